"""Serving sweep, plain and with EAGLE-3: `specserve serve` + `specserve bench serve`, then
`specserve bench compare` of the two (with a plot).

Two kinds of model:
  --shape llama3-8b   vLLM's Llama-3-8B EAGLE table shape, nothing to build: a Llama-3-8B
                      target config and a word-level tokenizer over its 128256 ids
                      (serve_shape.py), served with `--load-format dummy`; EAGLE-3 is an
                      EAGLE-3-shaped head, K=3, synthetic acceptance 0.505 (tau 1.89, as that
                      table). Defaults: random prompts of 84 tokens, 1536 output tokens,
                      concurrency 1,16,64, 4 x concurrency prompts.
  (no --shape)        the GPU reference family (build_family.py), code prompts, EAGLE-3 K=5.
  --shape llama3-70b --tensor-parallel-size 4 --acceptance 0.7   the same flow at Llama-3-70B
                      shape (an EAGLE-3 head of the published 70B layout) over 4 GPUs.
  --shape tiny --device cpu   the llama3-8b flow at test size on the CPU (a smoke run).

Each configuration starts `specserve serve` on 127.0.0.1, runs `bench serve` at each max
concurrency, saves the JSON in --result-dir (and the server log, start-up timings included),
stops the server; `bench compare` runs once both labels have results there.

    python benchmarks/serve_sweep.py --shape llama3-8b --labels plain    # one 10-minute call
    python benchmarks/serve_sweep.py --shape llama3-8b --labels eagle3   # prints the compare
    python benchmarks/serve_sweep.py --shape llama3-8b --output-len 64 --result-dir /tmp/short
    python benchmarks/serve_sweep.py --family-dir /tmp/family            # the trained family

Results are kept in --result-dir (outside $OUT, which a device call empties) and copied to $OUT.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import out_dir  # noqa: E402

# vLLM's table: EAGLE-3 K=3 at acceptance length 1.89 (1 + 0.505 + 0.505^2 + 0.505^3 = 1.89).
SHAPE_EAGLE3 = {
    "method": "eagle3",
    "num_speculative_tokens": 3,
    "rejection_sample_method": "synthetic",
    "synthetic_acceptance_rate": 0.505,
}


def sh(args: list[str], **kw: object) -> None:
    print("+", " ".join(args), flush=True)
    subprocess.run(args, check=True, **kw)  # type: ignore[call-overload]


def wait_healthy(url: str, proc: subprocess.Popen, log: str, seconds: float = 600) -> float:
    """Seconds until /health answered 200; the server log's tail in the error otherwise."""
    t0 = time.monotonic()
    while time.monotonic() < t0 + seconds:
        if proc.poll() is not None:
            with open(log) as f:
                tail = f.read()[-3000:]
            raise RuntimeError(f"the server exited ({proc.returncode}); its log ends:\n{tail}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return time.monotonic() - t0
        except OSError:
            time.sleep(1)
    raise RuntimeError(f"the server did not come up in {seconds:.0f} s (log: {log})")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--shape", default=None, choices=("llama3-8b", "llama3-70b", "tiny"), help="no build"
    )
    ap.add_argument("--tensor-parallel-size", type=int, default=1, help="the server's")
    ap.add_argument(
        "--acceptance", type=float, default=None, help="synthetic acceptance (--shape; 0.505)"
    )
    ap.add_argument("--device", default="auto", help="the server's --device (cpu: smoke run)")
    ap.add_argument("--family-dir", default="/tmp/family")
    ap.add_argument("--skip-build", action="store_true", help="use --family-dir as it is")
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--input-len", type=int, default=84, help="random prompts (--shape)")
    ap.add_argument("--output-len", type=int, default=None, help="default 1536 (--shape), 128")
    ap.add_argument("--concurrency", default="1,16,64")
    ap.add_argument("--num-prompts-factor", type=int, default=None, help="default 4 / 2")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--labels", default="plain,eagle3", help="which halves to run")
    ap.add_argument("--result-dir", default="/tmp/sweep")
    ap.add_argument("--plot", default=None, help="default: <result-dir>/sweep.png")
    ap.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="default: the server's (on for CUDA) with --shape, off for the family",
    )
    args = ap.parse_args(argv)
    shape = args.shape is not None
    if args.output_len is None:
        args.output_len = 1536 if shape else 128
    if args.num_prompts_factor is None:
        args.num_prompts_factor = 4 if shape else 2
    if args.async_scheduling is None and not shape:
        args.async_scheduling = False  # the family sweep's recorded setting
    bad = set(args.labels.split(",")) - {"plain", "eagle3"}
    if bad:
        raise SystemExit(f"--labels takes plain and/or eagle3, not {', '.join(sorted(bad))}")
    return args


