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

import logging
import os
import time
import weakref

import torch
import torch.nn.functional as F

from strata.experts.block import pooled_moe_steps
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

log = logging.getLogger("strata.engine")
# Replay pooled stages' decode windows from segment graphs (`GraphedPooledDecode`): on by default since their
# greedy output was checked token for token against the eager path on the H200 (bench/experts.py --check, 25 and
# 50 % resident); STRATA_POOL_GRAPHS=0 runs them eagerly.
POOL_GRAPHS = os.environ.get("STRATA_POOL_GRAPHS", "1") != "0"
# ... with uploads (`--pcie-frac`): the uploads queued between two stretches into a fixed buffer that the next
# stretch adds. Checked token for token against the eager path on an H200 (twenty-sixth session, `bench/experts.py
# --check --pcie-frac 0,0.5`); STRATA_POOL_GRAPHS_UPLOAD=0 runs such stages eagerly.
POOL_GRAPHS_UPLOAD = os.environ.get("STRATA_POOL_GRAPHS_UPLOAD", "1") != "0"


class TritonDecode:
    """Runs a stage's layers (and head) over decode rows: tokens, positions and sequence ids, all [R]."""

    def __init__(self, spec: ModelSpec, weights: StageWeights, inv_freq: torch.Tensor,
                 pools: dict[int, ExpertPool] | None = None, rope_scale: float = 1.0):
        """`pools`: the CPU expert pools of the MoE layers that keep some experts in host RAM. Their layers wait
        for the host mid-window: a stage with pools runs eagerly, or with `POOL_GRAPHS` as one graph per stretch
        between two of them (`GraphedPooledDecode`). `rope_scale`: the factor rotary cos/sin carry (YaRN)."""
        self.spec, self.weights, self.inv_freq, self.rope_scale = spec, weights, inv_freq, rope_scale
        self.pools = pools or {}
        self.scale = spec.attention.head_dim**-0.5
        self.keep_hidden = False  # the last stage also returns its rows' final normed hidden states (MTP drafts)

    def __call__(self, pool: StatePool, inp: torch.Tensor, positions: torch.Tensor, seq_ids: torch.Tensor,
                 keep_idx: torch.Tensor | None = None):
        """inp: token ids [R] on the first stage, else the previous stage's hidden states [R, hidden]. Returns the
        logits [R, V] on the last stage (with `keep_hidden`: (logits, final normed hidden states [R, hidden])), else
        this stage's hidden states. A sequence's rows are consecutive; `keep_idx` [R] int32: the pool's keep slot
        each row leaves its GDN states in (-1 none; `Window.keep_idx`)."""
        steps = self.steps(pool, inp, positions, seq_ids, keep_idx)
        try:
            ask = next(steps)
            while True:  # the CPU pools' layers (`steps`): their rows to the host, their share back
                _, i, x, weights, ids = ask
                job = self.pools[i].start(x, weights, ids)
                _, cpu_rows = steps.send(None)
                ask = steps.send(job.finish(cpu_rows))
        except StopIteration as done:
            return done.value

    def steps(self, pool: StatePool, inp: torch.Tensor, positions: torch.Tensor, seq_ids: torch.Tensor,
              keep_idx: torch.Tensor | None = None):
        """The window as a generator: at each layer with a CPU pool it yields ("start", layer, x, weights, ids) (send
        None) and then ("finish", cpu_rows) (send the pool's share of the rows, on their device); returns what
        `__call__` returns. Without pools it yields nothing."""
        x = F.embedding(inp, self.weights.embed) if not inp.is_floating_point() else inp  # [R, hidden]
        pending = None  # the last block's output, added to x by the next norm (one kernel for both)
        for i, w in self.weights.layers.items():
            h, x = self._add_norm(pending, x, w["attn_norm"])
            if self.spec.layers[i].mixer == "attention":
                h = self._attention(i, w, h, pool, positions, seq_ids)
            else:
                h = self._gdn(i, w, h, pool, seq_ids, keep_idx)
            h, x = self._add_norm(h, x, w["mlp_norm"])
            if i in self.pools:
                steps = pooled_moe_steps(h, w, self.spec.moe, kernels="decode")
                start = next(steps)
                yield (start[0], i, *start[1:])
                pending = yield from _forward(steps)
            else:
                pending = self._mlp(i, w, h)
        if self.weights.final_norm is None:
            return x if pending is None else x + finish(pending)
        h, _ = self._add_norm(pending, x, self.weights.final_norm)
        logits = linear_triton(h, self.weights.lm_head).float()  # [R, V]
        return (logits, h) if self.keep_hidden else logits

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
                           a.rotary_dim, pool.k[i], pool.v[i], seq_ids, self.rope_scale)
        # each row's cells in fixed chunks, merged in the launch; Qwen3-Next's output gate applied as heads are stored
        out = decode_attention_split_triton(q, pool.k[i], pool.v[i], seq_ids, positions, self.scale,
                                            gate).reshape(r, -1)
        return linear_split(out, w["o"])  # its chunks are added by the next norm

    def _gdn(self, i: int, w: Tensors, x, pool: StatePool, seq_ids, keep_idx=None) -> torch.Tensor:
        g = self.spec.gdn
        r = x.shape[0]
        proj = linear_triton(x, w["in_proj"])
        mixed, z, b, a = proj.split([g.conv_dim, g.value_dim, g.num_v_heads, g.num_v_heads], dim=-1)
        # the recurrent step makes its decay and beta from a and b itself (no gates launch); a sequence's rows step
        # in order, drafted ones leaving their states in keep slots
        keep = None if keep_idx is None or i not in pool.keep_conv else (keep_idx, pool.keep_conv[i],
                                                                          pool.keep_recurrent[i])
        out = gdn_decode_triton(mixed, w["conv"], pool.conv[i], pool.recurrent[i], seq_ids, None, None,
                                g.num_k_heads, g.num_v_heads, g.k_head_dim, g.v_head_dim,
                                gates=(a, b, w["neg_a"], w["dt_bias"]), keep=keep)
        out = gated_rms_norm_triton(out, z.reshape(r, g.num_v_heads, g.v_head_dim), w["norm"], self.spec.rms_eps)
        if "out_heads" in w:  # a packed out_proj whose value heads' columns are in the file's order
            out = out.index_select(1, w["out_heads"])
        return linear_split(out.reshape(r, -1), w["out"])

    def _mlp(self, i: int, w: Tensors, x) -> torch.Tensor:
        if self.spec.layers[i].mlp == "dense":
            return linear_split(silu_mul_triton(linear_split(x, w["gate_up"])), w["down"])
        m = self.spec.moe
        shared = (w["shared_gate_up"], w["shared_down"]) if m.shared_dim else None
        # the experts' pairs (and the shared expert) are added up by the next norm
        return moe_triton(x, w["router"], w["experts_gate_up"], w["experts_down"], m.top_k, m.norm_topk, shared,
                          w.get("shared_gate"), linear=linear_split, tiles=decode_tiles(x.shape[0]), defer=True,
                          shared_pair=True)


