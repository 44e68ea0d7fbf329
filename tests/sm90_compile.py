"""Compiles the engine's Triton kernels for an H100 / H200 (sm_90) on a machine without a GPU.

Triton's interpreter, which the CPU tests run the kernels under, does not type-check a kernel the way its compiler
does: a kernel can pass every interpreted test and still fail to compile on the GPU (a loop-carried variable whose
type changes, a name reused for a tensor of another shape). This compiles each decode kernel, and the prompt
windows' attention, GDN, tile layout and expert kernels (their pointer-load path), at the configurations the
engine launches for the Qwen3-30B-A3B and Qwen3-Next shapes, through Triton's own pipeline and
the `ptxas` it ships, and reports each one's registers, spill bytes and shared memory.

Arguments are typed as the just-in-time compiler specializes them at run time: pointers 16-byte aligned, integers
multiples of 16 except the ones a case names as plain (counts) or as 1 (unit strides). It needs triton's CUDA
backend files, not a GPU. Run as a script it prints one JSON object per kernel; `test_triton_compile.py` runs it in
a process of its own (the tests import triton under the interpreter, which replaces the compiler's kernels).

    python tests/sm90_compile.py        # every case
    python tests/sm90_compile.py 0/2    # every second case from the first (the test runs two such processes)
"""

from __future__ import annotations

import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

FLOATS = {"eps", "qk_scale"}  # float scalar arguments; other non-pointer, non-constexpr arguments are int32


