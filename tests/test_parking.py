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
from strata.state import park_disk
from strata.state.park_disk import DiskSnapshot, DiskTier, decode_tokens, encode_tokens, park_dir_problem
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


def grow(state: SessionState, new_tokens: list[int], seed: int) -> None:
    """`state` reads `new_tokens`: random K/V in their cells, new random GDN states."""
    generator = torch.Generator().manual_seed(seed)
    n, m = state.length, len(new_tokens)
    for t in (*state.k.values(), *state.v.values()):
        t[n : n + m].copy_(torch.randn(t[n : n + m].shape, generator=generator))
    for t in (*state.conv.values(), *state.recurrent.values()):
        t.copy_(torch.randn(t.shape, generator=generator))
    state.length, state.tokens = n + m, state.tokens + list(new_tokens)


def cell_bytes(state: SessionState, cells: int) -> int:
    return sum(t[:cells].numel() * t.element_size() for t in (*state.k.values(), *state.v.values()))


def test_a_restored_conversation_parked_again_copies_only_its_new_cells(spec):
    """Reuse on re-park: each turn the conversation comes back from its image, reads a few tokens and is parked again;
    the new image holds only the new cells (and the GDN states) and extends the old one, restores bit for bit, and
    a file of it stands alone. The chain of images stays short: past `MAX_DEPTH` an image is copied whole."""
    lot = lot_for(spec, 10**9)
    tokens = list(range(1, 21))
    first = filled(spec, tokens, seed=20)
    assert lot.park(first) and lot.reused_bytes == 0  # a state never restored: copied whole
    state, depths, reused = filled(spec, [5], seed=21), [], 0
    for turn in range(6):
        new = [60 + 4 * turn + j for j in range(4)]
        count = reuse_prefix(state, tokens + new, [], lot)  # back from its image (what `state` held is parked)
        assert count == len(tokens) and state.origin is not None
        grow(state, new, seed=30 + turn)
        tokens = tokens + new
        expected = state.length, list(state.tokens), {i: t.clone() for i, t in state.k.items()}
        before = lot.reused_bytes
        assert lot.park(state)
        image = lot.best(tokens + [99])[1]
        depths.append(image.depth)
        if image.base is not None:
            assert image.base_cells == len(tokens) - 4
            assert lot.reused_bytes - before == cell_bytes(state, image.base_cells)
            assert all(t.shape[0] == 4 for t in image.k.values())  # its own cells: the new ones only
            reused += 1
        else:
            assert lot.reused_bytes == before
        copy = filled(spec, [7], seed=22)
        image.restore(copy, len(tokens))
        assert_same_state(copy, state)
        whole = Snapshot.from_named(image.named_tensors(), tokens=list(tokens), nbytes=image.nbytes)  # as a file holds it
        assert all(torch.equal(whole.k[i], expected[2][i][: len(tokens)]) for i in whole.k)
        state = filled(spec, [5], seed=23)  # the conversation leaves its sequence (held by another one now)
    assert depths == [2, 3, 4, 1, 2, 3] and reused == 5


def test_an_image_whose_base_was_written_over_is_evicted_and_a_re_park_copies_whole(spec):
    a_ids = list(range(1, 21))
    size = Snapshot.region_bytes(filled(spec, a_ids, seed=24))
    lot = lot_for(spec, int(2.6 * size))
    assert lot.park(filled(spec, a_ids, seed=24))  # "a" at the ring's start
    state = filled(spec, [5], seed=25)
    assert reuse_prefix(state, a_ids + [30, 31], [], lot) == len(a_ids)
    grow(state, [30, 31], seed=26)
    assert lot.park(state)  # extends "a"'s bytes, placed beside them
    b_ids = list(state.tokens)
    image = lot.best(b_ids + [99])[1]
    assert image.base is not None
    lot.park(filled(spec, list(range(40, 60)), seed=27))  # fills the ring's end ...
    lot.park(filled(spec, list(range(70, 90)), seed=28))  # ... and wraps over "a"'s bytes
    assert lot.best(b_ids + [99]) == (0, None) and lot.evictions >= 1  # its image went with them, never restored
    before = lot.reused_bytes
    grow(state, [32], seed=29)
    assert lot.park(state) and lot.reused_bytes == before  # its origin's bytes are gone: copied whole
    assert lot.best(state.tokens + [99])[1].base is None


