"""One forward pass over a window: per-row parts run once over all rows, per-sequence parts per segment."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from strata.experts.block import pooled_moe
from strata.experts.pool import stage_pools
from strata.kernels.attention import attention
from strata.kernels.deferred import PairSum
from strata.kernels.elementwise import gdn_gates
from strata.kernels.gdn import causal_conv1d, gated_delta_rule_chunked, gated_delta_rule_step
from strata.kernels import cpu_decode, onednn
from strata.kernels.invariant import in_row_blocks, plain
from strata.kernels.moe import combine_triton, decode_tiles, moe, moe_triton, swiglu
from strata.kernels.packed import project
from strata.kernels.rmsnorm import gated_rms_norm, rms_norm
from strata.kernels.rope import apply_rope, rope_cos_sin
from strata.model.rope_scaling import rope_frequencies
from strata.model.spec import AttentionSpec, ModelSpec
from strata.model.weights import StageWeights, Tensors
from strata.quant.packed import PackedWeight
from strata.runtime.window import Window


class Forward:
    """Runs a stage's layers over windows. Holds no per-sequence state: that lives in the window's segments."""

    def __init__(self, spec: ModelSpec, weights: StageWeights, device: torch.device, dtype: torch.dtype,
                 kernels: str = "torch", cuda_graphs: bool = False, pack_pools: bool | None = None,
                 upload: float = 0.0):
        """kernels: "torch" runs the reference ops everywhere; "triton" runs decode windows on the Triton kernels
        (`fast_decode`), replayed from CUDA graphs when `cuda_graphs`, and prompt windows' attention, MoE and GDN
        (conv + chunked delta rule) blocks on the Triton prefill kernels (the projections stay on torch's GEMMs,
        which are fastest there)."""
        self.spec, self.weights, self.device, self.dtype = spec, weights, device, dtype
        a = spec.attention
        # rotary frequencies and the factor its cos/sin carry (RoPE scaling: `strata.model.rope_scaling`)
        self.inv_freq, self.rope_scale = rope_frequencies(a.rotary_dim, a.rope_theta, a.rope_type, a.rope_params, device)
        self.scale = a.head_dim**-0.5
        self.fast = None
        self.mtp: Tensors | None = None  # the multi-token-prediction layer (`set_mtp`), on the last stage
        self.hidden: torch.Tensor | None = None  # with `mtp`: the last window's final hidden states, every row
        self._hidden_parts: list[torch.Tensor] = []
        # the CPU expert pools (`pack_pools`: their weights' layout; `upload`: the share the device computes after
        # uploading it, `--pcie-frac`; `ExpertPool`)
        self.pools = stage_pools(weights.offloaded, spec.moe.num_experts, pack_pools, upload,
                                 pin=torch.device(device).type == "cuda") if weights.offloaded else {}
        self.attend = attention  # a sequence's rows over its cells, in prompt windows
        self.norm = rms_norm  # per row vector: row-invariant in both forms
        self.add_norm = None  # residual add + norm in one pass for prompt windows (None: the add, then self.norm)
        # a CPU stage runs its decode rows' residual adds and norms, and their attention blocks, in C
        # (`strata.kernels.cpu_decode`): one call each a layer, no padding to a block of rows, each row on its own
        self.host_decode = (torch.device(device).type == "cpu" and dtype == torch.float32 and kernels == "torch"
                            and cpu_decode.available())
        # a stage of attention layers (dense MLPs, or routed experts without a shared one) whose matrices are all on
        # the CPU's packed kernel: its decode rows go through every layer in one C call (`cpu_decode.Stage`), the
        # same steps without Python between them
        self.host_stage = (cpu_decode.Stage(spec, weights.layers, self.scale)
                           if self.host_decode and cpu_decode.Stage.of(spec, weights.layers) else None)
        # the attention layers whose decode rows `cpu_decode.attention` runs (it takes head dims in 8s)
        self.host_attention = [i for i in weights.layers if spec.layers[i].mixer == "attention"] if (
            self.host_decode and spec.attention.head_dim % 8 == 0) else []
        self.gated_norm = gated_rms_norm  # the GDN output's norm x silu(z); row-invariant in both forms
        self.gdn_gates = gdn_gates  # a GDN block's decay and beta from its projections
        self.rotate = None  # Triton rotary (positions in, cos/sin made in-kernel); None: the torch reference
        self.prompt_moe = None  # the Triton MoE block with prompt-sized tiles (None: the torch reference)
        self.prompt_gdn = None  # (conv, chunked delta rule) on Triton for prompt windows (None: the torch references)
        if kernels == "triton":
            from strata.kernels.moe import moe_triton, prompt_tiles

            self.prompt_moe = lambda *a, **kw: moe_triton(*a, **kw, tiles=prompt_tiles(dtype))
            from strata.kernels.attention import prefill_attention_triton

            self.attend = prefill_attention_triton
            from strata.kernels.elementwise import gdn_gates_triton
            from strata.kernels.rmsnorm import add_rms_norm_triton, gated_rms_norm_triton, rms_norm_triton
            from strata.kernels.rope import apply_rope_triton

            self.norm = rms_norm_triton
            self.add_norm = add_rms_norm_triton
            self.gated_norm = gated_rms_norm_triton
            self.gdn_gates = gdn_gates_triton
            self.rotate = apply_rope_triton
            from strata.kernels.gdn import causal_conv1d_triton, gated_delta_rule_chunked_triton

            self.prompt_gdn = (causal_conv1d_triton, gated_delta_rule_chunked_triton)
            from strata.runtime import fast_decode

            self.fast = fast_decode.TritonDecode(spec, weights, self.inv_freq, self.pools, self.rope_scale)
            if cuda_graphs and not self.pools:
                self.fast = fast_decode.GraphedDecode(self.fast)
            elif cuda_graphs and fast_decode.POOL_GRAPHS and (fast_decode.POOL_GRAPHS_UPLOAD or not any(
                    p.num_upload for p in self.pools.values())):
                # with CPU pools: a graph a stretch between two of them, uploads (--pcie-frac) queued between
                # stretches (STRATA_POOL_GRAPHS_UPLOAD=0: such stages eagerly)
                self.fast = fast_decode.GraphedPooledDecode(self.fast)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, self.weights.embed)  # [R, hidden]

    def layers(self, x: torch.Tensor, window: Window) -> torch.Tensor:
        positions = window.positions.to(self.device)
        cos_sin = None
        if self.rotate is None:
            cos, sin = cos_sin = rope_cos_sin(positions, self.inv_freq, self.dtype, self.rope_scale)
            turn = lambda t: apply_rope(t, cos, sin)  # noqa: E731
        else:
            turn = lambda t: self.rotate(t, positions, self.inv_freq, self.spec.attention.rotary_dim,  # noqa: E731
                                         scale=self.rope_scale)
        rows = _rows_for(window)
        cells = None  # with the CPU's decode kernels: each row's K/V cells, layer by layer (`cpu_decode.cell_table`)
        layers = self.host_attention
        if self.host_decode and layers and rows is not plain and cos_sin is not None:
            cells = cpu_decode.cell_table(window, layers, self.spec.attention.num_kv_heads * self.spec.attention.head_dim)
            if cells is not None and self.host_stage is not None:
                return self.host_stage.run(x, *cos_sin, cells, positions)
            cells = None if cells is None else dict(zip(layers, cells))
        delta = None  # what the last block adds to the residual stream x, not added yet
        for i, w in self.weights.layers.items():
            h, x = self._add_norm(delta, x, w["attn_norm"], rows)
            if self.spec.layers[i].mixer == "attention":
                delta = self._attention(i, w, h, window, turn, rows, positions, cos_sin,
                                        None if cells is None else cells[i])
            else:
                delta = self._gdn(i, w, h, window, rows)
            h, x = self._add_norm(delta, x, w["mlp_norm"], rows)
            delta = self._mlp(i, w, h, rows)
        return x if delta is None else x + _finished(delta)

    def _add_norm(self, delta, x: torch.Tensor, weight: torch.Tensor, rows) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + delta), x + delta); delta None: nothing to add. Prompt windows on Triton add and norm in one
        pass, finishing a block's deferred output (the MoE's pairs) as they load it."""
        if delta is not None and self.add_norm is not None and rows is plain:
            return self.add_norm(delta, x, weight, self.spec.rms_eps)
        if self.host_decode and rows is not plain:
            return cpu_decode.rms_norm(x, weight, self.spec.rms_eps, None if delta is None else _finished(delta))
        if delta is not None:
            x = x + _finished(delta)
        return rows(self.norm, x, weight, self.spec.rms_eps), x

    def head(self, x: torch.Tensor, window: Window) -> torch.Tensor:
        if window.logit_rows.shape[0] == 0:  # prompt chunks that are not their prompts' last: no logits wanted
            return x.new_zeros(0, self.weights.lm_head.shape[0], dtype=torch.float32)
        rows = _rows_for(window)
        x = x[window.logit_rows.to(self.device)]
        if self.host_decode and rows is not plain:
            h = cpu_decode.rms_norm(x, self.weights.final_norm, self.spec.rms_eps)[0]
        else:
            h = rows(self.norm, x, self.weights.final_norm, self.spec.rms_eps)
        return rows(project, h, self.weights.lm_head).float()  # [N, V]

    def __call__(self, window: Window) -> torch.Tensor:
        return self.run_stage(window)

    def set_mtp(self, weights: Tensors) -> None:
        """Draft with this multi-token-prediction layer (`strata.model.weights.mtp_tensors`): from now on each window
        keeps its rows' final hidden states (`hidden`) for `run_mtp`. Its head scores the draft vocabulary's rows of
        the LM head (all of them without one)."""
        self.mtp = dict(weights)
        vocab = self.mtp.get("draft_vocab")
        lm_head = head = self.weights.lm_head
        if vocab is not None:  # (a packed head: the CPU kernel's, its rows kept packed)
            head = (lm_head.rows(vocab) if isinstance(lm_head, PackedWeight)
                    else onednn.dense(lm_head)[vocab.to(self.device)].contiguous())
        self.mtp["head"] = head
        if onednn.is_blocked(lm_head) or getattr(lm_head, "host_kernel", False):  # a CPU stage on the torch
            # kernels: the MTP layer's float matrices on oneDNN's products too
            onednn.block_matrices(self.mtp, onednn.MTP_MATRICES, self.dtype)
        if self.fast is not None:  # the Triton decode windows return their rows' final hidden states as well
            getattr(self.fast, "decode", self.fast).keep_hidden = True

    def run_mtp(self, hidden: torch.Tensor, tokens: torch.Tensor, window: Window) -> tuple[torch.Tensor, torch.Tensor]:
        """The MTP layer over rows (hidden state h_t, the token x_t+1) at positions t, one segment per sequence (its
        K/V cells: layer `spec.num_layers` of the pool): [norm(embed(x)) | norm(h)] -> fc -> a decoder layer of the
        model's full-attention kind -> norm. Returns those normed outputs [R, hidden] (the next step's h) and the
        draft ids [N] of the window's logit rows (the argmax over the draft vocabulary)."""
        w, eps = self.mtp, self.spec.rms_eps
        e = rms_norm(F.embedding(tokens, self.weights.embed), w["pre_embed_norm"], eps)
        g = rms_norm(hidden, w["pre_hidden_norm"], eps)
        x = project(torch.cat([e, g], dim=-1), w["fc"])
        positions = window.positions.to(self.device)
        cos, sin = rope_cos_sin(positions, self.inv_freq, self.dtype, self.rope_scale)
        turn = lambda t: apply_rope(t, cos, sin)  # noqa: E731
        attend, self.attend = self.attend, attention  # the reference kernels: any shape of segments, no graphs
        try:
            x = x + self._attention(self.spec.num_layers, w, rms_norm(x, w["attn_norm"], eps), window, turn, plain,
                                    positions)
        finally:
            self.attend = attend
        h = rms_norm(x, w["mlp_norm"], eps)
        if "gate_up" in w:
            x = x + swiglu(h, w["gate_up"], w["down"])
        else:
            m = self.spec.moe
            shared = (w["shared_gate_up"], w["shared_down"]) if m.shared_dim else None
            args = (h, w["router"], w["experts_gate_up"], w["experts_down"], m.top_k, m.norm_topk, shared,
                    w.get("shared_gate"))
            if self.prompt_moe is None:
                x = x + _finished(moe(*args, plain))
            elif h.shape[0] <= MTP_DECODE_TILE_ROWS:  # on Triton: no host sync, no loop over the experts
                x = x + moe_triton(*args, tiles=decode_tiles(h.shape[0]))
            else:  # a paused layer's rows read at once
                x = x + _finished(self.prompt_moe(*args))
        out = rms_norm(x, w["final_norm"], eps)
        rows = window.logit_rows.to(self.device)
        picks = project(out[rows], w["head"]).argmax(dim=-1)
        vocab = w.get("draft_vocab")
        return out, picks if vocab is None else vocab.to(self.device)[picks]

    def run_stage(self, window: Window, x: torch.Tensor | None = None) -> torch.Tensor:
        """This stage's share of a window: from the tokens (first stage, x None) or the previous stage's hidden
        states x [R, hidden], to the next hidden states, or to the logits on the last stage.

        A mixed window (decode rows first, then prompt chunks) runs as its two parts in turn: the decode rows
        exactly as a decode window of their own (row-invariant; a CUDA graph on the GPU), so a decoding row's
        logits are bitwise the same whether or not prompt rows share its window; the prompt rows on the prompt
        kernels. The weights are read once per part."""
        self._hidden_parts = []
        parts = window.split()
        if parts is None:
            out = self._run_part(window, x)
        else:
            decode, prompt = parts
            r = decode.num_rows
            first = self._run_part(decode, None if x is None else x[:r])
            rest = self._run_part(prompt, None if x is None else x[r:])
            out = torch.cat([first, rest])  # hidden states in row order, or logits in logit-row order
        if self.mtp is not None:
            self.hidden = _joined(self._hidden_parts)
        return out

    def _run_part(self, window: Window, x: torch.Tensor | None = None) -> torch.Tensor:
        if self.fast is not None and window.is_decode and window.pool is not None:
            positions = window.positions.to(self.device, torch.int32)
            inp = window.tokens.to(self.device) if x is None else x
            keep_idx = None if window.keep_idx is None else window.keep_idx.to(self.device)
            out = self.fast(window.pool, inp, positions, window.seq_ids.to(self.device), keep_idx)
            if isinstance(out, tuple):  # (logits, final hidden states): the MTP layer reads the latter
                out, hidden = out
                self._hidden_parts.append(hidden)
            if self.weights.final_norm is not None and window.logit_rows.shape[0] != window.num_rows:
                out = out[window.logit_rows.to(self.device)]  # a one-row prompt chunk that is not its prompt's last
            return out
        x = self.embed(window.tokens.to(self.device)) if x is None else x
        x = self.layers(x, window)
        if self.mtp is not None:  # every row's final hidden state, for the MTP layer's rows
            self._hidden_parts.append(rms_norm(x, self.weights.final_norm, self.spec.rms_eps))
        return self.head(x, window) if self.weights.final_norm is not None else x

    def _attention(self, i: int, w: Tensors, x: torch.Tensor, window: Window, turn, rows,
                   positions: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None,
                   cells: torch.Tensor | None = None) -> torch.Tensor:
        """positions: the window's on this stage's device, as `layers` holds them (read once per window); cos_sin:
        the window's rotary factors where `turn` is the torch reference's; cells: the decode rows' K/V cells of this
        layer where the CPU's decode kernel runs them (`cpu_decode.cell_table`)."""
        a = self.spec.attention
        r = x.shape[0]
        qkv = rows(project, x, w["qkv"], w.get("qkv_bias"))
        if cells is not None:  # one C call: norms, rotary, append, attend
            norms = [w[n].float() if a.qk_norm else None for n in ("q_norm", "k_norm")]
            out = cpu_decode.attention(qkv, a.num_heads, a.num_kv_heads, a.head_dim, a.output_gate, *cos_sin, *norms,
                                       self.spec.rms_eps, cells, positions, self.scale)
            gate = split_qkv(a, qkv)[3]
        else:
            out, gate = self._attend_rows(i, w, a, qkv, window, turn, rows, positions)
        out = out.reshape(r, -1)
        if gate is not None:
            out = out * torch.sigmoid(gate.reshape(r, -1))
        return rows(project, out, w["o"])

    def _attend_rows(self, i: int, w: Tensors, a: AttentionSpec, qkv: torch.Tensor, window: Window, turn, rows,
                     positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The attention between the qkv and o products on torch's ops: (its output [R, H, D], the gate or None)."""
        q, k, v, gate = split_qkv(a, qkv)
        if a.qk_norm:
            q = rows(self.norm, q, w["q_norm"], self.spec.rms_eps)
            k = rows(self.norm, k, w["k_norm"], self.spec.rms_eps)
        q, k = turn(q), turn(k)
        outs = []
        for seg in window.segments:
            seg_rows = slice(seg.start, seg.stop)
            end = seg.first_pos + seg.num_rows
            k_cells, v_cells = seg.state.k[i], seg.state.v[i]
            k_cells[seg.first_pos : end] = k[seg_rows]
            v_cells[seg.first_pos : end] = v[seg_rows]
            outs.append(self.attend(q[seg_rows], k_cells[:end], v_cells[:end], positions[seg_rows], self.scale))
        return _joined(outs), gate

    def _gdn(self, i: int, w: Tensors, x: torch.Tensor, window: Window, rows) -> torch.Tensor:
        g = self.spec.gdn
        r = x.shape[0]
        proj = rows(project, x, w["in_proj"])
        mixed, z, b, a = proj.split([g.conv_dim, g.value_dim, g.num_v_heads, g.num_v_heads], dim=-1)
        decay, beta = self.gdn_gates(a, b, w["neg_a"], w["dt_bias"])  # [R, Hv]: log decay (float32), beta
        outs = []
        prompt_gdn = self.prompt_gdn if rows is plain else None  # Triton in prompt windows
        conv = causal_conv1d if prompt_gdn is None else prompt_gdn[0]
        for seg in window.segments:
            seg_rows = slice(seg.start, seg.stop)
            state = seg.state
            conv_out, history = conv(mixed[seg_rows], w["conv"], state.conv[i])
            state.conv[i].copy_(history)
            q, k, v = conv_out.split([g.key_dim, g.key_dim, g.value_dim], dim=-1)
            n = seg.num_rows
            q = q.reshape(n, g.num_k_heads, g.k_head_dim)
            k = k.reshape(n, g.num_k_heads, g.k_head_dim)
            v = v.reshape(n, g.num_v_heads, g.v_head_dim)
            rule = gated_delta_rule_step if n == 1 else gated_delta_rule_chunked
            if prompt_gdn is not None:
                rule = prompt_gdn[1]  # any n, 1 included
            seg_out, new_state = rule(q, k, v, decay[seg_rows], beta[seg_rows], state.recurrent[i])
            state.recurrent[i].copy_(new_state)
            if seg.keep:  # a drafted row: a rejection returns the state to this one
                state.keep(seg.first_pos, i)
            outs.append(seg_out)
        out = self.gated_norm(_joined(outs), z.reshape(r, g.num_v_heads, g.v_head_dim), w["norm"], self.spec.rms_eps, rows)
        if "out_heads" in w:  # a packed out_proj whose value heads' columns are in the file's order
            out = out.index_select(1, w["out_heads"])
        return rows(project, out.reshape(r, -1), w["out"])

    def _mlp(self, i: int, w: Tensors, x: torch.Tensor, rows) -> torch.Tensor:
        if self.spec.layers[i].mlp == "dense":
            return rows(swiglu, x, w["gate_up"], w["down"])
        m = self.spec.moe
        shared = (w["shared_gate_up"], w["shared_down"]) if m.shared_dim else None
        if i in self.pools:  # some of this layer's experts are in host RAM: the CPU pool computes their pairs
            return pooled_moe(x, w, m, self.pools[i], rows, "prompt" if self.prompt_moe is not None and rows is plain else "torch")
        args = (x, w["router"], w["experts_gate_up"], w["experts_down"], m.top_k, m.norm_topk, shared, w.get("shared_gate"))
        if self.prompt_moe is not None and rows is plain:  # a prompt window: no host sync, grouped GEMMs
            return self.prompt_moe(*args, defer=True)  # its pairs are added by the next residual norm
        return moe(*args, rows)


# the MTP layer's MoE on Triton takes decode tiles up to this many rows (a window's drafting slots' rows), prompt tiles
# past it (a paused layer's rows read at once)
MTP_DECODE_TILE_ROWS = 64


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """A block's per-segment outputs as the window's rows (segments hold consecutive rows, in order): a window of
    one sequence keeps its output as is, with no copy."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _finished(delta) -> torch.Tensor:
    """A block's output as a tensor (a deferred MoE output's pairs added, as its own combine kernel adds them)."""
    return combine_triton(delta) if isinstance(delta, PairSum) else delta


def _rows_for(window: Window):
    """Decode windows (one row per sequence) run per-row work row-invariantly, so batched rows equal solo rows."""
    return in_row_blocks if window.is_decode else plain


def split_qkv(a: AttentionSpec, qkv: torch.Tensor):
    """The fused projection's output [R, q_out + 2*Hkv*D] -> q [R, H, D], k, v [R, Hkv, D], and the output gate
    [R, H, D] (None without one; with one, each head's q_proj rows are [q | gate]). All views of qkv."""
    r, d = qkv.shape[0], a.head_dim
    q_out = a.num_heads * d * (2 if a.output_gate else 1)
    q, k, v = qkv.split([q_out, a.num_kv_heads * d, a.num_kv_heads * d], dim=-1)
    gate = None
    if a.output_gate:
        q, gate = q.reshape(r, a.num_heads, 2 * d).chunk(2, dim=-1)
    return q.reshape(r, a.num_heads, d), k.reshape(r, a.num_kv_heads, d), v.reshape(r, a.num_kv_heads, d), gate
