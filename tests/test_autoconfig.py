"""autoconfig: facts recorded in tests/data/ replayed through the rules, the config file `strata serve` reads, the
facts readers (on fakes of NVML, /proc and cgroups), the node annotation, and `--calibrate` on the CPU.

Machines (tests/data/machine-*.json, written from published specs):
  4x16gb-gen3-x8  4 x Tesla V100-PCIE-16GB on PCIe Gen3; cuda:3 sits in a x8 slot, cuda:1's link idles at Gen1
                  (as NVML reports an idle link), cuda:2 has 300 MiB taken by a display server; 128 GiB RAM, 16 cores
  1xh200, 2xh200  NVIDIA H200 (141 GB, PCIe Gen5 x16); 128 GiB / 16 cores and 256 GiB / 32 cores
  cpu-only        no GPU, 256 GiB RAM, 32 cores
  too-small       one RTX 4090 (24 GB) and 64 GiB RAM
Models: bench/shapes.py's real shapes at bfloat16 (Qwen3-Next-80B-A3B: 159.3 GB, Qwen3-30B-A3B: 61.1 GB) and the
embedded default read from its own files.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from autoconfig.cli import main
from autoconfig.facts import (
    Facts, MachineFacts, ModelFacts, load_facts, model_facts_from_spec, read_gpus, read_host, read_model,
)
from autoconfig.memory import partition
from autoconfig.node import ANNOTATION, facts_from_annotations, node_patch
from autoconfig.report import write_config
from autoconfig.rules import ImpossibleWish, Wishes, candidates, propose
from bench.shapes import shape

DATA = Path(__file__).parent / "data"
SETTING_KEYS = {"device", "dtype", "max_cells", "batch", "layer_split", "split_device", "batch_groups",
                "trim_stage_weights", "expert_budget_gb", "cpu_threads", "pcie_frac", "park_vram_gb", "kernels",
                "cuda_graphs"}


def machine(name: str) -> MachineFacts:
    return load_facts(DATA / f"machine-{name}.json")


@pytest.fixture(scope="module")
def next80b() -> ModelFacts:
    return model_facts_from_spec(shape("qwen3-next-80b-a3b"), 2.0, name="Qwen3-Next-80B-A3B")


@pytest.fixture(scope="module")
def moe30b() -> ModelFacts:
    return model_facts_from_spec(shape("qwen3-30b-a3b"), 2.0, name="Qwen3-30B-A3B")


@pytest.fixture(scope="module")
def default_facts() -> ModelFacts:
    return read_model("default")


def layers(proposal) -> list[int]:
    return [int(n) for n in proposal.settings["layer_split"].split(",")]


# ---------------------------------------------------------------------------------------------- facts


def test_facts_round_trip_through_json(next80b):
    facts = Facts(machine=machine("4x16gb-gen3-x8"), model=next80b)
    assert Facts.model_validate_json(facts.model_dump_json()) == facts
    assert len(facts.machine.gpus) == 4 and facts.machine.gpus[3].pcie_width == 8


def test_recorded_model_facts_match_the_spec(next80b):
    """tests/data/model-qwen3-next-80b-a3b.json is what model_facts_from_spec computes (a replayable model)."""
    recorded = ModelFacts.model_validate_json((DATA / "model-qwen3-next-80b-a3b.json").read_text())
    assert recorded == next80b
    assert next80b.layer_kinds.count("attention") == 12 and next80b.layer_kinds.count("gdn") == 36
    assert next80b.num_experts == 512 and next80b.experts_per_token == 10
    assert 159e9 < next80b.weight_bytes < 160e9  # 79.7 B parameters at bfloat16
    assert next80b.kv_bytes_per_token == 2 * 2 * 256 * 2  # K and V, 2 heads of 256, bfloat16
    assert next80b.recurrent_bytes_per_sequence == 32 * 128 * 128 * 4 + 3 * 8192 * 2


def test_read_model_on_the_real_default_files(default_facts):
    from strata.model.loader import ModelFiles

    assert default_facts.num_layers == 30 and set(default_facts.layer_kinds) == {"attention"}
    assert set(default_facts.mlp_kinds) == {"dense"} and default_facts.num_experts == 0
    assert default_facts.vocab_size == 49152 and default_facts.tie_embeddings
    assert default_facts.embed_bytes == 49152 * 576 * 2  # the Q4_1 file counts at its dequantized bfloat16 size
    # the checkpoint's own shapes agree with what the spec implies
    from_spec = model_facts_from_spec(ModelFiles.open("default").spec, 2.0, name="default")
    assert from_spec.model_dump(exclude={"name"}) == default_facts.model_dump(exclude={"name"})


@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_moe-mixed-dense", "qwen3_5_moe", "llama-mha-untied"])
def test_read_model_on_tiny_checkpoints_of_every_family(name, tmp_path):
    """Real safetensors folders (fused or per-expert tensors, a language_model prefix beside a vision tower, MTP
    weights): the sizes read from the files are the sizes the spec implies, layer by layer."""
    from strata.model.loader import ModelFiles
    from tests.tiny_models import add_mtp_weights, build

    model = build(name, tmp_path)
    mtp = add_mtp_weights(tmp_path, model.config.get_text_config().hidden_size) if name == "qwen3_next" else []
    facts = read_model(tmp_path)
    from_spec = model_facts_from_spec(ModelFiles.open(tmp_path).spec, 2.0)
    assert facts.model_dump(exclude={"name", "mtp_bytes"}) == from_spec.model_dump(exclude={"name", "mtp_bytes"})
    hidden = from_spec.hidden_size
    assert facts.mtp_bytes == ((2 * hidden * hidden + (len(mtp) - 1) * hidden) * 2 if mtp else 0)  # fc + norms
    if name != "llama-mha-untied":
        assert facts.num_experts > 0 and all(
            (e > 0) == (kind == "moe") for e, kind in zip(facts.expert_bytes, facts.mlp_kinds))


def test_read_host_within_cgroup_limits(tmp_path):
    proc, cgroup = tmp_path / "proc", tmp_path / "cgroup"
    proc.mkdir()
    cgroup.mkdir()
    (proc / "meminfo").write_text("MemTotal:       263856128 kB\nMemFree:   1000 kB\nMemAvailable:   250000000 kB\n")
    host = read_host(proc, cgroup)
    assert host.ram_total_bytes == 263856128 * 1024 and host.ram_available_bytes == 250000000 * 1024
    assert not host.cpu_bf16_dots  # no cpuinfo to read
    (proc / "cpuinfo").write_text("processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16 amx_tile\n\n"
                                  "processor\t: 1\nflags\t\t: fpu avx512f avx512_bf16 amx_tile\n")
    assert read_host(proc, cgroup).cpu_bf16_dots
    (cgroup / "memory.max").write_text(f"{64 << 30}\n")
    (cgroup / "memory.current").write_text(f"{4 << 30}\n")
    (cgroup / "cpu.max").write_text("150000 100000\n")  # 1.5 CPUs
    host = read_host(proc, cgroup)
    assert host.ram_total_bytes == 64 << 30 and host.ram_available_bytes == 60 << 30
    assert host.cpu_cores <= 2
    # the node-facts pod (`--annotate-node`) describes the node, not itself: its own 256Mi limit does not count
    node = read_host(proc, cgroup, node=True)
    assert node.ram_total_bytes == 263856128 * 1024 and node.ram_available_bytes == 250000000 * 1024


def test_read_gpus_through_nvml(monkeypatch):
    """The NVML reader on a fake pynvml: names, memory and both PCIe links, current and maximum."""
    class NVMLError(Exception):
        pass

    cards = [dict(name=b"Tesla V100-PCIE-16GB", total=16 << 30, free=15 << 30, gen=1, width=16, gen_max=3,
                  width_max=16),
             dict(name="NVIDIA H200", total=141 << 30, free=140 << 30, gen=5, width=8, gen_max=5, width_max=16)]
    fake = types.SimpleNamespace(
        NVMLError=NVMLError, nvmlInit=lambda: None, nvmlShutdown=lambda: None,
        nvmlDeviceGetCount=lambda: len(cards), nvmlDeviceGetHandleByIndex=lambda i: cards[i],
        nvmlDeviceGetName=lambda h: h["name"],
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(total=h["total"], free=h["free"], used=0),
        nvmlDeviceGetCurrPcieLinkGeneration=lambda h: h["gen"], nvmlDeviceGetCurrPcieLinkWidth=lambda h: h["width"],
        nvmlDeviceGetMaxPcieLinkGeneration=lambda h: h["gen_max"],
        nvmlDeviceGetMaxPcieLinkWidth=lambda h: (_ for _ in ()).throw(NVMLError("not supported")),
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    gpus = read_gpus()
    assert [g.name for g in gpus] == ["Tesla V100-PCIE-16GB", "NVIDIA H200"]
    assert (gpus[0].pcie_gen, gpus[0].pcie_gen_max, gpus[0].vram_free_bytes) == (1, 3, 15 << 30)
    assert gpus[1].pcie_width == 8 and gpus[1].pcie_width_max == 0  # a query NVML refuses reads as 0
    assert gpus[0].link == "PCIe Gen3 x16"  # an idle link counts at its maximum generation

    def no_driver():
        raise NVMLError("driver not loaded")

    monkeypatch.setattr(fake, "nvmlInit", no_driver)
    assert read_gpus() == []


def test_no_torch_at_import():
    code = ("import sys, autoconfig, autoconfig.cli, autoconfig.rules, autoconfig.facts, autoconfig.calibrate, "
            "autoconfig.node, autoconfig.report; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=Path(__file__).parents[1])
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


# ---------------------------------------------------------------------------------------------- rules


def test_four_16gb_cards_gen3_with_one_on_x8(next80b):
    """The seed's machine: split 4 ways, trim, one group per stage, fewer layers on the x8 card."""
    p = propose(Facts(machine=machine("4x16gb-gen3-x8"), model=next80b), Wishes(concurrency=8))
    s, why = p.settings, p.reasons
    assert set(s) == SETTING_KEYS and set(why) == SETTING_KEYS
    split = layers(p)
    assert len(split) == 4 and sum(split) == 48
    assert split[3] < min(split[:3])
    assert "cuda:3 is on PCIe Gen3 x8" in why["layer_split"] and "fewer layers" in why["layer_split"]
    assert "proportional to the VRAM each card has left after its dense weights and the state" in why["layer_split"]
    assert "cuda:1" not in why["layer_split"].split(";", 1)[1]  # its link idles at Gen1: not a slow card
    assert s["device"] == "cuda" and "4 stages on cuda:0..3" in why["device"] and "do not fit" in why["device"]
    assert s["trim_stage_weights"] is True and "only its own layers" in why["trim_stage_weights"]
    assert s["batch"] == 8 and s["batch_groups"] == 4
    assert "one group per stage (2 slots each)" in why["batch_groups"]
    assert s["dtype"] == "bfloat16" and s["kernels"] == "auto" and s["cuda_graphs"] is True
    budgets = [float(b) for b in s["expert_budget_gb"].split(",")]
    assert len(budgets) == 4 and all(11 < b < 15.2 for b in budgets)
    residency = [st.resident for st in p.stages]
    assert residency[3] == max(residency)  # the x8 card fetches least over its link
    assert "what each card has left after its dense weights" in why["expert_budget_gb"]
    assert "stay in RAM" in why["expert_budget_gb"]
    assert s["cpu_threads"] == 12 and "16 cores less 4" in why["cpu_threads"]
    assert any("every card is on PCIe Gen3" in n for n in p.notes)
    assert p.env == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert s["pcie_frac"] == 0.0 and "not measured" in why["pcie_frac"]  # the recorded facts have no RAM bandwidth


