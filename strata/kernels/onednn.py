"""CPU products over weights in oneDNN's blocked layout: the torch path's projections on a CPU stage.

torch's float32 `F.linear` on the CPU is MKL's GEMM, and on AMD processors MKL takes a slow path: on this project's
AMD EPYC a one-row product over SmolLM2-135M's MLP weights read 16 GB/s and 4 or 8 rows cost up to 1.6x one row,
while oneDNN's product over the same weights laid out once in its blocked format (`_reorder_linear_weight`, torch's
own op for its CPU inference path) read 40-48 GB/s at 1 to 8 rows alike, and a 49,152-row head went from 7.0 to
2.4 ms (1 row) and 11.2 to 2.5 ms (8 rows). bfloat16 gains 1.5-2x at one row the same way. So a CPU stage on the
torch kernels keeps its projection matrices blocked (`block_stage`): the matrices are reordered once at load, in
place of the plain ones (no second copy), and `strata.kernels.packed.project` runs them with oneDNN.

A blocked weight is a torch tensor of the `torch._mkldnn` layout: its shape and dtype are the matrix's, it cannot
be indexed (`to_dense` gives the plain matrix back). Row invariance holds as for the plain product: a row's result
is the same at any place of a block and with any other rows beside it (tests/test_onednn.py), and decode windows
run fixed blocks of rows (`strata.kernels.invariant`).
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger("strata.engine")

BLOCK_ROWS = 8  # the rows the layout is chosen for: a decode window's block (`strata.kernels.invariant`)
# a layer's matrices the torch path runs through `project` (the router and the shared expert's gate stay plain:
# a product of a handful of outputs, read through F.linear)
LAYER_MATRICES = ("qkv", "o", "in_proj", "out", "gate_up", "down", "shared_gate_up", "shared_down")
MTP_MATRICES = ("fc", "qkv", "o", "gate_up", "down", "shared_gate_up", "shared_down", "head")


def available(dtype: torch.dtype) -> bool:
    """Whether this torch and CPU run oneDNN's products over blocked weights of `dtype` (float32 anywhere oneDNN
    is built in; bfloat16 where the CPU has the instructions: torch's own check)."""
    ops = torch.ops.mkldnn
    if not (torch.backends.mkldnn.is_available() and hasattr(ops, "_reorder_linear_weight")
            and hasattr(ops, "_linear_pointwise")):
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and bool(ops._is_mkldnn_bf16_supported())


def block(w: torch.Tensor) -> torch.Tensor:
    """The matrix w [N, K] in oneDNN's blocked layout (a new tensor; w is left as it is)."""
    return torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), BLOCK_ROWS)


def is_blocked(w) -> bool:
    return isinstance(w, torch.Tensor) and w.is_mkldnn


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ w.T (+ bias) over a blocked w [N, K]: as F.linear."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), w, bias, "none", [], "")


def dense(w: torch.Tensor) -> torch.Tensor:
    """A weight in the plain layout (a blocked one written back out; a plain one as it is)."""
    return w.to_dense() if is_blocked(w) else w


def block_matrices(tensors: dict, names, dtype: torch.dtype) -> int:
    """Reorder the named plain matrices of `tensors` in place (packed weights, other dtypes and missing names are
    left as they are). Returns the bytes reordered."""
    done = 0
    for name in names:
        w = tensors.get(name)
        if isinstance(w, torch.Tensor) and not w.is_mkldnn and w.dim() == 2 and w.dtype == dtype \
                and w.device.type == "cpu":
            tensors[name] = block(w)
            done += w.numel() * w.element_size()
    return done


def block_stage(weights, dtype: torch.dtype) -> int:
    """A CPU stage's projection matrices and head reordered in place (`StageWeights`), where `available(dtype)`.
    A head tied to the embedding gets a blocked copy of its own (the embedding's lookups read the plain table).
    Returns the bytes reordered (0: none; nothing changed)."""
    if not available(dtype):
        return 0
    done = sum(block_matrices(layer, LAYER_MATRICES, dtype) for layer in weights.layers.values())
    head = {"head": weights.lm_head}
    done += block_matrices(head, ("head",), dtype)
    weights.lm_head = head["head"]
    if done:
        log.info("CPU products run on oneDNN's blocked layout: %.1f MB of projection weights reordered at load",
                 done / 1e6)
    return done
