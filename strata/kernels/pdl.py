"""Programmatic dependent launch (Hopper and later GPUs): the next kernel of a stream is launched while the one
before it is still finishing, so its launch and block scheduling overlap that kernel's tail instead of following
it. A decode window is a chain of about fifteen small kernels per layer, where those gaps are a large share of
the step.

A kernel that takes part has a `PDL: tl.constexpr` argument and begins with `wait_for_prior(PDL)`: before it
touches memory it waits until the kernel before it has finished and its writes are visible (griddepcontrol.wait),
then lets the kernel after it be launched (griddepcontrol.launch_dependents). Its launch passes `**pdl(tensor)`.
The arithmetic does not change: a row's bits are the same with or without it. Off on the CPU, under the Triton
interpreter, on GPUs before Hopper, with a Triton that lacks the instructions, and with `STRATA_PDL=0`.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_cuda = getattr(getattr(tl, "extra", None), "cuda", None)
AVAILABLE = _cuda is not None and hasattr(_cuda, "gdc_wait") and hasattr(_cuda, "gdc_launch_dependents")
_capable: dict[int, bool] = {}  # device index -> compute capability >= 9


@triton.jit
def wait_for_prior(PDL: tl.constexpr):
    """Wait for the kernel before this one (its writes visible), then let the next one launch."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


def enabled(device: torch.device) -> bool:
    if device.type != "cuda" or not AVAILABLE or os.environ.get("TRITON_INTERPRET") == "1" \
            or os.environ.get("STRATA_PDL", "1") == "0":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _capable:
        _capable[index] = torch.cuda.get_device_capability(index)[0] >= 9
    return _capable[index]


def pdl(t: torch.Tensor) -> dict:
    """The launch arguments of a kernel that begins with `wait_for_prior`, for a launch on `t`'s device."""
    return {"PDL": True, "launch_pdl": True} if enabled(t.device) else {"PDL": False}
