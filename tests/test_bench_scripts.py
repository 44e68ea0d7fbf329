"""The GPU benchmarks cannot run in CI, but they must at least import: each one is loaded here (its module body:
imports of the kernels and helpers it calls, constants, function definitions) without running its `main`, so a
renamed or removed function fails here instead of on a leased GPU."""

import importlib.util
import re
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


def test_cpu_packed_bench_runs(capsys, monkeypatch):
    """bench/cpu_packed.py: the default's matrices packed at one row, timed on the kernel at each width this CPU has
    and on oneDNN over the same weights written out (or a line saying why not, where the kernel cannot run)."""
    from strata.kernels import cpu_packed

    monkeypatch.setattr(sys, "path", [str(BENCH), *sys.path])
    spec = importlib.util.spec_from_file_location("bench_cpu_packed_run", BENCH / "cpu_packed.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(["--rows", "1"])
    out = capsys.readouterr().out
    if not cpu_packed.available():
        assert "not available" in out
        return
    assert "a token reads 98 MB packed, 538 MB as float32" in out, out
    row = next(line.split() for line in out.splitlines() if line.split()[:1] == ["1"])
    assert all(float(v) > 0 for v in row[1:5] if v != "nan"), row


def test_cpu_default_bench_runs_each_decode_path(capsys, monkeypatch):
    """bench/cpu_default.py: the embedded default's decode rate on each way its decode rows can run between the
    products (one call a stage, a call a layer, torch's ops), in one run, the first the stage's call."""
    from strata.kernels import cpu_decode

    monkeypatch.setattr(sys, "path", [str(BENCH), *sys.path])
    spec = importlib.util.spec_from_file_location("bench_cpu_default_run", BENCH / "cpu_default.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(["--tokens", "4", "--rounds", "1", "--skip-transformers"])
    out = capsys.readouterr().out
    strata = next(line.split() for line in out.splitlines() if line.startswith("strata "))
    assert float(strata[2]) > 0, out
    paths = re.findall(r"between the products (.+?): ([0-9.]+) tok/s", out)
    if cpu_decode.available():
        assert [p for p, _ in paths] == ["one call a layer", "torch's ops"], out
        assert all(float(rate) > 0 for _, rate in paths)


def test_serve_bench_measures_a_pooled_engine_through_http_and_in_process(tmp_path, capsys, monkeypatch):
    """bench/serve.py with --expert-budget-gb (issue 29 through the server): a tiny Qwen3-MoE checkpoint with half its
    experts in host RAM, served by `strata serve` and run in process with the same settings; every stream answers,
    both sides report tokens, and the server's engine ran with the pool."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers

    from strata.experts.residency import expert_bytes
    from strata.model.loader import ModelFiles
    from tests.tiny_models import VOCAB, build

    folder = tmp_path / "tiny-moe"
    build("qwen3_moe-gqa4", folder)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text("{}")
    spec = ModelFiles.open(folder).spec
    half = (spec.num_layers * spec.moe.num_experts // 2 + 0.5) * expert_bytes(spec, 4) / 1e9
    monkeypatch.setattr(sys, "path", [str(BENCH), *sys.path])
    spec_ = importlib.util.spec_from_file_location("bench_serve_run", BENCH / "serve.py")
    module = importlib.util.module_from_spec(spec_)
    monkeypatch.setitem(sys.modules, spec_.name, module)  # its dataclasses look their module up
    spec_.loader.exec_module(module)
    report = tmp_path / "report.json"
    module.main(["--model", str(folder), "--batch", "2", "--concurrency", "1,2", "--tokens", "8", "--max-cells", "256",
                 "--skip-stall", "--expert-budget-gb", f"{half:.9f}", "--cpu-threads", "1", "--client-procs", "1",
                 "--json", str(report)])
    out = capsys.readouterr().out
    figures = json.loads(report.read_text())
    assert figures["config"]["expert_budget_gb"] == f"{half:.9f}"
    for n in ("1", "2"):
        served, local = figures["server"]["waves"][n], figures["engine"]["waves"][n]
        assert served["errors"] == 0 and served["tok_s"] > 0 and local["tok_s"] > 0, (served, local)
    log = Path(re.search(r"\(log: (\S+)\)", out)[1]).read_text()
    assert f"{spec.moe.num_experts // 2} of {spec.moe.num_experts} routed experts resident" in log, log[-2000:]
    assert "stall case skipped (--skip-stall)" in out
