"""`specserve bench serve` / `bench compare` against a real server (draft-model speculation, so
every decode step drafts and the Speculative Decoding section always shows)."""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator
from typing import Any

import pytest

from specserve.bench.datasets import DatasetArgs, sample_requests
from specserve.bench.endpoint import RequestFuncOutput
from specserve.bench.report import calculate_metrics, format_result
from specserve.entrypoints.cli import main

from .test_server import LiveServer, _config, dirs  # noqa: F401 - fixtures

pytestmark = pytest.mark.usefixtures("one_torch_thread")

OUTPUT_LEN = 8


@pytest.fixture(scope="module")
def server(dirs: dict[str, str]) -> Iterator[LiveServer]:  # noqa: F811 - dirs is a fixture
    spec = {"method": "draft_model", "model": dirs["draft"], "num_speculative_tokens": 2}
    s = LiveServer(_config(dirs, spec))
    yield s
    s.close()


def _bench(server: LiveServer, dirs: dict[str, str], *extra: str) -> None:  # noqa: F811
    argv = [
        "bench", "serve", "--base-url", server.url, "--tokenizer", dirs["tokenizer"],
        "--output-len", str(OUTPUT_LEN), "--temperature", "0", "--disable-tqdm", *extra,
    ]  # fmt: skip
    assert main(argv) == 0


def _row(name: str, value: Any) -> str:
    return f"{name:<40} {value:<10}"  # vLLM's row format


