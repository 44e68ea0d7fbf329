"""Batch slots: the conversations the engine runs, and the windows that run them.

Each slot owns a `SessionState` in one `StatePool`. `admit` gives a slot a request; its prompt is then read
inside the windows. Every window holds, in this order and within the token budget (`Engine.max_window_tokens`,
`--max-window-tokens`):

1. one row per decoding slot (its last token), so a running stream advances in every window;
2. prompt rows of the slots still reading their prompt, in admission order: a prompt longer than what is left
   of the budget spans several windows, several short ones share one.

A slot's first token is sampled from the window holding its prompt's last row; from the next window on it
decodes. Decoding rows run exactly as a decode window of their own (row-invariant products, the same per-row
sampling keyed by (seed, position); `Forward.run_stage`), so a decoding row's logits are bitwise the same alone,
batched, and beside any prompt rows. Prompt rows share their windows' weight reads, which may round a prompt's
state differently by what is read beside it (as any batched prefill does); its tokens are the same but for
rounding ties.

Stepping (`step`) keeps windows in flight and reads them in launch order. With `lookahead` 1 (the default on a
GPU) each group's next window is launched before its window in flight is read: its decoding rows take that
window's sampled tokens, still on the device, so the host builds, launches and reads while the device computes
and the device never waits for the host. A conversation that ends on a stop token has had one more row launched
behind it: that row is computed and committed (the state then holds the stop token too, as the tokens it has
read say) and gives no event. Rows that certainly end (max_new, max_cells) are not launched. A slot changes hands
only when none of the windows in flight holds a row of it (`free`), so an admission never races a row of the
slot's previous owner; the other slots' windows stay in flight meanwhile, and the admitted prompt joins the next
window built.
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from strata.kernels.invariant import row_block
from strata.runtime.drafts import propose
from strata.errors import StrataError
from strata.runtime.generate import Engine
from strata.runtime.stages import Handoff
from strata.runtime.sampling import SamplingParams, sample
from strata.runtime.window import Segment, Window, host_copy, row_tensor
from strata.grammar import Constraint, GrammarMatcher, HostBitmask, apply_bitmask, fill_bitmask
from strata.state.session import SessionState

log = logging.getLogger("strata.engine")
_order = itertools.count(1)  # admissions and releases, in the order they happened
PROMPT_END_CHECKPOINT_MIN = 32  # prompt tokens read since the last GDN checkpoint for one before the prompt's end
# prompt rows a window runs with its decode rows, on the decode kernels (replayed from a CUDA graph on a GPU) as a
# drafting slot's rows are: a short chunk, such as a parked conversation's follow-up, then costs a graph replay
# instead of a prompt window's launches (`_short_chunks`)
SHORT_CHUNK_ROWS = 16


# rows a slot's paused MTP layer keeps waiting, at most (`Slots._run_mtp`): 512 rows of a 2,048-wide model in
# bfloat16 are 2 MB a slot
MTP_PENDING_ROWS = 512


@dataclass
class Slot:
    state: SessionState
    active: bool = False
    params: SamplingParams = field(default_factory=SamplingParams)
    max_new: int = 0
    stop_ids: frozenset[int] = frozenset()
    num_prompt: int = 0
    num_reused: int = 0  # prompt tokens taken from a held or parked state at admission
    unread: list[int] = field(default_factory=list)  # prompt ids not yet put in a window
    generated: list[int] = field(default_factory=list)
    seen_prompt: torch.Tensor | None = None  # [V] bool, only with penalties
    counts: torch.Tensor | None = None  # [V] int32 counts of generated tokens, only with penalties
    draft_len: int = 0  # drafts it may propose next (`--spec`): one more than it had accepted last time
    mtp_drafts: list[int] = field(default_factory=list)  # what the MTP layer drafted after its last window
    # rows the MTP layer has not read yet, consecutive: (first position, hidden states, next tokens) (`_run_mtp`)
    mtp_pending: list[tuple[int, torch.Tensor, list[int]]] = field(default_factory=list)
    logprobs: int | None = None  # report each token's log-probability and this many top ones (None: none)
    matcher: "GrammarMatcher | None" = None  # the constraint its answer follows (structured output), or None
    follows: int | None = None  # the slot reading the same prompt, whose read this one shares (`admit`)
    prompt: list[int] = field(default_factory=list)  # the prompt it was admitted with
    admitted: int = 0  # when it was admitted (`_order`): prompt rows are given out in this order
    released: int = 0  # when it last went idle (`_order`)

    @property
    def next_token(self) -> int:
        return self.generated[-1]

    @property
    def reading(self) -> bool:
        """Admitted, and some of its prompt is not in a window yet."""
        return self.active and bool(self.unread)


@dataclass
class Event:
    """A token for a slot; `finish_reason` is set on its last one ("stop", "length")."""

    slot: int
    token: int
    finish_reason: str | None = None
    logprobs: tuple[float, list[tuple[int, float]]] | None = None  # the token's and the top ones (slot.logprobs)


@dataclass
class SlotWindow:
    """A launched window: its rows' slots and, once run, their logits and sampled tokens."""

    window: Window
    decoding: list[int]  # the slots with a decode row, the window's first rows, in order
    samplers: list[int]  # the slots that sample a token from this window (logit-row order)
    members: frozenset[int] = frozenset()  # every slot with a row in this window
    prompt_rows: int = 0  # rows of prompt chunks
    logits: torch.Tensor | None = None
    future: Future | None = None  # the pipeline's (pipelined groups): done once every stage has queued its share
    group: int = 0
    drafts: dict[int, list[int]] = field(default_factory=dict)  # drafting slot -> the tokens drafted after its last
    spans: dict[int, tuple[int, int, int]] = field(default_factory=dict)  # slot -> (first row, rows, first position)
    hidden: torch.Tensor | None = None  # with MTP drafts: every row's final hidden state
    sampled: torch.Tensor | None = None  # [N] int64 on the last stage's device: each sampler's next token
    host: torch.Tensor | None = None  # the same, copied to host memory (pinned on a GPU)
    logprob_rows: dict[int, int] = field(default_factory=dict)  # sampler row -> its row in logprob_host
    logprob_host: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (token's, top values, top ids)
    copied: "torch.cuda.Event | None" = None  # recorded once that copy is queued
    deferred: bool = False  # its layers are queued, its sampling waits for the window before it to be read
    shared: list[int] = field(default_factory=list)  # samplers past the logit rows: the sampler whose row each shares
    checkpoints: list[int] = field(default_factory=list)  # slots whose chunk ends at a GDN checkpoint's position

    @property
    def num_rows(self) -> int:
        return self.window.num_rows


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
        if self.pool.keep_free and num_slots > 1:
            log.info("drafts keep the Gated DeltaNet states after drafted rows in %d slots (%.0f MB of device memory: "
                     "%d drafting slots x %d drafts, --spec-max-active and --spec)", len(self.pool.keep_free),
                     self.pool.keep_nbytes() / 1e6, len(self.pool.keep_free) // engine.speculative.num_speculative_tokens,
                     engine.speculative.num_speculative_tokens)
        self.slots = [Slot(state) for state in self.pool.sessions()]
        bounds = [round(num_slots * g / num_groups) for g in range(num_groups + 1)]
        self.groups = [range(a, b) for a, b in zip(bounds, bounds[1:])]  # consecutive slots per group
        self.budget = engine.max_window_tokens
        # rows of short prompt chunks a window runs with its decode rows (`_short_chunks`): on a GPU, where that
        # part is a graph replay; elsewhere the prompt kernels cost no more (and Triton's interpreter far less)
        self.short_chunk_rows = SHORT_CHUNK_ROWS if engine.device.type == "cuda" else 0
        largest = max(len(g) for g in self.groups)
        if self.budget < largest:
            raise StrataError(f"--max-window-tokens {self.budget} is below the {largest} slots of a group (--batch "
                              f"{num_slots}, --batch-groups {num_groups}): every decoding slot needs its row in each "
                              "window; raise --max-window-tokens or lower --batch")
        if lookahead is None:
            lookahead = engine.lookahead
        if lookahead not in (0, 1):
            raise StrataError(f"--lookahead {lookahead}: a group runs at most one window ahead (0 or 1)")
        self.lookahead = lookahead
        self._flight: deque[SlotWindow] = deque()  # launched windows not read yet, oldest first
        self._read_log: deque[tuple[int, int]] = deque(maxlen=4096)  # (decode rows, prompt rows) of windows read
        self.speculative = engine.speculative  # drafts verified in the windows (`strata.runtime.drafts`), or None
        # on the CPU's torch kernels a decode window's products run in blocks of this many rows (`row_block`); on
        # the CPU's packed kernel each row on its own, unpadded (1: no row comes free, each costs its share)
        self.row_block = (_decode_block(engine) if self.speculative and engine.device.type == "cpu"
                          and engine.kernels == "torch" else None)
        if self.row_block == 1 and self.speculative.keeps_to_free_rows:
            log.warning("--spec %s:%d: this CPU engine's products run on its packed kernel, where no row comes free "
                        "and each drafted row costs about a third of a decode row; drafts kept to free rows (MTP's) "
                        "are not proposed (measured: no gain at one slot, 0.83-0.90x at four; n-gram drafts are)",
                        self.speculative.method, self.speculative.num_speculative_tokens)
        # vLLM's spec_decode counters: windows with drafts (one per drafting slot), drafted and accepted tokens,
        # and accepted tokens by draft position
        self.spec_counts = {"drafts": 0, "draft_tokens": 0, "accepted": 0}
        self.spec_accepted_per_pos = [0] * (self.speculative.num_speculative_tokens if self.speculative else 0)
        self.mtp = engine.stages[-1].forward if engine.mtp else None  # the last stage, which runs the MTP layer
        self._bitmask: HostBitmask | None = None  # constrained rows' masks, filled on the host each window

    def __len__(self) -> int:
        return len(self.slots)

    @property
    def active(self) -> list[int]:
        return [i for i, s in enumerate(self.slots) if s.active]

    @property
    def busy(self) -> frozenset[int]:
        """The slots with a row in a window in flight (an idle one among them: the row launched behind its end)."""
        return frozenset().union(*(sw.members for sw in self._flight))

    @property
    def free(self) -> list[int]:
        """The slots a request may be given now: idle, and no row of theirs in flight."""
        busy = self.busy
        return [i for i, s in enumerate(self.slots) if not s.active and i not in busy]

    def check_slot(self, index: int) -> Slot:
        if not 0 <= index < len(self.slots):
            raise StrataError(f"slot {index} does not exist (slots are 0..{len(self.slots) - 1})")
        return self.slots[index]

    def check_request(self, prompt_ids: list[int], max_new: int, params: SamplingParams) -> None:
        """Refuse what no slot could run (StrataError naming the input)."""
        if max_new < 1:
            raise StrataError(f"max_new {max_new}: a request must generate at least one token")
        self.engine.check_prompt(prompt_ids)
        params.validate()
        if params.min_tokens > max_new:
            raise StrataError(f"min_tokens {params.min_tokens} is more than max_new {max_new}: no answer could obey both")

    def admit(self, index: int, prompt_ids: list[int], max_new: int, params: SamplingParams = SamplingParams(),
              stop_ids: frozenset[int] | None = None, idle: list[SessionState] = (), logprobs: int | None = None,
              grammar: Constraint | None = None) -> int:
        """Give the slot a request; its prompt is read in the next windows (`step`, `run_slots`). Returns the
        prompt tokens reused instead of read.

        The longest reusable prefix of the prompt that the slot itself, another idle slot, an `idle` sequence or a
        parked conversation holds is kept (`Engine.reuse`; what the slot held otherwise is parked) and only the
        rest is read; at least one token is always read, since its row gives the first new token. `logprobs`: each
        token's event carries its log-probability and this many top ones (`Event.logprobs`). `grammar`: each token is
        sampled among those the constraint allows (StrataError when it cannot be compiled); the answer ends when the
        grammar does."""
        slot = self.check_slot(index)
        if slot.active:
            raise StrataError(f"slot {index} is busy; stop it and wait for its end first")
        busy = self.busy
        if index in busy:
            raise StrataError(f"slot {index} still has a row in a window in flight: read it (step, flush) before "
                              "admitting a conversation there")
        self.check_request(prompt_ids, max_new, params)
        if params.logit_bias and params.logit_bias[-1][0] >= self.engine.spec.vocab_size:
            raise StrataError(f"logit_bias: token id {params.logit_bias[-1][0]} is outside the vocabulary "
                              f"(0..{self.engine.spec.vocab_size - 1})")
        if logprobs is not None and not 0 <= logprobs <= self.engine.spec.vocab_size:
            raise StrataError(f"logprobs={logprobs}: top log-probabilities must be 0 to the vocabulary's size")
        matcher = GrammarMatcher(self.engine.grammars.compile(grammar)) if grammar is not None else None
        tok = self.engine.tokenizer
        slot.stop_ids = (tok.stop_ids if tok else frozenset()) if stop_ids is None else stop_ids
        slot.params, slot.max_new, slot.num_prompt, slot.logprobs = params, max_new, len(prompt_ids), logprobs
        slot.matcher = matcher
        slot.generated = []
        slot.draft_len = self.speculative.num_speculative_tokens if self.speculative else 0
        slot.seen_prompt = slot.counts = None
        if params.has_penalties:
            vocab, device = self.engine.spec.vocab_size, self.engine.stages[-1].device
            slot.seen_prompt = torch.zeros(vocab, dtype=torch.bool, device=device)
            slot.seen_prompt[row_tensor(prompt_ids, torch.int64, device)] = True  # no wait for windows in flight
            slot.counts = torch.zeros(vocab, dtype=torch.int32, device=device)
        others = [s.state for j, s in enumerate(self.slots) if not s.active and j not in busy] + list(idle)
        slot.num_reused = self.engine.reuse(slot.state, prompt_ids, others)
        slot.mtp_drafts, slot.mtp_pending = [], []
        if self.mtp is not None and slot.num_reused and not slot.state.conv:  # (a GDN state is kept whole)
            # the MTP cell of the last reused position pairs its hidden state with the token after it: read that
            # position again, so the cell is made with this prompt's next token
            slot.num_reused -= 1
            slot.state.truncate(slot.num_reused)
        slot.unread = list(prompt_ids[slot.num_reused :])
        slot.prompt, slot.follows = list(prompt_ids), self._leader(index, prompt_ids)
        if slot.follows is not None:
            slot.num_reused = len(prompt_ids)  # none of it read by this slot (back to its own count if the leader stops)
        slot.active, slot.admitted = True, next(_order)
        return slot.num_reused

    def _leader(self, index: int, prompt_ids: list[int]) -> int | None:
        """An active slot of the same group that will read this same prompt and has not put its last row in a
        window yet: the new slot shares that read (`n` samples of one request), taking its first token from the
        leader's last prompt row and a copy of its state (`_share`). Not with pipelined groups or an MTP layer."""
        if len(self.groups) > 1 or self.mtp is not None:
            return None
        return next((j for j, s in enumerate(self.slots) if j != index and s.active and s.follows is None
                     and s.unread and s.prompt == prompt_ids), None)

    def admit_now(self, index: int, prompt_ids: list[int], max_new: int, params: SamplingParams = SamplingParams(),
                  stop_ids: frozenset[int] | None = None) -> Event:
        """`admit`, then read the prompt at once in prompt windows of its own, outside the slots' windows, and sample
        the first token (benchmarks and tests that time or compare decode windows: the slot's state is bitwise what
        a lone read gives, whatever the other slots hold); that token's event. Requests go through `admit`."""
        self.admit(index, prompt_ids, max_new, params, stop_ids)
        slot = self.slots[index]
        slot.follows = None  # it reads its prompt now, alone
        logits = self.engine.run(slot.state, slot.unread)
        slot.unread = []
        position = slot.state.length
        token = self._sample([index], logits[-1:], [params], [position])
        return self._record([index], token.tolist(), [position])[0]

    def read_prompt_scored(self, index: int, top: int) -> tuple[list[tuple[float, list[tuple[int, float]]]], Event]:
        """Read an admitted slot's whole prompt now, every row's logits kept (the prompt's own log-probabilities,
        vLLM's `prompt_logprobs` / a completion's `echo` with `logprobs`), and sample its first token, as
        `admit_now` does: per prompt token after the first, the raw log-softmax at it and the `top` best, and the
        first token's event. A prefix the slot reused is read again (its rows' logits are wanted too); the other
        slots wait while it reads (one prompt window after another, outside the slots' windows)."""
        slot = self.slots[index]
        if self.mtp is not None:
            raise StrataError("prompt log-probabilities: not with MTP drafts (--speculative mtp:N); serve without them")
        if slot.num_reused:
            slot.state.truncate(0)
        slot.num_reused, slot.follows, slot.unread = 0, None, []
        logits = self.engine.run(slot.state, slot.prompt, all_logits=True)  # [L, V]
        step = self.engine.max_window_tokens
        self._read_log += [(0, min(step, len(slot.prompt) - s)) for s in range(0, len(slot.prompt), step)]  # its windows
        scored = []
        for start in range(0, len(slot.prompt) - 1, 256):  # log-softmax a few rows at a time: [256, V] float32
            rows = logits[start : min(start + 256, len(slot.prompt) - 1)]
            nxt = row_tensor(slot.prompt[start + 1 : start + 1 + len(rows)], torch.int64, rows.device)
            scored += _entries(*log_probabilities(rows, nxt, top))
        position = slot.state.length
        token = self._sample([index], logits[-1:], [slot.params], [position])
        first = None if slot.logprobs is None else _entries(*log_probabilities(logits[-1:], token, slot.logprobs))
        return scored, self._record([index], token.tolist(), [position], first)[0]

    def stop(self, index: int) -> bool:
        """Free a slot now; False when it was not active. Its rows in windows still in flight are committed when
        read and give no event."""
        slot = self.check_slot(index)
        was_active = slot.active
        self._release(slot)
        return was_active

    def _release(self, slot: Slot) -> None:
        if slot.active:
            slot.active, slot.unread, slot.released = False, [], next(_order)
            for other in self.slots:  # its followers read the prompt themselves
                if other.follows is not None and self.slots[other.follows] is slot:
                    other.follows, other.num_reused = None, other.num_prompt - len(other.unread)
            slot.follows = None

    def abandon(self) -> list[int]:
        """After a window failed: forget every window in flight and end every slot that was active or had a row in
        one; their states are reset, since the failed window may have advanced them part-way. Returns those slots.
        The other idle slots keep what they hold."""
        touched = sorted(self.busy | set(self.active))
        self._flight.clear()
        for i in touched:
            self._release(self.slots[i])
            self.slots[i].state.reset()
        return touched

    def take_read_log(self) -> list[tuple[int, int]]:
        """(decode rows, prompt rows) of each window read since the last call (`vllm:iteration_tokens_total`)."""
        log = list(self._read_log)
        self._read_log.clear()
        return log

    @property
    def in_flight(self) -> bool:
        return bool(self._flight)

    @property
    def reading(self) -> bool:
        return any(s.reading for s in self.slots)

    # synchronous stepping (tests, calibration): one window, run and committed

    def run_slots(self) -> SlotWindow | None:
        """Run one window over every active slot, as one group (None when no slot has a row to run)."""
        assert not self._flight, "run_slots with windows in flight: flush them first"
        sw = self._build(range(len(self.slots)), None, 0)
        if sw is None:
            return None
        logits = self.engine.forward(sw.window)
        self._keep_checkpoints(sw)
        self._share(sw)
        self._then(sw, logits)
        return sw

    def commit_slots(self, sw: SlotWindow) -> list[Event]:
        """Keep every row of the window, then give each sampling slot its next token."""
        return self._read(sw)

    # stepping with windows in flight (the scheduler, benchmarks)

    def step(self) -> list[Event]:
        """Launch every window that may run now (each group keeps up to 1 + lookahead in flight), then read the
        oldest window in flight and return its events (none when nothing runs). Blocks only for that window.
        Groups launch in turns (g0, g1, ..., then g0's next, ...): a stage runs its windows in launch order, and a
        group's next window waits on the device for the group's window before it, so a stage always has another
        group's window to run meanwhile."""
        for _ in range(self.lookahead + 1):
            for g in range(len(self.groups)):
                # a constrained slot's mask follows its last token, which the host must have read. One group: its
                # next window's layers are queued now and its sampling once that token is read (`_read`); pipelined
                # groups sample in the stages' workers, so such a group runs no window ahead while it is active.
                constrained = any(self.slots[i].matcher is not None and self.slots[i].active
                                  for i in self.groups[g])
                ahead = 0 if constrained and len(self.groups) > 1 else self.lookahead
                in_flight = [sw for sw in self._flight if sw.group == g]
                if len(in_flight) > ahead or (in_flight and in_flight[-1].deferred):
                    continue  # a window not yet sampled cannot feed the next one
                self._launch(g, defer=constrained and bool(in_flight))
        return self._read(self._flight.popleft()) if self._flight else []

    def flush(self) -> list[Event]:
        """Read every window in flight (before a slot changes hands); their events in launch order."""
        events = []
        while self._flight:
            events += self._read(self._flight.popleft())
        return events

    def _build(self, members: range, latest: SlotWindow | None, group: int) -> SlotWindow | None:
        """The next window of these slots: a row per decoding slot, then prompt chunks within the budget; its
        rows' positions become the states' (prompt tokens join `state.tokens` now, a decode row's once read).
        With a window of theirs in flight (`latest`), the decoding slots are that window's samplers that are still
        active and not certain to end, and take the tokens it sampled, on the device."""
        if latest is None:
            decoding = [i for i in members if self.slots[i].active and not self.slots[i].unread]
        else:  # a slot decodes only after the window holding its prompt's last row, which is `latest` or older
            decoding = [i for i in latest.samplers if self.slots[i].active and not self._ends_after_pending(i)]
        left = self.budget - len(decoding)
        drafts = self._drafts(decoding, left) if latest is None and self.speculative else {}
        left -= sum(len(d) for d in drafts.values())
        chunks: list[tuple[int, list[int]]] = []
        checkpoints: list[int] = []  # slots whose GDN states are kept after this window (`_next_checkpoint`)
        for i in sorted((i for i in members if self.slots[i].reading and self.slots[i].follows is None),
                        key=lambda i: self.slots[i].admitted):
            if left <= 0:
                break
            slot = self.slots[i]
            take, cut = left, self._next_checkpoint(slot)
            if cut is not None and cut - slot.state.length <= left:  # the chunk ends where a checkpoint is kept
                take = cut - slot.state.length
                checkpoints.append(i)
            ids, slot.unread = slot.unread[:take], slot.unread[take:]
            chunks.append((i, ids))
            left -= len(ids)
        if not decoding and not chunks:
            return None
        short = self._short_chunks(chunks)
        chunks.sort(key=lambda c: len(c[1]) != 1 and c[0] not in short)  # they join the decode rows (`Window.split`)
        unread_left = {i for i, _ in chunks if self.slots[i].unread}  # chunks that are not their prompt's last
        parts = [(self.slots[i].state, [0], False) if latest is not None else
                 (self.slots[i].state, [self.slots[i].next_token] + drafts[i], "apart") if i in drafts else
                 (self.slots[i].state, [self.slots[i].next_token], False) for i in decoding]
        parts += [(self.slots[i].state, ids, False if i not in unread_left else None, i in short) for i, ids in chunks]
        window = Window.build(parts, self.engine.device, fed=len(decoding) if latest is not None else 0)
        samplers = [i for i in decoding for _ in range(1 + len(drafts.get(i, ())))]
        samplers += [i for i, _ in chunks if i not in unread_left]
        read = {i for i, _ in chunks}
        leaders = {i: j for j, i in enumerate(samplers) if i in read}  # samplers whose prompt's last row is here
        followers = [f for f in members if self.slots[f].active and self.slots[f].follows in leaders]
        shared = [leaders[self.slots[f].follows] for f in followers]
        samplers += followers
        members = frozenset(decoding).union(i for i, _ in chunks).union(followers)
        spans, row = {}, 0
        for i in decoding:
            spans[i] = (row, 1 + len(drafts.get(i, ())), self.slots[i].state.length)
            row += spans[i][1]
        for i, ids in chunks:
            spans[i] = (row, len(ids), self.slots[i].state.length)
            row += len(ids)
        sw = SlotWindow(window, decoding, samplers, members, sum(len(ids) for _, ids in chunks), group=group,
                        drafts=drafts, spans=spans, shared=shared, checkpoints=checkpoints)
        for f in followers:  # the leader's state once its prompt is read (`_share` queues the copy)
            slot = self.slots[f]
            slot.unread = []
            slot.state.length, slot.state.tokens = len(slot.prompt), list(slot.prompt)
        for i in decoding:  # the rows' positions are the state's now; their tokens join `state.tokens` when read
            self.slots[i].state.length += 1 + len(drafts.get(i, ()))
        for i, ids in chunks:
            self.slots[i].state.length += len(ids)
            self.slots[i].state.tokens += ids
        return sw

    def _short_chunks(self, chunks: list[tuple[int, list[int]]]) -> set[int]:
        """The slots whose prompt chunk runs with the decode rows, a row per position (`Window.build`'s `apart`):
        chunks of 2 to `short_chunk_rows` rows, at most that many rows in all, on the Triton decode kernels (the
        torch reference runs the decode rows one segment at a time; the GDN decode step takes a sequence's rows in
        order)."""
        if self.engine.kernels != "triton" or not self.short_chunk_rows:
            return set()
        short, room = set(), self.short_chunk_rows
        for i, ids in chunks:
            if 1 < len(ids) <= room:
                short.add(i)
                room -= len(ids)
        return short

    def _drafts(self, decoding: list[int], room: int) -> dict[int, list[int]]:
        """Draft tokens for the decoding slots, within `room` rows of the window (on the CPU, within the rows their
        last block of rows leaves free: `SpeculativeConfig.keeps_to_free_rows`): at most what their max_new and
        cells leave, and one more than the slot's last accepted count (a slot whose text stopped repeating drafts
        one token a window, which costs little, until the lookup is right again). Greedy and sampled slots alike:
        `_verify` keeps a draft iff it is the token its row picked (docs/BATCHING.md, drafts)."""
        spec, out = self.speculative, {}
        room = min(room, self._draft_rows(len(decoding)))
        if self.pool.keep_conv:  # each draft keeps a GDN state in a keep slot until its window is verified
            room = min(room, len(self.pool.keep_free))
        for i in decoding:
            slot = self.slots[i]
            if room <= 0:
                break
            if slot.matcher is not None:  # its mask follows each token: no drafts
                continue
            k = min(slot.draft_len, room, slot.max_new - len(slot.generated) - 1,
                    slot.state.max_cells - slot.state.length - 2)
            if k < 1:
                continue
            if self.mtp is not None:
                proposal = slot.mtp_drafts[:k]
            else:
                proposal = propose(slot.state.tokens + [slot.next_token], k, spec.prompt_lookup_max,
                                   spec.prompt_lookup_min)
            if proposal:
                out[i] = proposal
                room -= len(proposal)
        return out

    def _draft_rows(self, decoding: int) -> int:
        """How many rows drafts may take in a window beside `decoding` decoding slots (its budget aside): none while
        more than `max_active` slots are active (such a window is bound by compute); on the CPU, for drafts kept to
        free rows (`SpeculativeConfig.keeps_to_free_rows`), those the decoding slots leave in their last block."""
        spec = self.speculative
        if sum(s.active for s in self.slots) > spec.max_active:
            return 0
        if spec.keeps_to_free_rows and self.row_block:
            return -decoding % self.row_block
        return self.budget

    def _launch(self, group: int, defer: bool = False) -> None:
        """Launch the group's next window, if it has a row to run (`_build`). `defer` (one group only): queue its
        layers now and its sampling when the window before it is read (`_read`: the masks of its constrained rows
        follow the tokens of that window)."""
        latest = next((sw for sw in reversed(self._flight) if sw.group == group), None)
        sw = self._build(self.groups[group], latest, group)
        if sw is None:
            return
        feed = None
        if latest is not None and sw.decoding:
            row_of = {slot: j for j, slot in enumerate(latest.samplers)}
            index = None if sw.decoding == latest.samplers else [row_of[i] for i in sw.decoding]

            def feed() -> tuple[Handoff, list[int] | None]:  # the latest window's tokens, once it is queued
                if latest.future is not None:
                    latest.future.result()
                return Handoff(latest.sampled, latest.copied), index

        window = sw.window
        if len(self.groups) == 1:
            if feed is not None:
                sent, index = feed()
                window = sw.window = window.feed(sent.x if index is None else
                                                 sent.x[row_tensor(index, torch.int64, sent.x.device)])
            logits = self.engine.forward(window)
            self._keep_checkpoints(sw)
            self._share(sw)
            if defer:
                sw.logits, sw.deferred = logits, True
                if self.mtp is not None:
                    sw.hidden = self.mtp.hidden
            else:
                self._then(sw, logits)
        else:  # fed and sampled in the stages' workers: the host thread only queues
            sw.future = self.engine.pipeline.launch(window, tokens=feed, then=lambda logits: self._then(sw, logits))
        self._flight.append(sw)

    def _next_checkpoint(self, slot: Slot) -> int | None:
        """Where the reading slot's next GDN checkpoint falls (`--checkpoint-every`): the next multiple of it, or its
        prompt's last position (so the same prompt, or one that goes on from it, reads at most its last token
        again) when at least PROMPT_END_CHECKPOINT_MIN tokens were read since the last checkpoint or the reused
        prefix, whichever comes first; None without GDN layers, checkpoints or one ahead in this prompt. Not with
        pipelined groups (the stages' workers queue the windows)."""
        every = self.engine.checkpoint_every
        if every is None or not slot.state.conv or len(self.groups) > 1:
            return None
        at, end = slot.state.length, len(slot.prompt) - 1
        since = max([slot.num_reused, *(c for c in slot.state.checkpoints if c <= at)])
        cuts = [(at // every + 1) * every] if every else []
        if end - since >= PROMPT_END_CHECKPOINT_MIN:  # a short read is not worth a window of its own at the end
            cuts.append(end)
        cuts = [c for c in cuts if at < c <= end and c not in slot.state.checkpoints]
        return min(cuts, default=None)

    def _keep_checkpoints(self, sw: SlotWindow) -> None:
        """Behind the window's layers: host copies of the GDN states of the slots whose chunk ended at a
        checkpoint."""
        summed = self.engine.parking.budget > 0  # only a parked conversation's restore checks the sums
        for i in sw.checkpoints:
            self.slots[i].state.checkpoint(summed)

    def _share(self, sw: SlotWindow) -> None:
        """Queue, behind the window's layers, the copy of each leader's state (its prompt just read) into the slots
        that share its read (`_leader`): K/V cells and GDN states, on every stage's device."""
        if not sw.shared:
            return
        for f, k in zip(sw.samplers[-len(sw.shared):], sw.shared):
            slot = self.slots[f]
            slot.state.copy_from(self.slots[sw.samplers[k]].state, len(slot.prompt))
            slot.follows = None

    def _logit_positions(self, sw: SlotWindow) -> list[int]:
        """Per sampler: the position its sampled token takes (a slot sharing a leader's row: the leader's)."""
        positions = [sw.window.host[1][j] + 1 for j in sw.window.host[2]]
        return positions + [positions[k] for k in sw.shared]

    def _then(self, sw: SlotWindow, logits: torch.Tensor) -> None:
        """Sample each sampler's next token on the device and start its copy to the host (on the last stage's
        device; in its worker for pipelined groups)."""
        if sw.logits is None:
            sw.logits = logits
            if self.mtp is not None:
                sw.hidden = self.mtp.hidden
        positions = self._logit_positions(sw)  # the position each sampled token takes
        if sw.shared:  # the rows of the slots sharing a leader's prompt read: copies of the leader's
            logits = torch.cat([logits, logits.index_select(0, row_tensor(sw.shared, torch.int64, logits.device))])
        sw.sampled = self._sample(sw.samplers, self._masked(sw, logits), [self.slots[i].params for i in sw.samplers],
                                  positions, sw.drafts)
        self._logprobs(sw, logits)
        sw.host, sw.copied = host_copy(sw.sampled)

    @torch.inference_mode()  # the logits are the forward's (an inference tensor), masked in place
    def _masked(self, sw: SlotWindow, logits: torch.Tensor) -> torch.Tensor:
        """The logits with each constrained sampler row's forbidden tokens at -inf (other rows unchanged bit for bit;
        in place, or in a copy when a constrained row reports log-probabilities, which are of the raw logits). The
        masks are filled on the host from the matchers, which have accepted every token before this row's (`step`
        defers the sampling of a window until the one before it is read)."""
        rows = [(self.slots[i].matcher, j) for j, i in enumerate(sw.samplers)
                if self.slots[i].matcher is not None and self.slots[i].active]  # an ended slot's token is dropped
        if not rows:
            return logits
        if self._bitmask is None:
            self._bitmask = HostBitmask(self.engine.grammars.vocab, logits.device)
        bitmask = self._bitmask.take(len(sw.samplers))
        fill_bitmask(bitmask, rows)
        # in place unless a constrained row reports log-probabilities, which are of the raw logits
        masked = logits.clone() if any(self.slots[sw.samplers[j]].logprobs is not None for _, j in rows) else logits
        apply_bitmask(masked, bitmask, [j for _, j in rows])
        self._bitmask.sent()
        return masked

    def _logprobs(self, sw: SlotWindow, logits: torch.Tensor) -> None:
        """For the sampler rows whose slot reports log-probabilities: the raw log-softmax of their logits (before
        penalties, temperature and filters, as vLLM reports by default) at the sampled token, and the top ones, on
        their way to the host with the tokens."""
        rows = [j for j, i in enumerate(sw.samplers) if self.slots[i].logprobs is not None]
        if not rows:
            return
        k = max(self.slots[sw.samplers[j]].logprobs for j in rows)
        index = row_tensor(rows, torch.int64, logits.device)
        sw.logprob_rows = {j: r for r, j in enumerate(rows)}
        sw.logprob_host = tuple(host_copy(t)[0] for t in log_probabilities(logits.index_select(0, index),
                                                                            sw.sampled.index_select(0, index), k))

    def _ends_after_pending(self, index: int) -> bool:
        """Whether the slot's token in flight certainly ends it (max_new or max_cells): no row goes behind it."""
        slot = self.slots[index]
        return len(slot.generated) + 1 >= slot.max_new or slot.state.length + 1 >= slot.state.max_cells

    def _read(self, sw: SlotWindow) -> list[Event]:
        """Wait for the window's tokens, commit its rows and record each active sampler's token."""
        if sw.future is not None:
            sw.future.result()
        if sw.copied is not None:
            sw.copied.synchronize()
        for i in sw.decoding:
            self.slots[i].state.tokens.append(self.slots[i].next_token)
        self._read_log.append((len(sw.decoding) + sum(len(d) for d in sw.drafts.values()), sw.prompt_rows))
        lengths = self._logit_positions(sw)
        tokens = sw.host.tolist() if sw.samplers else []
        rows = list(range(len(sw.samplers)))
        kept = self._verify(sw, tokens, lengths) if sw.drafts else (sw.samplers, tokens, lengths, rows)
        if self.mtp is not None:
            self._run_mtp(sw, kept[0], kept[1])
        events = self._record(*kept[:3], self._logprob_entries(sw, kept[3]))
        later = next((w for w in self._flight if w.group == sw.group), None)
        if later is not None and later.deferred:  # (`_launch`) its masks follow these tokens
            later.deferred = False
            self._then(later, later.logits)
        return events

    def _logprob_entries(self, sw: SlotWindow, rows: list[int]) -> list | None:
        """Per kept row: (its token's log-probability, [(top id, log-probability)...]) or None."""
        if sw.logprob_host is None:
            return None
        chosen, top_values, top_ids = (t.tolist() for t in sw.logprob_host)
        out = []
        for j in rows:
            r = sw.logprob_rows.get(j)
            if r is None:
                out.append(None)
                continue
            k = self.slots[sw.samplers[j]].logprobs
            out.append((chosen[r], list(zip(top_ids[r][:k], top_values[r][:k]))))
        return out

    def _verify(self, sw: SlotWindow, tokens: list[int], lengths: list[int]
                ) -> tuple[list[int], list[int], list[int], list[int]]:
        """A drafting slot's rows picked a token each (argmax, or sampled with the random number of (seed,
        position)): keep its drafts while each equals the token its row before picked, then that row's own token,
        so the slot gains 1 + accepted tokens, exactly those decoding without drafts gives. For a sampled row this
        is speculative sampling with a draft of probability one: a draft d is kept with probability p(d), and a
        rejected row's pick is distributed as p without d, renormalised. Its state keeps the rows of the kept
        drafts and forgets the others; its penalty counts gain the kept tokens. Returns the samplers, tokens,
        lengths and sampler rows to record, the rejected rows' left out."""
        indices, kept, kept_lengths, rows = [], [], [], []
        j = 0
        while j < len(sw.samplers):
            i = sw.samplers[j]
            drafted = sw.drafts.get(i)  # a drafting slot's rows are consecutive samplers, its last token's first
            if not drafted:
                indices.append(i), kept.append(tokens[j]), kept_lengths.append(lengths[j]), rows.append(j)
                j += 1
                continue
            accepted = 0
            while accepted < len(drafted) and drafted[accepted] == tokens[j + accepted]:
                accepted += 1
            self._count_spec(len(drafted), accepted)
            if self.speculative.adaptive:
                self.slots[i].draft_len = min(self.speculative.num_speculative_tokens, accepted + 1)
            slot = self.slots[i]
            slot.state.tokens += drafted[:accepted]
            slot.state.rollback(lengths[j] + accepted)  # the rows of the rejected drafts are forgotten
            n = accepted + 1
            if slot.counts is not None:
                kept_ids = row_tensor(tokens[j : j + n], torch.int64, slot.counts.device)
                slot.counts.index_add_(0, kept_ids, torch.ones(n, dtype=torch.int32, device=slot.counts.device))
            indices += [i] * n
            kept += tokens[j : j + n]
            kept_lengths += lengths[j : j + n]
            rows += range(j, j + n)
            j += len(drafted) + 1
        return indices, kept, kept_lengths, rows

    def _run_mtp(self, sw: SlotWindow, indices: list[int], tokens: list[int]) -> None:
        """After a window is verified: the MTP layer reads each of its slots' kept rows t (the row's final hidden
        state and the token at t + 1: the prompt's next, a kept draft, or the token sampled), which makes their MTP
        cells; then each slot that decodes next chains it `draft_len` times from its last row for its next drafts
        (within the rows drafts may take in the next window: `_draft_rows`).
        A chained row's cell lies past the kept rows and is made again once the position is read.

        While the next window can take no drafts at all (more slots active than `max_active`, or no free rows in
        the CPU's block), the MTP layer does not run: each slot keeps its rows' hidden states and next tokens
        (`Slot.mtp_pending`, a few KB a row) and the first window that may draft again reads them with its own rows
        in one pass, so the cells are those of a layer that never paused and a paused layer costs nothing. A slot
        whose waiting rows would pass `MTP_PENDING_ROWS` has them read now (one pass, no drafts), which bounds
        their memory on a busy engine."""
        following = dict(zip(indices, tokens))  # a sampling slot's last kept token (the next it decodes)
        for i in sw.spans:
            self.slots[i].mtp_drafts = []
        # the drafts the next window can take (`_draft_rows`; about as many slots decode in it as now)
        room = self._draft_rows(sum(self.slots[i].active and not self.slots[i].unread for i in self.groups[sw.group]))
        hidden, inputs, segments, logit_rows, chains = [], [], [], [], []
        r = 0
        for i, (start, n, first_pos) in sw.spans.items():
            slot = self.slots[i]
            if i in following:
                n = slot.state.length - first_pos  # its kept rows (the verified drafts among them)
                after = following[i]
            elif slot.unread:
                after = slot.unread[0]  # a prompt chunk that is not its prompt's last
            else:
                continue  # stopped while its prompt was read: it keeps no state worth drafting from
            rows = (first_pos, sw.hidden[start : start + n], slot.state.tokens[first_pos + 1 : first_pos + n] + [after])
            pending = slot.mtp_pending
            if pending and pending[-1][0] + len(pending[-1][2]) != first_pos:
                pending.clear()  # not the rows just before these (cannot happen while the slot keeps its sequence)
            if room <= 0 and sum(len(p[2]) for p in pending) + n <= MTP_PENDING_ROWS:
                pending.append((first_pos, rows[1].clone(), rows[2]))
                continue
            parts = pending + [rows]
            slot.mtp_pending = []
            count = sum(len(p[2]) for p in parts)
            hidden += [p[1] for p in parts]
            inputs += [t for p in parts for t in p[2]]
            segments.append(Segment(slot.state, r, r + count, parts[0][0]))
            r += count
            if i in following and slot.active and slot.draft_len:
                logit_rows.append(r - 1)
                chains.append(i)
        if not hidden:
            return
        lengths = {}
        for i in chains:
            lengths[i] = min(self.slots[i].draft_len, room)
            room -= lengths[i]
        keep = [j for j, i in enumerate(chains) if lengths[i] > 0]
        chains, logit_rows = [chains[j] for j in keep], [logit_rows[j] for j in keep]
        device = self.mtp.device
        window = self._mtp_window(segments, logit_rows)
        out, picks = self.mtp.run_mtp(torch.cat(hidden) if len(hidden) > 1 else hidden[0],
                                      row_tensor(inputs, torch.int64, device), window)
        drafts = {i: [p] for i, p in zip(chains, picks.tolist())}
        last = dict(zip(chains, out[window.logit_rows]))  # each chain's latest normed MTP output: its next h
        for step in range(1, max((lengths[i] for i in chains), default=0)):
            chains = [i for i in chains if lengths[i] > step
                      and self.slots[i].state.length + step < self.slots[i].state.max_cells]
            if not chains:
                break
            window = self._mtp_window([Segment(self.slots[i].state, j, j + 1, self.slots[i].state.length + step - 1)
                                       for j, i in enumerate(chains)], list(range(len(chains))))
            out, picks = self.mtp.run_mtp(torch.stack([last[i] for i in chains]),
                                          row_tensor([drafts[i][-1] for i in chains], torch.int64, device), window)
            for j, (i, p) in enumerate(zip(chains, picks.tolist())):
                drafts[i].append(p)
                last[i] = out[j]
        for i, d in drafts.items():
            self.slots[i].mtp_drafts = d

    def _mtp_window(self, segments: list[Segment], logit_rows: list[int]) -> Window:
        """A window over MTP rows: `segments` of consecutive positions, their cells in the slots' pool."""
        device = self.mtp.device
        positions = [s.first_pos + j for s in segments for j in range(s.num_rows)]
        as_tensor = lambda xs, dtype=torch.int64: row_tensor(xs, dtype, device)  # noqa: E731
        return Window(None, as_tensor(positions), segments, as_tensor(logit_rows), self.pool,
                      as_tensor([s.state.index for s in segments], torch.int32))

    def _count_spec(self, drafted: int, accepted: int) -> None:
        self.spec_counts["drafts"] += 1
        self.spec_counts["draft_tokens"] += drafted
        self.spec_counts["accepted"] += accepted
        for pos in range(accepted):
            self.spec_accepted_per_pos[pos] += 1

    def _sample(self, indices: list[int], logits: torch.Tensor, params: list[SamplingParams],
                positions: list[int], drafts: dict[int, list[int]] | None = None) -> torch.Tensor:
        """Each row's next token, on the device (no host sync); the penalty counts of its slot count it. A drafting
        slot's rows (`drafts`: slot -> its drafts; its rows are consecutive, its last token's first) each count the
        drafts before them as generated, as the row would decoding without drafts; `_verify` adds the kept tokens."""
        if not indices:
            return torch.empty(0, dtype=torch.int64, device=logits.device)
        drafts = drafts or {}
        slots = [self.slots[i] for i in indices]
        seen = counts = None
        if any(p.has_penalties for p in params):
            vocab, device = logits.shape[-1], logits.device
            none_b = torch.zeros(vocab, dtype=torch.bool, device=device)
            none_c = torch.zeros(vocab, dtype=torch.int32, device=device)
            seen = torch.stack([s.seen_prompt if s.seen_prompt is not None else none_b for s in slots])
            rows, j = [], 0
            while j < len(indices):
                s, drafted = slots[j], drafts.get(indices[j], [])
                base = s.counts if s.counts is not None else none_c
                rows.append(base)
                for o in range(len(drafted)):  # row o + 1 follows drafts[:o + 1]
                    base = base.clone()
                    base[drafted[o]] += 1
                    rows.append(base)
                j += 1 + len(drafted)
            counts = torch.stack(rows)
        tokens = sample(self._before_min_tokens(indices, logits, drafts), params, positions, seen, counts)
        for j, (i, s) in enumerate(zip(indices, slots)):
            if s.counts is not None and i not in drafts:
                s.counts.index_add_(0, tokens[j : j + 1], torch.ones(1, dtype=torch.int32, device=tokens.device))
        return tokens

    def _before_min_tokens(self, indices: list[int], logits: torch.Tensor, drafts: dict[int, list[int]]) -> torch.Tensor:
        """The logits with each slot's stop tokens at -inf in the rows that draw one of its first `min_tokens`
        tokens (a drafting slot's row o draws token len(generated) + o + 1); a copy, or the input when no row does."""
        rows, tokens, j = [], [], 0
        while j < len(indices):
            s = self.slots[indices[j]]
            n = 1 + len(drafts.get(indices[j], []))
            for o in range(min(n, max(0, s.params.min_tokens - len(s.generated)))):
                rows += [j + o] * len(s.stop_ids)
                tokens += sorted(s.stop_ids)
            j += n
        if not rows:
            return logits
        at = row_tensor([rows, tokens], torch.int64, logits.device)
        return logits.index_put((at[0], at[1]), logits.new_full((len(rows),), float("-inf")))

    def _record(self, indices: list[int], tokens: list[int], lengths: list[int],
                logprobs: list | None = None) -> list[Event]:
        """Give each active slot its token and end the slots that are done. lengths[j]: the positions slot j held
        once the row that sampled its token was committed (later rows may be in flight); logprobs[j]: what its
        event reports (`Event.logprobs`)."""
        events = []
        for j, (i, token, length) in enumerate(zip(indices, tokens, lengths)):
            slot = self.slots[i]
            if not slot.active:  # stopped, or ended by its previous token, while this row was in flight
                continue
            slot.generated.append(token)
            reason = None
            if slot.matcher is not None and not slot.matcher.accept(token):
                log.warning("slot %d: token %d refused by its grammar (%s); the answer ends", i, token,
                            slot.matcher.error)
                reason = "stop"
            if token in slot.stop_ids or (slot.matcher is not None and slot.matcher.is_finished()):
                reason = "stop"
            elif len(slot.generated) >= slot.max_new or length + 1 >= slot.state.max_cells:
                reason = "length"
            if reason:
                self._release(slot)
            events.append(Event(i, token, reason, logprobs[j] if logprobs else None))
        return events


def log_probabilities(logits: torch.Tensor, chosen: torch.Tensor, k: int) -> tuple[torch.Tensor, ...]:
    """Rows of logits [N, V] as log-probabilities are reported (the raw log-softmax): the one of each row's chosen
    token ([N]), and the k largest with their ids ([N, k] each, most likely first)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    values, ids = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
    return lp.gather(1, chosen[:, None])[:, 0], values, ids


def _entries(chosen: torch.Tensor, values: torch.Tensor, ids: torch.Tensor) -> list[tuple[float, list]]:
    """`log_probabilities`' tensors as the host lists an event or a PLP line carries: (the token's, [(id, value)])."""
    return [(c, list(zip(i, v))) for c, i, v in zip(chosen.tolist(), ids.tolist(), values.tolist())]


def _decode_block(engine) -> int:
    """The rows a CPU engine's decode products take at once: 1 where its matrices are packed for the CPU's own kernel
    (`strata.kernels.cpu_packed`: rows unpadded, a row more costs about a third of one on SmolLM2), else the measured
    block of oneDNN's products (`row_block`)."""
    packed = any(getattr(w, "host_kernel", False) for stage in engine.stages
                 for layer in stage.forward.weights.layers.values() for w in layer.values())
    return 1 if packed else row_block(engine.dtype)
