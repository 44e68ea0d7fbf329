"""A window: a flat list of rows, each one token of one sequence at one position."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from strata.state.session import SessionState, StatePool


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
    tokens: torch.Tensor  # [R] int64
    positions: torch.Tensor  # [R] int64
    segments: list[Segment]
    logit_rows: torch.Tensor  # [N] int64: the rows whose next-token logits are wanted
    pool: StatePool | None = None  # the pool holding every segment's state, when they share one
    seq_ids: torch.Tensor | None = None  # [S] int32: each segment's index in `pool`

    @property
    def num_rows(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def is_decode(self) -> bool:
        """One row per sequence: the shape of a solo decode step and of a batch window."""
        return len(self.segments) == self.num_rows

    @classmethod
    def build(cls, parts: list[tuple[SessionState, list[int], bool]], device: torch.device) -> "Window":
        """parts: (state, token ids continuing that state, whether every row wants logits — else only the last)."""
        tokens, positions, segments, logit_rows = [], [], [], []
        row = 0
        for state, ids, all_logits in parts:
            state.reserve(len(ids))
            segments.append(Segment(state, row, row + len(ids), state.length))
            tokens += ids
            positions += range(state.length, state.length + len(ids))
            logit_rows += range(row, row + len(ids)) if all_logits else [row + len(ids) - 1]
            row += len(ids)
        as_tensor = lambda xs: torch.tensor(xs, dtype=torch.int64, device=device)  # noqa: E731
        pools = {id(s.state.pool): s.state.pool for s in segments}
        pool = next(iter(pools.values())) if len(pools) == 1 else None
        seq_ids = torch.tensor([s.state.index for s in segments], dtype=torch.int32, device=device)
        return cls(as_tensor(tokens), as_tensor(positions), segments, as_tensor(logit_rows), pool, seq_ids)

    def commit(self) -> None:
        """Every row was kept: advance each sequence past its rows."""
        tokens = self.tokens.tolist()
        for seg in self.segments:
            seg.state.length = seg.first_pos + seg.num_rows
            seg.state.tokens += tokens[seg.start : seg.stop]
