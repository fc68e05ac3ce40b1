"""benchmarks/moe_decode.py: its active-weight byte count against a hand count, and the whole
script at tiny shapes on the CPU (every configuration, the dummy-weight GLM MTP drafter included);
benchmarks/moe.py --sweep's plan (both down variants)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from typing import Any

import pytest
import torch

ROOT = os.path.join(os.path.dirname(__file__), "..")


def _script() -> Any:
    path = os.path.join(ROOT, "benchmarks", "moe_decode.py")
    spec = importlib.util.spec_from_file_location("moe_decode", path)
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


def test_step_bytes_counts_the_chosen_experts(tmp_path) -> None:
    from specserve.models.registry import load_model

    mod = _script()
    cfg = mod.tiny(mod.QWEN3_30B_A3B, "num_experts")  # 2 layers, hidden 64, 8 experts, top-2
    mod.write_config(cfg, str(tmp_path))
    model, _ = load_model(str(tmp_path), torch.float32, torch.device("cpu"), 64, "dummy")
    h, q, kv, e_inter, v = 64, 4 * 16, 2 * 16, 32, 512
    # qkv, o, q/k norms, two layer norms, router: every layer reads them whole.
    per_layer = h * (q + 2 * kv) + q * h + 2 * 16 + 2 * h + 8 * h
    weights = 4 * (2 * per_layer + h + v * h)  # + final norm + lm_head, float32
    per_expert = 4 * 3 * h * e_inter
    for batch, context in ((1, 10), (4, 7)):
        b = mod.step_bytes(model, batch, context)
        assert b["weights"] == weights
        distinct = 8 * (1 - (1 - 2 / 8) ** batch)  # 2 at batch 1
        assert abs(b["routed_experts"] - 2 * distinct * per_expert) < 1e-6
        assert b["embed_rows"] == 4 * batch * h
        assert b["kv"] == 4 * batch * context * 2 * 2 * kv
        assert b["total"] == sum(b[k] for k in ("weights", "routed_experts", "embed_rows", "kv"))
    assert mod.expected_distinct(128, 8, 1) == 8


def test_step_bytes_counts_fused_shared_experts_once(tmp_path, request) -> None:
    """GLM-4.5-Air's shared expert, fused into the stacked experts (models/moe.py) or its own
    MLP, is read whole every step: the same bytes either way, not a routed expert's share."""
    from specserve.models.registry import load_model

    mod = _script()
    cfg = mod.tiny(mod.GLM45_AIR, "n_routed_experts")  # 2 layers (1 MoE), 8 experts, top-2
    mod.write_config(cfg, str(tmp_path))
    fused, _ = load_model(str(tmp_path), torch.float32, torch.device("cpu"), 64, "dummy")
    request.getfixturevalue("unfused_shared_experts")
    unfused, _ = load_model(str(tmp_path), torch.float32, torch.device("cpu"), 64, "dummy")
    assert len(fused.model.layers[1].mlp.shared_slots) == 1
    assert unfused.model.layers[1].mlp.shared_experts is not None
    per_expert = 4 * 3 * 64 * 32  # float32 w13 + w2 rows of one expert
    for batch in (1, 4):
        a, b = mod.step_bytes(fused, batch, 10), mod.step_bytes(unfused, batch, 10)
        assert a == b
        distinct = 8 * (1 - (1 - 2 / 8) ** batch)
        assert abs(a["routed_experts"] - distinct * per_expert) < 1e-6