def test_a_recent_image_on_an_old_base_outlives_the_images_parked_between_them(spec):
    """Eviction keeps the most recently used: "a" is parked, then "x", then "a" comes back, reads two tokens and is
    parked again as an image extending "a"'s bytes at the ring's start. The next snapshot, wrapping round, writes
    over "x" (parked before it) and not over those bytes, so the recent conversation stays restorable bit for bit."""
    a_ids, x_ids, y_ids = list(range(1, 21)), list(range(40, 60)), list(range(70, 90))
    size = Snapshot.region_bytes(filled(spec, a_ids, seed=24))
    state = filled(spec, [], seed=25)
    probe = ParkingLot(10**9, truncatable=not spec.gdn_layers())  # the dependent image's size, measured alike
    probe.park(filled(spec, a_ids, seed=24))
    reuse_prefix(state, a_ids + [30, 31], [], probe)
    grow(state, [30, 31], seed=26)
    own = Snapshot.region_bytes(state, len(a_ids))
    lot = lot_for(spec, 2 * size + own + 8)
    assert lot.park(filled(spec, a_ids, seed=24))  # "a" at the ring's start
    assert lot.park(filled(spec, x_ids, seed=27))  # "x" after it
    state = filled(spec, [], seed=25)
    assert reuse_prefix(state, a_ids + [30, 31], [], lot) == len(a_ids)
    grow(state, [30, 31], seed=26)
    assert lot.park(state)  # extends "a"'s bytes: the most recent image
    b_ids = list(state.tokens)
    assert lot.best(b_ids + [99])[1].base is not None
    assert lot.park(filled(spec, y_ids, seed=28))  # no room at the end: wraps, skips "a"'s bytes, writes over "x"
    assert lot.best(x_ids + [99]) == (0, None) and lot.evictions == 1
    count, image = lot.best(b_ids + [99])
    assert count == len(b_ids) and image.base is not None
    copy = filled(spec, [7], seed=29)
    image.restore(copy, len(b_ids))
    assert_same_state(copy, state)
    assert lot.best(y_ids + [99])[0] == len(y_ids)
    assert lot.park(filled(spec, list(range(100, 120)), seed=30))  # one more: the chain is now the oldest, and goes
    assert lot.best(b_ids + [99]) == (0, None) and lot.best(y_ids + [99])[0] == len(y_ids)


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
    (restored,) = [line.split() for line in parked.out if line.startswith("RESTORED ")]  # its seconds, tokens, tier
    assert 0 < float(restored[1]) < 60 and restored[2:] == [str(held), "ram"]
    # the same two turns with the conversation staying in its slot between them
    stayed = Driver(engine_with(model, park_gb=0), 2)
    stayed.run(conversation(0))
    stayed_answer, stayed_reused, _ = stayed.run(turn2)
    assert stayed_reused == held and answer == stayed_answer
    assert not any(line.startswith("PARKED") for line in stayed.out)


def test_a_conversation_parked_again_after_a_restore_copies_only_its_new_cells(model):
    """Three turns, others taking both slots between them: the second park of the conversation extends the image its
    second turn was restored from (PARKED reports the bytes not copied again), and the third turn, restored from the
    two images, answers as if the conversation had stayed."""
    engine = engine_with(model, park_gb=0.05)
    driver = Driver(engine, 2)
    turns, answers = [conversation(0)], []
    for k in range(3):
        answers.append(driver.run(turns[-1])[0])
        if k < 2:
            driver.run(conversation(10 + 2 * k))
            driver.run(conversation(11 + 2 * k))
            turns.append(turns[-1] + answers[-1] + [3, 1, 4 + k])
    reused = [int(line.split()[5]) for line in driver.out if line.startswith("PARKED ")]
    assert reused[-1] == engine.parking.reused_bytes > 0 and sorted(reused) == reused
    first_turn_cells = len(turns[1]) - 3 - 1  # turn one's prompt and answer, but for its last token
    state = driver.scheduler.slots.slots[0].state
    assert reused[-1] == cell_bytes(state, first_turn_cells)  # the second park: turn one's cells not copied again
    stayed = Driver(engine_with(model, park_gb=0), 2)
    assert [stayed.run(turn)[0] for turn in turns] == answers
    assert engine.parking.refused == 0


def live_state(state: SessionState) -> tuple:
    """A slot's tokens and a copy of its committed cells and GDN states."""
    n = state.length
    cells = [t[:n].clone() for t in (*state.k.values(), *state.v.values())]
    return list(state.tokens), cells + [t.clone() for t in (*state.conv.values(), *state.recurrent.values())]


def test_a_corrupt_parked_conversation_is_read_again_and_answers_the_same(model, caplog):
    engine = engine_with(model, park_gb=0.05)
    driver = Driver(engine, 2)
    turn1 = conversation(0)
    answer, _, _ = driver.run(turn1)
    for k in (1, 2, 3):  # conversations 0 and 1 are parked now, 2 and 3 in the slots
        driver.run(conversation(k))
    (snap,) = [s for s in engine.parking._snapshots.values() if s.tokens[: len(turn1)] == turn1]
    others = {key: (s.tokens, [t.clone() for t in (*s.k.values(), *s.v.values(), *s.conv.values(),
                                                   *s.recurrent.values())])
              for key, s in engine.parking._snapshots.items() if s is not snap}
    assert len(others) == 1  # conversation 1's image
    slots = driver.scheduler.slots.slots
    (kept,) = [slot for slot in slots if slot.state.tokens[:14] == conversation(3)]  # the slot turn 2 does not take
    kept_before = live_state(kept.state)
    flip_a_byte(next(iter(snap.recurrent.values())) if snap.recurrent else next(iter(snap.k.values())), at=40)
    turn2 = turn1 + answer + [3, 1, 4, 1, 5]
    with caplog.at_level("WARNING", logger="strata.engine"):
        again, reused, _ = driver.run(turn2)
    assert reused == 0 and engine.parking.refused == 1
    assert "refused: its bytes changed" in caplog.text and f"its prompt ({len(turn2)} tokens) is read again" in caplog.text
    stayed = Driver(engine_with(model, park_gb=0), 2)
    stayed.run(turn1)
    assert again == stayed.run(turn2)[0]
    for key, (tokens_, tensors) in others.items():  # the other parked conversation: untouched, bit for bit
        s = engine.parking._snapshots[key]
        assert s.tokens == tokens_
        after = (*s.k.values(), *s.v.values(), *s.conv.values(), *s.recurrent.values())
        assert len(after) == len(tensors) and all(torch.equal(a, b) for a, b in zip(after, tensors))
    tokens_after, cells_after = live_state(kept.state)  # and the conversation in the other slot
    assert tokens_after == kept_before[0] and all(torch.equal(a, b) for a, b in zip(cells_after, kept_before[1]))


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


