"""Stages: a model's layers split over devices, a window run through them in order, or pipelined by groups.

A stage is a layer range on one device with its weights and a worker thread that runs its share of each
window in order (the stage's "stream"). The embedding lives on the first stage and the head on the last; rows
cross from one stage to the next as a hidden-state tensor copied onto the next stage's device. A window is
either run synchronously through every stage (`__call__`), or launched (`launch`): each stage's worker takes
the window when the previous stage hands it over, so stage k runs group g while stage k+1 runs group g-1, and
the host thread never waits.

On GPUs each stage queues its work on a stream of its own, and nothing waits for more than it needs: a stage
starts after what the caller queued on its device's default stream (the window's inputs, state edits); the
hand-off copy runs on a side stream of the sender's device after an event recorded at the end of the
sender's share of this window only (a plain cross-device copy would wait for everything queued on the
sender's device, the next group's window included); the caller's default stream on the last device waits
for the window's end, so whoever reads the logits sees them finished.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable

import torch

from strata.errors import StrataError
from strata.model.spec import ModelSpec
from strata.model.weights import StageWeights
from strata.runtime.forward import Forward
from strata.runtime.window import Window, row_tensor

log = logging.getLogger("strata.engine")


def plan_stages(spec: ModelSpec, layer_split: str | None, device: torch.device, split_device: str | None = None,
                batch_groups: int = 1) -> list[tuple[range, torch.device]]:
    """Layer ranges and devices from `--layer-split` (counts like 12,12,12,12, or proportions like 0.6,0.4)."""
    n = spec.num_layers
    if device.type == "cuda" and device.index is None:  # a bare "cuda" is the current GPU
        device = torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)
    if not layer_split:
        if batch_groups > 1:
            raise StrataError(f"--batch-groups {batch_groups} needs --layer-split: groups pipeline through stages")
        return [(range(n), device)]
    try:
        parts = [p.strip() for p in layer_split.split(",") if p.strip()]
        values = [float(p) for p in parts]
    except ValueError:
        raise StrataError(f"--layer-split {layer_split!r}: expected numbers separated by commas, e.g. 12,12,12,12") from None
    if not values or any(v <= 0 for v in values):
        raise StrataError(f"--layer-split {layer_split!r}: every stage needs a positive share")
    if len(values) > n:
        raise StrataError(f"--layer-split {layer_split!r}: {len(values)} stages for a model of {n} layers")
    if any("." in p for p in parts):  # proportions
        bounds = [round(n * sum(values[: k + 1]) / sum(values)) for k in range(len(values))]
        counts = [b - a for a, b in zip([0, *bounds], bounds)]
        if any(c < 1 for c in counts):
            raise StrataError(f"--layer-split {layer_split!r}: a stage would get no layer of {n}")
    else:
        counts = [int(v) for v in values]
        if sum(counts) != n:
            raise StrataError(f"--layer-split {layer_split!r} covers {sum(counts)} layers; the model has {n}: "
                              "the counts must add up to the layer count (or give proportions such as 0.5,0.5)")
    if split_device is not None:
        devices = [torch.device(split_device)] * len(counts)
        if batch_groups > 1 and len(counts) > 1 and devices[0].type != "cpu":
            raise StrataError(f"--batch-groups {batch_groups} with every stage on {split_device}: groups pipeline "
                              "stages on different devices; two stages on one device would only take turns")
    elif device.type == "cuda":
        available = torch.cuda.device_count()
        if len(counts) > available:
            raise StrataError(f"--layer-split {layer_split!r} asks for {len(counts)} stages but {available} GPU(s) "
                              "are visible; use fewer stages or --split-device to put them on one device")
        devices = [torch.device("cuda", k) for k in range(len(counts))]
    else:  # the CPU: stages run on worker threads of one device (how the split and the groups are tested)
        devices = [device] * len(counts)
    starts = [sum(counts[:k]) for k in range(len(counts))]
    return [(range(s, s + c), d) for s, c, d in zip(starts, counts, devices)]


@dataclass
class Stage:
    index: int
    layers: range
    device: torch.device
    weights: StageWeights
    forward: Forward
    worker: ThreadPoolExecutor
    stream: "torch.cuda.Stream | None" = None  # where this stage's kernels queue (GPUs only)
    handoff: "torch.cuda.Stream | None" = None  # where its output is copied to the next stage's device

    def __post_init__(self):
        if self.device.type == "cuda" and self.stream is None:
            self.stream = torch.cuda.Stream(device=self.device)
            self.handoff = torch.cuda.Stream(device=self.device)

    @property
    def first(self) -> bool:
        return self.layers.start == 0


@dataclass
class Handoff:
    """A stage's output on its own device and, on a GPU, the event that marks it written."""

    x: torch.Tensor
    ready: "torch.cuda.Event | None" = None


