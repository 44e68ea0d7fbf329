"""Parked conversations on disk: a second tier under the host-RAM ring (`--park-dir`, `--park-disk-gb`).

Every snapshot parked in host RAM (`ParkingLot.park`) is also written to a file in the park folder, by a background
thread once the snapshot's copies into host memory are done (`Snapshot.wait`): an admission never waits for a disk
write. The files outlive the process: a new engine on the same folder reads their headers (never their tensors) and
knows their conversations by their tokens, so a follow-up of a conversation parked before a restart reads only its
new tokens. `ParkingLot.best` looks in host RAM first, then here (the longest reusable prefix wins, a tie stays in
RAM); taking a file's conversation reads its tensors into host memory (pinned on a GPU) and restores it through the
same `Snapshot.restore`, checks included.

The format, version 2 (version 1 hashed the tokens' text; its files are refused as another version): a safetensors file named `<token hash>.park.safetensors`, written under a temporary name and
renamed (a reader never sees half a file). Its tensors are the snapshot's (`Snapshot.named_tensors`: `k.3`,
`recurrent.0`, ...); its header's metadata (strings) says:

- `format`: "strata-parked-conversation", `format_version`: "2";
- `fingerprint`: the model's (`model_fingerprint`): a file of another model is refused;
- `tokens`: the conversation's tokens, base64 of int32 little-endian; `token_hash`: their hash (`token_hash`);
- `checksum`: the snapshot's own checksum (taken on the device when parked; `Snapshot.restore` checks it again);
- `data_checksum`: the same sum over every tensor of the file, checked when the file is read back;
- `nbytes`: the state's bytes (`snapshot_bytes`); `length`: the token count.

A file that fails a check is refused with a warning naming it and why: a damaged one (not a complete safetensors
file, tokens that do not match their hash, bytes that changed) is deleted; an intact one that belongs elsewhere
(another model, another format version, other layers or fewer cells than this engine's sequences) is renamed
`*.refused`. Either way the prompt is read again and nothing else changes. The files' bytes stay within
`--park-disk-gb`, the least recently used (written or taken) deleted first; a failed write (a full disk, no
permission) is a warning, never a failed request. One engine per folder: two engines sharing one would delete
each other's files.
"""

from __future__ import annotations

import atexit
import base64
import dataclasses
import errno
import itertools
import json
import logging
import math
import os
import shutil
import sys
import threading
import time
import weakref
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from strata.errors import StrataError
from strata.state.parking import GB, Snapshot, SnapshotRefused, checksum, token_hash

log = logging.getLogger("strata.engine")

FORMAT, VERSION = "strata-parked-conversation", "2"
SUFFIX = ".park.safetensors"
REFUSED = ".refused"  # appended to the name of an intact file that belongs to another model or format version
TEMP = ".tmp"  # a file being written: `.<token hash>.<pid>.<n>.park.safetensors.tmp`
DEFAULT_PARK_DISK_GB = 20.0  # the default budget, capped at half the file system
IDLE_S = 2.0  # the writer thread ends after this long without work (a new one starts with the next write)
WARN_EVERY_S = 60.0  # the same write failure is warned about at most this often
assert array("i").itemsize == 4


# the folder and the budget

def _nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _probe(folder: Path) -> None:
    """Create and delete a file in `folder` (raises OSError where that cannot be done: a read-only file system, no
    permission)."""
    probe = folder / f".strata-probe-{os.getpid()}{TEMP}"
    probe.write_bytes(b"")
    probe.unlink()


