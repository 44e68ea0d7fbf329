"""The decode window on Triton kernels, replayed from CUDA graphs.

A decode window (one row per sequence, every sequence in one `StatePool`) runs as a fixed sequence of
kernel launches whose shapes depend only on the number of rows (a sum of split-K chunks or of a row's expert
outputs is left to the kernel that reads it, `strata/kernels/deferred.py`): row-invariant Triton kernels for every
per-row op (projections, norms, rotary, router, experts, head), and per-row kernels that index the pool by
each row's sequence id for attention and the Gated DeltaNet step. No launch waits for the host, so on a GPU
the whole window is captured once per row count as a CUDA graph and replayed with its inputs copied into
static buffers. A row's logits are bitwise the same alone or among any other rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from strata.experts.block import pooled_moe
from strata.experts.pool import ExpertPool
from strata.kernels.attention import decode_attention_split_triton
from strata.kernels.elementwise import silu_mul_triton
from strata.kernels.gdn import gdn_decode_triton
from strata.kernels.deferred import finish
from strata.kernels.linear import linear_split, linear_triton
from strata.kernels.moe import decode_tiles, moe_triton
from strata.kernels.qk_prep import qk_prep_triton
from strata.kernels.rmsnorm import add_rms_norm_triton, gated_rms_norm_triton, rms_norm_triton
from strata.model.spec import ModelSpec
from strata.model.weights import StageWeights, Tensors
from strata.runtime.forward import split_qkv
from strata.state.session import StatePool


class TritonDecode:
    """Runs a stage's layers (and head) over decode rows: tokens, positions and sequence ids, all [R]."""

    def __init__(self, spec: ModelSpec, weights: StageWeights, inv_freq: torch.Tensor,
                 pools: dict[int, ExpertPool] | None = None):
        """`pools`: the CPU expert pools of the MoE layers that keep some experts in host RAM. Their layers wait
        for the host mid-window, so a stage with pools is not captured as a CUDA graph (`Forward`)."""
        self.spec, self.weights, self.inv_freq = spec, weights, inv_freq
        self.pools = pools or {}
        self.scale = spec.attention.head_dim**-0.5

    def __call__(self, pool: StatePool, inp: torch.Tensor, positions: torch.Tensor, seq_ids: torch.Tensor) -> torch.Tensor:
        """inp: token ids [R] on the first stage, else the previous stage's hidden states [R, hidden]. Returns the
        logits [R, V] on the last stage, else this stage's hidden states."""
        x = F.embedding(inp, self.weights.embed) if not inp.is_floating_point() else inp  # [R, hidden]
        pending = None  # the last block's output, added to x by the next norm (one kernel for both)
        for i, w in self.weights.layers.items():
            h, x = self._add_norm(pending, x, w["attn_norm"])
            if self.spec.layers[i].mixer == "attention":
                h = self._attention(i, w, h, pool, positions, seq_ids)
            else:
                h = self._gdn(i, w, h, pool, seq_ids)
            h, x = self._add_norm(h, x, w["mlp_norm"])
            pending = self._mlp(i, w, h)
        if self.weights.final_norm is None:
            return x if pending is None else x + finish(pending)
        h, _ = self._add_norm(pending, x, self.weights.final_norm)
        return linear_triton(h, self.weights.lm_head).float()  # [R, V]

    def _add_norm(self, h, x, weight):
        """(rms_norm(x + h), x + h), or (rms_norm(x), x) when there is no h: bitwise what the two ops give. h may be
        left unfinished by the block before (a `SplitSum` or `PairSum`): the norm adds it up."""
        if h is None:
            return rms_norm_triton(x, weight, self.spec.rms_eps), x
        return add_rms_norm_triton(h, x, weight, self.spec.rms_eps, decode=True)

    def _attention(self, i: int, w: Tensors, x, pool: StatePool, positions, seq_ids) -> torch.Tensor:
        a = self.spec.attention
        r = x.shape[0]
        # without an output gate every part of qkv is read by qk_prep, which adds its split-K chunks as it loads
        project = linear_triton if a.output_gate else linear_split
        q, k, v, gate = split_qkv(a, project(x, w["qkv"], w.get("qkv_bias")))
        # q/k norms, rotary, and each row's k and v into its own cell: one launch
        q = qk_prep_triton(q, k, v, w.get("q_norm"), w.get("k_norm"), self.spec.rms_eps, positions, self.inv_freq,
                           a.rotary_dim, pool.k[i], pool.v[i], seq_ids)
        # each row's cells in fixed chunks, merged in the launch; Qwen3-Next's output gate applied as heads are stored
        out = decode_attention_split_triton(q, pool.k[i], pool.v[i], seq_ids, positions, self.scale,
                                            gate).reshape(r, -1)
        return linear_split(out, w["o"])  # its chunks are added by the next norm

    def _gdn(self, i: int, w: Tensors, x, pool: StatePool, seq_ids) -> torch.Tensor:
        g = self.spec.gdn
        r = x.shape[0]
        proj = linear_triton(x, w["in_proj"])
        mixed, z, b, a = proj.split([g.conv_dim, g.value_dim, g.num_v_heads, g.num_v_heads], dim=-1)
        # the recurrent step makes its decay and beta from a and b itself (no gates launch)
        out = gdn_decode_triton(mixed, w["conv"], pool.conv[i], pool.recurrent[i], seq_ids, None, None,
                                g.num_k_heads, g.num_v_heads, g.k_head_dim, g.v_head_dim,
                                gates=(a, b, w["neg_a"], w["dt_bias"]))
        out = gated_rms_norm_triton(out, z.reshape(r, g.num_v_heads, g.v_head_dim), w["norm"], self.spec.rms_eps)
        return linear_split(out.reshape(r, -1), w["out"])

    def _mlp(self, i: int, w: Tensors, x) -> torch.Tensor:
        if self.spec.layers[i].mlp == "dense":
            return linear_split(silu_mul_triton(linear_split(x, w["gate_up"])), w["down"])
        m = self.spec.moe
        if i in self.pools:
            return pooled_moe(x, w, m, self.pools[i], kernels="decode")
        shared = (w["shared_gate_up"], w["shared_down"]) if m.shared_dim else None
        # the experts' pairs (and the shared expert) are added up by the next norm
        return moe_triton(x, w["router"], w["experts_gate_up"], w["experts_down"], m.top_k, m.norm_topk, shared,
                          w.get("shared_gate"), linear=linear_split, tiles=decode_tiles(x.shape[0]), defer=True,
                          shared_pair=True)


