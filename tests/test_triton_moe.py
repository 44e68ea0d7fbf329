"""Triton MoE kernels against the torch reference (`route`, `routed_experts`, `moe`) under the Triton
interpreter, on small odd sizes; and each row's output bitwise the same alone or among 33 rows."""

import os
from dataclasses import replace

os.environ["TRITON_INTERPRET"] = "1"  # before triton or strata.kernels are imported

import pytest
import torch
import torch.nn.functional as F
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

if not isinstance(tl.sum, InterpretedFunction):
    pytest.skip("triton was imported (by an earlier test module) before TRITON_INTERPRET=1 was set: "
                "set it in tests/conftest.py or the environment", allow_module_level=True)

import strata.kernels.moe as moe_module  # noqa: E402
from strata.kernels.moe import (DECODE_TILES, PROMPT_TILES, combine_triton, expert_tiles, expert_tiles_sorted,  # noqa: E402
                                fused_experts_triton, moe, moe_triton, route, route_triton, routed_experts)

HIDDEN, EXPERTS, INTER, SHARED = 40, 8, 24, 28
ROWS = [1, 3, 7, 33]
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=1e-2, atol=1e-2)}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16}


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def make_weights(dtype, seed=0):
    """router [E, H], gate_up [E, 2I, H], down [E, H, I], shared ([2S, H], [H, S]), shared_gate [1, H]."""
    g = _gen(seed)

    def rand(*shape):
        return (torch.randn(*shape, generator=g) / shape[-1] ** 0.5).to(dtype)

    return dict(router=rand(EXPERTS, HIDDEN), gate_up=rand(EXPERTS, 2 * INTER, HIDDEN), down=rand(EXPERTS, HIDDEN, INTER),
                shared=(rand(2 * SHARED, HIDDEN), rand(HIDDEN, SHARED)), shared_gate=rand(1, HIDDEN))


def make_x(rows, dtype, seed=1):
    return torch.randn(rows, HIDDEN, generator=_gen(seed)).to(dtype)


def routing(rows, top_k, seed=2, experts=EXPERTS - 2):
    """Random distinct experts per row among the first `experts` (the last ones unused), random weights."""
    g = _gen(seed)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(rows)])  # [R, k]
    weights = torch.rand(rows, top_k, generator=g)  # [R, k]
    return weights, ids


@pytest.mark.parametrize("norm_topk", [True, False], ids=["norm", "raw"])
@pytest.mark.parametrize("experts, top_k", [(8, 2), (8, 3), (60, 5), (512, 8)], ids=lambda v: str(v))
@pytest.mark.parametrize("rows", [1, 7, 33], ids=lambda r: f"R={r}")
def test_route_matches_reference(rows, experts, top_k, norm_topk):
    logits = torch.randn(rows, experts, generator=_gen(rows + experts))  # distinct values
    weights, ids = route_triton(logits, top_k, norm_topk)
    ref_weights, ref_ids = route(logits, torch.eye(experts), top_k, norm_topk)  # identity router: logits through
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert torch.equal(ids.long(), ref_ids)
    torch.testing.assert_close(weights, ref_weights, rtol=1e-6, atol=1e-6)


def test_route_ties_pick_lowest_expert():
    logits = torch.tensor([[0.0, 1.0, 1.0, 0.5, 1.0]])
    _, ids = route_triton(logits, 3, True)
    assert ids.tolist() == [[1, 2, 4]]


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("top_k", [2, 3], ids=lambda k: f"k={k}")
@pytest.mark.parametrize("rows", ROWS, ids=lambda r: f"R={r}-H={HIDDEN}-E={EXPERTS}-I={INTER}")
def test_fused_experts_match_reference(rows, top_k, dtype):
    w = make_weights(dtype)
    x = make_x(rows, dtype)
    weights, ids = routing(rows, top_k)
    out = fused_experts_triton(x, weights.to(dtype), ids, w["gate_up"], w["down"])
    ref = routed_experts(x.float(), weights.to(dtype).float(), ids, w["gate_up"].float(), w["down"].float())
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref, **TOL[dtype])


@pytest.mark.parametrize("rows, top_k, experts, bm", [(1, 8, 128, 16), (7, 3, 8, 16), (33, 2, 8, 16), (64, 10, 512, 16),
                                                      (70, 3, 8, 64), (5, 4, 16, 128), (120, 10, 512, 16)], ids=str)
