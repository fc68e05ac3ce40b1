"""gpt-oss decode against the active-weight floor, and the cost of EAGLE-3 / parallel-draft steps.

Random weights (load_format="dummy": attention sinks, router and expert biases included) at the
published shapes, experts in MXFP4 as the published checkpoints store them (the config carries
quantization_config mxfp4, so on CUDA the experts stay 4-bit: random code bytes and scales,
read by ops/moe_mxfp4.py's kernels; --mxfp4-experts dequantize measures bf16 experts instead):
gpt-oss-20b (24 layers, 32 experts top-4) and gpt-oss-120b (36 layers, 128 experts top-4) cut to
the layers whose weights, as loaded, fit --weights-gb (default 70 GB: the full 120b is ~65 GB
with 4-bit experts, ~234 GB in bf16). Both alternate sliding-window (128) and full attention
layers. Built on benchmarks/moe_decode.py (one process, each configuration caught on its own):

  check   greedy tokens of a short generation with CUDA graphs == with enforce_eager=True
  plain   decode ms/step at batch 1, 16, 64 and the batch-1 graph's replay time, against the
          step's floor: the bytes it reads over the copy bandwidth measured in this run. The
          routed experts are counted as they are read: 4.25 bits a weight when kept MXFP4 (so
          "floor" is then the MXFP4 floor, the goal's measure), bf16 when dequantized; "mxfp4
          fl" is always the step with the expert matrices at 4.25 bits (the rest as loaded).
  spec    ms per speculative step (synthetic acceptance 0.7) against the plain step: a random
          EAGLE-3 head (the project's layout: one 2880-wide Llama layer, fc over 3 x 2880
          aux hidden states, 32000-token draft vocabulary) at K = 3, and the same head trained
          for parallel drafting (K drafts from one forward) at K = 3 and K = 8.

    python benchmarks/gpt_oss_decode.py             # < 8 min on one H100; $OUT/gpt_oss_decode.json
    python benchmarks/gpt_oss_decode.py --quick     # batch 1 only, fewer configurations
    python benchmarks/gpt_oss_decode.py --cpu-smoke # tiny shapes on the CPU: the code paths only
                                                    # (4-bit experts, dequantized per call)
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402, F401  (the repository on sys.path)
from decode import copy_bandwidth, write_config  # noqa: E402
from moe_decode import (  # noqa: E402
    Plan,
    common_args,
    finish_args,
    log,
    model_bytes,
    print_plain_table,
    print_spec_table,
    print_verdicts,
    run_plans,
    start,
)
from spec_step import EAGLE3_HEAD  # noqa: E402

# openai/gpt-oss-20b's config.json (the keys specserve and transformers read; layer_types is
# written per layer count by `with_layers`).
GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"],
    "model_type": "gpt_oss",
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "num_hidden_layers": 24,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "num_local_experts": 32,
    "num_experts_per_tok": 4,
    "experts_per_token": 4,
    "sliding_window": 128,
    "vocab_size": 201088,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 150000,
    "rope_scaling": {
        "rope_type": "yarn",
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 4096,
    },
    "attention_bias": True,
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "eos_token_id": 200002,
    "pad_token_id": 199999,
    # As published: the experts in MXFP4, everything else bf16.
    "quantization_config": {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    },
}
# openai/gpt-oss-120b: the same layer, 36 of them, 128 experts.
GPT_OSS_120B = {**GPT_OSS_20B, "num_hidden_layers": 36, "num_local_experts": 128}
# A random EAGLE-3 head for gpt-oss in the project's layout (one 2880-wide Llama layer).
GPT_OSS_EAGLE3 = {
    **EAGLE3_HEAD,
    "hidden_size": 2880,
    "intermediate_size": 17280,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "vocab_size": 201088,
    "draft_vocab_size": 32000,
    "rms_norm_eps": 1e-5,
    "rope_theta": 150000.0,
    "max_position_embeddings": 131072,
}
# The same head trained for parallel drafting; the mask token is the last (reserved) id.
GPT_OSS_PTD = {**GPT_OSS_EAGLE3, "parallel_draft": True, "ptd_token_id": 201087}
# --cpu-smoke: 2 layers (one sliding, one full), hidden 64, 8 experts top-2, 512-token vocab.
TINY = {
    "hidden_size": 64,
    "intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "experts_per_token": 2,
    "sliding_window": 16,
    "vocab_size": 512,
    "max_position_embeddings": 2048,
}
TINY_HEAD = {
    **{k: TINY[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads")},
    **{k: TINY[k] for k in ("head_dim", "vocab_size", "max_position_embeddings")},
    "intermediate_size": 128,
    "draft_vocab_size": 128,
}
TARGET = 0.70  # the goal: batch-1 decode at >= 70% of the active-weight floor (MXFP4 bytes)


def with_layers(cfg: dict, n: int) -> dict:
    """`cfg` at n layers, alternating sliding (even) and full (odd) as the published configs."""
    kinds = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
    return {**cfg, "num_hidden_layers": n, "layer_types": kinds}


def fit_layers(cfg: dict, weight_bytes: float, keep_mxfp4: bool) -> tuple[int, str]:
    """The most layers (even, so both attention kinds stay equally many) whose weights, as
    loaded (experts 4-bit or bf16), take <= weight_bytes."""
    base = model_bytes(cfg, 2, keep_mxfp4=keep_mxfp4)
    per_layer = (model_bytes(cfg, 4, keep_mxfp4=keep_mxfp4) - base) / 2
    full = base + (cfg["num_hidden_layers"] - 2) * per_layer
    n = 2 + int((weight_bytes - base) // per_layer)
    n = max(2, min(n - n % 2, cfg["num_hidden_layers"]))
    kind = "MXFP4-expert" if keep_mxfp4 else "bf16"
    note = (
        f"{n} of {cfg['num_hidden_layers']} layers: {(base + (n - 2) * per_layer) / 1e9:.0f} "
        f"GB of {kind} weights (the full model {full / 1e9:.0f} GB)"
    )
    return n, note


def plans_for(args: argparse.Namespace, notes: list[str]) -> list[Plan]:
    smoke = args.cpu_smoke
    heads = {
        label: write_config(
            {**head, **(TINY_HEAD if smoke else {})}, tempfile.mkdtemp(prefix=f"gpt-oss-{label}-")
        )
        for label, head in (("eagle3", GPT_OSS_EAGLE3), ("ptd", GPT_OSS_PTD))
    }
    if smoke:  # the PTD mask token must be in the tiny vocabulary
        write_config({**GPT_OSS_PTD, **TINY_HEAD, "ptd_token_id": 511}, heads["ptd"])
    specs = [
        ("eagle3", {"method": "eagle3", "model": heads["eagle3"], "num_speculative_tokens": 3})
    ]
    specs += [
        (
            "ptd",
            {
                "method": "eagle3",
                "model": heads["ptd"],
                "num_speculative_tokens": k,
                "parallel_draft": True,
            },
        )
        for k in (3, 8)
    ]
    plans: list[Plan] = []
    for key, name, cfg in (
        ("20b", "gpt-oss-20b", GPT_OSS_20B),
        ("120b", "gpt-oss-120b", GPT_OSS_120B),
    ):
        if key not in args.models.split(","):
            continue
        n = cfg["num_hidden_layers"]
        if smoke:
            cfg = {**cfg, **TINY, "num_local_experts": 8 if key == "20b" else 16}
            n = 2
        elif key == "120b":
            n, note = fit_layers(cfg, args.weights_gb * 1e9, args.mxfp4_experts != "dequantize")
            if args.layers_120b:
                n, note = args.layers_120b, f"{args.layers_120b} of 36 layers (--layers-120b)"
            notes.append(f"gpt-oss-120b shape: {note}")
        plans.append((name, with_layers(cfg, n), specs, "num_local_experts"))
    return plans


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common_args(ap, budget_s=400.0)
    ap.add_argument("--models", default="20b,120b", help="20b and/or 120b")
    ap.add_argument(
        "--weights-gb", type=float, default=70.0, help="weight budget of the 120b cut (as loaded)"
    )
    ap.add_argument(
        "--mxfp4-experts",
        default=None,
        choices=("auto", "mxfp4", "dequantize"),
        help="EngineConfig.mxfp4_experts (default: auto; mxfp4 under --cpu-smoke, so the smoke "
        "runs the 4-bit container through its dequantize-per-call CPU fallback)",
    )
    ap.add_argument("--layers-120b", type=int, default=None, help="default: as many as fit")
    args = finish_args(ap.parse_args())
    if args.mxfp4_experts is None:
        args.mxfp4_experts = "mxfp4" if args.cpu_smoke else "auto"
    unknown = set(args.models.split(",")) - {"20b", "120b"}
    if unknown:
        ap.error(f"--models: unknown {', '.join(sorted(unknown))} (choose 20b and/or 120b)")
    return args


def main() -> None:
    args = parse_args()
    start(args)
    notes = []
    if args.cpu_smoke:
        notes.append("--cpu-smoke: tiny shapes on the CPU (float32); times are not meaningful")
    plans = plans_for(args, notes)
    as_read = "bf16 (dequantized at load)" if args.mxfp4_experts == "dequantize" else "MXFP4"
    notes.append(
        f"floor: routed experts as read, {as_read}, = expected distinct experts under uniform "
        "random routing, E * (1 - (1 - k/E)^B) a layer; 'mxfp4 fl': the same step with the "
        "expert matrices at 4.25 bits (biases, attention, lm_head as loaded)"
    )
    log(f"device {args.device}; {'; '.join(notes[:-1])}")
    bw_before = copy_bandwidth() if args.device == "cuda" else None
    result = run_plans(args, plans, notes, "gpt_oss_decode.json", bw_before)
    print_plain_table(result, mxfp4=True)
    print_spec_table(result)
    print_verdicts(result, TARGET)
    for m in result["models"]:
        r1 = next((r for r in m["plain"].get("rows", []) if r["batch"] == 1), None)
        if r1 and r1.get("floor_mxfp4_ms"):
            print(
                f"{m['name']}: batch-1 at {100 * r1['floor_mxfp4_ms'] / r1['ms_per_step']:.1f}% "
                f"of the floor with MXFP4 experts (the goal's measure; experts read as "
                f"{as_read})"
            )


if __name__ == "__main__":
    main()
