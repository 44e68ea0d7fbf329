"""Conversation parking: the host-RAM store on its own, then engines on tiny checkpoints whose conversations are
parked between turns by other conversations taking their slots."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from strata.config import EngineSettings
from strata.errors import StrataError
from strata.model.families import build_spec
from strata.model.loader import ModelFiles
from strata.runtime.generate import Engine
from strata.runtime.scheduler import Scheduler
from strata.state.parking import (
    DEFAULT_PARK_GB,
    GB,
    ParkingLot,
    Snapshot,
    SnapshotRefused,
    common_prefix,
    host_ram_bytes,
    park_budget,
    reusable,
    reuse_prefix,
    snapshot_bytes,
)
from strata.state.session import SessionState
from tests.protocol_lines import add, end_of, tokens
from tests.tiny_models import CASES, VOCAB, build

ATTENTION_ONLY, HYBRID = "llama-mha-untied", "qwen3_next"
MAX_CELLS = 64


# the store

def spec_of(name: str):
    import transformers

    config_cls, _, kwargs = CASES[name]
    return build_spec(getattr(transformers, config_cls)(**kwargs).to_dict(), name)[1]


def filled(spec, tokens: list[int], seed: int) -> SessionState:
    """A state that holds `tokens`, with random K/V cells and GDN states standing for what reading them wrote."""
    state = SessionState.standalone(spec, range(spec.num_layers), MAX_CELLS, torch.device("cpu"), torch.float32)
    generator = torch.Generator().manual_seed(seed)
    for t in (*state.k.values(), *state.v.values(), *state.conv.values(), *state.recurrent.values()):
        t.copy_(torch.randn(t.shape, generator=generator))
    state.length, state.tokens = len(tokens), list(tokens)
    return state


def assert_same_state(a: SessionState, b: SessionState) -> None:
    assert a.length == b.length and a.tokens == b.tokens
    n = a.length
    for i in a.k:
        assert torch.equal(a.k[i][:n], b.k[i][:n]) and torch.equal(a.v[i][:n], b.v[i][:n]), i
    for i in a.conv:
        assert torch.equal(a.conv[i], b.conv[i]) and torch.equal(a.recurrent[i], b.recurrent[i]), i


@pytest.fixture(scope="module", params=[ATTENTION_ONLY, HYBRID])
def spec(request):
    return spec_of(request.param)


def lot_for(spec, budget: int) -> ParkingLot:
    return ParkingLot(budget, truncatable=not spec.gdn_layers())


def test_what_a_held_state_can_serve():
    held = [1, 2, 3, 4]
    # attention only: any common prefix, always leaving one prompt token to read
    assert reusable(held, [1, 2, 9], truncatable=True) == 2
    assert reusable(held, [1, 2, 3, 4, 5], truncatable=True) == 4
    assert reusable(held, [1, 2, 3, 4], truncatable=True) == 3
    assert reusable(held, [1, 2], truncatable=True) == 1
    assert reusable(held, [7, 1, 2], truncatable=True) == 0
    assert reusable([], [1, 2], truncatable=True) == 0
    # with GDN layers: the whole held list must be a strict prefix of the prompt
    assert reusable(held, [1, 2, 3, 4, 5], truncatable=False) == 4
    assert reusable(held, [1, 2, 9, 9, 9], truncatable=False) == 0
    assert reusable(held, [1, 2, 3, 4], truncatable=False) == 0
    assert reusable(held, [1, 2, 3], truncatable=False) == 0
    long = list(range(1000))
    assert common_prefix(long, long[:637] + [-1] + long[638:]) == 637
    assert common_prefix(long, long[:10]) == 10 and common_prefix([5], [6]) == 0


def test_a_snapshot_restores_the_state_exactly(spec):
    tokens = list(range(10, 30))
    parked = filled(spec, tokens, seed=1)
    lot = lot_for(spec, 10**9)
    assert lot.park(parked)
    att, g = spec.attention, spec.gdn
    expected = 2 * len(spec.attention_layers()) * len(tokens) * att.num_kv_heads * att.head_dim * 4
    if spec.gdn_layers():
        expected += len(spec.gdn_layers()) * ((g.conv_kernel - 1) * g.conv_dim + g.num_v_heads * g.k_head_dim * g.v_head_dim) * 4
    assert lot.nbytes == snapshot_bytes(parked) == expected and lot.conversations == 1
    count, snap = lot.best(tokens + [99])
    assert count == len(tokens) and isinstance(snap, Snapshot)
    target = filled(spec, [7, 7, 7], seed=2)  # a sequence holding something else
    snap.restore(target, count)
    assert_same_state(target, parked)


def flip_a_byte(t: torch.Tensor, at: int = 5) -> None:
    t.view(-1).view(torch.uint8)[at] ^= 0x10


@pytest.mark.parametrize("damage", ["byte", "tokens", "model", "layers", "cells"])
def test_a_changed_or_foreign_snapshot_is_refused(spec, damage):
    """Checked before anything is written (model fingerprint, token hash, layers, shapes) and after the copy (the
    checksum): refused with what was wrong; the target is untouched, or reset when the bytes were wrong."""
    tokens = list(range(10, 30))
    lot = ParkingLot(10**9, truncatable=not spec.gdn_layers(), fingerprint="model-a")
    assert lot.park(filled(spec, tokens, seed=1))
    _, snap = lot.best(tokens + [99])
    target = filled(spec, [7, 7, 7], seed=2)
    if damage == "layers":  # a state of another layer range (another stage of a split)
        target = SessionState.standalone(spec, range(1, spec.num_layers), MAX_CELLS, torch.device("cpu"),
                                         torch.float32)
    if damage == "cells":
        target = SessionState.standalone(spec, range(spec.num_layers), 16, torch.device("cpu"), torch.float32)
    before = filled(spec, [7, 7, 7], seed=2) if damage not in ("layers", "cells") else None
    fingerprint = "model-b" if damage == "model" else "model-a"
    if damage == "byte":
        flip_a_byte(next(iter(snap.recurrent.values())) if spec.gdn_layers() else next(iter(snap.k.values())))
    if damage == "tokens":
        snap.tokens[3] += 1
    expected = {"byte": "bytes changed", "tokens": "token list", "model": "another model", "layers": "layers are",
                "cells": "cells"}[damage]
    with pytest.raises(SnapshotRefused, match=expected):
        snap.restore(target, len(tokens), fingerprint)
    if damage == "byte":
        assert target.length == 0 and target.tokens == []  # reset: its old content was parked before, as always
    elif before is not None:
        assert_same_state(target, before)  # nothing written


def test_the_budget_holds_and_the_least_recently_parked_go_first(spec):
    prompts = {name: [base + j for j in range(12)] for name, base in (("a", 0), ("b", 20), ("c", 40), ("d", 60))}
    states = {name: filled(spec, ids, seed=i) for i, (name, ids) in enumerate(prompts.items())}
    size = snapshot_bytes(states["a"])
    lot = lot_for(spec, int(2.5 * size))
    held = lambda name: lot.best(prompts[name] + [150])[0] == len(prompts[name])  # noqa: E731
    assert lot.park(states["a"]) and lot.park(states["b"])
    assert (lot.conversations, lot.nbytes, lot.evictions) == (2, 2 * size, 0)
    assert lot.park(states["c"])  # no room for three: "a", parked first, goes
    assert (lot.conversations, lot.nbytes, lot.evictions) == (2, 2 * size, 1)
    assert not held("a") and held("b") and held("c")
    _, b = lot.best(prompts["b"] + [150])
    lot.take(b)  # "b" went back to a slot ...
    assert lot.conversations == 1 and lot.nbytes == size
    assert lot.park(states["b"])  # ... and was parked again: now the most recent
    assert lot.park(states["d"])  # so "c" goes
    assert held("b") and held("d") and not held("c") and lot.evictions == 2
    assert lot.nbytes <= lot.budget


def test_nothing_is_parked_without_budget_room_or_tokens(spec):
    state = filled(spec, list(range(12)), seed=3)
    assert not lot_for(spec, 0).park(state)  # budget 0: parking is off
    too_small = lot_for(spec, snapshot_bytes(state) - 1)
    assert not too_small.park(state) and too_small.conversations == 0
    empty = filled(spec, [], seed=4)
    assert not lot_for(spec, 10**9).park(empty)


def test_the_lookup_takes_the_longest_prefix_by_the_models_rules(spec):
    gdn = bool(spec.gdn_layers())
    lot = lot_for(spec, 10**9)
    first, second = list(range(1, 11)), list(range(1, 6)) + [50, 51, 52]
    lot.park(filled(spec, first, seed=5))
    lot.park(filled(spec, second, seed=6))
    assert lot.conversations == 2
    count, snap = lot.best(list(range(1, 8)) + [99])  # shares 7 tokens with the first, 5 with the second
    assert (count, snap and snap.tokens) == ((0, None) if gdn else (7, first))
    count, snap = lot.best(first + [11])  # the whole first list is a prefix: either model
    assert count == 10 and snap.tokens == first
    count, snap = lot.best(second + [60, 61])
    assert count == 8 and snap.tokens == second
    assert lot.best([99, 1, 2]) == (0, None)


def test_a_later_turn_replaces_the_parked_earlier_one_without_gdn(spec):
    lot = lot_for(spec, 10**9)
    lot.park(filled(spec, list(range(8)), seed=7))
    lot.park(filled(spec, list(range(12)), seed=8))  # the same conversation, two turns on
    assert lot.conversations == (2 if spec.gdn_layers() else 1)  # a GDN state cannot be cut back to serve turn one
    lot.park(filled(spec, list(range(12)), seed=9))  # the very same tokens again: one copy is enough
    assert lot.conversations == (2 if spec.gdn_layers() else 1)


def test_reuse_prefix_keeps_copies_or_restores_and_parks_what_it_displaces(spec):
    lot = lot_for(spec, 10**9)
    a_ids, b_ids = list(range(1, 16)), list(range(40, 50))
    a = filled(spec, a_ids, seed=10)
    original_a = filled(spec, a_ids, seed=10)
    # its own conversation's next turn: kept in place, nothing parked
    assert reuse_prefix(a, a_ids + [16, 17], [], lot) == len(a_ids) and lot.conversations == 0
    # another conversation: "a" is parked first, then the sequence starts empty
    assert reuse_prefix(a, b_ids, [], lot) == 0
    assert a.length == 0 and lot.conversations == 1
    # "a" comes back into another sequence, from host RAM, and leaves the lot
    other = filled(spec, [3, 3], seed=11)
    assert reuse_prefix(other, a_ids + [16], [], lot) == len(a_ids)
    assert_same_state(other, original_a)
    assert lot.conversations == 1 and lot.best(a_ids + [16])[0] == 0  # "[3, 3]" is parked instead
    # an idle sequence beats an equal parked snapshot: it is copied (VRAM to VRAM)
    lot.park(original_a)
    fresh = filled(spec, [], seed=12)
    assert reuse_prefix(fresh, a_ids + [16], [other], lot) == len(a_ids)
    assert_same_state(fresh, original_a)
    assert lot.best(a_ids + [16])[0] == len(a_ids)  # the parked copy stayed parked


def test_bad_budgets_are_refused_with_a_clear_message(capsys):
    ram = host_ram_bytes()
    assert park_budget(None) == int(min(DEFAULT_PARK_GB * GB, ram / 4))
    assert park_budget(0) == 0 and park_budget(0.5) == int(0.5 * GB)
    with pytest.raises(StrataError, match=r"--park-gb -1: give the GB of host RAM .* 0 or more \(0 turns parking off\)"):
        park_budget(-1)
    with pytest.raises(StrataError, match="--park-gb nan"):
        park_budget(float("nan"))
    with pytest.raises(StrataError, match=r"--park-gb 1e\+06: this host has [\d.]+ GB of RAM"):
        park_budget(1e6)
    with pytest.raises(StrataError, match="parking budget of -5 bytes"):
        ParkingLot(-5, truncatable=True)
    with pytest.raises(ValidationError, match="0 or more"):
        EngineSettings(park_gb=-2)
    from strata.cli import main

    assert main(["engine", "--park-gb", "1000000"]) == 2
    err = capsys.readouterr().err
    assert "strata: error: --park-gb: this host has" in err and "0 to turn parking off" in err


# engines: conversations parked between turns

NEW = 8


def conversation(k: int, n: int = 14) -> list[int]:
    return [(k * 37 + j * 11 + 5) % VOCAB for j in range(n)]


@pytest.fixture(scope="module", params=[ATTENTION_ONLY, HYBRID])
def model(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    build(request.param, folder)
    return folder


def engine_with(model, park_gb: float, **kw) -> Engine:
    return Engine(ModelFiles.open(model), max_cells=256, park_gb=park_gb, **kw)


class Driver:
    """A scheduler driven by protocol lines, as the engine process drives it; each `run` is one request, by id."""

    def __init__(self, engine: Engine, num_slots: int):
        self.out: list[str] = []
        self.scheduler = Scheduler(engine, num_slots, self.out.append)
        self.count = 0

    def run(self, prompt_ids: list[int]) -> tuple[list[int], int, list[str]]:
        """The request's tokens, the prompt tokens it reused, and every line from its ADD on."""
        self.count += 1
        rid, start = f"q{self.count}", len(self.out)
        self.scheduler.handle(add(rid, NEW, prompt_ids))
        while self.scheduler.busy:
            self.scheduler.step()
        lines = self.out[start:]
        (run,) = [line for line in lines if line.startswith(f"RUN {rid} ")]
        assert end_of(lines, rid) == ["length", str(len(prompt_ids)), str(NEW), run.split()[2]]
        return tokens(lines, rid), int(run.split()[2]), lines