def test_expert_tiles_kernel_lays_pairs_out_like_the_sort(rows, top_k, experts, bm, monkeypatch):
    """Decode windows lay the pairs out with one program, prompt windows with three kernels over chunks of the
    pairs (here chunks of 1,024 and of 32): the layout of the device sort (`expert_tiles_sorted`), so a row's
    bits do not depend on which one ran. Ids >= E (experts held elsewhere) are left out by all."""
    g = _gen(rows + experts)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(rows)]).int()  # [R, k]
    ids[0, 0] = experts  # one pair whose expert is not held here
    want = expert_tiles_sorted(ids, experts, bm)
    n = want[0].numel() - 1  # the last slot is a spare that no tile reads
    layouts = {"one program": expert_tiles(ids, experts, bm)}
    monkeypatch.setattr(moe_module, "SMALL_P", 0)
    layouts["chunks of 1,024"] = expert_tiles(ids, experts, bm)
    monkeypatch.setattr(moe_module, "LAYOUT_CHUNK", 32)
    layouts["chunks of 32"] = expert_tiles(ids, experts, bm)
    for name, (pair_of_slot, expert_of_block, used) in layouts.items():
        assert torch.equal(pair_of_slot[:n], want[0][:n]), name
        assert torch.equal(expert_of_block, want[1]), name
        assert used.item() == int((want[1] < experts).sum()), name


