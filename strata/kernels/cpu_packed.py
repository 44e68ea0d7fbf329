"""Products over packed weights on the CPU: y = x @ W.T with W kept as `strata.quant.packed` row records.

The CPU engine used to dequantize a GGUF checkpoint's weights to float32 at load and run oneDNN's products over
them: SmolLM2-135M (q4_1 projections, a q8_0 head) then reads 540 MB a token. Kept packed it reads about 96 MB.
`cpu_packed.c` reads the records as they are: each weight row's 32 columns at a time become float codes in
registers, multiplied with every row of x (float32) and scaled per block (`FORMATS`). Each output is summed in one
fixed order whatever the rows beside it and the thread count (row invariance: a conversation's greedy output is
the same alone or beside others), and the threads share the weight rows, never K. A token of SmolLM2-135M on 2
cores of an AMD EPYC (bench/cpu_packed.py, 16 lanes / 8 lanes): 3.4 / 4.1 ms at one row against 14 ms for oneDNN
over float32 weights; 10.7 / 14.4 against 16.2 ms at 8 rows; from a few rows on the multiply-adds, not the memory,
are the limit, and at 32 rows oneDNN is faster (28 against 42 ms).

`linear` serves decode windows and small prompt windows; for a window of many rows `dequantize` (bit for bit
`strata.quant.packed.dequantize`, threaded) and a float GEMM may be faster (`project` chooses). The decode rows'
work between the products is `strata.kernels.cpu_decode`'s.

It needs an x86-64 CPU with AVX2, FMA and F16C (x86-64-v3). Where the CPU has AVX-512 the products run 16 lanes
wide (`use_wide`; STRATA_CPU_PACKED_WIDE=0 keeps 8): each width sums in its own fixed order, so a process keeps one.
The library is `cpu_packed.so` beside the source (images ship it built: the Dockerfile calls `build(SHIPPED)`),
else built with gcc on the host the first time (`strata.kernels.native_build`); load it after torch (it shares
torch's libgomp, which importing this module ensures). Where the CPU lacks the instructions, or there is no
library and no gcc, or STRATA_CPU_PACKED=0, `available()` is False (why: in the log, once) and callers keep
dequantized weights.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from pathlib import Path

import torch
import torch.nn.functional as F

from strata.kernels import native_build, onednn
from strata.quant.packed import PackedWeight

log = logging.getLogger("strata.engine")
SOURCE = Path(__file__).resolve().parent / "cpu_packed.c"
SHIPPED = SOURCE.with_suffix(".so")  # built into an image by its Dockerfile (`build`)
# the instructions it is built for (not -march=native: any x86-64-v3 CPU runs the library); no multiply-adds the
# source does not write, so the dequantizer's products and sums are rounded as torch rounds them
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC"]
CPU_FLAGS = {"avx2", "fma", "f16c"}
FORMATS = ("q8_0", "q4_1", "q4_k", "q6_k")  # in the kernel's numbering
_INDEX = {fmt: i for i, fmt in enumerate(FORMATS)}


def build(out: Path) -> str | None:
    """Compile the kernel into `out`; the compiler's complaint when it cannot."""
    return native_build.build(SOURCE, FLAGS, out)


@functools.cache
def _loaded() -> tuple[ctypes.CDLL | None, str]:
    """The library and, where it cannot be had, why."""
    lib, why_not = native_build.load_for_cpu("STRATA_CPU_PACKED", CPU_FLAGS, SOURCE, FLAGS, SHIPPED,
                                             "packed weights are dequantized at load on the CPU")
    if lib is None:
        return None, why_not
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.cpu_packed_linear.argtypes = [ctypes.c_int, ptr, i64, i64, ptr, i64, i64, ptr, ptr, ctypes.c_int]
    lib.cpu_packed_linear.restype = ctypes.c_int
    lib.cpu_packed_dequantize.argtypes = [ctypes.c_int, ptr, i64, i64, i64, ptr, ctypes.c_int]
    lib.cpu_packed_dequantize.restype = ctypes.c_int
    lanes = lib.cpu_packed_wide(0 if os.environ.get("STRATA_CPU_PACKED_WIDE") == "0" else -1)  # -1: the widest
    log.info("packed weights on the CPU: products %d lanes wide", lanes)
    return lib, ""


