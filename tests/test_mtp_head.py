"""The multi-token-prediction head shipped for the embedded default (strata/model/heads/), and the script that trains
it (train/mtp_head.py), run end to end on a tiny random Llama."""

from __future__ import annotations

import importlib.util
import json
import random
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
HEAD_FILE = REPO / "strata" / "model" / "heads" / "smollm2-135m-instruct-mtp.safetensors"
H, FFN, V = 576, 1536, 49152
SHAPES = {
    "mtp.pre_fc_norm_embedding.weight": [H],
    "mtp.pre_fc_norm_hidden.weight": [H],
    "mtp.fc.weight": [H, 2 * H],
    "mtp.layers.0.input_layernorm.weight": [H],
    "mtp.layers.0.self_attn.q_proj.weight": [H, H],
    "mtp.layers.0.self_attn.k_proj.weight": [192, H],
    "mtp.layers.0.self_attn.v_proj.weight": [192, H],
    "mtp.layers.0.self_attn.o_proj.weight": [H, H],
    "mtp.layers.0.post_attention_layernorm.weight": [H],
    "mtp.layers.0.mlp.gate_proj.weight": [FFN, H],
    "mtp.layers.0.mlp.up_proj.weight": [FFN, H],
    "mtp.layers.0.mlp.down_proj.weight": [H, FFN],
    "mtp.norm.weight": [H],
}


def _script():
    spec = importlib.util.spec_from_file_location("mtp_head_script", REPO / "train" / "mtp_head.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_shipped_head_file():
    from safetensors import safe_open

    assert HEAD_FILE.exists(), "run train/mtp_head.py"
    with safe_open(str(HEAD_FILE), framework="pt") as f:
        meta = f.metadata()
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    assert set(tensors) == set(SHAPES) | {"mtp.draft_vocab"}
    for name, shape in SHAPES.items():
        assert list(tensors[name].shape) == shape, name
        assert tensors[name].dtype == torch.bfloat16, name
        assert torch.isfinite(tensors[name].float()).all(), name
    vocab = tensors["mtp.draft_vocab"]
    assert vocab.dtype == torch.int64 and vocab.dim() == 1 and 1024 <= len(vocab) <= V
    assert (vocab[1:] > vocab[:-1]).all(), "sorted ascending, no repeats"
    assert 0 <= int(vocab[0]) and int(vocab[-1]) < V
    assert meta["format"] == "pt" and meta["base_model"] == "SmolLM2-135M-Instruct"
    assert meta["trained_by"] == "train/mtp_head.py"
    accept = json.loads(meta["acceptance_per_position"])
    assert len(accept) == 4 and accept[0] >= 0.5 and accept == sorted(accept, reverse=True)


def test_shipped_head_is_package_data():
    import subprocess

    ignored = subprocess.run(["git", "check-ignore", "-q", str(HEAD_FILE)], cwd=REPO).returncode == 0
    assert not ignored
    text = (REPO / "pyproject.toml").read_text()
    assert '"model/heads/*.safetensors"' in text


def test_training_end_to_end_on_a_tiny_llama(tmp_path):
    """Answers from a tiny random Llama, a head initialised from its last layer, a few AdamW steps: the chained loss
    falls; the module's forward, draft and file round trip agree with the chained computation."""
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices; one thread is as fast and keeps clear of a busy neighbour's cores
    try:
        _tiny_end_to_end(tmp_path)
    finally:
        torch.set_num_threads(threads)


def _tiny_end_to_end(tmp_path):
    from tests.tiny_models import build

    m = _script()
    model = build("llama-gqa-tied", tmp_path / "tiny").float().eval()
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 160) for _ in range(rng.randrange(4, 10))] for _ in range(8)]
    gen = torch.Generator().manual_seed(0)
    seqs = m.answer_batch(model, prompts, [i % 2 == 1 for i in range(8)], 24, 0.7, eos=-1, gen=gen)
    assert all(len(s.tokens) == len(p) + 23 for s, p in zip(seqs, prompts))
    greedy = seqs[0]
    assert (greedy.tokens[1:] == greedy.greedy[:-1])[greedy.prompt_len - 1:].all(), "greedy answers follow the picks"
    with torch.no_grad():  # recorded hidden states are the model's final normed states
        ref = model.model(input_ids=greedy.tokens[None]).last_hidden_state[0]
    torch.testing.assert_close(greedy.hidden.float(), ref, atol=2e-2, rtol=0)

    vocab = m.choose_draft_vocab(seqs, 96, 160)
    assert len(vocab) == 96 and (vocab[1:] > vocab[:-1]).all()
    head = m.head_from_model(model, vocab)
    steps = [1.0, 0.6, 0.4]
    index = m._vocab_index(head)
    batch = m.make_batch(seqs, len(steps), index)
    before = float(m.step_loss(head, batch, steps, 0.5, 1.0)[0].detach())
    m.train_head(head, seqs, [], epochs=30, lr=1e-2, batch_tokens=128, weights=steps, soft=0.5, feat=1.0,
                 log=lambda _: None,
                 eval_every=1000)
    after = float(m.step_loss(head, batch, steps, 0.5, 1.0)[0].detach())
    assert after < 0.75 * before, (before, after)

    head.eval()
    s = seqs[0]
    n = 12
    with torch.no_grad():
        logits = head(s.hidden.float(), s.tokens)
        drafts = head.draft(s.hidden[:n], s.tokens[:n + 1], 3)
        assert logits.shape == (len(s.tokens) - 1, 96)
        assert drafts[0] == int(vocab[logits[n - 1].argmax()])
        # the chained computation, fed the drafts as the tokens that follow, gives the same drafts
        tokens = s.tokens[:n + 3].clone()
        tokens[n + 1:n + 3] = torch.tensor(drafts[:2])
        outs = head.chain(s.hidden.float()[None, :n + 3], tokens[None], 3)
        assert [int(vocab[head.logits(o)[0, n - 1].argmax()]) for o in outs] == drafts

    path = tmp_path / "head.safetensors"
    head.save(path, {"base_model": "tiny"})
    loaded = m.MtpHead.from_file(path, head.embedding)
    assert loaded.config() == head.config()
    assert torch.equal(loaded.draft_vocab, vocab)
    torch.testing.assert_close(loaded.fc.weight, head.fc.weight.to(torch.bfloat16).float())