@pytest.mark.parametrize("split", [None, "2,2", "1,2,1"], ids=["one-stage", "two-stages", "three-stages"])
def test_a_single_slot_restores_a_parked_conversation(model, split):
    # with GDN checkpoints as `strata serve` keeps them by default (before each prompt's last token)
    engine = engine_with(model, park_gb=0.05, layer_split=split, checkpoint_every=0)
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
    stayed = Driver(engine_with(model, park_gb=0, layer_split=split, checkpoint_every=0), 1)
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
    """With checkpoints (`checkpoint_every` 0: before each prompt's last token), a hybrid model's conversation can
    be cut back: an edited turn reuses the checkpoint inside the shared prefix, parked or held, and answers as a
    fresh read of the whole prompt does; the same prompt again (a regenerated answer) reads only its last token."""
    engine = engine_with(model, park_gb=0.05, checkpoint_every=0)
    gdn = bool(engine.spec.gdn_layers())
    driver = Driver(engine, 1)
    turn1 = conversation(7, 40)  # a checkpoint at 39
    answer, _, _ = driver.run(turn1)
    driver.run(conversation(8))  # conversation 7 is parked, its checkpoint with it
    edited = turn1 + answer[:3] + [9, 9, 9]
    got, reused, _ = driver.run(edited)
    assert reused == (len(turn1) - 1 if gdn else len(turn1) + 3)
    fresh = Driver(engine_with(model, park_gb=0, checkpoint_every=0), 1)
    assert got == fresh.run(edited)[0]
    stayed = Driver(engine_with(model, park_gb=0, checkpoint_every=0), 1)  # held in its slot, not parked
    stayed.run(turn1)
    stayed_got, stayed_reused, _ = stayed.run(edited)
    assert stayed_reused == reused and stayed_got == got
    again, reused_again, _ = stayed.run(turn1)  # regenerate turn one's answer
    assert reused_again == len(turn1) - 1 and again == answer
    if gdn:
        off = Driver(engine_with(model, park_gb=0), 1)  # checkpoints off: a GDN state is kept whole or not at all
        off.run(turn1)
        assert off.run(edited)[1] == 0


@pytest.mark.parametrize("model", [HYBRID], indirect=True)
def test_a_parked_gdn_checkpoint_whose_bytes_changed_is_refused(model, caplog):
    """A parked conversation's checkpoint carries the checksum of the device states it was copied from: a flipped
    byte in its host copy is found when an edited follow-up restores from it, refused with a log line, and the
    prompt read again, answering as a fresh read does."""
    engine = engine_with(model, park_gb=0.05, checkpoint_every=0)
    driver = Driver(engine, 1)
    turn1 = conversation(7, 40)  # a checkpoint at 39
    answer, _, _ = driver.run(turn1)
    driver.run(conversation(8))  # conversation 7 is parked, its checkpoint with it
    (snap,) = [s for s in engine.parking._snapshots.values() if s.tokens[: len(turn1)] == turn1]
    checkpoint = snap.checkpoints[len(turn1) - 1]
    assert checkpoint.sum is not None
    flip_a_byte(next(iter(checkpoint.values()))[1], at=40)  # a recurrent state's byte
    edited = turn1 + answer[:3] + [9, 9, 9]
    with caplog.at_level("WARNING", logger="strata.engine"):
        got, reused, _ = driver.run(edited)
    assert reused == 0 and engine.parking.refused == 1
    assert f"its GDN checkpoint at {len(turn1) - 1} positions changed" in caplog.text
    assert got == Driver(engine_with(model, park_gb=0, checkpoint_every=0), 1).run(edited)[0]


