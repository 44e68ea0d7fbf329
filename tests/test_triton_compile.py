"""The engine's Triton kernels compile for an H100 / H200 (sm_90) at the engine's configurations, the decode
windows' ones with no register spills (latency-bound: a spill is a trip to memory on the critical path; some prompt
kernels spill a little by choice, see strata/kernels/gdn.py): the interpreter the other kernel tests run under does
not type-check a kernel as the compiler does (`tests/sm90_compile.py` says more). Runs the compiler in a process of
its own, without the interpreter."""

import json
import os
import subprocess
import sys
from pathlib import Path


def test_kernels_compile_for_sm90_and_decode_kernels_do_not_spill(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compiled afresh, into a directory the test owns
    script = Path(__file__).with_name("sm90_compile.py")
    parts = 2  # two processes, each compiling every second case (CI's two cores)
    runs = [subprocess.Popen([sys.executable, str(script), f"{i}/{parts}"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env) for i in range(parts)]
    outputs = [run.communicate(timeout=900) for run in runs]  # both finished before either is judged
    results = []
    for run, (out, err) in zip(runs, outputs):
        assert run.returncode == 0, err[-3000:]
        results += [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert len(results) >= 35 and {r["window"] for r in results} == {"decode", "prompt"}, results
    failed = {r["kernel"]: r["error"] for r in results if "error" in r}
    assert not failed, "\n\n".join(f"{k}: {v}" for k, v in failed.items())
    spilled = {r["kernel"]: r["spill_bytes"] for r in results if r["window"] == "decode" and r["spill_bytes"]}
    assert not spilled, f"register spills (bytes stored + loaded): {spilled}"
    assert all(0 < r["regs"] <= 255 for r in results)
