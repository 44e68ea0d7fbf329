"""Per-sequence state: the K/V cells of its attention layers and the conv + recurrent state of its GDN layers."""

from __future__ import annotations

import torch

from strata.errors import PromptTooLong
from strata.model.spec import ModelSpec


class SessionState:
    """One sequence's state over a range of layers, sized by `max_cells` positions.

    `length` is the number of committed positions: cells [0, length) hold valid K/V and the GDN
    states have absorbed exactly those tokens.
    """

    def __init__(self, spec: ModelSpec, layers: range, max_cells: int, device: torch.device, dtype: torch.dtype):
        self.layers = layers
        self.max_cells = max_cells
        self.length = 0
        self.tokens: list[int] = []  # the committed tokens, cell by cell: what a later request may reuse
        att = spec.attention
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        for i in spec.attention_layers(layers):
            self.k[i] = torch.zeros(max_cells, att.num_kv_heads, att.head_dim, device=device, dtype=dtype)  # [L, Hkv, D]
            self.v[i] = torch.zeros(max_cells, att.num_kv_heads, att.head_dim, device=device, dtype=dtype)
        self.conv: dict[int, torch.Tensor] = {}
        self.recurrent: dict[int, torch.Tensor] = {}
        if spec.gdn is not None:
            g = spec.gdn
            for i in spec.gdn_layers(layers):
                self.conv[i] = torch.zeros(g.conv_kernel - 1, g.conv_dim, device=device, dtype=dtype)  # [K-1, C]
                self.recurrent[i] = torch.zeros(
                    g.num_v_heads, g.k_head_dim, g.v_head_dim, device=device, dtype=torch.float32
                )  # [Hv, Dk, Dv]

    def reserve(self, n: int) -> None:
        """Refuse a window that would write past the last cell."""
        if self.length + n > self.max_cells:
            raise PromptTooLong(
                f"{self.length + n} positions do not fit in max_cells={self.max_cells} "
                f"({self.length} held + {n} new); shorten the prompt or raise --max-cells"
            )

    @torch.inference_mode()
    def reset(self) -> None:
        """Forget the sequence (K/V cells need no clearing: only cells below `length` are ever read)."""
        self.length = 0
        self.tokens = []
        for t in (*self.conv.values(), *self.recurrent.values()):
            t.zero_()

    @torch.inference_mode()
    def copy_from(self, other: "SessionState") -> None:
        """Become a copy of `other` (same layers): its committed K/V cells, GDN states and tokens."""
        n = other.length
        for i in self.k:
            self.k[i][:n] = other.k[i][:n]
            self.v[i][:n] = other.v[i][:n]
        for i in self.conv:
            self.conv[i].copy_(other.conv[i])
            self.recurrent[i].copy_(other.recurrent[i])
        self.length, self.tokens = n, list(other.tokens)

    def nbytes(self) -> int:
        tensors = (*self.k.values(), *self.v.values(), *self.conv.values(), *self.recurrent.values())
        return sum(t.numel() * t.element_size() for t in tensors)