class GraphedDecode:
    """Captures `TritonDecode` once per (pool, row count) as a CUDA graph and replays it. A graph replays the
    kernels on the pool's own tensors, so it is stored on the pool."""

    WARMUP = 2

    def __init__(self, decode: TritonDecode):
        self.decode = decode
        self.memory_pool = None

    def __call__(self, pool: StatePool, tokens: torch.Tensor, positions: torch.Tensor, seq_ids: torch.Tensor) -> torch.Tensor:
        graphs = pool.__dict__.setdefault("cuda_graphs", {})  # captured against this pool's tensors: they live and die with it
        key = (id(self), tokens.shape[0])  # a pool may serve several stages, each with its own graphs
        entry = graphs.get(key)
        if entry is None:
            entry = graphs[key] = self._capture(pool, tokens, positions, seq_ids)
        graph, (t_buf, p_buf, s_buf), out = entry
        t_buf.copy_(tokens)
        p_buf.copy_(positions)
        s_buf.copy_(seq_ids)
        graph.replay()
        return out.clone()  # the graph's output buffer is rewritten by its next replay

    def _capture(self, pool, tokens, positions, seq_ids):
        bufs = (tokens.clone(), positions.clone(), seq_ids.clone())
        # Warm-up runs (Triton compiles here) rewrite the K/V cells the real window writes anyway, but they
        # advance the rows' GDN states: keep those states and put them back before the real step.
        rows = seq_ids.long()
        mine = self.decode.weights.layers
        saved = [(t, t[rows].clone()) for states in (pool.conv, pool.recurrent) for i, t in states.items() if i in mine]
        # Warm up and capture on a stream of this stage's own device: torch.cuda.graph's default capture stream
        # is made once per process, on whichever device captured first, and would run a later stage's kernels
        # on that device instead.
        stream = torch.cuda.Stream(device=tokens.device)
        stream.wait_stream(torch.cuda.current_stream(tokens.device))
        with torch.cuda.stream(stream):
            for _ in range(self.WARMUP):
                self.decode(pool, *bufs)
        torch.cuda.current_stream(tokens.device).wait_stream(stream)
        for t, snapshot in saved:
            t[rows] = snapshot
        graph = torch.cuda.CUDAGraph()
        if self.memory_pool is None:
            self.memory_pool = torch.cuda.graph_pool_handle()
        # thread_local: another stage's worker may allocate or wait while this one captures (pipelined groups)
        with torch.cuda.graph(graph, pool=self.memory_pool, stream=stream, capture_error_mode="thread_local"):
            out = self.decode(pool, *bufs)
        return graph, bufs, out
