"""The decode rows' work between a CPU stage's products, in C: the residual add and RMSNorm, the attention block, a
MoE layer's routed experts, and a whole stage of dense layers.

A decode step of SmolLM2-135M on 2 cores of an AMD EPYC spent more time in some two hundred small torch ops a layer
(qkv views, rotary's cat / neg / mul, K/V appends, the attention's permutes and two small matmuls, norms over rows
padded to a block) than in its products. `cpu_decode.c` does each of those runs in one call:

- `rms_norm`: a residual add and the next norm, each row on its own (no padding to a block of rows);
- `attention`: from the qkv product's rows to the o product's input: q / k norms (Qwen3), rotary, each row's key and
  value written to its sequence's cell, and each query head over its sequence's cells (float32 cells, found by
  address: `cell_table`);
- `experts`: a MoE layer's routed experts on packed weights (each expert a task of its own);
- `Stage`: every layer of a stage of attention layers whose matrices are all on the packed kernel
  (`strata.kernels.cpu_packed`), dense MLPs or routed experts (routing included), the products through that
  library's own function: one call a decode window (7.7 -> 3.7 ms a step of the default with the attention and then
  the stage in C, A/B in process).

Every output is computed by one thread in one fixed order from its own row and its own sequence's cells, so a row
is bitwise the same alone or beside others (the row invariance decode windows need). The library is
`cpu_decode.so` beside the source (an image ships it built: the Dockerfile calls `build(SHIPPED)`), else built with
gcc on the host the first time (`strata.kernels.native_build`). It needs AVX2 and FMA; where it cannot be had, or
STRATA_CPU_DECODE=0, `available()` is False (why: in the log, once) and the stage runs the torch ops.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch

from strata.kernels import cpu_packed, native_build
from strata.quant.packed import PackedWeight

log = logging.getLogger("strata.engine")
SOURCE = Path(__file__).resolve().parent / "cpu_decode.c"
SHIPPED = SOURCE.with_suffix(".so")  # built into an image by its Dockerfile (`build`)
FLAGS = ["-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC", "-lm"]
CPU_FLAGS = {"avx2", "fma"}


def build(out: Path) -> str | None:
    """Compile the kernels into `out`; the compiler's complaint when it cannot."""
    return native_build.build(SOURCE, FLAGS, out)


@functools.cache
def _loaded() -> tuple[ctypes.CDLL | None, str]:
    """The library and, where it cannot be had, why."""
    lib, why_not = native_build.load_for_cpu("STRATA_CPU_DECODE", CPU_FLAGS, SOURCE, FLAGS, SHIPPED,
                                             "decode rows run torch's ops on the CPU")
    if lib is None:
        return None, why_not
    i64, ptr, f32, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
    lib.cpu_decode_rms_norm.argtypes = [ptr, ptr, ptr, f32, i64, i64, ptr, ptr]
    lib.cpu_decode_rms_norm.restype = None
    lib.cpu_decode_attention.argtypes = [ptr, i64, i64, i32, i32, i32, i32, i32, ptr, ptr, ptr, ptr, f32, ptr, ptr,
                                         i64, ptr, f32, ptr, i32]
    lib.cpu_decode_attention.restype = i32
    lib.cpu_decode_stage.argtypes = [ptr, ptr, ptr, ptr, i64, ptr, ptr, ptr, i64, ptr, i32]
    lib.cpu_decode_stage.restype = i32
    lib.cpu_decode_experts.argtypes = [ptr, ptr, i64, i64, i64, i64, ptr, ptr, i64, i32, ptr, i64, i64, i32, ptr, i64,
                                       i64, ptr, i32]
    lib.cpu_decode_experts.restype = i32
    return lib, ""


def _load() -> ctypes.CDLL | None:
    return _loaded()[0]


def available() -> bool:
    """Whether the kernels can run here (CPU, library, STRATA_CPU_DECODE)."""
    return _load() is not None


