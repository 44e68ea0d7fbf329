"""The window's bitmask (one int32 row of ceil(V / 32) words per window row) and its application to logits."""

from __future__ import annotations

import sys
from typing import Sequence

import numpy as np
import torch

from strata.grammar.vocab import GrammarVocab

assert sys.byteorder == "little", "the bitmask is read a byte at a time, lowest byte first"
_FORBIDDEN = {torch.device("cpu"): ((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1) == 0}  # [256, 8]


def new_bitmask(rows: int, vocab: GrammarVocab, pinned: bool = False) -> torch.Tensor:
    """[rows, vocab.words] int32 on the CPU, every token allowed: a row nobody fills leaves its logits alone.
    `pinned` (logits on a GPU): in page-locked memory, which `apply_bitmask` sends up without a staging copy; then
    do not refill it once applied (make a new one for the next window)."""
    if pinned:
        return torch.empty((rows, vocab.words), dtype=torch.int32, pin_memory=True).fill_(-1)
    return torch.full((rows, vocab.words), -1, dtype=torch.int32)


class HostBitmask:
    """One host bitmask reused window after window (the engine's): pinned when the logits live on a GPU, so
    `apply_bitmask` sends it up without a staging copy, and refilled only once the device has read what it held.

        bitmask = host.take(rows)      # [rows, words], as the last window left them
        fill_bitmask(bitmask, [...]); apply_bitmask(logits, bitmask, [...]); host.sent()
    """

    def __init__(self, vocab: GrammarVocab, device: torch.device | str):
        self.vocab, self.device = vocab, torch.device(device)
        self._buffer: torch.Tensor | None = None
        self._read: "torch.cuda.Event | None" = None  # recorded after the last upload was queued

    def take(self, rows: int) -> torch.Tensor:
        if self._buffer is None or self._buffer.shape[0] < rows:
            self._buffer = new_bitmask(max(rows, 64), self.vocab, pinned=self.device.type == "cuda")
        elif self._read is not None:
            self._read.synchronize()  # the device has long read it in practice: a window ran in between
        return self._buffer[:rows]  # not cleared: fill the rows you apply (a fill writes each of its rows whole)

    def sent(self) -> None:
        """Call once the bitmask is applied: the next `take` waits for the device to have read it."""
        if self.device.type == "cuda":
            self._read = torch.cuda.Event()
            self._read.record()


def forbidden(bitmask: torch.Tensor, columns: int) -> torch.Tensor:
    """bool [rows, columns]: True where a token is not allowed (bit t % 32 of word t // 32 clear). Read a byte at a
    time through a 256-entry table: a quarter of the temporaries a 32-way shift makes."""
    table = _FORBIDDEN.get(bitmask.device)
    if table is None:
        table = _FORBIDDEN[bitmask.device] = _FORBIDDEN[torch.device("cpu")].to(bitmask.device)
    octets = bitmask.view(torch.uint8).view(-1).long()  # little-endian: octet k holds tokens 8k .. 8k+7
    return table.index_select(0, octets).view(bitmask.shape[0], -1)[:, :columns]


def allowed_tokens(bitmask: torch.Tensor, row: int, columns: int | None = None) -> torch.Tensor:
    """The allowed token ids of one row, int64 [n], counted on the host (for tests and debugging)."""
    bits = np.unpackbits(bitmask[row].cpu().numpy().view(np.uint8), bitorder="little")[:columns]
    return torch.from_numpy(np.flatnonzero(bits))


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int] | None = None) -> None:
    """Set to -inf, in place, the logits of tokens the bitmask forbids, in the constrained `rows` only (None: every
    row); other rows are not touched, bit for bit. logits [R, V] (V may be narrower or wider than the tokenizer:
    only the bitmask's first V columns are read); bitmask [R, words], on the CPU or on the logits' device.

    On a GPU nothing waits for the device: the constrained rows' masks go up through pinned memory from torch's
    caching host allocator (not reused before the copy has run) with a non-blocking copy, and the fill runs on the
    logits' stream."""
    if logits.dim() != 2 or bitmask.dim() != 2 or bitmask.shape[0] != logits.shape[0]:
        raise ValueError(f"logits [R, V] and bitmask [R, words] expected; got {tuple(logits.shape)} and "
                         f"{tuple(bitmask.shape)}")
    if bitmask.shape[1] * 32 < logits.shape[1]:
        raise ValueError(f"a bitmask of {bitmask.shape[1]} words covers {bitmask.shape[1] * 32} tokens, "
                         f"not the logits' {logits.shape[1]}")
    if rows is not None and len(rows) == 0:
        return
    if rows is None:
        logits.masked_fill_(forbidden(_to(bitmask, logits.device), logits.shape[1]), float("-inf"))
    elif logits.device.type == "cpu":
        _apply_row_by_row(logits, bitmask, rows)
    else:
        _apply_gathered(logits, bitmask, rows)


def _apply_row_by_row(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    """In place, one row at a time (the CPU: no gathered copies)."""
    for row in (rows.tolist() if isinstance(rows, torch.Tensor) else rows):
        logits[row].masked_fill_(forbidden(bitmask[row:row + 1].cpu(), logits.shape[1])[0], float("-inf"))


def _apply_gathered(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    """On a GPU: the whole bitmask and the row list go up without waiting (the bitmask's words are few next to the
    logits), and one kernel masks the listed rows in place (`strata.kernels.bitmask`)."""
    from strata.kernels.bitmask import apply_bitmask_triton

    index = rows if isinstance(rows, torch.Tensor) else torch.tensor(rows, dtype=torch.int32)
    apply_bitmask_triton(logits, _to(bitmask.contiguous(), logits.device), _to(index.int(), logits.device))


def _to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if t.device == device:
        return t
    if device.type == "cuda" and t.device.type == "cpu":
        # a pinned tensor goes up as it is (`new_bitmask(pinned=True)`: torch's caching host allocator does not
        # hand its memory out again before the copy has run); any other through a pinned copy of our own, since
        # the caller may refill its tensor as soon as we return
        staged = t if t.is_pinned() else torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t)
        return staged.to(device, non_blocking=True)
    return t.to(device)
