"""benchmarks/mxfp4.py --cpu-smoke: the whole flow (random MXFP4 layers, routing, the decode
kernels' table configs and a sweep candidate checked against the reference, the JSON) at tiny
shapes under the Triton interpreter. It runs in the interpreter stage of `make test`, in
parallel with the other interpreter tests (it is single-threaded Python, ~80 s)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from .test_triton_attention import needs_interpreter

ROOT = os.path.join(os.path.dirname(__file__), "..")


@needs_interpreter
def test_mxfp4_bench_cpu_smoke(tmp_path) -> None:
    env = {**os.environ, "OUT": str(tmp_path), "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    script = os.path.join(ROOT, "benchmarks", "mxfp4.py")
    cmd = [
        sys.executable,
        script,
        "--cpu-smoke",
        "--configs",
        "table,gu16x1024x2",
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "cpu smoke: 4 checks OK" in proc.stdout
    rows = json.load(open(tmp_path / "mxfp4.json"))["rows"]
    cases = [(r["T"], tuple(r["gate_up_config"])) for r in rows]
    assert cases == [(T, config) for T in (1, 3) for config in ((8, 1024, 2), (16, 1024, 2))]
    for r in rows:
        assert r["rel_err"] < 2e-2
        assert r["gate_up_MB"] > 0 and r["down_MB"] > 0 and 1 <= r["distinct_experts"] <= 6
