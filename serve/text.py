"""Token ids to text as they stream: incremental detokenization and stop strings."""

from __future__ import annotations

from strata.model.tokenizer import Tokenizer

_LOOKBACK = 4  # tokens decoded again with each new one, so word joins and multi-byte characters come out right


class TextStream:
    """Feed token ids one by one; get the text that is safe to show so far.

    Text that could be the start of a stop string is held back until it is decided; when a stop string
    appears, the text ends just before it (after it with `include_stop`) and `stopped` is set; a stop token
    (`stop_ids`: the one the engine ended the answer on) adds no text unless `include_stop`. Before `min_tokens` tokens (vLLM's field) no
    stop string is looked for: one that ends within their text does not stop the answer.
    """

    def __init__(self, tokenizer: Tokenizer, stop: list[str] | None = None, min_tokens: int = 0,
                 include_stop: bool = False, skip_special: bool = True, stop_ids: frozenset[int] = frozenset()):
        self.tokenizer = tokenizer
        self.stop = [s for s in (stop or []) if s]
        self.min_tokens = min_tokens
        self.include_stop = include_stop  # vLLM's include_stop_str_in_output: the text ends after the stop string
        self.skip_special = skip_special  # vLLM's skip_special_tokens: special tokens' text left out
        self.stop_ids = stop_ids  # the tokens the engine ends the answer on: their text is not the answer's
        self.ids: list[int] = []
        self.text = ""  # everything decided so far (emitted or held back)
        self.emitted = 0  # characters of `text` already handed out
        self.stopped = False
        self._start = 0  # ids[_start:] are decoded together
        self._read = 0  # ids[_start:_read] produced the text already in `text`

    def push(self, token: int) -> str:
        """Add one token; return the new text that may be shown now (possibly "")."""
        if self.stopped or (token in self.stop_ids and not self.include_stop):
            return ""  # (a stop token is the answer's last: nothing after it to decode)
        self.ids.append(token)
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)  # noqa: E731
        before = decode(self.ids[self._start : self._read])
        after = decode(self.ids[self._start :])
        if after.endswith("\ufffd") or not after.startswith(before):
            return ""  # an incomplete character: wait for the next token
        self.text += after[len(before) :]
        self._read = len(self.ids)
        self._start = max(self._start, self._read - _LOOKBACK)
        if len(self.ids) < self.min_tokens:  # no stop string yet: all of it may be shown
            out, self.emitted = self.text[self.emitted :], len(self.text)
            return out
        return self._release(final=False)

    def finish(self) -> str:
        """The end of the answer: whatever was held back."""
        return "" if self.stopped else self._release(final=True)

    def _release(self, final: bool) -> str:
        for s in self.stop:
            at = self.text.find(s, max(0, self.emitted - len(s) + 1))
            if at >= 0:
                self.stopped = True
                self.text = self.text[: at + len(s) if self.include_stop else at]
                out, self.emitted = self.text[self.emitted :], len(self.text)
                return out
        end = len(self.text)
        if not final:
            for s in self.stop:  # hold back the longest tail that could begin a stop string
                for k in range(min(len(s) - 1, end - self.emitted), 0, -1):
                    if self.text.endswith(s[:k]):
                        end = min(end, len(self.text) - k)
                        break
        out, self.emitted = self.text[self.emitted : end], end
        return out
