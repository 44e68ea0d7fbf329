"""Load a layer range's tensors from a checkpoint into neutral, compute-ready form.

Neutral names per layer (shapes in torch orientation, [out, in]):
  attn_norm, mlp_norm                        [hidden] float32 (norm offsets folded in)
  attention: qkv [q_out + 2*Hkv*D, hidden] (q_out = H*D, or 2*H*D with the output gate: per head [q | gate]),
             qkv_bias (optional), q_norm, k_norm [D], o [hidden, H*D]
  gdn:       in_proj [conv_dim + value_dim + 2*Hv, hidden] (rows: q, k, v | z | b | a), conv [conv_dim, K],
             neg_a [Hv] (= -exp(A_log)), dt_bias [Hv], norm [Dv], out [hidden, value_dim], and out_heads [Hv]
             int64 where `out` stays packed with its value heads' columns in the file's order (GGUF Qwen3.5)
  dense:     gate_up [2I, hidden], down [hidden, I]
  moe:       router [E, hidden], experts_gate_up [E, 2I, hidden], experts_down [E, hidden, I],
             shared_gate_up, shared_down, shared_gate [1, hidden] (when the spec has them)
             With some experts in host RAM (`resident`): experts_gate_up / experts_down hold the M resident ones
             only, expert_slot [E] int32 maps a global id to its slot (M: not here), and `offloaded` holds the
             rest on the host (`strata.experts.residency.split_experts`).
Only the named layers are read, so a stage holds no tensor of another stage's layers.

With `packed`, the projections, experts and head of a quantized checkpoint (GGUF Q8_0 / Q4_K / Q5_K / Q6_K, FP8
blocks of 128 columns) stay quantized as `PackedWeight`s, which the Triton kernels read (`strata.kernels.packed`);
a tensor of another type, a fused tensor whose parts differ in type, the embedding and the router are dequantized
at load, and the load's log line says how many tensors went which way. `packed_kernels="cpu"`: kept for the CPU's
own kernel instead (`strata.kernels.cpu_packed`: its formats, GGUF Q4_1 among them), marked `host_kernel`; a tied
head gets a packed copy of its own then (the embedding's lookups read the plain table).
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field

import torch

from strata.errors import CheckpointError
from strata.model.checkpoint import Checkpoint
from strata.model.families import Family
from strata.model.spec import ModelSpec
from strata.quant import packed as pk
from strata.quant.packed import PackedWeight

Tensors = dict[str, torch.Tensor | PackedWeight]
log = logging.getLogger("strata.engine")


def _nbytes(t: torch.Tensor | PackedWeight) -> int:
    return t.nbytes() if isinstance(t, PackedWeight) else t.numel() * t.element_size()


@dataclass
class StageWeights:
    layers: dict[int, Tensors]
    embed: torch.Tensor | None = None  # [V, hidden], on the stage that owns the embedding
    final_norm: torch.Tensor | None = None
    lm_head: torch.Tensor | None = None  # [V, hidden]; the embedding itself when tied
    mtp: Tensors = field(default_factory=dict)  # raw mtp.* tensors, kept for drafting
    held: dict[int, Tensors] = field(default_factory=dict)  # other stages' dense tensors, when not trimmed (unused)
    offloaded: dict[int, Tensors] = field(default_factory=dict)  # per MoE layer, the experts kept in host RAM

    def host_nbytes(self) -> int:
        """Bytes of the experts kept in host RAM for the CPU pool (not counted by `nbytes`)."""
        return sum(_nbytes(t) for layer in self.offloaded.values() for t in layer.values())

    def nbytes(self) -> int:
        seen, total = set(), 0
        tensors = [t for layers in (self.layers, self.held) for layer in layers.values() for t in layer.values()]
        tensors += [t for t in (self.embed, self.final_norm, self.lm_head) if t is not None] + list(self.mtp.values())
        for t in tensors:
            key = id(t) if getattr(t, "is_mkldnn", False) else t.data_ptr()  # a oneDNN-blocked matrix has no data pointer to share
            if key not in seen:
                seen.add(key)
                total += _nbytes(t)
        return total


class _Reader:
    def __init__(self, ckpt: Checkpoint, device: torch.device, dtype: torch.dtype, packed: bool = False,
                 packed_kernels: str = "triton"):
        self.ckpt, self.device, self.dtype = ckpt, device, dtype
        self.names = set(ckpt.names())
        self.packed = packed and hasattr(ckpt, "load_packed")
        self.host_kernel = packed_kernels == "cpu"
        if self.host_kernel:
            from strata.kernels import cpu_packed

            self.formats = frozenset(cpu_packed.FORMATS)
        else:
            self.formats = frozenset(pk.KERNEL_FORMAT)  # what the Triton kernels read
        self.quantizes = getattr(ckpt, "quantizes", False)  # quantized as it loads (`strata.quant.online`)
        self.kept = Counter()  # stored type -> matrices kept packed
        self.dequantized = Counter()  # stored type -> matrices dequantized at load (with `packed`)
        self._stored = {}  # id of a packed matrix handed out -> its stored type (a fused one may undo it)

    def matrix(self, name: str, shape: tuple[int, ...], device: torch.device | None = None,
               packed: bool = True) -> torch.Tensor | PackedWeight:
        """A projection's or experts' weight: packed when the reader packs and the checkpoint stores it so. A
        checkpoint that quantizes as it loads (`strata.quant.online`) gives its quantized values either way:
        written out in the reader's dtype where the weight is not kept packed."""
        keep = self.packed and packed
        if not keep and not self.quantizes:
            return self.get(name, shape, device=device)
        if name not in self.names:
            raise CheckpointError(f"{self.ckpt.path}: tensor {name!r} is missing from the checkpoint")
        w = self.ckpt.load_packed(name, self.dtype)
        kind = self.ckpt.qtype_name(name)
        if w is None:
            self.dequantized[kind] += 1
            return self.get(name, shape, device=device)
        self._check_shape(name, w, shape)
        if not keep or w.fmt not in self.formats:  # (a format these kernels do not read: its values written out)
            self.dequantized[kind] += 1
            return self.plain(w).to(device or self.device).contiguous()
        return self._kept(w, kind, device)

    def _check_shape(self, name: str, w: torch.Tensor | PackedWeight, shape: tuple[int, ...]) -> None:
        if tuple(w.shape) != tuple(shape):
            raise CheckpointError(
                f"{self.ckpt.path}: tensor {name!r} has shape {list(w.shape)}, the config implies {list(shape)}")

    def _kept(self, w: PackedWeight, kind: str, device: torch.device | None = None) -> PackedWeight:
        """A packed weight kept as it is, on the device, counted (and remembered, should a join undo it)."""
        self.kept[kind] += 1
        w = w.to(device or self.device)
        w.host_kernel = self.host_kernel
        self._stored[id(w)] = kind
        return w

    def matrix_columns(self, name: str, shape: tuple[int, ...]) -> tuple[torch.Tensor | PackedWeight, torch.Tensor | None]:
        """A projection's weight and, where it stays packed with its stored columns in another order than
        transformers' (a GGUF Qwen3.5 `out_proj`), that order (transformers' column j is column order[j]); else
        `matrix`'s weight and None."""
        if self.packed and hasattr(self.ckpt, "load_packed_columns"):
            found = self.ckpt.load_packed_columns(name, self.dtype)
            if found is not None and found[0].fmt in self.formats:
                w, order = found
                self._check_shape(name, w, shape)
                return self._kept(w, self.ckpt.qtype_name(name)), order
        return self.matrix(name, shape), None

    def cat(self, parts: list, dim: int = 0) -> torch.Tensor | PackedWeight:
        """Weights joined along rows: packed when every part is packed alike, else all dequantized."""
        if all(isinstance(p, PackedWeight) for p in parts) and len({p.fmt for p in parts}) == 1:
            return pk.cat(parts, dim)
        for p in parts:
            if isinstance(p, PackedWeight):  # counted as kept when read: it is not, after all
                kind = self._stored.pop(id(p), None)
                if kind is not None:
                    self.kept -= Counter({kind: 1})
                self.dequantized["mixed types"] += 1
        return torch.cat([self.plain(p) for p in parts], dim)

    def plain(self, w: torch.Tensor | PackedWeight) -> torch.Tensor:
        return pk.dequantize(w).to(self.dtype) if isinstance(w, PackedWeight) else w

    def summary(self) -> str | None:
        if not (self.packed or self.quantizes) or not (self.kept or self.dequantized):
            return None
        say = lambda c: ", ".join(f"{n} {k}" for k, n in sorted(c.items())) or "none"  # noqa: E731
        if self.quantizes:
            return (f"matrices quantized as they load (--quantization): kept packed on the device: {say(self.kept)}; "
                    f"written out in {str(self.dtype).removeprefix('torch.')}: {say(self.dequantized)}")
        return f"weights kept quantized on the device: {say(self.kept)}; dequantized at load: {say(self.dequantized)}"

    def has(self, name: str) -> bool:
        return name in self.names

    def get(self, name: str, shape: tuple[int, ...] | None = None, dtype: torch.dtype | None = None,
            device: torch.device | None = None) -> torch.Tensor:
        if name not in self.names:
            raise CheckpointError(f"{self.ckpt.path}: tensor {name!r} is missing from the checkpoint")
        t = self.ckpt.load(name, dtype or self.dtype)
        if shape is not None:
            self._check_shape(name, t, shape)
        return t.to(device or self.device).contiguous()

    def norm(self, name: str, dim: int, offset: float) -> torch.Tensor:
        w = self.get(name, (dim,), torch.float32)
        return w + offset if offset else w