def _forward(steps):
    """`yield from` a started `pooled_moe_steps`: its "finish" request and the value it returns."""
    request = steps.send(None)
    result = yield request
    try:
        steps.send(result)
    except StopIteration as done:
        return done.value
    raise RuntimeError("pooled_moe_steps did not end after the pool's share")


class GraphedDecode:
    """Captures `TritonDecode` once per (pool, row count) as a CUDA graph and replays it. A graph replays the
    kernels on the pool's own tensors, so it is stored on the pool."""

    WARMUP = 2

    def __init__(self, decode: TritonDecode):
        self.decode = decode
        self.memory_pool = None

    def __call__(self, pool: StatePool, tokens: torch.Tensor, positions: torch.Tensor, seq_ids: torch.Tensor,
                 keep_idx: torch.Tensor | None = None):
        inputs = (tokens, positions, seq_ids, keep_idx)
        graphs = pool.__dict__.setdefault("cuda_graphs", {})  # captured against this pool's tensors: they live and die with it
        key = (id(self), tokens.shape[0])  # a pool may serve several stages, each with its own graphs
        entry = graphs.get(key)
        if entry is None:
            entry = graphs[key] = self._capture(pool, *inputs)
        graph, bufs, out = entry
        _copy_inputs(bufs, inputs)
        graph.replay()
        return _cloned(out)  # the graph's output buffers are rewritten by its next replay

    def _capture(self, pool, tokens, positions, seq_ids, keep_idx):
        bufs = _input_buffers(tokens, positions, seq_ids, keep_idx)
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


