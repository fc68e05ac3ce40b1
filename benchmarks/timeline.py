"""Device timeline of batch-1 decode steps at a target's real shape (random weights): where a
step's time over the captured graph goes, kernel by kernel (decode.py's `timeline`).

    python benchmarks/timeline.py --shape qwen3-30b-a3b   # $OUT/timeline-<shape>.json
    python benchmarks/timeline.py --shape glm47-flash,gpt-oss-20b,llama3-8b
    python benchmarks/timeline.py --shape gpt-oss-20b --profile   # + the host side (cProfile)
    python benchmarks/timeline.py --shape llama3-8b --batch 64 --spec-k 4   # EAGLE-3 steps

Each shape: `load_format="dummy"`, bf16, async scheduling, decode_matmul=auto, CUDA graphs. Shapes
that do not fit one GPU keep as many layers as fit (moe_decode.fit_layers), as their decode
benchmarks do; the per-layer rows are what matter.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import out_dir  # noqa: E402
from decode import LLAMA3_8B, profile_steps, timeline, write_config  # noqa: E402
from gpt_oss_decode import GPT_OSS_20B  # noqa: E402
from mla_decode import GLM47_FLASH, MTP_LAYERS  # noqa: E402
from moe_decode import QWEN3_30B_A3B, fit_layers  # noqa: E402

SHAPES = {
    "llama3-8b": (LLAMA3_8B, 0),
    "qwen3-30b-a3b": (QWEN3_30B_A3B, 0),
    "glm47-flash": (GLM47_FLASH, MTP_LAYERS),
    "gpt-oss-20b": (GPT_OSS_20B, 0),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3-30b-a3b", help=",".join(SHAPES))
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--rows", type=int, default=24, help="graph kernels printed")
    ap.add_argument("--batch", type=int, default=1, help="requests decoding at once")
    ap.add_argument(
        "--profile",
        action="store_true",
        help="also the host side of batch-1 steps: cProfile and every synchronizing operation",
    )
    ap.add_argument(
        "--step-ms",
        action="store_true",
        help="then the steady-state step time without the profiler (spec_step.measure, 48 "
        "steps, a fresh engine)",
    )
    ap.add_argument(
        "--spec-k",
        type=int,
        default=0,
        help="llama3-8b only: trace EAGLE-3 steps with K drafts (spec_step.py's head, synthetic "
        "acceptance 0.7): drafting and verification kernels by name",
    )
    args = ap.parse_args()
    out = out_dir()
    for name in args.shape.split(","):
        cfg, mtp = SHAPES[name]
        cfg = dict(cfg)
        if "first_k_dense_replace" in cfg:
            n, note = fit_layers(cfg, torch.cuda.get_device_properties(0).total_memory, mtp)
            cfg["num_hidden_layers"] = n
            print(f"{name}: {note}")
        model_dir = write_config(cfg, tempfile.mkdtemp(prefix=f"{name}-"))
        print(f"\n#### {name}", flush=True)
        if args.step_ms:  # first: a profiler leaves launches slower for the rest of the process
            step_time(model_dir, args.prompt_len, args.batch, cfg["vocab_size"])
        spec = {}
        if args.spec_k:
            if name != "llama3-8b":
                raise SystemExit("--spec-k: llama3-8b only (spec_step.py's EAGLE-3 head)")
            spec = {"speculative_config": eagle3_spec(args.spec_k)}
        res = timeline(
            model_dir,
            args.prompt_len,
            rows=args.rows,
            batch=args.batch,
            gpu_memory_utilization=0.9,
            max_model_len=model_len(args.prompt_len),
            **spec,
        )
        tag = f"-k{args.spec_k}" if args.spec_k else ""
        with open(os.path.join(out, f"timeline-{name}-b{args.batch}{tag}.json"), "w") as f:
            json.dump({"shape": name, "config": cfg, **res}, f, indent=1)
        if args.profile:
            kw = dict(async_scheduling=True, decode_matmul="auto", gpu_memory_utilization=0.9)
            profile_steps(model_dir, args.prompt_len, **kw)
        gc.collect()
        torch.cuda.empty_cache()


def model_len(prompt_len: int) -> int:
    """max_model_len for a run at `prompt_len`: 1024 (the recorded runs'; it sets the attention's
    split count), or room for the prompt and the steps past it."""
    return max(1024, prompt_len + 512)


def eagle3_spec(k: int) -> dict:
    """spec_step.py's EAGLE-3-shaped head for the Llama-3-8B shape, K drafts, acceptance 0.7."""
    from spec_step import EAGLE3_HEAD, synthetic_spec

    return synthetic_spec(write_config(EAGLE3_HEAD, tempfile.mkdtemp(prefix="eagle3-")), k, 0.7)


def step_time(model_dir: str, prompt_len: int, batch: int, vocab_size: int) -> None:
    """Print the step time of a running decode loop (CUDA events, no profiler)."""
    from spec_step import make_engine, measure

    # 2048 batched tokens: the KV sizing's logits headroom fits beside Qwen3-30B-A3B's weights
    engine = make_engine(
        model_dir,
        None,
        "fused",
        batch,
        async_scheduling=True,
        max_num_batched_tokens=2048,
        max_model_len=model_len(prompt_len),
    )
    # The host's waits for the device (each step's results): ~0 when the host is the bottleneck.
    runner, waits = engine.runner, []
    finish = runner.finish

    def timed_finish(pending: object) -> object:
        t = time.perf_counter()
        if pending.event is not None:  # type: ignore[attr-defined]
            pending.event.synchronize()  # type: ignore[attr-defined]
        waits.append(time.perf_counter() - t)
        return finish(pending)

    runner.finish = timed_finish
    r = measure(engine, batch, 48, prompt_len, vocab_size)
    del runner.finish  # the wrapper refers to the runner: no cycle left to keep it alive
    wait = 1e6 * sum(waits[-48:]) / 48
    print(
        f"step {1e3 * r['ms_per_step']:.0f} us (wall {1e3 * r['wall_ms_per_step']:.0f}); host "
        f"waits {wait:.0f} us a step for the device"
    )
    del engine, runner
    gc.collect()
    torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