def _attention(r: _Reader, p: str, spec: ModelSpec, offset: float) -> Tensors:
    a, hidden = spec.attention, spec.hidden_size
    q_out = a.num_heads * a.head_dim * (2 if a.output_gate else 1)
    kv_out = a.num_kv_heads * a.head_dim
    w = {
        "qkv": r.cat(
            [r.matrix(f"{p}q_proj.weight", (q_out, hidden)), r.matrix(f"{p}k_proj.weight", (kv_out, hidden)),
             r.matrix(f"{p}v_proj.weight", (kv_out, hidden))]
        ),
        "o": r.matrix(f"{p}o_proj.weight", (hidden, a.num_heads * a.head_dim)),
    }
    if r.has(f"{p}q_proj.bias"):
        w["qkv_bias"] = torch.cat(
            [r.get(f"{p}q_proj.bias", (q_out,)), r.get(f"{p}k_proj.bias", (kv_out,)), r.get(f"{p}v_proj.bias", (kv_out,))]
        )
    if a.qk_norm:
        w["q_norm"] = r.norm(f"{p}q_norm.weight", a.head_dim, offset)
        w["k_norm"] = r.norm(f"{p}k_norm.weight", a.head_dim, offset)
    return w


def _gdn(r: _Reader, p: str, spec: ModelSpec, family: Family) -> Tensors:
    g, hidden = spec.gdn, spec.hidden_size
    hv = g.num_v_heads
    if family.gdn_projection == "fused_qkvz":
        # rows grouped per key head: [q | k | v (Hv/Hk heads) | z (Hv/Hk heads)], and [b | a] likewise
        per = hv // g.num_k_heads
        sizes = [g.k_head_dim, g.k_head_dim, per * g.v_head_dim, per * g.v_head_dim]
        qkvz = r.matrix(f"{p}in_proj_qkvz.weight", (2 * g.key_dim + 2 * g.value_dim, hidden))
        ba = r.matrix(f"{p}in_proj_ba.weight", (2 * hv, hidden))
        # the rows regrouped: [q | k | v | z] of every key head, then [b | a] likewise
        order = torch.cat([t.reshape(-1) for t in torch.arange(qkvz.shape[0]).reshape(g.num_k_heads, -1).split(sizes, 1)])
        order_ba = torch.cat([t.reshape(-1) for t in torch.arange(2 * hv).reshape(g.num_k_heads, -1).split([per, per], 1)])
        in_proj = r.cat([_take_rows(qkvz, order), _take_rows(ba, order_ba)])
    else:
        in_proj = r.cat(
            [r.matrix(f"{p}in_proj_qkv.weight", (g.conv_dim, hidden)),
             r.matrix(f"{p}in_proj_z.weight", (g.value_dim, hidden)),
             r.matrix(f"{p}in_proj_b.weight", (hv, hidden)), r.matrix(f"{p}in_proj_a.weight", (hv, hidden))]
        )
    t = {
        "in_proj": in_proj.contiguous(),
        "conv": r.get(f"{p}conv1d.weight", (g.conv_dim, 1, g.conv_kernel)).reshape(g.conv_dim, g.conv_kernel),
        "neg_a": -r.get(f"{p}A_log", (hv,), torch.float32).exp(),
        "dt_bias": r.get(f"{p}dt_bias", (hv,), torch.float32),
        "norm": r.get(f"{p}norm.weight", (g.v_head_dim,), torch.float32),
    }
    t["out"], order = r.matrix_columns(f"{p}out_proj.weight", (hidden, g.value_dim))
    if order is not None:
        heads = _stored_heads(order, hv, g.v_head_dim)
        if heads is None:  # columns moved within heads: written out in transformers' order after all
            t["out"] = r.plain(t["out"])[:, order.to(t["out"].device)].contiguous()
        else:
            t["out_heads"] = heads.to(r.device)
    return t


