"""benchmarks/mla_decode.py: the latent KV count and the MLA step bytes against hand counts,
and the whole script at tiny shapes on the CPU (dummy MLA + MTP weights, one and three MTP
layers, every configuration)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from typing import Any

import torch

ROOT = os.path.join(os.path.dirname(__file__), "..")


def _script(name: str) -> Any:
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    path = os.path.join(ROOT, "benchmarks", f"{name}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


def test_latent_kv_bytes(tmp_path) -> None:
    from specserve.models.registry import load_model

    mod, moe = _script("mla_decode"), _script("moe_decode")
    cfg = {**mod.GLM47_FLASH, **mod.TINY_MLA}  # 2 layers, 4 heads, L 32, R 8, nope 16, v 16
    kv = mod.kv_layout(cfg, torch.bfloat16)
    assert kv["layers"] == 2
    assert kv["latent_bytes_per_token"] == 2 * 2 * (32 + 8)
    assert kv["full_kv_bytes_per_token"] == 2 * 2 * 4 * (16 + 8 + 16)
    # The real shape: 47 layers of (512 + 64) latent elements vs 20 heads x (192 + 64 + 256).
    real = mod.kv_layout(dict(mod.GLM47_FLASH), torch.bfloat16)
    assert real["latent_bytes_per_token"] == 47 * 2 * 576
    assert real["ratio"] == 20 * 512 / 576
    # moe_decode.step_bytes reads each layer's own layout: the latent rows for MLA.
    moe.write_config(cfg, str(tmp_path))
    model, _ = load_model(str(tmp_path), torch.float32, torch.device("cpu"), 64, "dummy")
    assert moe.step_bytes(model, 3, 10)["kv"] == 4 * 3 * 10 * 2 * (32 + 8)


def test_cpu_smoke_runs_every_configuration(tmp_path) -> None:
    env = {**os.environ, "OUT": str(tmp_path), "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "mla_decode.py"), "--cpu-smoke"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "check: greedy eager == eager (CPU): OK" in proc.stdout
    m = json.load(open(tmp_path / "mla_decode.json"))["models"][0]
    assert m["plain"]["status"] == "ok" and m["check"]["check"] == "OK"
    assert m["check"]["eager"] == m["plain"]["greedy"] and len(m["plain"]["greedy"]) == 8
    cases = [(s["case"], s["k"], s["mtp_layers"]) for s in m["spec"]]
    assert cases == [
        ("mtp graphs", 1, 1),
        ("mtp eager", 1, 1),
        ("mtp graphs", 3, 1),
        ("mtp eager", 3, 1),
        ("multi graphs", 3, 3),
        ("multi draft-eager", 3, 3),
        ("multi eager", 3, 3),
    ]
    for s in m["spec"]:
        assert s["status"] == "ok", s
        assert all(1.0 <= r["tokens_per_step"] <= s["k"] + 1 for r in s["rows"])


def test_prefill_cpu_smoke_runs_both_paths(tmp_path) -> None:
    """benchmarks/mla_prefill.py --cpu-smoke: both prefill paths time a prompt and agree on
    its first greedy token (float32)."""
    env = {**os.environ, "OUT": str(tmp_path), "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    script = os.path.join(ROOT, "benchmarks", "mla_prefill.py")
    cmd = [sys.executable, script, "--cpu-smoke", "--repeats", "1"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.load(open(tmp_path / "mla_prefill.json"))["rows"]
    assert [r["prompt_tokens"] for r in rows] == [16, 40]
    for r in rows:
        assert r["latent_ms"] > 0 and r["expanded_ms"] > 0
        assert r["first_tokens"]["latent"] == r["first_tokens"]["expanded"]
