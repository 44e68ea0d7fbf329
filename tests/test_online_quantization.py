"""`--quantization FMT`: a float checkpoint's matrices quantized as they load (`strata.quant.online`).

The same quantized values on every path: the torch path (which writes them out in the compute dtype) gives, bit for
bit, the logits of a checkpoint whose matrices were replaced by their dequantized quantization, and that checkpoint
under `transformers` agrees; the Triton kernels (under the interpreter) keep them packed and decode the same greedy
tokens. A checkpoint stored quantized is refused, through the CLI with exit 2, before anything loads."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from strata.errors import CheckpointError  # noqa: E402
from strata.model.loader import ModelFiles  # noqa: E402
from strata.quant.online import quantize_weight  # noqa: E402
from strata.quant.packed import PackedWeight, dequantize, row_bytes  # noqa: E402
from strata.runtime.generate import Engine  # noqa: E402
from tests.tiny_models import VOCAB, build  # noqa: E402

SIZES = dict(hidden_size=256, intermediate_size=256, moe_intermediate_size=256, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, num_hidden_layers=1, num_experts=4, num_experts_per_tok=2)
PROMPT = [(i * 29 + 5) % VOCAB for i in range(8)]


def is_matrix(name: str) -> bool:
    """The tensors the loader reads as matrices (projections, experts, head): what --quantization quantizes."""
    return name.endswith("_proj.weight") or name == "lm_head.weight"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A tiny Qwen3-MoE checkpoint, and per format its twin whose matrices hold their quantized values."""
    base = tmp_path_factory.mktemp("float")
    build("qwen3_moe-gqa4", base, **SIZES)
    tensors = load_file(base / "model.safetensors")
    twins = {}
    for fmt in ("q4_k", "q8_0", "q5_k"):
        twin = tmp_path_factory.mktemp(fmt)
        for f in base.iterdir():
            if f.name != "model.safetensors":
                (twin / f.name).write_bytes(f.read_bytes())
        save_file({k: dequantize(quantize_weight(v.to(torch.float32), fmt, torch.float32)).to(v.dtype).contiguous()
                   if is_matrix(k) else v for k, v in tensors.items()}, twin / "model.safetensors")
        twins[fmt] = twin
    return base, twins


def logits(engine: Engine) -> torch.Tensor:
    state = engine.new_state()
    return engine.run(state, PROMPT, all_logits=True)


def greedy(engine: Engine, n: int = 4) -> list[int]:
    return engine.generate(PROMPT, n).ids


