"""fp8 KV cache against bf16, Llama-3-8B shape (dummy weights): decode step time at batch 64
over 4k-token contexts (target <= 0.8x bf16) and at batch 1 over short contexts (within 2%),
an EAGLE-3 K = 3 step against a plain step under fp8 (synthetic acceptance), the largest
concurrency whose 8k-token contexts fit the KV cache, and the default model's (SmolLM2-135M)
mean |prompt logprob difference| with an fp8 against a bf16 cache.

    python benchmarks/fp8_kv.py [--quick]               # GPU; $OUT/fp8_kv.json
    python benchmarks/fp8_kv.py --device cpu --shape tiny   # CPU smoke run of every part
    python benchmarks/fp8_kv.py --capacity-only fp8     # one KV dtype's pool, a JSON line

Each KV dtype's capacity is measured in a fresh process (`--capacity-only`), before this one
touches the GPU: an engine's pool is sized from the memory free when it is built, so nothing an
earlier engine left behind (a reference, the allocator's fragments) can shrink it.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import write_json  # noqa: E402
from decode import write_config  # noqa: E402
from serve_shape import SHAPES  # noqa: E402
from spec_step import measure, synthetic_spec  # noqa: E402


def make_engine(target: str, kv: str, device: str, **kw: object) -> object:
    from specserve.config import EngineConfig
    from specserve.engine.engine import LLMEngine

    cuda = device == "cuda"
    cfg = EngineConfig(
        model=target,
        dtype="bfloat16" if cuda else "float32",
        device=device,
        load_format="dummy",
        kv_cache_dtype=kv,
        gpu_memory_utilization=0.85,
        warmup=False,  # measure() runs warm steps of the batch it times first
        **kw,  # type: ignore[arg-type]
    )
    return LLMEngine(cfg)


def run_engine(
    fn: Callable[[object], dict], target: str, kv: str, device: str, **kw: object
) -> dict:
    """`fn(engine)` on a fresh engine, which is closed and referenced by nothing once this
    returns, so the next engine's KV sizing (torch.cuda.mem_get_info) finds its memory free."""
    # NOTE: the engine lives in this frame only. A caller that kept it in a variable (a loop's
    # `eng`) while building the next engine kept its weights allocated: close() frees the KV
    # cache and graphs, not the model. That cost the fp8 capacity engine ~15 GB of pool (the
    # Llama-3-8B shape's bf16 weights) when it was built after the bf16 one.
    engine = make_engine(target, kv, device, **kw)
    try:
        return fn(engine)
    finally:
        engine.close()  # type: ignore[attr-defined]
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def decode_rows(target: str, head: str, args: argparse.Namespace) -> list[dict]:
    """Step times: (batch, context) cases, fp8 vs bf16 plain, then EAGLE-3 K = 3 under fp8."""
    vocab = 128000 if args.shape == "llama3-8b" else 500
    steps = 12 if args.quick else 24
    cases = [(64, args.long_ctx), (1, 128)]

    def timed(kv: str, batch: int, ctx: int, **kw: object) -> dict:
        fn = functools.partial(measure, batch=batch, steps=steps, prompt_len=ctx, vocab_size=vocab)
        return run_engine(
            fn, target, kv, args.device, max_model_len=ctx + 700, max_num_seqs=batch,
            max_num_batched_tokens=8192, **kw,
        )  # fmt: skip

    rows = []
    for kv in ("auto", "fp8"):
        for batch, ctx in cases:
            r = timed(kv, batch, ctx)
            rows.append({"kv": kv, "spec": "plain", "batch": batch, "context": ctx, **r})
            print(f"{kv:>4} plain B={batch} ctx={ctx}: {r['ms_per_step']:.3f} ms/step", flush=True)
    for batch, ctx in cases:
        r = timed("fp8", batch, ctx, speculative_config=synthetic_spec(head, 3, 0.7))
        rows.append({"kv": "fp8", "spec": "eagle3 K=3", "batch": batch, "context": ctx, **r})
        print(f" fp8 eagle3 B={batch} ctx={ctx}: {r['ms_per_step']:.3f} ms/step", flush=True)
    return rows


def pool_size(target: str, kv: str, args: argparse.Namespace) -> dict:
    """The KV pool one engine of `kv` gets in this process (`--capacity-only`)."""
    ctx = args.capacity_ctx

    def snapshot(engine: object) -> dict:
        m = engine.metrics_snapshot()  # type: ignore[attr-defined]
        return {
            "kv_cache_num_blocks": m["kv_cache_num_blocks"],
            "kv_cache_num_tokens": m["kv_cache_num_tokens"],
            "max_concurrency": m["kv_cache_num_tokens"] // ctx,
        }

    # max_num_seqs high enough that GPU memory, not the per-sequence cap, sizes the pool.
    return run_engine(
        snapshot, target, kv, args.device, max_model_len=ctx, max_num_seqs=1024,
        enforce_eager=True, max_num_batched_tokens=8192,
    )  # fmt: skip


