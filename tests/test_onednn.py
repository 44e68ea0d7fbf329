"""oneDNN's blocked weights for the CPU stage's products (strata/kernels/onednn.py): the same products as F.linear,
row-invariant, and what a CPU engine loaded from a checkpoint holds."""

import pytest
import torch
import torch.nn.functional as F

from strata.kernels import onednn
from strata.kernels.invariant import in_row_blocks
from strata.kernels.packed import project
from strata.model.weights import StageWeights

pytestmark = pytest.mark.skipif(not onednn.available(torch.float32), reason="this torch is built without oneDNN")
DTYPES = [torch.float32] + ([torch.bfloat16] if onednn.available(torch.bfloat16) else [])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 8, 37])
def test_a_blocked_product_is_f_linear(dtype, rows):
    torch.manual_seed(rows)
    w = torch.randn(200, 96, dtype=dtype) * 0.1
    bias = torch.randn(200, dtype=dtype)
    x = torch.randn(rows, 96, dtype=dtype)
    blocked = onednn.block(w)
    assert blocked.is_mkldnn and blocked.shape == w.shape and blocked.dtype == dtype
    assert torch.equal(onednn.dense(blocked), w)  # the layout changes, not the values
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(project(x, blocked), F.linear(x, w), **tol)
    torch.testing.assert_close(project(x, blocked, bias), F.linear(x, w, bias), **tol)
    # non-contiguous rows (a view of a wider tensor) and a leading dimension
    wide = torch.randn(rows, 2, 96, dtype=dtype)[:, 1]
    torch.testing.assert_close(project(wide, blocked), F.linear(wide, w), **tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_is_the_same_beside_any_rows_in_decode_blocks(dtype):
    """The decode windows' property: a row's bits do not depend on the window's other rows or its place."""
    torch.manual_seed(0)
    w = onednn.block(torch.randn(300, 128, dtype=dtype) * 0.1)
    row = torch.randn(1, 128, dtype=dtype)
    alone = in_row_blocks(project, row, w)
    for others in (3, 7, 12):
        window = torch.randn(others + 1, 128, dtype=dtype)
        place = others // 2
        window[place] = row[0]
        assert torch.equal(in_row_blocks(project, window, w)[place], alone[0])


def test_block_stage_reorders_projections_and_leaves_the_rest():
    torch.manual_seed(0)
    embed = torch.randn(50, 16)
    layer = {"qkv": torch.randn(48, 16), "o": torch.randn(16, 16), "gate_up": torch.randn(64, 16),
             "down": torch.randn(16, 32), "router": torch.randn(4, 16), "attn_norm": torch.randn(16),
             "experts_gate_up": torch.randn(4, 8, 16), "other_dtype": torch.randn(8, 16, dtype=torch.float64)}
    plain = {k: v.clone() for k, v in layer.items()}
    weights = StageWeights(layers={0: layer}, embed=embed, final_norm=torch.ones(16), lm_head=embed)
    before = weights.nbytes()
    done = onednn.block_stage(weights, torch.float32)
    assert done == sum(plain[k].numel() * 4 for k in ("qkv", "o", "gate_up", "down")) + embed.numel() * 4
    for k in ("qkv", "o", "gate_up", "down"):
        assert layer[k].is_mkldnn and torch.equal(onednn.dense(layer[k]), plain[k])
    for k in ("router", "attn_norm", "experts_gate_up", "other_dtype"):  # read by F.linear / elementwise / indexed
        assert not layer[k].is_mkldnn and torch.equal(layer[k], plain[k])
    # a tied head gets a blocked copy of its own: the embedding's lookups still read the plain table
    assert weights.lm_head.is_mkldnn and not weights.embed.is_mkldnn and torch.equal(onednn.dense(weights.lm_head), embed)
    assert weights.nbytes() == before + embed.numel() * 4  # the head's copy counted, nothing failed on data_ptr
    assert onednn.block_stage(weights, torch.float32) == 0  # already blocked: nothing more


def test_the_cpu_engine_holds_blocked_projections(tmp_path):
    """A float checkpoint on the CPU's torch kernels: projections and head blocked (a quantized one's packed matrices
    go to the CPU's own kernel instead: tests/test_cpu_packed_engine.py); tiny models' answers are checked against
    transformers elsewhere (test_engine.py), so they run on these."""
    from strata.model.loader import ModelFiles
    from strata.runtime.generate import Engine
    from tests.tiny_models import build

    build("llama-gqa-tied", tmp_path)
    w = Engine(ModelFiles.open(tmp_path), max_cells=64).stages[0].weights
    assert w.layers[0]["qkv"].is_mkldnn and w.layers[0]["down"].is_mkldnn and w.lm_head.is_mkldnn
    assert not w.embed.is_mkldnn and not w.layers[0]["attn_norm"].is_mkldnn
    assert torch.equal(onednn.dense(w.lm_head), w.embed)  # a tied head: a blocked copy of the embedding
