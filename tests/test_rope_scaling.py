"""RoPE scaling against `transformers`: tiny checkpoints of each kind (linear, llama3, yarn, dynamic) give its greedy
tokens and its logits at every position, on the torch path and on the Triton kernels (interpreter); the older
`rope_scaling` spelling reads the same; kinds Strata does not implement are refused by name."""

from __future__ import annotations

import json

import pytest
import torch

from strata.errors import CheckpointError
from strata.model.loader import ModelFiles
from strata.model.rope_scaling import rope_config, rope_frequencies
from strata.runtime.generate import Engine
from tests.tiny_models import VOCAB, build

NEW = 8
PROMPT = [(i * 37 + 11) % VOCAB for i in range(72)]  # past original_max_position_embeddings (64) below

KINDS = {
    "linear": dict(rope_type="linear", factor=2.0),
    "llama3": dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=64),
    "yarn": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64),
    "yarn-betas-mscale": dict(rope_type="yarn", factor=3.0, original_max_position_embeddings=48, beta_fast=16.0,
                              beta_slow=2.0, attention_factor=1.3),
    "dynamic": dict(rope_type="dynamic", factor=2.0),
}
# (case, rope kind): Llama with every kind; Qwen3 dense (q/k norms) and Qwen3-Next (partial rotary, where YaRN's
# attention factor scales the rotary dimensions only) with yarn
RUNS = [("llama-gqa-tied", k) for k in KINDS] + [("qwen3-dense", "yarn"), ("qwen3_next", "yarn")]


@pytest.fixture(scope="module", params=RUNS, ids=[f"{c}-{k}" for c, k in RUNS])
def model(request, tmp_path_factory):
    case, kind = request.param
    folder = tmp_path_factory.mktemp(f"{case}-{kind}")
    theta = {"llama-gqa-tied": 100000.0, "qwen3-dense": 1000000.0, "qwen3_next": 10000.0}[case]
    extra = {"partial_rotary_factor": 0.25} if case == "qwen3_next" else {}
    ref = build(case, folder, rope_parameters=dict(KINDS[kind], rope_theta=theta, **extra))
    ref.generation_config.eos_token_id = None
    return case, kind, folder, ref


def reference_logits(ref, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ref(input_ids=torch.tensor([ids])).logits[0].float()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def test_the_config_is_read_and_the_frequencies_are_transformers(model):
    case, kind, folder, ref = model
    spec = ModelFiles.open(folder).spec
    assert spec.attention.rope_type == KINDS[kind]["rope_type"]
    a = spec.attention
    inv_freq, scale = rope_frequencies(a.rotary_dim, a.rope_theta, a.rope_type, a.rope_params)
    rotary = ref.model.rotary_emb
    theirs = rotary.original_inv_freq if kind == "dynamic" else rotary.inv_freq
    assert torch.equal(inv_freq, theirs.float())
    assert scale == pytest.approx(rotary.attention_scaling, rel=1e-12)
    if kind.startswith("yarn"):
        assert scale != 1.0 and not torch.equal(inv_freq, rope_frequencies(a.rotary_dim, a.rope_theta)[0])


def test_greedy_tokens_and_logits_match_transformers(model):
    case, kind, folder, ref = model
    engine = Engine(ModelFiles.open(folder), max_cells=256)
    ours = engine.generate(PROMPT, NEW, stop_ids=frozenset()).ids
    with torch.no_grad():
        theirs = ref.generate(input_ids=torch.tensor([PROMPT]), attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
                              max_new_tokens=NEW, do_sample=False)[0, len(PROMPT):].tolist()
    assert ours == theirs
    full = PROMPT + ours
    state = engine.new_state()
    logits = [engine.run(state, PROMPT, all_logits=True)] + [engine.run(state, [t]) for t in ours[:-1]]
    assert rel_err(torch.cat(logits), reference_logits(ref, full)[: len(full) - 1]) < 1e-4


@pytest.mark.parametrize("model", [("llama-gqa-tied", "yarn"), ("qwen3_next", "yarn")], indirect=True,
                         ids=["llama-yarn", "qwen3_next-yarn"])
def test_the_triton_kernels_rotate_as_transformers(model):
    """The Triton rotary kernel (prompt windows) and qk_prep (decode windows) carry YaRN's factor too."""
    case, kind, folder, ref = model
    engine = Engine(ModelFiles.open(folder), max_cells=256, kernels="triton")
    ids = PROMPT[:20]  # YaRN changes the frequencies and cos/sin at every position (the interpreter is slow)
    state = engine.new_state()
    got = engine.run(state, ids, all_logits=True)
    after = engine.run(state, [5])
    want = reference_logits(ref, ids + [5])
    assert rel_err(got, want[:-1]) < 1e-4
    assert rel_err(after, want[-1:]) < 1e-4


def test_the_older_rope_scaling_spelling_reads_the_same():
    new = {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                               "original_max_position_embeddings": 32768}, "max_position_embeddings": 131072}
    old = {"rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
           "rope_theta": 1e6, "max_position_embeddings": 131072}
    assert rope_config(new) == rope_config(old)
    llama3 = {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
              "rope_theta": 500000.0, "max_position_embeddings": 131072}
    # original_max_position_embeddings missing: max_position_embeddings, as transformers takes it
    assert dict(rope_config(llama3)[3])["original_max_position_embeddings"] == 131072


@pytest.mark.parametrize("rope, needle", [
    ({"rope_type": "longrope", "rope_theta": 1e4}, "'longrope' is not supported"),
    ({"rope_type": "su", "rope_theta": 1e4}, "'su' is not supported"),
    ({"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4}, "needs low_freq_factor, high_freq_factor"),
    ({"rope_type": "linear", "rope_theta": 1e4}, "needs factor"),
    ({"rope_type": "linear", "factor": -2, "rope_theta": 1e4}, "factor -2"),
])
def test_unsupported_or_incomplete_scaling_is_refused_by_name(rope, needle):
    with pytest.raises(CheckpointError, match=needle):
        rope_config({"rope_parameters": rope, "max_position_embeddings": 4096})


def test_a_checkpoint_with_an_unknown_kind_exits_2_naming_it(tmp_path):
    import subprocess
    import sys

    build("llama-gqa-tied", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0], "long_factor": [1.0]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    run = subprocess.run([sys.executable, "-m", "strata.cli", "generate", "--model", str(tmp_path), "--prompt-ids",
                          "1,2,3", "--max-tokens", "2"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr
    assert "longrope" in run.stderr
