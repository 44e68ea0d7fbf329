"""The CPU expert pool: the experts of one MoE layer that are not on the stage's device, in host RAM, and the
computation of the (row, expert) pairs routed to them.

Per layer and window: `start` copies the window's rows and their routing to the host (asynchronously on a
GPU: pinned buffers, non-blocking copies, an event) before the device kernels of the resident experts are
queued; `finish` waits for that copy only (not for the device kernels, which run meanwhile), computes the
pairs whose expert is here with torch on the CPU, and copies their sum back (pinned, non-blocking, queued
on the stage's stream before the addition that reads it).

Uploads (`--pcie-frac F`): the first round(F x N) of the pool's N experts (host slots 0..U-1) are not computed by
the CPU: when a window routes rows to one, its weights go to the device over PCIe (pinned host memory, a copy
stream of their own, queued before the CPU starts on its pairs) and the device computes its pairs, so the link
and the CPU work at once. Which pairs go up depends only on the expert (its slot), never on the window, so a row's
bits stay the same alone or beside others. F = 0 uploads nothing: the CPU-only pool, bit for bit.

Quantized experts (the loader keeps a layer's experts packed when the Triton kernels read them packed): q4_k
experts stay 4-bit in host RAM, as torch's CPU int4 products read them (`Int4Expert`: 4.3x fewer bytes than
bfloat16, 3.3x faster for one row on the CI machine); q8_0 experts (gate/up and down both) stay in their records
on the pool's own kernel where it runs (bfloat16 rows); other packed formats are written out in the rows' dtype.

Plain bfloat16 experts run on the pool's own kernel where the host can build it (`strata.experts.native`:
AVX512_BF16 and gcc; every expert of a window in one OpenMP region, about twice oneDNN's rate for one to four rows
on a 16-core GPU host), their weights kept plain; elsewhere on oneDNN's products over its blocked layout.

Row invariance: each expert's pairs run through `rows` (`in_row_blocks` in decode windows: fixed, zero-padded
blocks of rows; the pool's kernel sums each output in one fixed order whatever the rows beside it), and a row's
pair outputs are summed in float32 in ascending expert id. So a row's CPU share, like its device share, does not
depend on which other rows share the window.
"""

from __future__ import annotations

import logging
import os
import time

import torch
import torch.nn.functional as F

from strata.experts import native
from strata.kernels import onednn
from strata.kernels.elementwise import silu_mul
from strata.kernels.moe import swiglu
from strata.quant.packed import PackedWeight, dequantize

log = logging.getLogger(__name__)
Tensors = dict[str, torch.Tensor]


INT4_GROUP = 32  # q4_k's scale group: one (scale, zero) pair a group in torch's int4 layout


class Int4Expert:
    """One q4_k expert matrix [N, K] in torch's CPU int4 layout: its 4-bit codes packed as
    `_convert_weight_to_int4pack_for_cpu` lays them out, and per 32 columns a (scale, zero) pair such that
    w = (code - 8) * scale + zero, i.e. scale = d * sub-scale and zero = 8 * scale - dmin * min (q4_k's own
    values, exact in float32; a bfloat16 pool rounds them to bfloat16, about 0.4 % of a group's scale)."""

    def __init__(self, w: PackedWeight, dtype: torch.dtype):
        n, k = w.shape
        codes = torch.stack([w.codes & 15, w.codes >> 4], dim=-1).reshape(n, k).to(torch.int32)
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        d, dmin = w.supers.float().unbind(-1)  # [N, K/256]
        sc, mn = w.scales.float().unbind(-1)  # [N, K/32]
        scale = d.repeat_interleave(8, dim=-1) * sc
        zero = 8 * scale - dmin.repeat_interleave(8, dim=-1) * mn
        self.scales_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(dtype)  # [K/32, N, 2]
        self.nbytes = self.packed.numel() * self.packed.element_size() + self.scales_zeros.numel() * self.scales_zeros.element_size()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.scales_zeros.dtype != x.dtype:  # the product takes them in the rows' dtype
            self.scales_zeros = self.scales_zeros.to(x.dtype)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), self.packed, INT4_GROUP, self.scales_zeros)