def why() -> str:
    """Why the kernels cannot run here ("" where they can)."""
    return _loaded()[1]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             delta: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode rows' residual add and RMSNorm in one call: x, delta [R, D] float32, weight [D] float32 ->
    (norm(x + delta) * weight, x + delta); each row on its own, whatever R."""
    x = x.contiguous()
    r, d = x.shape
    delta = None if delta is None else delta.contiguous()
    weight = weight.contiguous()
    summed, out = torch.empty(r, d), torch.empty(r, d)
    _load().cpu_decode_rms_norm(x.data_ptr(), None if delta is None else delta.data_ptr(), weight.data_ptr(), eps, r,
                                d, summed.data_ptr(), out.data_ptr())
    return out, summed


def _linear_address() -> ctypes.c_void_p:
    """The packed kernel's product (`cpu_packed_linear`), as the C code here calls it."""
    return ctypes.cast(cpu_packed._load().cpu_packed_linear, ctypes.c_void_p)


def _kernel_experts(w) -> bool:
    """Whether w is a stack of experts [E, N, K] packed for the CPU's kernel, its records contiguous."""
    return (isinstance(w, PackedWeight) and w.host_kernel and w.ndim == 3 and w.fmt in cpu_packed.FORMATS
            and w.data.is_contiguous())


