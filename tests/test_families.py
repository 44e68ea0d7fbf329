"""Every family against `transformers` on tiny random checkpoints: greedy tokens and logits at every position."""

from __future__ import annotations

import pytest
import torch

from strata.model.loader import ModelFiles
from strata.runtime.generate import Engine
from tests.tiny_models import ALL_CASES, VOCAB, add_mtp_weights, build

NEW_TOKENS = 40
PROMPTS = {
    "short": [5, 17, 33, 2, 99, 7, 64, 1, 3, 120],  # shorter than the GDN chunk (64)
    "long": [(i * 37 + 11) % VOCAB for i in range(100)],  # longer than the GDN chunk
}


@pytest.fixture(scope="module", params=list(ALL_CASES))
def case(request, tmp_path_factory):
    name = request.param
    folder = tmp_path_factory.mktemp(name)
    ref = build(name, folder)
    ref.generation_config.eos_token_id = None
    return name, folder, ref


def _reference_logits(ref, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ref(input_ids=torch.tensor([ids])).logits[0].float()


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("prompt", list(PROMPTS))
def test_greedy_tokens_and_logits_match_transformers(case, prompt):
    name, folder, ref = case
    ids = PROMPTS[prompt]
    engine = Engine(ModelFiles.open(folder), max_cells=256)

    ours = engine.generate(ids, NEW_TOKENS, stop_ids=frozenset())
    with torch.no_grad():
        theirs = ref.generate(
            input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=NEW_TOKENS, do_sample=False,
        )
    assert ours.ids == theirs[0, len(ids):].tolist()
    assert ours.finish_reason == "length"

    # logits at every position: the prompt read in one window, then one window per generated token
    full = ids + ours.ids
    state = engine.new_state()
    logits = [engine.run(state, ids, all_logits=True)] + [engine.run(state, [t]) for t in ours.ids[:-1]]
    assert _rel_err(torch.cat(logits), _reference_logits(ref, full)[: len(full) - 1]) < 1e-4


def test_prompt_read_in_chunks_equals_one_window(case):
    name, folder, ref = case
    ids = PROMPTS["long"]
    engine = Engine(ModelFiles.open(folder), max_cells=256, max_window_tokens=37)
    logits = engine.run(engine.new_state(), ids, all_logits=True)
    assert _rel_err(logits, _reference_logits(ref, ids)) < 1e-4


def test_spec_reflects_the_config(case):
    name, folder, ref = case
    spec = ModelFiles.open(folder).spec
    cfg = ref.config.get_text_config()
    assert spec.num_layers == cfg.num_hidden_layers
    assert spec.vocab_size == cfg.vocab_size
    assert spec.attention.num_kv_heads == cfg.num_key_value_heads
    if spec.gdn is not None:
        assert [layer.mixer for layer in spec.layers] == [
            "attention" if t == "full_attention" else "gdn" for t in cfg.layer_types
        ]
        assert spec.attention.rotary_dim < spec.attention.head_dim  # partial rotary
    if name == "qwen3_moe-mixed-dense":
        assert [layer.mlp for layer in spec.layers] == ["dense", "moe", "dense", "moe"]


def test_mtp_weights_are_loaded(tmp_path):
    build("qwen3_next", tmp_path)
    names = add_mtp_weights(tmp_path, hidden=64)
    files = ModelFiles.open(tmp_path)
    assert files.spec.num_mtp_layers == 1
    weights = files.load(torch.device("cpu"), torch.float32)
    assert sorted(weights.mtp) == names


def test_a_stage_reads_only_its_layers(tmp_path):
    build("qwen3_next", tmp_path)
    files = ModelFiles.open(tmp_path)
    read = []
    load = files.checkpoint.load
    files.checkpoint.load = lambda name, dtype=torch.float32: read.append(name) or load(name, dtype)
    weights = files.load(torch.device("cpu"), torch.float32, layers=range(2, 4))
    assert sorted(weights.layers) == [2, 3]
    layer_ids = {int(n.split(".")[2]) for n in read if n.startswith("model.layers.")}
    assert layer_ids == {2, 3}
    assert weights.embed is None and weights.lm_head is not None


def test_the_multimodal_checkpoint_takes_overrides_for_its_text_model(tmp_path):
    """tests.tiny_models.build's overrides reach the text model of the multimodal case too (its config is made
    apart from the others'), and the engine reads the overridden shape."""
    ref = build("qwen3_5_moe", tmp_path, shared_expert_intermediate_size=32)
    assert ref.config.text_config.shared_expert_intermediate_size == 32
    assert ModelFiles.open(tmp_path).spec.moe.shared_dim == 32