def int4_available() -> bool:
    """Whether this torch has the CPU int4 products (`_weight_int4pack_mm_for_cpu`)."""
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and hasattr(torch.ops.aten,
                                                                               "_convert_weight_to_int4pack_for_cpu")


def _pool_matrices(w, dtype: torch.dtype) -> list | torch.Tensor:
    """A stack of experts' matrices as the pool holds them: q4_k -> `Int4Expert` each, another packed format ->
    written out in `dtype`, plain -> as it is."""
    if not isinstance(w, PackedWeight):
        return w
    if w.fmt == "q4_k" and int4_available():
        return [Int4Expert(w.index(torch.tensor([e])).reshape_rows(*w.shape[1:-1]), dtype) for e in range(w.shape[0])]
    return dequantize(w).to(dtype)


Q8_TRIAL_EXPERTS = 32  # experts a q8_0 trial reads each way: 300 MB at the 30B shape, past a last-level cache
_q8_choice: dict[tuple[int, int], bool] = {}


def q8_records_faster(gate_up: PackedWeight, down: PackedWeight) -> bool:
    """Whether the pool's kernel computes q8_0 experts faster from their records (1.06 bytes a value, each group
    turned into bf16 in registers) than written out in bfloat16 (2 bytes a value, no conversion), on this host: a
    memory-bound host gains from the fewer bytes, one with few fast cores and much bandwidth a core loses to the
    conversion (the 2-vCPU CI VM: 177 against 128 us an expert at one row; the H100's 16-core host: about even at
    one row, 1.1-1.3x slower from four). Measured once per process and shape: one row, then four rows, through up
    to Q8_TRIAL_EXPERTS of the layer's experts each way, best of 3; the records only where faster at both (said in
    the log). STRATA_POOL_Q8=1 or 0 decides instead."""
    forced = os.environ.get("STRATA_POOL_Q8")
    if forced in ("0", "1"):
        return forced == "1"
    key = (gate_up.shape[-1], down.shape[-1])
    if key not in _q8_choice:
        n = min(gate_up.shape[0], Q8_TRIAL_EXPERTS)
        pick = torch.arange(n)
        records = ([r for r in gate_up.index(pick).data.contiguous()], [r for r in down.index(pick).data.contiguous()])
        plain = ([m for m in dequantize(gate_up.index(pick)).to(torch.bfloat16).contiguous()],
                 [m for m in dequantize(down.index(pick)).to(torch.bfloat16).contiguous()])
        threads = torch.get_num_threads()
        times = {}
        for rows in (1, 4):
            x = torch.randn(n * rows, key[0]).to(torch.bfloat16)
            for name, (gu, dn) in (("records", records), ("bf16", plain)):
                native.experts_bf16(x, [rows] * n, gu, dn, threads)
                best = float("inf")
                for _ in range(3):
                    start = time.perf_counter()
                    native.experts_bf16(x, [rows] * n, gu, dn, threads)
                    best = min(best, time.perf_counter() - start)
                times[name, rows] = best
        _q8_choice[key] = all(times["records", r] < times["bf16", r] for r in (1, 4))
        log.info("the CPU expert pool reads q8_0 experts %s (%d experts, one / four rows each: %.2f / %.2f ms from "
                 "their records, %.2f / %.2f ms written out in bf16; STRATA_POOL_Q8=0/1 decides instead)",
                 "as their records" if _q8_choice[key] else "written out in bf16", n, times["records", 1] * 1e3,
                 times["records", 4] * 1e3, times["bf16", 1] * 1e3, times["bf16", 4] * 1e3)
    return _q8_choice[key]


