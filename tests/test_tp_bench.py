"""benchmarks/tp_decode.py's CPU smoke run: TP = 1 and 2 over gloo at the tiny shape, plain and
EAGLE-3 engines at every batch, and the all-reduce timed in its own two-rank group."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(__file__), "..")


def test_cpu_smoke_times_both_tp_sizes(tmp_path) -> None:
    env = {**os.environ, "OUT": str(tmp_path), "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    script = os.path.join(ROOT, "benchmarks", "tp_decode.py")
    cmd = [sys.executable, script, "--device", "cpu", "--shape", "tiny", "--tp", "1,2"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = json.load(open(tmp_path / "tp_decode.json"))
    assert out["errors"] == [] and out["allreduce_group"] == "separate"
    rows = out["rows"]
    assert sorted({(r["tp"], r["batch"]) for r in rows}) == [
        (tp, b) for tp in (1, 2) for b in (1, 16, 64)
    ]
    for r in rows:
        assert r["plain"]["ms_per_step"] > 0 and r["spec"]["ms_per_step"] > 0, r
        # K = 3 at synthetic acceptance 0.7: between 1 and K + 1 tokens a request a step
        assert 1.0 <= r["spec"]["tokens_per_step"] <= 4.0, r
        if r["tp"] == 2:
            assert r["allreduce_us"] > 0 and r["allreduce_ms_per_step"] > 0, r
            assert r["allreduce_share"] > 0, r
        else:
            assert "allreduce_us" not in r  # TP = 1 runs no collective
    # The table comes last, after the note on which group timed the all-reduce.
    assert "separate group" in proc.stdout
    assert proc.stdout.rstrip().splitlines()[-1].split()[:2] == ["2", "64"]