def two_turns_with_others_between(driver: Driver) -> tuple[list[int], list[int], int]:
    """Conversation 0's first turn, two other conversations taking both slots (the engine gives a new request the
    slot idle longest), then its second turn; the second turn's prompt, answer and reused tokens."""
    turn1 = conversation(0)
    answer, _, _ = driver.run(turn1)
    driver.run(conversation(1))
    driver.run(conversation(2))
    turn2 = turn1 + answer + [3, 1, 4, 1, 5]
    again, reused, _ = driver.run(turn2)
    return turn2, again, reused


def test_a_parked_conversation_reads_only_its_new_tokens_and_answers_as_if_it_had_stayed(model):
    engine = engine_with(model, park_gb=0.05)
    parked = Driver(engine, 2)
    turn2, answer, reused = two_turns_with_others_between(parked)
    held = len(turn2) - 5 - 1  # turn one's prompt and answer, but for the answer's last token (never read)
    assert reused == held
    assert any(line.startswith("PARKED 1 ") for line in parked.out)  # conversation 0, pushed out by conversation 2
    # the same two turns with the conversation staying in its slot between them
    stayed = Driver(engine_with(model, park_gb=0), 2)
    stayed.run(conversation(0))
    stayed_answer, stayed_reused, _ = stayed.run(turn2)
    assert stayed_reused == held and answer == stayed_answer
    assert not any(line.startswith("PARKED") for line in stayed.out)


