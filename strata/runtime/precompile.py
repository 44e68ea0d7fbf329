"""Triton kernels compiled in parallel while the weights load, so the warm-up before `READY` finds them compiled.

On a machine whose Triton cache is cold, almost all of the warm-up is compilation: about 90 kernel variants,
each compiled on one core (the thirteenth and fifteenth sessions measured 72 of the 81 s of a 24-layer warm-up on
an H200 as compilation; the same warm-up on a warm cache took 9 s). Compilation depends on the kernels' shapes and
specializations, not on the weights' values or on how many layers there are. So before it loads the weights, the
engine starts compile workers: processes that each build the same model cut to one layer of each kind, with
random weights, the same slots, cells and window budget, and run their share of the warm-up's items
(`strata.runtime.warmup.warm_up(share=...)`). What they compile lands in Triton's on-disk cache, where the
warm-up that follows finds it. A worker that fails costs nothing but time: the warm-up compiles whatever is not
in the cache, as it would without workers.

Workers run only for one-stage engines on a GPU with the Triton kernels and no CPU expert pool (the other setups
warm up as before). Each worker takes GPU memory (its one-layer model, the slots' cells for its attention layer,
a CUDA context); their number is bounded by the cores, by `--compile-workers`, and by the memory the card has
beside the model.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import time
from dataclasses import dataclass, replace

import torch

from strata.model.spec import ModelSpec

log = logging.getLogger("strata.engine")

CONTEXT_BYTES = 1 << 30  # a worker's CUDA context, activations and graph memory, beside its weights and cells
MAX_WORKERS = 8


Plan = dict[int, dict[str, str]]  # per layer, its packed weights' formats (`ModelFiles.packed_plan`)


def kind_layers(spec: ModelSpec, plan: Plan | None = None) -> list[int]:
    """The first layer of each (mixer, MLP) kind, in model order; with a `plan`, of each kind and set of packed
    formats (a kernel is compiled per format: llama.cpp's mixes give layers of one kind several)."""
    kinds, keep = set(), []
    for i, layer in enumerate(spec.layers):
        kind = (layer.mixer, layer.mlp, tuple(sorted((plan or {}).get(i, {}).items())))
        if kind not in kinds:
            kinds.add(kind)
            keep.append(i)
    return keep


def layer_kinds(spec: ModelSpec, plan: Plan | None = None) -> ModelSpec:
    """The spec cut to `kind_layers`: the kernels of a window over these layers are the kernels of a window over
    all of them."""
    return replace(spec, layers=tuple(spec.layers[i] for i in kind_layers(spec, plan)))


def worker_bytes(spec: ModelSpec, num_slots: int, max_cells: int, dtype: torch.dtype) -> int:
    """GPU memory one compile worker takes: its cut model's weights, its slots' cells and state, a context."""
    from autoconfig.facts import model_facts_from_spec

    size = torch.tensor([], dtype=dtype).element_size()
    facts = model_facts_from_spec(layer_kinds(spec), bytes_per_param=size)
    return facts.weight_bytes + facts.state_bytes(None, max_cells, num_slots) + CONTEXT_BYTES


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


@dataclass(frozen=True)
class Job:
    """What a worker needs to run the warm-up's windows at the engine's shapes."""

    spec: ModelSpec
    device: str
    dtype: torch.dtype
    max_cells: int
    max_window_tokens: int
    num_slots: int
    lookahead: int
    kernels: str = "triton"
    layers: tuple = ()  # the model's layers the cut model keeps (`kind_layers`; empty: one of each kind)
    formats: tuple = ()  # per layer of the cut model, its packed weights' (name, format) pairs
    head_format: str | None = None


def _work(job: Job, share: tuple[int, int]) -> None:
    """One worker: the cut model with random weights (packed as the model's are), the same slots, its share of
    the warm-up."""
    import sys

    os.dup2(2, 1)  # the engine's standard output is the protocol: nothing of a worker's may reach it
    sys.stdout = sys.stderr
    from strata.model.random_weights import random_stage_weights
    from strata.runtime.generate import Engine
    from strata.runtime.warmup import warm_up

    spec = replace(job.spec, layers=tuple(job.spec.layers[i] for i in job.layers)) if job.layers else layer_kinds(job.spec)
    device = torch.device(job.device)
    if device.type == "cuda":
        if device.index is None:  # "cuda": the process's current card, as the engine's own tensors take it
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    weights = lambda layers, dev, trim: _packed_as(random_stage_weights(spec, layers, dev, job.dtype), job)  # noqa: E731
    engine = Engine(None, spec=spec, weights=weights, device=device, dtype=job.dtype, max_cells=job.max_cells,
                    max_window_tokens=job.max_window_tokens, park_gb=0, lookahead=job.lookahead, kernels=job.kernels)
    warm_up(engine.init_slots(job.num_slots), progress=lambda done, what: None, share=share)


def _packed_as(weights, job: Job):
    """Random weights quantized and packed where the model's are, so the packed kernels' variants compile."""
    from strata.quant.online import quantize_weight

    for j, pairs in enumerate(job.formats):
        for key, fmt in pairs:
            weights.layers[j][key] = quantize_weight(weights.layers[j][key], fmt, job.dtype)
    if job.head_format is not None and weights.lm_head is not None:
        weights.lm_head = quantize_weight(weights.lm_head, job.head_format, job.dtype)
    return weights


class CompileWorkers:
    """Compile workers started now; `wait` before the warm-up."""

    def __init__(self, job: Job, count: int):
        self.started = time.perf_counter()
        context = multiprocessing.get_context("spawn")  # a fresh interpreter: no CUDA state inherited
        self.procs = [context.Process(target=_work, args=(job, (k, count)), name=f"strata-compile-{k}", daemon=True)
                      for k in range(count)]
        for p in self.procs:
            p.start()
        log.info("compiling kernels in %d worker process(es) while the weights load", count)

    def wait(self) -> float:
        """Until every worker has ended; the seconds since they started. A worker that failed is logged."""
        for p in self.procs:
            p.join()
        took = time.perf_counter() - self.started
        failed = [p.name for p in self.procs if p.exitcode != 0]
        if failed:
            log.warning("compile worker(s) %s ended with an error (see above); the warm-up compiles what they "
                        "did not", ", ".join(failed))
        log.info("compile workers done in %.1f s", took)
        return took


def start_compile_workers(spec: ModelSpec, *, device: torch.device, dtype: torch.dtype, kernels: str, max_cells: int,
                          max_window_tokens: int, num_slots: int, lookahead: int, single_stage: bool,
                          workers: int | None = None,
                          plan: tuple[Plan, str | None] | None = None,
                          model_bytes: int | None = None) -> CompileWorkers | None:
    """Compile workers for an engine about to load `spec`, or None where they would not help or fit: not a GPU,
    not the Triton kernels, several stages or CPU experts (`single_stage` False), `workers` 0, or too little
    GPU memory beside the model for even two of them. `plan`: the weights the engine keeps packed
    (`ModelFiles.packed_plan`), which the workers' random weights copy. `model_bytes`: what the engine's weights
    will take on the device (default: `spec`'s at `dtype`; a packed model takes less)."""
    if device.type != "cuda" or kernels == "torch" or not single_stage or workers == 0:
        return None
    from autoconfig.facts import model_facts_from_spec

    size = torch.tensor([], dtype=dtype).element_size()
    model = model_bytes if model_bytes is not None else model_facts_from_spec(spec, bytes_per_param=size).weight_bytes
    free, _ = torch.cuda.mem_get_info(device)
    each = worker_bytes(spec, num_slots, max_cells, dtype)
    room = int((free - model) * 0.9) // each
    count = min(workers or MAX_WORKERS, usable_cores() - 1, room)
    if count < 2:
        log.info("no compile workers: %s", f"{usable_cores()} core(s)" if usable_cores() < 3 else
                 f"{free / 2**30:.1f} GiB free on {device}, the model needs {model / 2**30:.1f} and each worker "
                 f"{each / 2**30:.1f}")
        return None
    lookahead = (1 if device.type == "cuda" else 0) if lookahead is None else lookahead
    layers, head = plan if plan is not None else ({}, None)
    keep = tuple(kind_layers(spec, layers))
    formats = tuple(tuple(sorted(layers.get(i, {}).items())) for i in keep)
    job = Job(spec, str(device), dtype, max_cells, max_window_tokens, num_slots, lookahead, layers=keep,
              formats=formats, head_format=head)
    return CompileWorkers(job, count)
