"""The CPU expert pool's own kernel for bfloat16 experts, plain or q8_0 (`experts_bf16.c`): every expert of a window
in one OpenMP region, AVX512_BF16 dot products summed in float32, each output summed in one fixed order (a row's
bits do not depend on the rows beside it). On a 16-core GPU host it reads a window's plain experts at the host's full
read bandwidth for one row, where two oneDNN products an expert reach about half (docs/PERFORMANCE.md,
bench/cpu_experts.py). q8_0 experts are read as their records (`strata.quant.packed`: int8 codes and a float16
scale per 32 columns, 1.06 bytes a value): each 32 codes become bf16 exactly in registers and each group's sum is
scaled in float32.

It is compiled for the AVX-512 instructions it uses (`FLAGS`, not -march=native: the library runs on any CPU that
has them, so an image can ship it built: `experts_bf16.so` beside the source, which the Dockerfile makes), else
built on the host the first time a pool asks for it (into `$XDG_CACHE_HOME/strata/`, reused while the source is
the same), and loaded after torch, so it shares torch's libgomp. Where the CPU lacks AVX512_BF16, or there is no
built library and no gcc, or the build fails, `load` returns None (said once in the log) and the pool keeps
oneDNN's products. STRATA_POOL_KERNEL=0 turns it off.
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
SOURCE = Path(__file__).resolve().parent / "experts_bf16.c"
ALIGN = 32  # the kernel's dot products take 32 bf16 at a time: H and I multiples of it
# STRATA_POOL_SCHEDULE: how the kernel's loops share their units among its threads (the same results either way):
# dynamic (handed out one unit at a time as threads come free, the default: a preempted thread holds up no other;
# +9 % at one row in process and +26-29 % through the server with 16 threads on a 16-core host) or static (fixed
# shares)
SCHEDULES = {"static": (0, 0), "dynamic": (1, 1)}
# where a pool window's time goes in `pool_window`: the bookkeeping before the products (counting, grouping), the
# threads' wake-up (the region's start until its last thread came in), the gather and gate_up products, silu and
# the down products, the weighted sums
PHASES = ("bookkeeping", "wake-up", "gate_up", "down", "sums")


def cpu_has_bf16_dots(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Whether the CPU has AVX512_BF16 dot products, which the kernel needs (autoconfig reads it too)."""
    return "avx512_bf16" in native_build.cpu_flags(cpuinfo)


def amx_available() -> bool:
    """Whether this CPU has AMX's bf16 tiles (`amx_tile`, `amx_bf16`)."""
    return {"amx_tile", "amx_bf16"} <= native_build.cpu_flags()


def use_amx(on: bool, prefetch: int = 256) -> bool:
    """Runs the bf16 products on AMX tiles (on) or AVX-512 (off) from now on in this process; False where AMX is not
    to be had (no such CPU, no kernel, or Linux refused the tile state). `prefetch`: weight columns read ahead."""
    lib = load()
    if lib is None or (on and not amx_available()):
        return False
    return lib.amx_use(int(on), prefetch) == 0


def set_schedule(name: str) -> bool:
    """Shares the kernel's loops among its threads `name`'s way (SCHEDULES) from now on in this process; False
    without the kernel. STRATA_POOL_SCHEDULE sets it when the kernel loads."""
    if name not in SCHEDULES:
        raise ValueError(f"schedule {name!r}: expected one of {', '.join(SCHEDULES)}")
    lib = load()
    if lib is None:
        return False
    lib.pool_schedule(*SCHEDULES[name])
    return True


# no fused multiply-adds the source does not write: the weighted sums round each product as torch's ops would
FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma", "-mf16c", "-mamx-tile",
         "-mamx-bf16", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC"]
SHIPPED = SOURCE.with_suffix(".so")  # built into an image by its Dockerfile (`build`)


def build(out: Path) -> str | None:
    """Compile the kernel into `out` (atomically: a reader sees the whole file or none); the compiler's complaint
    when it cannot."""
    return native_build.build(SOURCE, FLAGS, out)


@functools.cache
def load() -> ctypes.CDLL | None:
    """The built kernel, or None where it cannot be had here (why: in the log, once)."""
    if os.environ.get("STRATA_POOL_KERNEL", "1") == "0":
        return None
    if not cpu_has_bf16_dots():
        log.info("the CPU expert pool uses oneDNN's products: this CPU has no AVX512_BF16 dot products")
        return None
    lib, _ = native_build.load(SOURCE, FLAGS, SHIPPED, "the CPU expert pool uses oneDNN's products")
    if lib is None:
        return None
    schedule = os.environ.get("STRATA_POOL_SCHEDULE", "dynamic")
    if schedule not in SCHEDULES:
        log.warning("STRATA_POOL_SCHEDULE=%s: expected one of %s; the CPU expert pool keeps dynamic shares", schedule,
                    ", ".join(SCHEDULES))
    else:
        lib.pool_schedule(*SCHEDULES[schedule])
    if os.environ.get("STRATA_POOL_AMX") == "1" and amx_available():
        if lib.amx_use(1, int(os.environ.get("STRATA_POOL_AMX_PREFETCH", "256"))) == 0:
            log.info("the CPU expert pool's bf16 products run on AMX tiles")
        else:
            log.warning("the CPU expert pool keeps AVX-512: Linux refused the AMX tile state")
    return lib


