"""The decode rows' work between a CPU stage's products, in C: the residual add and RMSNorm, and the attention block.

A decode step of SmolLM2-135M on 2 cores of an AMD EPYC spent more time in some two hundred small torch ops a layer
(qkv views, rotary's cat / neg / mul, K/V appends, the attention's permutes and two small matmuls, norms over rows
padded to a block) than in its products. `cpu_decode.c` does each of those runs in one call a layer:

- `rms_norm`: a residual add and the next norm, each row on its own (no padding to a block of rows);
- `attention`: from the qkv product's rows to the o product's input: q / k norms (Qwen3), rotary, each row's key and
  value written to its sequence's cell, and each query head over its sequence's cells, for the decode rows of a
  window whose sequences share one `StatePool` (float32 cells).

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
import os
from pathlib import Path

import torch

from strata.kernels import native_build

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
    if os.environ.get("STRATA_CPU_DECODE", "1") == "0":
        return None, "STRATA_CPU_DECODE=0"
    missing = CPU_FLAGS - native_build.cpu_flags()
    if missing:
        log.info("decode rows run torch's ops on the CPU: this CPU has no %s", ", ".join(sorted(missing)))
        return None, f"this CPU has no {', '.join(sorted(missing))}"
    lib, why_not = native_build.load(SOURCE, FLAGS, SHIPPED, "decode rows run torch's ops on the CPU")
    if lib is None:
        return None, why_not
    i64, ptr, f32, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
    lib.cpu_decode_rms_norm.argtypes = [ptr, ptr, ptr, f32, i64, i64, ptr, ptr]
    lib.cpu_decode_rms_norm.restype = None
    lib.cpu_decode_attention.argtypes = [ptr, i64, i64, i32, i32, i32, i32, i32, ptr, ptr, ptr, ptr, f32, ptr, ptr,
                                         i64, i64, ptr, ptr, f32, ptr, i32]
    lib.cpu_decode_attention.restype = i32
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


def takes(k_cells: torch.Tensor, v_cells: torch.Tensor, head_dim: int) -> bool:
    """Whether `attention` takes a layer whose cells are `k_cells`, `v_cells` [S, L, Hkv, D] (a pool's, on the
    CPU): float32, each cell's heads packed, K and V laid out alike, D a multiple of 8."""
    return (k_cells.device.type == "cpu" and k_cells.dtype == v_cells.dtype == torch.float32 and head_dim % 8 == 0
            and k_cells.stride() == v_cells.stride() and k_cells.stride(-1) == 1 and k_cells.stride(-2) == head_dim
            and available())


def attention(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int, gated: bool,
              cos: torch.Tensor, sin: torch.Tensor, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None,
              eps: float, k_cells: torch.Tensor, v_cells: torch.Tensor, seq_ids: torch.Tensor,
              positions: torch.Tensor, scale: float) -> torch.Tensor:
    """Decode rows' attention block: qkv [R, H*D(*2 when gated: each head's [q | gate]) + 2*Hkv*D] float32, the
    product's rows; cos, sin [R, rotary_dim]; q_norm, k_norm [D] or None; k_cells, v_cells [S, L, Hkv, D] a pool's
    cells (`takes`); seq_ids [R] each row's sequence in them, positions [R] its position. Writes each row's key and
    value to its cell, and returns the attention's output [R, H, D] (the gate not applied)."""
    r = qkv.shape[0]
    qkv = qkv.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    seq_ids = seq_ids.to(torch.int32).contiguous()
    positions = positions.to(torch.int64).contiguous()
    norms = [None if n is None else n.float().contiguous() for n in (q_norm, k_norm)]
    out = torch.empty(r, num_heads, head_dim)
    if r and _load().cpu_decode_attention(
            qkv.data_ptr(), r, qkv.shape[1], num_heads, num_kv_heads, head_dim, head_dim * (2 if gated else 1),
            cos.shape[1], cos.data_ptr(), sin.data_ptr(), *(None if n is None else n.data_ptr() for n in norms), eps,
            k_cells.data_ptr(), v_cells.data_ptr(), k_cells.stride(0), k_cells.stride(1), seq_ids.data_ptr(),
            positions.data_ptr(), scale, out.data_ptr(), torch.get_num_threads()):
        raise MemoryError("cpu_decode.attention: no memory for its buffers")
    return out