def test_pcie_frac_balances_the_slowest_link_against_the_cpu_pool(next80b):
    """With the host's RAM read bandwidth measured: F = link / (link + pool), the pool reading at POOL_READ_SHARE of
    it, over the slowest card's link (an x8 Gen3 card here: 7.9 GB/s); no share when nothing spills."""
    from autoconfig.rules import POOL_KERNEL_READ_SHARE, POOL_READ_SHARE

    facts = machine("4x16gb-gen3-x8")
    facts.host.ram_read_gbps = 40.0
    p = propose(Facts(machine=facts, model=next80b), Wishes(concurrency=8))
    link = min(g.link_gbps for g in facts.gpus)
    assert link < max(g.link_gbps for g in facts.gpus)
    want = round(link / (link + 40.0 * POOL_READ_SHARE), 2)
    assert p.settings["pcie_frac"] == want and 0 < want < 1
    assert f"{link:.0f} GB/s" in p.reasons["pcie_frac"] and "40 GB/s measured" in p.reasons["pcie_frac"]
    assert "oneDNN" in p.reasons["pcie_frac"]
    facts.host.cpu_bf16_dots = True  # the pool's own kernel reads faster: less is uploaded
    k = propose(Facts(machine=facts, model=next80b), Wishes(concurrency=8))
    assert k.settings["pcie_frac"] == round(link / (link + 40.0 * POOL_KERNEL_READ_SHARE), 2) < want
    assert "its own kernel" in k.reasons["pcie_frac"]
    big = machine("1xh200")
    big.host.ram_read_gbps = 40.0
    fits = propose(Facts(machine=big, model=read_model("default")), Wishes(concurrency=8))
    assert fits.settings["pcie_frac"] == 0.0 and fits.reasons["pcie_frac"] == "0: no expert is in host RAM"
    cpu = propose(Facts(machine=machine("cpu-only"), model=next80b), Wishes(concurrency=1))
    assert cpu.settings["pcie_frac"] == 0.0


