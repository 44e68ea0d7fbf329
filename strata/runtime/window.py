"""A window: a flat list of rows, each one token of one sequence at one position."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from strata.state.session import SessionState, StatePool


def row_tensor(values: list, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A small per-row tensor on `device`. On a GPU it is copied from pinned memory without waiting: a copy
    from ordinary host memory would wait for everything queued on the device's stream, so building the next
    group's window would wait for the window another stage is still running (pipelined groups)."""
    t = torch.tensor(values, dtype=dtype)
    if torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def host_copy(t: torch.Tensor) -> tuple[torch.Tensor, "torch.cuda.Event | None"]:
    """`t` on its way to host memory without waiting: a pinned copy and the event to synchronize on before reading
    it (queued on the current stream of `t`'s device). On the CPU, `t` itself and no event."""
    if t.device.type != "cuda":
        return t, None
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record(torch.cuda.current_stream(t.device))
    return host, ready


@dataclass
class Segment:
    """The rows [start, stop) of a window: consecutive positions of one sequence, from `first_pos`."""

    state: SessionState
    start: int
    stop: int
    first_pos: int

    @property
    def num_rows(self) -> int:
        return self.stop - self.start


@dataclass
class Window:
    tokens: torch.Tensor | None  # [R] int64; None until fed (a batch window whose tokens are still being sampled)
    positions: torch.Tensor  # [R] int64
    segments: list[Segment]
    logit_rows: torch.Tensor  # [N] int64: the rows whose next-token logits are wanted
    pool: StatePool | None = None  # the pool holding every segment's state, when they share one
    seq_ids: torch.Tensor | None = None  # [S] int32: each segment's index in `pool`
    host: tuple[list[int] | None, ...] | None = None  # tokens (None: on the device only), positions, logit rows, seq ids

    @property
    def num_rows(self) -> int:
        return int(self.positions.shape[0])

    @property
    def is_decode(self) -> bool:
        """One row per sequence: the shape of a solo decode step and of a batch window."""
        return len(self.segments) == self.num_rows

    @classmethod
    def build(cls, parts: list[tuple[SessionState, list[int], bool]], device: torch.device,
              fed: bool = False) -> "Window":
        """parts: (state, token ids continuing that state, whether every row wants logits — else only the last).
        `fed`: the rows' tokens are on the device only (sampled by the window before): the ids just count the rows,
        and `tokens` stays None until the caller sets it."""
        tokens, positions, segments, logit_rows = [], [], [], []
        row = 0
        for state, ids, all_logits in parts:
            state.reserve(len(ids))
            segments.append(Segment(state, row, row + len(ids), state.length))
            tokens += ids
            positions += range(state.length, state.length + len(ids))
            logit_rows += range(row, row + len(ids)) if all_logits else [row + len(ids) - 1]
            row += len(ids)
        as_tensor = lambda xs: row_tensor(xs, torch.int64, device)  # noqa: E731
        pools = {id(s.state.pool): s.state.pool for s in segments}
        pool = next(iter(pools.values())) if len(pools) == 1 else None
        seq_list = [s.state.index for s in segments]
        host_tokens = None if fed else tokens
        return cls(None if fed else as_tensor(tokens), as_tensor(positions), segments, as_tensor(logit_rows), pool,
                   row_tensor(seq_list, torch.int32, device), (host_tokens, positions, logit_rows, seq_list))

    def on(self, device: torch.device) -> "Window":
        """This window with its row tensors on `device`, copied from the host (for a stage on another device:
        copying them from the first device would make that stage wait for whatever that device is running)."""
        if self.host is None or self.positions.device == device:
            return self
        tokens, positions, logit_rows, seq_ids = self.host
        as_tensor = lambda xs: row_tensor(xs, torch.int64, device)  # noqa: E731
        return replace(self, tokens=self.tokens if tokens is None else as_tensor(tokens), positions=as_tensor(positions),
                       logit_rows=as_tensor(logit_rows), seq_ids=row_tensor(seq_ids, torch.int32, device))

    def record_stream(self, stream: "torch.cuda.Stream") -> None:
        """The row tensors on `stream`'s device are read there: keep their memory from being reused by the stream
        that made them until `stream` has run what is queued now (the caching allocator otherwise hands a freed
        block to the next tensor made on that stream, and a later window's inputs would overwrite this one's)."""
        for t in (self.tokens, self.positions, self.logit_rows, self.seq_ids):
            if t is not None and t.device == stream.device:
                t.record_stream(stream)

    def commit(self) -> None:
        """Every row was kept: advance each sequence past its rows."""
        tokens = self.host[0] if self.host is not None and self.host[0] is not None else self.tokens.tolist()
        for seg in self.segments:
            seg.state.length = seg.first_pos + seg.num_rows
            seg.state.tokens += tokens[seg.start : seg.stop]