def test_periodic_gdn_checkpoints_serve_an_edit_far_back(model):
    """Every 16 prompt tokens: an edit at token 20 of a 40-token conversation reads from position 16; a short read
    after the last periodic checkpoint (39 - 32 < 32 tokens) keeps no prompt-end checkpoint."""
    engine = engine_with(model, park_gb=0, checkpoint_every=16)
    gdn = bool(engine.spec.gdn_layers())
    driver = Driver(engine, 1)
    turn1 = conversation(9, 40)
    driver.run(turn1)
    if gdn:
        state = driver.scheduler.slots.slots[0].state
        assert sorted(state.checkpoints) == [16, 32] and state.checkpoint_nbytes() > 0
        assert all(c.sum is None for c in state.checkpoints.values())  # parking off: no checksum is taken
    edited = turn1[:20] + [9, 9, 9, 9, 9]
    got, reused, _ = driver.run(edited)
    assert reused == (16 if gdn else 20)
    assert got == Driver(engine_with(model, park_gb=0), 1).run(edited)[0]


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


# on disk (--park-dir): written through, found again by a new engine, refused when damaged or foreign

import errno  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
from pathlib import Path  # noqa: E402
from types import SimpleNamespace  # noqa: E402

from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402


def park_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*" + park_disk.SUFFIX))


def disk_lot(spec, folder: Path, disk: int = 10**9, ram: int = 10**9, fingerprint: str = "model-a") -> ParkingLot:
    return ParkingLot(ram, truncatable=not spec.gdn_layers(), fingerprint=fingerprint,
                      disk=DiskTier(folder, disk, fingerprint))


def rewrite(path: Path, **changes: str) -> None:
    """The file again, its tensors unchanged, its header's metadata changed."""
    with safe_open(str(path), framework="pt") as f:
        meta, tensors = f.metadata(), {name: f.get_tensor(name).clone() for name in f.keys()}
    save_file(tensors, str(path), metadata={**meta, **changes})


def with_checkpoint(spec, state: SessionState) -> SessionState:
    """A GDN checkpoint (host copies, as `SessionState.checkpoint` keeps them) at position 8 of a filled state."""
    if state.conv:
        state.checkpoints = {8: {i: (state.conv[i].clone() + 1, state.recurrent[i].clone() - 1) for i in state.conv}}
    return state


def test_a_snapshot_is_written_through_and_a_new_lot_finds_it_on_disk(spec, tmp_path):
    tokens_ = list(range(10, 30))
    parked = with_checkpoint(spec, filled(spec, tokens_, seed=1))
    lot = disk_lot(spec, tmp_path)
    assert lot.park(parked) and lot.disk.flush(30)
    (path,) = park_files(tmp_path)
    snap = next(iter(lot._snapshots.values()))
    assert path.name == f"{snap.tokens_hash}.park.safetensors"
    with safe_open(str(path), framework="pt") as f:
        meta, names = f.metadata(), set(f.keys())
    assert meta["format"] == "strata-parked-conversation" and meta["format_version"] == "2"
    assert meta["fingerprint"] == "model-a" and list(decode_tokens(meta["tokens"])) == tokens_
    assert meta["token_hash"] == snap.tokens_hash and int(meta["checksum"]) == int(snap.sum)
    assert int(meta["nbytes"]) == snapshot_bytes(parked) and names == set(snap.named_tensors())
    first = spec.attention_layers()[0]
    assert {f"k.{first}", f"v.{first}"} <= names
    assert not spec.gdn_layers() or f"checkpoints.8.{spec.gdn_layers()[0]}[1]" in names
    # in host RAM and on disk: taken from host RAM
    count, found = lot.best(tokens_ + [99])
    assert count == len(tokens_) and found is snap and not isinstance(found, DiskSnapshot)
    # a new lot on the same folder (a restarted engine): from the file, restored bit for bit, checkpoints too
    again = disk_lot(spec, tmp_path)
    assert again.conversations == 0 and again.disk.conversations == 1
    count, found = again.best(tokens_ + [99])
    assert count == len(tokens_) and isinstance(found, DiskSnapshot) and found.length == len(tokens_)
    again.take(found)
    target = filled(spec, [7, 7, 7], seed=2)
    found.restore(target, count, "model-a")
    assert_same_state(target, parked)
    assert sorted(found.checkpoints) == sorted(parked.checkpoints)
    for position, layers in parked.checkpoints.items():
        for i, pair in layers.items():
            assert all(torch.equal(a, b) for a, b in zip(pair, found.checkpoints[position][i]))
    assert park_files(tmp_path) == [path]  # taken, not deleted: it serves the next restart too
    assert again.best(tokens_ + [99])[0] == len(tokens_)


