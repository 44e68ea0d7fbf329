"""Batch slots: several conversations decoded together, one row per active slot in each window.

Each slot owns a `SessionState` carved like the solo one. A slot's prompt is read through the solo path
(a prompt window of its own), then every batch window holds one row per active slot, so the weights are
read once for all of them. Rows compute exactly as a solo decode row does (row-invariant products, the
same per-row sampling keyed by (seed, position)), so a conversation gets the same tokens alone or batched.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from strata.errors import StrataError
from strata.runtime.generate import Engine
from strata.runtime.sampling import SamplingParams, sample
from strata.runtime.window import Window
from strata.state.session import SessionState


@dataclass
class Slot:
    state: SessionState
    active: bool = False
    params: SamplingParams = field(default_factory=SamplingParams)
    max_new: int = 0
    stop_ids: frozenset[int] = frozenset()
    num_prompt: int = 0
    generated: list[int] = field(default_factory=list)
    seen_prompt: torch.Tensor | None = None  # [V] bool, only with penalties
    counts: torch.Tensor | None = None  # [V] int32 counts of generated tokens, only with penalties

    @property
    def next_token(self) -> int:
        return self.generated[-1]


@dataclass
class Event:
    """A token for a slot; `finish_reason` is set on its last one ("stop", "length")."""

    slot: int
    token: int
    finish_reason: str | None = None


@dataclass
class SlotWindow:
    """A launched batch window: its rows (one per slot in `slots`) and, once run, their logits."""

    window: Window
    slots: list[int]
    logits: torch.Tensor | None = None
    future: Future | None = None


class Slots:
    """`init_slots` makes these; `run_slots` + `commit_slots` step synchronously, `batch_launch` + `batch_poll` without blocking."""

    def __init__(self, engine: Engine, num_slots: int, num_groups: int = 1):
        if not 1 <= num_slots <= 256:
            raise StrataError(f"--batch {num_slots}: the number of slots must be between 1 and 256")
        if not 1 <= num_groups <= num_slots:
            raise StrataError(f"--batch-groups {num_groups}: groups must be between 1 and the {num_slots} slots")
        self.engine = engine
        self.pool = engine.new_pool(num_slots)  # every slot's state in one tensor per layer
        self.slots = [Slot(state) for state in self.pool.sessions()]
        bounds = [round(num_slots * g / num_groups) for g in range(num_groups + 1)]
        self.groups = [range(a, b) for a, b in zip(bounds, bounds[1:])]  # consecutive slots per group
        self.reused = 0  # prompt tokens the last admission took from a prefix instead of reading them

    def __len__(self) -> int:
        return len(self.slots)

    @property
    def active(self) -> list[int]:
        return [i for i, s in enumerate(self.slots) if s.active]

    def check_slot(self, index: int) -> Slot:
        if not 0 <= index < len(self.slots):
            raise StrataError(f"slot {index} does not exist (slots are 0..{len(self.slots) - 1})")
        return self.slots[index]

    def admit(self, index: int, prompt_ids: list[int], max_new: int, params: SamplingParams = SamplingParams(),
              stop_ids: frozenset[int] | None = None, idle: list[SessionState] = (), resumed: int = 0) -> Event:
        """Read the prompt into the slot (the solo path's prompt window) and sample its first token.

        The longest reusable prefix of the prompt that the slot itself, another idle slot, an `idle` sequence
        (e.g. the solo session just STOPped) or a parked conversation holds is kept (`Engine.reuse`; what the slot
        held otherwise is parked) and only the rest is read; `self.reused` counts the tokens kept. So a solo
        conversation moved into a slot continues exactly as it would have alone (its last token is read by a
        one-row decode window). `resumed`: the last so many prompt ids were generated earlier by this same
        request; they count as its output (for `max_new`, the penalties and the reported counts)."""
        slot = self.check_slot(index)
        if slot.active:
            raise StrataError(f"slot {index} is busy; stop it (BSTOP) and wait for its BDONE first")
        if not 0 <= resumed < len(prompt_ids):
            raise StrataError(f"resume={resumed}: it must leave at least one prompt token")
        if max_new <= resumed:
            raise StrataError(f"max_new {max_new}: a slot must generate at least one token (beyond resume={resumed})")
        self.engine.check_prompt(prompt_ids)
        params.validate()
        tok = self.engine.tokenizer
        slot.stop_ids = (tok.stop_ids if tok else frozenset()) if stop_ids is None else stop_ids
        num_prompt = len(prompt_ids) - resumed
        slot.params, slot.max_new, slot.num_prompt = params, max_new, num_prompt
        slot.generated = list(prompt_ids[num_prompt:])
        slot.seen_prompt = slot.counts = None
        if params.has_penalties:
            vocab, device = self.engine.spec.vocab_size, self.engine.stages[-1].device
            slot.seen_prompt = torch.zeros(vocab, dtype=torch.bool, device=device)
            slot.seen_prompt[torch.tensor(prompt_ids[:num_prompt], device=device)] = True
            slot.counts = torch.zeros(vocab, dtype=torch.int32, device=device)
            if resumed:
                slot.counts.index_add_(0, torch.tensor(slot.generated, device=device),
                                       torch.ones(resumed, dtype=torch.int32, device=device))
        others = [s.state for s in self.slots if not s.active] + list(idle)
        self.reused = self.engine.reuse(slot.state, prompt_ids, others)
        logits = self.engine.run(slot.state, prompt_ids[self.reused :])
        slot.active = True
        return self._take(index, logits[-1:])[0]

    def stop(self, index: int) -> bool:
        """Free a slot now; False when it was not active."""
        slot = self.check_slot(index)
        was_active, slot.active = slot.active, False
        return was_active

    def run_slots(self) -> SlotWindow | None:
        """Run one batch window over the active slots (None when none is active)."""
        sw = self._build()
        if sw is not None:
            sw.logits = self._forward(sw.window)
        return sw

    def commit_slots(self, sw: SlotWindow) -> list[Event]:
        """Keep every row of the window, then sample each slot's next token."""
        sw.window.commit()
        return self._take(sw.slots, sw.logits)

    def batch_launch(self, group: int | None = None) -> SlotWindow | None:
        """Start a batch window over the active slots (of one group) on the stages' workers; return at once."""
        sw = self._build(group)
        if sw is not None:
            sw.future = self.engine.pipeline.launch(sw.window)
        return sw

    def batch_poll(self, sw: SlotWindow) -> list[Event] | None:
        """The window's events once it has run (committing it), None while it still runs. Never blocks."""
        if not sw.future.done():
            return None
        sw.logits = sw.future.result()
        return self.commit_slots(sw)

    @torch.inference_mode()
    def _forward(self, window: Window) -> torch.Tensor:
        return self.engine.forward(window)

    def _build(self, group: int | None = None) -> SlotWindow | None:
        active = [i for i in self.active if group is None or i in self.groups[group]]
        if not active:
            return None
        parts = [(self.slots[i].state, [self.slots[i].next_token], False) for i in active]
        return SlotWindow(Window.build(parts, self.engine.device), active)

    def _take(self, indices: int | list[int], logits: torch.Tensor) -> list[Event]:
        """Sample one token per row, record it in its slot, and end the slots that are done."""
        indices = [indices] if isinstance(indices, int) else indices
        slots = [self.slots[i] for i in indices]
        positions = [s.state.length for s in slots]  # a tensor only if some row samples (not for greedy rows)
        seen = counts = None
        if any(s.params.has_penalties for s in slots):
            vocab = logits.shape[-1]
            none_b = torch.zeros(vocab, dtype=torch.bool, device=logits.device)
            none_c = torch.zeros(vocab, dtype=torch.int32, device=logits.device)
            seen = torch.stack([s.seen_prompt if s.seen_prompt is not None else none_b for s in slots])
            counts = torch.stack([s.counts if s.counts is not None else none_c for s in slots])
        tokens = sample(logits, [s.params for s in slots], positions, seen, counts).tolist()
        events = []
        for i, slot, token in zip(indices, slots, tokens):
            if not slot.active:  # stopped while its window was in flight: the row is dropped
                continue
            slot.generated.append(token)
            if slot.counts is not None:
                slot.counts[token] += 1
            reason = None
            if token in slot.stop_ids:
                reason = "stop"
            elif len(slot.generated) >= slot.max_new or slot.state.length + 1 >= slot.state.max_cells:
                reason = "length"
            if reason:
                slot.active = False
            events.append(Event(i, token, reason))
        return events