def test_ram_read_bandwidth_is_measured():
    from autoconfig.facts import measure_ram_read_gbps

    assert measure_ram_read_gbps(nbytes=64 * 2**20, repeats=2) > 0.1


def test_a_degraded_link_is_named(next80b):
    degraded = machine("4x16gb-gen3-x8").model_copy(deep=True)
    degraded.gpus[1].pcie_width = 4  # trained at x4 in a x16 slot
    p = propose(Facts(machine=degraded, model=next80b), Wishes(concurrency=8))
    assert any("cuda:1 runs its link at x4 of the x16" in n for n in p.notes)
    assert "cuda:1 is on PCIe Gen3 x4" in p.reasons["layer_split"]
    assert "cuda:3 is on PCIe Gen3 x8" in p.reasons["layer_split"]
    split = layers(p)
    assert split[1] < split[3] < split[0]


def test_one_h200_keeps_most_experts_and_offloads_the_rest(next80b):
    p = propose(Facts(machine=machine("1xh200"), model=next80b), Wishes(concurrency=8))
    s, why = p.settings, p.reasons
    assert s["device"] == "cuda:0" and "the only usable GPU" in why["device"]
    assert s["layer_split"] is None and s["trim_stage_weights"] is False and s["batch_groups"] == 1
    assert "one stage, nothing to pipeline" in why["batch_groups"]
    assert s["batch"] == 8 and "one slot per expected concurrent conversation" in why["batch"]
    budget = float(s["expert_budget_gb"])
    assert 130 < budget < 146 and "what cuda:0 has left" in why["expert_budget_gb"]
    assert 0.85 < p.stages[0].resident < 0.95
    assert s["cpu_threads"] == 12
    assert p.env == {}


