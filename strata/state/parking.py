"""Conversation parking: an idle conversation's state kept, so that its follow-up does not read its prompt again.

When a slot (or the solo session) finishes, its state stays where it is, idle. When that sequence is given to
another conversation, its old state is first *parked*: a `Snapshot` (its committed tokens, each attention
layer's K/V cells [0, length), each GDN layer's conv and recurrent state) copied into host RAM, pinned when the
state lives on a GPU so the copies run asynchronously. A `ParkingLot` keeps snapshots within a byte budget
and evicts the least recently parked first.

An admission keeps the longest reusable prefix of its prompt that the sequence itself, another idle sequence
or a parked snapshot holds (`reuse_prefix`), and reads only the rest. What is reusable (`reusable`):

- K/V cells can be cut anywhere (cells past `length` are never read), so a model with only attention layers
  reuses the longest common prefix of the held tokens and the prompt;
- a GDN state has absorbed every token it holds and cannot be cut, so a model with GDN layers reuses a state
  only when all of its tokens are a prefix of the prompt;
- at least one prompt token is always read: the logits of its last row give the first new token.

A snapshot is checked before it is written back (`Snapshot.problem`, then `Snapshot.restore`): the model's
fingerprint, the layers and each tensor's shape and dtype against the sequence it goes into, the hash of its tokens,
and a checksum of its bytes (a 64-bit sum of their 32-bit words, taken on the state's device when parked and again
on the device after the copy back, so the check costs no pass over host memory). A snapshot that fails is refused
with a log line naming what was wrong and dropped; the sequence it was meant for is reset (what it held was parked
before) and the prompt is read in full: no other state is touched and the answer is the same.

With `--park-dir`, `disk` (`strata.state.park_disk.DiskTier`) is a second tier: every snapshot parked here is also
written to a file there in the background, and `best` looks there after host RAM (files outlive the process).
"""

from __future__ import annotations

import array
import hashlib
import itertools
import logging
import math
import os
import re
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import MISSING, dataclass, field, fields
from typing import TYPE_CHECKING, ClassVar

import torch

from strata.errors import StrataError
from strata.state.session import SessionState, checksum  # noqa: F401 (park_disk and the tests take it from here)

if TYPE_CHECKING:
    from strata.state.park_vram import VramCopy

log = logging.getLogger("strata.engine")
GB = 1e9
DEFAULT_PARK_GB = 4.0  # the default budget, capped at a quarter of the host's RAM


def host_ram_bytes() -> int | None:
    """The host's physical memory, None where the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def park_gb_problem(park_gb: float) -> str | None:
    """What is wrong with a `--park-gb` value, None when nothing is."""
    if not math.isfinite(park_gb) or park_gb < 0:
        return "give the GB of host RAM for parked conversations, a number of 0 or more (0 turns parking off)"
    ram = host_ram_bytes()
    if ram is not None and park_gb * GB > ram:
        return (f"this host has {ram / GB:.1f} GB of RAM in all, and the weights and the OS need their share; "
                f"give a part of it (the default is {DEFAULT_PARK_GB:g}), or 0 to turn parking off")
    return None


def park_budget(park_gb: float | None) -> int:
    """Bytes of host RAM that parked conversations may take: `park_gb` GB (0: parking off), or by default
    4 GB, or a quarter of the host's RAM where that is less. Refuses a budget the host cannot hold."""
    if park_gb is None:
        ram = host_ram_bytes()
        return int(min(DEFAULT_PARK_GB * GB, ram / 4)) if ram else int(DEFAULT_PARK_GB * GB)
    problem = park_gb_problem(park_gb)
    if problem:
        raise StrataError(f"--park-gb {park_gb:g}: {problem}")
    return int(park_gb * GB)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    if list(a[:n]) == list(b[:n]):
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]; list slices compare in C
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if list(a[:mid]) == list(b[:mid]):
            lo = mid
        else:
            hi = mid
    return lo