class ExpertPool:
    """One MoE layer's experts kept in host RAM: `gate_up` [N, 2I, H], `down` [N, H, I] for global ids `ids` [N]."""

    def __init__(self, offloaded: Tensors, num_experts: int, pack: bool | None = None, upload: float = 0.0,
                 pin: bool = False):
        """`pack`: keep the weights in oneDNN's blocked layout (`onednn.available`; None: wherever it is), which the CPU
        streams at up to 1.6x the plain layout's rate in bf16 (bench/experts.py), 2.5-4x in float32 on AMD (MKL's slow
        path there: `strata.kernels.onednn`). `upload`: the share
        of the experts (host slots 0..U-1, U = round(upload x N)) whose pairs the device computes after uploading
        their weights (`--pcie-frac`), kept plain in the rows' dtype, in pinned memory when `pin`."""
        if not 0.0 <= upload <= 1.0:
            raise ValueError(f"upload share {upload}: expected a number from 0 to 1")
        ids = offloaded["ids"].long()
        self.num_here = int(ids.numel())
        self.num_upload = min(self.num_here, round(upload * self.num_here))
        u = self.num_upload
        dtype = offloaded["gate_up"].dtype  # the rows' (a packed weight's: its tiles')
        split = [_split(offloaded[n], u) for n in ("gate_up", "down")]
        cpu_parts = [cpu for _, cpu in split]
        # q8_0 experts stay in their records on the pool's own kernel (1.06 bytes a value against bf16's 2)
        self.q8 = (pack is not True and all(isinstance(w, PackedWeight) and w.fmt == "q8_0" for w in cpu_parts)
                   and native.usable(dtype, cpu_parts[0].shape[-1], cpu_parts[0].shape[-2] // 2)
                   and cpu_parts[0].shape[0] > 0 and q8_records_faster(*cpu_parts))
        if self.q8:
            gate_up, down = (w.data.contiguous() for w in cpu_parts)  # [N, rows, record bytes] uint8
        else:
            gate_up, down = (_pool_matrices(cpu, dtype) for cpu in cpu_parts)
        self.up_gate_up, self.up_down = (_upload_matrices(up, dtype, pin) for up, _ in split)
        self.int4 = isinstance(gate_up, list) or isinstance(down, list)  # q4_k experts read as they are
        size = lambda w: sum(m.nbytes for m in w) if isinstance(w, list) else w.numel() * w.element_size()  # noqa: E731
        self.upload_expert_bytes = (size(self.up_gate_up) + size(self.up_down)) // max(1, u)
        self.nbytes = size(gate_up) + size(down) + size(self.up_gate_up) + size(self.up_down)
        # global id -> host slot: 0..U-1 uploaded, U..N-1 computed by the CPU (its lists' entry slot - U); N: not here
        self.index = torch.full((num_experts,), self.num_here, dtype=torch.int64)
        self.index[ids] = torch.arange(self.num_here)
        # plain bf16 experts on the pool's own kernel where it builds here (`pack` True: oneDNN's products all the same)
        self.native = self.q8 or (pack is not True and not self.int4
                                  and native.usable(gate_up.dtype, gate_up.shape[-1], gate_up.shape[-2] // 2))
        self.packed = (onednn.available(dtype) if pack is None else pack) and not self.int4 and not self.native
        n_cpu = self.num_here - u
        if self.native:  # the kernel reads each expert's matrices whole
            gate_up, down = gate_up.contiguous(), down.contiguous()
        if self.packed:  # the blocked copies replace the plain ones (no second copy of the pool in host RAM)
            self.gate_up = [onednn.block(gate_up[e]) for e in range(n_cpu)]
            self.down = [onednn.block(down[e]) for e in range(n_cpu)]
        else:
            self.gate_up, self.down = gate_up, down
        self.copy_stream = None  # the uploads' stream on the device (made by the first window that uploads)
        self._pending: dict[int, tuple] = {}  # host slot -> (event, gate_up, down): swapped in, copy still landing
        self.device_slots: torch.Tensor | None = None  # hot residency's host mirror of the layer's `expert_slot`
        self.pairs_uploaded = 0  # pairs the device computed on uploaded weights so far
        self.experts_uploaded = 0  # experts whose weights went up, summed over windows (bytes: x `upload_expert_bytes`)
        self.pairs_here = 0  # pairs computed by the CPU pool so far
        self.pairs_total = 0  # pairs routed in this layer so far (device + uploaded + pool)
        self.experts_read = 0  # experts whose weights the pool read, summed over windows (bytes: x `expert_bytes`)
        self.busy_s = 0.0  # host seconds in `compute`
        # of those, in the kernel's phases (`native.PHASES`; the pool's own kernel only)
        self.phase_s = torch.zeros(len(native.PHASES), dtype=torch.float64)
        self.wait_s = 0.0  # host seconds waiting for a window's rows to arrive from the device
        self.counts = torch.zeros(num_experts, dtype=torch.float64)  # routed pairs per global id (`hotness`)
        self.swaps = 0  # experts swapped with the device's resident set so far (`hotness.refresh_layer`)

    def put(self, j: int, expert: int, gate_up: torch.Tensor, down: torch.Tensor, ready=None) -> None:
        """Host slot `j` now holds global expert `expert` (whose id was not here), in place of the one it held.
        `ready`: an event after which `gate_up` and `down` hold the weights (copies still running from the device):
        the slot takes them before the pool next reads it."""
        left = int(torch.nonzero(self.index == j)[0])
        self.index[left] = self.num_here
        self.index[expert] = j
        if ready is not None:
            self._pending[j] = (ready, gate_up, down)
            return
        self._pending.pop(j, None)
        self._write_slot(j, gate_up, down)

    def _settle(self) -> None:
        """Slots whose weights were still being copied from the device: wait for those copies, take the weights."""
        for j, (ready, gate_up, down) in list(self._pending.items()):
            ready.synchronize()
            self._write_slot(j, gate_up, down)
            del self._pending[j]

    def _write_slot(self, j: int, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        if j < self.num_upload:
            self.up_gate_up[j].copy_(gate_up)
            self.up_down[j].copy_(down)
        elif self.packed or self.int4:
            raise ValueError("a packed pool's experts cannot be swapped (hot residency keeps the plain layout)")
        else:
            self.gate_up[j - self.num_upload].copy_(gate_up)
            self.down[j - self.num_upload].copy_(down)

    @property
    def expert_bytes(self) -> int:
        """The bytes of one expert the CPU computes (as the pool holds it: packed, int4 or plain)."""
        u = self.num_upload
        return (self.nbytes - u * self.upload_expert_bytes) // max(1, self.num_here - u)

    def slot_weights(self, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Host slot `j`'s (gate_up, down) in the plain layout (for a swap with the device's resident set)."""
        self._settle()
        if j < self.num_upload:
            return self.up_gate_up[j], self.up_down[j]
        return self.gate_up[j - self.num_upload], self.down[j - self.num_upload]

    def start(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> "PoolJob":
        """Begin one window: x [R, H], weights and global expert ids [R, k] of every row (on the stage's device).
        Queue their copy to the host; the caller queues the device's share next, then calls `finish`."""
        return PoolJob(self, x, weights, ids)

    def compute(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, rows) -> torch.Tensor:
        """On the host: the weighted sum of each row's pairs whose expert is here, [R, H] float32; zeros for a row
        with none."""
        start_s = time.perf_counter()
        self._settle()
        try:
            return self._compute(x, weights, ids, rows)
        finally:
            self.busy_s += time.perf_counter() - start_s

    def _compute(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, rows) -> torch.Tensor:
        r, k = ids.shape
        self.pairs_total += r * k
        if self.native:  # the whole window in one call: its bookkeeping in torch's small ops cost about as much as
            # one row's products (about 30 ops of 5-10 us each on a 16-core host)
            out, pairs, experts = native.pool_window(x, weights, ids, self.index, self.num_upload, self.num_here,
                                                     self.counts, self.gate_up, self.down, torch.get_num_threads(),
                                                     self.phase_s)
            self.pairs_here += pairs
            self.experts_read += experts
            return out
        out = torch.zeros(r, x.shape[1], dtype=torch.float32)
        routed = ids.reshape(-1).long()
        self.counts += torch.bincount(routed, minlength=self.counts.numel()).double()
        flat = self.index[routed]  # [R*k] host slot, or num_here
        # [P'] pair ids (row * k + choice), ascending, of the experts the CPU computes
        pairs = torch.nonzero((flat >= self.num_upload) & (flat < self.num_here)).squeeze(1)
        self.pairs_here += int(pairs.numel())
        if not pairs.numel():
            return out
        pairs, experts, counts = _by_slot(pairs, flat[pairs] - self.num_upload)
        self.experts_read += int(experts.numel())
        # each expert's rows are a slice of one gather (pairs grouped by expert, a few ops a window, not a few an
        # expert: on the H200 host each small op costs 5-10 us, about an expert's product over 20 of them)
        grouped = x[pairs // k]  # [P, H]: each expert's rows in turn
        parts = list(zip(experts.tolist(), grouped.split(counts.tolist())))
        y = torch.cat([rows(self._expert, part, e) for e, part in parts]).float()
        y = y * weights.reshape(-1)[pairs].float()[:, None]  # [P, H] in expert order
        return _sum_by_row(y, pairs // k, r, k)

    def _expert(self, x: torch.Tensor, e: int) -> torch.Tensor:
        if self.int4:  # each matrix int4 or plain (Q4_K_M: q4_k gate_up, q6_k down written out)
            product = lambda w, v: w(v) if isinstance(w, Int4Expert) else F.linear(v, w)  # noqa: E731
            return product(self.down[e], silu_mul(product(self.gate_up[e], x)))
        if not self.packed:
            return swiglu(x, self.gate_up[e], self.down[e])
        return onednn.linear(silu_mul(onednn.linear(x, self.gate_up[e])), self.down[e])


    def upload(self, x: torch.Tensor, weights: torch.Tensor, ids_host: torch.Tensor, rows) -> torch.Tensor | None:
        """Queue on x's device the pairs of the uploaded experts (host slots 0..U-1): their weights copied up on the
        pool's copy stream, then each expert's rows through `rows` on the current stream, weighted and summed in
        ascending slot order. Returns that share [R, H] float32 on the device (None: no such pair in the window).
        x, weights: the window's rows and routing weights on the device; ids_host: its expert ids on the host."""
        if not self.num_upload:
            return None
        self._settle()
        r, k = ids_host.shape
        flat = self.index[ids_host.reshape(-1).long()]
        pairs = torch.nonzero(flat < self.num_upload).squeeze(1)
        if not pairs.numel():
            return None
        pairs, experts, counts = _by_slot(pairs, flat[pairs])
        self.pairs_uploaded += int(pairs.numel())
        self.experts_uploaded += int(experts.numel())
        device = x.device
        cuda = device.type == "cuda"
        current = torch.cuda.current_stream(device) if cuda else None
        if cuda and self.copy_stream is None:
            self.copy_stream = torch.cuda.Stream(device=device)
        up = []  # (gate_up, down) of each routed uploaded expert, on the device
        if cuda:
            with torch.cuda.stream(self.copy_stream):
                for e in experts.tolist():
                    up.append((self.up_gate_up[e].to(device, non_blocking=True),
                               self.up_down[e].to(device, non_blocking=True)))
            current.wait_stream(self.copy_stream)
            for gu, dn in up:  # allocated on the copy stream, read on the current one
                gu.record_stream(current)
                dn.record_stream(current)
        else:
            up = [(self.up_gate_up[e], self.up_down[e]) for e in experts.tolist()]
        pairs_dev = pairs.to(device, non_blocking=cuda)
        route = weights.reshape(-1).float()
        out = torch.zeros(r, x.shape[1], dtype=torch.float32, device=device)
        start = 0
        for (gu, dn), n in zip(up, counts.tolist()):
            sel = pairs_dev[start : start + n]
            start += n
            row = sel // k
            y = rows(swiglu, x[row], gu, dn).float() * route[sel, None]
            out.index_add_(0, row, y)  # one call an expert, its rows distinct: a row sums in ascending slot order
        return out


class PoolJob:
    """One window's pairs on the pool: the host copies of its inputs, then (`finish`) the result on the device."""

    def __init__(self, pool: ExpertPool, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor):
        self.pool, self.device, self.dtype = pool, x.device, x.dtype
        self.x_dev, self.weights_dev = x, weights
        self.copied = None
        if x.device.type == "cuda":
            self.x, self.weights, self.ids = (to_pinned(t) for t in (x, weights, ids))
            self.copied = torch.cuda.Event()
            self.copied.record(torch.cuda.current_stream(x.device))
        else:
            self.x, self.weights, self.ids = x, weights, ids

    def finish(self, rows) -> torch.Tensor:
        """The pool's share of every row, [R, H] in the rows' dtype on their device (zeros where none)."""
        if self.copied is not None:
            start = time.perf_counter()
            self.copied.synchronize()  # the host waits for its copy of the inputs, not for the device kernels
            self.pool.wait_s += time.perf_counter() - start
        uploaded = self.pool.upload(self.x_dev, self.weights_dev, self.ids, rows)  # queued before the CPU starts
        out = self.pool.compute(self.x, self.weights, self.ids, rows)
        if uploaded is not None:
            return (uploaded + out.to(self.device, non_blocking=self.device.type == "cuda")).to(self.dtype)
        if self.device.type == "cpu":
            return out.to(self.dtype)
        # Converted on the host and uploaded from pinned memory; the caching host allocator keeps the buffer
        # until the copy queued on the stage's stream has run.
        return to_pinned(out.to(self.dtype), copy_on_host=True).to(self.device, non_blocking=True)


def _sum_by_row(y: torch.Tensor, row: torch.Tensor, r: int, k: int) -> torch.Tensor:
    """y [P, H]: pair outputs in ascending expert id, row [P] their rows -> [r, H], each row's pairs summed in that
    order (so a row's bits depend only on its own pairs). The pairs are placed at (row, rank among the row's pairs)
    of a zero-padded [r, k, H] and added rank by rank: a few ops a window, where `index_add_` was one slow scatter
    an expert (250 us for one row of 2,048 on the H200 host)."""
    out = torch.zeros(r, k, y.shape[1], dtype=y.dtype)
    order = torch.argsort(row, stable=True)  # by row; the expert order kept within a row
    by_row = row[order]
    per_row = torch.bincount(row, minlength=r)
    rank = torch.arange(row.numel()) - (torch.cumsum(per_row, 0) - per_row)[by_row]
    out[by_row, rank] = y[order]
    total = out[:, 0]
    for j in range(1, int(per_row.max())):
        total = total + out[:, j]
    return total.contiguous()


def _by_slot(pairs: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pair ids and their slots -> the pair ids ordered by slot (ascending pair id within one), the distinct slots
    in ascending order, and each one's count of pairs."""
    order = torch.argsort(slots, stable=True)
    experts, counts = torch.unique_consecutive(slots[order], return_counts=True)
    return pairs[order], experts, counts


def _split(w, u: int):
    """A stack of N experts' matrices cut into the first u (uploaded) and the rest (the CPU's)."""
    if not u:
        return None, w
    if isinstance(w, PackedWeight):
        n = w.shape[0]
        return w.index(torch.arange(u)), w.index(torch.arange(u, n))
    return w[:u], w[u:]


def _upload_matrices(w, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """The uploaded experts' matrices: plain, in the rows' dtype (a packed weight written out), pinned when `pin`
    so that their copies to the device run asynchronously at the link's rate."""
    if w is None:
        return torch.empty(0, dtype=dtype)
    w = dequantize(w).to(dtype) if isinstance(w, PackedWeight) else w.to(dtype)
    if not pin:
        return w.contiguous()
    try:
        return w.pin_memory()
    except RuntimeError as e:  # e.g. a container's locked-memory limit
        log.warning("could not pin %.2f GB of host RAM for the uploaded experts (%s): their copies to the GPU run "
                    "synchronously, slower; raise the locked-memory limit (ulimit -l) or lower --pcie-frac",
                    w.numel() * w.element_size() / 1e9, str(e).splitlines()[0])
        return w.contiguous()


def to_pinned(t: torch.Tensor, copy_on_host: bool = False) -> torch.Tensor:
    """A pinned host copy of `t` (queued, not waited for, when `t` is on a GPU)."""
    buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    buf.copy_(t, non_blocking=not copy_on_host)
    return buf


def stage_pools(offloaded: dict[int, Tensors], num_experts: int, pack: bool | None = None, upload: float = 0.0,
                pin: bool = False) -> dict[int, ExpertPool]:
    """The pools of a stage's layers that keep some experts in host RAM (`StageWeights.offloaded`); `upload`: the
    share of each pool's experts the device computes after uploading them (`--pcie-frac`)."""
    return {i: ExpertPool(t, num_experts, pack, upload, pin) for i, t in offloaded.items()}
