"""Layer split over stages, pipelined batch groups and per-stage weights: the same tokens as one stage."""

from __future__ import annotations

import pytest
import torch

from strata.errors import StrataError
from strata.model.loader import ModelFiles
from strata.runtime.generate import Engine
from strata.runtime.scheduler import Scheduler
from strata.runtime.stages import plan_stages
from tests.protocol_lines import add, tokens
from tests.tiny_models import CASES, VOCAB, build

NEW = 40
SPLITS = ["2,2", "1,1,2", "1,1,1,1"]


def prompt(i: int) -> list[int]:
    return [(i * 37 + j * 11 + 5) % VOCAB for j in range(6 + 7 * i)]


@pytest.fixture(scope="module", params=list(CASES))
def model(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    build(request.param, folder)
    files = ModelFiles.open(folder)
    one = Engine(files, max_cells=256)
    solo = [one.generate(prompt(i), NEW, stop_ids=frozenset()).ids for i in range(4)]
    return files, solo


def batched(engine: Engine, n: int = 4) -> list[list[int]]:
    """n conversations through the engine process's scheduler (pipelined when the engine has groups)."""
    out: list[str] = []
    sched = Scheduler(engine, n, out.append)
    for i in range(n):
        sched.handle(add(f"c{i}", NEW, prompt(i)))
    while sched.busy:
        sched.step()
    return [tokens(out, f"c{i}") for i in range(n)]


@pytest.mark.parametrize(("split", "lookahead"), [(s, 0) for s in SPLITS] + [("1,1,2", 1)])
def test_split_solo_and_batched_equal_one_stage(model, split, lookahead):
    files, solo = model
    engine = Engine(files, max_cells=256, layer_split=split, trim_stage_weights=True, lookahead=lookahead)
    assert [len(s.layers) for s in engine.stages] == [int(c) for c in split.split(",")]
    assert engine.generate(prompt(0), NEW, stop_ids=frozenset()).ids == solo[0]
    assert batched(engine) == solo


@pytest.mark.parametrize(("split", "groups", "trim", "lookahead"), [
    ("2,2", 2, True, 0), ("1,1,2", 2, False, 0), ("1,1,1,1", 4, True, 0), ("1,1,1,1", 2, False, 0),
    ("2,2", 2, True, 1), ("1,1,1,1", 4, False, 1)])
def test_pipelined_groups_equal_one_stage(model, split, groups, trim, lookahead):
    """lookahead 1: each group's next window is launched before its window in flight is read, its tokens fed
    from that window in the first stage's worker."""
    files, solo = model
    engine = Engine(files, max_cells=256, layer_split=split, batch_groups=groups, trim_stage_weights=trim,
                    lookahead=lookahead)
    assert batched(engine) == solo


def test_a_trimmed_stage_holds_only_its_layers(model):
    files, _ = model
    trimmed = Engine(files, max_cells=64, layer_split="1,1,2", trim_stage_weights=True)
    full = Engine(files, max_cells=64, layer_split="1,1,2")
    for t, f in zip(trimmed.stages, full.stages):
        assert sorted(t.weights.layers) == list(t.layers) and t.weights.held == {}
        assert sorted(f.weights.held) == [i for i in range(4) if i not in f.layers]
        assert not any(name.startswith("experts_") for layer in f.weights.held.values() for name in layer)
        assert t.weights.nbytes() < f.weights.nbytes()
    assert trimmed.stages[0].weights.embed is not None and trimmed.stages[1].weights.embed is None
    assert trimmed.stages[-1].weights.lm_head is not None and trimmed.stages[0].weights.lm_head is None


def test_refusals(model):
    files, _ = model
    spec = files.spec
    with pytest.raises(StrataError, match="covers 3 layers"):
        plan_stages(spec, "1,2", torch.device("cpu"))
    with pytest.raises(StrataError, match="5 stages for a model of 4 layers"):
        plan_stages(spec, "1,1,1,1,1", torch.device("cpu"))
    with pytest.raises(StrataError, match="needs --layer-split"):
        plan_stages(spec, None, torch.device("cpu"), batch_groups=2)
    with pytest.raises(StrataError, match="two stages on one device"):
        plan_stages(spec, "2,2", torch.device("cuda"), split_device="cuda:0", batch_groups=2)
    if torch.cuda.device_count() < 3:
        with pytest.raises(StrataError, match="GPU"):
            plan_stages(spec, "1,1,2", torch.device("cuda"))
    assert [len(r) for r, _ in plan_stages(spec, "0.5,0.5", torch.device("cpu"))] == [2, 2]


def test_groups_launch_in_turns_with_lookahead(model):
    """A stage runs windows in launch order and a group's fed window waits for the group's window before it, so
    the groups take turns (g0, g1, g0, g1): each stage always has another group's window to run meanwhile."""
    files, solo = model
    engine = Engine(files, max_cells=256, layer_split="2,2", batch_groups=2, lookahead=1)
    slots = engine.init_slots(4)
    for i in range(4):
        slots.admit(i, prompt(i), NEW, stop_ids=frozenset())
    got = {i: [] for i in range(4)}
    for e in slots.step():  # launches two windows per group, reads the oldest
        got[e.slot].append(e.token)
    assert [sw.group for sw in slots._flight] == [1, 0, 1]  # each group: its prompt window, then a decoding one
    assert [sw.samplers for sw in slots._flight] == [[2, 3], [0, 1], [2, 3]]
    assert [sw.decoding for sw in slots._flight] == [[], [0, 1], [2, 3]]
    for e in slots.flush():
        got[e.slot].append(e.token)
    assert all(got[i] == solo[i][: len(got[i])] for i in range(4)) and all(len(got[i]) == 2 for i in range(4))