def test_the_disk_budget_keeps_the_most_recently_used_files(spec, tmp_path):
    prompts = {name: [base + j for j in range(12)] for name, base in (("a", 0), ("b", 20), ("c", 40))}
    states = {name: filled(spec, ids, seed=i) for i, (name, ids) in enumerate(prompts.items())}
    (tmp_path / "probe").mkdir()
    probe = disk_lot(spec, tmp_path / "probe")
    probe.park(states["a"])
    probe.disk.flush(30)
    size = park_files(tmp_path / "probe")[0].stat().st_size  # the three states' files are the same size
    folder = tmp_path / "park"
    folder.mkdir()
    lot = disk_lot(spec, folder, disk=int(2.5 * size))  # room for two files
    assert lot.park(states["a"]) and lot.park(states["b"]) and lot.disk.flush(30)
    assert len(park_files(folder)) == 2
    _, a = lot.best(prompts["a"] + [150])
    lot.take(a)  # "a" is used again: its file is now more recent than "b"'s
    assert lot.park(states["c"]) and lot.disk.flush(30)  # so "b"'s file goes
    kept = {p.name.split(".")[0] for p in park_files(folder)}
    assert len(kept) == 2 and a.tokens_hash in kept and lot.disk.evictions == 1
    assert lot.disk.nbytes <= lot.disk.budget and sum(p.stat().st_size for p in park_files(folder)) <= lot.disk.budget
    fresh = disk_lot(spec, folder, disk=int(2.5 * size))  # the next engine sees the same two
    assert fresh.best(prompts["b"] + [150]) == (0, None) and fresh.best(prompts["c"] + [150])[0] == 12


def test_a_later_turn_replaces_the_earlier_turns_file_without_gdn(spec, tmp_path):
    lot = disk_lot(spec, tmp_path)
    lot.park(filled(spec, list(range(8)), seed=7))
    lot.disk.flush(30)
    lot.park(filled(spec, list(range(12)), seed=8))  # the same conversation, two turns on
    lot.disk.flush(30)
    assert len(park_files(tmp_path)) == (2 if spec.gdn_layers() else 1)


def test_a_failed_write_is_a_warning_and_the_snapshot_stays_in_ram(spec, tmp_path, monkeypatch, caplog):
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(park_disk, "save_file", full)
    lot = disk_lot(spec, tmp_path)
    state = filled(spec, list(range(12)), seed=3)
    with caplog.at_level("WARNING", logger="strata.engine"):
        assert lot.park(state) and lot.disk.flush(30)
    assert "could not write a parked conversation" in caplog.text and "the disk is full" in caplog.text
    assert park_files(tmp_path) == [] and not list(tmp_path.iterdir())  # no temporary file left either
    assert lot.conversations == 1 and lot.best(list(range(12)) + [1])[0] == 12 and lot.disk.write_failures == 1


def test_a_bad_park_dir_or_budget_is_refused_with_a_clear_message(tmp_path, monkeypatch, capsys):
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    assert "is a file, not a folder" in park_dir_problem(a_file)
    assert "its parent folder" in park_dir_problem(tmp_path / "missing" / "park") and "does not exist" in \
        park_dir_problem(tmp_path / "missing" / "park")
    read_only = tmp_path / "read-only"
    read_only.mkdir()
    read_only.chmod(0o555)
    if os.geteuid() == 0:  # root writes anywhere: this folder stands for one it may not write
        access = os.access
        monkeypatch.setattr(park_disk.os, "access", lambda p, mode: Path(p) != read_only and access(p, mode))
    assert "is not writable by this process" in park_dir_problem(read_only)
    assert park_dir_problem(tmp_path / "new") is None and not (tmp_path / "new").exists()
    assert park_dir_problem(tmp_path / "new", create=True) is None and (tmp_path / "new").is_dir()
    with pytest.raises(StrataError, match=r"--park-dir .*read-only: is not writable"):
        park_disk.open_park_dir(read_only, None, "m")
    with pytest.raises(StrataError, match=r"--park-disk-gb -1: give the GB of disk .* 0 or more"):
        park_disk.park_disk_budget(-1, tmp_path)
    with pytest.raises(StrataError, match=r"--park-disk-gb 1e\+09: the file system of .* holds [\d.]+ GB in all"):
        park_disk.park_disk_budget(1e9, tmp_path)
    assert 0 < park_disk.park_disk_budget(None, tmp_path) <= 20 * GB
    assert park_disk.open_park_dir(tmp_path / "off", 0, "m") is None  # a budget of 0: no disk tier
    with pytest.raises(ValidationError, match="is a file, not a folder"):
        EngineSettings(park_dir=str(a_file))
    with pytest.raises(ValidationError, match="0 or more"):
        EngineSettings(park_dir=str(tmp_path), park_disk_gb=-2)
    from strata.cli import main

    assert main(["engine", "--park-dir", str(tmp_path / "missing" / "park")]) == 2
    err = capsys.readouterr().err
    assert "strata: error: --park-dir: its parent folder" in err and "create it" in err
    assert main(["engine", "--park-dir", str(a_file)]) == 2
    assert "--park-dir: is a file, not a folder" in capsys.readouterr().err
    assert main(["engine", "--park-dir", str(tmp_path), "--park-disk-gb", "-1"]) == 2
    assert "--park-disk-gb: give the GB of disk" in capsys.readouterr().err


# engines on a park folder