def reusable(held: Sequence[int], prompt: Sequence[int], truncatable: bool, checkpoints: Iterable[int] = ()) -> int:
    """How many leading tokens of `prompt` a state holding the tokens `held` can serve, leaving at least one to
    read: their common prefix when the state can be cut (attention layers only), else all of `held` when it is a
    prefix of the prompt, else the latest of its GDN `checkpoints` (positions) within their common prefix, else
    none."""
    limit = len(prompt) - 1
    if truncatable:
        return min(common_prefix(held, prompt), max(limit, 0))
    if len(held) <= limit and list(prompt[: len(held)]) == list(held):
        return len(held)
    checkpoints = [c for c in checkpoints if c <= limit]
    if not checkpoints:
        return 0
    shared = common_prefix(held, prompt)
    return max((c for c in checkpoints if c <= shared), default=0)


def snapshot_bytes(state: SessionState) -> int:
    """The host bytes a snapshot of `state` takes: K/V cells [0, length) and the whole GDN states."""
    n = state.length
    cells = sum(t[:n].numel() * t.element_size() for t in (*state.k.values(), *state.v.values()))
    gdn = sum(t.numel() * t.element_size() for t in (*state.conv.values(), *state.recurrent.values()))
    return cells + gdn


class SnapshotRefused(StrataError):
    """A parked image that does not belong to this model, these layers or these tokens, or whose bytes changed."""


SAMPLES, SAMPLE_BYTES = 16, 64 << 10  # slices of a weight file read into the model's fingerprint


def _file_digest(path: str) -> tuple[str, int, str]:
    """A weight file's name, size and a hash of SAMPLES slices of SAMPLE_BYTES spread over it, from its first byte
    to its last (the whole file when it is smaller): another model of the same shape has other bytes in every
    slice, and reading 1 MB of a file costs milliseconds whatever its size."""
    size = os.path.getsize(path)
    digest = hashlib.blake2b(digest_size=8)
    with open(path, "rb") as f:
        if size <= SAMPLES * SAMPLE_BYTES:
            digest.update(f.read())
        else:
            for i in range(SAMPLES):
                f.seek(i * (size - SAMPLE_BYTES) // (SAMPLES - 1))
                digest.update(f.read(SAMPLE_BYTES))
    return os.path.basename(path), size, digest.hexdigest()


def model_fingerprint(spec, dtype: torch.dtype, path: str | os.PathLike | None = None,
                      quantization: str | None = None) -> str:
    """What a parked image must have been made by: the model's shapes (its `ModelSpec`), the state's dtype, the
    checkpoint's weight files (`path`, a file or a folder: each one's name, size and sampled bytes, `_file_digest`)
    and the format its weights were quantized to as they loaded (`--quantization`), so that an image written by
    another model of the same shape, or by the same model quantized otherwise, is refused."""
    files = []
    if path is not None and os.path.isdir(path):
        files = [_file_digest(os.path.join(path, f)) for f in sorted(os.listdir(path))
                 if f.endswith((".safetensors", ".gguf", ".bin"))]
    elif path is not None and os.path.exists(path):
        files = [_file_digest(str(path))]
    text = f"{spec!r}|{dtype}|{files}|{quantization}"
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def token_hash(tokens: Sequence[int]) -> str:
    """A 128-bit hash of the token ids (as int64 words: 0.5 ms for 9K tokens, where hashing their text took 2.4)."""
    return hashlib.blake2b(array.array("q", tokens).tobytes(), digest_size=16).hexdigest()


class RunningChecksum:
    """`checksum` of tensors being written by copies queued on their device's stream, summed on a side stream in
    batches of about `BATCH` bytes as soon as the copies queued before them are done: the sums run while the later
    copies do, so a restore ends with its last copy plus one batch's sums instead of the sums of every tensor (on the
    CPU: summed at once)."""

    BATCH = 64 << 20
    _side: ClassVar[dict[torch.device, "torch.cuda.Stream"]] = {}

    def __init__(self):
        self.total: torch.Tensor | int = 0
        self.pending: list[torch.Tensor] = []
        self.pending_bytes = 0
        self.sides: set[torch.device] = set()

    def add(self, t: torch.Tensor) -> None:
        if t.device.type != "cuda":
            self._sum([t])
            return
        if self.pending and self.pending[0].device != t.device:
            self._flush()
        self.pending.append(t)
        self.pending_bytes += t.numel() * t.element_size()
        if self.pending_bytes >= self.BATCH:
            self._flush()

    def _sum(self, tensors: list[torch.Tensor]) -> None:
        part = checksum(tensors)
        self.total = part if isinstance(self.total, int) else self.total.to(part.device) + part

    def _flush(self) -> None:
        if not self.pending:
            return
        device = self.pending[0].device
        side = self._side.get(device)
        if side is None:
            side = self._side[device] = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))  # after the copies queued so far
        with torch.cuda.stream(side):
            self._sum(self.pending)
        self.sides.add(device)
        self.pending, self.pending_bytes = [], 0

    def value(self) -> int:
        """The sum (waits for the copies and the sums)."""
        self._flush()
        for device in self.sides:
            torch.cuda.current_stream(device).wait_stream(self._side[device])
        return int(self.total)


