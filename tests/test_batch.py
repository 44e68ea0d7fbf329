"""Batch slots and mixed windows: conversations decoded together, and prompts read in chunks inside the decoding
windows, give exactly the tokens each conversation gets alone."""

from __future__ import annotations

import pytest
import torch

from strata.errors import StrataError
from strata.model.loader import ModelFiles
from strata.runtime.generate import Engine
from strata.runtime.sampling import SamplingParams
from tests.slot_helpers import decode_rows_alone_and_beside
from tests.tiny_models import CASES, VOCAB, build

NEW = 150
NO_STOP = frozenset()
BUDGET = 24  # rows per window: prompts of up to 68 tokens span several windows


def prompt(i: int) -> list[int]:
    return [(i * 31 + j * 7 + 3) % VOCAB for j in range(5 + 9 * i)]  # 5 .. 68 tokens: some longer than a GDN chunk


@pytest.fixture(scope="module", params=list(CASES))
def engine(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    build(request.param, folder)
    return Engine(ModelFiles.open(folder), max_cells=512, max_window_tokens=BUDGET)


def drain(slots, sync: bool = True, out: dict | None = None, windows: list | None = None) -> dict[int, list[int]]:
    """Every event until the slots are idle: one window at a time (sync), or stepping with windows in flight.
    `windows`: gets each synchronous window's (decoding slots, prompt rows, rows)."""
    out = {} if out is None else out
    while slots.active or slots.in_flight:
        if sync:
            sw = slots.run_slots()
            if windows is not None:
                windows.append((list(sw.decoding), sw.prompt_rows, sw.num_rows))
            events = slots.commit_slots(sw)
        else:
            events = slots.step()
        for e in events:
            out.setdefault(e.slot, []).append(e.token)
    return out


def test_eight_conversations_equal_their_solo_runs(engine):
    """Eight prompts admitted together are read in chunks over several windows (24 rows each), the earlier ones
    decoding while the later ones are read; every answer equals its solo run, and no window exceeds the budget."""
    solo = [engine.generate(prompt(i), NEW, stop_ids=NO_STOP).ids for i in range(8)]
    slots = engine.init_slots(8)
    reused = [slots.admit(i, prompt(i), NEW, stop_ids=NO_STOP) for i in range(8)]  # parked by the solo runs
    windows: list = []
    batched = drain(slots, windows=windows)
    for i in range(8):
        assert batched[i] == solo[i], f"conversation {i} drifted from its solo run"
    assert max(rows for *_, rows in windows) <= BUDGET
    assert any(decoding and prompt_rows for decoding, prompt_rows, _ in windows)  # mixed windows ran
    assert sum(p for _, p, _ in windows) == sum(len(prompt(i)) - reused[i] for i in range(8))  # each row once


def test_a_long_prompt_never_stops_the_decoding_slots(engine):
    """Two conversations decode; a 300-token prompt arrives. Every window from then on holds a row of each decoding
    slot (a token for each, window after window) and prompt rows up to the budget; the long prompt is read over
    several windows, and all three answers equal their solo runs."""
    long_prompt = [(5 + 11 * j) % VOCAB for j in range(300)]
    want = {0: engine.generate(prompt(1), 60, stop_ids=NO_STOP).ids, 1: engine.generate(prompt(2), 60, stop_ids=NO_STOP).ids,
            2: engine.generate(long_prompt, 20, stop_ids=NO_STOP).ids}
    slots = engine.init_slots(3)
    got: dict[int, list[int]] = {}
    slots.admit(0, prompt(1), 60, stop_ids=NO_STOP)
    slots.admit(1, prompt(2), 60, stop_ids=NO_STOP)
    while slots.slots[0].reading or slots.slots[1].reading or len(got.get(1, [])) < 5:
        for e in slots.commit_slots(slots.run_slots()):
            got.setdefault(e.slot, []).append(e.token)
    slots.admit(2, long_prompt, 20, stop_ids=NO_STOP)
    reading_windows = 0
    while slots.slots[2].reading or not got.get(2):
        before = {i: len(got.get(i, [])) for i in (0, 1)}
        sw = slots.run_slots()
        assert sw.num_rows <= BUDGET and sw.decoding[:2] == [0, 1]
        for e in slots.commit_slots(sw):
            got.setdefault(e.slot, []).append(e.token)
        assert all(len(got[i]) == before[i] + 1 for i in (0, 1)), "a decoding slot missed a window"
        reading_windows += 1
    assert reading_windows >= 300 // (BUDGET - 2)  # the prompt spanned several windows, each a row per stream
    drain(slots, out=got)
    assert got == want


def test_staggered_admissions_and_a_reused_slot(engine):
    slots = engine.init_slots(4)
    got: dict[str, list[int]] = {}
    names = {0: "a", 1: "b"}
    for i in names:
        slots.admit(i, prompt(i), 60, stop_ids=NO_STOP)
    for step in range(40):
        if step == 10:  # a slot that joins mid-flight
            names[2] = "c"
            slots.admit(2, prompt(5), 60, stop_ids=NO_STOP)
        if step == 20:  # one stopped early, its slot reused for a new conversation
            assert slots.stop(1)
            names[1] = "d"
            slots.admit(1, prompt(3), 30, stop_ids=NO_STOP)
        for e in slots.commit_slots(slots.run_slots()):
            got.setdefault(names[e.slot], []).append(e.token)
    for slot, events in drain(slots).items():
        got[names[slot]] += events
    assert got["a"] == engine.generate(prompt(0), 60, stop_ids=NO_STOP).ids
    assert got["c"] == engine.generate(prompt(5), 60, stop_ids=NO_STOP).ids
    assert got["d"] == engine.generate(prompt(3), 30, stop_ids=NO_STOP).ids
    b_solo = engine.generate(prompt(1), 60, stop_ids=NO_STOP).ids
    assert got["b"] == b_solo[: len(got["b"])] and len(got["b"]) == 20


def test_decode_rows_are_bitwise_the_same_beside_prompt_rows(engine):
    """Two slots decode; the same decode rows run alone, then with a prompt chunk of another slot beside them:
    their logits are bitwise equal."""
    slots = engine.init_slots(3)
    for i in (0, 1):
        slots.admit(i, prompt(i + 1), 20, stop_ids=NO_STOP)
    while any(s.reading for s in slots.slots):
        slots.commit_slots(slots.run_slots())
    alone, mixed = decode_rows_alone_and_beside(engine, slots, [0, 1], 2, prompt(4)[: BUDGET - 2])
    assert mixed.shape[0] == 3
    assert torch.equal(mixed[:2], alone)


SAMPLED = [
    SamplingParams(temperature=0.8, seed=1),
    SamplingParams(temperature=1.2, top_p=0.9, seed=2),
    SamplingParams(temperature=0.7, top_k=5, seed=3, repetition_penalty=1.3),
    SamplingParams(temperature=1.0, min_p=0.1, seed=4, presence_penalty=0.5, frequency_penalty=0.4),
    SamplingParams(),  # a greedy neighbour
    SamplingParams(repetition_penalty=1.5, frequency_penalty=0.3),  # greedy with penalties
]


@pytest.mark.parametrize("lookahead", [0, 1])
def test_sampled_answers_do_not_depend_on_neighbours(engine, lookahead):
    solo = [engine.generate(prompt(i), 40, p, stop_ids=NO_STOP).ids for i, p in enumerate(SAMPLED)]
    slots = engine.init_slots(len(SAMPLED), lookahead=lookahead)
    for i, p in enumerate(SAMPLED):
        slots.admit(i, prompt(i), 40, p, stop_ids=NO_STOP)
    got = drain(slots, sync=False)
    assert [got[i] for i in range(len(SAMPLED))] == solo


@pytest.mark.parametrize("lookahead", [None, 0, 1], ids=["sync", "step", "lookahead"])
def test_stop_tokens_and_length_end_a_slot(engine, lookahead):
    ids = engine.generate(prompt(2), 40, stop_ids=NO_STOP).ids
    stop = next(ids[j] for j in range(2, 40) if ids[j] not in ids[:j])  # a token first sampled by a decoding row
    slots = engine.init_slots(3, lookahead=lookahead or 0)
    cells = len(prompt(2)) + 4  # room for the prompt and 4 more positions: the 4th token ends it ("length")
    slots.slots[2].state.max_cells = cells
    slots.admit(0, prompt(2), 40, stop_ids=frozenset({stop}))
    slots.admit(1, prompt(2), 3, stop_ids=NO_STOP)
    slots.admit(2, prompt(2), 40, stop_ids=NO_STOP)
    events = []
    while slots.active or slots.in_flight:
        events += slots.commit_slots(slots.run_slots()) if lookahead is None else slots.step()
    done = {e.slot: e for e in events if e.finish_reason}
    assert done[0].finish_reason == "stop" and done[0].token == stop
    assert done[1].finish_reason == "length" and done[2].finish_reason == "length"
    stop_at = ids.index(stop) + 1
    assert slots.slots[0].generated == ids[:stop_at]
    assert slots.slots[1].generated == ids[:3] and slots.slots[2].generated == ids[:4]
    assert [len([e for e in events if e.slot == i]) for i in range(3)] == [stop_at, 3, 4]  # one event per token
    for slot in slots.slots:  # a state holds exactly the tokens it has read, whatever ran ahead of the host
        state = slot.state
        assert state.length == len(state.tokens) and state.tokens == (prompt(2) + ids)[: state.length]
        assert state.length <= cells or slot is not slots.slots[2]
    # what ran ahead: behind a stop token one more row (it read the stop token); nothing past max_new or max_cells
    assert slots.slots[0].state.length == len(prompt(2)) + stop_at - (0 if lookahead == 1 else 1)
    assert slots.slots[1].state.length == len(prompt(2)) + 2 and slots.slots[2].state.length == len(prompt(2)) + 3


def test_lookahead_batches_equal_solo_with_staggered_admissions(engine):
    """Windows launched ahead of the host (decoding rows' tokens fed on the device, prompt rows from the host):
    a request is admitted while the other slots' windows stay in flight, its prompt joins the next window, and
    every conversation continues exactly as alone. A slot with a row still in flight is not given out."""
    slots = engine.init_slots(4, lookahead=1)
    got: dict[int, list[int]] = {}
    slots.admit(0, prompt(0), 50, stop_ids=NO_STOP)
    slots.admit(1, prompt(1), 50, stop_ids=NO_STOP)
    for step in range(30):
        if step == 7:
            assert slots.in_flight and slots.busy == {0, 1}
            assert slots.free == [2, 3]
            slots.admit(2, prompt(5), 50, stop_ids=NO_STOP)  # 50 tokens: read over several windows
            assert slots.in_flight  # nothing was read to make room for it
        if step == 12:
            slots.stop(1)  # its rows in flight are committed when read, and give no event
            assert 1 in slots.busy and 1 not in slots.free
            with pytest.raises(StrataError, match="in flight"):
                slots.admit(1, prompt(3), 50, stop_ids=NO_STOP)
        if step == 14:
            assert 1 not in slots.busy
            slots.admit(1, prompt(3), 50, stop_ids=NO_STOP)
        for e in slots.step():
            got.setdefault(e.slot, []).append(e.token)
        if step == 11:
            stopped = list(got[1])  # what slot 1's first conversation had when it was stopped
    drain(slots, sync=False, out=got)
    assert got[0] == engine.generate(prompt(0), 50, stop_ids=NO_STOP).ids
    assert got[2] == engine.generate(prompt(5), 50, stop_ids=NO_STOP).ids
    first = engine.generate(prompt(1), 50, stop_ids=NO_STOP).ids
    assert got[1][: len(stopped)] == first[: len(stopped)]
    assert got[1][len(stopped):] == engine.generate(prompt(3), 50, stop_ids=NO_STOP).ids


def test_admission_errors(engine):
    slots = engine.init_slots(2)
    slots.admit(0, prompt(0), 5)
    with pytest.raises(StrataError, match="busy"):
        slots.admit(0, prompt(1), 5)
    with pytest.raises(StrataError, match="slot 7 does not exist"):
        slots.admit(7, prompt(1), 5)
    with pytest.raises(StrataError, match="vocabulary"):
        slots.admit(1, [1, VOCAB + 5], 5)
    with pytest.raises(StrataError, match="max_cells"):
        slots.admit(1, [1] * 600, 5)
    with pytest.raises(StrataError, match="at least one token"):
        slots.admit(1, prompt(1), 0)
    assert slots.active == [0]  # the failures left the running slot alone
    with pytest.raises(StrataError, match="max-window-tokens"):
        engine.init_slots(BUDGET + 1)  # a decoding row per slot must fit a window


def test_the_solo_stream_closed_early_leaves_a_whole_state(engine):
    """`Engine.stream` runs in a slot of its own: closing it early stops the request, and its slot's state holds
    exactly the tokens it read (a follow-up then reuses them)."""
    want = engine.generate(prompt(3), 30, stop_ids=NO_STOP).ids
    steps = engine.stream(prompt(3), 30, stop_ids=NO_STOP)
    early = [next(steps)[0] for _ in range(5)]
    steps.close()
    state = engine.solo_slots().slots[0].state
    assert early == want[:5] and not engine.solo_slots().slots[0].active
    assert state.tokens == (prompt(3) + want)[: state.length] and state.length == len(state.tokens)
    assert engine.generate(prompt(3), 30, stop_ids=NO_STOP).ids == want
    kept = len(prompt(3)) - 1 if engine.parking.truncatable else 0  # a GDN state past the prompt cannot be cut
    assert engine.solo_slots().slots[0].num_reused == kept


@pytest.mark.parametrize("block", [1, 3, 8])
def test_row_blocks_give_each_row_its_solo_result(monkeypatch, block):
    """Whatever block the machine measured (or STRATA_ROW_BLOCK set), a row's product in a window of 5 rows equals
    its product alone, bit for bit."""
    from strata.kernels import invariant

    monkeypatch.setattr(invariant, "_blocks", {})
    monkeypatch.setenv("STRATA_ROW_BLOCK", str(block))
    w = torch.randn(96, 64)
    x = torch.randn(5, 64)
    together = invariant.invariant_linear(x, w)
    for r in range(5):
        assert torch.equal(together[r], invariant.invariant_linear(x[r:r + 1], w)[0])


def test_the_measured_row_block_and_a_bad_setting(monkeypatch):
    from strata.kernels import invariant

    monkeypatch.setattr(invariant, "_blocks", {})
    monkeypatch.delenv("STRATA_ROW_BLOCK", raising=False)
    block, times = invariant.measure_row_block(torch.float32, nbytes=4 << 20, repeats=2)
    assert block in invariant.CANDIDATES and set(times) == set(invariant.CANDIDATES)
    assert times[block] <= invariant.WITHIN * times[1]
    monkeypatch.setenv("STRATA_ROW_BLOCK", "three")
    with pytest.raises(ValueError, match="STRATA_ROW_BLOCK='three'"):
        invariant.row_block(torch.float32)


def fresh_prompt(salt: int) -> list[int]:
    """59 tokens (three windows of 24) that no earlier test read, so nothing parked holds them."""
    return [(t + salt) % VOCAB for t in prompt(6)]


@pytest.mark.parametrize("lookahead", [0, 1])
def test_samples_of_one_prompt_share_its_read(engine, lookahead):
    """Requests with the same prompt admitted together (`n` samples) read it once: the others take their first
    token from the leader's last prompt row and a copy of its state (K/V cells, GDN states), and each answer is
    the one it gets alone, greedy or sampled with its own seed."""
    ids = fresh_prompt(100 + lookahead)
    params = [SamplingParams(), SamplingParams(temperature=1.0, seed=11), SamplingParams(temperature=1.0, seed=12),
              SamplingParams()]
    slots = engine.init_slots(4, lookahead=lookahead)
    reused = [slots.admit(i, ids, 30, p, stop_ids=NO_STOP) for i, p in enumerate(params)]
    assert reused == [0] + [len(ids)] * 3 and [s.follows for s in slots.slots] == [None, 0, 0, 0]
    slots.take_read_log()
    got = drain(slots, sync=False)
    assert sum(prompt_rows for _, prompt_rows in slots.take_read_log()) == len(ids)  # read once, not four times
    assert [s.num_reused for s in slots.slots[1:]] == [len(ids)] * 3  # reported as cached prompt tokens
    solo = [engine.generate(ids, 30, p, stop_ids=NO_STOP).ids for p in params]
    assert [got[i] for i in range(4)] == solo
    assert got[1] != got[2]  # their own seeds


def test_a_sample_whose_leader_stops_reads_the_prompt_itself(engine):
    ids = fresh_prompt(200)
    slots = engine.init_slots(2)
    slots.admit(0, ids, 20, stop_ids=NO_STOP)
    assert slots.admit(1, ids, 20, SamplingParams(temperature=1.0, seed=5), stop_ids=NO_STOP) == len(ids)
    slots.commit_slots(slots.run_slots())  # the leader's first 24 prompt rows
    slots.stop(0)
    got = drain(slots)
    assert 0 not in got and got[1] == engine.generate(ids, 20, SamplingParams(temperature=1.0, seed=5),
                                                      stop_ids=NO_STOP).ids
    assert slots.slots[1].num_reused == 0
