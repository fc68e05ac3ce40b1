"""`specserve train-draft`: train an EAGLE / EAGLE-3 / MTP / PTD drafter for a local target.

    specserve train-draft --target DIR --method eagle3 --data corpus/ notes.jsonl --out HEAD_DIR

Flags map 1:1 onto `DraftTrainConfig` fields (`--batch-size` <-> `batch_size`), except
`--num-speculative-tokens`, which is `eval_k` (the K acceptance is measured at).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

_METHODS = ("eagle", "eagle3", "mtp", "ptd")


def add_train_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "train-draft",
        help="train a drafter (EAGLE, EAGLE-3, MTP, PTD) on a target's hidden states",
        description=__doc__.splitlines()[0],
    )
    p.add_argument("--target", required=True, help="local HF target model directory")
    p.add_argument("--method", required=True, choices=_METHODS)
    p.add_argument(
        "--data",
        required=True,
        nargs="+",
        help="text files, .jsonl ('text' or 'prompt' field), .py files, or directories of them",
    )
    p.add_argument("--out", required=True, help="output drafter directory")
    p.add_argument(
        "--eval-data",
        nargs="+",
        default=None,
        help="held-out files for the acceptance prompts (default: the last documents of --data)",
    )
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--ttt-steps", type=int, default=3, help="draft steps unrolled in training")
    p.add_argument(
        "--draft-vocab-size", type=int, default=None, help="EAGLE-3/PTD reduced vocabulary"
    )
    p.add_argument("--num-layers", type=int, default=1, help="EAGLE decoder layers / MTP modules")
    p.add_argument("--ptd-k", type=int, default=None, help="PTD: K to train for (default: K)")
    p.add_argument(
        "--num-speculative-tokens",
        dest="eval_k",
        type=int,
        default=3,
        help="K for the acceptance measurement at the end",
    )
    p.add_argument("--eval-num-prompts", type=int, default=8)
    p.add_argument("--eval-max-tokens", type=int, default=64)
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument(
        "--dtype", default="auto", help="auto (bf16 autocast on CUDA) | float32 | bfloat16"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", dest="progress", action="store_false")
    p.set_defaults(func=cmd_train_draft)
    return p


def cmd_train_draft(args: argparse.Namespace) -> int:
    from specserve.train.data import read_texts
    from specserve.train.drafter import train_drafter

    texts = read_texts(args.data)
    eval_prompts = None
    if args.eval_data:
        held = read_texts(args.eval_data)
        # NOTE: a prompt is the opening of a held-out document, long enough to give context.
        eval_prompts = [t[:400] for t in held[: args.eval_num_prompts]]
    result = train_drafter(
        args.target,
        args.method,
        args.out,
        texts,
        eval_prompts=eval_prompts,
        steps=args.steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        lr=args.lr,
        ttt_steps=args.ttt_steps,
        draft_vocab_size=args.draft_vocab_size,
        num_layers=args.num_layers,
        ptd_k=args.ptd_k,
        device=args.device,
        dtype=args.dtype,
        seed=args.seed,
        eval_k=args.eval_k,
        eval_num_prompts=args.eval_num_prompts,
        eval_max_tokens=args.eval_max_tokens,
        progress=args.progress,
    )
    losses, acc = result["losses"], result["acceptance_length"]
    summary = {
        "method": args.method,
        "out_dir": result["out_dir"],
        "steps": len(losses),
        "first_loss": losses[0] if losses else None,
        "final_loss": sum(losses[-10:]) / len(losses[-10:]) if losses else None,
        "step_accuracy": result["step_accuracy"],
        "num_speculative_tokens": args.eval_k,
        "acceptance_length": None if acc != acc else acc,  # NaN: evaluation skipped
        "train_seconds": round(result["train_seconds"], 1),
    }
    print(json.dumps(summary))
    return 0
