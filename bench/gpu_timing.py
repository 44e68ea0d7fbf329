"""GPU timing for the benchmarks: mean seconds of a call (CUDA events, optionally replayed from a CUDA graph as
decode windows are), where a step's time goes (its kernels by GPU time, from torch.profiler), and the card's own
anchors: its copy bandwidth and its bf16 matmul rate."""

from __future__ import annotations

import time
from typing import Callable

import torch


def gpu_seconds(fn: Callable[[], object], reps: int = 10, graph: bool = False) -> float:
    """Mean GPU seconds of fn() after warm-up calls; `graph`: replayed from a CUDA graph, so the launches' host
    cost stays out (as for decode windows)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    run = fn
    if graph:
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured):
            fn()
        run = captured.replay
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def copy_bandwidth(device: str, nbytes: int = 4 << 30) -> float:
    """Bytes per second a device-to-device copy moves (read + write), over `nbytes` of bfloat16."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    return 2 * nbytes * 10 / (start.elapsed_time(end) / 1e3)


def matmul_rate(device: str, n: int = 8192) -> float:
    """FLOP/s of a bf16 [n, n] x [n, n] product (torch's GEMM)."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        a @ b
    torch.cuda.synchronize()
    return 10 * 2 * n**3 / (time.perf_counter() - start)


def _kernel_events(run: Callable[[], None], steps: int) -> list:
    """The profiler's per-kernel averages of `run` called `steps` times (kernels with GPU time only)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            run()
        torch.cuda.synchronize()
    return [e for e in prof.key_averages() if getattr(e, "self_device_time_total", 0) > 0]


def kernel_seconds(run: Callable[[], None], steps: int = 5) -> dict[str, float]:
    """GPU seconds per call of each kernel `run` launches (torch.profiler, after one call to warm up), by name."""
    run()
    return {e.key: e.self_device_time_total / 1e6 / steps for e in _kernel_events(run, steps)}


def print_kernel_table(run: Callable[[], None], title: str, top: int = 15, steps: int = 1) -> None:
    """Run `run` `steps` times under the profiler and print its kernels, largest GPU time first, per step."""
    events = _kernel_events(run, steps)
    total = sum(e.self_device_time_total for e in events) or 1
    print(f"\n{title}: {total / 1e3 / steps:.3f} ms of GPU time per step, {sum(e.count for e in events) / steps:.0f} "
          "kernels per step")
    print(f"{'kernel':64} {'per step':>8} {'us/step':>9} {'share':>6}")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:top]:
        t = e.self_device_time_total
        print(f"{e.key[:64]:64} {e.count / steps:8.1f} {t / steps:9.1f} {t / total:6.1%}")


def print_chain_table(run: Callable[[], None], title: str, layers: int, steps: int = 4) -> None:
    """Where a step's time goes along its chain of kernels when they overlap (programmatic dependent launch): each
    kernel is charged the time from the end of the kernel before it to its own end (its share of the critical
    path; a gap over 50 us is the host between steps, not chain), summed by name and printed per layer, next to
    each kernel's own duration (which, launched early, includes its wait for the one before)."""
    import json
    import os
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            run()
        torch.cuda.synchronize()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = sorted((e for e in json.load(f)["traceEvents"] if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    finally:
        os.unlink(path)
    chain: dict[str, float] = {}
    own: dict[str, float] = {}
    count: dict[str, int] = {}
    last_end = None
    for e in events:
        end, name = e["ts"] + e["dur"], e["name"][:48]
        cost = e["dur"] if last_end is None else max(0.0, end - last_end)
        chain[name] = chain.get(name, 0.0) + (e["dur"] if cost > 50 else cost)
        own[name] = own.get(name, 0.0) + e["dur"]
        count[name] = count.get(name, 0) + 1
        last_end = end if last_end is None else max(last_end, end)
    print(f"\n{title}: {sum(chain.values()) / steps:.1f} us of chain per step, "
          f"{len(events) / steps:.0f} kernels per step")
    print(f"{'kernel':48} {'per step':>8} {'chain us/layer':>15} {'own us/layer':>13}")
    for name in sorted(chain, key=lambda n: -chain[n]):
        print(f"{name:48} {count[name] / steps:8.1f} {chain[name] / steps / layers:15.2f} "
              f"{own[name] / steps / layers:13.2f}")
