"""How many threads the CPU expert pool runs when `--cpu-threads` is not given (torch-free: autoconfig and the
operator read it too).

The pool's threads share the host with the engine's host loop (it queues the GPU's windows), CUDA's own threads and,
under `strata serve`, the HTTP server and its clients. A pool thread the OS takes off its core for one of them
holds up the pool's window, and so the GPU waiting for it: on an H100's 16-core host, 8 layers of Qwen3-30B-A3B's
shape with half the experts resident, one stream through the server got 45 tok/s with 16 pool threads, 90 with 14
and 135 with 12, where the in-process engine got 115-140 either way (docs/PERFORMANCE.md, "Experts beyond VRAM
through the server"). So a quarter of the cores, at most HOST_CORES and at least one, is left to the rest."""

from __future__ import annotations

import math
import os
from pathlib import Path

HOST_CORES = 4  # cores left, at the most, to the engine's host loop, CUDA's threads, the server and its clients
CGROUP = Path("/sys/fs/cgroup")


def usable_cores(cgroup: Path = CGROUP) -> int:
    """The CPUs this process may use: its affinity, within its container's CPU quota where it has one (a pod
    limited to 16 CPUs on a 128-core node sees 128 in its affinity)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = cgroup_cpus(cgroup / "cpu.max")
    return max(1, min(cores, quota)) if quota is not None else cores


def cgroup_number(path: Path) -> int | None:
    """A cgroup file's number; None where it is missing or says "max" (no limit)."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def cgroup_cpus(path: Path) -> int | None:
    """CPUs of the cgroup's quota: `cpu.max` ("150000 100000", or "max 100000"), or v1's cfs quota / period."""
    try:
        quota, period = path.read_text().split()[:2]
    except (OSError, ValueError):
        v1 = path.parent / "cpu"
        quota, period = cgroup_number(v1 / "cpu.cfs_quota_us"), cgroup_number(v1 / "cpu.cfs_period_us")
        return math.ceil(quota / period) if quota and period else None  # v1's -1 (no quota) reads as None
    return math.ceil(int(quota) / int(period)) if quota.isdigit() and period.isdigit() else None


def pool_threads(cores: int) -> int:
    """The pool's threads on a host whose process may use `cores` CPUs: all but a quarter of them (at most
    HOST_CORES, at least one core kept where there are two or more)."""
    if cores <= 1:
        return 1
    return cores - min(HOST_CORES, max(1, cores // 4))
