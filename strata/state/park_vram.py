"""Parking's first tier on a GPU: copies of recently parked conversations kept in spare VRAM (`--park-vram-gb`).

Host RAM holds every parked conversation (`strata.state.parking`), and a follow-up's restore copies it back over the
host link: 906 MB for 9,216 tokens of the Qwen3-30B-A3B shape took 17.5 ms on an H200, longer than the follow-up's
own window. With `--park-vram-gb G`, each GPU also keeps, in a block of G GB reserved at start, a copy of each
conversation as it is parked (a device-to-device copy beside the copy to host RAM, in the same stream), so a
follow-up that comes back while its copy is still there is restored at the GPU's own bandwidth. The copies take
consecutive regions of the block in the order they are made, so the oldest are written over first; host RAM keeps
its image either way (a copy written over costs only the faster restore). The restore's checks are the same: the
checksum of what arrives is compared with the one taken when the conversation was parked.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

import torch

from strata.errors import StrataError
from strata.state.parking import GB, HostRing, Snapshot, _aligned, _overlap
from strata.state.session import SessionState

KINDS = ("k", "v", "conv", "recurrent")


def park_vram_gb_problem(park_vram_gb: float) -> str | None:
    """Why `--park-vram-gb` cannot be this value, None when it can (what the GPU has is checked at `reserve`)."""
    if not park_vram_gb >= 0 or park_vram_gb == float("inf"):
        return f"{park_vram_gb} is not a size: give GB of VRAM, 0 or more (0: no copies in VRAM)"
    return None


def _indexed(device: torch.device | str) -> torch.device:
    """`cuda` as the `cuda:N` its tensors report (the blocks are found by their tensors' devices)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


class VramCopy:
    """One parked conversation's state as a GPU holds it: per kind ("k", "v", "conv", "recurrent") and layer, a
    tensor in its device's block; `regions`: (offset, bytes) taken in each device's block, and `bytes`: those
    regions, whose sums (of their 32-bit words) are taken as the copies are made and again when they are restored:
    one pass over each region instead of one per tensor."""

    def __init__(self, tensors: dict[str, dict[int, torch.Tensor]], regions: dict[torch.device, tuple[int, int]],
                 nbytes: int, blocks: dict[torch.device, torch.Tensor]):
        self.tensors, self.regions, self.nbytes = tensors, regions, nbytes
        self.bytes = {d: blocks[d][offset : offset + size] for d, (offset, size) in regions.items()}
        self.sums = self._sums()  # queued after the copies, on the same stream

    def _sums(self) -> dict[torch.device, torch.Tensor]:
        return {d: b.view(torch.int32).sum(dtype=torch.int64) for d, b in self.bytes.items()}

    def changed(self) -> str | None:
        """Why the copy is not what was kept (its regions' sums differ), None when it is; waits for the device."""
        now = self._sums()
        for d, total in now.items():
            if int(total) != int(self.sums[d]):
                return f"checksum {int(total):#x} of its copy in VRAM on {d}, kept {int(self.sums[d]):#x}"
        return None

    def pairs(self, state: SessionState, length: int) -> dict[torch.device, tuple[list, list]]:
        """The state's tensors to write and this copy's tensors to read, by device (the K/V cells [0, length))."""
        out: dict[torch.device, tuple[list, list]] = {}
        for kind, layers in zip(KINDS, (state.k, state.v, state.conv, state.recurrent)):
            for i, t in layers.items():
                dst = t[:length] if kind in ("k", "v") else t
                group = out.setdefault(dst.device, ([], []))
                group[0].append(dst)
                group[1].append(self.tensors[kind][i])
        return out


class VramTier:
    """Copies of parked conversations in `capacity` bytes of each GPU their states live on (a layer split's stages
    each keep their layers' part). The engine takes it on GPUs only; it works on any device (the tests' CPU)."""

    where = "vram"

    def __init__(self, capacity: int):
        if capacity < 0:
            raise StrataError(f"--park-vram-gb: {capacity} bytes; give 0 or more")
        self.capacity = capacity
        self.rings: dict[torch.device, HostRing] = {}
        self._copies: OrderedDict[int, tuple[Snapshot, VramCopy]] = OrderedDict()  # by id(snapshot), oldest first

    @property
    def conversations(self) -> int:
        return len(self._copies)

    @property
    def nbytes(self) -> int:
        return sum(copy.nbytes for _, copy in self._copies.values())

    def reserve(self, devices: Iterable[torch.device]) -> None:
        """Take the block on each GPU now (the engine's warm-up does it), so a size the GPU cannot hold beside the
        model is refused at start."""
        for device in devices:
            device = _indexed(device)
            if device in self.rings or not self.capacity:
                continue
            ring = HostRing(self.capacity)
            try:
                ring.block = torch.empty(self.capacity, dtype=torch.uint8, device=device)
            except torch.cuda.OutOfMemoryError:
                free, total = torch.cuda.mem_get_info(device)
                raise StrataError(f"--park-vram-gb {self.capacity / GB:g}: {device} has {free / GB:.1f} GB free of "
                                  f"{total / GB:.1f} GB beside the model and its cells; give at most that, or 0 (no "
                                  "copies in VRAM)") from None
            self.rings[device] = ring

    def keep(self, snapshot: Snapshot, state: SessionState, avoid: Snapshot | None = None) -> bool:
        """Copy what `state` holds into the blocks as `snapshot`'s VRAM copy (its whole state, whatever the host
        image shares with an older one); copies whose regions it takes are dropped, never `avoid`'s (a copy about to
        be restored from). False when a block cannot take it."""
        parts = dict(zip(KINDS, Snapshot.parts(state)))
        layers = dict(zip(KINDS, (state.k, state.v, state.conv, state.recurrent)))
        sizes: dict[torch.device, int] = {}
        for kind in KINDS:
            for t in parts[kind]:
                sizes[t.device] = sizes.get(t.device, 0) + _aligned(t.numel() * t.element_size())
        self.reserve(sizes)
        keep = self._copies.get(id(avoid)) if avoid is not None else None
        regions = {}
        for device, size in sizes.items():
            ring = self.rings.get(device)
            if ring is None or size > ring.capacity:
                return False
            offset = ring.place(size, [keep[1].regions[device]] if keep and device in keep[1].regions else [])
            if offset is None:
                return False
            regions[device] = (offset, size)
        for key, (_, copy) in list(self._copies.items()):
            if any(_overlap(r, copy.regions[d]) for d, r in regions.items() if d in copy.regions):
                del self._copies[key]
        at = {device: offset for device, (offset, _) in regions.items()}
        tensors: dict[str, dict[int, torch.Tensor]] = {}
        with torch.inference_mode():
            for kind in KINDS:
                tensors[kind] = {}
                for i, t in zip(layers[kind], parts[kind]):
                    view = self.rings[t.device].view(at[t.device], t)
                    view.copy_(t, non_blocking=True)
                    at[t.device] += _aligned(t.numel() * t.element_size())
                    tensors[kind][i] = view
        blocks = {d: self.rings[d].block for d in regions}
        self._copies[id(snapshot)] = (snapshot, VramCopy(tensors, regions, sum(sizes.values()), blocks))
        return True

    def copy_of(self, snapshot: Snapshot) -> VramCopy | None:
        """`snapshot`'s copy in VRAM, None when it has none (any more)."""
        found = self._copies.get(id(snapshot))
        return found[1] if found is not None and found[0] is snapshot else None

    def release(self, snapshot: Snapshot) -> None:
        """Forget `snapshot`'s copy (restored into a sequence, or no longer parked): its regions may be written."""
        found = self._copies.get(id(snapshot))
        if found is not None and found[0] is snapshot:
            del self._copies[id(snapshot)]

    def clear(self) -> None:
        self._copies.clear()