def models(args: argparse.Namespace) -> tuple[str, dict]:
    """(target dir, EAGLE-3 speculative config), writing or building what is needed."""
    py = sys.executable
    if args.shape is not None:
        from serve_shape import write_shape

        target, head = write_shape(os.path.join(args.result_dir, "models"), args.shape)
        spec = {**SHAPE_EAGLE3, "model": head}
        if args.acceptance is not None:
            spec["synthetic_acceptance_rate"] = args.acceptance
        return target, spec
    fam = args.family_dir
    if not args.skip_build:
        sh([py, os.path.join(ROOT, "benchmarks", "build_family.py"), "--family", "gpu", "--cache",
            fam, "--methods", "eagle3", "--stages", "tokenizer,target,drafters"])  # fmt: skip
    head = os.path.join(fam, "drafters", "eagle3")
    return os.path.join(fam, "target"), {"method": "eagle3", "model": head,
                                         "num_speculative_tokens": 5}  # fmt: skip


def serve_cmd(args: argparse.Namespace, target: str, spec: dict | None) -> list[str]:
    max_len = args.input_len + args.output_len + 64 if args.shape else 1024
    cmd = [sys.executable, "-m", "specserve.entrypoints.cli", "serve", target, "--host",
           "127.0.0.1", "--port", str(args.port), "--max-num-seqs", str(args.max_num_seqs),
           "--max-model-len", str(max_len), "--device", args.device]  # fmt: skip
    if args.shape:
        cmd += ["--load-format", "dummy"]
    if args.tensor_parallel_size > 1:
        cmd += ["--tensor-parallel-size", str(args.tensor_parallel_size)]
    if spec:
        cmd += ["--speculative-config", json.dumps(spec)]
    if args.async_scheduling is not None:
        cmd += ["--async-scheduling" if args.async_scheduling else "--no-async-scheduling"]
    return cmd


def bench_cmd(args: argparse.Namespace, url: str, target: str, label: str) -> list[str]:
    data = ["--dataset-name", "code"]
    if args.shape:
        data = ["--dataset-name", "random", "--input-len", str(args.input_len)]
    return [sys.executable, "-m", "specserve.entrypoints.cli", "bench", "serve", "--base-url",
            url, "--model", target, *data, "--output-len", str(args.output_len),
            "--temperature", "0", "--disable-tqdm", "--sweep-max-concurrency", args.concurrency,
            "--sweep-num-prompts-factor", str(args.num_prompts_factor), "--save-result",
            "--result-dir", args.result_dir, "--label", label]  # fmt: skip


def run_half(args: argparse.Namespace, label: str, target: str, spec: dict | None) -> None:
    out = args.result_dir
    for old in glob.glob(os.path.join(out, f"{label}-sweep-*.json")):
        os.remove(old)
    url = f"http://127.0.0.1:{args.port}"
    log = os.path.join(out, f"{label}-server.log")
    cmd = serve_cmd(args, target, spec)
    print("+", " ".join(cmd), f"> {log}", flush=True)
    with open(log, "w") as f:
        server = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
    try:
        up = wait_healthy(url, server, log)
        print(f"{label}: the server answered /health after {up:.1f} s", flush=True)
        sh(bench_cmd(args, url, target, label))
    finally:
        server.terminate()
        server.wait(timeout=120)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    out = args.result_dir
    os.makedirs(out, exist_ok=True)
    target, eagle3 = models(args)
    for label, spec in (("plain", None), ("eagle3", eagle3)):
        if label in args.labels.split(","):
            run_half(args, label, target, spec)
    plain = glob.glob(os.path.join(out, "plain-sweep-*.json"))
    spec_run = glob.glob(os.path.join(out, "eagle3-sweep-*.json"))
    if plain and spec_run:
        png = args.plot or os.path.join(out, "sweep.png")
        sh([sys.executable, "-m", "specserve.entrypoints.cli", "bench", "compare", plain[0],
            spec_run[0], "--plot", png])  # fmt: skip
    for f in glob.glob(os.path.join(out, "*.json")) + glob.glob(os.path.join(out, "*.png")):
        shutil.copy(f, out_dir())
    for f in glob.glob(os.path.join(out, "*.log")):
        shutil.copy(f, out_dir())


if __name__ == "__main__":
    main()