def test_answers_end_at_eos_and_noise_moves_only_the_inputs(tmp_path):
    """Rows that pick the end token stop there (finished rows leave the batch in groups, and run on until then: what
    they write past their end is dropped); training noise moves the hidden states the head reads, not the targets."""
    from tests.tiny_models import build

    m = _script()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        model = build("llama-gqa-tied", tmp_path / "tiny").float().eval()
        rng = random.Random(1)
        prompts = [[rng.randrange(3, 160) for _ in range(rng.randrange(4, 10))] for _ in range(16)]
        sampled = [i % 2 == 1 for i in range(16)]
        first = m.answer_batch(model, prompts, sampled, 24, 0.7, eos=-1, gen=torch.Generator().manual_seed(0))
        # an end token the greedy answers pick early on
        eos = int(torch.cat([s.greedy[s.prompt_len - 1:s.prompt_len + 4] for s, f in zip(first, sampled) if not f]
                            ).mode().values)
        seqs = m.answer_batch(model, prompts, sampled, 24, 0.7, eos=eos, gen=torch.Generator().manual_seed(0))
    finally:
        torch.set_num_threads(threads)
    ended = 0
    for s, p, was_sampled in zip(seqs, prompts, sampled):
        answer = s.tokens[len(p):]
        assert s.tokens[:len(p)].tolist() == p and len(answer) <= 23
        assert s.hidden.shape[0] == s.greedy.shape[0] == s.top_ids.shape[0] == len(s.tokens)
        for t in (s.tokens, s.hidden, s.top_ids):  # compact storage, not a view of the batch's buffers
            assert t.untyped_storage().nbytes() == t.numel() * t.element_size()
        assert eos not in answer.tolist(), "the end token is picked last, never fed"
        if not was_sampled:
            assert (s.tokens[1:] == s.greedy[:-1])[len(p) - 1:].all()
            if len(answer) < 23:
                assert int(s.greedy[-1]) == eos
                ended += 1
    assert ended >= 2
    vocab = m.choose_draft_vocab(seqs, 64, 160)
    index = torch.full((160,), -1, dtype=torch.int64)
    index[vocab] = torch.arange(len(vocab))
    clean = m.make_batch(seqs, 3, index)
    noisy = m.make_batch(seqs, 3, index, noise=0.02, gen=torch.Generator().manual_seed(0))
    assert clean.noisy_hidden is None and torch.equal(noisy.hidden, clean.hidden)
    for j in range(3):
        assert torch.equal(noisy.targets[j], clean.targets[j])
    real = clean.hidden.abs().sum(-1) > 0
    moved = (noisy.noisy_hidden - clean.hidden).norm(dim=-1)[real] / clean.hidden.norm(dim=-1)[real]
    assert 0 < float(moved.mean()) < 0.06 and float(moved.max()) < 0.12
