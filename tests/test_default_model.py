"""The embedded default (SmolLM2-135M-Instruct GGUF) against transformers loading the same file."""

from __future__ import annotations

import torch

PROMPT = "The capital of France is"


def test_greedy_answer_is_paris_like_transformers(default_engine, hf_default_model, hf_default_tokenizer):
    tok = default_engine.tokenizer
    ids = tok.encode(PROMPT)
    assert ids == hf_default_tokenizer(PROMPT)["input_ids"]
    ours = default_engine.generate(ids, 32, stop_ids=frozenset())
    with torch.no_grad():
        theirs = hf_default_model.generate(
            input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=32, do_sample=False, eos_token_id=None,
        )
    assert ours.ids == theirs[0, len(ids):].tolist()
    assert tok.decode(ours.ids).startswith(" Paris.")


def test_logits_match_transformers_at_every_position(default_engine, hf_default_model):
    ids = default_engine.tokenizer.encode("Strata reads the prompt in one window, then decodes one row at a time.")
    state = default_engine.new_state()
    ours = torch.cat([default_engine.run(state, ids[:-3], all_logits=True)] + [default_engine.run(state, [t]) for t in ids[-3:]])
    with torch.no_grad():
        theirs = hf_default_model(input_ids=torch.tensor([ids])).logits[0]
    assert float((ours - theirs).abs().max() / theirs.abs().max()) < 1e-4


def test_chat_template_matches_transformers(default_engine, hf_default_tokenizer):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ours = default_engine.tokenizer.encode_chat(messages)
    theirs = hf_default_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    theirs = theirs["input_ids"] if isinstance(theirs, dict) or hasattr(theirs, "keys") else theirs
    assert ours == list(theirs)
    answer = default_engine.generate(ours, 24)
    assert answer.finish_reason == "stop"  # the model closes its turn with <|im_end|>
    assert "Paris" in default_engine.tokenizer.decode(answer.ids)


def test_its_matrices_stay_packed_for_the_cpu_kernel(default_engine):
    """Q4_1 projections and the Q8_0 head stay packed for the CPU's own kernel where it can run (98 MB a token read
    instead of 538); the embedding is a float table for lookups. Without the kernel, all dequantized at load."""
    from strata.kernels import cpu_packed
    from strata.quant.packed import PackedWeight

    w = default_engine.stages[0].weights
    assert isinstance(w.embed, torch.Tensor) and w.embed.dtype == torch.float32
    if not cpu_packed.available():
        assert isinstance(w.layers[0]["qkv"], torch.Tensor) and isinstance(w.lm_head, torch.Tensor), cpu_packed.why()
        return
    for layer in w.layers.values():
        for key in ("qkv", "o", "gate_up", "down"):
            assert isinstance(layer[key], PackedWeight) and layer[key].fmt == "q4_1" and layer[key].host_kernel
    assert isinstance(w.lm_head, PackedWeight) and w.lm_head.fmt == "q8_0" and w.lm_head.shape == w.embed.shape
    assert w.nbytes() < 250e6  # 98 MB of matrices and head beside the 113 MB float32 embedding
