"""Checkpoints with a `quantization_config`: FP8 block-scaled weights (written here by quantizing a tiny model's
linear weights to float8 e4m3 in blocks, as published FP8 checkpoints are laid out) give the tokens and logits of
`transformers` reading the FP8 file with its own dequantization (`FineGrainedFP8Config(dequantize=True)`), or, for
blocks it refuses (partial ones at the edges), running weights dequantized by this file's own arithmetic (never
Strata's); other methods are refused naming them, exit 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from strata.errors import CheckpointError
from strata.model.checkpoint import open_checkpoint
from strata.model.loader import ModelFiles
from strata.model.quantization import Fp8Blocks, read_quantization
from strata.runtime.generate import Engine
from tests.tiny_models import VOCAB, build

FP8_MAX = 448.0  # the largest finite float8 e4m3fn
PROMPT = [(i * 37 + 11) % VOCAB for i in range(40)]
NEW = 12


def quantized(name: str, t: torch.Tensor) -> bool:
    """The tensors FP8 checkpoints quantize: linear layers' weights; not embeddings, norms, routers, the head."""
    return (t.dim() == 2 and name.endswith(".weight") and "embed" not in name and "lm_head" not in name
            and "norm" not in name and not name.endswith("mlp.gate.weight"))


def fp8_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """w [O, I] -> (float8 e4m3 [O, I], scale_inv [ceil(O/bo), ceil(I/bi)] float32), one scale a block."""
    bo, bi = block
    rows, cols = w.shape
    scales = torch.empty(-(-rows // bo), -(-cols // bi))
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            part = w[i * bo : (i + 1) * bo, j * bi : (j + 1) * bi].float()
            s = max(float(part.abs().max()) / FP8_MAX, 1e-12)
            scales[i, j] = s
            q[i * bo : (i + 1) * bo, j * bi : (j + 1) * bi] = (part / s).to(torch.float8_e4m3fn)
    return q, scales


def block_dequantize(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The float values of an FP8 weight: each block's codes times its scale (written here, not Strata's code)."""
    rows, cols = q.shape
    scales = scale_inv.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return q.float() * scales


def write_fp8(folder, block: tuple[int, int]) -> dict[str, torch.Tensor]:
    """Rewrite the folder's weights as an FP8 block-scaled checkpoint; returns the dequantized state dict."""
    files = sorted(folder.glob("*.safetensors"))
    assert len(files) == 1
    tensors = load_file(files[0])
    out, dequantized = {}, {}
    for name, t in tensors.items():
        if quantized(name, t):
            q, s = fp8_blocks(t, block)
            out[name], out[f"{name}_scale_inv"] = q, s
            dequantized[name] = block_dequantize(q, s, block)
        else:
            out[name] = dequantized[name] = t
    save_file(out, files[0], metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block)}
    (folder / "config.json").write_text(json.dumps(config))
    return dequantized


# blocks that divide the tiny shapes, and blocks that leave partial ones at the edges
@pytest.fixture(scope="module", params=[("llama-gqa-tied", (32, 32)), ("qwen3_moe-gqa4", (16, 24))],
                ids=["llama-32x32", "qwen3_moe-16x24"])
def fp8_model(request, tmp_path_factory):
    case, block = request.param
    import shutil

    import transformers

    folder, twin = tmp_path_factory.mktemp(case), tmp_path_factory.mktemp(f"{case}-dequantized")
    build(case, folder)
    plain = load_file(next(folder.glob("*.safetensors")))
    dequantized = write_fp8(folder, block)
    # the float reference of the FP8 checkpoint: its dequantized weights under the same names, read by transformers
    shutil.copy(folder / "config.json", twin / "config.json")
    config = json.loads((twin / "config.json").read_text())
    del config["quantization_config"]
    (twin / "config.json").write_text(json.dumps(config))
    save_file(dequantized, twin / "model.safetensors", metadata={"format": "pt"})
    if case.startswith("llama"):  # blocks that divide every weight: transformers dequantizes the FP8 file itself
        ref = transformers.AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch.float32, quantization_config=transformers.FineGrainedFP8Config(dequantize=True)).eval()
        theirs = ref.state_dict()
        assert all(torch.equal(theirs[name].float(), w.float()) for name, w in dequantized.items() if name in theirs)
    else:  # partial blocks at the edges, which transformers' dequantizer refuses: the values computed above
        ref = transformers.AutoModelForCausalLM.from_pretrained(twin, dtype=torch.float32).eval()
    ref.generation_config.eos_token_id = None
    return folder, ref, plain, twin


