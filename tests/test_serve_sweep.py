"""benchmarks/serve_sweep.py --shape: the Llama-3-8B-shape tokenizer decodes every id and
re-encodes to the same ids, and the whole sweep (two real servers with dummy weights, plain
and EAGLE-3 with synthetic acceptance, bench serve at two concurrencies, bench compare with a
plot) runs end to end at the tiny shape on the CPU."""

from __future__ import annotations

import glob
import json
import os
import socket
import subprocess
import sys
from typing import Any

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
BENCH = os.path.join(ROOT, "benchmarks")


def test_shape_tokenizer_round_trips_every_id(tmp_path: Any) -> None:
    sys.path.insert(0, BENCH)
    try:
        from serve_shape import write_shape
    finally:
        sys.path.remove(BENCH)
    from transformers import AutoTokenizer

    target, head = write_shape(str(tmp_path), "llama3-8b")
    cfg = json.load(open(os.path.join(target, "config.json")))
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"]) == (
        4096,
        32,
        14336,
    )
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (32, 8)
    assert cfg["vocab_size"] == 128256 and cfg["rope_theta"] == 500000.0
    assert json.load(open(os.path.join(head, "config.json")))["draft_vocab_size"] == 32000
    tok = AutoTokenizer.from_pretrained(target)
    assert len(tok) == 128256
    assert (tok.bos_token_id, tok.eos_token_id) == (cfg["bos_token_id"], cfg["eos_token_id"])
    ids = list(range(128256))
    assert tok.encode(tok.decode(ids), add_special_tokens=False) == ids


def test_tiny_sweep_on_cpu(tmp_path: Any) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "sweep"
    argv = [
        sys.executable, os.path.join(BENCH, "serve_sweep.py"), "--shape", "tiny", "--device",
        "cpu", "--input-len", "16", "--output-len", "8", "--concurrency", "1,2",
        "--num-prompts-factor", "2", "--max-num-seqs", "4", "--result-dir", str(out),
        "--port", str(port),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    env.pop("OUT", None)
    p = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    runs = {}
    for label in ("plain", "eagle3"):
        (path,) = glob.glob(os.path.join(out, f"{label}-sweep-c1_2-*.json"))
        runs[label] = json.load(open(path))["runs"]
        assert [(r["max_concurrency"], r["completed"], r["failed"]) for r in runs[label]] == [
            (1, 2, 0),
            (2, 4, 0),
        ]
        for r in runs[label]:
            assert r["total_input_tokens"] == 16 * r["completed"]
            assert r["total_output_tokens"] == 8 * r["completed"]
            assert r["max_itl_ms"] >= r["p99_itl_ms"] > 0
        assert "the server answered /health" in p.stdout
        assert os.path.getsize(os.path.join(out, f"{label}-server.log")) > 0
    assert "spec_decode_acceptance_length" not in runs["plain"][0]
    assert all(r["spec_decode_draft_tokens"] > 0 for r in runs["eagle3"])
    assert "| Max ITL (ms) |" in p.stdout and "| Acceptance length |" in p.stdout
    assert (out / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_prefix_cache_server_commands_parse() -> None:
    """benchmarks/prefix_cache.py's `specserve serve` commands (built on serve_sweep's) are
    ones the real CLI accepts, with caching on and off as configured."""
    sys.path.insert(0, BENCH)
    try:
        import prefix_cache
    finally:
        sys.path.remove(BENCH)
    from specserve.entrypoints.cli import build_parser

    args = prefix_cache.parse_args(["--device", "cpu", "--shape", "tiny"])
    for label, spec, cache, _ in prefix_cache.CONFIGS:
        cmd = prefix_cache.server_cmd(
            args, "/models/target", prefix_cache.SPEC if spec else None, cache
        )
        assert cmd[1:3] == ["-m", "specserve.entrypoints.cli"], label
        ns = build_parser().parse_args(cmd[3:])
        assert ns.enable_prefix_caching is cache, label
        assert (ns.speculative_config is not None) is spec, label
