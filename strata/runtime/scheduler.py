"""The engine's scheduler: owns the waiting line, gives requests slots, and turns windows into events.

It runs in-process (tests drive `handle` and `step` directly) and inside the `strata engine` process
(`strata.runtime.pipe` only moves lines between the pipes and this object). Requests arrive by id (`ADD`) and
wait in arrival order, at most `max_waiting` of them (beyond: `ERR <id> full`). Before each window every waiting
request that a free slot can take is given one (free: idle, and no row of it in a window in flight, so a slot
never changes hands under a row of its previous owner; the windows in flight stay in flight, so an arrival does
not stop the running streams' pipeline); its prompt is then read inside the windows, beside the decoding rows
(`strata.runtime.slots`). One `step` launches what may run and reads one window.
"""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from typing import Callable

from strata import protocol
from strata.experts.hotness import REFRESH_WINDOWS
from strata.errors import StrataError
from strata.protocol import Abort, Add, ProtocolError, Quit, Request
from strata.runtime.generate import Engine
from strata.runtime.slots import Event
from strata.state.parking import reusable

log = logging.getLogger("strata.engine")

DEFAULT_MAX_WAITING = 256


class Scheduler:
    def __init__(self, engine: Engine, num_slots: int, emit: Callable[[str], None],
                 max_waiting: int = DEFAULT_MAX_WAITING):
        if max_waiting < 0:
            raise StrataError(f"--max-waiting {max_waiting}: give 0 or more requests")
        self.engine = engine
        self.slots = engine.init_slots(num_slots)
        self.emit = emit
        self.max_waiting = max_waiting
        self.waiting: OrderedDict[str, Request] = OrderedDict()  # arrival order
        self.owner: list[str | None] = [None] * num_slots  # the request each slot runs
        self.running: dict[str, int] = {}  # request id -> slot
        self._parked = (0, 0, 0, 0, 0, 0, 0)  # the conversations and bytes (RAM, disk, VRAM) the last PARKED reported
        self._pools = [p for stage in engine.stages for p in stage.forward.pools.values()]  # CPU expert pools
        self._expert_pairs = (0, 0)  # the (device, CPU) pair counts the last EXPERTS event reported
        self._experts_said = 0.0  # when (time.monotonic) that was
        self._spec_said = 0  # the drafts the last SPEC event reported
        self._windows_since_refresh = 0  # --expert-residency hot: windows since the resident experts were refreshed

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.slots.active or self.slots.in_flight)

    def facts(self) -> dict:
        spec = self.engine.spec
        return {"family": spec.family, "vocab_size": spec.vocab_size, "num_layers": spec.num_layers,
                "max_cells": self.engine.max_cells, "batch": len(self.slots),
                "batch_groups": len(self.slots.groups), "max_window_tokens": self.slots.budget,
                "max_waiting": self.max_waiting, "lookahead": self.slots.lookahead, "stages": len(self.engine.stages),
                "device": str(self.engine.device), "dtype": str(self.engine.dtype).removeprefix("torch."),
                "expert_residency": self.engine.expert_residency(), "pid": os.getpid(),
                "speculative": str(self.engine.speculative) if self.engine.speculative else None}

    def handle(self, line: str) -> bool:
        """Carry out one command line; False once the engine should exit. Bad input answers ERR and changes nothing."""
        try:
            command = protocol.parse_command(line)
        except ProtocolError as e:
            self.emit(protocol.err(protocol.command_id(line), protocol.ERR_INVALID, str(e)))
            return True
        if isinstance(command, Quit):
            return False
        try:
            if isinstance(command, Add):
                self._add(command.id, command.request)
            elif isinstance(command, Abort):
                self._abort(command.id)
        except StrataError as e:
            self.emit(protocol.err(command.id, protocol.ERR_INVALID, str(e)))
        except Exception as e:  # keep serving the other conversations
            log.exception("internal error on %r", line[:200])
            self.emit(protocol.err(command.id, protocol.ERR_INTERNAL, f"internal error: {type(e).__name__}: {e}"))
        return True

    def step(self) -> None:
        """Give waiting requests free slots, launch what may run and read one window; emit what it gave. A window
        that fails (an error the checks at admission did not foresee) ends the requests it ran with an internal
        error; the engine carries on with the waiting line (a device fault the CUDA context cannot survive still
        ends the process, which the server restarts)."""
        self._admit_waiting()
        try:
            events = self.slots.step()
        except Exception as e:
            if _fatal(e):
                raise
            log.exception("a window failed; ending the requests it ran")
            self._fail_running(f"internal error in a window: {type(e).__name__}: {e}")
            return
        self._emit_events(events)
        self._refresh_experts()
        self._report_experts()
        self._report_spec()
        if self.engine.parking.disk is not None:  # its files are written in the background
            self._report_parking()

    def _fail_running(self, message: str) -> None:
        for index in self.slots.abandon():
            rid = self.owner[index]
            self.owner[index] = None
            if rid is not None and self.running.pop(rid, None) is not None:
                self.emit(protocol.err(rid, protocol.ERR_INTERNAL, message))

    # requests

    def _stops(self, request: Request) -> frozenset[int]:
        tok = self.engine.tokenizer
        model_stops = tok.stop_ids if tok and not request.ignore_eos else frozenset()
        return model_stops | request.stop_ids

    def _add(self, rid: str, request: Request) -> None:
        if rid in self.waiting or rid in self.running:
            raise StrataError(f"request id {rid} is already in use; give each request its own id")
        self.slots.check_request(request.ids, request.max_new, request.params)
        if len(self.waiting) >= self.max_waiting and not self._could_start_now():
            self.emit(protocol.err(rid, protocol.ERR_FULL, f"the waiting line is full ({self.max_waiting} requests, "
                                                            "--max-waiting); retry later"))
            return
        self.waiting[rid] = request
        self.emit(protocol.wait(rid))

    def _could_start_now(self) -> bool:
        """Whether a request added now gets a slot at the next window without waiting behind others."""
        return not self.waiting and any(not s.active for s in self.slots.slots)

    def _abort(self, rid: str) -> None:
        """End the request now, waiting or running; an id that is not known (already ended) is ignored."""
        if rid in self.waiting:
            request = self.waiting.pop(rid)
            self.emit(protocol.end(rid, "abort", len(request.ids), 0, 0))
        elif rid in self.running:
            index = self.running.pop(rid)
            slot = self.slots.slots[index]
            self.slots.stop(index)
            self.owner[index] = None
            self.emit(protocol.end(rid, "abort", slot.num_prompt, len(slot.generated), slot.num_reused))

    def _admit_waiting(self) -> None:
        """Give each waiting request, in arrival order, a free slot: the one holding the longest reusable prefix of
        its prompt, else the one idle longest (what recently ended stays for its follow-up)."""
        if not self.waiting or all(s.active for s in self.slots.slots):
            return
        truncatable = self.engine.parking.truncatable
        while self.waiting:
            free = self.slots.free
            if not free:
                break
            rid, request = next(iter(self.waiting.items()))
            del self.waiting[rid]
            best = max(free, key=lambda i: (reusable(self.slots.slots[i].state.tokens, request.ids, truncatable,
                                                     self.slots.slots[i].state.checkpoints),
                                            -self.slots.slots[i].released))
            try:
                reused = self.slots.admit(best, request.ids, request.max_new, request.params, self._stops(request),
                                          logprobs=request.logprobs, grammar=request.grammar)
            except StrataError as e:
                self.emit(protocol.err(rid, protocol.ERR_INVALID, str(e)))
                continue
            self.owner[best], self.running[rid] = rid, best
            if request.prompt_logprobs is None:
                self.emit(protocol.run(rid, reused))
                continue
            try:
                scored, first = self.slots.read_prompt_scored(best, request.prompt_logprobs)
            except StrataError as e:
                self.slots.stop(best)
                self.owner[best] = None
                del self.running[rid]
                self.emit(protocol.err(rid, protocol.ERR_INVALID, str(e)))
                continue
            self.emit(protocol.run(rid, 0))
            for line in protocol.prompt_logprobs(rid, scored):
                self.emit(line)
            self._emit_events([first])
        self._report_parking()

    # events

    def _emit_events(self, events: list[Event]) -> None:
        for decode_rows, prompt_rows in self.slots.take_read_log():
            self.emit(protocol.window(decode_rows, prompt_rows))
        if not events:
            return
        for e in events:
            if e.logprobs is not None:
                self.emit(protocol.logprobs(self.owner[e.slot], e.token, *e.logprobs))
        self.emit(protocol.tokens([(self.owner[e.slot], e.token) for e in events]))
        for e in events:
            if e.finish_reason:
                rid = self.owner[e.slot]
                slot = self.slots.slots[e.slot]
                self.owner[e.slot] = None
                del self.running[rid]
                self.emit(protocol.end(rid, e.finish_reason, slot.num_prompt, len(slot.generated), slot.num_reused))

    def _refresh_experts(self) -> None:
        """With `--expert-residency hot`, every `REFRESH_WINDOWS` windows: the pooled layers' resident experts move
        toward the most routed ones (`Engine.refresh_experts`). Between windows of one slot group only: pipelined
        groups run stages on their workers meanwhile."""
        if not self._pools or self.engine.expert_residency_mode != "hot" or len(self.slots.groups) > 1:
            return
        self._windows_since_refresh += 1
        if self._windows_since_refresh >= REFRESH_WINDOWS:
            self._windows_since_refresh = 0
            swapped = self.engine.refresh_experts()
            if swapped:
                log.info("hot residency: %d experts swapped with the device's resident sets", swapped)

    def _report_experts(self) -> None:
        """Say EXPERTS (running totals of the pooled layers' routed pairs, computed on the device / on the CPU,
        the pools' host seconds and the expert bytes they read) when they changed: at most once a second while windows run, and once more when the engine goes idle."""
        if not self._pools:
            return
        total = sum(p.pairs_total for p in self._pools)
        on_cpu = sum(p.pairs_here for p in self._pools)
        uploaded = sum(p.pairs_uploaded for p in self._pools)
        counts = (total - on_cpu - uploaded, on_cpu, uploaded)
        now = time.monotonic()
        if counts != self._expert_pairs and (now - self._experts_said >= 1.0 or not self.busy):
            self._expert_pairs, self._experts_said = counts, now
            seconds = sum(p.busy_s for p in self._pools)
            read = sum(p.experts_read * p.expert_bytes for p in self._pools)
            up_bytes = sum(p.experts_uploaded * p.upload_expert_bytes for p in self._pools)
            self.emit(protocol.experts(counts[0], counts[1], seconds, read, counts[2], up_bytes))

    def _report_spec(self) -> None:
        """Say SPEC (running totals of drafts and accepted tokens) after a window whose slots drafted."""
        counts = self.slots.spec_counts
        if counts["drafts"] != self._spec_said:
            self._spec_said = counts["drafts"]
            self.emit(protocol.spec_decode(counts["drafts"], counts["draft_tokens"], counts["accepted"],
                                           self.slots.spec_accepted_per_pos))

    def _report_parking(self) -> None:
        """Say PARKED when the parked conversations or their bytes changed (admissions park and unpark them)."""
        lot = self.engine.parking
        for seconds, num_tokens, tier in lot.restores:
            self.emit(protocol.restored(seconds, num_tokens, tier))
        lot.restores.clear()
        disk = (lot.disk.conversations, lot.disk.nbytes) if lot.disk is not None else (0, 0)
        vram = (lot.vram.conversations, lot.vram.nbytes) if lot.vram is not None else (0, 0)
        if (lot.conversations, lot.nbytes, *disk, lot.reused_bytes, *vram) != self._parked:
            self._parked = (lot.conversations, lot.nbytes, *disk, lot.reused_bytes, *vram)
            self.emit(protocol.parked(*self._parked))


def _fatal(e: Exception) -> bool:
    """A device error after which the CUDA context cannot be used again (the process must restart)."""
    text = str(e)
    return "CUDA error" in text or "device-side assert" in text or "illegal memory access" in text
