"""A CPU engine on the torch path keeps a GGUF's weights packed for the CPU's own kernel (`strata.kernels.cpu_packed`):
a tiny Llama GGUF whose matrices are Q4_1 / Q8_0 / Q4_K / Q6_K (the formats that kernel reads) and IQ3_S (one it
does not: dequantized at load), against `transformers` over gguf's own dequantization of the same bytes; decode
rows batched equal their solo rows bit for bit; without the kernel (`STRATA_CPU_PACKED=0`) everything is
dequantized at load and the answers are the same."""

from __future__ import annotations

import subprocess
import sys

import gguf
import pytest
import torch

from strata.kernels import cpu_packed
from strata.quant.packed import PackedWeight
from tests.slot_helpers import decode_logits
from tests.test_packed_engine import (ARCH, PROMPT, SIZES, STEPS, decode, gguf_tensors, make_engine, reference_state,
                                      rel_err, write_gguf)
from tests.tiny_models import VOCAB, build

T = gguf.GGMLQuantizationType
F32, Q4_1, Q8_0, Q4_K, Q6_K, IQ3_S = T.F32, T.Q4_1, T.Q8_0, T.Q4_K, T.Q6_K, T.IQ3_S
# layer 0, layer 1: every format the kernel reads in several roles, and IQ3_S (which it does not)
TYPES = {
    "attn_q": (Q4_1, Q8_0), "attn_k": (Q4_1, Q8_0), "attn_v": (Q4_1, Q8_0), "attn_output": (Q8_0, IQ3_S),
    "ffn_gate": (Q4_K, Q4_1), "ffn_up": (Q4_K, Q4_1), "ffn_down": (Q6_K, Q4_1),
    "attn_norm": (F32, F32), "ffn_norm": (F32, F32),
    "token_embd": Q8_0, "output": Q4_1, "output_norm": F32,
}
# neutral weight -> its format in layer 0, layer 1 (None: dequantized at load)
EXPECTED = {"qkv": ("q4_1", "q8_0"), "o": ("q8_0", None), "gate_up": ("q4_k", "q4_1"), "down": ("q6_k", "q4_1")}

pytestmark = pytest.mark.skipif(not cpu_packed.available(), reason=f"no CPU packed kernel here: {cpu_packed.why()}")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """(the GGUF file, transformers' greedy tokens and logits over the file's dequantized bytes)."""
    folder = tmp_path_factory.mktemp("cpu_packed")
    ref = build("llama-mha-untied", folder / "hf", **SIZES)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in ref.state_dict().items():
            if name.endswith("norm.weight"):
                param.add_(0.2 * torch.randn_like(param))
    path = folder / "llama.gguf"
    stored = write_gguf(path, ARCH["llama"], ref.config, gguf_tensors(ref, "llama", TYPES))
    with torch.no_grad():
        ref.load_state_dict(reference_state(ref, "llama", stored, TYPES), strict=True)
        ids = list(PROMPT)
        for _ in range(STEPS):
            ids.append(int(ref.eval()(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
        logits = ref(input_ids=torch.tensor([ids])).logits[0].float()
    return path, ids[len(PROMPT):], logits


@pytest.fixture(scope="module")
def engine(model):
    return make_engine(model[0], kernels="torch")


def test_the_formats_the_kernel_reads_stay_packed(engine):
    engine, log = engine
    w = engine.weights
    for i, layer in w.layers.items():
        for key, formats in EXPECTED.items():
            got = layer[key]
            if formats[i] is None:
                assert isinstance(got, torch.Tensor) and got.dtype == torch.float32, (i, key)
            else:
                assert isinstance(got, PackedWeight) and got.fmt == formats[i] and got.host_kernel, (i, key, got)
    assert isinstance(w.lm_head, PackedWeight) and w.lm_head.fmt == "q4_1" and w.lm_head.host_kernel
    assert isinstance(w.embed, torch.Tensor)  # lookups read the plain table
    said = [line for line in log if line.startswith("weights kept")]
    assert said == ["weights kept quantized on the device: 7 Q4_1, 2 Q4_K, 1 Q6_K, 4 Q8_0; dequantized at load: "
                    "1 IQ3_S"], said


def test_logits_and_tokens_are_transformers_over_the_same_bytes(engine, model):
    """Every prompt position (a prompt window: the weights written out, torch's GEMM) and each decode step (one
    row: the packed kernel)."""
    _, tokens, want = model
    got = decode(engine[0], tokens)
    assert got.shape == want.shape == (len(PROMPT) + STEPS, VOCAB)
    assert rel_err(got, want) < 1e-4
    assert got[len(PROMPT) - 1:-1].argmax(-1).tolist() == tokens


def test_decode_rows_batched_equal_their_solo_rows_bitwise(engine):
    engine = engine[0]
    prompts = {i: [(i * 29 + j * 13 + 5) % VOCAB for j in range(4 + 3 * i)] for i in range(5)}
    together = decode_logits(engine.init_slots(5), prompts)
    for i, p in prompts.items():
        alone = decode_logits(engine.init_slots(1), {0: p})
        assert torch.equal(together[i], alone[0]), i


def test_without_the_kernel_everything_is_dequantized_and_the_answer_is_the_same(model):
    """STRATA_CPU_PACKED=0 (in a fresh process: the kernel's availability is decided once)."""
    path, tokens, _ = model
    code = f"""
import torch
from tests.test_packed_engine import decode, make_engine
engine, log = make_engine({str(path)!r}, kernels="torch")
assert all(isinstance(w, torch.Tensor) for layer in engine.weights.layers.values() for w in layer.values())
assert isinstance(engine.weights.lm_head, torch.Tensor)
assert not [line for line in log if line.startswith("weights kept")]
torch.save(decode(engine, {tokens!r}), {str(path.parent / "plain.pt")!r})
"""
    run = subprocess.run([sys.executable, "-c", code], env={**__import__("os").environ, "STRATA_CPU_PACKED": "0"},
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    plain = torch.load(path.parent / "plain.pt")
    got = decode(make_engine(path, kernels="torch")[0], tokens)
    assert rel_err(got, plain) < 1e-5
    assert torch.equal(got.argmax(-1), plain.argmax(-1))
