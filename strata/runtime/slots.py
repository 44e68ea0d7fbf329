"""Batch slots: several conversations decoded together, one row per active slot in each window.

Each slot owns a `SessionState` carved like the solo one. A slot's prompt is read through the solo path
(a prompt window of its own), then every batch window holds one row per active slot, so the weights are
read once for all of them. Rows compute exactly as a solo decode row does (row-invariant products, the
same per-row sampling keyed by (seed, position)), so a conversation gets the same tokens alone or batched.

Stepping (`step`) keeps windows in flight and reads them in launch order. With `lookahead` 1 (the default on a
GPU) each group's next window is launched before its window in flight is read: its input tokens are that
window's sampled tokens, still on the device, so the host builds, launches and reads while the device computes
and the device never waits for the host. A conversation that ends on a stop token has had one more row launched
behind it: that row is computed and committed (the state then holds the stop token too, as the tokens it has
read say) and gives no event. Rows that certainly end (max_new, max_cells) are not launched.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from strata.errors import StrataError
from strata.runtime.generate import Engine
from strata.runtime.stages import Handoff
from strata.runtime.sampling import SamplingParams, sample
from strata.runtime.window import Window, host_copy, row_tensor
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
    """A launched batch window: its rows (one per slot in `slots`) and, once run, their logits and tokens."""

    window: Window
    slots: list[int]
    logits: torch.Tensor | None = None
    future: Future | None = None  # the pipeline's (pipelined groups): done once every stage has queued its share
    group: int = 0
    sampled: torch.Tensor | None = None  # [R] int64 on the last stage's device: each row's next token
    host: torch.Tensor | None = None  # the same, copied to host memory (pinned on a GPU)
    copied: "torch.cuda.Event | None" = None  # recorded once that copy is queued


class Slots:
    """`init_slots` makes these; `step` / `flush` run windows in flight (the engine process), `run_slots` +
    `commit_slots` one window at a time."""

    def __init__(self, engine: Engine, num_slots: int, num_groups: int = 1, lookahead: int | None = None):
        """`lookahead`: windows a group launches beyond the one the host reads next (0 or 1; default: the engine's,
        `Engine.lookahead`)."""
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
        if lookahead is None:
            lookahead = engine.lookahead
        if lookahead not in (0, 1):
            raise StrataError(f"--lookahead {lookahead}: a group runs at most one window ahead (0 or 1)")
        self.lookahead = lookahead
        self._flight: deque[SlotWindow] = deque()  # launched windows not read yet, oldest first

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
        if self._flight:
            raise StrataError("batch windows are in flight: read them (flush) before admitting a conversation")
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
        """Free a slot now; False when it was not active. Its rows in windows still in flight are committed when
        read and give no event."""
        slot = self.check_slot(index)
        was_active, slot.active = slot.active, False
        return was_active

    @property
    def in_flight(self) -> bool:
        return bool(self._flight)

    # synchronous stepping (tests, calibration): one window, run and committed

    def run_slots(self) -> SlotWindow | None:
        """Run one batch window over the active slots (None when none is active)."""
        assert not self._flight, "run_slots with windows in flight: flush them first"
        rows = self.active
        if not rows:
            return None
        sw = SlotWindow(Window.build([(self.slots[i].state, [self.slots[i].next_token], False) for i in rows],
                                     self.engine.device), rows)
        sw.logits = self.engine.forward(sw.window)
        return sw

    def commit_slots(self, sw: SlotWindow) -> list[Event]:
        """Keep every row of the window, then sample each slot's next token."""
        sw.window.commit()
        return self._take(sw.slots, sw.logits)

    # stepping with windows in flight (the scheduler, benchmarks)

    def step(self) -> list[Event]:
        """Launch every window that may run now (each group keeps up to 1 + lookahead in flight), then read the
        oldest window in flight and return its events (none when nothing runs). Blocks only for that window.
        Groups launch in turns (g0, g1, ..., then g0's next, ...): a stage runs its windows in launch order, and a
        group's next window waits on the device for the group's window before it, so a stage always has another
        group's window to run meanwhile."""
        for _ in range(self.lookahead + 1):
            for g in range(len(self.groups)):
                if sum(sw.group == g for sw in self._flight) <= self.lookahead:
                    self._launch(g)
        return self._read(self._flight.popleft()) if self._flight else []

    def flush(self) -> list[Event]:
        """Read every window in flight (before a slot changes hands); their events in launch order."""
        events = []
        while self._flight:
            events += self._read(self._flight.popleft())
        return events

    def _launch(self, group: int) -> None:
        """Launch the group's next window, if it has a row to run. With a window of the group in flight
        (lookahead), the rows are that window's slots that are still active and not certain to end, and each
        takes the token its row there sampled, on the device; otherwise every active slot of the group takes its
        last token from the host."""
        latest = next((sw for sw in reversed(self._flight) if sw.group == group), None)
        if latest is None:
            rows = [i for i in self.groups[group] if self.slots[i].active]
        else:  # a slot joins a group only after a flush, so every row continues one of the latest window's
            rows = [i for i in latest.slots if self.slots[i].active and not self._ends_after_pending(i)]
        if not rows:
            return
        parts = [(self.slots[i].state, [self.slots[i].next_token if latest is None else 0], False) for i in rows]
        window = Window.build(parts, self.engine.device, fed=latest is not None)
        sw = SlotWindow(window, rows, group=group)
        params = [self.slots[i].params for i in rows]
        positions = [p + 1 for p in window.host[1]]  # the position each sampled token will take

        def then(logits: torch.Tensor) -> None:  # on the last stage's device (its worker, for pipelined groups)
            sw.logits = logits
            sw.sampled = self._sample(rows, logits, params, positions)
            sw.host, sw.copied = host_copy(sw.sampled)

        feed = None
        if latest is not None:
            row_of = {slot: j for j, slot in enumerate(latest.slots)}
            index = None if rows == latest.slots else [row_of[i] for i in rows]

            def feed() -> tuple[Handoff, list[int] | None]:  # the latest window's tokens, once it is queued
                if latest.future is not None:
                    latest.future.result()
                return Handoff(latest.sampled, latest.copied), index

        if len(self.groups) == 1:
            if feed is not None:
                sent, index = feed()
                window.tokens = sent.x if index is None else sent.x[row_tensor(index, torch.int64, sent.x.device)]
            then(self.engine.forward(window))
        else:  # fed and sampled in the stages' workers: the host thread only queues
            sw.future = self.engine.pipeline.launch(window, tokens=feed, then=then)
        for i in rows:  # the row's position is the state's now; its token joins `state.tokens` when read
            self.slots[i].state.length += 1
        self._flight.append(sw)

    def _ends_after_pending(self, index: int) -> bool:
        """Whether the slot's token in flight certainly ends it (max_new or max_cells): no row goes behind it."""
        slot = self.slots[index]
        return len(slot.generated) + 1 >= slot.max_new or slot.state.length + 1 >= slot.state.max_cells

    def _read(self, sw: SlotWindow) -> list[Event]:
        """Wait for the window's tokens, commit its rows and record each active slot's token."""
        if sw.future is not None:
            sw.future.result()
        if sw.copied is not None:
            sw.copied.synchronize()
        for i in sw.slots:
            self.slots[i].state.tokens.append(self.slots[i].next_token)
        return self._record(sw.slots, sw.host.tolist(), [p + 1 for p in sw.window.host[1]])

    def _sample(self, indices: list[int], logits: torch.Tensor, params: list[SamplingParams],
                positions: list[int]) -> torch.Tensor:
        """Each row's next token, on the device (no host sync); the penalty counts of its slot count it."""
        slots = [self.slots[i] for i in indices]
        seen = counts = None
        if any(p.has_penalties for p in params):
            vocab = logits.shape[-1]
            none_b = torch.zeros(vocab, dtype=torch.bool, device=logits.device)
            none_c = torch.zeros(vocab, dtype=torch.int32, device=logits.device)
            seen = torch.stack([s.seen_prompt if s.seen_prompt is not None else none_b for s in slots])
            counts = torch.stack([s.counts if s.counts is not None else none_c for s in slots])
        tokens = sample(logits, params, positions, seen, counts)
        for j, s in enumerate(slots):
            if s.counts is not None:
                s.counts.index_add_(0, tokens[j : j + 1], torch.ones(1, dtype=torch.int32, device=tokens.device))
        return tokens

    def _take(self, indices: int | list[int], logits: torch.Tensor) -> list[Event]:
        """Sample one token per row now (the host waits for it) and record it."""
        indices = [indices] if isinstance(indices, int) else indices
        slots = [self.slots[i] for i in indices]
        lengths = [s.state.length for s in slots]
        tokens = self._sample(indices, logits, [s.params for s in slots], lengths)
        return self._record(indices, tokens.tolist(), lengths)

    def _record(self, indices: list[int], tokens: list[int], lengths: list[int]) -> list[Event]:
        """Give each active slot its token and end the slots that are done. lengths[j]: the positions slot j held
        once the row that sampled its token was committed (later rows may be in flight)."""
        events = []
        for i, token, length in zip(indices, tokens, lengths):
            slot = self.slots[i]
            if not slot.active:  # stopped, or ended by its previous token, while this row was in flight
                continue
            slot.generated.append(token)
            reason = None
            if token in slot.stop_ids:
                reason = "stop"
            elif len(slot.generated) >= slot.max_new or length + 1 >= slot.state.max_cells:
                reason = "length"
            if reason:
                slot.active = False
            events.append(Event(i, token, reason))
        return events
