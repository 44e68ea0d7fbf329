"""The engine's scheduler: turns protocol commands into work and work into events.

It runs in-process (tests drive `handle` and `step` directly) and inside the `strata engine` process
(`strata.runtime.pipe` only moves lines between the pipes and this object). One `step` runs one solo decode
step, if a solo generation is running, and one batch window over the active slots.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Callable, Iterator

from strata import protocol
from strata.errors import StrataError
from strata.protocol import BGen, BStop, Gen, ProtocolError, Quit, Request, Stop
from strata.runtime.generate import Engine
from strata.runtime.slots import Event

log = logging.getLogger("strata.engine")


class Scheduler:
    def __init__(self, engine: Engine, num_slots: int, emit: Callable[[str], None]):
        self.engine = engine
        self.slots = engine.init_slots(num_slots) if num_slots else None
        self.emit = emit
        self._solo: Iterator[tuple[int, str | None]] | None = None
        self._solo_counts = (0, 0, 0)  # prompt tokens, generated tokens, prompt tokens reused
        self._parked = (0, 0)  # the conversations and bytes the last PARKED event reported
        self._pools = [p for stage in engine.stages for p in stage.forward.pools.values()]  # CPU expert pools
        self._expert_pairs = (0, 0)  # the (device, CPU) pair counts the last EXPERTS event reported
        self._experts_said = 0.0  # when (time.monotonic) that was
        self._solo_state = engine.new_state()

    @property
    def busy(self) -> bool:
        return self._solo is not None or bool(self.slots and (self.slots.active or self.slots.in_flight))

    def facts(self) -> dict:
        spec = self.engine.spec
        return {"family": spec.family, "vocab_size": spec.vocab_size, "num_layers": spec.num_layers,
                "max_cells": self.engine.max_cells, "batch": len(self.slots) if self.slots else 0,
                "batch_groups": len(self.slots.groups) if self.slots else 0,
                "lookahead": self.slots.lookahead if self.slots else 0, "stages": len(self.engine.stages),
                "device": str(self.engine.device), "dtype": str(self.engine.dtype).removeprefix("torch."),
                "expert_residency": self.engine.expert_residency(), "pid": os.getpid()}

    def handle(self, line: str) -> bool:
        """Carry out one command line; False once the engine should exit. Bad input answers ERR and changes nothing."""
        try:
            command = protocol.parse_command(line)
        except ProtocolError as e:
            self.emit(protocol.err(str(e)))
            return True
        try:
            if isinstance(command, Quit):
                return False
            if isinstance(command, Gen):
                self._start_solo(command.request)
            elif isinstance(command, Stop):
                self._stop_solo()
            elif isinstance(command, BGen):
                self._admit(command.slot, command.request)
            elif isinstance(command, BStop):
                self._stop_slot(command.slot)
        except StrataError as e:
            self.emit(protocol.err(str(e)))
            if isinstance(command, BGen):
                self.emit(protocol.badm(command.slot, False))
        except Exception as e:  # keep serving the other conversations
            log.exception("internal error on %r", line)
            self.emit(protocol.err(f"internal error: {type(e).__name__}: {e}"))
            if isinstance(command, BGen):
                self.emit(protocol.badm(command.slot, False))
        self._report_parking()
        self._report_experts()
        return True

    def _report_experts(self) -> None:
        """Say EXPERTS (running totals of the pooled layers' routed pairs, computed on the device / on the CPU)
        when they changed: at most once a second while windows run, and once more when the engine goes idle."""
        if not self._pools:
            return
        total = sum(p.pairs_total for p in self._pools)
        on_cpu = sum(p.pairs_here for p in self._pools)
        counts = (total - on_cpu, on_cpu)
        now = time.monotonic()
        if counts != self._expert_pairs and (now - self._experts_said >= 1.0 or not self.busy):
            self._expert_pairs, self._experts_said = counts, now
            self.emit(protocol.experts(*counts))

    def _report_parking(self) -> None:
        """Say PARKED when the parked conversations or their bytes changed (admissions park and unpark them)."""
        lot = self.engine.parking
        if (lot.conversations, lot.nbytes) != self._parked:
            self._parked = (lot.conversations, lot.nbytes)
            self.emit(protocol.parked(*self._parked))

    def _idle_slot_states(self) -> list:
        """The idle slots' sequences: a solo run may copy a prefix from them."""
        return [s.state for s in self.slots.slots if not s.active] if self.slots else []

    def step(self) -> None:
        self._step()
        self._report_experts()

    def _step(self) -> None:
        if self._solo is not None:
            self._advance_solo()
        if self.slots is not None:
            self._emit_slot_events(self.slots.step())

    def _drain(self) -> None:
        """Read every window in flight (before a slot changes hands or a solo run looks at idle slots)."""
        if self.slots is not None:
            self._emit_slot_events(self.slots.flush())

    # solo path

    def _stops(self, request: Request) -> frozenset[int]:
        tok = self.engine.tokenizer
        model_stops = tok.stop_ids if tok and not request.ignore_eos else frozenset()
        return model_stops | request.stop_ids

    def _start_solo(self, request: Request) -> None:
        if self._solo is not None:
            raise StrataError("a solo generation is already running; send STOP and wait for its DONE first")
        self.engine.check_prompt(request.ids)
        request.params.validate()
        self._solo_counts = (len(request.ids), 0, 0)
        if request.max_new == 0:
            self.emit(protocol.done("length", len(request.ids), 0, 0))
            return
        self._drain()  # an idle slot may still have a row in flight
        reused = self.engine.reuse(self._solo_state, request.ids, self._idle_slot_states())
        self._solo_counts = (len(request.ids), 0, reused)
        self._solo = self.engine.stream(request.ids, request.max_new, request.params, self._stops(request),
                                        state=self._solo_state)
        self._advance_solo()  # reads the prompt and yields the first token

    def _advance_solo(self) -> None:
        token, reason = next(self._solo)
        prompt, generated, reused = self._solo_counts
        self._solo_counts = (prompt, generated + 1, reused)
        self.emit(protocol.token(token))
        if reason is not None:
            self._solo.close()
            self._solo = None
            self.emit(protocol.done(reason, prompt, generated + 1, reused))

    def _stop_solo(self) -> None:
        if self._solo is None:
            return  # idempotent: the generation had already ended with its DONE
        self._solo.close()
        self._solo = None
        self.emit(protocol.done("abort", *self._solo_counts))

    # batch slots

    def _require_slots(self):
        if self.slots is None:
            raise StrataError("this engine has no batch slots; start it with --batch N")
        return self.slots

    def _admit(self, index: int, request: Request) -> None:
        slots = self._require_slots()
        self._drain()
        event = slots.admit(index, request.ids, request.max_new, request.params, self._stops(request),
                            idle=[self._solo_state] if self._solo is None else [], resumed=request.resume)
        self.emit(protocol.badm(index, True, slots.reused))
        self._emit_slot_events([event])

    def _stop_slot(self, index: int) -> None:
        slots = self._require_slots()
        self._drain()
        slot = slots.check_slot(index)
        if slots.stop(index):
            self.emit(protocol.bdone(index, "abort", slot.num_prompt, len(slot.generated)))

    def _emit_slot_events(self, events: list[Event]) -> None:
        for e in events:
            self.emit(protocol.btoken(e.slot, e.token))
            if e.finish_reason:
                slot = self.slots.slots[e.slot]
                self.emit(protocol.bdone(e.slot, e.finish_reason, slot.num_prompt, len(slot.generated)))