def test_route_keeps_ids_in_range_on_nan_logits():
    logits = torch.randn(3, 8, generator=_gen(4))
    logits[1] = float("nan")  # a broken row must not send the expert kernels outside their weights
    _, ids = route_triton(logits, 2, True)
    assert ids.min() >= 0 and ids.max() < 8
    assert torch.equal(ids[[0, 2]].long(), route(logits[[0, 2]], torch.eye(8), 2, True)[1])


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("rows", [5, 70], ids=lambda r: f"R={r}")
def test_fused_experts_prompt_tiles_match_reference(rows, dtype):
    """Prompt windows' tiles (128 pairs x 128 columns): tiles partly filled, several per expert at R=70. Their
    pair outputs are rounded to the activations' dtype (half the bytes of float32); decode windows keep float32."""
    w = make_weights(dtype)
    x = make_x(rows, dtype)
    weights, ids = routing(rows, 3)
    out = fused_experts_triton(x, weights.to(dtype), ids, w["gate_up"], w["down"], PROMPT_TILES)
    ref = routed_experts(x.float(), weights.to(dtype).float(), ids, w["gate_up"].float(), w["down"].float())
    torch.testing.assert_close(out.float(), ref, **TOL[dtype])
    pairs = fused_experts_triton(x, weights.to(dtype), ids, w["gate_up"], w["down"], PROMPT_TILES, defer=True)
    assert pairs.y.dtype == dtype and torch.equal(combine_triton(pairs), out)
    assert fused_experts_triton(x, weights.to(dtype), ids, w["gate_up"], w["down"], defer=True).y.dtype == torch.float32
    full = moe_triton(x, top_k=2, norm_topk=True, tiles=PROMPT_TILES, **make_weights(dtype))
    torch.testing.assert_close(full.float(), moe(x.float(), top_k=2, norm_topk=True,
                                                 **{k: _float(v) for k, v in make_weights(dtype).items()}), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_fused_experts_all_rows_one_expert(dtype):
    w = make_weights(dtype)
    x = make_x(33, dtype)  # 33 pairs of expert 5: three tiles, the last one partly filled
    ids = torch.full((33, 1), 5, dtype=torch.int32)
    weights = torch.rand(33, 1, generator=_gen(3))
    out = fused_experts_triton(x, weights, ids, w["gate_up"], w["down"])
    ref = routed_experts(x.float(), weights, ids.long(), w["gate_up"].float(), w["down"].float())
    torch.testing.assert_close(out.float(), ref, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("top_k", [2, 3], ids=lambda k: f"k={k}")
def test_fused_experts_rows_are_bitwise_independent(top_k, dtype):
    w = make_weights(dtype)
    x = make_x(33, dtype)
    weights, ids = routing(33, top_k)
    batched = fused_experts_triton(x, weights, ids, w["gate_up"], w["down"])
    for i in [0, 5, 17, 32]:
        alone = fused_experts_triton(x[i : i + 1], weights[i : i + 1], ids[i : i + 1], w["gate_up"], w["down"])
        assert torch.equal(alone[0], batched[i]), f"row {i}"


@pytest.mark.parametrize("gated", [False, True], ids=["shared", "shared+gate"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("rows", [1, 7], ids=lambda r: f"R={r}-H={HIDDEN}-E={EXPERTS}-k=2-I={INTER}-S={SHARED}")
def test_moe_matches_reference(rows, dtype, gated):
    w = make_weights(dtype)
    if not gated:
        del w["shared_gate"]
    x = make_x(rows, dtype)
    out = moe_triton(x, top_k=2, norm_topk=True, **w)
    ref = moe(x.float(), top_k=2, norm_topk=True, **{k: _float(v) for k, v in w.items()})
    torch.testing.assert_close(out.float(), ref, **TOL[dtype])


def test_moe_without_shared_expert_and_with_own_linear():
    w = make_weights(torch.float32)
    x = make_x(3, torch.float32)
    calls = []

    def linear(a, b):
        calls.append(tuple(b.shape))
        return F.linear(a, b)

    out = moe_triton(x, w["router"], w["gate_up"], w["down"], top_k=3, norm_topk=False, linear=linear)
    torch.testing.assert_close(out, moe(x, w["router"], w["gate_up"], w["down"], top_k=3, norm_topk=False),
                               **TOL[torch.float32])
    assert calls == [(EXPERTS, HIDDEN)]


def _float(v):
    return tuple(t.float() for t in v) if isinstance(v, tuple) else v.float()


@pytest.mark.parametrize("tiles", ["decode", "prompt"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_fused_experts_skip_ids_past_the_experts_held(dtype, tiles):
    """Ids >= E (experts the CPU pool holds) add nothing and cost no tile: the result is the held pairs' sum, and
    each row keeps its bits whatever the other rows skip."""
    w = make_weights(dtype)
    x = make_x(33, dtype)
    weights, ids = routing(33, 3, experts=EXPERTS)
    ids[3] = torch.tensor([7, 5, 6])  # a row with nothing here
    skipped = ids >= 5  # experts 5, 6, 7 are "not here"; some rows skip everything
    ids_here = torch.where(skipped, torch.full_like(ids, 5), ids)
    t = PROMPT_TILES if tiles == "prompt" else DECODE_TILES
    gu, down = w["gate_up"][:5], w["down"][:5]
    out = fused_experts_triton(x, weights, ids_here.int(), gu, down, t)
    ref = routed_experts(x.float(), weights.masked_fill(skipped, 0.0), ids.clamp(max=4), gu.float(), down.float())
    torch.testing.assert_close(out.float(), ref, **TOL[dtype])
    torch.testing.assert_close(routed_experts(x.float(), weights, ids_here, gu.float(), down.float()), ref)
    assert torch.equal(out[skipped.all(1)], torch.zeros_like(out[skipped.all(1)]))
    for i in [0, 7, 32]:
        alone = fused_experts_triton(x[i : i + 1], weights[i : i + 1], ids_here[i : i + 1].int(), gu, down, t)
        assert torch.equal(alone[0], out[i]), f"row {i}"
    assert torch.equal(fused_experts_triton(x, weights, ids.int() * 0, gu[:0], down[:0]), torch.zeros_like(x))


@pytest.mark.parametrize("per_sm", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_persistent_expert_tiles_give_the_same_bits(dtype, per_sm):
    """Programs that walk the used tiles (ExpertTiles.persistent) compute every tile as one program per tile does:
    the same pair outputs bit for bit, whatever the number of programs (4 multiprocessors off the GPU: 4 or 8
    programs for some twenty tiles here, so each program takes several)."""
    w = make_weights(dtype)
    x = make_x(70, dtype)
    weights, ids = routing(70, 3)
    tiles = replace(PROMPT_TILES, block_m=32, block_n=16, block_k=16, down_n=16, persistent=0, down_persistent=0)
    want = fused_experts_triton(x, weights.to(dtype), ids, w["gate_up"], w["down"], tiles, defer=True)
    walked = replace(tiles, persistent=per_sm, down_persistent=None)  # both products walked
    got = fused_experts_triton(x, weights.to(dtype), ids, w["gate_up"], w["down"], walked, defer=True)
    assert torch.equal(got.y, want.y)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_weight_tiles_by_tensor_descriptors_give_the_same_bits(dtype):
    """Weight tiles read through tensor descriptors (ExpertTiles.tma): the same products as pointer loads, bit
    for bit, with column tiles that pass the end of an expert's rows (24 of 16 + 16; 40 of 3 x 16)."""
    w = make_weights(dtype)
    x = make_x(70, dtype)
    weights, ids = routing(70, 3)
    tiles = replace(PROMPT_TILES, block_m=32, block_n=16, block_k=16, down_n=16, persistent=0, down_persistent=0)
    want = fused_experts_triton(x, weights.to(dtype), ids, w["gate_up"], w["down"], tiles, defer=True)
    for t in (replace(tiles, tma=True), replace(tiles, tma=True, persistent=2, down_persistent=1)):
        got = fused_experts_triton(x, weights.to(dtype), ids, w["gate_up"], w["down"], t, defer=True)
        assert torch.equal(got.y, want.y)


def test_weights_the_descriptors_cannot_take_are_read_by_pointers():
    """Expert weights at an address a tensor descriptor refuses (not 16-byte aligned): the prompt tiles read them
    with pointer loads, with the same results as aligned copies of the same values."""
    w = make_weights(torch.float16)
    x = make_x(70, torch.float16)
    weights, ids = routing(70, 3)
    buffers = [torch.empty(t.numel() + 1, dtype=t.dtype) for t in (w["gate_up"], w["down"])]
    gate_up, down = (b[1:].view(t.shape).copy_(t) for b, t in zip(buffers, (w["gate_up"], w["down"])))
    assert gate_up.data_ptr() % 16 and down.data_ptr() % 16
    want = fused_experts_triton(x, weights.half(), ids, w["gate_up"], w["down"], PROMPT_TILES, defer=True)
    got = fused_experts_triton(x, weights.half(), ids, gate_up, down, PROMPT_TILES, defer=True)
    assert torch.equal(got.y, want.y)


@pytest.mark.parametrize("rows", [1, 5, 33], ids=lambda r: f"R={r}")
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_handoff_launch_gives_the_same_bits(rows, dtype):
    """gate_up and down in one launch (ExpertTiles.handoff: each down program waits for its pair tile's gate_up
    tiles to be counted done) compute every pair as the two launches do, bit for bit: routed pairs, a shared
    pair, ids past the experts held, and a column count that leaves the last tile partly filled."""
    w = make_weights(dtype)
    x = make_x(rows, dtype)
    weights, ids = routing(rows, 3, experts=EXPERTS)
    ids[0, 0] = EXPERTS  # the shared pair's id on row 0
    ids[-1, 1] = EXPERTS + 1  # not held here
    tiles = replace(DECODE_TILES, block_n=16, block_k=16, down_n=16, handoff=False)
    shared = (w["gate_up"][0], w["down"][0])
    want = fused_experts_triton(x, weights.to(dtype), ids.int(), w["gate_up"], w["down"], tiles, defer=True,
                                shared=shared)
    got = fused_experts_triton(x, weights.to(dtype), ids.int(), w["gate_up"], w["down"], replace(tiles, handoff=True),
                               defer=True, shared=shared)
    held = ids.reshape(-1) <= EXPERTS  # a pair not held here is never written (and never read)
    assert torch.equal(got.y[held], want.y[held])
    assert DECODE_TILES.handoff and not PROMPT_TILES.handoff


@pytest.mark.parametrize("shared", [None, "plain", "gated"])
@pytest.mark.parametrize("rows", [1, 3], ids=lambda r: f"R={r}")
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_routing_program_lays_out_the_tiles_as_the_layout_kernel(rows, dtype, shared):
    """route_triton(layout=...): one program routes the rows in turn and lays their pairs out. Its weights and ids
    are the per-row programs' bit for bit, its tiles `expert_tiles`' (with zeroed handoff counters), and the
    experts computed from them give the same bits."""
    w = make_weights(dtype)
    x = make_x(rows, dtype)
    logits = F.linear(x, w["router"])
    gate = w["shared_gate"] if shared == "gated" else None
    want_w, want_ids = route_triton(logits, 3, True, shared, x, gate)
    bm = DECODE_TILES.block_m
    got_w, got_ids, tiles = route_triton(logits, 3, True, shared, x, gate, layout=(bm, True))
    assert torch.equal(got_w, want_w) and torch.equal(got_ids, want_ids)
    held = EXPERTS + (shared is not None)
    for got, want in zip(tiles[:3], expert_tiles(want_ids, held, bm)):
        assert torch.equal(got, want)
    assert torch.equal(tiles[3], torch.zeros_like(tiles[3]))
    if shared is not None:
        sh = (w["gate_up"][1], w["down"][1])  # any expert-shaped pair stands in for the shared one
        args = (x, want_w.to(dtype), want_ids, w["gate_up"], w["down"], DECODE_TILES)
        a = fused_experts_triton(*args, defer=True, shared=sh)
        b = fused_experts_triton(*args, defer=True, shared=sh, layout=tiles)
        assert torch.equal(a.y, b.y)
    full = moe_triton(x, top_k=3, norm_topk=True, **w)  # 1 row: the routing program's layout inside
    ref = moe(x.float(), top_k=3, norm_topk=True, **{k: _float(v) for k, v in w.items()})
    torch.testing.assert_close(full.float(), ref, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_one_row_tiles_differ_from_the_decode_tiles_in_stages_alone(dtype):
    """A one-row window's expert tiles (`decode_tiles(1)`) differ from the other decode windows' in pipeline stages
    only, which do not enter the arithmetic: the same bits as DECODE_TILES."""
    assert replace(moe_module.decode_tiles(1), num_stages=DECODE_TILES.num_stages) == DECODE_TILES
    assert moe_module.decode_tiles(1).num_stages == moe_module.ONE_ROW_STAGES
    assert moe_module.decode_tiles(8) == DECODE_TILES
    w = make_weights(dtype)
    x = make_x(1, dtype)
    a = moe_triton(x, top_k=3, norm_topk=True, tiles=moe_module.decode_tiles(1), **w)
    b = moe_triton(x, top_k=3, norm_topk=True, **w)
    assert torch.equal(a, b)