def park_dir_problem(path: str | os.PathLike, create: bool = False) -> str | None:
    """What is wrong with a `--park-dir` value, None when nothing is. `create`: make the folder (its parent must
    exist) and write a file there to be sure (the engine does, at startup)."""
    folder = Path(path).expanduser()
    user = f"user {os.getuid()}" if hasattr(os, "getuid") else "this user"
    if folder.exists() and not folder.is_dir():
        return "is a file, not a folder: give a folder for the parked conversations' files (created if missing)"
    if not folder.exists():
        parent = folder.parent
        if not parent.is_dir():
            return (f"its parent folder {parent} does not exist: create it, or give a folder whose parent exists "
                    "(Strata creates only the last folder of the path)")
        if not os.access(parent, os.W_OK | os.X_OK):
            return f"it does not exist and {parent} is not writable by this process ({user}) to create it"
    elif not os.access(folder, os.W_OK | os.X_OK):
        return f"is not writable by this process ({user}): give a folder it may write, or fix its permissions"
    if create:
        try:
            folder.mkdir(exist_ok=True)
            _probe(folder)
        except OSError as e:
            return f"cannot write there ({e.strerror or e}): give a folder on a writable file system"
    return None


def park_disk_gb_problem(park_disk_gb: float, path: str | os.PathLike | None = None) -> str | None:
    """What is wrong with a `--park-disk-gb` value (for the folder `path`), None when nothing is."""
    if not math.isfinite(park_disk_gb) or park_disk_gb < 0:
        return "give the GB of disk for parked conversations' files, a number of 0 or more (0 turns the disk tier off)"
    if path is not None:
        try:
            total = shutil.disk_usage(_nearest_existing(Path(path).expanduser())).total
        except OSError:
            return None
        if park_disk_gb * GB > total:
            return (f"the file system of {path} holds {total / GB:.1f} GB in all; give a part of it (the default is "
                    f"{DEFAULT_PARK_DISK_GB:g}, at most half of it), or 0 to turn the disk tier off")
    return None


def park_disk_budget(park_disk_gb: float | None, path: str | os.PathLike) -> int:
    """Bytes of files the park folder may hold: `park_disk_gb` GB (0: the disk tier off), or by default 20 GB, or
    half the file system where that is less. Refuses a budget the file system cannot hold."""
    if park_disk_gb is None:
        try:
            total = shutil.disk_usage(_nearest_existing(Path(path).expanduser())).total
        except OSError:
            total = None
        return int(min(DEFAULT_PARK_DISK_GB * GB, total / 2)) if total else int(DEFAULT_PARK_DISK_GB * GB)
    problem = park_disk_gb_problem(park_disk_gb, path)
    if problem:
        raise StrataError(f"--park-disk-gb {park_disk_gb:g}: {problem}")
    return int(park_disk_gb * GB)


def open_park_dir(path: str | os.PathLike | None, park_disk_gb: float | None, fingerprint: str,
                  pinned: bool = False) -> "DiskTier | None":
    """The disk tier of `--park-dir` (None without one, or with a budget of 0): the folder checked (created when
    missing) and its files' headers read. Raises StrataError for a folder that cannot be used."""
    if path is None:
        return None
    problem = park_dir_problem(path, create=True)
    if problem:
        raise StrataError(f"--park-dir {path}: {problem}")
    budget = park_disk_budget(park_disk_gb, path)
    if budget == 0:
        return None
    return DiskTier(Path(path).expanduser(), budget, fingerprint, pinned)


# the format

def encode_tokens(tokens: Sequence[int]) -> str:
    """Tokens as base64 of int32 little-endian."""
    words = array("i", tokens)
    if sys.byteorder == "big":
        words.byteswap()
    return base64.b64encode(words.tobytes()).decode("ascii")


def decode_tokens(text: str) -> array:
    raw = base64.b64decode(text.encode("ascii"), validate=True)
    if len(raw) % 4:
        raise ValueError(f"{len(raw)} bytes are not a whole number of int32 tokens")
    words = array("i")
    words.frombytes(raw)
    if sys.byteorder == "big":
        words.byteswap()
    return words


class BadFile(Exception):
    """A park file that cannot be used: `damaged` (delete it) or intact but not for this engine (move it aside)."""

    def __init__(self, reason: str, damaged: bool = True):
        super().__init__(reason)
        self.damaged = damaged


