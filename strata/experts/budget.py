"""`--expert-budget-gb`: checked against the stages' experts, turned into each stage's residency, and logged.

A budget below a stage's experts is honoured: the stage keeps an equal share of each MoE layer's experts on
its device and the CPU pool computes the rest (`strata.experts.residency`). Refused, with the numbers: a count
of values that is neither one nor one per stage, a negative or non-finite value, and a budget that leaves more
experts in host RAM than the host has available.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import torch

from strata.errors import StrataError
from strata.experts.residency import StageResidency, plan_residency
from strata.experts.threads import pool_threads, usable_cores
from strata.model.spec import ModelSpec

log = logging.getLogger("strata.engine")


def host_available_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (None where it cannot be read)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_expert_budget(spec: ModelSpec, plan: list[tuple[range, torch.device]], budget_gb: list[float] | None,
                        dtype_bytes: int, host_available: int | None = None,
                        packed_bytes: int | None = None) -> list[StageResidency]:
    """Each stage's residency under `budget_gb` (one value for every stage, or one per stage; None: no budget,
    every expert resident). `host_available`: bytes of RAM the experts left to the host may take (default: the
    host's MemAvailable); a stage on the CPU itself takes none, its experts are in RAM either way. `packed_bytes`:
    one expert's bytes on a GPU stage that keeps quantized weights packed (None: plain): the budget holds as many
    experts as fit at that size (autoconfig counts the same packed sizes)."""
    if budget_gb is not None:
        if len(budget_gb) not in (1, len(plan)):
            raise StrataError(f"--expert-budget-gb has {len(budget_gb)} values for {len(plan)} stage(s): give one "
                              f"value for every stage or one per stage (e.g. {','.join(['10'] * len(plan))})")
        bad = [v for v in budget_gb if not math.isfinite(v) or v < 0]
        if bad:
            raise StrataError(f"--expert-budget-gb {bad[0]}: a budget is a number of GB, 0 or more (0 keeps every "
                              "routed expert in host RAM)")
    stages = []
    for k, (layers, device) in enumerate(plan):
        budget = None if budget_gb is None else budget_gb[k if len(budget_gb) > 1 else 0] * 1e9
        res = plan_residency(spec, layers, device, budget, dtype_bytes,
                             packed_bytes if device.type == "cuda" else None)
        stages.append(res)
        if budget is not None and res.resident:
            log.info("stage %d (%s): %d of %d routed experts resident in each of its %d MoE layers: %.2f GB on the "
                     "device, %.2f GB in host RAM for the CPU pool", k, device, res.per_layer, res.num_experts,
                     len(res.resident), res.device_bytes / 1e9, res.host_bytes / 1e9)
    to_host = sum(r.host_bytes for r in stages if r.device.type != "cpu")
    available = host_available if host_available is not None else host_available_bytes()
    if to_host and available is not None and to_host > available:
        raise StrataError(
            f"--expert-budget-gb leaves {to_host / 1e9:.1f} GB of routed experts in host RAM for the CPU pool, but "
            f"the host has {available / 1e9:.1f} GB available: raise the budget, split the layers over more GPUs, "
            "or free host memory")
    return stages


def set_pool_threads(cpu_threads: int | None, stages: list[StageResidency]) -> None:
    """`--cpu-threads`: torch's CPU threads, for the whole engine process, when a stage has a pool (on a GPU the
    engine does no other CPU arithmetic); left alone otherwise. Not given, with a pool beside a GPU:
    `threads.pool_threads` of the cores this process may use (a few are left to the host loop, CUDA and the
    server)."""
    if cpu_threads is not None and cpu_threads < 1:
        raise StrataError(f"--cpu-threads {cpu_threads}: the CPU expert pool needs at least 1 thread")
    if cpu_threads is None and any(r.pooled and r.device.type == "cuda" for r in stages):
        cpu_threads = pool_threads(usable_cores())
    if cpu_threads is not None and any(r.pooled for r in stages):
        torch.set_num_threads(cpu_threads)
