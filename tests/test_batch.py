"""Batch slots: conversations decoded together give exactly the tokens each gets alone."""

from __future__ import annotations

import pytest

from strata.errors import StrataError
from strata.model.loader import ModelFiles
from strata.runtime.generate import Engine
from strata.runtime.sampling import SamplingParams
from tests.tiny_models import CASES, VOCAB, build

NEW = 150
NO_STOP = frozenset()


def prompt(i: int) -> list[int]:
    return [(i * 31 + j * 7 + 3) % VOCAB for j in range(5 + 9 * i)]  # 5 .. 68 tokens: some longer than a GDN chunk


@pytest.fixture(scope="module", params=list(CASES))
def engine(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    build(request.param, folder)
    return Engine(ModelFiles.open(folder), max_cells=512)


def drain(slots, sync: bool = True) -> dict[int, list[int]]:
    """Every event until the slots are idle: one window at a time (sync), or stepping with windows in flight."""
    out: dict[int, list[int]] = {}
    while slots.active or slots.in_flight:
        events = slots.commit_slots(slots.run_slots()) if sync else slots.step()
        for e in events:
            out.setdefault(e.slot, []).append(e.token)
    return out


def test_eight_conversations_equal_their_solo_runs(engine):
    solo = [engine.generate(prompt(i), NEW, stop_ids=NO_STOP).ids for i in range(8)]
    slots = engine.init_slots(8)
    first = {i: slots.admit(i, prompt(i), NEW, stop_ids=NO_STOP).token for i in range(8)}
    rest = drain(slots)
    batched = [[first[i], *rest[i]] for i in range(8)]
    for i in range(8):
        assert batched[i] == solo[i], f"conversation {i} drifted from its solo run"


def test_staggered_admissions_and_a_reused_slot(engine):
    slots = engine.init_slots(4)
    got: dict[str, list[int]] = {}
    names = {0: "a", 1: "b"}
    for i, name in names.items():
        got[name] = [slots.admit(i, prompt(i), 60, stop_ids=NO_STOP).token]
    for step in range(40):
        if step == 10:  # a slot that joins mid-flight
            names[2] = "c"
            got["c"] = [slots.admit(2, prompt(5), 60, stop_ids=NO_STOP).token]
        if step == 20:  # one stopped early, its slot reused for a new conversation
            assert slots.stop(1)
            names[1] = "d"
            got["d"] = [slots.admit(1, prompt(3), 30, stop_ids=NO_STOP).token]
        for e in slots.commit_slots(slots.run_slots()):
            got[names[e.slot]].append(e.token)
    for name, events in drain(slots).items():
        got[names[name]] += events
    assert got["a"] == engine.generate(prompt(0), 60, stop_ids=NO_STOP).ids
    assert got["c"] == engine.generate(prompt(5), 60, stop_ids=NO_STOP).ids
    assert got["d"] == engine.generate(prompt(3), 30, stop_ids=NO_STOP).ids
    b_solo = engine.generate(prompt(1), 60, stop_ids=NO_STOP).ids
    assert got["b"] == b_solo[: len(got["b"])] and len(got["b"]) == 21


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
    first = {i: slots.admit(i, prompt(i), 40, p, stop_ids=NO_STOP).token for i, p in enumerate(SAMPLED)}
    rest = drain(slots, sync=False)
    assert [[first[i], *rest[i]] for i in range(len(SAMPLED))] == solo


@pytest.mark.parametrize("lookahead", [None, 0, 1], ids=["sync", "step", "lookahead"])
def test_stop_tokens_and_length_end_a_slot(engine, lookahead):
    ids = engine.generate(prompt(2), 40, stop_ids=NO_STOP).ids
    stop = next(ids[j] for j in range(2, 40) if ids[j] not in ids[:j])  # a token first sampled by a batch window
    slots = engine.init_slots(3, lookahead=lookahead or 0)
    cells = len(prompt(2)) + 4  # room for the prompt and 4 more positions: the 4th token ends it ("length")
    slots.slots[2].state.max_cells = cells
    events = [slots.admit(0, prompt(2), 40, stop_ids=frozenset({stop})), slots.admit(1, prompt(2), 3, stop_ids=NO_STOP),
              slots.admit(2, prompt(2), 40, stop_ids=NO_STOP)]
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
    """Windows launched ahead of the host (their tokens fed on the device): admissions and stops flush them, a
    conversation continues exactly as alone, and a flushed slot's state is what its tokens say."""
    slots = engine.init_slots(4, lookahead=1)
    got = {0: [slots.admit(0, prompt(0), 50, stop_ids=NO_STOP).token], 1: [slots.admit(1, prompt(1), 50, stop_ids=NO_STOP).token]}
    for step in range(30):
        if step == 7:
            with pytest.raises(StrataError, match="in flight"):
                slots.admit(2, prompt(5), 50, stop_ids=NO_STOP)
            for e in slots.flush():
                got[e.slot].append(e.token)
            assert not slots.in_flight
            got[2] = [slots.admit(2, prompt(5), 50, stop_ids=NO_STOP).token]
        for e in slots.step():
            got[e.slot].append(e.token)
    for slot, tokens in drain(slots, sync=False).items():
        got[slot] += tokens
    assert got[0] == engine.generate(prompt(0), 50, stop_ids=NO_STOP).ids
    assert got[1] == engine.generate(prompt(1), 50, stop_ids=NO_STOP).ids
    assert got[2] == engine.generate(prompt(5), 50, stop_ids=NO_STOP).ids


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
    assert slots.active == [0]  # the failures left the running slot alone


@pytest.mark.parametrize("params", [SamplingParams(), SAMPLED[3], SAMPLED[5]], ids=["greedy", "sampled", "penalties"])
def test_a_solo_run_moved_into_a_slot_continues_exactly(engine, params):
    """What the server does when a second request arrives: STOP the solo run, BGEN it into a slot with resume."""
    from strata import protocol
    from strata.runtime.scheduler import Scheduler

    out: list[str] = []
    sched = Scheduler(engine, 2, out.append)
    keys = protocol.format_request(protocol.Request(60, params, frozenset(), True, prompt(4)))
    sched.handle(f"GEN {keys}")
    for _ in range(9):
        sched.step()
    sched.handle("STOP")
    solo = [int(line.split()[1]) for line in out if line.startswith("T ")]
    assert out[-1] == f"DONE abort {len(prompt(4))} {len(solo)} 0"
    moved = protocol.Request(60, params, frozenset(), True, prompt(4) + solo, resume=len(solo))
    sched.handle(f"BGEN 1 {protocol.format_request(moved)}")
    assert sched.slots.reused == len(prompt(4)) + len(solo) - 1  # only the last token was read again
    while sched.busy:
        sched.step()
    rest = [int(line.split()[2]) for line in out if line.startswith("BT 1 ")]
    assert out[-1] == f"BDONE 1 length {len(prompt(4))} 60"
    assert solo + rest == engine.generate(prompt(4), 60, params, stop_ids=NO_STOP).ids


def test_scheduler_with_lookahead_stops_and_readmits_a_slot(engine):
    """The engine process's loop with windows in flight: BSTOP reads them first (their tokens are sent before the
    BDONE, none after), the slot's state is whole, and a new conversation in it reuses its prefix and runs as alone."""
    from strata.runtime.scheduler import Scheduler

    out: list[str] = []
    saved, engine.lookahead = engine.lookahead, 1
    try:
        sched = Scheduler(engine, 2, out.append)
    finally:
        engine.lookahead = saved
    assert sched.slots.lookahead == 1
    sched.handle(f"BGEN 0 60 ignore_eos=1 {' '.join(map(str, prompt(2)))}")
    sched.handle(f"BGEN 1 40 ignore_eos=1 {' '.join(map(str, prompt(3)))}")
    for _ in range(6):
        sched.step()
    assert sched.slots.in_flight
    sched.handle("BSTOP 0")
    assert not sched.slots.in_flight
    first = [int(line.split()[2]) for line in out if line.startswith("BT 0 ")]
    assert out[-1] == f"BDONE 0 abort {len(prompt(2))} {len(first)}"
    assert first == engine.generate(prompt(2), len(first), stop_ids=NO_STOP).ids
    state = sched.slots.slots[0].state
    assert state.tokens == (prompt(2) + first)[: state.length] and state.length == len(state.tokens)
    held = state.length
    follow_up = prompt(2) + first + prompt(4)
    sched.handle(f"BGEN 0 30 ignore_eos=1 {' '.join(map(str, follow_up))}")
    assert sched.slots.reused == held  # the whole state: every token it read is in the follow-up
    mark = len(out)
    while sched.busy:
        sched.step()
    again = [int(line.split()[2]) for line in out[mark - 1 :] if line.startswith("BT 0 ")]
    assert again == engine.generate(follow_up, 30, stop_ids=NO_STOP).ids
    rest = [int(line.split()[2]) for line in out if line.startswith("BT 1 ")]
    assert rest == engine.generate(prompt(3), 40, stop_ids=NO_STOP).ids
    assert f"BDONE 1 length {len(prompt(3))} 40" in out and f"BDONE 0 length {len(follow_up)} 30" in out


@pytest.mark.parametrize("params", [SamplingParams(), SAMPLED[0], SAMPLED[1], SAMPLED[5]],
                         ids=["greedy", "sampled", "top_p", "penalties"])
def test_the_solo_path_one_step_ahead_gives_the_same_tokens(engine, params):
    """`lookahead` 1 on the solo path (the GPU default): each step launched before the host reads the last token.
    Same tokens; the state holds exactly the tokens it read, the stop token included when one ended it, and a
    generation closed early leaves it whole too. (Penalties keep the host first: they count on the host.)"""
    want = engine.generate(prompt(3), 30, params, stop_ids=NO_STOP).ids
    saved, engine.lookahead = engine.lookahead, 1
    try:
        assert engine._runs_ahead(params) == (not params.has_penalties)
        assert engine.generate(prompt(3), 30, params, stop_ids=NO_STOP).ids == want
        stop = next((want[j] for j in range(1, 30) if want[j] not in want[:j]), want[0])  # ends where it first occurs
        state = engine.new_state()
        got = [t for t, _ in engine.stream(prompt(3), 30, params, frozenset({stop}), state=state)]
        assert got == want[: want.index(stop) + 1]
        assert state.tokens == (prompt(3) + got)[: state.length] and state.length == len(state.tokens)
        assert state.length == len(prompt(3)) + len(got) - (0 if engine._runs_ahead(params) else 1)
        state = engine.new_state()
        steps = engine.stream(prompt(3), 30, params, NO_STOP, state=state)
        early = [next(steps)[0] for _ in range(5)]
        steps.close()
        assert early == want[:5] and state.tokens == (prompt(3) + want)[: state.length] == state.tokens[: state.length]
        assert state.length == len(state.tokens)
    finally:
        engine.lookahead = saved
