"""One sequence's place in its grammar: the next-token mask, tokens accepted, rolled back (drafts), the end."""

from __future__ import annotations

import os

import llguidance
import torch

from strata.errors import StrataError
from strata.grammar.compile import CompiledGrammar

_executor: llguidance.LLExecutor | None = None


class GrammarMatcher:
    """Per sequence. The engine, each window: `fill(bitmask, row)` (or `fill_bitmask` for all rows at once), apply
    the bitmask to the logits, sample, `accept(token)`; after it `is_finished()` says the grammar has ended (the
    answer ends there, as at a stop token). Stop tokens (the vocabulary's `stop_ids`, EOS among them) are allowed
    by the mask exactly where the grammar may end; accepting one finishes the matcher. A token the grammar refuses
    (never one sampled under the mask) returns False and leaves the matcher failed for good (`error` says why; its
    mask then allows only the stop tokens)."""

    def __init__(self, compiled: CompiledGrammar):
        self.compiled = compiled
        self._matcher = compiled.template.deep_copy()
        self.accepted = 0  # tokens accepted and not rolled back

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]` (bit t of word t // 32 set: token t allowed)."""
        _check(bitmask, self.compiled.vocab.words)
        view = bitmask[row]
        self._matcher.unsafe_compute_mask_ptr(view.data_ptr(), view.numel() * 4)

    def accept(self, token: int) -> bool:
        """Move past `token`; False if the grammar refuses it. A stop token accepted once the grammar has finished
        changes nothing (it is not a step to roll back)."""
        finished = self.is_finished()
        ok = self._matcher.consume_token(token)
        self.accepted += ok and not finished
        return ok

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens` (drafts, say) the grammar accepts in a row from here; the matcher does not move."""
        return self._matcher.validate_tokens(tokens)

    def rollback(self, n: int) -> None:
        """Undo the last `n` accepted tokens (rejected drafts); a finished matcher comes back too. Not from a failed
        matcher."""
        if not 0 <= n <= self.accepted:
            raise ValueError(f"cannot roll back {n} tokens of {self.accepted} accepted")
        if n and not self._matcher.rollback(n):
            raise ValueError(f"rollback of {n} tokens refused: {self.error}")
        self.accepted -= n

    def is_finished(self) -> bool:
        """The grammar has ended: a stop token was accepted, or no token can extend the answer (a closed JSON
        object, the last choice spelled out). The engine ends the answer here whether or not a stop token came."""
        return self._matcher.is_stopped() and not self._matcher.is_error()

    def can_end(self) -> bool:
        """The text so far is a whole answer of the grammar: the mask allows the stop tokens now."""
        return self._matcher.is_accepting()

    @property
    def error(self) -> str | None:
        if not self._matcher.is_error():
            return None
        return self._matcher.get_error().split("\n")[0]  # the rest is the parser's state, for debugging


def fill_bitmask(bitmask: torch.Tensor, rows: list[tuple[GrammarMatcher, int]]) -> None:
    """Every (matcher, row) pair's mask into `bitmask` in one call, spread over the library's worker threads."""
    if not rows:
        return
    _check(bitmask, rows[0][0].compiled.vocab.words)
    _get_executor().unsafe_compute_mask_ptr([(m._matcher, row) for m, row in rows], bitmask.data_ptr(),
                                             bitmask.shape[1] * 4, bitmask.shape[0])


def _get_executor() -> llguidance.LLExecutor:
    global _executor
    if _executor is None:
        # one thread by default: on the H200's 16-core host a 64-row window's fill took 0.5 ms on 1, 0.9-1.2 on 2-4
        # and 1.6-2.4 on the library's default 12 (its threads contend with torch's; docs/PERFORMANCE.md)
        threads = os.environ.get("STRATA_GRAMMAR_THREADS", "1")
        try:
            if int(threads) < 1:
                raise ValueError
            _executor = llguidance.LLExecutor(int(threads))
        except ValueError:
            raise StrataError(f"STRATA_GRAMMAR_THREADS={threads!r}: a number of threads (1 or more) is expected")
    return _executor


def _check(bitmask: torch.Tensor, words: int) -> None:
    if bitmask.dtype != torch.int32 or bitmask.device.type != "cpu" or bitmask.dim() != 2 \
            or bitmask.shape[1] != words or not bitmask.is_contiguous():
        raise ValueError(f"a bitmask is a contiguous CPU int32 tensor [rows, {words}]; got {bitmask.dtype} "
                         f"{tuple(bitmask.shape)} on {bitmask.device}")