def test_two_h200_hold_everything_split_in_halves(next80b):
    p = propose(Facts(machine=machine("2xh200"), model=next80b), Wishes(context=32768, concurrency=8))
    s, why = p.settings, p.reasons
    assert s["layer_split"] == "24,24" and s["trim_stage_weights"] is True
    assert s["batch_groups"] == 2 and "both cards work at once" in why["batch_groups"]
    assert "do not fit fewer cards" in why["device"]
    assert s["expert_budget_gb"] is None and "every expert fits in VRAM" in why["expert_budget_gb"]
    assert s["cpu_threads"] is None and "CPU pool stays idle" in why["cpu_threads"]
    assert s["max_cells"] == 32768 and "as asked" in why["max_cells"]
    assert "slow link" not in why["layer_split"]


def test_a_model_that_fits_one_card_leaves_the_other_free(moe30b):
    p = propose(Facts(machine=machine("2xh200"), model=moe30b), Wishes(concurrency=4))
    assert p.settings["device"] == "cuda:0" and p.settings["layer_split"] is None
    assert "fit on it alone" in p.reasons["device"] and "cuda:1 stays free" in p.reasons["device"]
    two = [c for c in candidates(Facts(machine=machine("2xh200"), model=moe30b), Wishes(concurrency=4)) if c.stages[1:]]
    assert two and two[0].settings["layer_split"] == "24,24" and two[0].settings["batch_groups"] == 2
    assert "a calibration candidate (the rules chose cuda:0)" in two[0].reasons["device"]