class Pipeline:
    """The stages of one engine, run as one forward pass over a window."""

    def __init__(self, stages: list[Stage]):
        self.stages = stages
        for s in stages:
            log.info("stage %d: layers %d-%d on %s, %.2f GB of weights", s.index, s.layers.start, s.layers.stop - 1,
                     s.device, s.weights.nbytes() / 1e9)

    def _stage(self, stage: Stage, window: Window, sent: Handoff | None) -> Handoff:
        with torch.inference_mode():
            if stage.stream is None:  # the CPU
                x = None if sent is None else sent.x.to(stage.device, copy=True)  # the sender may reuse its buffer
                return Handoff(stage.forward.run_stage(window, x))
            torch.cuda.set_device(stage.device)
            with torch.cuda.stream(stage.stream):
                stage.stream.wait_stream(torch.cuda.default_stream(stage.device))  # the caller's inputs and edits
                window.record_stream(stage.stream)  # made on the default stream, read here
                x = None if sent is None else self._receive(stage, sent, self.stages[stage.index - 1])
                out = stage.forward.run_stage(window, x)
                ready = torch.cuda.Event()
                ready.record(stage.stream)
            return Handoff(out, ready)

    def _receive(self, stage: Stage, sent: Handoff, sender: Stage) -> torch.Tensor:
        """Copy what `sender` handed over (its output, or the last stage's sampled tokens) here once it is written
        (and not later), on the sender's hand-off stream."""
        if sender.handoff is None:  # from the CPU
            return sent.x.to(stage.device)
        if sender.device == stage.device:
            stage.stream.wait_event(sent.ready)
            sent.x.record_stream(stage.stream)
            return sent.x
        with torch.cuda.stream(sender.handoff):
            sender.handoff.wait_event(sent.ready)
            sent.x.record_stream(sender.handoff)  # read there: keep its memory until the copy is done
            return sent.x.to(stage.device, non_blocking=True)

    def _fed_tokens(self, stage: Stage, sent: Handoff, index: list[int] | None) -> torch.Tensor:
        """The first stage's input tokens from the last stage's sampled ones: copied like a hand-off, then picked."""
        if stage.stream is not None:
            torch.cuda.set_device(stage.device)
        with torch.cuda.stream(stage.stream) if stage.stream is not None else nullcontext():
            tokens = self._receive(stage, sent, self.stages[-1])
            return tokens if index is None else tokens[row_tensor(index, torch.int64, stage.device)]

    def _finish(self, last: Handoff) -> torch.Tensor:
        """The window's result, safe to use from the device's default stream (where callers work)."""
        if last.ready is not None:
            default = torch.cuda.default_stream(last.x.device)
            default.wait_event(last.ready)
            last.x.record_stream(default)
        return last.x

    def __call__(self, window: Window) -> torch.Tensor:
        sent = None
        for stage in self.stages:
            sent = self._stage(stage, window.on(stage.device), sent)
        return self._finish(sent)

    def launch(self, window: Window, tokens: Callable[[], tuple[Handoff, list[int] | None]] | None = None,
               then: Callable[[torch.Tensor], None] | None = None) -> Future:
        """Queue the window on every stage's worker in turn; the returned future holds its logits.

        `tokens`, when given, is called in the first stage's worker and returns the window's input tokens as the
        last stage handed them over (the tokens an earlier window sampled there: it may still be queued, the call
        waits for that) and which of them to take, in row order (None: all); `then` runs in the last stage's
        worker on the logits (sampling, without the host thread)."""
        future: Future | None = None
        last = len(self.stages) - 1
        for stage in self.stages:
            prev = future

            def work(st=stage, p=prev, local=window.on(stage.device)):  # row tensors made here, on the host thread
                if st.index == 0 and tokens is not None:
                    local = local.feed(self._fed_tokens(st, *tokens()))
                out = self._stage(st, local, p.result() if p else None)
                if st.index < last:
                    return out
                out = self._finish(out)
                if then is not None:
                    then(out)
                return out

            future = stage.worker.submit(work)
        return future
