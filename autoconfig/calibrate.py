"""`--calibrate`: measure the rules' top candidates on this machine and keep the fastest.

Each candidate loads the model with its settings (an engine is reused by candidates that differ only in slots),
fills min(concurrency, batch) slots with a short prompt, reads the prompts, and times a few decode windows. The figure is total tokens/s over the conversations decoded at once. strata and torch
are imported here, lazily: the rules stay pure.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass
from typing import Any, Callable

from autoconfig.rules import Proposal

# settings a single-device Engine does not take: passed by name where this build's Engine accepts them
SPLIT_KEYS = ("layer_split", "split_device", "trim_stage_weights", "expert_budget_gb", "cpu_threads", "pcie_frac")
SLOT_KEYS = ("batch_groups",)  # taken by `init_slots`: candidates that differ only in these share an engine


class Unmeasurable(Exception):
    """This build cannot run a candidate (e.g. its Engine has no layer split yet); the table says why."""


@dataclass
class Measurement:
    proposal: Proposal
    tokens_per_s: float | None = None
    conversations: int = 0
    note: str = ""


def build_engine(model: str, settings: dict[str, Any]):
    """An Engine for `settings` (EngineSettings keys), through EngineSettings so the values are checked as
    `strata serve` checks them."""
    from strata.config import EngineSettings
    from strata.runtime.generate import Engine

    s = EngineSettings(**{**settings, "model": model})
    accepted = inspect.signature(Engine.__init__).parameters
    options = s.stage_options()  # as `strata serve` passes them (e.g. expert_budget_gb "10,12" -> [10.0, 12.0])
    extra = {k: options.get(k, getattr(s, k)) for k in SPLIT_KEYS if getattr(s, k) not in (None, False)}
    missing = [k for k in extra if k not in accepted]
    if missing:
        raise Unmeasurable(f"this build's engine takes no {', '.join('--' + k.replace('_', '-') for k in missing)}")
    return Engine(s.open_model(), device=s.torch_device(), dtype=s.torch_dtype(), max_cells=s.max_cells,
                  max_window_tokens=s.max_window_tokens, kernels=s.kernels, cuda_graphs=s.cuda_graphs, **extra)


def calibrate(model: str, proposals: list[Proposal], concurrency: int, windows: int = 8, prompt_len: int = 16,
              build: Callable[[str, dict], Any] = build_engine) -> list[Measurement]:
    """Measure each proposal in turn (the engine of one is freed before the next loads)."""
    out: list[Measurement] = []
    engine, engine_key = None, None
    for proposal in proposals:
        m = Measurement(proposal)
        out.append(m)
        key = {k: v for k, v in proposal.settings.items() if k not in ("batch", "batch_groups")}
        try:
            if key != engine_key:
                engine = engine_key = None
                _free_gpu_memory()
                engine, engine_key = build(model, proposal.settings), key
            m.tokens_per_s, m.conversations = _measure(engine, proposal.settings, concurrency, windows, prompt_len)
        except Unmeasurable as e:
            m.note = str(e)
        except Exception as e:  # out of memory, say: that candidate loses, the others still run
            m.note = f"failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return out


def fastest(measurements: list[Measurement]) -> Measurement | None:
    measured = [m for m in measurements if m.tokens_per_s is not None]
    return max(measured, key=lambda m: m.tokens_per_s) if measured else None


def table(measurements: list[Measurement]) -> str:
    best = fastest(measurements)
    rows = ["  candidate                                         conversations   tokens/s"]
    for m in measurements:
        mark = "*" if m is best else " "
        speed = f"{m.tokens_per_s:10.1f}" if m.tokens_per_s is not None else f"{'-':>10}"
        rows.append(f"{mark} {m.proposal.label:<50}{m.conversations:>13}  {speed}  {m.note}".rstrip())
    return "\n".join(rows)


def _measure(engine, settings: dict, concurrency: int, windows: int, prompt_len: int) -> tuple[float, int]:
    import torch

    vocab, cells = engine.spec.vocab_size, engine.max_cells
    prompt_len = max(1, min(prompt_len, cells - windows - 4))
    if prompt_len + windows + 4 > cells:
        raise Unmeasurable(f"max_cells {cells} is too short for {windows} windows")
    prompt = lambda seed: [1 + (seed * 7919 + i * 104729) % (vocab - 1) for i in range(prompt_len)]  # noqa: E731
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    batch = settings["batch"]
    accepted = inspect.signature(engine.init_slots).parameters
    extra = {k: settings[k] for k in SLOT_KEYS if settings.get(k, 1) != 1}
    missing = [k for k in extra if k not in accepted]
    if missing:
        raise Unmeasurable(f"this build's slots take no {', '.join('--' + k.replace('_', '-') for k in missing)}")
    slots = engine.init_slots(batch, **extra)  # lookahead: the engine's default, as in `strata engine`
    active = min(concurrency, batch)
    for s in range(active):
        slots.admit(s, prompt(s), windows + 4, stop_ids=frozenset())
    while slots.reading:  # the prompts, read in the first windows
        slots.step()
    for _ in range(len(slots.groups)):  # warm up: every group's first decoding window
        slots.step()
    sync()
    start, rows = time.perf_counter(), 0
    while rows < active * windows and (slots.active or slots.in_flight):  # stepped as the engine process steps
        rows += len(slots.step())
    sync()
    elapsed = time.perf_counter() - start
    slots.flush()
    return rows / elapsed, active


def _free_gpu_memory() -> None:
    import gc

    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except ImportError:
        pass