def test_cpu_only_box(moe30b):
    p = propose(Facts(machine=machine("cpu-only"), model=moe30b), Wishes(concurrency=4))
    s, why = p.settings, p.reasons
    assert (s["device"], s["dtype"], s["kernels"], s["cuda_graphs"]) == ("cpu", "float32", "torch", False)
    assert "no usable GPU" in why["device"] and "Triton kernels need a GPU" in why["kernels"]
    assert s["batch"] == 4 and s["layer_split"] is None and s["expert_budget_gb"] is None
    # in half the RAM, float32 (122 GB) no longer fits: bfloat16 does
    small = machine("cpu-only").model_copy(deep=True)
    small.host.ram_available_bytes = 110 << 30
    p = propose(Facts(machine=small, model=moe30b), Wishes())
    assert p.settings["dtype"] == "bfloat16" and "in float32 the weights would take 122.1 GB" in p.reasons["dtype"]
    assert p.settings["batch"] == 1 and "one conversation at a time is expected, so one slot" in p.reasons["batch"]


def test_the_default_model_on_this_kind_of_box(default_facts):
    p = propose(Facts(machine=machine("cpu-only"), model=default_facts), Wishes(concurrency=2, context=2048))
    assert p.settings["device"] == "cpu" and p.settings["batch"] == 2 and p.settings["max_cells"] == 2048
    assert "the model has no routed experts" in p.reasons["expert_budget_gb"]


def test_a_machine_too_small_says_so_with_numbers(next80b):
    with pytest.raises(ImpossibleWish) as e:
        propose(Facts(machine=machine("too-small"), model=next80b), Wishes())
    msg = str(e.value)
    assert "Qwen3-Next-80B-A3B does not fit this machine" in msg
    assert "159.3 GB of weights" in msg and "of VRAM (1 GPU)" in msg and "of RAM" in msg and "more" in msg
    with pytest.raises(ImpossibleWish, match="beyond what .* was trained for"):
        propose(Facts(machine=machine("1xh200"), model=next80b), Wishes(context=1_000_000))


def test_long_context_caps_the_slots(next80b):
    """At 262144 positions a conversation's K/V takes 6.7 GB: on 16 GB cards only a few slots fit."""
    p = propose(Facts(machine=machine("4x16gb-gen3-x8"), model=next80b), Wishes(context=262144, concurrency=8))
    assert 1 <= p.settings["batch"] < 8
    assert "8 concurrent conversations are expected, but" in p.reasons["batch"]
    assert "while experts spill to RAM" in p.reasons["batch"]


def test_one_conversation_gets_one_slot_and_no_candidate_is_batch_0(next80b, moe30b):
    """There is no solo path: one conversation at a time is one slot, and no proposal or candidate has batch 0."""
    for name, model in [("4x16gb-gen3-x8", next80b), ("1xh200", next80b), ("2xh200", moe30b), ("cpu-only", moe30b)]:
        facts = Facts(machine=machine(name), model=model)
        p = propose(facts, Wishes())
        assert p.settings["batch"] == 1 and p.settings["batch_groups"] == 1, name
        assert p.reasons["batch"].startswith("1: one conversation at a time is expected, so one slot"), name
        assert "solo" not in p.reasons["batch"] and "batch 1" in p.label and "solo" not in p.label
        for wishes in (Wishes(), Wishes(concurrency=8)):
            assert all(c.settings["batch"] >= 1 for c in candidates(facts, wishes)), (name, wishes)
    found = candidates(Facts(machine=machine("1xh200"), model=next80b), Wishes(concurrency=8))
    assert [c.label for c in found] == ["cuda:0, batch 8", "cuda:0, batch 4", "cuda:0, batch 1"]
    assert found[2].reasons["batch"] == "1: a calibration candidate (the rules chose 8)"
    # a lone conversation offers no fewer-slots variant
    alone = candidates(Facts(machine=machine("1xh200"), model=next80b), Wishes())
    assert [c.label for c in alone] == ["cuda:0, batch 1"]