def test_a_corrupt_parked_conversation_is_read_again_and_answers_the_same(model, caplog):
    engine = engine_with(model, park_gb=0.05)
    driver = Driver(engine, 2)
    turn1 = conversation(0)
    answer, _, _ = driver.run(turn1)
    driver.run(conversation(1))
    driver.run(conversation(2))  # conversation 0 is parked now
    (snap,) = [s for s in engine.parking._snapshots.values() if s.tokens[: len(turn1)] == turn1]
    others = {key: (s.tokens, [t.clone() for t in (*s.k.values(), *s.conv.values())])
              for key, s in engine.parking._snapshots.items() if s is not snap}
    flip_a_byte(next(iter(snap.recurrent.values())) if snap.recurrent else next(iter(snap.k.values())), at=40)
    turn2 = turn1 + answer + [3, 1, 4, 1, 5]
    with caplog.at_level("WARNING", logger="strata.engine"):
        again, reused, _ = driver.run(turn2)
    assert reused == 0 and engine.parking.refused == 1
    assert "refused: its bytes changed" in caplog.text and f"its prompt ({len(turn2)} tokens) is read again" in caplog.text
    stayed = Driver(engine_with(model, park_gb=0), 2)
    stayed.run(turn1)
    assert again == stayed.run(turn2)[0]
    for key, (tokens_, tensors) in others.items():  # the other parked conversations: untouched
        if key in engine.parking._snapshots:
            s = engine.parking._snapshots[key]
            assert s.tokens == tokens_ and all(torch.equal(a, b) for a, b in zip((*s.k.values(), *s.conv.values()),
                                                                                  tensors))


