"""Building and loading the project's own C kernels (`strata/experts/experts_bf16.c`, `strata/kernels/cpu_packed.c`,
`strata/kernels/cpu_decode.c`).

A kernel is compiled with gcc for the instructions it names in its flags (not -march=native), so a library built
once runs on any CPU that has them: an image ships it built beside its source (`shipped`, made by the Dockerfile
with `build`). Without that file it is built on the host the first time it is asked for, into
`$XDG_CACHE_HOME/strata/<name>-<digest>.so` (the digest of source and flags: a changed source builds anew), and
loaded with ctypes. Load it after torch: its OpenMP is torch's libgomp. Where it cannot be had (no gcc, a failed
build, an unwritable cache), `load` returns None and says why once in the log.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger("strata.engine")
GCC = "gcc"  # the compiler looked up on PATH


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str]:
    """The first CPU's flags in `cpuinfo` (none off x86-64, or where it cannot be read)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return set()
    try:
        flags = next((line for line in cpuinfo.read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        return set()
    return set(flags.partition(":")[2].split())


def build(source: Path, flags: list[str], out: Path) -> str | None:
    """Compile `source` with `flags` into the library `out` (atomically: a reader sees the whole file or none); why
    not, where it cannot."""
    gcc = shutil.which(GCC)
    if gcc is None:
        return "no gcc to build it"
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=out.parent, suffix=".so", delete=False) as tmp:
        built = Path(tmp.name)
    try:
        run = subprocess.run([gcc, *flags, str(source), "-o", str(built)], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        built.unlink(missing_ok=True)
        return str(e)
    if run.returncode:
        built.unlink(missing_ok=True)
        return run.stderr.strip()[-300:] or f"gcc exited with {run.returncode}"
    built.replace(out)
    return None


def cached(source: Path, flags: list[str]) -> Path:
    """Where the host's own build of `source` with `flags` is kept."""
    digest = hashlib.sha256(source.read_bytes() + " ".join(flags).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "strata"
    return cache / f"{source.stem}-{digest}.so"


def load(source: Path, flags: list[str], shipped: Path, fallback: str) -> tuple[ctypes.CDLL | None, str]:
    """The library built from `source`: `shipped` where it exists, else the cached build, else built now; and why
    not where it cannot be had (then None, logged as "`fallback`: its own kernel could not be built: why"; callers
    cache the result, so this is said once)."""
    lib = shipped
    if not lib.exists():
        try:
            lib = cached(source, flags)
            problem = None if lib.exists() else build(source, flags, lib)
        except OSError as e:  # an unreadable source, an unwritable cache folder
            problem = str(e)
        if problem:
            log.warning("%s: its own kernel could not be built: %s", fallback, problem)
            return None, f"its kernel could not be built: {problem}"
    try:
        return ctypes.CDLL(str(lib)), ""
    except OSError as e:  # a library built for another system
        log.warning("%s: its own kernel could not be loaded: %s", fallback, e)
        return None, f"its kernel could not be loaded: {e}"


def load_for_cpu(switch: str, needs: set[str], source: Path, flags: list[str], shipped: Path,
                 fallback: str) -> tuple[ctypes.CDLL | None, str]:
    """`load`, after two checks that say why not (once, in the log, as "`fallback`: ..."): the environment variable
    `switch` set to 0 turns the library off, and the CPU must have every flag in `needs`."""
    if os.environ.get(switch, "1") == "0":
        return None, f"{switch}=0"
    missing = needs - cpu_flags()
    if missing:
        log.info("%s: this CPU has no %s", fallback, ", ".join(sorted(missing)))
        return None, f"this CPU has no {', '.join(sorted(missing))}"
    return load(source, flags, shipped, fallback)