def test_state_is_planned_for_exactly_the_slots(next80b, moe30b):
    """Each slot holds one conversation's state, and nothing else does: the stages plan the state of `batch`
    sequences, no extra one."""
    p = propose(Facts(machine=machine("4x16gb-gen3-x8"), model=next80b), Wishes(concurrency=8))
    assert p.settings["batch"] == 8
    assert sum(st.state_bytes for st in p.stages) == next80b.state_bytes(None, 8192, 8)
    assert "the state of 8 sequences x 8192 positions" in p.reasons["layer_split"]
    assert "the state of 8 slots (0.3 GB each for 8192 positions)" in p.reasons["batch"]
    # at 262144 positions two conversations' state fit the share state may take: two slots, one per group
    p = propose(Facts(machine=machine("4x16gb-gen3-x8"), model=next80b), Wishes(context=262144, concurrency=8))
    assert (p.settings["batch"], p.settings["batch_groups"]) == (2, 2)
    assert sum(st.state_bytes for st in p.stages) == next80b.state_bytes(None, 262144, 2)
    assert "and 2 slots are what fits in the 13.9 GB that state may take" in p.reasons["batch"]
    # a 24 GB card with room for one 32768-position conversation's state: one slot, the others wait for it
    p = propose(Facts(machine=machine("too-small"), model=moe30b), Wishes(context=32768, concurrency=4))
    assert p.settings["batch"] == 1 and p.stages[0].state_bytes == moe30b.state_bytes(None, 32768, 1)
    assert "holds the state of at most one conversation of 32768 positions" in p.reasons["batch"]
    assert "one slot serves them in turn" in p.reasons["batch"]


def test_a_busy_card_is_left_out(next80b):
    busy = machine("4x16gb-gen3-x8").model_copy(deep=True)
    busy.gpus[2].vram_free_bytes = 700 << 20
    busy.host.ram_available_bytes = 200 << 30  # the experts of the fourth card now stay in RAM too
    p = propose(Facts(machine=busy, model=next80b), Wishes(concurrency=6))
    assert len(layers(p)) == 3 and p.env["CUDA_VISIBLE_DEVICES"] == "0,1,3"
    assert any("cuda:2" in n and "left out" in n for n in p.notes)
    assert p.settings["batch_groups"] == 3 and p.settings["batch"] == 6


def test_slots_round_up_to_whole_groups(next80b):
    p = propose(Facts(machine=machine("4x16gb-gen3-x8"), model=next80b), Wishes(concurrency=6))
    assert p.settings["batch"] == 8 and p.settings["batch_groups"] == 4
    assert "rounded to 8: a multiple of the 4 groups" in p.reasons["batch"]


def test_partition_follows_the_shares():
    assert partition([1.0] * 48, [1, 1, 1, 0.75]) == [0, 13, 26, 38, 48]
    assert partition([1.0] * 4, [1, 1, 1, 1]) == [0, 1, 2, 3, 4]
    assert partition([1.0, 1.0], [100, 1]) == [0, 1, 2]  # every stage keeps a layer


def test_candidates_for_calibration(next80b):
    found = candidates(Facts(machine=machine("4x16gb-gen3-x8"), model=next80b), Wishes(concurrency=8))
    labels = [c.label for c in found]
    assert labels[0] == "cuda, batch 8, split 13,13,13,9, 4 groups"
    assert any("1 group" in label for label in labels) and any("batch 4" in label for label in labels)
    assert len(found) == len(set(labels)) <= 4
    assert labels[3] == "cuda, batch 1, split 13,13,13,9, 1 group" and all(c.settings["batch"] >= 1 for c in found)
    ungrouped = next(c for c in found if "1 group" in c.label)
    assert ungrouped.reasons["batch_groups"].startswith("1: a calibration candidate (the rules chose 4)")


# ---------------------------------------------------------------------------------------------- config file


@pytest.mark.parametrize("suffix", [".json", ".toml"])
def test_config_file_round_trips_through_engine_settings(next80b, tmp_path, monkeypatch, suffix):
    from serve.config import ServeSettings
    from strata.config import EngineSettings, use_config_file

    for key in list(os.environ):
        if key.startswith("STRATA_"):
            monkeypatch.delenv(key)
    p = propose(Facts(machine=machine("4x16gb-gen3-x8"), model=next80b), Wishes(concurrency=8, context=16384))
    path = write_config(tmp_path / f"strata{suffix}", p.config("/models/Qwen3-Next-80B-A3B"))
    try:
        use_config_file(path)
        engine, serve = EngineSettings(), ServeSettings()
    finally:
        use_config_file(None)
    assert set(p.settings) <= set(EngineSettings.model_fields)
    for key, value in p.settings.items():
        assert getattr(engine, key) == value, key
        assert getattr(serve, key) == value, key
    assert engine.model == "/models/Qwen3-Next-80B-A3B"
    assert engine.layer_split == p.settings["layer_split"] and engine.batch_groups == 4


# ---------------------------------------------------------------------------------------------- node, CLI