def takes_experts(x: torch.Tensor, gate_up, down) -> bool:
    """Whether `experts` takes these rows and stacked experts: float32 rows on the CPU, both matrices packed for the
    CPU's kernel ([E, N, K] records, `cpu_packed.FORMATS`), the libraries at hand."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and available() and cpu_packed.available()
            and _kernel_experts(gate_up) and _kernel_experts(down))


def experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up, down) -> torch.Tensor:
    """Decode rows' routed experts in one call: x [R, H] float32, weights, ids [R, k] (each row's choices; an id >=
    E: an expert not held here, adding nothing), gate_up [E, 2I, H], down [E, H, I] packed (`takes_experts`) ->
    [R, H], each row the sum over its choices in order of weight x down(silu(gate) x up); a row alone equals itself
    beside others."""
    r, h = x.shape
    e, two_i, _ = gate_up.shape
    x = x.contiguous()
    ids = ids.to(torch.int64).contiguous()
    weights = weights.float().contiguous()
    out = torch.empty(r, h)
    fmt = cpu_packed.FORMATS.index
    if r and _load().cpu_decode_experts(
            _linear_address(), x.data_ptr(), r, h, two_i // 2, ids.shape[1], ids.data_ptr(), weights.data_ptr(), e,
            fmt(gate_up.fmt), gate_up.data.data_ptr(), gate_up.data.stride(0), gate_up.data.shape[-1],
            fmt(down.fmt), down.data.data_ptr(), down.data.stride(0), down.data.shape[-1], out.data_ptr(),
            torch.get_num_threads()):
        raise MemoryError("cpu_decode.experts: no memory for its buffers")
    return out


def cell_table(window, layers: list[int], head_cells: int) -> torch.Tensor | None:
    """The addresses of each decode row's sequence's K and V cells, layer by layer: [len(layers), 2, R] int64 (what
    `attention` and `Stage.run` read), or None where a sequence's cells are not laid out as `attention` reads them
    (float32 on the CPU, a cell's heads packed: `head_cells` floats a cell). Read from the window's pool where its
    sequences share one (the same addresses either way)."""
    pool, r = window.pool, window.num_rows
    if pool is not None:
        key = ("cpu_decode_cells", tuple(layers), head_cells)
        got = pool.__dict__.get(key)  # (each layer's K and V addresses [n, 2, 1], bytes a sequence [n, 1, 1]) or None
        if got is None and key not in pool.__dict__:  # read once a pool: its tensors never move
            ks, vs = [pool.k[i] for i in layers], [pool.v[i] for i in layers]
            if all(_laid_out(t[0], head_cells) for t in (*ks, *vs)):
                got = (torch.tensor([[k.data_ptr(), v.data_ptr()] for k, v in zip(ks, vs)])[:, :, None],
                       torch.tensor([k.stride(0) * 4 for k in ks])[:, None, None])
            pool.__dict__[key] = got
        if got is None:
            return None
        bases, step = got
        return bases + window.seq_ids.to(torch.int64)[None, None, :] * step
    table = torch.empty(len(layers), 2, r, dtype=torch.int64)
    for j, i in enumerate(layers):
        for seg in window.segments:  # one row each (a decode window)
            k, v = seg.state.k[i], seg.state.v[i]
            if not (_laid_out(k, head_cells) and _laid_out(v, head_cells)):
                return None
            table[j, 0, seg.start], table[j, 1, seg.start] = k.data_ptr(), v.data_ptr()
    return table


def _laid_out(cells: torch.Tensor, head_cells: int) -> bool:
    """Whether a sequence's cells [L, Hkv, D] are float32 on the CPU, `head_cells` floats a cell, heads packed."""
    return (cells.device.type == "cpu" and cells.dtype == torch.float32 and cells.stride(0) == head_cells
            and cells.stride(2) == 1 and cells.stride(1) == cells.shape[2])


def attention(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int, gated: bool,
              cos: torch.Tensor, sin: torch.Tensor, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None,
              eps: float, cells: torch.Tensor, positions: torch.Tensor, scale: float) -> torch.Tensor:
    """Decode rows' attention block: qkv [R, H*D(*2 when gated: each head's [q | gate]) + 2*Hkv*D] float32, the
    product's rows; cos, sin [R, rotary_dim]; q_norm, k_norm [D] float32 or None; cells [2, R] the addresses of
    each row's sequence's K and V cells of this layer (`cell_table`), positions [R] each row's position. D is a
    multiple of 8. Writes each row's key and value to its cell, and returns the attention's output [R, H, D] (the gate
    not applied)."""
    r = qkv.shape[0]
    qkv = qkv.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    positions = positions.to(torch.int64).contiguous()
    cells = cells.contiguous()
    out = torch.empty(r, num_heads, head_dim)
    if r and _load().cpu_decode_attention(
            qkv.data_ptr(), r, qkv.shape[1], num_heads, num_kv_heads, head_dim, head_dim * (2 if gated else 1),
            cos.shape[1], cos.data_ptr(), sin.data_ptr(), *(None if n is None else n.data_ptr() for n in (q_norm, k_norm)),
            eps, cells.data_ptr(), cells.data_ptr() + r * 8, num_kv_heads * head_dim, positions.data_ptr(), scale,
            out.data_ptr(), torch.get_num_threads()):
        raise MemoryError("cpu_decode.attention: no memory for its buffers")
    return out


class _Matrix(ctypes.Structure):
    _fields_ = [("fmt", ctypes.c_int64), ("n", ctypes.c_int64), ("k", ctypes.c_int64), ("row_bytes", ctypes.c_int64),
                ("data", ctypes.c_void_p), ("bias", ctypes.c_void_p)]


class _Layer(ctypes.Structure):
    _fields_ = [("attn_norm", ctypes.c_void_p), ("mlp_norm", ctypes.c_void_p), ("q_norm", ctypes.c_void_p),
                ("k_norm", ctypes.c_void_p), ("qkv", _Matrix), ("o", _Matrix), ("gate_up", _Matrix),
                ("down", _Matrix), ("router", ctypes.c_void_p)] + [
                (name, ctypes.c_int64) for name in ("n_experts", "top_k", "norm_topk", "expert_dim",
                                                    "gate_up_stride", "down_stride")]


class _Stage(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int64) for name in ("n_layers", "hidden", "H", "Hkv", "D", "q_head_stride", "rot",
                                                    "inter")] + [("eps", ctypes.c_float), ("scale", ctypes.c_float)]