def test_bench_serve_table_and_json(
    server: LiveServer,
    dirs: dict[str, str],  # noqa: F811
    tmp_path: Any,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _bench(
        server, dirs, "--dataset-name", "random", "--input-len", "16", "--num-prompts", "6",
        "--max-concurrency", "3", "--save-result", "--result-dir", str(tmp_path), "--label", "base",
    )  # fmt: skip
    out = capsys.readouterr().out.splitlines()
    start = out.index("============ Serving Benchmark Result ============")
    table = out[start : out.index("=" * 50, start) + 1]
    assert _row("Successful requests:", 6) in table
    assert _row("Failed requests:", 0) in table
    assert _row("Maximum request concurrency:", 3) in table
    assert _row("Total generated tokens:", 6 * OUTPUT_LEN) in table
    for header in (
        "---------------Time to First Token----------------",
        "-----Time per Output Token (excl. 1st token)------",
        "---------------Inter-token Latency----------------",
        "----------------End-to-end Latency----------------",
        "---------------Speculative Decoding---------------",
    ):
        assert header in table
    for name in (
        "Mean TTFT (ms):", "P99 TPOT (ms):", "Median ITL (ms):", "Mean E2EL (ms):",
        "Max TTFT (ms):", "Max ITL (ms):",
    ):  # fmt: skip
        assert any(line.startswith(f"{name:<40} ") for line in table), name
    for name in ("Acceptance rate (%):", "Acceptance length:", "Drafts:", "Draft tokens:"):
        assert any(line.startswith(f"{name:<40} ") for line in table), name
    assert "Per-position acceptance (%):" in table
    assert any(line.startswith(f"{'  Position 1:':<40} ") for line in table)

    (path,) = glob.glob(os.path.join(tmp_path, "base-*.json"))
    r = json.load(open(path))
    assert r["completed"] == 6 and r["failed"] == 0 and r["num_prompts"] == 6
    assert r["total_output_tokens"] == 6 * OUTPUT_LEN and r["max_concurrency"] == 3
    assert r["backend"] == "openai" and r["label"] == "base" and r["model_id"] == server.model
    for key in ("mean_ttft_ms", "median_tpot_ms", "p99_itl_ms", "std_e2el_ms", "output_throughput"):
        assert isinstance(r[key], float) and r[key] >= 0, key
    for key in ("ttft", "tpot", "itl", "e2el"):
        assert r[f"max_{key}_ms"] >= r[f"p99_{key}_ms"] >= r[f"median_{key}_ms"], key
    assert r["spec_decode_num_drafts"] > 0 and r["spec_decode_draft_tokens"] > 0
    assert 1.0 <= r["spec_decode_acceptance_length"] <= 3.0
    assert len(r["spec_decode_per_position_acceptance_rates"]) == 2
    assert "ttfts" not in r  # per-request lists only with --save-detailed


def test_sweep_and_compare(
    server: LiveServer,
    dirs: dict[str, str],  # noqa: F811
    tmp_path: Any,
    capsys: pytest.CaptureFixture[str],
) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ("Hello", "Tell me a joke")))
    sweep = ["--sweep-max-concurrency", "1,2", "--sweep-num-prompts-factor", "2", "--save-result"]
    _bench(server, dirs, "--dataset-name", "random", "--input-len", "8", "--label", "before",
           "--result-dir", str(tmp_path), *sweep)  # fmt: skip
    _bench(server, dirs, "--backend", "openai-chat", "--dataset-name", "custom",
           "--dataset-path", str(prompts), "--label", "after", "--ignore-eos",
           "--result-dir", str(tmp_path), *sweep)  # fmt: skip
    capsys.readouterr()
    (before,) = glob.glob(os.path.join(tmp_path, "before-sweep-c1_2-*.json"))
    (after,) = glob.glob(os.path.join(tmp_path, "after-sweep-c1_2-*.json"))
    runs = json.load(open(after))["runs"]
    assert [(r["max_concurrency"], r["num_prompts"], r["completed"]) for r in runs] == [
        (1, 2, 2),
        (2, 4, 4),
    ]
    assert all(r["total_output_tokens"] == r["completed"] * OUTPUT_LEN for r in runs)

    png = tmp_path / "sweep.png"
    assert main(["bench", "compare", before, after, "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    header = "| Metric | Before (c=1) | After (c=1) | Delta | Before (c=2) | After (c=2) | Delta |"
    assert header in out
    rows = [line for line in out.splitlines() if line.startswith("| ")]
    names = [line.split(" | ")[0][2:] for line in rows[1:]]
    for name in (
        "Output token throughput (tok/s)", "Mean TPOT (ms)", "P99 E2EL (ms)", "Max TTFT (ms)",
        "Max ITL (ms)",
    ):  # fmt: skip
        assert name in names
    tput = rows[1 + names.index("Output token throughput (tok/s)")].split(" | ")
    assert tput[3].endswith("%") and tput[6].rstrip(" |").endswith("%")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_one_stall_shows_in_max_itl() -> None:
    """One 1.15 s gap among 400 ITLs of 10 ms (a first-time compile on the serving path) leaves P99
    at 10 ms; only the maximum shows it, in the JSON and in the table."""
    outs = []
    for i in range(4):
        itl = [0.010] * 100
        if i == 2:
            itl[37] = 1.15
        ttft = 0.05 if i != 1 else 0.7
        outs.append(
            RequestFuncOutput(
                success=True, latency=ttft + sum(itl), output_tokens=101, ttft=ttft, itl=itl,
                prompt_len=84, start_time=0.0,
            )
        )  # fmt: skip
    r = calculate_metrics(outs, duration=2.0, percentiles=[99.0])
    assert r["p99_itl_ms"] == pytest.approx(10.0)
    assert r["max_itl_ms"] == pytest.approx(1150.0)
    assert r["max_ttft_ms"] == pytest.approx(700.0) and r["median_ttft_ms"] == pytest.approx(50.0)
    table = format_result(r, 4, float("inf"), ["ttft", "itl"], [99.0]).splitlines()
    assert _row("Max ITL (ms):", "1150.00") in table
    assert _row("Max TTFT (ms):", "700.00") in table
    assert not any(line.startswith("Max TPOT") for line in table)  # not asked for


def test_datasets(tmp_path: Any, dirs: dict[str, str]) -> None:  # noqa: F811
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(dirs["tokenizer"])
    reqs = sample_requests(DatasetArgs("random", 5, 4, input_len=12, seed=3), tok)
    assert len(reqs) == 5 and all(0 < r.prompt_len <= 12 for r in reqs)
    assert reqs == sample_requests(DatasetArgs("random", 5, 4, input_len=12, seed=3), tok)

    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a"}\n\n{"prompt": "b c"}\n')
    reqs = sample_requests(DatasetArgs("custom", 5, 4, path=str(path)), tok)
    assert len(reqs) == 5 and {r.prompt for r in reqs} == {"a", "b c"}
    path.write_text('{"text": "a"}\n')
    with pytest.raises(ValueError, match="prompt"):
        sample_requests(DatasetArgs("custom", 1, 4, path=str(path)), tok)
    with pytest.raises(ValueError, match="tokenizer"):
        sample_requests(DatasetArgs("random", 1, 4), None)
    for name in ("code", "chat"):
        # Shipped prompt sets: they load when installed, and say how to do without otherwise.
        try:
            assert len(sample_requests(DatasetArgs(name, 3, 4), tok)) == 3
        except FileNotFoundError as e:
            assert "custom --dataset-path" in str(e)


def test_sweep_against_the_embedded_family(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """The issue's CPU check: a small sweep against the embedded family (EAGLE-3 speculation, the
    shipped code prompts) gives the table, the JSON and the spec-decode section; compare works."""
    from specserve.config import EngineConfig
    from specserve.data import embedded_model_dir

    target, spec = embedded_model_dir()
    s = LiveServer(EngineConfig(model=target, speculative_config=spec, max_num_seqs=8))
    try:
        for label in ("a", "b"):
            argv = [
                "bench", "serve", "--base-url", s.url, "--model", target, "--dataset-name", "code",
                "--output-len", "24", "--temperature", "0", "--disable-tqdm", "--label", label,
                "--sweep-max-concurrency", "1,2", "--sweep-num-prompts-factor", "2",
                "--save-result", "--result-dir", str(tmp_path),
            ]  # fmt: skip
            assert main(argv) == 0
    finally:
        s.close()
    out = capsys.readouterr().out
    assert out.count("Serving Benchmark Result") == 4
    assert "Speculative Decoding" in out and "Acceptance length" in out
    (a,) = glob.glob(os.path.join(tmp_path, "a-sweep-*.json"))
    (b,) = glob.glob(os.path.join(tmp_path, "b-sweep-*.json"))
    runs = json.load(open(a))["runs"]
    assert [r["max_concurrency"] for r in runs] == [1, 2]
    assert all(r["completed"] == r["num_prompts"] for r in runs)
    assert main(["bench", "compare", a, b]) == 0
    assert "| Metric | Before (c=1) | After (c=1) | Delta |" in capsys.readouterr().out


def test_bench_serve_fails_when_every_request_fails(
    server: LiveServer,
    dirs: dict[str, str],  # noqa: F811
) -> None:
    """A model the server does not serve: every request fails, and so does the command."""
    argv = [
        "bench", "serve", "--base-url", server.url, "--tokenizer", dirs["tokenizer"],
        "--model", "no-such-model", "--dataset-name", "random", "--input-len", "8",
        "--output-len", "4", "--num-prompts", "2", "--disable-tqdm",
    ]  # fmt: skip
    assert main(argv) != 0


def test_bench_serve_temperature_defaults_to_zero() -> None:
    import argparse

    from specserve.bench.cli import add_serve_args

    p = argparse.ArgumentParser()
    add_serve_args(p)
    assert p.parse_args([]).temperature == 0.0  # vLLM's default: greedy