def test_node_annotation_is_the_machine_facts():
    m = machine("4x16gb-gen3-x8")
    patch = node_patch(m)
    text = patch["metadata"]["annotations"][ANNOTATION]
    assert ANNOTATION == "strata.dev/facts" and set(patch) == {"metadata"}
    assert MachineFacts.model_validate_json(text) == m and "\n" not in text
    assert facts_from_annotations(patch["metadata"]["annotations"]) == m
    assert facts_from_annotations({ANNOTATION: "{not json"}) is None and facts_from_annotations(None) is None


def test_cli_facts_prints_this_machine():
    out = subprocess.run([sys.executable, "-m", "autoconfig", "facts"], capture_output=True, text=True,
                         cwd=Path(__file__).parents[1])
    assert out.returncode == 0, out.stderr
    facts = MachineFacts.model_validate_json(out.stdout)
    assert facts.host.cpu_cores >= 1 and facts.host.ram_total_bytes > 0


def test_cli_annotates_the_node(monkeypatch, capsys):
    """`facts --annotate-node` patches $NODE_NAME with the annotation (on a fake `kubernetes` client)."""
    import autoconfig.cli as cli

    calls = []

    class ConfigException(Exception):
        pass

    def in_cluster():
        calls.append("in-cluster")

    core = types.SimpleNamespace(patch_node=lambda name, body: calls.append((name, body)))
    fake = types.SimpleNamespace(
        client=types.SimpleNamespace(CoreV1Api=lambda: core),
        config=types.SimpleNamespace(ConfigException=ConfigException, load_incluster_config=in_cluster,
                                     load_kube_config=lambda: calls.append("kubeconfig")),
    )
    monkeypatch.setitem(sys.modules, "kubernetes", fake)
    asked = []
    monkeypatch.setattr(cli, "read_machine", lambda node=False: asked.append(node) or machine("2xh200"))
    monkeypatch.delenv("NODE_NAME", raising=False)
    assert main(["facts", "--annotate-node"]) == 2
    assert "$NODE_NAME" in capsys.readouterr().err
    monkeypatch.setenv("NODE_NAME", "gpu-node-7")
    assert main(["facts", "--annotate-node"]) == 0
    assert calls == ["in-cluster", ("gpu-node-7", node_patch(machine("2xh200")))]
    assert "annotated node gpu-node-7 with strata.dev/facts" in capsys.readouterr().err
    assert asked == [True, True]  # the node's own RAM and CPUs, not the facts pod's limits


def test_cli_replays_facts_and_writes_a_config(next80b, tmp_path, capsys):
    facts = tmp_path / "facts.json"
    facts.write_text(Facts(machine=machine("4x16gb-gen3-x8"), model=next80b).model_dump_json())
    config = tmp_path / "strata.toml"
    assert main(["--facts", str(facts), "--concurrency", "8", "--write", str(config)]) == 0
    out = capsys.readouterr()
    assert "layer_split" in out.out and "cuda:3 is on PCIe Gen3 x8" in out.out and "4 x Tesla V100-PCIE-16GB" in out.out
    assert "strata serve --config" in out.err and "CUDA_DEVICE_ORDER=PCI_BUS_ID" in out.err
    assert 'layer_split = "13,13,13,9"' in config.read_text() and 'model = "Qwen3-Next-80B-A3B"' in config.read_text()
    assert main(["--facts", str(facts), "--json", "--concurrency", "8"]) == 0
    assert json.loads(capsys.readouterr().out)["settings"]["batch_groups"] == 4