def usable(dtype: torch.dtype, hidden: int, width: int) -> bool:
    """Whether experts of this dtype and shape ([2I, H] and [H, I]) can run on the kernel here."""
    return dtype == torch.bfloat16 and hidden % ALIGN == 0 and width % ALIGN == 0 and load() is not None


def experts_bf16(x: torch.Tensor, counts: list[int], gate_up: list[torch.Tensor], down: list[torch.Tensor],
                 threads: int) -> torch.Tensor:
    """x [P, H] bf16, the rows of each expert in turn (counts[e] of them); gate_up[e] [2I, H], down[e] [H, I] bf16,
    contiguous, or q8_0 records (uint8 [2I, row bytes] and [H, row bytes], `strata.quant.packed`, the same format
    for both). Returns [P, H] float32: each row's down(silu(gate) * up), the product rounded to bf16 between."""
    lib = load()
    p, hidden = x.shape
    q8 = gate_up[0].dtype == torch.uint8
    width = gate_up[0].shape[0] // 2
    x = x.contiguous()
    starts = [0]
    for c in counts[:-1]:
        starts.append(starts[-1] + c)
    as_ints = lambda xs, dtype: torch.tensor(xs, dtype=dtype)  # noqa: E731
    gp = as_ints([w.data_ptr() for w in gate_up], torch.int64)
    dp = as_ints([w.data_ptr() for w in down], torch.int64)
    start, count = as_ints(starts, torch.int32), as_ints(counts, torch.int32)
    h = torch.empty(p, 2 * width)
    a = torch.empty(p, width, dtype=torch.bfloat16)
    out = torch.empty(p, hidden)
    ptr = lambda t: ctypes.c_void_p(t.data_ptr())  # noqa: E731
    args = (len(counts), ptr(gp), ptr(dp), ptr(start), ptr(count), ptr(x), ptr(h), ptr(a), ptr(out), hidden, width,
            threads)
    if q8:
        lib.experts_q8_0(*args, gate_up[0].shape[1], down[0].shape[1])
    else:
        lib.experts_bf16(*args)
    return out


def pool_window(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, index: torch.Tensor, lo: int, hi: int,
                counts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, threads: int,
                phases: torch.Tensor | None = None) -> tuple[torch.Tensor, int, int]:
    """One window of a pool in one call (`pool_window` in experts_bf16.c): x [R, H] bf16 and each row's k routing
    weights and global expert ids [R, k] on the host; `index` [N] int64 global id -> host slot, of which slots
    [lo, hi) are the kernel's: their experts `gate_up` [hi - lo, 2I, H] and `down` [hi - lo, H, I] (bf16, or q8_0
    records [.., rows, record bytes] uint8), contiguous. Adds each id's pairs to `counts` [N] float64. Returns each
    row's weighted sum of its pairs here [R, H] float32 (added in ascending slot order; zeros where none), the pairs
    computed and the experts read. `phases` [5] float64, seconds added (PHASES: where a window's time goes)."""
    lib = load()
    r, k = ids.shape
    hidden = x.shape[1]
    width = gate_up.shape[1] // 2
    x, weights, ids = x.contiguous(), weights.contiguous(), ids.contiguous()
    if ids.dtype not in (torch.int64, torch.int32):
        ids = ids.long()
    if weights.dtype not in (torch.float32, torch.bfloat16):
        weights = weights.float()
    q8 = gate_up.dtype == torch.uint8
    out = torch.empty(r, hidden)
    stats = torch.zeros(2, dtype=torch.int64)
    if phases is None:
        phases = torch.zeros(len(PHASES), dtype=torch.float64)
    ptr = lambda t: ctypes.c_void_p(t.data_ptr())  # noqa: E731
    step = lambda t: ctypes.c_int64(t.stride(0) * t.element_size())  # noqa: E731
    done = lib.pool_window(r, k, ptr(ids), ids.dtype == torch.int64, ptr(weights), weights.dtype == torch.bfloat16,
                           ptr(index), index.numel(), ctypes.c_int64(lo), ctypes.c_int64(hi), ptr(counts),
                           ctypes.c_int64(gate_up.data_ptr()), step(gate_up), ctypes.c_int64(down.data_ptr()),
                           step(down), ptr(x), ptr(out), hidden, width, threads, q8,
                           gate_up.shape[-1] if q8 else 0, down.shape[-1] if q8 else 0, ptr(stats), ptr(phases))
    if done:
        raise ValueError(f"an expert id outside [0, {index.numel()}) among this window's routed ids")
    return out, int(stats[0]), int(stats[1])
