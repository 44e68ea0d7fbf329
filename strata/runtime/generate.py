"""The solo path: read a prompt, then decode one sequence token by token."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

import torch

from strata.errors import PromptTooLong, StrataError
from strata.model.loader import ModelFiles
from strata.model.spec import ModelSpec
from strata.model.weights import StageWeights
from strata.runtime.forward import Forward
from strata.runtime.sampling import SamplingParams, sample, token_counts
from strata.runtime.window import Window
from strata.state.session import SessionState, StatePool


@dataclass
class Generation:
    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" (a stop token) or "length" (max_new_tokens or max_cells reached)


class Engine:
    """One model on one device, decoding sequences through the window forward pass."""

    def __init__(self, files: ModelFiles | None, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 max_cells: int = 4096, prefill_chunk: int = 512, spec: ModelSpec | None = None,
                 weights: StageWeights | None = None, kernels: str = "auto", cuda_graphs: bool = True):
        """Load `files` onto `device`; or, for benchmarks, run given `spec` + `weights` (no tokenizer)."""
        self.spec = files.spec if files is not None else spec
        self.tokenizer = files.tokenizer if files is not None else None
        self.device, self.dtype = torch.device(device), dtype
        self.max_cells = min(max_cells, self.spec.max_positions)
        self.prefill_chunk = prefill_chunk
        self.weights = files.load(self.device, dtype) if files is not None else weights
        if kernels == "auto":
            kernels = "triton" if self.device.type == "cuda" else "torch"
        self.kernels = kernels
        self.forward = Forward(self.spec, self.weights, self.device, dtype, kernels,
                               cuda_graphs=cuda_graphs and kernels == "triton" and self.device.type == "cuda")

    def init_slots(self, num_slots: int) -> "Slots":
        """Batch slots that decode several sequences together (see `strata.runtime.slots`)."""
        from strata.runtime.slots import Slots

        return Slots(self, num_slots)

    def new_state(self) -> SessionState:
        return SessionState.standalone(self.spec, range(self.spec.num_layers), self.max_cells, self.device, self.dtype)

    def new_pool(self, num_seqs: int) -> StatePool:
        return StatePool(self.spec, range(self.spec.num_layers), num_seqs, self.max_cells, self.device, self.dtype)

    def check_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise StrataError("the prompt is empty: give at least one token")
        bad = [i for i in ids if not 0 <= i < self.spec.vocab_size]
        if bad:
            raise StrataError(f"token id {bad[0]} is outside the vocabulary (0..{self.spec.vocab_size - 1})")
        if len(ids) >= self.max_cells:
            raise PromptTooLong(
                f"the prompt has {len(ids)} tokens; max_cells={self.max_cells} leaves room for at most "
                f"{self.max_cells - 1}; shorten the prompt or raise --max-cells"
            )

    @torch.inference_mode()
    def run(self, state: SessionState, ids: list[int], *, all_logits: bool = False) -> torch.Tensor:
        """Feed `ids` to `state` (in chunks of `prefill_chunk` rows); return the logits of the last row, or of every row."""
        outs = []
        for start in range(0, len(ids), self.prefill_chunk):
            window = Window.build([(state, ids[start : start + self.prefill_chunk], all_logits)], self.device)
            outs.append(self.forward(window))
            window.commit()
        return torch.cat(outs) if all_logits else outs[-1]

    @torch.inference_mode()
    def stream(self, prompt_ids: list[int], max_new_tokens: int, params: SamplingParams = SamplingParams(),
               stop_ids: frozenset[int] | None = None, state: SessionState | None = None) -> Iterator[tuple[int, str | None]]:
        """Yield (token, finish_reason) pairs; finish_reason is None until the last token. `state` is reused when given."""
        self.check_prompt(prompt_ids)
        params.validate()
        stops = self.tokenizer.stop_ids if stop_ids is None and self.tokenizer else (stop_ids or frozenset())
        if state is None:
            state = self.new_state()
        else:
            state.reset()
        logits = self.run(state, prompt_ids)
        history = list(prompt_ids)
        for n in range(max_new_tokens):
            token = self._sample(logits[-1:], params, state.length, history, len(prompt_ids))
            history.append(token)
            if token in stops:
                yield token, "stop"
                return
            if n + 1 == max_new_tokens or state.length + 1 >= self.max_cells:
                yield token, "length"
                return
            yield token, None
            logits = self.run(state, [token])

    def generate(self, prompt_ids: list[int], max_new_tokens: int, params: SamplingParams = SamplingParams(),
                 stop_ids: frozenset[int] | None = None) -> Generation:
        gen = Generation(list(prompt_ids))
        if max_new_tokens <= 0:
            self.check_prompt(prompt_ids)
            gen.finish_reason = "length"
            return gen
        for token, reason in self.stream(prompt_ids, max_new_tokens, params, stop_ids):
            gen.ids.append(token)
            gen.finish_reason = reason
        return gen

    def _sample(self, logits: torch.Tensor, params: SamplingParams, position: int, history: list[int], n_prompt: int) -> int:
        if params.is_greedy and not params.has_penalties:
            return int(torch.argmax(logits[0]))
        positions = torch.tensor([position], dtype=torch.int64, device=logits.device)
        seen = counts = None
        if params.has_penalties:
            vocab = logits.shape[-1]
            as_row = lambda ids: torch.tensor([ids or [-1]], dtype=torch.int64, device=logits.device)  # noqa: E731
            seen = token_counts(as_row(history[:n_prompt]), vocab) > 0
            counts = token_counts(as_row(history[n_prompt:]), vocab)
        return int(sample(logits, [params], positions, seen, counts)[0])
