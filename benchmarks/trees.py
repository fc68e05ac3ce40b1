"""Cost of verifying a draft tree vs a plain step and the K = 4 chain, Llama-3-8B shape (or
the GPU reference family's ~100M target, `--shape family`), EAGLE-3-shaped head, random bf16
weights (load_format=dummy). `--profile` also counts each step's CUDA kernels and lists the
costliest, which tells a launch-bound step from a bandwidth-bound one.

For batch 1 and 16: ms per engine step of plain decoding, the K = 4 chain, and EAGLE-2 trees of
8 / 16 / 32 / 64 verified tokens (root + 7 / 15 / 31 / 63 nodes), and the drafting share of
each step (CUDA events around drafting: the tree draft loop runs depth - 1 expansions of topk
nodes a request). Random weights accept almost nothing: these are step costs, not speed-ups.
Tree steps replay CUDA graphs as chains do (the target's verification with its tree fields,
the whole tree drafting in one graph), every row on one attention backend (`--backend`: the
Triton kernel, which takes tree masks, on CUDA; torch on the CPU). Outputs are not compared
here: tests/test_tree_graphs_gpu.py checks tree graphs against eager steps.

    python benchmarks/trees.py                          # GPU, $OUT/trees.json, < 10 min
    python benchmarks/trees.py --shape family --batches 1 --profile  # the e2e family's size
    python benchmarks/trees.py --device cpu --shape tiny  # smoke run of the code paths
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import write_json  # noqa: E402
from decode import LLAMA3_8B, write_config  # noqa: E402
from spec_step import EAGLE3_HEAD  # noqa: E402

TINY = {
    **LLAMA3_8B,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "torch_dtype": "float32",
}
TINY_HEAD = {**EAGLE3_HEAD, **{k: TINY[k] for k in TINY if k in EAGLE3_HEAD}}
TINY_HEAD["draft_vocab_size"] = 256
TINY_HEAD["architectures"] = EAGLE3_HEAD["architectures"]
# The GPU reference family's shapes (specserve/train/presets.py "gpu": 100.7M parameters), the
# size at which benchmarks/e2e.py --parts trees measures trees end to end.
FAMILY = {
    **LLAMA3_8B,
    "hidden_size": 768,
    "intermediate_size": 2048,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
    "vocab_size": 16384,
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
}
FAMILY_HEAD = {**EAGLE3_HEAD, **{k: FAMILY[k] for k in FAMILY if k in EAGLE3_HEAD}}
FAMILY_HEAD["draft_vocab_size"] = 8192
FAMILY_HEAD["architectures"] = EAGLE3_HEAD["architectures"]
SHAPES = {
    "llama3-8b": (LLAMA3_8B, EAGLE3_HEAD),
    "family": (FAMILY, FAMILY_HEAD),
    "tiny": (TINY, TINY_HEAD),
}
# verified tokens (root + nodes) -> (nodes, topk, depth); topk * (depth - 1) < nodes
TREES = {8: (7, 2, 3), 16: (15, 4, 4), 32: (31, 4, 6), 64: (63, 8, 6)}


def _engine(target: str, spec: dict | None, batch: int, device: str, backend: str):
    from specserve import LLM

    return LLM(
        target,
        load_format="dummy",
        max_model_len=1024,
        max_num_seqs=batch,
        device=device,
        attention_backend=backend,
        speculative_config=spec,
    )


def _time(llm, batch: int, steps: int, prompt_len: int) -> tuple[float, float, list]:
    """-> (ms per engine step, drafting ms per step, outputs)."""
    from specserve import SamplingParams

    runner = llm.engine.runner
    prompts = [{"prompt_token_ids": [(7 * i + j) % 500 + 1 for j in range(prompt_len)]}
               for i in range(batch)]  # fmt: skip
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm.generate(prompts, sp, use_tqdm=False)  # warm-up
    sp = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
    runner.draft_events = [] if torch.cuda.is_available() and runner.device.type == "cuda" else None
    eng = llm.engine
    for p in prompts:
        eng.add_request(f"r{time.monotonic_ns()}-{id(p)}", p["prompt_token_ids"], sp)
    while eng.has_unfinished_requests() and eng.scheduler.waiting:
        eng.step()  # prefill
    if runner.device.type == "cuda":
        torch.cuda.synchronize()
    n, outs = 0, []
    t0 = time.perf_counter()
    if runner.draft_events is not None:
        runner.draft_events.clear()
    while eng.has_unfinished_requests():
        outs += eng.step()
        n += 1
    if runner.device.type == "cuda":
        torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) * 1e3 / max(n, 1)
    draft_ms = 0.0
    if runner.draft_events:
        draft_ms = sum(a.elapsed_time(b) for a, b in runner.draft_events) / len(runner.draft_events)
    return ms, draft_ms, outs


def _profile(llm, batch: int, steps: int) -> dict:
    """CUDA kernels of `steps` decode steps (after a prefill): launches and GPU time a step and
    the kernels that take most of it, to tell a launch-bound step from a bandwidth-bound one."""
    from torch.profiler import ProfilerActivity, profile

    from specserve import SamplingParams

    eng = llm.engine
    sp = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
    for i in range(batch):
        eng.add_request(
            f"p{time.monotonic_ns()}-{i}", [(5 * i + j) % 500 + 1 for j in range(64)], sp
        )
    eng.step()  # prefill
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        n = 0
        while eng.has_unfinished_requests():
            eng.step()
            n += 1
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e.name[:60], []).append(e.device_time_total / 1e3)
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:8]
    return {
        "steps": n,
        "kernels_per_step": len(kernels) / max(n, 1),
        "gpu_ms_per_step": sum(e.device_time_total for e in kernels) / 1e3 / max(n, 1),
        "top": [(name, len(v) / max(n, 1), sum(v) / max(n, 1)) for name, v in top],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shape", default="llama3-8b", choices=list(SHAPES))
    ap.add_argument(
        "--profile",
        action="store_true",
        help="also count each step's CUDA kernels (torch.profiler)",
    )
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--sizes", default="8,16,32,64")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--backend", default=None, help="attention backend (triton on CUDA)")
    args = ap.parse_args()
    if args.backend is None:
        args.backend = "triton" if args.device.startswith("cuda") else "torch"
    tiny = args.shape == "tiny"
    root = tempfile.mkdtemp(prefix="trees-")
    target_cfg, head_cfg = SHAPES[args.shape]
    target = write_config(target_cfg, os.makedirs(f"{root}/t") or f"{root}/t")
    head = write_config(head_cfg, os.makedirs(f"{root}/h") or f"{root}/h")
    steps = 6 if tiny else args.steps
    rows = []
    for batch in map(int, args.batches.split(",")):
        chain = {"method": "eagle3", "model": head, "num_speculative_tokens": 4, "adaptive": False}
        configs = [("plain", None), ("chain K=4", chain)]
        for size in map(int, args.sizes.split(",")):
            n, k, d = TREES[size]
            tree = {**chain, "num_speculative_tokens": n, "draft_tree": {"topk": k, "depth": d}}
            configs.append((f"tree {size} (topk {k}, depth {d})", tree))
        for name, spec in configs:
            llm = _engine(target, spec, batch, args.device, args.backend)
            ms, draft_ms, _ = _time(llm, batch, steps, 64 if tiny else 256)
            row = {"batch": batch, "config": name, "step_ms": ms, "draft_ms": draft_ms}
            print(f"batch {batch:3d}  {name:28s} {ms:8.2f} ms/step  drafting {draft_ms:6.2f} ms")
            if args.profile and args.device.startswith("cuda"):
                row["profile"] = prof = _profile(llm, batch, 8)
                print(f"    {prof['kernels_per_step']:.0f} kernels, "
                      f"{prof['gpu_ms_per_step']:.2f} ms of GPU time a step; top kernels "
                      "(launches, ms a step):")  # fmt: skip
                for kname, count, kms in prof["top"]:
                    print(f"      {count:5.1f} {kms:6.3f}  {kname}")
            rows.append(row)
            del llm
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    notes = [
        f"device {args.device}, shape {args.shape}, attention backend {args.backend}",
        "tree steps replay CUDA graphs (target verification and tree drafting)"
        if args.device.startswith("cuda")
        else "eager (no CUDA graphs off CUDA)",
    ]
    if tiny:
        notes.append("--shape tiny: code paths only; times are not meaningful")
    print(f"wrote {write_json('trees.json', {'rows': rows, 'notes': notes})}")
    print(json.dumps(notes))


if __name__ == "__main__":
    main()
