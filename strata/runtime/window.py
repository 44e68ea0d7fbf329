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
    keep: bool = False  # a drafted row: keep the Gated DeltaNet states after it (`SessionState.kept`), for a rollback

    @property
    def num_rows(self) -> int:
        return self.stop - self.start


@dataclass
class Window:
    tokens: torch.Tensor | None  # [R] int64; None until fed (its first `fed` rows' tokens are still being sampled)
    positions: torch.Tensor  # [R] int64
    segments: list[Segment]
    logit_rows: torch.Tensor  # [N] int64: the rows whose next-token logits are wanted
    pool: StatePool | None = None  # the pool holding every segment's state, when they share one
    seq_ids: torch.Tensor | None = None  # [S] int32: each segment's index in `pool`
    host: tuple[list[int], ...] | None = None  # tokens (0 for fed rows), positions, logit rows, seq ids, keep slots
    fed: int = 0  # leading rows whose tokens come from the device (`feed`)
    tail: torch.Tensor | None = None  # with `fed`: the other rows' tokens, on the device
    # [R] int32: the pool's keep slot each row leaves its GDN states in (-1 none), when the pool has keep slots
    # (drafts on the Triton decode kernels); its host list is `host[4]`
    keep_idx: torch.Tensor | None = None

    @property
    def num_rows(self) -> int:
        return int(self.positions.shape[0])

    @property
    def is_decode(self) -> bool:
        """One row per sequence: the shape of a decode window."""
        return len(self.segments) == self.num_rows

    @classmethod
    def build(cls, parts: list[tuple[SessionState, list[int], bool | None]], device: torch.device,
              fed: int = 0) -> "Window":
        """parts: (state, token ids continuing that state, which rows want logits: True every row, False the last
        row, None none — a prompt chunk that is not its prompt's last; "apart": every row, each row a segment of
        its own — a drafting slot's last token and its drafts, run as decode rows one position after another),
        and optionally `apart` (True: each row a segment of its own, as decode rows, whichever rows want logits —
        a short prompt chunk run with the decode rows).
        `fed`: the first so many rows take their tokens from the device (sampled by the window before; `feed`):
        their ids here only count the rows, and `tokens` stays None until the caller feeds them."""
        tokens, positions, segments, logit_rows, keep = [], [], [], [], []
        row = 0
        for state, ids, all_logits, *apart in parts:
            state.reserve(len(ids))
            if all_logits == "apart":
                # the GDN states after each row but the last (in the pool's keep slots, else copied by `Forward`)
                slots = state.take_keep_slots(len(ids) - 1)
                if slots is not None:
                    keep += [(row + j, slot) for j, slot in enumerate(slots)]
                segments += [Segment(state, row + j, row + j + 1, state.length + j,
                                     keep=bool(state.conv) and slots is None) for j in range(len(ids))]
                if slots is None:
                    state.release_kept()
                all_logits = True
            elif apart and apart[0]:
                segments += [Segment(state, row + j, row + j + 1, state.length + j) for j in range(len(ids))]
            else:
                segments.append(Segment(state, row, row + len(ids), state.length))
            tokens += ids
            positions += range(state.length, state.length + len(ids))
            if all_logits is not None:
                logit_rows += range(row, row + len(ids)) if all_logits else [row + len(ids) - 1]
            row += len(ids)
        as_tensor = lambda xs: row_tensor(xs, torch.int64, device)  # noqa: E731
        pools = {id(s.state.pool): s.state.pool for s in segments}
        pool = next(iter(pools.values())) if len(pools) == 1 else None
        seq_list = [s.state.index for s in segments]
        tail = as_tensor(tokens[fed:]) if fed and len(tokens) > fed else None
        keep_list = None
        if keep and pool is None:
            raise RuntimeError("drafted rows that keep their GDN states must share one pool with the window's rows")
        if pool is not None and pool.keep_conv:  # every window of such a pool carries them (one graph per row count)
            keep_list = [-1] * row
            for r, slot in keep:
                keep_list[r] = slot
        return cls(None if fed else as_tensor(tokens), as_tensor(positions), segments, as_tensor(logit_rows), pool,
                   row_tensor(seq_list, torch.int32, device), (tokens, positions, logit_rows, seq_list, keep_list), fed,
                   tail, None if keep_list is None else row_tensor(keep_list, torch.int32, device))

    def feed(self, tokens: torch.Tensor) -> "Window":
        """This window with its first `fed` rows' tokens given (on the device), the others' appended."""
        return replace(self, tokens=tokens if self.tail is None else torch.cat([tokens, self.tail]))

    def on(self, device: torch.device) -> "Window":
        """This window with its row tensors on `device`, copied from the host (for a stage on another device:
        copying them from the first device would make that stage wait for whatever that device is running)."""
        if self.host is None or self.positions.device == device:
            return self
        tokens, positions, logit_rows, seq_ids, keep = self.host
        as_tensor = lambda xs: row_tensor(xs, torch.int64, device)  # noqa: E731
        tail = as_tensor(tokens[self.fed:]) if self.tail is not None else None
        return replace(self, tokens=None if self.fed else as_tensor(tokens), positions=as_tensor(positions),
                       logit_rows=as_tensor(logit_rows), seq_ids=row_tensor(seq_ids, torch.int32, device), tail=tail,
                       keep_idx=None if keep is None else row_tensor(keep, torch.int32, device))

    def split(self) -> tuple["Window", "Window"] | None:
        """A mixed window as (its leading one-row segments, the rest), each a window of its own over the same row
        tensors (views); None when the window is all one kind. The first part runs as a decode window (row-
        invariant, a CUDA graph on the GPU), the second as a prompt window. Callers keep the one-row segments first (`Slots` builds windows so)."""
        k = next((j for j, s in enumerate(self.segments) if s.num_rows != 1), len(self.segments))
        if k == 0 or k == len(self.segments):
            return None
        r = k  # one row per leading segment
        rest = [Segment(s.state, s.start - r, s.stop - r, s.first_pos) for s in self.segments[k:]]
        host_logits = self.host[2]
        tokens = (None, None) if self.tokens is None else (self.tokens[:r], self.tokens[r:])
        decode = Window(tokens[0], self.positions[:r], self.segments[:k],
                        row_tensor([j for j in host_logits if j < r], torch.int64, self.positions.device), self.pool,
                        self.seq_ids[:k], keep_idx=None if self.keep_idx is None else self.keep_idx[:r])
        prompt_logits = [j - r for j in host_logits if j >= r]
        prompt = Window(tokens[1], self.positions[r:], rest,
                        row_tensor(prompt_logits, torch.int64, self.positions.device), self.pool, self.seq_ids[k:])
        return decode, prompt

    def record_stream(self, stream: "torch.cuda.Stream") -> None:
        """The row tensors on `stream`'s device are read there: keep their memory from being reused by the stream
        that made them until `stream` has run what is queued now (the caching allocator otherwise hands a freed
        block to the next tensor made on that stream, and a later window's inputs would overwrite this one's)."""
        for t in (self.tokens, self.positions, self.logit_rows, self.seq_ids, self.tail, self.keep_idx):
            if t is not None and t.device == stream.device:
                t.record_stream(stream)

    def commit(self) -> None:
        """Every row was kept: advance each sequence past its rows (a window built with every token on the host)."""
        tokens = self.host[0]
        for seg in self.segments:
            seg.state.length = seg.first_pos + seg.num_rows
            seg.state.tokens += tokens[seg.start : seg.stop]