@pytest.mark.parametrize("fmt", ["q4_k", "q8_0", "q5_k"])  # q5_k: a format the CPU's kernel does not read (written out)
def test_torch_path_is_the_quantized_checkpoint(folders, fmt):
    base, twins = folders
    quantized = Engine(ModelFiles.open(base, fmt), dtype=torch.float32, kernels="torch", max_cells=64)
    twin = Engine(ModelFiles.open(twins[fmt]), dtype=torch.float32, kernels="torch", max_cells=64)
    plain = Engine(ModelFiles.open(base), dtype=torch.float32, kernels="torch", max_cells=64)
    got, want, original = logits(quantized), logits(twin), logits(plain)
    # the quantized matrices stay packed for the CPU's own kernel (its sums in another order than oneDNN's over the
    # twin's float weights): float32 rounding apart, the same answer
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    from strata.kernels import cpu_packed

    qkv = quantized.weights.layers[0]["qkv"]
    if fmt in cpu_packed.FORMATS and cpu_packed.available():
        assert isinstance(qkv, PackedWeight) and qkv.fmt == fmt and qkv.host_kernel
    else:  # its quantized values written out: the twin's weights, bit for bit
        assert isinstance(qkv, torch.Tensor)
        assert torch.equal(got, want)
    assert not torch.equal(got, original)  # the quantization did change the weights
    import transformers

    ref = transformers.AutoModelForCausalLM.from_pretrained(twins[fmt], torch_dtype=torch.float32).eval()
    with torch.no_grad():
        expect = ref(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(got, expect, rtol=1e-4, atol=1e-4)


def test_triton_kernels_keep_them_packed(folders):
    base, twins = folders
    packed = Engine(ModelFiles.open(base, "q8_0"), dtype=torch.float32, kernels="triton", max_cells=64,
                    cuda_graphs=False)
    kept = {k for k, w in packed.weights.layers[0].items() if isinstance(w, PackedWeight) and w.fmt == "q8_0"}
    assert {"qkv", "o"} <= kept and any("gate_up" in k for k in kept), kept
    assert isinstance(packed.weights.lm_head, PackedWeight)
    twin = Engine(ModelFiles.open(twins["q8_0"]), dtype=torch.float32, kernels="torch", max_cells=64)
    assert greedy(packed) == greedy(twin)


def test_a_stored_quantized_checkpoint_is_refused():
    from strata.model.loader import default_model_path

    with pytest.raises(CheckpointError, match=r"stored quantized already \(.*Q4_1"):
        ModelFiles.open("default", "q4_k")
    out = subprocess.run([sys.executable, "-m", "strata.cli", "generate", "--prompt", "hi", "--max-tokens", "1",
                          "--quantization", "q8_0"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr
    assert "--quantization q8_0" in out.stderr and str(default_model_path()) in out.stderr, out.stderr
    out = subprocess.run([sys.executable, "-m", "strata.cli", "generate", "--prompt", "hi", "--quantization", "q3"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "quantization" in out.stderr, out.stderr


def test_the_server_passes_it_to_its_engine():
    from serve.config import ServeSettings
    from serve.engine_client import engine_argv

    argv = engine_argv(ServeSettings(model="some/folder", quantization="q4_k"))
    assert argv[argv.index("--quantization") + 1] == "q4_k"


def test_autoconfig_counts_the_packed_sizes(folders):
    from autoconfig.facts import read_model

    base, _ = folders
    plain, quantized = read_model(str(base), packed=True), read_model(ModelFiles.open(base, "q4_k"), packed=True)
    # every expert matrix has K = 256: a q4_k row of 148 bytes padded to 16 (bf16: 512); the embedding stays
    assert row_bytes("q4_k", 256) == 160
    assert sum(quantized.expert_bytes) * 512 == sum(plain.expert_bytes) * 160
    assert quantized.embed_bytes == plain.embed_bytes
    out = subprocess.run([sys.executable, "-m", "autoconfig", "--model", str(base), "--quantization", "q4_k", "--json"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    proposal = json.loads(out.stdout)
    assert proposal["settings"]["quantization"] == "q4_k" and "quantization" in proposal["reasons"]


def test_an_expert_budget_counts_packed_experts_at_their_packed_size(folders):
    """A GPU stage that keeps q4_k experts packed fits as many in a budget as their packed bytes allow, the size
    autoconfig counts when it proposes the budget (it used to count them at bf16: 3.2x fewer resident)."""
    from autoconfig.facts import read_model
    from strata.experts.budget import check_expert_budget
    from strata.runtime.generate import packed_expert_bytes

    base, _ = folders
    files = ModelFiles.open(base, "q4_k")
    spec = files.spec
    size = packed_expert_bytes(files, torch.bfloat16, 2)
    moe_layers = [i for i, layer in enumerate(spec.layers) if layer.mlp == "moe"]
    per_layer = sum(read_model(files, packed=True).expert_bytes) // len(moe_layers)
    assert size * spec.moe.num_experts == per_layer  # the engine's expert is autoconfig's
    assert packed_expert_bytes(ModelFiles.open(base), torch.bfloat16, 2) is None  # float weights: nothing packed
    plan = [(range(spec.num_layers), torch.device("cuda"))]
    budget = 3 * size * len(moe_layers) / 1e9  # three packed experts a layer
    (packed,) = check_expert_budget(spec, plan, [budget], 2, host_available=10**12, packed_bytes=size)
    (plain,) = check_expert_budget(spec, plan, [budget], 2, host_available=10**12)
    assert packed.per_layer == 3 and plain.per_layer == 0
    assert packed.device_bytes == 3 * size * len(moe_layers)
    cpu = [(range(spec.num_layers), torch.device("cpu"))]  # a CPU stage reads its experts written out
    assert check_expert_budget(spec, cpu, [budget], 2, host_available=10**12, packed_bytes=size)[0].per_layer == 0