@pytest.fixture(scope="module")
def parked(model, tmp_path_factory):
    """An engine parked conversation 0 (its first turn) into a folder; its second turn's answer had it stayed."""
    folder = tmp_path_factory.mktemp("park")
    engine = engine_with(model, park_gb=0.05, park_dir=str(folder))
    driver = Driver(engine, 2)
    turn1 = conversation(0)
    answer, _, _ = driver.run(turn1)
    driver.run(conversation(1))
    driver.run(conversation(2))  # takes conversation 0's slot: parked, and written
    assert engine.parking.disk.flush(30)
    (path,) = park_files(folder)
    turn2 = turn1 + answer + [3, 1, 4, 1, 5]
    stayed = Driver(engine_with(model, park_gb=0), 2)
    stayed.run(turn1)
    stayed_answer, held, _ = stayed.run(turn2)
    assert held == len(turn1) + len(answer) - 1
    return SimpleNamespace(folder=folder, name=path.name, turn1=turn1, turn2=turn2, answer=stayed_answer, held=held)


def restarted(model, parked, tmp_path, **kw) -> tuple[Engine, Path]:
    """A new engine on a copy of the parked folder."""
    folder = tmp_path / "park"
    if not folder.exists():
        shutil.copytree(parked.folder, folder)
    return engine_with(model, park_gb=0.05, park_dir=str(folder), **kw), folder


def test_after_a_restart_a_follow_up_reads_only_its_new_tokens_and_answers_as_if_it_had_stayed(model, parked,
                                                                                                  tmp_path, caplog):
    with caplog.at_level("INFO", logger="strata.engine"):
        engine, folder = restarted(model, parked, tmp_path)
    assert "1 parked conversations found" in caplog.text and engine.parking.conversations == 0
    driver = Driver(engine, 2)
    answer, reused, lines = driver.run(parked.turn2)
    assert reused == parked.held and answer == parked.answer and engine.parking.refused == 0
    assert (folder / parked.name).exists()  # it stays on disk (the conversation is in a slot now)
    # the engine ends with the conversation in a slot; another takes it: parked again, its second turn written
    driver.run(conversation(4))
    driver.run(conversation(5))
    engine.parking.disk.flush(30)
    names = {p.name for p in park_files(folder)}
    gdn = bool(engine.spec.gdn_layers())
    assert (parked.name in names) == gdn  # without GDN layers the second turn's file covers the first's
    assert len(names) == (2 if gdn else 1)


@pytest.mark.parametrize("split", ["2,2", "1,2,1"], ids=["two-stages", "three-stages"])
def test_a_file_parked_by_one_stage_is_restored_by_a_split_engine_after_a_restart(model, parked, tmp_path, split):
    """An image holds the whole model's state, so a restart under another layer split reads it (each stage takes
    its layers' cells and states) and answers as if the conversation had stayed."""
    engine, _ = restarted(model, parked, tmp_path, layer_split=split, checkpoint_every=0)
    answer, reused, _ = Driver(engine, 2).run(parked.turn2)
    assert reused == parked.held and answer == parked.answer and engine.parking.refused == 0


@pytest.mark.parametrize("damage", ["byte", "truncated", "cut-after-start", "model", "version", "tokens", "garbage"])
def test_a_damaged_or_foreign_file_is_refused_and_the_prompt_read_again(model, parked, tmp_path, caplog, damage):
    folder = tmp_path / "park"
    shutil.copytree(parked.folder, folder)
    path = folder / parked.name
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    if damage == "byte":  # in the tensors' bytes: the header reads fine, the file is refused when taken
        with open(path, "r+b") as f:
            f.seek(-7, os.SEEK_END)
            byte = f.read(1)
            f.seek(-7, os.SEEK_END)
            f.write(bytes([byte[0] ^ 0x10]))
    elif damage == "truncated":
        os.truncate(path, path.stat().st_size - 100)
    elif damage == "model":
        rewrite(path, fingerprint="0123456789abcdef")
    elif damage == "version":
        rewrite(path, format_version="1")
    elif damage == "tokens":
        ids = list(decode_tokens(meta["tokens"]))
        ids[3] = (ids[3] + 1) % VOCAB
        rewrite(path, tokens=encode_tokens(ids))
    elif damage == "garbage":  # not even safetensors, beside the good file
        (folder / ("0" * 32 + park_disk.SUFFIX)).write_bytes(b"not a safetensors file at all")
    with caplog.at_level("WARNING", logger="strata.engine"):
        engine, _ = restarted(model, parked, tmp_path)
        if damage == "cut-after-start":  # cut short between the startup and the take
            os.truncate(path, path.stat().st_size - 100)
        answer, reused, _ = Driver(engine, 2).run(parked.turn2)
    assert answer == parked.answer
    if damage == "garbage":
        assert reused == parked.held and "0" * 32 in caplog.text and "not a complete safetensors file" in caplog.text
        assert not (folder / ("0" * 32 + park_disk.SUFFIX)).exists()
        return
    assert reused == 0
    expected = {"byte": "its bytes changed since it was written", "truncated": "not a complete safetensors file",
                "cut-after-start": "cut short", "model": "parked by another model",
                "version": "written in version '1' of the format", "tokens": "token list does not match"}[damage]
    assert expected in caplog.text and parked.name in caplog.text
    at_take = damage in ("byte", "cut-after-start")
    assert engine.parking.refused == (1 if at_take else 0)
    if at_take:
        assert f"its prompt ({len(parked.turn2)} tokens) is read again" in caplog.text
    assert not path.exists()
    aside = path.with_name(path.name + ".refused")
    assert aside.exists() == (damage in ("model", "version"))  # intact but not this engine's: kept aside
    if aside.exists():
        assert "moved aside" in caplog.text


