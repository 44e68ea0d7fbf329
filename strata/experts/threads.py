"""How many threads the CPU expert pool runs when `--cpu-threads` is not given (torch-free: autoconfig and the
operator read it too).

The pool's threads share the host with the engine's host loop (it queues the GPU's windows), CUDA's own threads and,
under `strata serve`, the HTTP server and its clients. A pool thread the OS takes off its core for one of them
holds up the pool's window, and so the GPU waiting for it: on an H100's 16-core host, 8 layers of Qwen3-30B-A3B's
shape with half the experts resident, one stream through the server got 45 tok/s with 16 pool threads, 90 with 14
and 135 with 12, where the in-process engine got 115-140 either way (docs/PERFORMANCE.md, "Experts beyond VRAM
through the server"). So a quarter of the cores, at most HOST_CORES and at least one, is left to the rest."""

from __future__ import annotations

import os

HOST_CORES = 4  # cores left, at the most, to the engine's host loop, CUDA's threads, the server and its clients


def usable_cores() -> int:
    """The CPUs this process may run on (its affinity)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def pool_threads(cores: int) -> int:
    """The pool's threads on a host whose process may use `cores` CPUs: all but a quarter of them (at most
    HOST_CORES, at least one core kept where there are two or more)."""
    if cores <= 1:
        return 1
    return cores - min(HOST_CORES, max(1, cores // 4))
