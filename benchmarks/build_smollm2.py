"""`build_family.py --family smollm2`: the default model's EAGLE-3 head, built on a GPU.

target    SmolLM2-135M-Instruct, converted from its GGUF file (models/gguf.py)
data      the target's own replies (train/distill.py) to the training split of
          data/instruct_prompts.jsonl plus data/chat_prompts.jsonl and code_prompts.jsonl:
          one greedy reply and `--sampled` seeded ones per prompt
head      `train_drafter(method="eagle3")` over a reduced draft vocabulary (token frequency)
measured  acceptance length at K=3, greedy, on the held-out instruct prompts
shipped   the head in bf16, as smollm2_eagle3.tar.partNN (+ manifest) under $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from typing import Any

import torch


def _bf16_head(head_dir: str) -> None:
    """The shipped head in bf16 (the target runs bf16 on a GPU; it halves the package)."""
    from safetensors.torch import load_file, save_file

    path = os.path.join(head_dir, "model.safetensors")
    tensors = {
        n: t.to(torch.bfloat16) if t.is_floating_point() else t for n, t in load_file(path).items()
    }
    save_file(tensors, path)
    cfg_path = os.path.join(head_dir, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["torch_dtype"] = "bfloat16"
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2)


def build_smollm2(args: argparse.Namespace, pack: Callable[..., dict[str, Any]]) -> int:
    from specserve.data import default_gguf, load_prompts
    from specserve.models.gguf import resolve_gguf
    from specserve.train.data import load_tokenizer
    from specserve.train.distill import chat_prompt_ids, distill
    from specserve.train.drafter import train_drafter

    cache = args.cache or "/tmp/family-smollm2"
    out_dir = args.out_dir or os.path.join(cache, "out")
    os.makedirs(out_dir, exist_ok=True)
    t0 = time.perf_counter()
    target = resolve_gguf(args.gguf or default_gguf())
    print(f"target: {target} ({time.perf_counter() - t0:.0f} s)", flush=True)

    rows = load_prompts("instruct")
    train = [r["prompt"] for r in rows if r["split"] == "train"]
    train += [r["prompt"] for r in load_prompts("chat")] + [
        r["prompt"] for r in load_prompts("code")
    ]
    heldout = [r["prompt"] for r in rows if r["split"] == "heldout"]
    if args.num_prompts:  # smoke runs
        train, heldout = train[: args.num_prompts], heldout[:2]
    t1 = time.perf_counter()
    docs, dstats = distill(
        target,
        train,
        max_tokens=16 if args.num_prompts else 384,
        sampled=3,
        device=args.device,
        dtype="bfloat16" if args.device.startswith("cuda") else "float32",
        max_num_seqs=256,
        max_model_len=640,
        max_num_batched_tokens=16384,
    )
    dstats["seconds"] = time.perf_counter() - t1
    print(f"distilled: {dstats}", flush=True)

    head_dir = os.path.join(cache, "eagle3")
    steps = args.drafter_steps or 4000
    eval_prompts = chat_prompt_ids(load_tokenizer(target), heldout)
    result = train_drafter(
        target,
        "eagle3",
        head_dir,
        docs,
        eval_prompts=eval_prompts,
        steps=steps,
        batch_size=32,
        lr=5e-4,
        ttt_steps=3,
        draft_vocab_size=8192,
        device=args.device,
        eval_k=3,
        eval_num_prompts=len(eval_prompts),
        eval_max_tokens=16 if args.num_prompts else 128,
        seq_len=64 if args.num_prompts else 512,
        progress=False,
    )
    _bf16_head(head_dir)
    # Acceptance of the shipped (bf16) head, per position, through the engine in bf16.
    from specserve import LLM, SamplingParams

    spec = {"method": "eagle3", "model": head_dir, "num_speculative_tokens": 3}
    dtype = "bfloat16" if args.device.startswith("cuda") else "float32"  # CPU smoke runs
    llm = LLM(target, device=args.device, dtype=dtype, speculative_config=spec)
    sp = SamplingParams(temperature=0.0, max_tokens=128)
    llm.generate([{"prompt_token_ids": p} for p in eval_prompts], sp, use_tqdm=False)
    m = llm.get_metrics()
    summary = {
        "target": target,
        "distill": dstats,
        "train_steps": steps,
        "train_seconds": result["train_seconds"],
        "final_loss": sum(result["losses"][-50:]) / max(len(result["losses"][-50:]), 1),
        "acceptance_length_fp_train_eval": result["acceptance_length"],
        "acceptance_length_bf16": m["spec_decode_mean_acceptance_length"],
        "accepted_per_pos": m["spec_decode_num_accepted_tokens_per_pos_total"],
        "num_drafts": m["spec_decode_num_drafts_total"],
        "heldout_prompts": len(eval_prompts),
        "seconds": time.perf_counter() - t0,
    }
    with open(os.path.join(cache, "smollm2.json"), "w") as f:
        json.dump(summary, f, indent=2)
    summary["package"] = pack(cache, out_dir, prefix="smollm2_eagle3")
    with open(os.path.join(out_dir, "smollm2_summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    png = os.path.join(head_dir, "loss_curve.png")
    if os.path.isfile(png):
        os.replace(png, os.path.join(out_dir, "smollm2_eagle3_loss.png"))
    per_pos = [a / max(summary["num_drafts"], 1) for a in summary["accepted_per_pos"]]
    print("| stage | value |\n|---|---|")
    print(
        f"| distilled documents | {int(dstats['documents'])} ({int(dstats['reply_tokens'])} tokens, "
        f"{dstats['seconds']:.0f} s) |"
    )
    print(
        f"| training | {steps} steps, {result['train_seconds']:.0f} s, loss {summary['final_loss']:.3f} |"
    )
    print(
        f"| acceptance length, K=3, held-out chat (bf16) | {summary['acceptance_length_bf16']:.3f} |"
    )
    print(f"| per-position acceptance | {', '.join(f'{a:.3f}' for a in per_pos)} |")
    print(f"| package | {summary['package']['model_bytes'] / 1e6:.1f} MB |")
    return 0