def test_cpu_smoke_runs_every_configuration(tmp_path) -> None:
    env = {**os.environ, "OUT": str(tmp_path), "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "moe_decode.py"), "--cpu-smoke"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "check GLM-4.5-Air: greedy eager == eager (CPU): OK" in proc.stdout
    result = json.load(open(tmp_path / "moe_decode.json"))
    assert [m["name"] for m in result["models"]] == ["Qwen3-30B-A3B", "GLM-4.5-Air"]
    for m in result["models"]:
        assert m["plain"]["status"] == "ok" and m["check"]["check"] == "OK"
        assert [r["batch"] for r in m["plain"]["rows"]] == [1, 16, 64]
        assert m["check"]["eager"] == m["plain"]["greedy"] and len(m["plain"]["greedy"]) == 8
        ks = [(s["drafter"], s["k"]) for s in m["spec"]]
        assert ks == ([("eagle3", 3)] if m["name"].startswith("Qwen") else [("mtp", 1), ("mtp", 3)])
        for s in m["spec"]:
            assert s["status"] == "ok", s
            assert [r["batch"] for r in s["rows"]] == [1, 16]
            # Synthetic acceptance: between 1 (all rejected) and K + 1 tokens a step.
            assert all(1.0 <= r["tokens_per_step"] <= s["k"] + 1 for r in s["rows"])


def test_step_bytes_gpt_oss_biases_and_mxfp4(tmp_path) -> None:
    """gpt-oss: the chosen experts' biases count with them; at MXFP4 the expert matrices take
    4.25 bits a weight, the biases stay as loaded."""
    from specserve.models.registry import load_model

    mod = _script()
    path = os.path.join(ROOT, "benchmarks", "gpt_oss_decode.py")
    spec = importlib.util.spec_from_file_location("gpt_oss_decode", path)
    oss = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(oss)  # type: ignore[union-attr]
    cfg = oss.with_layers({**oss.GPT_OSS_20B, **oss.TINY}, 2)  # H 64, I 32, 8 experts, top-2
    mod.write_config(cfg, str(tmp_path))
    model, _ = load_model(str(tmp_path), torch.float32, torch.device("cpu"), 64, "dummy")
    matrix, bias = 3 * 64 * 32, 2 * 32 + 64  # w13 + w2; w13_bias [2I] + w2_bias [H]
    b = mod.step_bytes(model, 1, 10)
    assert b["routed_experts"] == 2 * 2 * 4 * (matrix + bias)  # 2 layers x top-2, float32
    assert b["routed_experts_mxfp4"] == 2 * 2 * (matrix * 4.25 / 8 + 4 * bias)
    assert b["total"] - b["total_mxfp4"] == b["routed_experts"] - b["routed_experts_mxfp4"]
    # Sinks and every bias got random values from the dummy loader (not left at zero/empty).
    for name, p in model.named_parameters():
        if name.endswith(("sinks", "_bias", "gate.bias")):
            assert (p != 0).all() and p.unique().numel() == p.numel(), name
    # Experts kept 4-bit (the published config carries quantization_config mxfp4): counted as
    # read, blocks + scales = 4.25 bits a weight.
    kept, _ = load_model(str(tmp_path), torch.float32, "cpu", 64, "dummy", mxfp4_experts="mxfp4")
    assert kept.model.layers[0].mlp.experts.w13_blocks.dtype == torch.uint8
    b4 = mod.step_bytes(kept, 1, 10)
    assert b4["routed_experts"] == b4["routed_experts_mxfp4"] == b["routed_experts_mxfp4"]
    assert b4["total"] == b4["total_mxfp4"] == b["total_mxfp4"]


def test_gpt_oss_cpu_smoke(tmp_path) -> None:
    env = {**os.environ, "OUT": str(tmp_path), "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "gpt_oss_decode.py"), "--cpu-smoke"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "mxfp4 fl" in proc.stdout
    result = json.load(open(tmp_path / "gpt_oss_decode.json"))
    assert [m["name"] for m in result["models"]] == ["gpt-oss-20b", "gpt-oss-120b"]
    for m in result["models"]:
        assert m["config"]["layer_types"] == ["sliding_attention", "full_attention"]
        assert m["plain"]["status"] == "ok" and m["check"]["check"] == "OK"
        assert [r["batch"] for r in m["plain"]["rows"]] == [1, 16, 64]
        # The smoke keeps the experts 4-bit: the floor counts them as read, at 4.25 bits.
        assert all(r["bytes"]["total_mxfp4"] == r["bytes"]["total"] for r in m["plain"]["rows"])
        assert [(s["drafter"], s["k"]) for s in m["spec"]] == [
            ("eagle3", 3),
            ("ptd", 3),
            ("ptd", 8),
        ]
        for s in m["spec"]:
            assert s["status"] == "ok", s
            assert all(1.0 <= r["tokens_per_step"] <= s["k"] + 1 for r in s["rows"])


def test_moe_sweep_times_every_candidate() -> None:
    """benchmarks/moe.py --sweep: at every model shape it times each gate_up candidate with the
    table's down config and each down candidate with the table's gate_up config, the table
    pair among them, each point labelled once."""
    pytest.importorskip("triton")
    from specserve.ops import moe_triton as mt

    path = os.path.join(ROOT, "benchmarks", "moe.py")
    spec = importlib.util.spec_from_file_location("moe_bench", path)
    bench = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(bench)  # type: ignore[union-attr]
    for H, inter, _, top_k, shared in bench.MODELS.values():
        points = bench.decode_sweep_pairs(H, inter, top_k + shared)
        names = [bench.point_name(p) for p in points]
        assert len(set(names)) == len(points)
        gate_up, down = mt.decode_configs(H, inter, top_k + shared)
        assert (gate_up, down) in points
        assert {d for g, d in points if g == gate_up} == set(mt.DECODE_DOWN_CONFIGS) | {down}
        assert {g for g, d in points if d == down} == set(mt.DECODE_GATE_UP_CONFIGS) | {gate_up}