REUSE_MIN_CELLS = 16  # a re-park extends the image a state was restored from when they share at least these cells
ALIGN = 256  # bytes: where each tensor of a snapshot starts in the ring


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    """Whether two (offset, bytes) regions share a byte."""
    return a[0] < b[0] + b[1] and b[0] < a[0] + a[1] and a[1] > 0 and b[1] > 0


def _flatten(name: str, value, out: dict) -> None:
    """Name every tensor inside `value` (dicts, tuples and lists, nested) by the keys and positions down to it."""
    if isinstance(value, torch.Tensor):
        out[name] = value
    elif isinstance(value, dict):
        for key, item in value.items():
            _flatten(f"{name}.{key}", item, out)
    elif isinstance(value, (tuple, list)):
        for i, item in enumerate(value):
            _flatten(f"{name}[{i}]", item, out)


_STEP = re.compile(r"\.([^.\[\]]+)|\[(\d+)\]")


def _unflatten(named: dict[str, object]) -> dict[str, object]:
    """Back from `_flatten`'s names to values by field: `.key` a dict's key (an int when it is digits), `[i]` a
    tuple's position."""
    fields_: dict[str, object] = {}
    for name, tensor in named.items():
        head = re.match(r"[^.\[]+", name)
        steps = _STEP.findall(name[head.end():]) if head else []
        if not head or "".join(f".{k}" if k else f"[{i}]" for k, i in steps) != name[head.end():]:
            raise ValueError(f"{name!r} is not the name of a snapshot's tensor")
        node, key = fields_, head.group()
        for k, i in steps:
            node = node.setdefault(key, {})
            key = ("[]", int(i)) if i else (int(k) if k.isdigit() else k)
        node[key] = tensor

    def build(value):
        if not isinstance(value, dict):
            return value
        if value and all(isinstance(k, tuple) for k in value):
            return tuple(build(value[k]) for k in sorted(value, key=lambda k: k[1]))
        return {k: build(v) for k, v in value.items()}

    return {name: build(value) for name, value in fields_.items()}