def test_fp8_weights_are_read_as_their_dequantized_values(fp8_model):
    folder, ref, plain, _ = fp8_model
    engine = Engine(ModelFiles.open(folder), max_cells=128)
    ours = engine.generate(PROMPT, NEW, stop_ids=frozenset()).ids
    with torch.no_grad():
        theirs = ref.generate(input_ids=torch.tensor([PROMPT]), attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
                              max_new_tokens=NEW, do_sample=False)[0, len(PROMPT):].tolist()
        want = ref(input_ids=torch.tensor([PROMPT + ours])).logits[0].float()
    assert ours == theirs
    state = engine.new_state()
    got = torch.cat([engine.run(state, PROMPT, all_logits=True)] + [engine.run(state, [t]) for t in ours[:-1]])
    assert float((got - want[:-1]).abs().max() / want.abs().max()) < 1e-4
    # the quantization is real: the float8 weights are not the original ones, and the scales matter
    ckpt = open_checkpoint(folder)
    name = "model.layers.0.self_attn.o_proj.weight"
    raw = load_file(next(folder.glob("*.safetensors")))[name]
    assert raw.dtype == torch.float8_e4m3fn
    assert not torch.equal(ckpt.load(name), raw.float())
    assert not torch.equal(ckpt.load(name), plain[name])


def test_autoconfig_counts_an_fp8_checkpoint_at_its_dequantized_size(fp8_model):
    """The engine holds FP8 weights dequantized (bfloat16 by default): autoconfig's facts equal the twin's."""
    from autoconfig.facts import read_model

    folder, _, _, twin = fp8_model
    fp8, plain = read_model(folder), read_model(twin)
    assert (fp8.expert_bytes, fp8.dense_bytes, fp8.embed_bytes, fp8.head_bytes) == \
        (plain.expert_bytes, plain.dense_bytes, plain.embed_bytes, plain.head_bytes)


def test_a_scale_of_the_wrong_shape_is_refused_naming_the_tensor():
    with pytest.raises(CheckpointError, match=r"w_scale_inv: shape \(2, 2\), expected \(2, 3\)"):
        Fp8Blocks((16, 16)).dequantize(torch.zeros(32, 40).to(torch.float8_e4m3fn), torch.ones(2, 2), "w")


@pytest.mark.parametrize("q, needle", [
    ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq' is not supported"),
    ({"quant_method": "awq"}, "quant_method 'awq'"),
    ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes'"),
    ({"quant_method": "fp8", "activation_scheme": "static"}, "without weight_block_size"),
    ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, "format 'e5m2'"),
])
def test_unsupported_quantization_is_refused_by_name(q, needle):
    with pytest.raises(CheckpointError, match=needle):
        read_quantization({"quantization_config": q}, "config.json")
    assert read_quantization({}, "config.json") is None


def test_a_gptq_checkpoint_exits_2_naming_the_method(tmp_path):
    build("llama-gqa-tied", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128}
    (tmp_path / "config.json").write_text(json.dumps(config))
    run = subprocess.run([sys.executable, "-m", "strata.cli", "generate", "--model", str(tmp_path), "--prompt-ids",
                          "1,2,3", "--max-tokens", "2"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr
    assert "gptq" in run.stderr and "config.json" in run.stderr