class Stage:
    """A stage of attention layers whose matrices are all on the CPU's packed kernel, its MLPs dense or routed
    experts without a shared one (Llama, Qwen3, Qwen3-MoE), run over a decode window's rows in one C call
    (`cpu_decode_stage`): the torch path's steps (norm, qkv, `attention`, o, add + norm, then gate_up, silu x up,
    down, or the router's top-k and `experts`, layer after layer), its Python between them gone. `of` says whether a
    stage qualifies."""

    def __init__(self, spec, layers: dict[int, dict], scale: float):
        a = spec.attention
        self.layers = list(layers)
        self._keep = []  # the tensors the C structs point into

        def matrix(m, bias=None) -> _Matrix:
            if bias is not None:
                bias = bias.float().contiguous()
                self._keep.append(bias)
            self._keep.append(m.data)
            return _Matrix(cpu_packed.FORMATS.index(m.fmt), m.shape[-2], m.shape[-1], m.data.shape[-1],
                           m.data.data_ptr(), None if bias is None else bias.data_ptr())

        table = (_Layer * len(layers))()
        for slot, (i, w) in zip(table, layers.items()):
            for name in ("attn_norm", "mlp_norm", "q_norm", "k_norm"):
                t = w.get(name) if name in ("attn_norm", "mlp_norm") or a.qk_norm else None
                if t is not None:
                    t = t.float().contiguous()
                    self._keep.append(t)
                setattr(slot, name, None if t is None else t.data_ptr())
            slot.qkv, slot.o = matrix(w["qkv"], w.get("qkv_bias")), matrix(w["o"])
            if spec.layers[i].mlp == "dense":
                slot.gate_up, slot.down = matrix(w["gate_up"]), matrix(w["down"])
                continue
            m = spec.moe
            router = w["router"].float().contiguous()
            self._keep.append(router)
            gate_up, down = w["experts_gate_up"], w["experts_down"]
            slot.gate_up, slot.down, slot.router = matrix(gate_up), matrix(down), router.data_ptr()
            slot.n_experts, slot.top_k, slot.norm_topk, slot.expert_dim = m.num_experts, m.top_k, m.norm_topk, m.expert_dim
            slot.gate_up_stride, slot.down_stride = gate_up.data.stride(0), down.data.stride(0)
        self._table = table
        self._shape = _Stage(len(layers), spec.hidden_size, a.num_heads, a.num_kv_heads, a.head_dim, a.head_dim,
                             a.rotary_dim, spec.dense_dim, spec.rms_eps, scale)
        self._linear = _linear_address()
        self.head_cells = a.num_kv_heads * a.head_dim

    @classmethod
    def of(cls, spec, layers: dict[int, dict]) -> bool:
        """Whether `Stage` runs these layers: every one an attention layer (no output gate, D a multiple of 8) with a
        dense MLP or routed experts of all its experts and no shared one, its matrices packed for the CPU's kernel
        (`cpu_packed.serves`; the experts' stacked likewise), the libraries at hand."""
        a = spec.attention
        if not (available() and cpu_packed.available() and layers and not a.output_gate and a.head_dim % 8 == 0):
            return False

        def takes(i: int, w: dict) -> bool:
            kind = spec.layers[i].mlp
            if spec.layers[i].mixer != "attention" or kind not in ("dense", "moe"):
                return False
            matrices = ("qkv", "o", "gate_up", "down") if kind == "dense" else ("qkv", "o")
            if not all(getattr(w.get(n), "host_kernel", False) and cpu_packed.serves(w[n]) for n in matrices):
                return False
            if kind == "dense":
                return tuple(w["gate_up"].shape) == (2 * spec.dense_dim, spec.hidden_size)
            m = spec.moe
            gate_up, down = w.get("experts_gate_up"), w.get("experts_down")
            return (not m.shared_dim and w["router"].dim() == 2 and w["router"].shape[0] == m.num_experts
                    and _kernel_experts(gate_up) and _kernel_experts(down)
                    and tuple(gate_up.shape) == (m.num_experts, 2 * m.expert_dim, spec.hidden_size)
                    and tuple(down.shape) == (m.num_experts, spec.hidden_size, m.expert_dim))

        return all(takes(i, w) for i, w in layers.items())

    def run(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cells: torch.Tensor,
            positions: torch.Tensor) -> torch.Tensor:
        """The stage's output for decode rows x [R, hidden] float32 (the stage's input; not changed) at `positions`,
        their cells `cell_table`'s."""
        x = x.float().contiguous().clone()
        cos, sin = cos.contiguous(), sin.contiguous()
        positions = positions.to(torch.int64).contiguous()
        cells = cells.contiguous()
        if x.shape[0] and _load().cpu_decode_stage(
                ctypes.byref(self._shape), self._table, self._linear, x.data_ptr(), x.shape[0], cos.data_ptr(),
                sin.data_ptr(), cells.data_ptr(), self.head_cells, positions.data_ptr(), torch.get_num_threads()):
            raise MemoryError("cpu_decode.Stage: no memory for its buffers")
        return x
