"""GPU timing for the benchmarks: mean seconds of a call (CUDA events, optionally replayed from a CUDA graph as
decode windows are), and where a step's time goes (its kernels by GPU time, from torch.profiler)."""

from __future__ import annotations

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


def print_kernel_table(run: Callable[[], None], title: str, top: int = 15, steps: int = 1) -> None:
    """Run `run` `steps` times under the profiler and print its kernels, largest GPU time first, per step."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            run()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if getattr(e, "self_device_time_total", 0) > 0]
    total = sum(e.self_device_time_total for e in events) or 1
    print(f"\n{title}: {total / 1e3 / steps:.3f} ms of GPU time per step, {sum(e.count for e in events) / steps:.0f} "
          "kernels per step")
    print(f"{'kernel':64} {'per step':>8} {'us/step':>9} {'share':>6}")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:top]:
        t = e.self_device_time_total
        print(f"{e.key[:64]:64} {e.count / steps:8.1f} {t / steps:9.1f} {t / total:6.1%}")