def _stored_heads(order: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor | None:
    """For an out projection kept with its value heads' columns in another order (`order`, transformers' column j
    is stored column order[j]): the index that puts a row's heads [Hv, Dv] in the stored order (`out_heads`: the
    forward takes `out.index_select(1, out_heads)` before the product); None when `order` moves columns within a
    head."""
    blocks = order.reshape(heads, head_dim)
    first = blocks[:, 0]
    if bool((first % head_dim).any()) or not torch.equal(blocks, first[:, None] + torch.arange(head_dim)):
        return None
    return torch.argsort(first // head_dim)


def _take_rows(w: torch.Tensor | PackedWeight, order: torch.Tensor) -> torch.Tensor | PackedWeight:
    return w.rows(order) if isinstance(w, PackedWeight) else w[order.to(w.device)]


def _swiglu(r: _Reader, p: str, hidden: int, dim: int, device: torch.device | None = None,
            packed: bool = True) -> tuple:
    gate_up = r.cat([r.matrix(f"{p}gate_proj.weight", (dim, hidden), device, packed),
                     r.matrix(f"{p}up_proj.weight", (dim, hidden), device, packed)])
    return gate_up, r.matrix(f"{p}down_proj.weight", (hidden, dim), device, packed)


def _experts(r: _Reader, p: str, spec: ModelSpec, device: torch.device | None = None, packed: bool = True) -> tuple:
    """`packed` False: read dequantized (experts split between the device and the CPU pool)."""
    m, hidden = spec.moe, spec.hidden_size
    e, i = m.num_experts, m.expert_dim
    if r.has(f"{p}gate_up_proj"):  # fused 3-D tensors
        return (r.matrix(f"{p}gate_up_proj", (e, 2 * i, hidden), device, packed),
                r.matrix(f"{p}down_proj", (e, hidden, i), device, packed))
    if r.has(f"{p}gate_proj"):  # stacked 3-D tensors (GGUF)
        gate_up = r.cat([r.matrix(f"{p}gate_proj", (e, i, hidden), device, packed),
                         r.matrix(f"{p}up_proj", (e, i, hidden), device, packed)], dim=1)
        return gate_up, r.matrix(f"{p}down_proj", (e, hidden, i), device, packed)
    pairs = [_swiglu(r, f"{p}{x}.", hidden, i, device, packed) for x in range(e)]
    return _stack(r, [gu for gu, _ in pairs]), _stack(r, [d for _, d in pairs])


def _stack(r: _Reader, parts: list) -> torch.Tensor | PackedWeight:
    if all(isinstance(p, PackedWeight) for p in parts) and len({p.fmt for p in parts}) == 1:
        return pk.stack(parts)
    return torch.stack([r.plain(p) for p in parts])


def _mlp(r: _Reader, p: str, spec: ModelSpec, kind: str, resident: tuple[int, ...] | None = None,
         offloaded: Tensors | None = None, split_packed: bool = True) -> Tensors:
    """`resident`: the ids of the experts this layer keeps on the device (None: all); the others are read into
    host RAM only and put in `offloaded` (packed as the device's, with `split_packed` and a packing reader; the CPU
    pool reads q4_k experts as they are, `strata.experts.pool`)."""
    hidden = spec.hidden_size
    if kind == "dense":
        gate_up, down = _swiglu(r, p, hidden, spec.dense_dim)
        return {"gate_up": gate_up, "down": down}
    m = spec.moe
    w = {"router": r.get(f"{p}gate.weight", (m.num_experts, hidden))}
    if resident is None:
        w["experts_gate_up"], w["experts_down"] = _experts(r, f"{p}experts.", spec)
    else:  # read on the host, so the device never holds more than the resident experts
        from strata.experts.residency import split_experts

        on_device, on_host = split_experts(
            *_experts(r, f"{p}experts.", spec, torch.device("cpu"), packed=split_packed), resident, r.device)
        w |= on_device
        offloaded.update(on_host)
    if m.shared_dim:
        w["shared_gate_up"], w["shared_down"] = _swiglu(r, f"{p}shared_expert.", hidden, m.shared_dim)
        if m.shared_gate:
            w["shared_gate"] = r.get(f"{p}shared_expert_gate.weight", (1, hidden))
    return w


def load_stage_weights(
    ckpt: Checkpoint,
    family: Family,
    spec: ModelSpec,
    layers: range,
    device: torch.device,
    dtype: torch.dtype,
    *,
    first: bool = True,
    last: bool = True,
    trim: bool = True,
    resident: dict[int, tuple[int, ...]] | None = None,
    packed: bool = False,
    split_packed: bool = True,
    packed_kernels: str = "triton",
) -> StageWeights:
    """Read the tensors of `layers` (plus the embedding on the first stage and the head on the last).

    Without `trim`, a stage also holds every other layer's dense tensors (all but the routed experts), as an
    untrimmed stage of the original system did: they are never used, only held (`--trim-stage-weights` off).
    `resident`: for MoE layers that keep only some experts on `device`, their ids (`strata.experts.residency`);
    the other experts go to `StageWeights.offloaded` in host RAM. `packed`: quantized weights stay quantized where
    the checkpoint allows (the module's docstring); `split_packed` False: not the experts split by `resident`
    (hot residency swaps them as plain tensors). `packed_kernels`: which kernels read them, "triton" or "cpu" (the
    module's docstring)."""
    r = _Reader(ckpt, device, dtype, packed, packed_kernels)
    pre, off, hidden = family.prefix, family.norm_offset, spec.hidden_size
    resident = resident or {}
    offloaded: dict[int, Tensors] = {}

    def layer_tensors(i: int, experts: bool) -> Tensors:
        p = f"{pre}layers.{i}."
        layer = spec.layers[i]
        w = {"attn_norm": r.norm(f"{p}input_layernorm.weight", hidden, off),
             "mlp_norm": r.norm(f"{p}post_attention_layernorm.weight", hidden, off)}
        w |= _attention(r, f"{p}self_attn.", spec, off) if layer.mixer == "attention" else _gdn(r, f"{p}linear_attn.", spec, family)
        if experts and i in resident:
            w |= _mlp(r, f"{p}mlp.", spec, layer.mlp, resident[i], offloaded.setdefault(i, {}), split_packed)
        elif experts or layer.mlp == "dense":
            w |= _mlp(r, f"{p}mlp.", spec, layer.mlp)
        return w

    weights = StageWeights(layers={i: layer_tensors(i, experts=True) for i in layers}, offloaded=offloaded)
    if not trim:
        weights.held = {i: layer_tensors(i, experts=False) for i in range(spec.num_layers) if i not in layers}
    embed_shape = (spec.vocab_size, hidden)
    if first or (last and spec.tie_embeddings):
        weights.embed = r.get(f"{pre}embed_tokens.weight", embed_shape)
    if last:
        weights.final_norm = r.norm(f"{pre}norm.weight", hidden, off)
        if spec.tie_embeddings or not r.has("lm_head.weight"):
            if not spec.tie_embeddings:
                raise CheckpointError(f"{ckpt.path}: tensor 'lm_head.weight' is missing and the config does not tie embeddings")
            weights.lm_head = weights.embed
            table = f"{pre}embed_tokens.weight"
            if r.host_kernel and r.packed and getattr(r.ckpt, "packed_format", lambda _: None)(table) in r.formats:
                weights.lm_head = r.matrix(table, embed_shape)  # the CPU kernel reads the head packed; the
                # embedding's lookups read the plain table
        else:
            weights.lm_head = r.matrix("lm_head.weight", embed_shape)
        weights.mtp = {n: r.get(n, dtype=torch.int64 if n == "mtp.draft_vocab" else None)
                       for n in sorted(r.names) if n.startswith("mtp.")}
        if not first and spec.tie_embeddings:
            weights.embed = None  # the last stage keeps only the head
    if (said := r.summary()) is not None:
        log.info("%s", said)
    return weights


def mtp_tensors(raw: Tensors, family: Family, spec: ModelSpec, device: torch.device, dtype: torch.dtype,
                source: str) -> Tensors:
    """The first multi-token-prediction layer (`mtp.*`, the Qwen3-Next layout) in neutral, compute-ready names:
    pre_embed_norm, pre_hidden_norm [hidden], fc [hidden, 2*hidden] (input: [norm(embedding) | norm(hidden)]),
    a decoder layer of the model's full-attention kind (attn_norm, mlp_norm, qkv, o, ..., and a dense or MoE MLP,
    whichever its tensors are), final_norm [hidden], and draft_vocab [N] int64 when the head scores only those
    tokens (a Strata extension; absent: the whole vocabulary). `source` names where `raw` came from in errors."""
    from strata.model.checkpoint import StateDictCheckpoint

    r = _Reader(StateDictCheckpoint({}, raw, source), device, dtype)
    off, hidden, p = family.norm_offset, spec.hidden_size, "mtp.layers.0."
    w = {"pre_embed_norm": r.norm("mtp.pre_fc_norm_embedding.weight", hidden, off),
         "pre_hidden_norm": r.norm("mtp.pre_fc_norm_hidden.weight", hidden, off),
         "fc": r.get("mtp.fc.weight", (hidden, 2 * hidden)),
         "final_norm": r.norm("mtp.norm.weight", hidden, off),
         "attn_norm": r.norm(f"{p}input_layernorm.weight", hidden, off),
         "mlp_norm": r.norm(f"{p}post_attention_layernorm.weight", hidden, off)}
    w |= _attention(r, f"{p}self_attn.", spec, off)
    kind = "moe" if r.has(f"{p}mlp.gate.weight") else "dense"
    if kind == "moe" and spec.moe is None or kind == "dense" and not r.has(f"{p}mlp.gate_proj.weight"):
        raise CheckpointError(f"{source}: the MTP layer has neither a dense MLP ({p}mlp.gate_proj.weight) nor "
                              f"one of this model's MoE blocks ({p}mlp.gate.weight)")
    if kind == "dense":
        dim = raw[f"{p}mlp.gate_proj.weight"].shape[0]
        w["gate_up"], w["down"] = _swiglu(r, f"{p}mlp.", hidden, dim)
    else:
        w |= _mlp(r, f"{p}mlp.", spec, "moe")
    if r.has("mtp.draft_vocab"):
        vocab = r.get("mtp.draft_vocab", dtype=torch.int64)
        if vocab.ndim != 1 or not len(vocab) or int(vocab.min()) < 0 or int(vocab.max()) >= spec.vocab_size:
            raise CheckpointError(f"{source}: mtp.draft_vocab must list token ids in 0..{spec.vocab_size - 1}")
        w["draft_vocab"] = vocab
    return w


def count_mtp_layers(names: list[str]) -> int:
    ids = {n.split(".")[2] for n in names if n.startswith("mtp.layers.")}
    return len(ids)