def capacity(args: argparse.Namespace) -> dict:
    """Sequences of `ctx` tokens the KV cache holds (the pool's tokens // ctx), bf16 vs fp8,
    each measured by this script in a fresh process (`--capacity-only KV`, a JSON line)."""
    out = {}
    for kv in ("auto", "fp8"):
        cmd = [
            sys.executable, os.path.abspath(__file__), "--capacity-only", kv, "--shape", args.shape,
            "--device", args.device, "--capacity-ctx", str(args.capacity_ctx),
        ]  # fmt: skip
        # stdout carries the JSON line only (logs go to stderr, which stays this process's).
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True)
        out[kv] = json.loads(proc.stdout.strip().splitlines()[-1])
        print(f"{kv:>4} KV cache: {out[kv]}", flush=True)
    return out


def default_model_logprobs(args: argparse.Namespace) -> float | None:
    """Mean |prompt logprob(fp8 KV) - prompt logprob(bf16 KV)| of the default model (nats)."""
    from specserve import LLM, SamplingParams
    from specserve.data import default_model, load_prompts

    try:
        gguf, _ = default_model()
    except FileNotFoundError as e:
        print(f"default model unavailable: {e}")
        return None
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    sp = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    vals = {}
    prompts = None
    for kv in ("auto", "fp8"):
        llm = LLM(gguf, dtype=dtype, device=args.device, max_model_len=1024, kv_cache_dtype=kv)
        if prompts is None:
            tok = llm.engine.tokenizer
            prompts = [tok.encode(r["prompt"])[:512] for r in load_prompts("code", 16)]
        res = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        vals[kv] = torch.tensor(
            [lp[t] for p, r in zip(prompts, res) for t, lp in zip(p[1:], r.prompt_logprobs[1:])],
            dtype=torch.float64,
        )
        llm.engine.runner.close()
        del llm
        gc.collect()
    return (vals["fp8"] - vals["auto"]).abs().mean().item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama3-8b", choices=list(SHAPES))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="fewer timed steps")
    ap.add_argument("--long-ctx", type=int, default=None, help="batch-64 context (4096)")
    ap.add_argument("--capacity-ctx", type=int, default=None, help="capacity context (8192)")
    ap.add_argument(
        "--capacity-only", choices=["auto", "fp8"], default=None,
        help="only print the KV pool of one engine of this KV dtype, as a JSON line",
    )  # fmt: skip
    args = ap.parse_args()
    tiny = args.shape == "tiny"
    args.long_ctx = args.long_ctx or (64 if tiny else 4096)
    args.capacity_ctx = args.capacity_ctx or (256 if tiny else 8192)
    t0 = time.time()
    target_cfg, head_cfg = SHAPES[args.shape]
    target = write_config({**target_cfg, "max_position_embeddings": 16384})
    if args.capacity_only is not None:
        print(json.dumps(pool_size(target, args.capacity_only, args)), flush=True)
        return
    head = write_config(head_cfg)
    # First, while this process holds no GPU memory (no CUDA context yet) that would count
    # against the measuring processes' mem_get_info().
    cap = capacity(args)
    rows = decode_rows(target, head, args)
    lp = default_model_logprobs(args)
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    out = {"device": device, "shape": args.shape, "rows": rows, "capacity": cap,
           "default_model_prompt_logprob_mad": lp, "wall_s": time.time() - t0}  # fmt: skip
    path = write_json("fp8_kv.json", out)

    def ms(kv: str, spec: str, batch: int) -> float:
        r = next(r for r in rows if (r["kv"], r["spec"], r["batch"]) == (kv, spec, batch))
        return r["ms_per_step"]

    print(f"\nfp8 KV cache vs bf16, {args.shape} on {device} ({path})")
    print(f"{'case':<40} {'bf16':>10} {'fp8':>10} {'ratio':>7}")
    for b, ctx in ((64, args.long_ctx), (1, 128)):
        a, f = ms("auto", "plain", b), ms("fp8", "plain", b)
        print(f"{f'decode B={b} ctx={ctx} (ms/step)':<40} {a:>10.3f} {f:>10.3f} {f / a:>7.3f}")
    for b in (64, 1):
        p, e = ms("fp8", "plain", b), ms("fp8", "eagle3 K=3", b)
        print(f"{f'fp8 EAGLE-3 K=3 vs plain B={b} (ms)':<40} {p:>10.3f} {e:>10.3f} {e / p:>7.3f}")
    a, f = cap["auto"]["max_concurrency"], cap["fp8"]["max_concurrency"]
    print(f"{f'sequences of {args.capacity_ctx} tokens':<40} {a:>10} {f:>10} {f / max(a, 1):>7.2f}")
    if lp is not None:
        print(f"{'SmolLM2-135M mean |prompt logprob diff|':<40} {lp:>21.4f} nats/token")


if __name__ == "__main__":
    main()