def test_a_file_parked_by_another_model_of_the_same_shape_is_refused(model, parked, tmp_path, caplog):
    """The same tiny case built with other weights: its engine finds the first model's file, refuses it, and answers
    as it answers on its own; a copy of the first model's folder elsewhere is the same model."""
    from strata.state.parking import model_fingerprint

    spec = ModelFiles.open(model).spec
    other = tmp_path / "other"
    build(HYBRID if spec.gdn_layers() else ATTENTION_ONLY, other, seed=1)
    copy = tmp_path / "copy"
    shutil.copytree(model, copy)
    assert model_fingerprint(spec, torch.float32, copy) == model_fingerprint(spec, torch.float32, model)
    assert model_fingerprint(spec, torch.float32, other) != model_fingerprint(spec, torch.float32, model)
    assert (model_fingerprint(spec, torch.float32, model, "q8_0")
            != model_fingerprint(spec, torch.float32, model))
    own = Driver(engine_with(other, park_gb=0), 2).run(parked.turn2)[0]
    folder = tmp_path / "park"
    shutil.copytree(parked.folder, folder)
    with caplog.at_level("WARNING", logger="strata.engine"):
        engine = engine_with(other, park_gb=0.05, park_dir=str(folder))
        answer, reused, _ = Driver(engine, 2).run(parked.turn2)
    assert reused == 0 and answer == own
    assert "parked by another model" in caplog.text and parked.name in caplog.text
    assert (folder / (parked.name + ".refused")).exists()


def test_the_disk_budget_holds_and_full_disks_never_fail_a_request(model, parked, tmp_path, monkeypatch, caplog):
    size = (parked.folder / parked.name).stat().st_size  # a finished 14-token conversation's file
    folder = tmp_path / "park"
    folder.mkdir()
    engine = engine_with(model, park_gb=0.05, park_dir=str(folder), park_disk_gb=1.5 * size / GB)
    driver = Driver(engine, 1)
    answers = {}
    for k in (10, 11, 12):  # each pushes the previous one out of the slot: 10 and 11 parked, 10's file evicted
        answers[k], _, _ = driver.run(conversation(k))
        engine.parking.disk.flush(30)
    (only,) = park_files(folder)
    assert engine.parking.disk.evictions == 1 and only.stat().st_size <= 1.5 * size
    assert list(decode_tokens(safe_open(str(only), framework="pt").metadata()["tokens"]))[:14] == conversation(11)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(park_disk, "save_file", full)
    with caplog.at_level("WARNING", logger="strata.engine"):
        for k in (13, 14):
            got, _, _ = driver.run(conversation(k))
            assert got == engine.generate(conversation(k), NEW, stop_ids=frozenset()).ids
        engine.parking.disk.flush(30)
    assert "the disk is full" in caplog.text and engine.parking.disk.write_failures >= 1
    assert park_files(folder) == [only]


# copies in VRAM (--park-vram-gb): a first tier in front of host RAM; its logic runs on any device, the CPU here

from strata.state.park_vram import VramTier  # noqa: E402


def test_a_copy_in_vram_is_restored_first_and_exactly(spec):
    """Parked with a VRAM tier, a conversation is restored from its copy there ("vram"), bit for bit; the copy is
    released once restored. A tier too small for it still parks it in host RAM, restored from there."""
    tokens = list(range(10, 30))
    parked = filled(spec, tokens, seed=1)
    for capacity, tier in ((10**8, "vram"), (1_000, "ram")):
        lot = lot_for(spec, 10**9)
        lot.vram = VramTier(capacity)
        assert lot.park(filled(spec, tokens, seed=1))
        assert (lot.vram.conversations, lot.vram.nbytes > 0) == ((1, True) if tier == "vram" else (0, False))
        target = filled(spec, [7, 7, 7], seed=2)
        snap = lot.best(tokens + [99])[1]
        assert reuse_prefix(target, tokens + [99], [], lot) == len(tokens)
        assert_same_state(target, parked)
        assert lot.restores[-1][1:] == (len(tokens), tier) and lot.vram.copy_of(snap) is None


def test_the_oldest_copies_in_vram_are_written_over_and_restore_from_ram(spec):
    """A tier that holds two conversations' copies: parking a third writes over the oldest copy; that conversation
    is still parked in host RAM and comes back from there, the others from VRAM, each exactly."""
    convs = [[c * 20 + j for j in range(1, 21)] for c in range(3)]
    size = Snapshot.region_bytes(filled(spec, convs[0], seed=0))
    lot = lot_for(spec, 10**9)
    lot.vram = VramTier(2 * size)
    for c, ids in enumerate(convs):
        lot.park(filled(spec, ids, seed=c))
    assert lot.conversations == 3 and lot.vram.conversations == 2
    for c, ids in enumerate(convs):
        target = filled(spec, [], seed=9)
        assert reuse_prefix(target, ids + [99], [], lot) == len(ids)
        assert_same_state(target, filled(spec, ids, seed=c))
        assert lot.restores[-1][2] == ("ram" if c == 0 else "vram")


