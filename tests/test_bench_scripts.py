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


def test_cpu_experts_bench_runs_and_its_kernel_is_right(capsys, monkeypatch):
    """bench/cpu_experts.py runs on any CPU: the pool's way always, the kernel where gcc builds it for this CPU
    (AVX512_BF16); each way's output near float64 and a row alone bitwise the row in a block."""
    monkeypatch.setattr(sys, "path", [str(BENCH), *sys.path])
    spec = importlib.util.spec_from_file_location("bench_cpu_experts_run", BENCH / "cpu_experts.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(["--experts", "2", "--rows", "1,3"])
    lines = [line.split() for line in capsys.readouterr().out.splitlines()]
    rows = [line for line in lines if len(line) == 7 and line[0] in ("1", "3")]
    ways = {line[1] for line in rows}
    assert ways & {"oneDNN", "F.linear"}, lines
    assert len(rows) == 2 * len(ways)
    for line in rows:
        assert float(line[5]) < 1e-2 and line[6] == "True", line
