"""Per-sequence state: the K/V cells of its attention layers and the conv + recurrent state of its GDN layers.

A `StatePool` holds the state of several sequences of one stage, one tensor per layer indexed by sequence
(`k[layer]`: [S, max_cells, Hkv, D]), so a decode window over many sequences is one kernel launch per layer
that indexes by each row's sequence id. A `SessionState` is one sequence's views into a pool.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from strata.errors import PromptTooLong
from strata.model.spec import ModelSpec


class StatePool:
    def __init__(self, spec: ModelSpec, layers: range, num_seqs: int, max_cells: int, device: torch.device,
                 dtype: torch.dtype, layer_devices: dict[int, torch.device] | None = None, mtp: bool = False,
                 keep_states: int = 0):
        """`layer_devices`: where each layer's state lives (its stage's device); default `device` for all. `mtp`:
        also the K/V cells of the multi-token-prediction layer (drafts, `--spec mtp:K`), as layer
        `spec.num_layers`, beside the last layer: they are copied, parked and restored with the others.
        `keep_states`: keep slots for the GDN states after drafted rows (drafts on the Triton decode kernels, which
        write them there in the window: `SessionState.take_keep_slots`), each every GDN layer's conv and recurrent
        state."""
        self.layers, self.num_seqs, self.max_cells = layers, num_seqs, max_cells
        at = lambda i: (layer_devices or {}).get(i, device)  # noqa: E731
        att = spec.attention
        kv_shape = (num_seqs, max_cells, att.num_kv_heads, att.head_dim)
        self.k = {i: torch.zeros(kv_shape, device=at(i), dtype=dtype) for i in spec.attention_layers(layers)}
        self.v = {i: torch.zeros(kv_shape, device=at(i), dtype=dtype) for i in spec.attention_layers(layers)}
        if mtp and layers.stop == spec.num_layers:
            last = spec.num_layers
            self.k[last] = torch.zeros(kv_shape, device=at(last - 1), dtype=dtype)
            self.v[last] = torch.zeros(kv_shape, device=at(last - 1), dtype=dtype)
        self.conv: dict[int, torch.Tensor] = {}
        self.recurrent: dict[int, torch.Tensor] = {}
        if spec.gdn is not None:
            g = spec.gdn
            for i in spec.gdn_layers(layers):
                self.conv[i] = torch.zeros(num_seqs, g.conv_kernel - 1, g.conv_dim, device=at(i), dtype=dtype)
                self.recurrent[i] = torch.zeros(num_seqs, g.num_v_heads, g.k_head_dim, g.v_head_dim, device=at(i),
                                                dtype=torch.float32)
        self.keep_conv = {i: torch.zeros((keep_states, *t.shape[1:]), device=t.device, dtype=t.dtype)
                          for i, t in self.conv.items()} if keep_states else {}
        self.keep_recurrent = {i: torch.zeros((keep_states, *t.shape[1:]), device=t.device, dtype=t.dtype)
                               for i, t in self.recurrent.items()} if keep_states else {}
        self.keep_free = list(range(keep_states)) if self.keep_conv else []  # keep slots no sequence holds

    def sessions(self) -> list["SessionState"]:
        return [SessionState(self, s) for s in range(self.num_seqs)]

    def nbytes(self) -> int:
        tensors = (*self.k.values(), *self.v.values(), *self.conv.values(), *self.recurrent.values())
        return sum(t.numel() * t.element_size() for t in tensors)

    def keep_nbytes(self) -> int:
        """The bytes of the keep slots (`keep_states`)."""
        return sum(t.numel() * t.element_size() for t in (*self.keep_conv.values(), *self.keep_recurrent.values()))


def checksum(tensors: Iterable[torch.Tensor]) -> torch.Tensor | int:
    """A 64-bit sum of the 32-bit words of the tensors' bytes (16-bit words for a tensor of an odd number of them),
    computed where they live, without waiting: a 0-dim int64 tensor on the first one's device (`int()` reads it)."""
    total = None
    for t in tensors:
        flat = t.contiguous().view(-1)
        words = flat.view(torch.int32) if flat.numel() * flat.element_size() % 4 == 0 else flat.view(torch.int16)
        part = words.sum(dtype=torch.int64)
        total = part if total is None else total.to(part.device) + part
    return 0 if total is None else total


