"""The CPU expert pool: budgets below a stage's experts keep a resident set on the device and compute the other
(row, expert) pairs on the CPU. Real outputs against the all-resident engine and `transformers`, batched against
solo, layer splits, trimming, the device tensors, the residency facts and the budget's refusals."""

from __future__ import annotations

import logging
import os
from types import SimpleNamespace

import pytest
import torch

from strata.config import EngineSettings
from strata.errors import StrataError
from strata.experts.budget import check_expert_budget
from strata.experts.residency import expert_bytes, residency_by_device
from strata.model.loader import ModelFiles
from strata.model.random_weights import random_stage_weights
from strata.runtime.generate import Engine
from strata.runtime.scheduler import Scheduler
from tests.protocol_lines import add, tokens
from tests.slot_helpers import decode_logits
from tests.tiny_models import VOCAB, build

NEW = 16
PROMPTS = [[(i * 37 + j * 11 + 5) % VOCAB for j in range(5 + 6 * i)] for i in range(8)]


@pytest.fixture(scope="module", params=["qwen3_moe-gqa4", "qwen3_moe-mixed-dense", "qwen3_next"])
def model(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    ref = build(request.param, folder)
    files = ModelFiles.open(folder)
    full = Engine(files, max_cells=256)
    return SimpleNamespace(name=request.param, ref=ref, files=files, spec=files.spec, full=full,
                           solo=[full.generate(p, NEW, stop_ids=frozenset()).ids for p in PROMPTS])


def budget_gb(spec, layers: range, per_layer: int, dtype_bytes: int = 4) -> float:
    """The budget (float32 weights unless `dtype_bytes` says otherwise) that keeps `per_layer` experts of each MoE
    layer of `layers` resident."""
    moe = [i for i in layers if spec.layers[i].mlp == "moe"]
    return (len(moe) * per_layer + 0.5) * expert_bytes(spec, dtype_bytes) / 1e9


def half(spec, layers: range | None = None) -> float:
    return budget_gb(spec, layers or range(spec.num_layers), spec.moe.num_experts // 2)


def pools(engine: Engine) -> dict:
    return {i: p for s in engine.stages for i, p in s.forward.pools.items()}


def batched(engine: Engine, n: int = 8) -> list[list[int]]:
    """n conversations decoded together through the engine process's scheduler (pipelined with groups)."""
    out: list[str] = []
    sched = Scheduler(engine, n, out.append)
    for i in range(n):
        sched.handle(add(f"c{i}", NEW, PROMPTS[i]))
    while sched.busy:
        sched.step()
    return [tokens(out, f"c{i}") for i in range(n)]


def assert_solo_batched_and_bitwise(engine: Engine, want: list[list[int]]) -> None:
    """Greedy tokens alone equal `want`, 8 conversations decoded together equal them, and a row's decode logits
    are bit for bit the same alone and beside 7 others."""
    solo = [engine.generate(p, NEW, stop_ids=frozenset()).ids for p in PROMPTS]
    assert solo == want
    assert batched(engine) == solo
    alone = decode_logits(engine.init_slots(1), {0: PROMPTS[4]})
    together = decode_logits(engine.init_slots(8), {slot: PROMPTS[(slot + 4) % 8] for slot in range(8)})
    assert torch.equal(together[0], alone[0])


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def every_logit(engine: Engine, prompt: list[int], answer: list[int]) -> torch.Tensor:
    """The logits at every position: the prompt in one window, then one decode window per answer token."""
    state = engine.new_state()
    return torch.cat([engine.run(state, prompt, all_logits=True)] + [engine.run(state, [t]) for t in answer[:-1]])


def test_half_resident_logits_match_all_resident_and_transformers(model):
    pooled = Engine(model.files, max_cells=256, expert_budget_gb=[half(model.spec)])
    assert pooled.expert_residency() == {"cpu": 0.5}
    prompt, answer = PROMPTS[2], model.solo[2]
    ours = every_logit(pooled, prompt, answer)
    assert rel_err(ours, every_logit(model.full, prompt, answer)) < 1e-5
    with torch.no_grad():
        theirs = model.ref(input_ids=torch.tensor([prompt + answer])).logits[0, : len(prompt) + len(answer) - 1].float()
    assert rel_err(ours, theirs) < 1e-4
    counts = [(p.pairs_here, p.pairs_total) for p in pools(pooled).values()]
    assert counts and all(0 < here < total for here, total in counts), "both the device and the CPU computed pairs"


def test_half_resident_greedy_tokens_equal_all_resident(model):
    pooled = Engine(model.files, max_cells=256, expert_budget_gb=[half(model.spec)])
    for i in (0, 3, 5):
        assert pooled.generate(PROMPTS[i], NEW, stop_ids=frozenset()).ids == model.solo[i]


@pytest.mark.parametrize("share", [2, 4], ids=["50%", "25%"])
def test_batched_equals_solo_with_the_pool(model, share):
    """8 slots decoded together, each row's CPU pairs computed beside 7 others, with half or a quarter of the
    experts resident: the solo tokens, and the solo logits bit for bit."""
    spec = model.spec
    count = spec.moe.num_experts // share
    engine = Engine(model.files, max_cells=256, expert_budget_gb=[budget_gb(spec, range(spec.num_layers), count)])
    assert engine.expert_residency() == {"cpu": count / spec.moe.num_experts}
    assert_solo_batched_and_bitwise(engine, model.solo)


@pytest.mark.parametrize("model", ["qwen3_moe-gqa4"], indirect=True)
def test_a_bfloat16_pool_on_its_own_kernel_keeps_batched_equal_to_solo(model):
    """bfloat16 experts in host RAM run on the pool's own kernel where the host builds it (AVX512_BF16 and gcc;
    oneDNN's products elsewhere): 8 slots decoded together give each slot's solo tokens and a row's logits bit for
    bit, and the logits are the all-resident bfloat16 engine's to bfloat16 rounding."""
    from strata.experts import native

    spec = model.spec
    budget = budget_gb(spec, range(spec.num_layers), spec.moe.num_experts // 2, dtype_bytes=2)
    pooled = Engine(model.files, max_cells=256, dtype=torch.bfloat16, expert_budget_gb=[budget])
    assert pooled.expert_residency() == {"cpu": 0.5}
    assert all(p.native == (native.load() is not None) for p in pools(pooled).values())
    full = Engine(model.files, max_cells=256, dtype=torch.bfloat16)
    prompt, answer = PROMPTS[2], model.solo[2]
    assert rel_err(every_logit(pooled, prompt, answer), every_logit(full, prompt, answer)) < 3e-2
    assert_solo_batched_and_bitwise(pooled, [pooled.generate(p, NEW, stop_ids=frozenset()).ids for p in PROMPTS])


@pytest.mark.parametrize("frac", [0.5, 1.0])
def test_pcie_frac_uploads_a_fixed_share_of_the_host_experts(model, frac):
    """--pcie-frac: the device computes the pairs of the first round(F x N) host experts on uploaded weights, the
    CPU the rest. The logits are the all-resident ones, the tokens too, batched == solo bit for bit (which experts go
    up does not depend on the window), the EXPERTS line counts the uploads; F = 1 leaves the CPU nothing."""
    up = Engine(model.files, max_cells=256, expert_budget_gb=[half(model.spec)], pcie_frac=frac)
    for p in pools(up).values():
        assert p.num_upload == round(frac * p.num_here) > 0
        assert p.up_gate_up.shape[0] == p.num_upload and len(p.gate_up) == p.num_here - p.num_upload
    prompt, answer = PROMPTS[2], model.solo[2]
    assert rel_err(every_logit(up, prompt, answer), every_logit(model.full, prompt, answer)) < 1e-5
    assert_solo_batched_and_bitwise(up, model.solo)
    uploaded = sum(p.pairs_uploaded for p in pools(up).values())
    on_cpu = sum(p.pairs_here for p in pools(up).values())
    assert uploaded > 0 and (on_cpu > 0) == (frac < 1)
    out: list[str] = []
    sched = Scheduler(up, 2, out.append)
    sched.handle(add("c0", 4, PROMPTS[1]))
    while sched.busy:
        sched.step()
    sched.step()
    fields = [line.split()[1:] for line in out if line.startswith("EXPERTS ")][-1]
    assert int(fields[4]) == sum(p.pairs_uploaded for p in pools(up).values())
    assert int(fields[5]) == sum(p.experts_uploaded * p.upload_expert_bytes for p in pools(up).values()) > 0


def test_pcie_frac_is_checked(model):
    with pytest.raises(StrataError, match="--pcie-frac 1.5: expected a share from 0 to 1"):
        Engine(model.files, max_cells=64, expert_budget_gb=[half(model.spec)], pcie_frac=1.5)
    with pytest.raises(StrataError, match="--pcie-frac 0.3: no expert is in host RAM"):
        EngineSettings(pcie_frac=0.3).stage_options()
    with pytest.raises(ValueError, match="less than or equal to 1"):
        EngineSettings(pcie_frac=2)
    assert EngineSettings(expert_budget_gb="1", pcie_frac=0.25).stage_options()["pcie_frac"] == 0.25


def test_budget_zero_keeps_every_expert_in_host_ram(model):
    zero = Engine(model.files, max_cells=256, expert_budget_gb=[0])
    assert zero.expert_residency() == {"cpu": 0.0}
    for i, w in zero.stages[0].weights.layers.items():
        if model.spec.layers[i].mlp == "moe":
            assert w["experts_gate_up"].shape[0] == 0 and w["experts_down"].shape[0] == 0
            assert zero.stages[0].weights.offloaded[i]["ids"].tolist() == list(range(model.spec.moe.num_experts))
    assert zero.generate(PROMPTS[1], NEW, stop_ids=frozenset()).ids == model.solo[1]
    assert batched(zero, 3) == model.solo[:3]


@pytest.mark.parametrize(("split", "groups", "trim"), [("2,2", 1, True), ("2,2", 2, False), ("1,1,2", 1, True)])
def test_layer_split_with_a_pool_per_stage(model, split, groups, trim):
    """Each stage gets its own budget: here the first keeps half its experts, the last all of them (no pool), a
    middle one none; tokens equal the one-stage, all-resident engine, solo and batched (pipelined with groups)."""
    spec = model.spec
    counts = [int(c) for c in split.split(",")]
    ranges = [range(sum(counts[:k]), sum(counts[: k + 1])) for k in range(len(counts))]
    wanted = [spec.moe.num_experts // 2] + [0] * (len(counts) - 2) + [spec.moe.num_experts]
    budgets = [budget_gb(spec, r, n) for r, n in zip(ranges, wanted)]
    engine = Engine(model.files, max_cells=256, layer_split=split, batch_groups=groups, trim_stage_weights=trim,
                    expert_budget_gb=budgets)
    for stage, r, n in zip(engine.stages, ranges, wanted):
        moe = [i for i in r if spec.layers[i].mlp == "moe"]
        assert sorted(stage.forward.pools) == (moe if n < spec.moe.num_experts else [])
        assert sorted(stage.weights.offloaded) == sorted(stage.forward.pools)
        assert all(name not in layer for layer in stage.weights.held.values()
                   for name in ("experts_gate_up", "expert_slot"))
    assert engine.generate(PROMPTS[0], NEW, stop_ids=frozenset()).ids == model.solo[0]
    assert batched(engine, 4) == model.solo[:4]


def test_device_holds_only_the_resident_experts(model):
    spec, e = model.spec, model.spec.moe.num_experts
    m = e // 2
    pooled = Engine(model.files, max_cells=64, expert_budget_gb=[half(spec)])
    full_w, pooled_w = model.full.stages[0].weights, pooled.stages[0].weights
    moe = [i for i in range(spec.num_layers) if spec.layers[i].mlp == "moe"]
    for i in moe:
        w, host = pooled_w.layers[i], pooled_w.offloaded[i]
        assert torch.equal(w["experts_gate_up"], full_w.layers[i]["experts_gate_up"][:m])  # the lowest ids stay
        assert torch.equal(w["experts_down"], full_w.layers[i]["experts_down"][:m])
        assert w["expert_slot"].tolist() == list(range(m)) + [m] * (e - m)
        assert host["ids"].tolist() == list(range(m, e))
        assert torch.equal(host["gate_up"], full_w.layers[i]["experts_gate_up"][m:])
        assert torch.equal(host["down"], full_w.layers[i]["experts_down"][m:])
    slot_bytes, ids_bytes = 4 * e * len(moe), 8 * (e - m) * len(moe)  # the int32 slot maps, the int64 host ids
    assert full_w.nbytes() - pooled_w.nbytes() == pooled_w.host_nbytes() - ids_bytes - slot_bytes
    assert pooled_w.host_nbytes() - ids_bytes == len(moe) * (e - m) * expert_bytes(spec, 4)


def test_loading_never_puts_the_other_experts_on_the_device(model):
    """Loaded onto the `meta` device (no data: it stands for a GPU here), a stage's device tensors hold the resident
    experts only, and the others were read into host RAM."""
    spec, e = model.spec, model.spec.moe.num_experts
    moe = [i for i in range(spec.num_layers) if spec.layers[i].mlp == "moe"]
    w = model.files.load(torch.device("meta"), torch.float32, resident={i: (1, 4) for i in moe})
    for i in moe:
        assert w.layers[i]["experts_gate_up"].device.type == "meta"
        assert w.layers[i]["experts_gate_up"].shape[0] == 2 and w.layers[i]["experts_down"].shape[0] == 2
        assert w.offloaded[i]["gate_up"].device.type == "cpu" and w.offloaded[i]["gate_up"].shape[0] == e - 2
        assert w.offloaded[i]["ids"].tolist() == [x for x in range(e) if x not in (1, 4)]


def test_residency_facts(model, tmp_path):
    pooled = Engine(model.files, max_cells=64, expert_budget_gb=[half(model.spec)])
    assert Scheduler(pooled, 1, lambda line: None).facts()["expert_residency"] == {"cpu": 0.5}
    assert Scheduler(model.full, 1, lambda line: None).facts()["expert_residency"] == {"cpu": 1.0}
    build("llama-gqa-tied", tmp_path)
    dense = Engine(ModelFiles.open(tmp_path), max_cells=64, expert_budget_gb=[0])  # no routed experts: nothing missing
    assert dense.expert_residency() == {"cpu": 1.0}


def test_experts_events_report_where_the_pooled_pairs_ran(model):
    """EXPERTS <on device> <on CPU>: running totals of the pooled layers' routed pairs, said once the engine goes
    idle (and at most once a second while it runs); equal to the pools' own counts, both sides used."""
    pooled = Engine(model.files, max_cells=256, expert_budget_gb=[half(model.spec)])
    out: list[str] = []
    sched = Scheduler(pooled, 4, out.append)
    for i in range(4):
        sched.handle(add(f"c{i}", 6, PROMPTS[i]))
    while sched.busy:
        sched.step()
    sched.step()  # idle: the last totals are said
    said = [tuple(map(int, line.split()[1:3])) for line in out if line.startswith("EXPERTS ")]
    total = sum(p.pairs_total for p in pools(pooled).values())
    on_cpu = sum(p.pairs_here for p in pools(pooled).values())
    assert said and said[-1] == (total - on_cpu, on_cpu)
    seconds, read, uploaded, upload_bytes = out[max(i for i, line in enumerate(out)
                                                    if line.startswith("EXPERTS "))].split()[3:]
    assert (uploaded, upload_bytes) == ("0", "0")  # no --pcie-frac
    busy = sum(p.busy_s for p in pools(pooled).values())
    assert busy > 0 and float(seconds) == pytest.approx(busy, abs=1e-5)
    assert int(read) == sum(p.experts_read * p.expert_bytes for p in pools(pooled).values()) > 0
    assert on_cpu > 0 and total - on_cpu > 0
    assert all(a[0] <= b[0] and a[1] <= b[1] for a, b in zip(said, said[1:]))  # running totals
    quiet: list[str] = []
    full = Scheduler(model.full, 2, quiet.append)  # every expert resident: no pool, no EXPERTS event
    full.handle(add("c0", 4, PROMPTS[0]))
    while full.busy:
        full.step()
    assert not [line for line in quiet if line.startswith("EXPERTS")]


def test_residency_per_device_combines_the_stages_of_a_device(model):
    spec, e = model.spec, model.spec.moe.num_experts
    moe = [i for i in range(spec.num_layers) if spec.layers[i].mlp == "moe"]
    layer = lambda n: {"experts_gate_up": torch.empty(n, 1, 1)}  # noqa: E731
    stages = [SimpleNamespace(device=torch.device("cuda", 0), weights=SimpleNamespace(layers={moe[0]: layer(e)})),
              SimpleNamespace(device=torch.device("cuda", 0), weights=SimpleNamespace(layers={moe[1]: layer(0)})),
              SimpleNamespace(device=torch.device("cuda", 1), weights=SimpleNamespace(layers={moe[1]: layer(e // 2)})),
              SimpleNamespace(device=torch.device("cuda", 2), weights=SimpleNamespace(layers={}))]
    assert residency_by_device(spec, stages) == {"cuda:0": 0.5, "cuda:1": 0.5, "cuda:2": 1.0}


def test_budget_checks_and_log(model, caplog):
    spec = model.spec
    plan = [(range(0, 2), torch.device("cuda", 0)), (range(2, 4), torch.device("cuda", 1))]
    with pytest.raises(StrataError, match="3 values for 2 stage"):
        check_expert_budget(spec, plan, [1, 1, 1], 4)
    with pytest.raises(StrataError, match="-1.0: a budget is a number of GB, 0 or more"):
        check_expert_budget(spec, plan, [1.0, -1.0], 4)
    with pytest.raises(StrataError, match="nan"):
        check_expert_budget(spec, plan, [float("nan")], 4)
    with pytest.raises(StrataError, match="in host RAM for the CPU pool, but the host has 0.0 GB available"):
        check_expert_budget(spec, plan, [0], 4, host_available=1000)
    assert not any(r.pooled for r in check_expert_budget(spec, plan, None, 4))
    assert not any(r.pooled for r in check_expert_budget(spec, plan, [1.0], 4, host_available=1000))
    with caplog.at_level(logging.INFO, logger="strata.engine"):
        (res,) = check_expert_budget(spec, [(range(spec.num_layers), torch.device("cpu"))], [half(spec)], 4)
    e = spec.moe.num_experts
    assert res.pooled and res.per_layer == e // 2 and res.fraction == 0.5
    assert f"{e // 2} of {e} routed experts resident in each of its {len(res.resident)} MoE layers" in caplog.text
    assert "GB in host RAM for the CPU pool" in caplog.text
    with pytest.raises(StrataError, match="--expert-budget-gb"):
        Engine(model.files, max_cells=64, expert_budget_gb=[-2])


def test_cpu_threads_set_the_pool_threads_and_reach_the_engine(model):
    before = torch.get_num_threads()
    try:
        Engine(model.files, max_cells=64, expert_budget_gb=[half(model.spec)], cpu_threads=1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    Engine(model.files, max_cells=64, cpu_threads=1)  # no pool: the threads are left alone
    assert torch.get_num_threads() == before
    with pytest.raises(StrataError, match="--cpu-threads 0: the CPU expert pool needs at least 1 thread"):
        Engine(model.files, max_cells=64, expert_budget_gb=[0], cpu_threads=0)
    options = EngineSettings(expert_budget_gb="10,12", cpu_threads=3).stage_options()
    assert options["expert_budget_gb"] == [10.0, 12.0] and options["cpu_threads"] == 3


def test_the_pool_leaves_a_quarter_of_the_cores_to_the_rest_by_default():
    """Without --cpu-threads a pool beside a GPU runs on all but a quarter of the cores (at most 4, at least 1 kept):
    a pool thread preempted by the host loop or the server holds up the window (docs/PERFORMANCE.md)."""
    from strata.experts.threads import pool_threads

    assert [pool_threads(n) for n in (1, 2, 3, 4, 8, 12, 16, 32, 64)] == [1, 1, 2, 3, 6, 9, 12, 28, 60]


def test_the_pools_cores_are_the_containers_quota_not_the_nodes(tmp_path):
    """In a pod whose CPU limit is below the node's cores the affinity still lists every core: the quota counts."""
    from strata.experts.threads import usable_cores

    affinity = len(os.sched_getaffinity(0))
    (tmp_path / "cpu.max").write_text("150000 100000\n")  # 1.5 CPUs: 2
    assert usable_cores(tmp_path) == min(affinity, 2)
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert usable_cores(tmp_path) == affinity
    assert usable_cores(tmp_path / "none") == affinity


def test_given_and_random_weights_are_split_too(model):
    spec = model.spec
    weights = random_stage_weights(spec, range(spec.num_layers), torch.device("cpu"), torch.float32)
    before = {i: w["experts_gate_up"].shape[0] for i, w in weights.layers.items() if "experts_gate_up" in w}
    given = Engine(None, spec=spec, weights=weights, max_cells=64, expert_budget_gb=[half(spec)])
    factory = Engine(None, spec=spec, max_cells=64, expert_budget_gb=[half(spec, range(2))], layer_split="2,2",
                     trim_stage_weights=True,
                     weights=lambda layers, device, trim: random_stage_weights(spec, layers, device, torch.float32))
    assert given.expert_residency() == {"cpu": 0.5} and factory.expert_residency() == {"cpu": 0.5}
    assert {i: w["experts_gate_up"].shape[0] for i, w in weights.layers.items() if "experts_gate_up" in w} == before
    whole = Engine(None, spec=spec, weights=weights, max_cells=64)
    ids = PROMPTS[1]
    assert rel_err(given.run(given.new_state(), ids), whole.run(whole.new_state(), ids)) < 1e-5


# the Triton path (under Triton's interpreter here)

@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_moe-mixed-dense"])
def triton_model(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    build(request.param, folder)
    files = ModelFiles.open(folder)
    return files, Engine(files, max_cells=128, kernels="torch")


@pytest.mark.parametrize("triton_model", ["qwen3_next"], indirect=True)
def test_a_q8_0_pool_on_its_own_kernel_keeps_a_row_the_same_alone_or_beside_others(triton_model, monkeypatch):
    """A bfloat16 engine on the Triton kernels with its experts quantized to q8_0 as they load and half of them in
    host RAM: the device keeps its half packed (the shared expert too), the pool reads its half as q8_0 records on
    its own kernel where it runs here; a decode row's logits are bit for bit the same alone and beside two other
    conversations, and the all-resident engine's to bfloat16 rounding. (Kept small: the Triton interpreter runs
    bfloat16 slowly.)"""
    from strata.experts import native
    from strata.quant.packed import PackedWeight

    files, _ = triton_model
    monkeypatch.setenv("STRATA_POOL_Q8", "1")  # its records, whichever way the host is faster
    quantized = ModelFiles.open(files.checkpoint.path, "q8_0")
    spec = quantized.spec
    moe = [i for i in range(spec.num_layers) if spec.layers[i].mlp == "moe"]
    budget = budget_gb(spec, range(spec.num_layers), spec.moe.num_experts // 2, dtype_bytes=2)
    pooled = Engine(quantized, max_cells=64, dtype=torch.bfloat16, kernels="triton", expert_budget_gb=[budget])
    assert pooled.expert_residency() == {"cpu": 0.5}
    assert all(p.q8 == (native.load() is not None) for p in pools(pooled).values())
    assert isinstance(pooled.weights.layers[moe[0]]["shared_gate_up"], PackedWeight)
    alone = decode_logits(pooled.init_slots(1), {0: PROMPTS[1]})
    together = decode_logits(pooled.init_slots(3), {0: PROMPTS[1], 1: PROMPTS[2], 2: PROMPTS[3]})
    assert torch.equal(together[0], alone[0])
    full = Engine(ModelFiles.open(files.checkpoint.path, "q8_0"), max_cells=64, dtype=torch.bfloat16,
                  kernels="triton")
    assert rel_err(alone[0].float(), decode_logits(full.init_slots(1), {0: PROMPTS[1]})[0].float()) < 3e-2


@pytest.mark.parametrize("pcie_frac", [0.0, 0.5])
def test_triton_path_with_the_pool(triton_model, pcie_frac):
    files, reference = triton_model
    spec = files.spec
    fast = Engine(files, max_cells=128, kernels="triton", expert_budget_gb=[half(spec)], pcie_frac=pcie_frac)
    assert pools(fast) and all(s.forward.fast.pools is s.forward.pools for s in fast.stages)
    assert all(p.num_upload == round(pcie_frac * p.num_here) for p in pools(fast).values())
    ids = PROMPTS[2]
    want = reference.generate(ids, 4, stop_ids=frozenset()).ids
    assert fast.generate(ids, 4, stop_ids=frozenset()).ids == want
    # decode windows of slots run TritonDecode: rows bitwise the same alone or batched
    alone = fast.init_slots(1)
    solo = decode_logits(alone, {0: PROMPTS[1]})[0]
    logits = decode_logits(fast.init_slots(3), {0: PROMPTS[0], 1: PROMPTS[1], 2: PROMPTS[3]})
    assert torch.equal(logits[1], solo)
    state = reference.new_state()
    reference.run(state, PROMPTS[1])
    assert rel_err(solo, reference.run(state, [alone.slots[0].next_token])[0]) < 1e-4
    if pcie_frac:  # a two-stage split with the pool and uploads, once a model
        split = Engine(files, max_cells=128, kernels="triton", layer_split="2,2", batch_groups=2,
                       expert_budget_gb=[half(spec, range(0, 2)), 0], pcie_frac=pcie_frac)
        assert [bool(s.forward.pools) for s in split.stages] == [True, True]
        assert split.generate(ids, 4, stop_ids=frozenset()).ids == want


def test_calibration_builds_an_engine_with_the_pool(model, tmp_path):
    """autoconfig's --calibrate passes the proposal's split settings as `strata serve` does."""
    from autoconfig.calibrate import build_engine

    before = torch.get_num_threads()
    try:
        engine = build_engine(str(model.files.checkpoint.path), {"device": "cpu", "dtype": "float32", "max_cells": 64,
                                                                  "expert_budget_gb": f"{half(model.spec):.9f}",
                                                                  "cpu_threads": 1})
    finally:
        torch.set_num_threads(before)
    assert engine.expert_residency() == {"cpu": 0.5}


@pytest.mark.parametrize("upload", [0.0, 0.5])
def test_a_swapped_out_expert_lands_in_the_pool_before_it_is_read(upload):
    """Hot residency on a GPU hands the pool a swapped-out expert whose copy from the device is still running
    (`put(..., ready=event)`): the maps change at once, the weights are taken into the slot once the event says the
    copy landed, and before any read of the pool (its products, its uploads, a later swap)."""
    from strata.experts.pool import ExpertPool
    from strata.kernels.invariant import plain

    class Copy:  # stands for the CUDA event recorded after the copy
        def __init__(self):
            self.waited = 0

        def synchronize(self):
            self.waited += 1

    torch.manual_seed(0)
    e, h, i = 8, 16, 12
    gate_up, down = torch.randn(e, 2 * i, h), torch.randn(e, h, i)
    pool = ExpertPool({"gate_up": gate_up[:4].clone(), "down": down[:4].clone(), "ids": torch.arange(4)}, e,
                      pack=False, upload=upload)
    j = int(pool.index[1])
    landed = Copy()
    pool.put(j, 6, gate_up[6].clone(), down[6].clone(), ready=landed)  # expert 6 leaves the device for slot j
    assert int(pool.index[6]) == j and int(pool.index[1]) == pool.num_here and landed.waited == 0
    x, weights = torch.randn(2, h), torch.ones(2, 1)
    got = pool.compute(x, weights, torch.tensor([[6], [0]]), plain)
    if upload:
        uploaded = pool.upload(x, weights, torch.tensor([[6], [0]]), plain)
        got = got if uploaded is None else got + uploaded
    assert landed.waited == 1
    from strata.kernels.moe import swiglu

    assert torch.allclose(got[0], swiglu(x[:1], gate_up[6], down[6])[0], atol=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(pool.slot_weights(j), (gate_up[6], down[6])))
    assert landed.waited == 1  # settled once


@pytest.mark.parametrize("dtype, pack", [(torch.float32, False), (torch.bfloat16, False)] + [
    (dtype, True) for dtype in (torch.float32, torch.bfloat16)
    if __import__("strata.kernels.onednn", fromlist=["available"]).available(dtype)
])  # oneDNN's blocked weights: float32 wherever torch has oneDNN, bf16 where the CPU has AVX-512 or AMX
def test_the_pool_computes_its_pairs_row_invariantly(dtype, pack):
    """The pool's share of each row, in either weight layout and on the pool's own kernel (plain bf16 where the host
    builds it: AVX512_BF16 and gcc): the float32 sum of its pairs (against a float64 reference), and bitwise the same
    whether the row is computed alone or among other rows in a decode window."""
    from strata.experts import native
    from strata.experts.pool import ExpertPool
    from strata.kernels.invariant import in_row_blocks

    g = torch.Generator().manual_seed(3)
    e, h, i, k, rows = 12, 64, 32, 4, 7
    gate_up = (torch.randn(e, 2 * i, h, generator=g) * 0.2).to(dtype)
    down = (torch.randn(e, h, i, generator=g) * 0.2).to(dtype)
    here = [1, 2, 3, 5, 8, 9, 11]  # the pool's experts (the others are resident elsewhere)
    pool = ExpertPool({"gate_up": gate_up[here], "down": down[here], "ids": torch.tensor(here)}, e, pack=pack)
    assert pool.packed == pack and pool.nbytes == (gate_up[here].numel() + down[here].numel()) * gate_up.element_size()
    assert pool.native == (dtype == torch.bfloat16 and not pack and native.load() is not None)
    x = torch.randn(rows, h, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(rows)])
    weights = torch.rand(rows, k, generator=g).to(dtype)
    out = pool.compute(x, weights, ids, in_row_blocks)
    want = torch.zeros(rows, h, dtype=torch.float64)
    for r in range(rows):
        for c in range(k):
            j = int(ids[r, c])
            if j in here:
                a = x[r].double() @ gate_up[j].double().T
                act = torch.nn.functional.silu(a[:i]) * a[i:]
                want[r] += weights[r, c].double() * (act @ down[j].double().T)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert torch.allclose(out.double(), want, atol=tol, rtol=tol), (out.double() - want).abs().max()
    for r in range(rows):
        alone = pool.compute(x[r : r + 1], weights[r : r + 1], ids[r : r + 1], in_row_blocks)
        assert torch.equal(alone[0], out[r]), r
    pool_pairs = sum(int(j) in here for j in ids.reshape(-1))
    assert pool.pairs_here == 2 * pool_pairs and pool.pairs_total == 2 * rows * k  # batched, then row by row
    assert pool.experts_read >= len({int(j) for j in ids.reshape(-1)} & set(here)) and pool.busy_s > 0


def test_the_pool_kernel_runs_a_window_in_one_call_as_its_products_and_sums_would():
    """`native.pool_window` (the window's bookkeeping in C: counts, grouping by host slot, the experts' products, each
    row's weighted sum in slot order) gives bit for bit what the kernel's products over the grouped rows and torch's
    weighted sums give, with int64 or int32 ids, bf16 or float32 weights, slots below `lo` left out (uploaded ones)
    and rows without a pair here zero; an id outside the layer is refused."""
    from strata.experts import native

    if native.load() is None:
        pytest.skip("the pool's own kernel needs AVX512_BF16 and gcc on this host")
    g = torch.Generator().manual_seed(9)
    n, h, i, k, rows, lo = 10, 64, 32, 3, 6, 2
    here = [0, 3, 4, 6, 7, 9]  # host slots 0..5 in this order; slots 0 and 1 are uploaded (not the kernel's)
    index = torch.full((n,), len(here), dtype=torch.int64)
    index[torch.tensor(here)] = torch.arange(len(here))
    gate_up = (torch.randn(len(here) - lo, 2 * i, h, generator=g) * 0.2).to(torch.bfloat16)
    down = (torch.randn(len(here) - lo, h, i, generator=g) * 0.2).to(torch.bfloat16)
    x = torch.randn(rows, h, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(n, generator=g)[:k] for _ in range(rows)])
    ids[2] = torch.tensor([1, 2, 5])  # a row with no pair on the kernel
    for id_dtype, w_dtype in ((torch.int64, torch.bfloat16), (torch.int32, torch.float32)):
        weights = torch.rand(rows, k, generator=g).to(w_dtype)
        counts = torch.zeros(n, dtype=torch.float64)
        out, pairs, experts = native.pool_window(x, weights, ids.to(id_dtype), index, lo, len(here), counts,
                                                 gate_up, down, 2)
        assert torch.equal(counts, torch.bincount(ids.reshape(-1), minlength=n).double())
        slot = index[ids.reshape(-1)]
        mine = [p for p in range(rows * k) if lo <= int(slot[p]) < len(here)]
        order = sorted(mine, key=lambda p: (int(slot[p]), p))
        used = sorted({int(slot[p]) for p in mine})
        assert pairs == len(mine) and experts == len(used)
        grouped = x[torch.tensor([p // k for p in order])]
        y = native.experts_bf16(grouped, [sum(int(slot[p]) == s for p in mine) for s in used],
                                [gate_up[s - lo] for s in used], [down[s - lo] for s in used], 2)
        y = y * weights.reshape(-1)[torch.tensor(order)].float()[:, None]
        want = torch.zeros(rows, h)
        for r in range(rows):
            mine_r = [q for q, p in enumerate(order) if p // k == r]
            if mine_r:
                want[r] = y[mine_r[0]]
                for q in mine_r[1:]:
                    want[r] = want[r] + y[q]
        assert want[2].abs().sum() == 0 and want.abs().sum() > 0
        assert torch.equal(out, want)
        try:  # fixed shares (STRATA_POOL_SCHEDULE=static) instead of units handed out as threads come free
            assert native.set_schedule("static")
            again, _, _ = native.pool_window(x, weights, ids.to(id_dtype), index, lo, len(here), counts.zero_(),
                                             gate_up, down, 2)
        finally:
            native.set_schedule("dynamic")
        assert torch.equal(again, want)
    with pytest.raises(ValueError, match=r"outside \[0, 10\)"):
        native.pool_window(x, weights, torch.full((rows, k), n), index, lo, len(here), counts, gate_up, down, 2)


def test_hot_residency_moves_the_most_routed_experts_to_the_device(model):
    """`--expert-residency hot`: after traffic made the host experts the most routed, refreshes swap them onto the
    device, moving every weight with its expert (against the all-resident engine's tensors), each expert held in
    exactly one place; the answers stay the all-resident ones, batched equal to solo."""
    from strata.experts import hotness

    hot = Engine(model.files, max_cells=256, expert_budget_gb=[half(model.spec)], expert_residency="hot")
    e = model.spec.moe.num_experts
    layers = pools(hot)
    for pool in layers.values():
        assert not pool.packed
        pool.counts.zero_()
        pool.counts[torch.nonzero(pool.index < pool.num_here).squeeze(1)] = 100.0  # the host experts: hottest
    swapped = 0
    while (step := hot.refresh_experts()) > 0:
        swapped += step
    stage_weights = {i: w for s in hot.stages for i, w in s.weights.layers.items()}
    full = model.full.weights.layers
    for i, pool in layers.items():
        w = stage_weights[i]
        m = w["experts_gate_up"].shape[0]
        slots = w["expert_slot"].long()
        on_device = {g for g in range(e) if slots[g] < m}
        on_host = {g for g in range(e) if pool.index[g] < pool.num_here}
        assert on_device.isdisjoint(on_host) and on_device | on_host == set(range(e))
        assert on_device == set(range(e // 2, e))  # the former host experts, all of them (the resident set's size)
        for g in range(e):
            gate_up, down = ((w["experts_gate_up"][slots[g]], w["experts_down"][slots[g]]) if g in on_device else
                             pool.slot_weights(int(pool.index[g])))
            assert torch.equal(gate_up, full[i]["experts_gate_up"][g]) and torch.equal(down, full[i]["experts_down"][g])
        assert pool.swaps == e // 2 and int(pool.counts.max()) < 100  # halved at each refresh
    assert swapped == len(layers) * (e // 2) and hot.refresh_experts() == 0
    solo = [hot.generate(p, NEW, stop_ids=frozenset()).ids for p in PROMPTS]
    assert solo == model.solo and batched(hot) == solo
    with pytest.raises(StrataError, match="--expert-residency 'busy'"):
        Engine(model.files, max_cells=64, expert_residency="busy")
    assert hotness.MODES == ("fixed", "hot")


def test_hot_residency_refreshes_between_windows(model, monkeypatch):
    """The scheduler refreshes a hot engine's resident experts every REFRESH_WINDOWS windows from the pools' own
    routing counts (which count every routed pair), and never a fixed one's."""
    from strata.runtime import scheduler

    monkeypatch.setattr(scheduler, "REFRESH_WINDOWS", 2)
    answers = {}
    for mode, refreshes in (("hot", True), ("fixed", False)):
        engine = Engine(model.files, max_cells=256, expert_budget_gb=[half(model.spec)], expert_residency=mode)
        calls, moved = [], []
        real = engine.refresh_experts
        monkeypatch.setattr(engine, "refresh_experts", lambda: calls.append(1) or moved.append(real()))
        answers[mode] = batched(engine, 4)
        assert bool(calls) == refreshes
        for pool in pools(engine).values():  # every routed pair counted (halved at each refresh when hot)
            assert 0 < pool.counts.sum() <= pool.pairs_total and (mode == "hot" or pool.counts.sum() == pool.pairs_total)
        if mode == "hot":
            assert any(moved)  # some refresh swapped experts in mid-decode
    # the device's experts and the pool's compute a pair alike on the CPU: swaps between windows change no token
    assert answers["hot"] == answers["fixed"] and all(len(a) == NEW for a in answers["hot"])


def pool_pairs_reference(x, weights, ids, here, gate_up, down, mid_dtype=None) -> torch.Tensor:
    """float64: each row's weighted pairs whose expert is in `here`, over the packed experts' dequantized weights;
    `mid_dtype`: silu(gate) * up rounded to it between the two products."""
    from strata.quant.packed import dequantize

    gu, dn = dequantize(gate_up).double(), dequantize(down).double()
    i = gu.shape[1] // 2
    want = torch.zeros(x.shape[0], dn.shape[1], dtype=torch.float64)
    for r in range(x.shape[0]):
        for c in range(ids.shape[1]):
            j = int(ids[r, c])
            if j in here:
                a = x[r].double() @ gu[j].T
                mid = torch.nn.functional.silu(a[:i]) * a[i:]
                if mid_dtype is not None:
                    mid = mid.to(mid_dtype).double()
                want[r] += weights[r, c].double() * (mid @ dn[j].T)
    return want


def test_the_pool_reads_q8_0_experts_as_their_records_on_its_own_kernel(monkeypatch, caplog):
    """q8_0 experts (gate/up and down) stay in their records in a bfloat16 pool where its own kernel runs and reads
    them faster so (measured once, said in the log; STRATA_POOL_Q8=1 forces it here): about half the bytes of
    bfloat16, the pairs near the float64 product of the dequantized weights (nearer than the same weights rounded to
    bfloat16), a row's bits the same alone as among others."""
    from strata.experts import native, pool as pool_module
    from strata.experts.pool import ExpertPool
    from strata.kernels.invariant import in_row_blocks
    from strata.quant.online import quantize_weight

    g = torch.Generator().manual_seed(6)
    e, h, i, k, rows = 6, 256, 128, 2, 5
    here = [0, 2, 3, 5]
    gate_up = quantize_weight(torch.randn(e, 2 * i, h, generator=g) * 0.05, "q8_0", torch.bfloat16)
    down = quantize_weight(torch.randn(e, h, i, generator=g) * 0.05, "q8_0", torch.bfloat16)
    keep = torch.tensor(here)
    offloaded = {"gate_up": gate_up.index(keep), "down": down.index(keep), "ids": keep}
    if native.load() is None:  # no AVX512_BF16 here: written out in bf16 as before
        assert not ExpertPool(offloaded, e).q8
        return
    monkeypatch.delenv("STRATA_POOL_Q8", raising=False)
    monkeypatch.setattr(pool_module, "_q8_choice", {})
    with caplog.at_level("INFO", logger="strata.experts.pool"):
        measured = ExpertPool(offloaded, e)
    assert "the CPU expert pool reads q8_0 experts" in caplog.text and "from their records" in caplog.text
    assert measured.q8 == pool_module._q8_choice[(h, i)]
    monkeypatch.setenv("STRATA_POOL_Q8", "1")
    pool = ExpertPool(offloaded, e)
    assert pool.q8 and pool.native and pool.gate_up.dtype == torch.uint8
    assert pool.nbytes < 0.55 * (2 * i * h + h * i) * len(here) * 2
    x = torch.randn(rows, h, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(rows)])
    weights = torch.rand(rows, k, generator=g).to(torch.bfloat16)
    out = pool.compute(x, weights, ids, in_row_blocks)
    want = pool_pairs_reference(x, weights, ids, here, gate_up, down, torch.bfloat16)  # the kernel rounds h so
    assert want.abs().max() > 0
    err = ((out.double() - want).norm() / want.norm()).item()
    written = ExpertPool({"gate_up": gate_up.index(keep), "down": down.index(keep), "ids": keep}, e, pack=True)
    assert not written.q8
    err_written = ((written.compute(x, weights, ids, in_row_blocks).double() - want).norm() / want.norm()).item()
    assert err < 1e-5 and err < err_written, (err, err_written)  # bf16-rounded weights: 5e-3
    for r in range(rows):
        alone = pool.compute(x[r : r + 1], weights[r : r + 1], ids[r : r + 1], in_row_blocks)
        assert torch.equal(alone[0], out[r]), r


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_pool_reads_q4_k_experts_as_4_bit(dtype):
    """Packed q4_k experts stay 4-bit in the pool (torch's CPU int4 products): the float reference of their
    dequantized weights (float32: to its rounding; bfloat16: the (scale, zero) pairs rounded too), fewer bytes,
    a row's bits the same alone as among others; a q6_k down (llama.cpp's Q4_K_M) is written out beside them."""
    from strata.experts.pool import ExpertPool, Int4Expert
    from strata.kernels.invariant import in_row_blocks
    from strata.quant.online import quantize_weight

    g = torch.Generator().manual_seed(5)
    e, h, i, k, rows = 6, 256, 256, 2, 5
    here = [0, 2, 3, 5]
    for down_fmt in ("q4_k", "q6_k"):
        gate_up = quantize_weight(torch.randn(e, 2 * i, h, generator=g) * 0.05, "q4_k", dtype)
        down = quantize_weight(torch.randn(e, h, i, generator=g) * 0.05, down_fmt, dtype)
        keep = torch.tensor(here)
        pool = ExpertPool({"gate_up": gate_up.index(keep), "down": down.index(keep), "ids": keep}, e)
        assert pool.int4 and not pool.packed and isinstance(pool.gate_up[0], Int4Expert)
        assert isinstance(pool.down[0], Int4Expert) == (down_fmt == "q4_k")
        plain_bytes = (2 * i * h + h * i) * len(here) * torch.tensor([], dtype=dtype).element_size()
        assert pool.nbytes < (0.6 if dtype == torch.float32 else 0.75) * plain_bytes
        x = torch.randn(rows, h, generator=g).to(dtype)
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(rows)])
        weights = torch.rand(rows, k, generator=g).to(dtype)
        out = pool.compute(x, weights, ids, in_row_blocks)
        want = pool_pairs_reference(x, weights, ids, here, gate_up, down)
        assert want.abs().max() > 0
        err = ((out.double() - want).norm() / want.norm()).item()
        assert err < (1e-5 if dtype == torch.float32 else 2e-2), (down_fmt, err)
        for r in range(rows):
            alone = pool.compute(x[r : r + 1], weights[r : r + 1], ids[r : r + 1], in_row_blocks)
            assert torch.equal(alone[0], out[r]), (down_fmt, r)
