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
"""

from __future__ import annotations

import itertools
import math
import os
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from strata.errors import StrataError
from strata.state.session import SessionState

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


def reusable(held: Sequence[int], prompt: Sequence[int], truncatable: bool) -> int:
    """How many leading tokens of `prompt` a state holding the tokens `held` can serve, leaving at least one to
    read: their common prefix when the state can be cut (attention layers only), else all of `held` when it is a
    prefix of the prompt, else none."""
    limit = len(prompt) - 1
    if truncatable:
        return min(common_prefix(held, prompt), max(limit, 0))
    return len(held) if len(held) <= limit and list(prompt[: len(held)]) == list(held) else 0


def snapshot_bytes(state: SessionState) -> int:
    """The host bytes a snapshot of `state` takes: K/V cells [0, length) and the whole GDN states."""
    n = state.length
    cells = sum(t[:n].numel() * t.element_size() for t in (*state.k.values(), *state.v.values()))
    gdn = sum(t.numel() * t.element_size() for t in (*state.conv.values(), *state.recurrent.values()))
    return cells + gdn


def _to_host(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Host copies of `tensors`: from a GPU into pinned memory without waiting (see `Snapshot.wait`), all of one
    dtype in one pinned block (a pinned allocation costs far more than a copy: one per layer made parking a
    conversation of 24 layers take tens of milliseconds)."""
    out: list[torch.Tensor | None] = [None] * len(tensors)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for j, t in enumerate(tensors):
        if t.device.type != "cuda":
            out[j] = t.clone()
        else:
            by_dtype.setdefault(t.dtype, []).append(j)
    for dtype, members in by_dtype.items():
        block = torch.empty(sum(tensors[j].numel() for j in members), dtype=dtype, pin_memory=True)
        at = 0
        for j in members:
            t = tensors[j]
            out[j] = block[at : at + t.numel()].view(t.shape)
            out[j].copy_(t, non_blocking=True)
            at += t.numel()
    return out


_copier: ThreadPoolExecutor | None = None  # parks' host copies, off the scheduler's thread (made at first use)


def _copy_later(tensors: list[torch.Tensor]) -> Future:
    """`_to_host(tensors)` done by a worker thread: a pinned allocation takes milliseconds (tens for a long
    conversation), which an admission must not wait for. Here the GPU tensors are only copied on the device (fast,
    asynchronous); the worker waits for those copies, moves them to pinned memory on a stream of its own, and
    the device copies are freed once it is done."""
    global _copier
    if _copier is None:
        _copier = ThreadPoolExecutor(1, thread_name_prefix="strata-park")
    staged = [t.clone() for t in tensors]
    devices = {t.device for t in staged if t.device.type == "cuda"}
    events = []
    for device in devices:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        events.append(event)

    def work() -> list[torch.Tensor]:
        with torch.inference_mode():
            for event in events:
                event.synchronize()
            streams = {d: torch.cuda.Stream(device=d) for d in devices}
            out = []
            for device, stream in streams.items():
                with torch.cuda.device(device), torch.cuda.stream(stream):
                    members = [j for j, t in enumerate(staged) if t.device == device]
                    out += list(zip(members, _to_host([staged[j] for j in members])))
            for stream in streams.values():
                stream.synchronize()
            done = dict(out)
            return [done[j] if j in done else t for j, t in enumerate(staged)]

    return _copier.submit(work)