def compile_sm90(kernel, constexprs: dict, pointers: dict[str, str] | None = None, plain: tuple[str, ...] = (),
                 ones: tuple[str, ...] = (), num_warps: int = 4, num_stages: int = 3) -> dict:
    """Compile `kernel` for sm_90 -> {"regs", "spill_bytes", "shared"}. pointers: argument -> element type ("bf16",
    "fp32", "i32"); the arguments a kernel takes as pointers are those named here or starting with "p_"; bf16
    unless named."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    pointers = pointers or {}
    params = list(inspect.signature(kernel.fn).parameters)
    unknown = set(constexprs) - set(params)
    assert not unknown, f"{kernel.fn.__name__} has no arguments {sorted(unknown)}"
    declared = {name for name, p in inspect.signature(kernel.fn).parameters.items() if "constexpr" in str(p.annotation)}
    missing = declared - set(constexprs) - set(ones)
    assert not missing, f"{kernel.fn.__name__}: the case gives no value for its constexprs {sorted(missing)}"
    signature, consts, attrs = {}, dict(constexprs), {}
    for i, name in enumerate(params):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in ones:
            signature[name] = "constexpr"
            consts[name] = 1
        elif name in pointers or name.startswith("p_"):
            signature[name] = "*" + pointers.get(name, "bf16")
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in FLOATS:
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
            if name not in plain:
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(kernel, signature, constexprs={(params.index(k),): v for k, v in consts.items()}, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=num_warps, num_stages=num_stages))
    return dict(_ptxas_usage(compiled.asm["ptx"]), shared=compiled.metadata.shared)


def _ptxas_usage(ptx: str) -> dict:
    import triton.backends.nvidia as nvidia

    ptxas = Path(nvidia.__file__).parent / "bin" / "ptxas"
    arch = re.search(r"\.target (sm_\w+)", ptx).group(1)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernel.ptx"
        src.write_text(ptx)
        out = subprocess.run([str(ptxas), f"-arch={arch}", "-v", str(src), "-o", os.devnull], capture_output=True,
                             text=True, check=True).stderr
    regs = re.search(r"Used (\d+) registers", out)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", out)
    return dict(regs=int(regs.group(1)), spill_bytes=int(spills.group(1)) + int(spills.group(2)))


def cases():
    """(label, "decode" or "prompt", kernel, compile_sm90 keyword arguments) for the kernels of the two shapes'
    decode and prompt windows."""
    import torch
    import triton
    import triton.language as tl

    from strata.kernels import attention, elementwise, gdn, linear, moe, qk_prep, rmsnorm, rope, sampling
    from strata.quant.packed import KERNEL_FORMAT

    pdl = dict(PDL=True)
    f32 = "fp32"
    out = []
    packed = {fmt: name for name, fmt in KERNEL_FORMAT.items()}  # each packed weight format's kernel variant
    for n, k_dim, partial, fmt in [(5120, 2048, True, 0), (128, 2048, True, 0), (151936, 2048, False, 0),
                                   *[(5120, 2048, True, f) for f in sorted(packed)], (151936, 2048, False, 3)]:
        bn, bk, stages = linear.CONFIGS[torch.bfloat16]
        label = f"linear_kernel [{n}, {k_dim}]" + (f" {packed[fmt]}" if fmt else "")
        out.append((label, linear.linear_kernel, dict(
            constexprs=dict(FMT=fmt, HAS_BIAS=False, PARTIAL=partial, INPUT_PRECISION="tf32",
                            BLOCK_M=linear.BLOCK_M, BLOCK_N=bn, BLOCK_K=bk, **pdl),
            pointers=dict(p_out=f32 if partial else "bf16", p_grid="i32", **({"p_w": "u8"} if fmt else {})), plain=("M",),
            ones=("stride_xk", "stride_wk"), num_warps=linear.NUM_WARPS, num_stages=stages)))
    out.append(("_sum_chunks_kernel", linear._sum_chunks_kernel, dict(
        constexprs=dict(SPLIT=4, HAS_BIAS=False, BLOCK=1024, **pdl), pointers=dict(p_part=f32))))
    layout = dict(BM=16, BLOCK_P=16, PAIR_BITS=4, BLOCK_S=1024, DONE=True)
    for experts, top, shared in [(128, 8, 0), (512, 10, 2)]:
        for lay in (False, True):
            out.append((f"_route_kernel E={experts}{' + layout' if lay else ''}", moe._route_kernel, dict(
                constexprs=dict(SPLIT=8, TY=tl.bfloat16, K_TOP=top, NORM_TOPK=True, SHARED=shared, BLOCK_E=experts,
                                BLOCK_TOP=16 if shared else 8, BLOCK_H=2048 if shared else 1, LAYOUT=lay, **layout,
                                **pdl),
                pointers=dict(p_logits=f32, p_weights=f32, p_ids="i32", p_pair="i32", p_expert="i32",
                              p_scratch="i32", p_used="i32", p_done="i32"),
                plain=("R", "E", "H", "NUM_SLOTS", "MAX_BLOCKS"), num_warps=moe.route_warps(experts))))
    out.append(("_expert_tiles_kernel", moe._expert_tiles_kernel, dict(
        constexprs=dict(BM=16, BLOCK_P=512, PAIR_BITS=9, BLOCK_S=1024, DONE=True, **pdl),
        pointers=dict(p_ids="i32", p_pair="i32", p_expert="i32", p_scratch="i32", p_used="i32", p_done="i32"),
        plain=("P", "E", "NUM_SLOTS", "MAX_BLOCKS"))))
    t = moe.DECODE_TILES
    expert_ptrs = dict(p_route=f32, p_y=f32, p_pair="i32", p_expert="i32", p_done="i32", p_used="i32")
    tiles = dict(BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, **pdl)
    packed_experts = dict(p_wgu="u8", p_sgu="u8", p_wd="u8", p_sd="u8")
    expert_ptrs = dict(expert_ptrs, p_grid="i32", p_ggu="i32", p_gd="i32")
    for shared, fmt, down_fmt in [(False, 0, 0), (True, 0, 0), *[(False, f, f) for f in sorted(packed)],
                                  (True, 3, 3), (False, 3, 5)]:  # the last: Q4_K_M's experts (q4_k, down q6_k)
        label = f"_experts_kernel (one launch){' shared pair' if shared else ''}" + (f" {packed[fmt]}" if fmt else "")
        label += f" down {packed[down_fmt]}" if down_fmt != fmt else ""
        out.append((label, moe._experts_kernel, dict(
            constexprs=dict(SHARED=shared, K_TOP=8, DOWN_N=t.down_n, DOWN_K=t.down_k or t.block_k, FMT=fmt,
                            DOWN_FMT=down_fmt, **tiles),
            pointers=dict(expert_ptrs, **(packed_experts if fmt else {})), plain=("P", "E", "GATE_UP_PROGRAMS"),
            ones=("s_guk", "s_dk"), num_warps=t.num_warps, num_stages=t.num_stages)))
    for fmt in (0, 3):
        suffix, weights = (f" {packed[fmt]}", dict(p_w="u8", p_sw="u8")) if fmt else ("", {})
        out.append(("_gate_up_kernel" + suffix, moe._gate_up_kernel, dict(
            constexprs=dict(SHARED=False, K_TOP=8, PERSISTENT=False, TMA=False, FMT=fmt, **tiles),
            pointers=dict(expert_ptrs, **weights), plain=("P", "E"), ones=("s_wk",), num_warps=t.num_warps,
            num_stages=t.num_stages)))
        out.append(("_down_kernel" + suffix, moe._down_kernel, dict(
            constexprs=dict(SHARED=False, PERSISTENT=False, TMA=False, FMT=fmt, **dict(tiles, BLOCK_N=t.down_n)),
            pointers=dict(expert_ptrs, **weights), plain=("P", "E"), ones=("s_wk",), num_warps=t.num_warps,
            num_stages=t.num_stages)))
    out.append(("_combine_kernel", moe._combine_kernel, dict(
        constexprs=dict(K_TOP=8, BLOCK_TOP=8, SHARED=0, SPLIT_S=0, SPLIT_G=0, BLOCK_N=t.combine_n, **pdl),
        pointers=dict(p_y=f32, p_ids="i32"), plain=("E",))))
    for h, hkv, d, rot in [(32, 4, 128, 128), (16, 2, 256, 64)]:
        out.append((f"_qk_prep_kernel D={d}", qk_prep._qk_prep_kernel, dict(
            constexprs=dict(SPLIT=2 if d == 128 else 0, QK_NORM=True, BLOCK_D=d, BLOCK_HALF=rot // 2,
                            BLOCK_PASS=triton.next_power_of_2(max(d - rot, 1)), HAS_PASS=rot < d, **pdl),
            pointers=dict(p_q=f32 if d == 128 else "bf16", p_k=f32 if d == 128 else "bf16",
                          p_v=f32 if d == 128 else "bf16", p_qn=f32, p_kn=f32, p_pos="i32", p_seq="i32",
                          p_inv_freq=f32),
            plain=("H", "HKV", "HALF"), num_warps=rmsnorm.norm_warps(d))))
        block_g, block_d, block_n = attention._decode_blocks(d, h // hkv)
        gate = d == 256  # Qwen3-Next's heads carry the output gate
        # one program per head, then the split (every decode window's: chunks merged by the last to finish) for
        # pools of 4,096, 8,192 and 262,144 cells (8 and 16 chunks merged from one tile, 512 a tile at a time)
        for cells in (None, 4096, 8192, 262144):
            split = cells is not None
            n_chunks = cells // attention.SPLIT_CELLS if split else 1
            out.append((f"_decode_kernel D={d}{' gated' if gate else ''}{f' split, {cells} cells' if split else ''}",
                        attention._decode_kernel, dict(
                constexprs=dict(G=h // hkv, D=d, BLOCK_G=block_g, BLOCK_D=block_d, BLOCK_N=block_n, SPLIT=split,
                                CHUNK_CELLS=attention.SPLIT_CELLS if split else block_n,
                                BLOCK_C=min(n_chunks, attention.ONE_TILE_CHUNKS) if split else 1,
                                ONE_TILE=n_chunks <= attention.ONE_TILE_CHUNKS,
                                MERGE=attention._merge_chunks(block_d, n_chunks) if split else 1,
                                DOT_PRECISION="tf32",
                                GATE=gate, **pdl),
                pointers={p: "bf16" for p in ("q", "k_pool", "v_pool", "out", "gate")} | dict(
                    acc_part=f32, m_part=f32, l_part=f32, arrivals="i32", seq_ids="i32", positions="i32"),
                ones=("s_qd", "s_kd", "s_vd", "s_od", "s_ad"))))
    norm_ptrs = dict(p_h=f32, p_ids="i32", p_w=f32)
    out.append(("_add_rms_norm_kernel (expert pairs)", rmsnorm._add_rms_norm_kernel, dict(
        constexprs=dict(PAIRS=True, SPLIT=0, K_TOP=8, BLOCK_TOP=8, SHARED=0, SPLIT_S=0, SPLIT_G=0, BLOCK=2048, **pdl),
        pointers=norm_ptrs, plain=("E",), num_warps=rmsnorm.add_norm_warps(2048, decode=True))))
    out.append(("_add_rms_norm_kernel (split-K chunks)", rmsnorm._add_rms_norm_kernel, dict(
        constexprs=dict(PAIRS=False, SPLIT=4, K_TOP=1, BLOCK_TOP=1, SHARED=0, SPLIT_S=0, SPLIT_G=0, BLOCK=2048,
                        **pdl),
        pointers=norm_ptrs, plain=("E",), num_warps=rmsnorm.add_norm_warps(2048, decode=True))))
    out.append(("_rms_norm_kernel gated [32, 128]", rmsnorm._rms_norm_kernel, dict(
        constexprs=dict(BLOCK=128, GATED=True, HEADS=1, **pdl), pointers=dict(p_w=f32),
        plain=("H",), num_warps=rmsnorm.norm_warps(128))))
    for keep in (False, True):  # keep: a drafting slot's rows leave their states in keep slots
        out.append((f"_conv_decode_kernel{' (keep slots)' if keep else ''}", gdn._conv_decode_kernel, dict(
            constexprs=dict(K=4, BLOCK_C=gdn.CONV_BLOCK_C, KEEP=keep, **pdl),
            pointers=dict(p_seq="i32", p_keep_idx="i32"), plain=("R",))))
    out.append(("_rec_decode_kernel (gates made inside)", gdn._rec_decode_kernel, dict(
        constexprs=dict(GROUP=2, DK=128, DV=128, KEY_DIM=2048, BLOCK_DK=128, BLOCK_DV=gdn.REC_MAX_BLOCK_DV,
                        GATES=True, **pdl),
        pointers=dict(p_state=f32, p_seq="i32", p_neg_a=f32, p_dt_bias=f32, p_keep_idx="i32", p_keep=f32),
        plain=("R", "keep_on"))))
    out.append(("_silu_mul_kernel", elementwise._silu_mul_kernel, dict(
        constexprs=dict(SPLIT=2, BLOCK=1024, **pdl), pointers=dict(p_in=f32))))
    out.append(("_gdn_gates_kernel", elementwise._gdn_gates_kernel, dict(
        constexprs=dict(BLOCK=32, **pdl), pointers=dict(p_neg_a=f32, p_dt_bias=f32, p_decay=f32), plain=("HV",))))
    out.append(("_sigmoid_gate_add_kernel", elementwise._sigmoid_gate_add_kernel, dict(
        constexprs=dict(BLOCK=1024, **pdl))))
    # the sampler's pick over a 151,936-token vocabulary (after each sampled decode step), as pick_triton launches it:
    # the blocks' totals, then the pick
    out.append(("_block_sums_kernel", sampling._block_sums_kernel, dict(
        constexprs=dict(BLOCK=sampling.BLOCK), pointers=dict(p_probs=f32, p_top_k="i64", p_min_p=f32, p_sums=f32,
                                                            p_counts="i32"), plain=("V",), num_warps=8)))
    out.append(("_pick_kernel", sampling._pick_kernel, dict(
        constexprs=dict(BLOCK=sampling.BLOCK, MAX_BLOCKS=triton.next_power_of_2(triton.cdiv(151936, sampling.BLOCK))),
        pointers=dict(p_probs=f32, p_sums=f32, p_counts="i32", p_top_k="i64", p_top_p=f32, p_min_p=f32,
                      p_seed="i64", p_pos="i64", p_pick="i64"), plain=("V", "NB"), num_warps=8)))
    decode = len(out)
    for h, d, rot in [(32, 128, 128), (16, 256, 64)]:  # prompt windows rotate q and k with it (Forward.rotate)
        out.append((f"_rope_kernel D={d} rotary {rot}", rope._rope_kernel, dict(
            constexprs=dict(BLOCK_H=min(h, rope.MAX_HEAD_BLOCK), BLOCK_HALF=rot // 2,
                            BLOCK_PASS=triton.next_power_of_2(max(d - rot, 1)), HAS_PASS=rot < d, **pdl),
            pointers=dict(p_pos="i32", p_inv_freq=f32), plain=("H", "HALF"))))
    for d, g in [(128, 8), (256, 8)]:
        block_m, block_n, warps, stages = attention.prefill_tiles(d)
        out.append((f"_prefill_kernel D={d}", attention._prefill_kernel, dict(
            constexprs=dict(G=g, D=d, BLOCK_M=block_m, BLOCK_D=attention._block_d(d), BLOCK_N=block_n,
                            DOT_PRECISION="tf32"),
            pointers={p: "bf16" for p in ("q", "k_cells", "v_cells", "out")} | dict(positions="i32"),
            plain=("T",), ones=("s_qd", "s_kd", "s_vd", "s_od"), num_warps=warps, num_stages=stages)))
    out.append(("_conv_prefill_kernel", gdn._conv_prefill_kernel, dict(
        constexprs=dict(K=4, BLOCK_T=gdn.CONV_PREFILL_BLOCK_T, BLOCK_C=gdn.CONV_PREFILL_BLOCK_C, BLOCK_H=4),
        plain=("T",))))
    chunk = 64
    out.append(("_gdn_chunk_prep_kernel", gdn._gdn_chunk_prep_kernel, dict(
        constexprs=dict(GROUP=2, DK=128, DV=128, BT=chunk, BLOCK_DK=128, BLOCK_DV=gdn.PREP_MAX_BLOCK_DV,
                        PRECISION="tf32", SUB=gdn.SOLVE_BLOCK),
        pointers=dict(p_g=f32, p_gl=f32), plain=("T",), num_warps=gdn.PREP_WARPS)))
    out.append(("_gdn_chunk_state_kernel", gdn._gdn_chunk_state_kernel, dict(
        constexprs=dict(DK=128, DV=128, BT=chunk, BLOCK_DK=128, BLOCK_DV=gdn.STATE_MAX_BLOCK_DV, PRECISION="tf32"),
        pointers=dict(p_gl=f32, p_s0=f32, p_s=f32), plain=("T", "num_chunks"), num_stages=2)))
    counts = dict(p_ids="i32", p_counts="i32", p_off="i32", p_expert="i32", p_used="i32", p_pair="i32")
    out.append(("_tile_counts_kernel", moe._tile_counts_kernel, dict(
        constexprs=dict(CHUNK=moe.LAYOUT_CHUNK, BLOCK_E=1024), pointers=counts, plain=("P", "E"))))
    out.append(("_tile_offsets_kernel", moe._tile_offsets_kernel, dict(
        constexprs=dict(BM=128, BLOCK_E=1024), pointers=counts, plain=("E", "NUM_CHUNKS"), num_warps=4)))
    out.append(("_tile_slots_kernel", moe._tile_slots_kernel, dict(
        constexprs=dict(CHUNK=moe.LAYOUT_CHUNK, PAIR_BITS=moe.LAYOUT_CHUNK.bit_length() - 1), pointers=counts,
        plain=("P", "E"), num_warps=8)))
    pt = moe.PROMPT_TILES  # with pointer loads (the descriptors' path takes tensor-descriptor arguments)
    prompt_tiles = dict(BLOCK_M=pt.block_m, BLOCK_K=pt.block_k, SHARED=False, TMA=False)
    for fmt in (0, 3):
        suffix, weights = (f" {packed[fmt]}", dict(p_w="u8", p_sw="u8")) if fmt else ("", {})
        out.append(("_gate_up_kernel (prompt tiles)" + suffix, moe._gate_up_kernel, dict(
            constexprs=dict(K_TOP=8, BLOCK_N=pt.block_n, PERSISTENT=False, FMT=fmt, **prompt_tiles, PDL=False),
            pointers=dict(expert_ptrs, **weights), plain=("P", "E"), ones=("s_wk",), num_warps=pt.num_warps,
            num_stages=pt.num_stages)))
        out.append(("_down_kernel (prompt tiles, walked)" + suffix, moe._down_kernel, dict(
            constexprs=dict(BLOCK_N=pt.down_n, PERSISTENT=True, FMT=fmt, **prompt_tiles, PDL=False),
            pointers=dict(expert_ptrs, p_y="bf16", **weights), plain=("P", "E"), ones=("s_wk",),
            num_warps=pt.num_warps, num_stages=pt.down_stages)))
    return [(label, "decode" if i < decode else "prompt", kernel, kw) for i, (label, kernel, kw) in enumerate(out)]


def main(part: int = 0, parts: int = 1) -> None:
    """Prints each case's result; `part` of `parts`: every parts-th case from the part-th (processes in parallel)."""
    for label, window, kernel, kw in cases()[part::parts]:
        try:
            result = dict(kernel=label, window=window, **compile_sm90(kernel, **kw))
        except Exception as e:  # noqa: BLE001 - reported per kernel, the caller decides
            result = dict(kernel=label, window=window, error=f"{type(e).__name__}: {str(e)[-2000:]}")
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("unset TRITON_INTERPRET: the interpreter replaces the compiler's kernels")
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    main(*map(int, sys.argv[1].split("/"))) if len(sys.argv) > 1 else main()