def test_restored_logits_are_close_to_reading_the_whole_prompt(model):
    engine = engine_with(model, park_gb=0.05)
    turn1 = conversation(3, 40)
    first = engine.new_state()
    engine.run(first, turn1)
    assert engine.reuse(first, conversation(4), []) == 0  # another conversation: turn one is parked
    assert engine.parking.conversations == 1
    turn2 = turn1 + [7, 8, 9, 10]
    state = engine.new_state()
    assert engine.reuse(state, turn2, []) == len(turn1)
    restored = engine.run(state, turn2[len(turn1):], all_logits=True)
    fresh = engine.run(engine.new_state(), turn2, all_logits=True)[len(turn1):]
    torch.testing.assert_close(restored, fresh, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("split", [None, "2,2"], ids=["one-stage", "two-stages"])
def test_a_single_slot_restores_a_parked_conversation(model, split):
    engine = engine_with(model, park_gb=0.05, layer_split=split)
    driver = Driver(engine, 1)
    turn1 = conversation(5)
    answer, reused, _ = driver.run(turn1)
    assert reused == 0
    _, _, lines = driver.run(conversation(6))  # the slot changes hands
    assert any(line.startswith("PARKED 1 ") for line in lines)
    turn2 = turn1 + answer + [2, 7, 1]
    again, reused, _ = driver.run(turn2)
    assert reused == len(turn1) + len(answer) - 1
    assert engine.parking.conversations == 1  # conversation 6 now, conversation 5 is back in the slot
    stayed = Driver(engine_with(model, park_gb=0, layer_split=split), 1)
    stayed.run(turn1)
    stayed_again, stayed_reused, _ = stayed.run(turn2)
    assert stayed_reused == len(turn1) + len(answer) - 1 and again == stayed_again


def test_an_edited_conversation_reuses_the_shared_part_only_without_gdn(model):
    engine = engine_with(model, park_gb=0.05)
    driver = Driver(engine, 1)
    turn1 = conversation(7)
    answer, _, _ = driver.run(turn1)
    driver.run(conversation(8))
    edited = turn1 + answer[:3] + [9, 9, 9]  # the answer cut short and something else said instead
    got, reused, _ = driver.run(edited)
    gdn = bool(engine.spec.gdn_layers())
    assert reused == (0 if gdn else len(turn1) + 3)
    stayed = Driver(engine_with(model, park_gb=0), 1)  # the edit sent while the conversation still held its slot
    stayed.run(turn1)
    stayed_got, stayed_reused, _ = stayed.run(edited)
    assert stayed_reused == reused and got == stayed_got


def test_gdn_checkpoints_serve_a_rewritten_history_and_a_regenerated_answer(model):
    """With checkpoints (`checkpoint_every`), a hybrid model's conversation can be cut back: an edited turn reuses
    the latest checkpoint inside the shared prefix (here the one kept before turn one's last prompt token), parked
    or held, and answers as a fresh read of the whole prompt does; the same prompt again (a regenerated answer)
    reads only its last token."""
    engine = engine_with(model, park_gb=0.05, checkpoint_every=8)
    gdn = bool(engine.spec.gdn_layers())
    driver = Driver(engine, 1)
    turn1 = conversation(7)  # 14 tokens: checkpoints at 8 and 13
    answer, _, _ = driver.run(turn1)
    driver.run(conversation(8))  # conversation 7 is parked, its checkpoints with it
    edited = turn1 + answer[:3] + [9, 9, 9]
    got, reused, _ = driver.run(edited)
    assert reused == (len(turn1) - 1 if gdn else len(turn1) + 3)
    fresh = Driver(engine_with(model, park_gb=0, checkpoint_every=8), 1)
    assert got == fresh.run(edited)[0]
    stayed = Driver(engine_with(model, park_gb=0, checkpoint_every=8), 1)  # held in its slot, not parked
    stayed.run(turn1)
    stayed_got, stayed_reused, _ = stayed.run(edited)
    assert stayed_reused == reused and stayed_got == got
    again, reused_again, _ = stayed.run(turn1)  # regenerate turn one's answer
    assert reused_again == len(turn1) - 1 and again == answer
    if gdn:
        state = stayed.scheduler.slots.slots[0].state
        assert sorted(state.checkpoints) == [8, 13] and state.checkpoint_nbytes() > 0
        off = Driver(engine_with(model, park_gb=0), 1)  # checkpoints off: a GDN state is kept whole or not at all
        off.run(turn1)
        assert off.run(edited)[1] == 0


def test_budget_zero_parks_nothing(model):
    engine = engine_with(model, park_gb=0)
    driver = Driver(engine, 2)
    turn2, answer, reused = two_turns_with_others_between(driver)
    assert reused == 0  # its state was overwritten, nowhere kept: the whole prompt is read
    assert engine.parking.conversations == 0 and not any(line.startswith("PARKED") for line in driver.out)
    assert answer == engine.generate(turn2, NEW, stop_ids=frozenset()).ids


def test_over_budget_the_least_recently_parked_is_evicted(model):
    probe = engine_with(model, park_gb=0).new_state()
    probe.length = len(conversation(0)) + NEW - 1  # what a finished conversation holds
    engine = engine_with(model, park_gb=1.5 * snapshot_bytes(probe) / GB)  # room for one conversation, not two
    driver = Driver(engine, 1)
    answers = {}
    for k in (10, 11, 12):  # each one pushes the previous one out of the slot; 12 pushes 11 and evicts 10
        answers[k], _, _ = driver.run(conversation(k))
    assert engine.parking.evictions == 1 and engine.parking.conversations == 1
    parked = [line for line in driver.out if line.startswith("PARKED")]
    assert parked and all(line.split()[1] == "1" for line in parked)
    follow = {k: conversation(k) + answers[k] + [6, 6] for k in (11, 10)}
    _, reused, _ = driver.run(follow[11])
    assert reused == len(conversation(11)) + NEW - 1  # still parked
    got, reused, _ = driver.run(follow[10])
    assert reused == 0  # evicted: read again
    assert got == engine.generate(follow[10], NEW, stop_ids=frozenset()).ids