def test_a_changed_copy_in_vram_is_refused_and_the_prompt_read_again(spec, caplog):
    """A byte changed in the VRAM copy: the checksum of what arrived differs, the restore is refused with a log
    line, the sequence is reset (what it held was parked first) and nothing else is touched."""
    tokens = list(range(10, 30))
    lot = lot_for(spec, 10**9)
    lot.vram = VramTier(10**8)
    lot.park(filled(spec, tokens, seed=1))
    (ring,) = lot.vram.rings.values()
    ring.block[8] ^= 0x10
    target = filled(spec, [7, 7, 7], seed=2)
    with caplog.at_level("WARNING", logger="strata.engine"):
        assert reuse_prefix(target, tokens + [99], [], lot) == 0
    assert "refused: its bytes changed" in caplog.text and lot.refused == 1
    assert target.length == 0 and lot.best([7, 7, 7, 1])[0] == 3  # the sequence's own conversation was parked first


def test_an_engine_answers_the_same_from_vram_copies(model):
    """Through the scheduler: a conversation pushed out by two others comes back from its VRAM copy (RESTORED ...
    vram), reads only its new tokens and answers as if it had stayed; PARKED reports the copies."""
    engine = engine_with(model, park_gb=0.05)
    engine.parking.vram = VramTier(20 << 20)
    driver = Driver(engine, 2)
    turn2, answer, reused = two_turns_with_others_between(driver)
    assert reused == len(turn2) - 5 - 1
    (restored,) = [line.split() for line in driver.out if line.startswith("RESTORED ")]
    assert restored[2:] == [str(reused), "vram"]
    assert any(len(line.split()) == 8 and line.split()[6] != "0" for line in driver.out if line.startswith("PARKED "))
    stayed = Driver(engine_with(model, park_gb=0), 2)
    stayed.run(conversation(0))
    assert stayed.run(turn2)[0] == answer


def test_park_vram_gb_is_refused_where_it_cannot_work(model):
    with pytest.raises(StrataError, match=r"--park-vram-gb 1: copies in VRAM need the engine on a GPU"):
        engine_with(model, park_gb=0.05, park_vram_gb=1)
    with pytest.raises(ValidationError, match="not a size"):
        EngineSettings(park_vram_gb=-1)
    with pytest.raises(ValidationError, match="not a size"):
        EngineSettings(park_vram_gb=float("nan"))


def test_checkpoints_off_with_pipelined_groups_is_said_at_start(model, caplog):
    """GDN checkpoints are not kept with --batch-groups > 1 (the stages' workers queue the windows): the engine
    says so at start, for a hybrid model only."""
    with caplog.at_level("WARNING", logger="strata.engine"):
        engine_with(model, park_gb=0, layer_split="2,2", batch_groups=2, checkpoint_every=0)
    hybrid = bool(ModelFiles.open(model).spec.gdn_layers())
    assert ("GDN checkpoints (--checkpoint-every) are not kept with --batch-groups 2" in caplog.text) == hybrid


def test_parked_conversations_restored_together_in_shared_windows_answer_as_if_they_had_stayed(model):
    """Four conversations parked (others took their slots), then their follow-ups admitted at once: each restores its
    parked prefix (hybrid models too: the follow-up goes on from the whole conversation) and is read beside the
    others in shared windows, and each answer equals the follow-up run alone on an engine that never parked."""
    engine = engine_with(model, park_gb=0.05, checkpoint_every=0, max_window_tokens=16)
    slots = engine.init_slots(4)
    first = {k: conversation(20 + k) for k in range(4)}
    for k in range(4):
        slots.admit(k, first[k], NEW, stop_ids=frozenset())
    answers: dict[int, list[int]] = {}
    while slots.active or slots.in_flight:
        for e in slots.step():
            answers.setdefault(e.slot, []).append(e.token)
    for k in range(4):  # others take the four slots: the first four are parked
        slots.admit(k, conversation(40 + k), 2, stop_ids=frozenset())
    while slots.active or slots.in_flight:
        slots.step()
    assert engine.parking.conversations >= 4
    follow = {k: first[k] + answers[k] + [3, k + 1, 4] for k in range(4)}
    reused = {k: slots.admit(k, follow[k], NEW, stop_ids=frozenset()) for k in range(4)}
    assert all(reused[k] == len(first[k]) + NEW - 1 for k in range(4)), reused
    got = {}
    while slots.active or slots.in_flight:
        for e in slots.step():
            got.setdefault(e.slot, []).append(e.token)
    alone = engine_with(model, park_gb=0)
    assert got == {k: alone.generate(follow[k], NEW, stop_ids=frozenset()).ids for k in range(4)}
    assert engine.parking.refused == 0
