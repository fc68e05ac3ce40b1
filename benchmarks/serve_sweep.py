"""Serving sweep on the GPU reference family, with and without EAGLE-3, and the compare table.

Builds (or reuses) the GPU family's target and EAGLE-3 head in --family-dir, then for each
configuration starts `specserve serve` on 127.0.0.1, runs `specserve bench serve` over the shipped
code prompts at max concurrency 1, 16 and 64, saves the JSON under $OUT, stops the server, and
prints `specserve bench compare` of the two runs last.

    python benchmarks/serve_sweep.py --family-dir /tmp/family
    # or in two calls of a warm machine (each half fits the 10-minute command limit):
    python benchmarks/serve_sweep.py --skip-build --labels plain
    python benchmarks/serve_sweep.py --skip-build --labels eagle3   # compare printed once both exist

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


def sh(args: list[str], **kw: object) -> None:
    print("+", " ".join(args), flush=True)
    subprocess.run(args, check=True, **kw)  # type: ignore[call-overload]


def wait_healthy(url: str, proc: subprocess.Popen, seconds: float = 300) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("the server exited")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(1)
    raise RuntimeError("the server did not come up")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family-dir", default="/tmp/family")
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--concurrency", default="1,16,64")
    ap.add_argument("--skip-build", action="store_true", help="use --family-dir as it is")
    ap.add_argument("--labels", default="plain,eagle3", help="which halves to run")
    ap.add_argument("--result-dir", default="/tmp/sweep")
    ap.add_argument("--async-scheduling", action="store_true", help="serve with it on")
    args = ap.parse_args()
    out = args.result_dir
    os.makedirs(out, exist_ok=True)
    fam = args.family_dir
    py = sys.executable
    if not args.skip_build:
        sh([py, os.path.join(ROOT, "benchmarks", "build_family.py"), "--family", "gpu", "--cache",
            fam, "--methods", "eagle3", "--stages", "tokenizer,target,drafters"])  # fmt: skip
    target = os.path.join(fam, "target")
    eagle3 = {"method": "eagle3", "model": os.path.join(fam, "drafters", "eagle3"),
              "num_speculative_tokens": 5}  # fmt: skip
    url = f"http://127.0.0.1:{args.port}"
    for label, spec in (("plain", None), ("eagle3", eagle3)):
        if label not in args.labels.split(","):
            continue
        for old in glob.glob(os.path.join(out, f"{label}-sweep-*.json")):
            os.remove(old)
        cmd = [py, "-m", "specserve.entrypoints.cli", "serve", target, "--host", "127.0.0.1",
               "--port", str(args.port), "--max-num-seqs", "64", "--max-model-len", "1024"]  # fmt: skip
        if spec:
            cmd += ["--speculative-config", json.dumps(spec)]
        # Explicit either way: the server's default is async on CUDA.
        cmd += ["--async-scheduling" if args.async_scheduling else "--no-async-scheduling"]
        server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_healthy(url, server)
            sh([py, "-m", "specserve.entrypoints.cli", "bench", "serve", "--base-url", url,
                "--model", target, "--dataset-name", "code", "--output-len",
                str(args.output_len), "--temperature", "0", "--disable-tqdm",
                "--sweep-max-concurrency", args.concurrency, "--sweep-num-prompts-factor", "2",
                "--save-result", "--result-dir", out, "--label", label])  # fmt: skip
        finally:
            server.terminate()
            server.wait(timeout=60)
    if os.environ.get("OUT"):
        for f in glob.glob(os.path.join(out, "*.json")):
            shutil.copy(f, os.environ["OUT"])
    plain = glob.glob(os.path.join(out, "plain-sweep-*.json"))
    spec_run = glob.glob(os.path.join(out, "eagle3-sweep-*.json"))
    if plain and spec_run:
        sh([py, "-m", "specserve.entrypoints.cli", "bench", "compare", plain[0], spec_run[0]])


if __name__ == "__main__":
    main()