class GraphedPooledDecode:
    """`TritonDecode` of a stage with CPU expert pools, replayed from CUDA graphs in segments: a head graph from
    the window's start (or a pooled layer's return) to the next pooled layer's rows being copied to the host, then
    a tail graph with that layer's resident experts. The copy's event is recorded between the two, so the host
    waits for the copy alone and computes the pool's pairs into a pinned buffer while the device runs the tail;
    the next head begins by uploading that share. (With one graph a segment the event came after the resident
    experts, and the host's pairs and the device's ran one after the other.) So the device's work between two
    pools costs two graph launches instead of its kernels' launches, and the rows, the pool's inputs and its share
    live in fixed buffers (captured once per (state pool, row count), as `GraphedDecode`)."""

    WARMUP = 2

    def __init__(self, decode: TritonDecode):
        self.decode = decode
        self.memory_pool = None
        self.eager = False  # set when a capture failed

    def __call__(self, pool: StatePool, tokens: torch.Tensor, positions: torch.Tensor, seq_ids: torch.Tensor,
                 keep_idx: torch.Tensor | None = None):
        inputs = (tokens, positions, seq_ids, keep_idx)
        if self.eager:
            return self.decode(pool, *inputs)
        graphs = pool.__dict__.setdefault("cuda_graphs", {})
        key = (id(self), tokens.shape[0])
        entry = graphs.get(key)
        if entry is None:
            try:
                entry = graphs[key] = self._capture(pool, *inputs)
            except RuntimeError as e:  # a kernel that cannot be captured: run the stage's windows eagerly
                log.warning("decode windows with the CPU expert pool run without CUDA graphs: capturing them failed "
                            "(%s)", e)
                self.eager = True
                return self.decode(pool, *inputs)
        segments, bufs, io, out = entry
        _copy_inputs(bufs, inputs)
        stream = torch.cuda.current_stream(tokens.device)
        for k, (head, tail) in enumerate(segments):
            if k:  # the pool of the layer the last head ended at: its rows are on the host once the copy is done
                layer, x_h, w_h, ids_h, share_h, cpu_rows, up_buf, x_d, w_d, copied = io[k - 1]
                the_pool = self.decode.pools[layer]
                start = time.perf_counter()
                copied.synchronize()
                the_pool.wait_s += time.perf_counter() - start
                if up_buf is not None:  # the uploaded experts' share, queued before the CPU starts on its own
                    uploaded = the_pool.upload(x_d, w_d, ids_h, cpu_rows)
                    if uploaded is None:
                        up_buf.zero_()
                    else:
                        up_buf.copy_(uploaded)
                share_h.copy_(the_pool.compute(x_h, w_h, ids_h, cpu_rows))
            head.replay()
            if tail is not None:
                io[k][-1].record(stream)  # the rows' copy to the host is done when this fires
                tail.replay()  # the layer's resident experts, while the host computes its pairs
        return _cloned(out)

    def _capture(self, pool, tokens, positions, seq_ids, keep_idx):
        bufs = _input_buffers(tokens, positions, seq_ids, keep_idx)
        rows = seq_ids.long()
        mine = self.decode.weights.layers
        saved = [(t, t[rows].clone()) for states in (pool.conv, pool.recurrent) for i, t in states.items() if i in mine]
        device = tokens.device
        stream = torch.cuda.Stream(device=device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(self.WARMUP):
                self.decode(pool, *bufs)
        torch.cuda.current_stream(device).wait_stream(stream)
        for t, snapshot in saved:
            t[rows] = snapshot
        if self.memory_pool is None:
            self.memory_pool = torch.cuda.graph_pool_handle()
        r, hidden, k = tokens.shape[0], self.decode.spec.hidden_size, self.decode.spec.moe.top_k
        dtype = self.decode.weights.layers[next(iter(self.decode.pools))]["router"].dtype
        io = []  # per pooled layer: its host buffers (allocated before capture: pinned, fixed addresses)
        for layer, the_pool in self.decode.pools.items():
            # the uploaded experts' share (float32, on the device), written between two stretches, and the device
            # tensors of the layer's rows and routing weights the uploads read (kept: graph memory stays theirs)
            up_buf = torch.zeros((r, hidden), dtype=torch.float32, device=device) if the_pool.num_upload else None
            share_dtype = torch.float32 if up_buf is not None else dtype  # added to the uploads' before rounding
            io.append([layer, _pinned((r, hidden), dtype), _pinned((r, k), torch.float32),  # routing weights: float32
                       _pinned((r, k), torch.int32), _pinned((r, hidden), share_dtype), None, up_buf, None, None,
                       torch.cuda.Event()])
        steps = self.decode.steps(pool, *bufs)
        segments, out, share, up_buf = [], None, None, None
        while out is None:
            head, tail = torch.cuda.CUDAGraph(), None
            with torch.cuda.graph(head, pool=self.memory_pool, stream=stream, capture_error_mode="thread_local"):
                try:
                    if share is None:
                        ask = next(steps)
                    else:  # the previous pool's share, uploaded from its pinned buffer, goes back into the window
                        back = share.to(device, non_blocking=True)
                        if up_buf is not None:  # with the uploaded experts' share, as `PoolJob.finish` adds them
                            back = (up_buf + back).to(dtype)
                        ask = steps.send(back)
                    _, layer, x, weights, ids = ask
                    slot = io[len(segments)]
                    assert slot[0] == layer, (slot[0], layer)
                    slot[7], slot[8] = x, weights
                    slot[1].copy_(x, non_blocking=True)
                    if weights.dtype != slot[2].dtype or ids.dtype != slot[3].dtype:  # the pool must see what eager sees
                        raise RuntimeError(f"routing weights {weights.dtype} / ids {ids.dtype}: expected float32 / int32")
                    slot[2].copy_(weights, non_blocking=True)
                    slot[3].copy_(ids, non_blocking=True)
                except StopIteration as done:
                    out = done.value
            if out is None:  # the layer's resident experts, in a graph of their own (see the class)
                tail = torch.cuda.CUDAGraph()
                with torch.cuda.graph(tail, pool=self.memory_pool, stream=stream, capture_error_mode="thread_local"):
                    _, slot[5] = steps.send(None)
                share, up_buf = slot[4], slot[6]
            segments.append((head, tail))
        for t, snapshot in saved:  # the capture queued nothing that ran; restore anyway for symmetry
            t[rows] = snapshot
        return segments, bufs, [tuple(s) for s in io], out


def _input_buffers(*inputs: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """A graph's static copies of a window's row tensors (None stays None: the pool has no keep slots)."""
    return tuple(None if t is None else t.clone() for t in inputs)


def _copy_inputs(bufs: tuple[torch.Tensor | None, ...], inputs: tuple[torch.Tensor | None, ...]) -> None:
    for buf, t in zip(bufs, inputs):
        if (buf is None) != (t is None):
            raise RuntimeError("a window's keep slots must be given to every decode window of its pool, or to none")
        if buf is not None:
            buf.copy_(t)


def _cloned(out):
    """A graph's output (logits or hidden states, or both), cloned: its buffers are rewritten by the next replay."""
    return tuple(t.clone() for t in out) if isinstance(out, tuple) else out.clone()


def _pinned(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A host buffer pinned by registering it with CUDA, outside torch's caching host allocator (whose copies record
    events on the stream, which a capturing stream refuses); unregistered when it is freed."""
    t = torch.empty(shape, dtype=dtype)
    cudart = torch.cuda.cudart()
    ptr, size = t.data_ptr(), t.numel() * t.element_size()
    err = cudart.cudaHostRegister(ptr, size, 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of a {size}-byte buffer failed ({err})")
    weakref.finalize(t, cudart.cudaHostUnregister, ptr)
    return t