def _load() -> ctypes.CDLL | None:
    return _loaded()[0]


def available() -> bool:
    """Whether the kernel can run here (CPU, library, STRATA_CPU_PACKED)."""
    return _load() is not None


def why() -> str:
    """Why the kernel cannot run here ("" where it can)."""
    return _loaded()[1]


def use_wide(on: bool) -> int:
    """Runs the products 16 lanes wide (AVX-512, where the CPU has it: on) or 8 (AVX2) from now on in this process;
    returns the lanes in use (0 without the kernel). Each width sums in its own fixed order: a process keeps one."""
    lib = _load()
    return lib.cpu_packed_wide(int(on)) if lib is not None else 0


def serves(w) -> bool:
    """Whether `linear` and `dequantize` take `w`: a 2-D packed weight on the CPU in one of FORMATS."""
    return (isinstance(w, PackedWeight) and w.ndim == 2 and w.device.type == "cpu" and w.fmt in FORMATS
            and w.data.is_contiguous() and available())  # (K fits the format's blocks: `PackedWeight` checks it)


def linear(x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] float32 @ w.T (+ bias [N]) -> [..., N] float32, over a weight `serves` takes; threads:
    torch.get_num_threads()."""
    n, k = w.shape
    lead = None
    if x.dim() != 2:
        lead = x.shape[:-1]
        x = x.reshape(-1, k)
    if x.dtype != torch.float32:
        raise TypeError(f"cpu_packed.linear takes float32 activations, got {x.dtype}")
    if not x.is_contiguous():
        x = x.contiguous()
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        bias = bias.float().contiguous()
    rows = x.shape[0]
    y = torch.empty(rows, n)
    if rows and _load().cpu_packed_linear(_INDEX[w.fmt], x.data_ptr(), rows, k, w.data.data_ptr(), n,
                                          w.data.shape[1], None if bias is None else bias.data_ptr(), y.data_ptr(),
                                          torch.get_num_threads()):
        raise MemoryError("cpu_packed.linear: no memory for its buffers")
    return y if lead is None else y.reshape(*lead, n)


# products of up to this many rows run on the kernel; more rows (a prompt window's) write the weight out in float32
# and run oneDNN's GEMM, which the arithmetic bounds: on 2 cores of an AMD EPYC, SmolLM2-135M's matrices, 16 rows
# 0.52 against 0.83 ms, 32 rows 1.28 against 1.07, 256 rows 7.7 against 4.6. Decode windows hand the kernel parts
# of at most this many rows (`strata.kernels.invariant.in_row_blocks`): each row is summed alone either way.
KERNEL_ROWS = 16


def project(x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, w, bias) over a packed weight `serves` takes ([..., N, K] experts too, one 2-D entry at a time
    by the caller), for x [..., K] of any float dtype, the result in x's dtype: `linear` for up to KERNEL_ROWS rows,
    else the weight written out (`dequantize`) and a GEMM."""
    rows = x.numel() // max(1, x.shape[-1])
    xf = x if x.dtype == torch.float32 else x.float()
    if rows <= KERNEL_ROWS:
        y = linear(xf, w, bias)
    else:
        plain = dequantize(w)
        bias32 = None if bias is None else bias.float()
        y = onednn.linear(xf, plain, bias32) if onednn.available(torch.float32) else F.linear(xf, plain, bias32)
    return y if x.dtype == torch.float32 else y.to(x.dtype)


def dequantize(w: PackedWeight) -> torch.Tensor:
    """The float32 weight [..., N, K] a packed one stands for: bit for bit `strata.quant.packed.dequantize(w)`."""
    if w.ndim != 2:  # stacked experts: their rows as one matrix
        return dequantize(w.reshape_rows(-1)).reshape(w.shape)
    n, k = w.shape
    out = torch.empty(n, k)
    if _load().cpu_packed_dequantize(_INDEX[w.fmt], w.data.data_ptr(), n, k, w.data.shape[1], out.data_ptr(),
                                     torch.get_num_threads()):
        raise MemoryError("cpu_packed.dequantize: no memory for its buffers")
    return out
