"""The GPU benchmarks cannot run in CI, but they must at least import: each one is loaded here (its module body:
imports of the kernels and helpers it calls, constants, function definitions) without running its `main`, so a
renamed or removed function fails here instead of on a leased GPU."""

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
SCRIPTS = sorted(p for p in BENCH.glob("*.py") if not p.name.startswith("_"))


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_bench_script_imports(path, monkeypatch):
    monkeypatch.setattr(sys, "path", [str(BENCH), *sys.path])  # their helpers by name; undone after the test
    spec = importlib.util.spec_from_file_location(f"bench_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    if path.stem not in ("checkpoints", "gpu_timing", "shapes"):  # helpers; every script has an entry point
        assert callable(getattr(module, "main", None)), f"{path.name} has no main()"