def test_cli_impossible_wish_exits_2(next80b, tmp_path, capsys):
    facts = tmp_path / "facts.json"
    facts.write_text(Facts(machine=machine("too-small"), model=next80b).model_dump_json())
    assert main(["--facts", str(facts)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("strata autoconfig: error: Qwen3-Next-80B-A3B does not fit this machine")
    assert main(["--facts", str(DATA / "machine-1xh200.json"), "--calibrate"]) == 2
    assert "cannot replay --facts" in capsys.readouterr().err


def test_calibrate_on_the_cpu_with_the_default_model(tmp_path, capsys, monkeypatch):
    import autoconfig.cli as cli

    monkeypatch.setattr(cli, "read_machine", lambda: machine("cpu-only"))  # the same rules on any CI box
    config = tmp_path / "strata.json"
    assert main(["--model", "default", "--calibrate", "--calibrate-windows", "2", "--concurrency", "2",
                 "--context", "64", "--write", str(config)]) == 0
    out = capsys.readouterr().out
    table = out.split("\n\n")[0]
    assert "tokens/s" in table and "cpu, batch 2" in table and "cpu, batch 1" in table and "solo" not in table
    assert sum(line.startswith("*") for line in table.splitlines()) == 1
    assert "calibrated here:" in out
    written = json.loads(config.read_text())
    assert written["device"] == "cpu" and written["max_cells"] == 64 and written["model"] == "default"
    assert written["batch"] in (1, 2)


def test_facts_recorded_on_the_real_h200_machine(moe30b):
    """`python -m autoconfig facts` read through NVML on the lent H200 (2026-11-30)."""
    recorded = machine("h200-recorded")
    assert [g.name for g in recorded.gpus] == ["NVIDIA H200"]
    assert recorded.gpus[0].pcie_gen == 5 and recorded.gpus[0].pcie_width == 16
    assert 140e9 < recorded.gpus[0].vram_total_bytes < 152e9 and recorded.host.cpu_cores == 16
    p = propose(Facts(machine=recorded, model=moe30b), Wishes(concurrency=8))
    assert p.settings["device"] == "cuda:0" and p.settings["layer_split"] is None
    assert p.settings["expert_budget_gb"] is None and "every expert fits in VRAM" in p.reasons["expert_budget_gb"]


def test_park_vram_takes_half_of_what_is_left_up_to_the_host_tier(moe30b, next80b):
    """--park-vram-gb: the 30B model on an H200 leaves tens of GB: the host tier's 4 GB; the 80B one spills experts
    to RAM: 0; with little left after the weights and state: 0, saying so; the CPU: 0."""
    p = propose(Facts(machine=machine("h200-recorded"), model=moe30b), Wishes(concurrency=8))
    assert p.settings["park_vram_gb"] == 4.0 and "host tier's budget" in p.reasons["park_vram_gb"]
    assert "the state of 8 slots" in p.reasons["park_vram_gb"]
    left = p.stages[0].capacity_bytes - p.stages[0].fixed_bytes - p.stages[0].state_bytes - p.stages[0].budget_bytes
    assert left > 8e9
    tight = machine("h200-recorded").model_copy(deep=True)
    tight.gpus[0].vram_free_bytes -= left - int(3e9)  # 3 GB left: half of it, 1.5 GB
    p = propose(Facts(machine=tight, model=moe30b), Wishes(concurrency=8))
    assert p.settings["park_vram_gb"] == 1.5 and "host tier" not in p.reasons["park_vram_gb"]
    tight.gpus[0].vram_free_bytes -= int(2e9)  # 1 GB left: not worth it
    p = propose(Facts(machine=tight, model=moe30b), Wishes(concurrency=8))
    assert p.settings["park_vram_gb"] == 0.0 and "too little" in p.reasons["park_vram_gb"]
    p = propose(Facts(machine=machine("1xh200"), model=next80b), Wishes(concurrency=8))
    assert p.settings["park_vram_gb"] == 0.0 and "holds experts" in p.reasons["park_vram_gb"]
    p = propose(Facts(machine=machine("cpu-only"), model=moe30b), Wishes())
    assert p.settings["park_vram_gb"] == 0.0 and "no GPU" in p.reasons["park_vram_gb"]


def test_calibrate_measures_a_pipelined_split_on_the_cpu():
    """A candidate with a layer split and groups is measured as `strata engine` would run it (stages, groups taking
    turns), not refused as unmeasurable: the embedded model split 15,15 over two CPU stages with 2 groups."""
    from autoconfig.calibrate import calibrate
    from autoconfig.rules import Proposal

    base = {"device": "cpu", "dtype": "auto", "max_cells": 96, "batch": 2, "layer_split": None, "split_device": None,
            "batch_groups": 1, "trim_stage_weights": False, "expert_budget_gb": None, "cpu_threads": None}
    grouped = {**base, "layer_split": "15,15", "batch_groups": 2, "trim_stage_weights": True}
    got = calibrate("default", [Proposal(settings=base, reasons={}), Proposal(settings=grouped, reasons={})],
                    concurrency=2, windows=2)
    assert [m.note for m in got] == ["", ""], [m.note for m in got]
    assert all(m.tokens_per_s and m.tokens_per_s > 0 and m.conversations == 2 for m in got)
