"""MLA prefill: latent-space attention against per-head K/V expanded from the latent, which
path is faster at each prompt length.

GLM-4.7-Flash shape (benchmarks/mla_decode.py's config, layers cut to fit), random bf16
weights. One engine; for each prompt length, the time to first token of one request (an eager
prefill step, chunked at the token budget, then one sampled token) with
`tunables().mla_expand_prefill_min_query` None (latent: the Triton MLA kernel) and 1 (expanded:
W_UK / W_UV bmm's + SDPA), alternating, median of --repeats. The switch is read at every
forward, and prefill steps are never captured, so both paths run in the same engine.

    python benchmarks/mla_prefill.py                 # $OUT/mla_prefill.json; ~3 min on an H100
    python benchmarks/mla_prefill.py --cpu-smoke     # tiny shapes on the CPU: the code path only
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import moe_decode as moe  # noqa: E402
from _common import out_dir as results_dir  # noqa: E402
from decode import write_config  # noqa: E402
from mla_decode import GLM47_FLASH, TINY_MLA  # noqa: E402

MODES = {"latent": None, "expanded": 1}


def ttft(llm: Any, prompt: list[int]) -> tuple[float, int]:
    """(seconds to the first token of `prompt`, that token)."""
    from specserve import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)
    return time.perf_counter() - t0, out[0].outputs[0].token_ids[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu-smoke", action="store_true")
    ap.add_argument("--lengths", default=None, help="prompt tokens (default 512,2048,8192)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--layers", type=int, default=None, help="default: as many as fit")
    args = ap.parse_args()
    smoke = args.cpu_smoke
    lengths = [int(x) for x in (args.lengths or ("16,40" if smoke else "512,2048,8192")).split(",")]
    cfg = {**GLM47_FLASH, **TINY_MLA} if smoke else dict(GLM47_FLASH)
    if not smoke:
        # NOTE: share 0.45, not fit_layers' 0.72: an 8192-token prefill step needs the rest for
        # its activations (2026-11-26: "no GPU memory left for the KV cache" at 0.72).
        n, _ = moe.fit_layers(cfg, torch.cuda.get_device_properties(0).total_memory, 1, 0.45)
        cfg["num_hidden_layers"] = args.layers or n
    model_dir = write_config(cfg, tempfile.mkdtemp(prefix="mla-prefill-"))
    from specserve import LLM
    from specserve.tunables import override

    llm = LLM(
        model_dir, dtype="float32" if smoke else "bfloat16", device="cpu" if smoke else "cuda",
        load_format="dummy", max_model_len=max(lengths) + 8, max_num_seqs=1,
        max_num_batched_tokens=8192 if not smoke else 64, warmup=False,
        gpu_memory_utilization=0.9,
    )  # fmt: skip
    g = torch.Generator().manual_seed(0)
    rows = []
    for n in lengths:
        prompt = torch.randint(0, cfg["vocab_size"], (n,), generator=g).tolist()
        times: dict[str, list[float]] = {m: [] for m in MODES}
        first: dict[str, int] = {}
        for _ in range(args.repeats + 1):  # the first round compiles / warms up: dropped
            for mode, min_q in MODES.items():
                with override(mla_expand_prefill_min_query=min_q):
                    t, tok = ttft(llm, prompt)
                times[mode].append(t)
                first[mode] = tok
        row = {"prompt_tokens": n, "first_tokens": first}
        for mode in MODES:
            row[f"{mode}_ms"] = statistics.median(times[mode][1:]) * 1e3
        row["expanded_vs_latent"] = row["expanded_ms"] / row["latent_ms"]
        rows.append(row)
        print(
            f"{n:6d} tokens: latent {row['latent_ms']:8.1f} ms, expanded {row['expanded_ms']:8.1f}"
            f" ms ({row['expanded_vs_latent']:.2f}x); first tokens {first}",
            flush=True,
        )
    result = {
        "device": torch.cuda.get_device_name() if not smoke else "cpu",
        "command": " ".join(sys.argv),
        "layers": cfg["num_hidden_layers"],
        "rows": rows,
    }
    out_dir = results_dir()
    with open(os.path.join(out_dir, "mla_prefill.json"), "w") as f:
        json.dump(result, f, indent=1)
    print("prompt tokens | latent ms | expanded ms | expanded / latent")
    for r in rows:
        print(
            f"{r['prompt_tokens']} | {r['latent_ms']:.1f} | {r['expanded_ms']:.1f} | "
            f"{r['expanded_vs_latent']:.2f}x"
        )


if __name__ == "__main__":
    main()