def _check_header(meta: dict | None, fingerprint: str, path: Path) -> tuple[array, str, int, int]:
    """Check a file's metadata; its tokens, token hash, checksum and nbytes (raises BadFile)."""
    if not meta or meta.get("format") != FORMAT:
        found = (meta or {}).get("format")
        raise BadFile(f"it is not a parked-conversation file (format {found!r}, expected {FORMAT!r})", damaged=False)
    if meta.get("format_version") != VERSION:
        raise BadFile(f"it was written in version {meta.get('format_version')!r} of the format and this engine reads "
                      f"version {VERSION}", damaged=False)
    if meta.get("fingerprint") != fingerprint:
        raise BadFile(f"it was parked by another model (fingerprint {meta.get('fingerprint') or '-'}, this one "
                      f"{fingerprint or '-'})", damaged=False)
    try:
        tokens = decode_tokens(meta["tokens"])
        sum_, nbytes = int(meta["checksum"]), int(meta["nbytes"])
        int(meta["data_checksum"])
    except (KeyError, ValueError, TypeError) as e:
        raise BadFile(f"its header is incomplete or garbled ({type(e).__name__}: {e})") from None
    if not tokens:
        raise BadFile("it holds no tokens")
    if token_hash(tokens) != meta.get("token_hash"):
        raise BadFile("its token list does not match the hash taken when it was parked")
    if path.name != f"{meta['token_hash']}{SUFFIX}":
        raise BadFile(f"its name does not match its tokens' hash ({meta['token_hash']})")
    return tokens, meta["token_hash"], sum_, nbytes


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def read_file(path: Path, pinned: bool) -> tuple[dict, dict[str, torch.Tensor]]:
    """A park file's metadata and tensors, read into one host block of its own (pinned when `pinned`), not mapped:
    a file deleted or cut short afterwards cannot change them. Raises BadFile or OSError."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise BadFile(f"it is cut short ({path.stat().st_size} bytes, not even a header)")
        n = int.from_bytes(head, "little")
        size = path.stat().st_size
        if n > size - 8:
            raise BadFile(f"it is cut short or not a safetensors file (a header of {n} bytes in {size})")
        try:
            header = json.loads(f.read(n))
            meta = header.pop("__metadata__", None) or {}
            layout = {name: (_DTYPES[t["dtype"]], list(t["shape"]), *t["data_offsets"]) for name, t in header.items()}
        except (ValueError, KeyError, TypeError) as e:
            raise BadFile(f"its safetensors header is garbled ({type(e).__name__}: {e})") from None
        end = max((e for *_, e in layout.values()), default=0)
        if size != 8 + n + end:
            raise BadFile(f"it is cut short or has extra bytes ({size} bytes, its header describes {8 + n + end})")
        block = torch.empty(end, dtype=torch.uint8, pin_memory=pinned and torch.cuda.is_available())
        view, got = memoryview(block.numpy()), 0
        while got < end:
            k = f.readinto(view[got:])
            if not k:
                raise BadFile(f"it was cut short while being read ({got} of {end} bytes)")
            got += k
    tensors = {}
    for name, (dtype, shape, start, stop) in layout.items():
        try:
            tensors[name] = block[start:stop].view(dtype).view(shape)
        except RuntimeError as e:
            raise BadFile(f"tensor {name} does not fit its place in the file ({e})") from None
    return meta, tensors


# the tier

@dataclass(eq=False)
class DiskSnapshot(Snapshot):
    """A parked conversation in a file: its tokens and what `reusable` needs (e.g. its checkpoints' positions) from
    the header; its tensors are read when it is taken (`DiskTier.take`). A file that fails a check is refused at
    restore (deleted or moved aside) and the restore raises SnapshotRefused naming it."""

    where: ClassVar[str] = "disk"
    path: Path | None = None
    failure: BadFile | None = None  # why the file could not be read when it was taken
    names: tuple[str, ...] = ()  # its tensors' names, as its header lists them
    tier: "DiskTier | None" = field(default=None, repr=False)

    def problem(self, state, fingerprint: str = "") -> str | None:
        if self.failure is not None:
            return str(self.failure)
        return super().problem(state, fingerprint)

    def restore(self, state, length: int, fingerprint: str = "", device_copy=None) -> None:
        problem = self.problem(state, fingerprint)
        if problem:  # damaged when it could not be read; else intact, but not for these sequences
            damaged = self.failure is None or self.failure.damaged
            raise SnapshotRefused(self._refuse(problem, damaged))
        try:
            super().restore(state, length, fingerprint, device_copy)
        except SnapshotRefused as e:
            raise SnapshotRefused(self._refuse(str(e), True)) from None

    def _refuse(self, reason: str, damaged: bool) -> str:
        action = self.tier.refuse(self.path, self.tokens_hash, damaged) if self.tier is not None else "left alone"
        return f"its file {self.path}: {reason}; {action}"


@dataclass
class _Entry:
    path: Path
    tokens: array
    checksum: int
    size: int  # the file's bytes
    stub: DiskSnapshot  # what `best` offers (no tensors)


class DiskTier:
    """The park folder's files, known by their tokens (`candidates`), written by a background thread (`write`),
    read when taken (`take`), within `budget` bytes, the least recently used deleted first."""

    def __init__(self, folder: Path, budget: int, fingerprint: str, pinned: bool = False):
        self.folder, self.budget, self.fingerprint, self.pinned = folder, budget, fingerprint, pinned
        self.nbytes = 0  # the bytes of the files indexed
        self.written = self.refused = self.evictions = self.write_failures = 0
        self._lock = threading.Condition()
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # by token hash, the least recently used first
        self._by_first: dict[int, dict[str, _Entry]] = {}  # by first token: a prompt's candidates
        self._templates: dict[tuple[str, ...], DiskSnapshot] = {}  # skeletons (no tensors) by tensor names
        self._jobs: deque[Callable[[], None]] = deque()
        self._busy = 0  # jobs queued or running
        self._thread: threading.Thread | None = None
        self._pending: dict[int, bool] = {}  # id of a snapshot waiting to be written -> released meanwhile
        self._names = itertools.count()
        self._warned: tuple[str, float] = ("", 0.0)
        self._scan()
        _TIERS.add(self)

    @property
    def conversations(self) -> int:
        return len(self._entries)

    # startup

    def _scan(self) -> None:
        """Index the folder's files by their headers (no tensor bytes read); refuse those that fail; delete what an
        interrupted write left; then keep the budget."""
        found, refused, warned = [], [], 0
        for path in sorted(self.folder.iterdir()):
            name = path.name
            if name.startswith(".") and name.endswith(SUFFIX + TEMP):
                path.unlink(missing_ok=True)  # a write interrupted by the end of a process
                continue
            if not name.endswith(SUFFIX):
                continue
            try:
                with safe_open(str(path), framework="pt") as f:
                    meta, names = f.metadata(), tuple(sorted(f.keys()))
                tokens, hash_, sum_, nbytes = _check_header(meta, self.fingerprint, path)
                stat = path.stat()
            except Exception as e:  # noqa: BLE001 - not safetensors, cut short, unreadable: refused, never fatal
                bad = e if isinstance(e, BadFile) else BadFile(f"it is not a complete safetensors file ({e})")
                action = self.refuse(path, None, bad.damaged)
                refused.append(path)
                if warned < 10:
                    log.warning("parked conversation file %s refused: %s; %s", path, bad, action)
                    warned += 1
                continue
            found.append((stat.st_mtime, path, tokens, hash_, sum_, nbytes, names, stat.st_size))
        if len(refused) > warned:
            log.warning("%d more parked conversation files in %s refused (as above)", len(refused) - warned, self.folder)
        for mtime, path, tokens, hash_, sum_, nbytes, names, size in sorted(found, key=lambda f: f[0]):
            self._index(path, tokens, hash_, sum_, nbytes, names, size)
        dropped = self._over_budget(keep=None)
        for entry in dropped:
            entry.path.unlink(missing_ok=True)
        aside = sum(1 for p in self.folder.iterdir() if p.name.endswith(SUFFIX + REFUSED))
        log.info("--park-dir %s: %d parked conversations found (%.2f GB of %.2f GB%s)%s", self.folder,
                 self.conversations, self.nbytes / GB, self.budget / GB,
                 f"; {len(dropped)} least recently used deleted to fit" if dropped else "",
                 f"; {aside} refused files (*{REFUSED}) beside them: delete them once you do not need them"
                 if aside else "")

    # the index

    def _index(self, path: Path, tokens: array, hash_: str, sum_: int, nbytes: int, names: tuple[str, ...],
               size: int) -> _Entry:
        """Add or replace a file's entry, as the most recently used (under the lock, or before the thread runs)."""
        template = self._templates.get(names)
        if template is None:
            template = self._templates[names] = DiskSnapshot.from_named(
                dict.fromkeys(names), tokens=[], nbytes=0, fingerprint=self.fingerprint, tokens_hash="", sum=0)
        stub = dataclasses.replace(template, tokens=tokens, nbytes=nbytes, tokens_hash=hash_, sum=sum_, copied=[],
                                   path=path, tier=self, names=names)
        self._forget(hash_)
        entry = self._entries[hash_] = _Entry(path, tokens, sum_, size, stub)
        self._by_first.setdefault(tokens[0], {})[hash_] = entry
        self.nbytes += size
        return entry

    def _forget(self, hash_: str) -> _Entry | None:
        entry = self._entries.pop(hash_, None)
        if entry is not None:
            self.nbytes -= entry.size
            bucket = self._by_first.get(entry.tokens[0], {})
            bucket.pop(hash_, None)
            if not bucket:
                self._by_first.pop(entry.tokens[0], None)
        return entry

    def _over_budget(self, keep: str | None) -> list[_Entry]:
        """Forget the least recently used entries (never `keep`) until the files fit the budget; they are returned
        for their files to be deleted (outside the lock)."""
        dropped = []
        while self.nbytes > self.budget:
            victim = next((h for h in self._entries if h != keep), None)
            if victim is None:
                break
            dropped.append(self._forget(victim))
            self.evictions += 1
        return dropped

    def candidates(self, prompt: Sequence[int]) -> list[DiskSnapshot]:
        """The files' snapshots that may serve `prompt` (those whose first token is its first), without tensors."""
        if not prompt:
            return []
        with self._lock:
            return [entry.stub for entry in self._by_first.get(prompt[0], {}).values()]

    # taking

    def take(self, snapshot: Snapshot) -> None:
        """A conversation goes back to a sequence: its file counts as used now; a file's snapshot (`DiskSnapshot`)
        gets its tensors, read into host memory (or the reason it could not be read, which its restore refuses)."""
        with self._lock:
            entry = self._entries.get(snapshot.tokens_hash)
            if entry is not None:
                self._entries.move_to_end(snapshot.tokens_hash)
                if entry.stub is snapshot:  # the index keeps a skeleton: the taken one gets tensors
                    entry.stub = dataclasses.replace(snapshot, copied=[])
        if entry is not None:
            self._submit(lambda: os.utime(entry.path) if entry.path.exists() else None)
        if isinstance(snapshot, DiskSnapshot):
            self._load(snapshot)

    def _load(self, stub: DiskSnapshot) -> None:
        try:
            meta, tensors = read_file(stub.path, self.pinned)
            tokens, hash_, sum_, nbytes = _check_header(meta, self.fingerprint, stub.path)
            if hash_ != stub.tokens_hash:
                raise BadFile("it holds another conversation than when the engine started")
            if tuple(sorted(tensors)) != stub.names:
                raise BadFile(f"its tensors are not the ones its header listed at startup ({sorted(tensors)[:4]}...)")
            arrived, written = int(checksum(tensors.values())), int(meta["data_checksum"])
            if arrived != written:
                raise BadFile(f"its bytes changed since it was written (checksum {arrived:#x}, written {written:#x})")
            loaded = Snapshot.from_named(tensors, tokens=list(tokens), nbytes=nbytes, fingerprint=meta["fingerprint"],
                                         tokens_hash=hash_, sum=sum_)
        except FileNotFoundError:
            stub.failure = BadFile("it is gone (deleted since the engine started)")
            return
        except BadFile as e:
            stub.failure = e
            return
        except (OSError, RuntimeError, ValueError) as e:
            stub.failure = BadFile(f"it could not be read ({type(e).__name__}: {e})")
            return
        for f in dataclasses.fields(Snapshot):
            setattr(stub, f.name, getattr(loaded, f.name))

    def refuse(self, path: Path, hash_: str | None, damaged: bool) -> str:
        """Take a refused file out of the index and the folder: deleted when damaged, else renamed `*.refused`;
        what was done, in words."""
        self.refused += 1
        if hash_ is not None:
            with self._lock:
                entry = self._entries.get(hash_)
                if entry is not None and entry.path == path:
                    self._forget(hash_)
        try:
            if damaged:
                path.unlink(missing_ok=True)
                return "deleted"
            aside = path.with_name(path.name + REFUSED)
            os.replace(path, aside)
            return f"moved aside to {aside.name} (delete it, or give that model or version its own --park-dir)"
        except OSError as e:
            return f"left in place ({e.strerror or e}): delete it by hand"

    # writing

    def write(self, snap: Snapshot, covers: Callable[[Sequence[int], Sequence[int]], bool]) -> None:
        """Write `snap` to a file in the background, once its copies into host memory are done; then delete the
        files of conversations it covers (`ParkingLot._covers`: earlier turns of it) and keep the budget. Returns
        at once."""
        with self._lock:
            self._pending[id(snap)] = False
        self._submit(lambda: self._write(snap, covers))

    def release(self, snap: Snapshot) -> None:
        """`snap` left host RAM (evicted, covered or taken): its ring region may be written over from now on, so a
        write of it that has not finished is given up."""
        with self._lock:
            if id(snap) in self._pending:
                self._pending[id(snap)] = True

    def _released(self, snap: Snapshot) -> bool:
        with self._lock:
            return self._pending.get(id(snap), True)

    def _write(self, snap: Snapshot, covers) -> None:
        try:
            if self._released(snap):
                return
            snap.wait()
            hash_, sum_ = snap.tokens_hash, int(snap.sum)
            with self._lock:
                same = self._entries.get(hash_)
            if same is not None and same.checksum == sum_ and same.path.exists():
                with self._lock:  # the same state is on disk already: it counts as used
                    if hash_ in self._entries:
                        self._entries.move_to_end(hash_)
                os.utime(same.path)
                return
            named = {name: t.contiguous() for name, t in snap.named_tensors().items()}
            meta = {"format": FORMAT, "format_version": VERSION, "fingerprint": snap.fingerprint,
                    "tokens": encode_tokens(snap.tokens), "token_hash": hash_, "checksum": str(sum_),
                    "data_checksum": str(int(checksum(named.values()))), "nbytes": str(snap.nbytes),
                    "length": str(snap.length)}
            size = sum(t.numel() * t.element_size() for t in named.values()) + len(json.dumps(meta)) + 128 * len(named)
            if size > self.budget:
                self._warn("size", f"a parked conversation of {size / GB:.3f} GB is larger than --park-disk-gb "
                           f"({self.budget / GB:g} GB): it stays in host RAM only")
                return
            final = self.folder / f"{hash_}{SUFFIX}"
            temp = self.folder / f".{hash_}.{os.getpid()}.{next(self._names)}{SUFFIX}{TEMP}"
            try:
                save_file(named, str(temp), metadata=meta)
                if self._released(snap):  # its ring region may have been written over while it was saved
                    temp.unlink(missing_ok=True)
                    return
                os.replace(temp, final)
                size = final.stat().st_size
            except Exception as e:  # noqa: BLE001 - a full disk, no permission, ...: a warning, never a failure
                self.write_failures += 1
                try:
                    temp.unlink(missing_ok=True)
                except OSError:
                    pass
                self._warn_write(e)
                return
            with self._lock:
                self._index(final, array("i", snap.tokens), hash_, sum_, snap.nbytes,
                            tuple(sorted(named)), size)
                self.written += 1
                covered = [self._forget(h) for h, e in list(self._by_first.get(snap.tokens[0], {}).items())
                           if h != hash_ and covers(snap.tokens, e.tokens)]
                dropped = self._over_budget(keep=hash_)
            for entry in (*covered, *dropped):
                entry.path.unlink(missing_ok=True)
        finally:
            with self._lock:
                self._pending.pop(id(snap), None)

    def _warn_write(self, e: Exception) -> None:
        code = getattr(e, "errno", None)
        if code is None:  # safetensors wraps the OS error in its own
            text = str(e)
            code = next((c for c, name in ((errno.ENOSPC, "StorageFull"), (errno.ENOSPC, "No space left"),
                                           (errno.EACCES, "PermissionDenied"), (errno.EACCES, "Permission denied"),
                                           (errno.EROFS, "ReadOnlyFilesystem"), (errno.EROFS, "Read-only"))
                         if name in text), None)
        advice = {errno.ENOSPC: "the disk is full: free space there or lower --park-disk-gb",
                  errno.EDQUOT: "the disk quota is used up: free space there or lower --park-disk-gb",
                  errno.EACCES: "check that this process may write there", errno.EPERM: "check that this process "
                  "may write there", errno.EROFS: "its file system is read-only: give another --park-dir"}
        self._warn(f"write {code}", f"could not write a parked conversation to {self.folder} "
                   f"({getattr(e, 'strerror', None) or e}); it stays in host RAM only"
                   + (f"; {advice[code]}" if code in advice else ""))

    def _warn(self, kind: str, text: str) -> None:
        last, when = self._warned
        now = time.monotonic()
        if kind != last or now - when > WARN_EVERY_S:
            self._warned = (kind, now)
            log.warning("%s", text)
        else:
            log.debug("%s", text)

    # the background thread

    def _submit(self, job: Callable[[], None]) -> None:
        with self._lock:
            self._jobs.append(job)
            self._busy += 1
            self._lock.notify_all()
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="strata-park-disk", daemon=True)
                self._thread.start()

    def _serve(self) -> None:
        while True:
            with self._lock:
                if not self._jobs:
                    self._lock.wait(IDLE_S)
                if not self._jobs:
                    self._thread = None
                    return
                job = self._jobs.popleft()
            try:
                job()
            except Exception:  # noqa: BLE001 - the thread must live on
                log.exception("the parked conversations' disk writer failed on a job; it goes on with the next")
            finally:
                with self._lock:
                    self._busy -= 1
                    self._lock.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every write asked for so far is done (or `timeout` seconds); False on the timeout."""
        with self._lock:
            return self._lock.wait_for(lambda: self._busy == 0, timeout)


_TIERS: "weakref.WeakSet[DiskTier]" = weakref.WeakSet()


@atexit.register
def _flush_at_exit() -> None:
    """A process that ends normally finishes its pending writes first (for a while)."""
    for tier in list(_TIERS):
        tier.flush(timeout=10.0)