@dataclass
class Snapshot:
    """One parked conversation: its tokens and a host copy of its state (per layer, as `SessionState` holds it).
    From a GPU the copy is made by a worker thread (`_copy_later`); `wait` (and `restore`) wait for it."""

    tokens: list[int]
    k: dict[int, torch.Tensor]  # [length, Hkv, D]
    v: dict[int, torch.Tensor]
    conv: dict[int, torch.Tensor]  # [K-1, C]
    recurrent: dict[int, torch.Tensor]  # [Hv, Dk, Dv] float32
    nbytes: int
    pending: Future | None = None  # the worker's host copies, in the order of `_parts`, until `wait` takes them
    layers: list[list[int]] = field(default_factory=list, repr=False)  # the layer ids of k, v, conv, recurrent

    @property
    def length(self) -> int:
        return len(self.tokens)

    @staticmethod
    def _parts(state) -> list[tuple[dict, int | None]]:
        return [(state.k, state.length), (state.v, state.length), (state.conv, None), (state.recurrent, None)]

    @classmethod
    @torch.inference_mode()
    def of(cls, state: SessionState) -> "Snapshot":
        """Copy `state`'s committed prefix to host memory (in the background from a GPU)."""
        parts = cls._parts(state)
        tensors = [t[:n] if n is not None else t for layers, n in parts for t in layers.values()]
        on_gpu = any(t.device.type == "cuda" for t in tensors)
        snap = cls(list(state.tokens), {}, {}, {}, {}, snapshot_bytes(state))
        snap.layers = [list(layers) for layers, _ in parts]
        if on_gpu:
            snap.pending = _copy_later(tensors)
        else:
            snap._fill(_to_host(tensors))
        return snap

    def _fill(self, flat: list[torch.Tensor]) -> None:
        at = 0
        for target, layers in zip((self.k, self.v, self.conv, self.recurrent), self.layers):
            target.update(zip(layers, flat[at : at + len(layers)]))
            at += len(layers)

    def wait(self) -> None:
        """Block until the copies into host memory are done (at once on the CPU)."""
        if self.pending is not None:
            self._fill(self.pending.result())
            self.pending = None

    @torch.inference_mode()
    def restore(self, state: SessionState, length: int) -> None:
        """Make `state` hold this conversation's first `length` positions (all of them with GDN layers)."""
        if state.conv and length != self.length:
            raise ValueError(f"a GDN state cannot be cut: restore all {self.length} positions, not {length}")
        self.wait()
        for i in state.k:
            state.k[i][:length].copy_(self.k[i][:length], non_blocking=True)
            state.v[i][:length].copy_(self.v[i][:length], non_blocking=True)
        for i in state.conv:
            state.conv[i].copy_(self.conv[i], non_blocking=True)
            state.recurrent[i].copy_(self.recurrent[i], non_blocking=True)
        state.length, state.tokens = length, self.tokens[:length]


class ParkingLot:
    """Parked conversations in host RAM, within `budget` bytes, the least recently parked evicted first.

    `truncatable`: the model has attention layers only, so a state can be cut to any prefix (see `reusable`)."""

    def __init__(self, budget: int, truncatable: bool):
        if budget < 0:
            raise StrataError(f"a parking budget of {budget} bytes: give 0 or more (0 turns parking off)")
        self.budget, self.truncatable = budget, truncatable
        self.nbytes = 0
        self.evictions = 0  # snapshots dropped to make room
        self._snapshots: OrderedDict[int, Snapshot] = OrderedDict()  # least recently parked first
        self._keys = itertools.count()

    @property
    def conversations(self) -> int:
        return len(self._snapshots)

    def park(self, state: SessionState) -> bool:
        """Keep a snapshot of what `state` holds; False when it holds nothing or does not fit in the budget at all
        (with a budget of 0: always). Snapshots that this one serves at least as well are dropped."""
        size = snapshot_bytes(state)
        if state.length == 0 or size > self.budget:
            return False
        for key, snap in list(self._snapshots.items()):
            if self._covers(state.tokens, snap.tokens):
                self._drop(key)
        while self.nbytes + size > self.budget:
            self._drop(next(iter(self._snapshots)))
            self.evictions += 1
        self._snapshots[next(self._keys)] = Snapshot.of(state)
        self.nbytes += size
        return True

    def best(self, prompt: Sequence[int]) -> tuple[int, Snapshot | None]:
        """The parked snapshot that serves the most leading tokens of `prompt`, and how many (0, None without one)."""
        found, count = None, 0
        for snap in self._snapshots.values():
            n = reusable(snap.tokens, prompt, self.truncatable)
            if n > count:
                found, count = snap, n
        return count, found

    def take(self, snapshot: Snapshot) -> None:
        """Unpark `snapshot`: its conversation goes back to a sequence (parked again when that one is reused)."""
        for key, snap in self._snapshots.items():
            if snap is snapshot:
                self._drop(key)
                return

    def clear(self) -> None:
        for key in list(self._snapshots):
            self._drop(key)

    def _drop(self, key: int) -> None:
        self.nbytes -= self._snapshots.pop(key).nbytes

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
    count, source = reusable(state.tokens, prompt, lot.truncatable), state
    for other in idle:
        if other is not state and (n := reusable(other.tokens, prompt, lot.truncatable)) > count:
            count, source = n, other
    parked, snap = lot.best(prompt)
    if parked > count:
        count, source = parked, snap
        lot.take(snap)  # before parking `state`, so making room cannot evict it
    if source is not state or count < state.length:
        lot.park(state)
    if source is state:
        state.truncate(count)
    elif isinstance(source, Snapshot):
        source.restore(state, count)
    else:
        state.copy_from(source, count)
    return count