class Checkpoint(dict):
    """A sequence's GDN states after some position: layer -> (conv, recurrent) host copies, and `sum`, the `checksum`
    of the device states they were copied from (None where none was taken: read from a park file, which has its own),
    checked when a parked conversation is restored from it."""

    sum: torch.Tensor | int | None = None


class SessionState:
    """One sequence's state over a range of layers, sized by `max_cells` positions.

    `length` is the number of committed positions: cells [0, length) hold valid K/V and the GDN
    states have absorbed exactly those tokens (`tokens`).
    """

    def __init__(self, pool: StatePool, index: int):
        self.pool, self.index = pool, index
        self.layers, self.max_cells = pool.layers, pool.max_cells
        self.length = 0
        self.tokens: list[int] = []  # the committed tokens, cell by cell: what a later request may reuse
        self.k = {i: t[index] for i, t in pool.k.items()}  # [L, Hkv, D] views
        self.v = {i: t[index] for i, t in pool.v.items()}
        self.conv = {i: t[index] for i, t in pool.conv.items()}  # [K-1, C]
        self.recurrent = {i: t[index] for i, t in pool.recurrent.items()}  # [Hv, Dk, Dv] float32
        # with drafts: the GDN states after each drafted row of the window in flight, by position (`rollback`)
        self.kept: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        self.keep_slots: list[int] = []  # the pool's keep slots those states are in (`take_keep_slots`), if any
        # GDN checkpoints (`--checkpoint-every`): host copies of every GDN layer's (conv, recurrent) state as it was
        # after the first `position` tokens, by position; the state can be cut back to any of them
        self.checkpoints: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        self.checkpoint_events: list = []  # CUDA events: the copies into host memory are done once they are
        # the parked image this state was restored from (`strata.state.parking.Snapshot`) and how many of its leading
        # cells this state still holds unchanged: parked again, those cells need no copy (reuse on re-park)
        self.origin: tuple[object, int] | None = None

    @classmethod
    def standalone(cls, spec: ModelSpec, layers: range, max_cells: int, device: torch.device,
                   dtype: torch.dtype, layer_devices: dict[int, torch.device] | None = None) -> "SessionState":
        return cls(StatePool(spec, layers, 1, max_cells, device, dtype, layer_devices), 0)

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
        self.checkpoints = {}
        self.origin = None
        self.release_kept()
        for t in (*self.conv.values(), *self.recurrent.values()):
            t.zero_()

    def truncate(self, length: int) -> None:
        """Keep only the first `length` positions (the cells past them are never read). A GDN state has absorbed
        every token it holds, so with GDN layers only the whole length, 0 (a reset) or a checkpoint's position can
        be kept (the GDN states then come back from the checkpoint)."""
        self.release_kept()
        if length == self.length:
            return
        if length == 0:
            self.reset()
            return
        if self.conv:
            if length not in self.checkpoints:
                raise ValueError(f"a GDN state cannot be cut from {self.length} to {length} positions (checkpoints: "
                                 f"{sorted(self.checkpoints) or 'none'})")
            self.set_gdn(self.checkpoints[length])
        self.length, self.tokens = length, self.tokens[:length]
        self.checkpoints = {p: c for p, c in self.checkpoints.items() if p <= length}
        self._keep_origin(length)

    def _keep_origin(self, cells: int) -> None:
        """Cells from `cells` on will be written again: they no longer equal the parked image's."""
        if self.origin is not None:
            self.origin = (self.origin[0], min(self.origin[1], cells))

    def cuts(self) -> set[int]:
        """The lengths this state can be cut back to besides its own: any with attention layers only, else its
        checkpoints' positions."""
        return set(self.checkpoints) if self.conv else set(range(self.length))

    @torch.inference_mode()
    def checkpoint(self, summed: bool = True) -> None:
        """Keep host copies of the GDN states as they are now, after `length` positions (queued behind the windows
        in flight on a GPU: the state is the one their last row leaves). `summed`: with the `checksum` of the device
        states, which a restore of a parked conversation from this checkpoint checks (two small kernels a GDN
        layer: not taken when nothing can be parked)."""
        if not self.conv:
            return
        kept, devices = Checkpoint(), set()
        if summed:  # queued, not waited for
            kept.sum = checksum(t for i in self.conv for t in (self.conv[i], self.recurrent[i]))
        for i in self.conv:
            kept[i] = tuple(_host_copy(t) for t in (self.conv[i], self.recurrent[i]))
            devices.add(self.conv[i].device)
        # the copies already done need no waiting for: only those in flight stay (the list would grow with every
        # prompt the slot reads, and each park waits on it)
        self.checkpoint_events = [e for e in self.checkpoint_events if not e.query()]
        for device in devices:
            if device.type == "cuda":
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(device))
                self.checkpoint_events.append(event)
        self.checkpoints[self.length] = kept

    def checkpoint_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for c in self.checkpoints.values() for pair in c.values() for t in pair)

    @torch.inference_mode()
    def set_gdn(self, states: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Put GDN states (a checkpoint's) back into this sequence's (asynchronously from pinned host memory)."""
        for i, (conv, recurrent) in states.items():
            self.conv[i].copy_(conv, non_blocking=True)
            self.recurrent[i].copy_(recurrent, non_blocking=True)

    def keep(self, position: int, layer: int) -> None:
        """Keep a copy of a GDN layer's conv and recurrent state as they are after `position` (a drafted row)."""
        self.kept.setdefault(position, {})[layer] = (self.conv[layer].clone(), self.recurrent[layer].clone())

    def take_keep_slots(self, n: int) -> list[int] | None:
        """Keep slots of the pool for the GDN states after the next `n` positions (a drafting slot's rows but its
        last, on the Triton decode kernels, which write them in the window): as many as are free, registered in
        `kept` for `rollback`; None when the pool has none (the torch path copies them: `keep`)."""
        pool = self.pool
        if not self.conv or not pool.keep_conv:
            return None
        self.release_kept()
        taken, pool.keep_free = pool.keep_free[:n], pool.keep_free[n:]
        for j, slot in enumerate(taken):
            self.kept[self.length + j] = {i: (pool.keep_conv[i][slot], pool.keep_recurrent[i][slot]) for i in self.conv}
        self.keep_slots = taken
        return taken

    def release_kept(self) -> None:
        """Forget the kept states, their keep slots free again."""
        self.kept.clear()
        if self.keep_slots:
            self.pool.keep_free += self.keep_slots
            self.keep_slots = []

    @torch.inference_mode()
    def rollback(self, length: int) -> None:
        """After a window of drafted rows: keep its first `length` positions, the rows past them rejected. The K/V
        cells past `length` are never read; the GDN states return to those kept after position length - 1 (one
        multi-tensor copy)."""
        if self.conv and length != self.length:
            kept = self.kept[length - 1]
            torch._foreach_copy_([t for i in kept for t in (self.conv[i], self.recurrent[i])],
                                 [t for pair in kept.values() for t in pair])
        self.release_kept()
        self.length = length
        self._keep_origin(length)

    @torch.inference_mode()
    def copy_from(self, other: "SessionState", length: int | None = None) -> None:
        """Become a copy of `other` (same layers): its first `length` committed K/V cells (all by default), GDN
        states and tokens, and its checkpoints up to `length` (host copies, shared). A GDN state is copied whole,
        or taken from `other`'s checkpoint at `length`."""
        n = other.length if length is None else length
        self.release_kept()
        if self.conv and n != other.length and n not in other.checkpoints:
            raise ValueError(f"a GDN state cannot be cut: copy all {other.length} positions or a checkpoint's "
                             f"({sorted(other.checkpoints) or 'none'}), not {n}")
        for i in self.k:
            self.k[i][:n] = other.k[i][:n]
            self.v[i][:n] = other.v[i][:n]
        if n == other.length:
            for i in self.conv:
                self.conv[i].copy_(other.conv[i])
                self.recurrent[i].copy_(other.recurrent[i])
        elif self.conv:
            self.set_gdn(other.checkpoints[n])
        self.length, self.tokens = n, other.tokens[:n]
        self.checkpoints = {p: c for p, c in other.checkpoints.items() if p <= n}
        self.origin = None

    def nbytes(self) -> int:
        tensors = (*self.k.values(), *self.v.values(), *self.conv.values(), *self.recurrent.values())
        return sum(t.numel() * t.element_size() for t in tensors)


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of `t` in host memory: pinned and asynchronous from a GPU."""
    if t.device.type != "cuda":
        return t.clone()
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host
