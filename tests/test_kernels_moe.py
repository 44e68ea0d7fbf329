"""MoE reference against transformers' Qwen3-MoE and Qwen3-Next sparse blocks (weights copied into our
layout), on odd sizes; and each row's routed output independent of the rows batched with it."""

import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3NextConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock

from strata.kernels.moe import moe, route, routed_experts

TOL = dict(rtol=1e-5, atol=1e-5)
HIDDEN, EXPERTS, TOP_K, INTER, SHARED = 40, 6, 2, 24, 28
ROWS = [1, 7, 33]
SIZES = dict(hidden_size=HIDDEN, num_experts=EXPERTS, num_experts_per_tok=TOP_K, moe_intermediate_size=INTER)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # CPU index_add_ (ours and transformers') costs ~20 ms a call on a busy 2-core box with 2 threads, ~5 us with one.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _id(rows):
    return f"R={rows}-H={HIDDEN}-E={EXPERTS}-k={TOP_K}-I={INTER}"


@torch.no_grad()
def randomize(block, seed=0):
    gen = torch.Generator().manual_seed(seed)
    for p in block.parameters():
        p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    return block.eval()


def qwen3_moe_block(norm_topk):
    config = Qwen3MoeConfig(**SIZES, norm_topk_prob=norm_topk)
    config._experts_implementation = "eager"
    return randomize(Qwen3MoeSparseMoeBlock(config))


def qwen3_next_block():
    config = Qwen3NextConfig(**SIZES, shared_expert_intermediate_size=SHARED, norm_topk_prob=True)
    config._experts_implementation = "eager"
    return randomize(Qwen3NextSparseMoeBlock(config))


def our_weights(block):
    """The block's weights in our layout: router [E, H], gate_up [E, 2I, H] (gate rows then up), down [E, H, I]."""
    weights = dict(router=block.gate.weight, gate_up=block.experts.gate_up_proj, down=block.experts.down_proj)
    if hasattr(block, "shared_expert"):
        s = block.shared_expert
        weights["shared"] = (torch.cat([s.gate_proj.weight, s.up_proj.weight]), s.down_proj.weight)  # [2S, H], [H, S]
        weights["shared_gate"] = block.shared_expert_gate.weight  # [1, H]
    return weights


def make_x(rows, seed=1):
    return torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("norm_topk", [True, False], ids=["norm_topk", "raw_topk"])
@pytest.mark.parametrize("rows", ROWS, ids=_id)
@torch.no_grad()
def test_moe_matches_qwen3_moe_block(rows, norm_topk):
    block = qwen3_moe_block(norm_topk)
    x = make_x(rows)
    out = moe(x, top_k=TOP_K, norm_topk=norm_topk, **our_weights(block))
    torch.testing.assert_close(out, block(x[None])[0], **TOL)


@pytest.mark.parametrize("rows", ROWS, ids=lambda r: _id(r) + f"-S={SHARED}")
@torch.no_grad()
def test_moe_matches_qwen3_next_block_with_gated_shared_expert(rows):
    block = qwen3_next_block()
    x = make_x(rows)
    out = moe(x, top_k=TOP_K, norm_topk=True, **our_weights(block))
    torch.testing.assert_close(out, block(x[None])[0], **TOL)


@torch.no_grad()
def test_gate_up_is_gate_rows_then_up_rows():
    # Our layout is read straight from transformers' fused gate_up_proj: check it is [gate; up], not interleaved.
    block = qwen3_moe_block(norm_topk=True)
    x = make_x(5)
    w = block.experts.gate_up_proj[0]
    expected = block.experts.down_proj[0] @ (torch.nn.functional.silu(x @ w[:INTER].T) * (x @ w[INTER:].T)).T
    ids = torch.zeros(5, 1, dtype=torch.long)
    out = routed_experts(x, torch.ones(5, 1), ids, block.experts.gate_up_proj, block.experts.down_proj)
    torch.testing.assert_close(out, expected.T, **TOL)
    torch.testing.assert_close(block.experts(x, ids, torch.ones(5, 1)), expected.T, **TOL)


@pytest.mark.parametrize("norm_topk", [True, False], ids=["norm_topk", "raw_topk"])
@torch.no_grad()
def test_routed_experts_rows_are_independent(norm_topk):
    w = our_weights(qwen3_moe_block(norm_topk))
    x = make_x(33)
    weights, ids = route(x, w["router"], TOP_K, norm_topk)
    batched = routed_experts(x, weights, ids, w["gate_up"], w["down"])
    for i in range(len(x)):
        alone = routed_experts(x[i : i + 1], weights[i : i + 1], ids[i : i + 1], w["gate_up"], w["down"])
        torch.testing.assert_close(alone[0], batched[i], rtol=1e-6, atol=1e-6)