class HostRing:
    """The parking lot's host memory: one block of `capacity` bytes, pinned when the states live on a GPU, made
    once (`reserve`: the engine does it while warming up). Snapshots take consecutive regions in the order they
    are parked, wrapping around at the end, so the region a new snapshot needs holds the least recently parked ones,
    which are evicted. Pinning costs milliseconds per megabyte: one allocation for good, instead of one per
    snapshot, keeps that off every admission."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.block: torch.Tensor | None = None
        self.head = 0

    def reserve(self, pinned: bool) -> None:
        if self.block is None and self.capacity:
            pinned = pinned and torch.cuda.is_available()
            self.block = torch.empty(self.capacity, dtype=torch.uint8, pin_memory=pinned)

    def place(self, size: int, avoid: Iterable[tuple[int, int]] = ()) -> int | None:
        """The offset of `size` bytes at the head (wrapping to 0 when they do not fit before the end), never over
        a region of `avoid` ((offset, bytes) each); None when no such place exists (the head stays where it was)."""
        avoid, head = list(avoid), self.head
        for _ in range(len(avoid) + 3):
            if self.head + size > self.capacity:
                self.head = 0
            start, end = self.head, self.head + size
            hit = next((a for a in avoid if _overlap((start, size), a)), None)
            if hit is not None:
                self.head = hit[0] + hit[1]
                continue
            self.head = end
            return start
        self.head = head
        return None

    def view(self, offset: int, like: torch.Tensor) -> torch.Tensor:
        return self.block[offset : offset + like.numel() * like.element_size()].view(like.dtype).view(like.shape)


@dataclass
class Snapshot:
    """One parked conversation: its tokens and a host copy of its state (per layer, as `SessionState` holds it), in
    its region of the lot's ring."""

    where: ClassVar[str] = "ram"  # the tier it is parked in (a file's: "disk")
    tokens: list[int]
    k: dict[int, torch.Tensor]  # [length, Hkv, D]
    v: dict[int, torch.Tensor]
    conv: dict[int, torch.Tensor]  # [K-1, C]
    recurrent: dict[int, torch.Tensor]  # [Hv, Dk, Dv] float32
    nbytes: int
    region: tuple[int, int] = (0, 0)  # (offset, bytes) in the ring
    copied: list = field(default_factory=list)  # CUDA events: the copies into host memory are done once they are
    fingerprint: str = ""  # the model's (`ParkingLot.fingerprint`)
    tokens_hash: str = ""  # of `tokens`, as parked
    sum: torch.Tensor | int = 0  # `checksum` of its tensors, taken on the state's device when parked
    checkpoints: dict = field(default_factory=dict)  # the state's GDN checkpoints (host copies, shared with it)
    # reuse on re-park: the image this one extends, whose first `base_cells` K/V cells it shares (its own `k` and
    # `v` hold cells [base_cells, length) only); None: it holds every cell
    base: "Snapshot | None" = None
    base_cells: int = 0

    MAX_DEPTH: ClassVar[int] = 4  # images in a chain of bases, at most: a restore copies each one's cells

    @property
    def length(self) -> int:
        return len(self.tokens)

    @property
    def depth(self) -> int:
        return 1 + (self.base.depth if self.base is not None else 0)

    def regions(self) -> list[tuple[int, int]]:
        """The ring regions this image reads: its own and its bases'."""
        return [self.region] + (self.base.regions() if self.base is not None else [])

    def pieces(self, end: int | None = None) -> list[tuple["Snapshot", int, int]]:
        """Where cells [0, end) are (all of them by default): (image, first cell, end cell) in order, the image's
        own `k[i][first - image.base_cells : end - image.base_cells]`."""
        end = self.length if end is None else end
        out = self.base.pieces(min(self.base_cells, end)) if self.base is not None and self.base_cells else []
        if end > self.base_cells:
            out.append((self, self.base_cells, end))
        return out

    def cells(self, kind: str) -> dict[int, torch.Tensor]:
        """Every layer's K (`kind` "k") or V cells [0, length) as one tensor: the image's own, or its pieces joined
        (a copy) when it extends a base."""
        own = getattr(self, kind)
        if self.base is None:
            return own
        return {i: torch.cat([getattr(img, kind)[i][a - img.base_cells : b - img.base_cells]
                              for img, a, b in self.pieces()]) for i in own}

    @staticmethod
    def parts(state: SessionState, first: int = 0) -> list[list[torch.Tensor]]:
        """The tensors a snapshot of `state` keeps: K cells [first, length), V cells, conv and recurrent states."""
        n = state.length
        return [[t[first:n] for t in state.k.values()], [t[first:n] for t in state.v.values()],
                list(state.conv.values()), list(state.recurrent.values())]

    @staticmethod
    def region_bytes(state: SessionState, first: int = 0) -> int:
        return sum(_aligned(t.numel() * t.element_size()) for part in Snapshot.parts(state, first) for t in part)

    @classmethod
    @torch.inference_mode()
    def of(cls, state: SessionState, ring: HostRing, offset: int, fingerprint: str = "",
           base: "Snapshot | None" = None, base_cells: int = 0) -> "Snapshot":
        """Copy `state`'s committed prefix into the ring at `offset` (asynchronously from a GPU), with what
        `problem` and `restore` check it by. With `base`, an image whose first `base_cells` cells `state` still
        holds unchanged: only the cells past them are copied (and the GDN states, whole)."""
        total = checksum(t for part in cls.parts(state) for t in part)
        dicts, at = [], offset
        for layers, part in zip((state.k, state.v, state.conv, state.recurrent), cls.parts(state, base_cells)):
            host = {}
            for i, t in zip(layers, part):
                host[i] = ring.view(at, t)
                host[i].copy_(t, non_blocking=t.device.type == "cuda")
                at += _aligned(t.numel() * t.element_size())
            dicts.append(host)
        snap = cls(list(state.tokens), *dicts, snapshot_bytes(state), (offset, at - offset),
                   fingerprint=fingerprint, tokens_hash=token_hash(state.tokens), sum=total,
                   checkpoints=dict(state.checkpoints), base=base, base_cells=base_cells if base is not None else 0)
        snap.copied += state.checkpoint_events  # the checkpoints' copies into host memory
        devices = {t.device for t in (*state.k.values(), *state.conv.values()) if t.device.type == "cuda"}
        for device in devices:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            snap.copied.append(event)
        return snap

    def wait(self) -> None:
        """Block until the copies into host memory are done (at once on the CPU)."""
        for event in self.copied:
            event.synchronize()
        self.copied = []

    # what a file holds (`strata.state.park_disk`): the fields below travel in its header, every other field's
    # tensors by name
    METADATA = ("tokens", "nbytes", "region", "copied", "fingerprint", "tokens_hash", "sum", "base", "base_cells")

    def named_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor of this snapshot by a stable name: each field but `METADATA`, and in it the dict keys and
        tuple positions down to the tensor (`k.3`, `recurrent.0`, `checkpoints.8.0[1]`); a field added later
        travels as it is. An image that extends a base gives its cells whole (a file stands alone). `from_named`
        builds the snapshot back."""
        named: dict[str, torch.Tensor] = {}
        for f in fields(self):
            if f.name not in self.METADATA:
                value = self.cells(f.name) if f.name in ("k", "v") else getattr(self, f.name)
                _flatten(f.name, value, named)
        return named

    @classmethod
    def from_named(cls, tensors: dict[str, torch.Tensor], **metadata) -> "Snapshot":
        """A snapshot from `named_tensors`' names and tensors, and its `METADATA` fields (`tokens`, `nbytes`, ...)
        as keywords; a field without a tensor takes its default, or {} (a model without such layers)."""
        values = _unflatten(tensors)
        unknown = set(values) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"tensors of no field of a snapshot: {sorted(unknown)}")
        for f in fields(cls):
            if f.name not in values and f.name not in metadata and f.default is MISSING \
                    and f.default_factory is MISSING:
                values[f.name] = {}
        return cls(**values, **metadata)

    def problem(self, state: SessionState, fingerprint: str = "") -> str | None:
        """Why this snapshot cannot go into `state` (another model, other layers, shapes or dtypes, tokens that
        changed), None when it can; nothing is written."""
        if self.fingerprint != fingerprint:
            return f"it was parked by another model (fingerprint {self.fingerprint or '-'}, this one {fingerprint or '-'})"
        if token_hash(self.tokens) != self.tokens_hash:
            return "its token list does not match the hash taken when it was parked"
        n = self.length
        if n > state.max_cells:
            return f"it holds {n} positions and the sequence has {state.max_cells} cells"
        for name, mine, theirs, cells in (("K", self.k, state.k, True), ("V", self.v, state.v, True),
                                          ("conv", self.conv, state.conv, False),
                                          ("recurrent", self.recurrent, state.recurrent, False)):
            if sorted(mine) != sorted(theirs):
                return f"its {name} layers are {sorted(mine)}, the sequence's {sorted(theirs)}"
            for i, t in mine.items():
                shape = (n - self.base_cells, *theirs[i].shape[1:]) if cells else tuple(theirs[i].shape)
                if tuple(t.shape) != shape or t.dtype != theirs[i].dtype:
                    return (f"layer {i}'s {name} is {tuple(t.shape)} {t.dtype}, the sequence needs {shape} "
                            f"{theirs[i].dtype}")
        return None

    @torch.inference_mode()
    def restore(self, state: SessionState, length: int, fingerprint: str = "",
                device_copy: "VramCopy | None" = None) -> None:
        """Make `state` hold this conversation's first `length` positions (all of them with GDN layers). Checked
        first (`problem`: nothing written when it fails) and after the copy (the checksum of what arrived: `state`
        is reset when it differs); either raises SnapshotRefused. Every parked cell is copied back, so the check
        covers them all (cells past `length` are never read). `device_copy`: the conversation's copy in VRAM
        (`strata.state.park_vram.VramCopy`), read instead of the host image: all its tensors in one multi-tensor copy
        a device, and its regions summed again (one pass each) against their sums when it was made."""
        if state.conv and length != self.length and length not in self.checkpoints:
            raise ValueError(f"a GDN state cannot be cut: restore all {self.length} positions or a checkpoint's "
                             f"({sorted(self.checkpoints) or 'none'}), not {length}")
        problem = self.problem(state, fingerprint)
        if problem:
            raise SnapshotRefused(problem)
        n = self.length
        if device_copy is not None:  # device to device, ordered after the copies that made it (the same stream)
            for dst, src in device_copy.pairs(state, n).values():
                torch._foreach_copy_(dst, src, non_blocking=True)
            state.length, state.tokens = n, list(self.tokens)
            changed = device_copy.changed()  # its regions summed again after the copies: waits for them
            if changed:
                state.reset()
                raise SnapshotRefused(f"its bytes changed since it was parked ({changed})")
        else:
            self._restore_from_host(state, n)
        state.checkpoints = dict(self.checkpoints)
        state.origin = (self, n)
        state.truncate(length)  # with GDN layers: back to the checkpoint at `length`
        if state.conv and length != n:
            self._check_checkpoint(state, length)

    def _check_checkpoint(self, state: SessionState, length: int) -> None:
        """The GDN states just taken from the checkpoint at `length` against the checksum of the device states it was
        copied from (a checkpoint read from a park file has none: the file's own sum covered it)."""
        taken = getattr(self.checkpoints[length], "sum", None)
        if taken is None:
            return
        arrived = int(checksum(t for i in state.conv for t in (state.conv[i], state.recurrent[i])))
        if arrived != int(taken):
            state.reset()
            raise SnapshotRefused(f"its GDN checkpoint at {length} positions changed since it was taken (checksum "
                                  f"{arrived:#x}, taken {int(taken):#x})")

    def _restore_from_host(self, state: SessionState, n: int) -> None:
        """Copy the host image (and its bases' cells) into `state`, checking the checksum of what arrived."""
        self.wait()
        pieces = self.pieces()
        for img, _, _ in pieces:
            img.wait()
        arrived = RunningChecksum()  # each tensor summed as soon as its copies are done, beside the next copies
        for kind, cells in (("k", state.k), ("v", state.v)):
            for i, t in cells.items():
                for img, a, b in pieces:
                    t[a:b].copy_(getattr(img, kind)[i][a - img.base_cells : b - img.base_cells], non_blocking=True)
                arrived.add(t[:n])
        for i in state.conv:
            state.conv[i].copy_(self.conv[i], non_blocking=True)
            arrived.add(state.conv[i])
            state.recurrent[i].copy_(self.recurrent[i], non_blocking=True)
            arrived.add(state.recurrent[i])
        state.length, state.tokens = n, list(self.tokens)
        arrived = arrived.value()  # waits for the copies
        if arrived != int(self.sum):
            state.reset()
            raise SnapshotRefused(f"its bytes changed since it was parked (checksum {arrived:#x}, parked "
                                  f"{int(self.sum):#x})")


class ParkingLot:
    """Parked conversations in host RAM, within `budget` bytes, the least recently parked evicted first.

    `truncatable`: the model has attention layers only, so a state can be cut to any prefix (see `reusable`)."""

    def __init__(self, budget: int, truncatable: bool, fingerprint: str = "", disk=None):
        """`fingerprint`: the model's (`model_fingerprint`): a snapshot parked under another is refused. `disk`: the
        files of `--park-dir` (`strata.state.park_disk.DiskTier`), written through and searched after host RAM."""
        if budget < 0:
            raise StrataError(f"a parking budget of {budget} bytes: give 0 or more (0 turns parking off)")
        self.budget, self.truncatable, self.fingerprint = budget, truncatable, fingerprint
        self.refused = 0  # snapshots refused at restore (`SnapshotRefused`)
        self.restores: list[tuple[float, int, str]] = []  # (seconds, tokens, tier) of restores not yet reported
        self.ring = HostRing(budget)
        self.nbytes = 0
        self.evictions = 0  # snapshots dropped to make room
        self._snapshots: OrderedDict[int, Snapshot] = OrderedDict()  # least recently parked first
        self._keys = itertools.count()
        # images out of the lot whose ring bytes are still intact (taken by a sequence, or replaced by a later turn
        # of their conversation): a sequence restored from one copies only its new cells when parked again
        self._intact: dict[int, Snapshot] = {}
        self.reused_bytes = 0  # bytes that re-parks did not copy again (running total)
        self.disk = disk
        self.vram = None  # with --park-vram-gb: copies in spare VRAM, restored first (`strata.state.park_vram`)

    @property
    def conversations(self) -> int:
        return len(self._snapshots)

    def park(self, state: SessionState, avoid: Snapshot | None = None) -> bool:
        """Keep a snapshot of what `state` holds; False when it holds nothing or does not fit in the budget at all
        (with a budget of 0: always). Snapshots that this one serves at least as well are dropped, and those whose
        ring region it takes are evicted (the least recently parked). `avoid`: a snapshot just taken whose region
        must not be written yet (its restore reads it after this park).

        A state restored from an image whose ring bytes are intact copies only the cells it wrote since (past the
        cells it still shares with that image) and its GDN states: the new image extends the old one (`base`),
        whose bytes it then needs; `reused_bytes` counts what was not copied."""
        if state.length == 0:
            return False
        base, shared = self._base(state)
        size = Snapshot.region_bytes(state, shared)
        if size > self.budget:
            return False
        self.ring.reserve(pinned=any(t.device.type == "cuda" for t in (*state.k.values(), *state.conv.values())))
        keep = ([avoid.region] if avoid is not None and avoid.where == "ram" else []) + \
            (base.regions() if base is not None else [])
        offset = self._place(size, keep)
        if offset is None and base is not None:  # no room beside the old image's bytes: copy every cell
            base, shared, size = None, 0, Snapshot.region_bytes(state)
            offset = self._place(size, keep[:1])
        if offset is None:
            return False
        new = (offset, size)
        for key, snap in list(self._snapshots.items()):
            if any(_overlap(new, r) for r in snap.regions()):
                self._drop(key, intact=False)
                self.evictions += 1
            elif self._covers(state.tokens, snap.tokens):
                self._drop(key)
        for key, snap in list(self._intact.items()):
            if any(_overlap(new, r) for r in snap.regions()):
                del self._intact[key]
        snap = Snapshot.of(state, self.ring, offset, self.fingerprint, base, shared)
        if self.vram is not None:
            self.vram.keep(snap, state, avoid)
        self._snapshots[next(self._keys)] = snap
        self.nbytes += snap.nbytes
        if base is not None:
            self.reused_bytes += sum(t[:shared].numel() * t.element_size() for t in (*state.k.values(), *state.v.values()))
        state.origin = (snap, state.length)  # parked again later, it extends this image
        if self.disk is not None:
            self.disk.write(snap, self._covers)  # in the background, once its copies are done
        return True

    def _place(self, size: int, keep: list[tuple[int, int]]) -> int | None:
        """A ring offset for `size` bytes away from `keep`, and away from the older regions that parked images
        extending others still read (their bases'), so that writing over an old base does not evict a recent image
        before the images parked between them: the ring's head skips those regions while it can. The least
        recently parked image's bases are not kept (it is the next to go anyway); without room otherwise, the
        head writes over bases too (the images on them are evicted)."""
        chained = [s for s in list(self._snapshots.values())[1:] if s.base is not None]
        if chained:
            offset = self.ring.place(size, keep + [r for s in chained for r in s.base.regions()])
            if offset is not None:
                return offset
        return self.ring.place(size, keep)

    def _base(self, state: SessionState) -> tuple[Snapshot | None, int]:
        """The image `state` was restored from, when its ring bytes are intact and its chain of bases is short
        enough, and how many leading cells `state` still shares with it (none: (None, 0))."""
        if state.origin is None:
            return None, 0
        image, cells = state.origin
        cells = min(cells, state.length, image.length)
        intact = self._intact.get(id(image)) is image or any(s is image for s in self._snapshots.values())
        if not intact or cells < REUSE_MIN_CELLS or image.depth >= Snapshot.MAX_DEPTH or not state.k \
                or state.tokens[:cells] != image.tokens[:cells]:
            return None, 0
        return image, cells

    def best(self, prompt: Sequence[int]) -> tuple[int, Snapshot | None]:
        """The parked snapshot that serves the most leading tokens of `prompt`, and how many (0, None without one)."""
        found, count = None, 0
        files = self.disk.candidates(prompt) if self.disk is not None else ()
        for snap in itertools.chain(self._snapshots.values(), files):  # host RAM first: a tie stays there
            n = reusable(snap.tokens, prompt, self.truncatable, snap.checkpoints)
            if n > count:
                found, count = snap, n
        return count, found

    def take(self, snapshot: Snapshot) -> None:
        """Unpark `snapshot`: its conversation goes back to a sequence (parked again when that one is reused). A
        file's snapshot is read into host memory here (its file stays, now the most recently used)."""
        for key, snap in self._snapshots.items():
            if snap is snapshot:
                self._drop(key, taken=True)
                break
        if self.disk is not None:
            self.disk.take(snapshot)

    def clear(self) -> None:
        for key in list(self._snapshots):
            self._drop(key, intact=False)
        self._intact.clear()
        if self.vram is not None:
            self.vram.clear()

    def _drop(self, key: int, intact: bool = True, taken: bool = False) -> None:
        """Take a snapshot out of the lot; `intact`: its ring bytes stay as they are for now (taken, or replaced
        by a later turn), so a sequence restored from it may still extend it."""
        snap = self._snapshots.pop(key)
        self.nbytes -= snap.nbytes
        if self.vram is not None and not taken:  # its copy in VRAM goes too, unless a restore is about to read it
            self.vram.release(snap)
        if intact and snap.where == "ram":
            self._intact[id(snap)] = snap
        if self.disk is not None:
            self.disk.release(snap)  # its ring region may be written over: a write of it not done is given up

    def _covers(self, tokens: Sequence[int], other: Sequence[int]) -> bool:
        """A state holding `tokens` serves every prompt at least as well as one holding `other`."""
        if self.truncatable:
            return len(other) <= len(tokens) and list(tokens[: len(other)]) == list(other)
        return list(tokens) == list(other)


@torch.inference_mode()
def reuse_prefix(state: SessionState, prompt: Sequence[int], idle: Iterable[SessionState], lot: ParkingLot) -> int:
    """Make `state` hold the longest reusable prefix of `prompt` found in itself, in an `idle` sequence (copied) or
    in a parked snapshot (restored); return its length, the prompt tokens that need no reading. Whatever `state`
    held that it does not keep is parked first (when the lot takes it)."""
    count, source = reusable(state.tokens, prompt, lot.truncatable, state.checkpoints), state
    for other in idle:
        if other is not state and (n := reusable(other.tokens, prompt, lot.truncatable, other.checkpoints)) > count:
            count, source = n, other
    parked, snap = lot.best(prompt)
    started = time.perf_counter()
    if parked > count:
        count, source = parked, snap
        lot.take(snap)  # before parking `state`, so making room cannot evict it (a file's is read here)
    if source is not state or count < state.length:
        lot.park(state, avoid=source if isinstance(source, Snapshot) else None)
    if source is state:
        state.truncate(count)
    elif isinstance(source, Snapshot):
        copy = lot.vram.copy_of(source) if lot.vram is not None else None
        try:
            source.restore(state, count, lot.fingerprint, copy)  # its checksum waits for the copies
            lot.restores.append((time.perf_counter() - started, count, "vram" if copy is not None else source.where))
        except SnapshotRefused as e:
            lot.refused += 1
            log.warning("a parked conversation of %d tokens was refused: %s; its prompt (%d tokens) is read again",
                        source.length, e, len(prompt))
            state.reset()
            return 0
        finally:
            if copy is not None:  # the conversation is in a sequence now (or refused): its copy's regions are free
                lot.vram.release(source)
    else:
        state.copy_from(source, count)
    return count
