"""MLA decode (GLM-4.7-Flash shape) against the active-weight floor, the latent KV cache, and the
cost of MTP steps: one MTP layer (the shipped layout) and three (the multi-layer MTP chain).

Random bf16 weights (load_format="dummy") at zai-org/GLM-4.7-Flash's shapes (`glm4_moe_lite`:
hidden 2048, 20 heads, MLA q_lora_rank 768 / kv_lora_rank 512 / qk_nope 192 / qk_rope 64 /
v_head 256, 1 dense + 46 MoE layers of 64 routed experts (top-4) + 1 shared, one MTP layer).
Layers are cut to what fits one GPU next to three MTP layers (the table says how many). The
helpers (engine, timing, floor, error capture) are benchmarks/moe_decode.py's. In one process,
each configuration caught on its own (an OOM or error is a table row, not a crash):

  check    greedy tokens with CUDA graphs == with enforce_eager=True
  plain    decode ms/step at batch 1, 16, 64 (engine defaults: async scheduling, CUDA graphs)
           and the batch-1 graph's replay time, against the step's floor (bytes one step reads:
           every non-expert weight, the routed experts the batch chose, embedding rows and the
           latent KV of the context, over the measured device copy bandwidth)
  kv       KV bytes per token: the latent cache (kv_lora_rank + qk_rope_head_dim per layer)
           against a full per-head K/V layout of the same attention
  mtp      ms per step with MTP K = 1 and K = 3 (one MTP layer: the shared single-module loop)
           against the plain step, with CUDA graphs and with enforce_eager (synthetic
           acceptance 0.7, so the step's shape does not depend on trained weights)
  multi    three MTP layers, K = 3 (the multi-layer chain, spec_decode/multi_layer_mtp.py): the
           chain captured in a graph (draft_graph_mode auto) against the eager chain
           (draft_graph_mode eager, the target still in graphs) and against enforce_eager

    python benchmarks/mla_decode.py            # < 9 min on one H100; $OUT/mla_decode.json
    python benchmarks/mla_decode.py --quick    # a smaller budget; < 8 min on one H100
    python benchmarks/mla_decode.py --cpu-smoke  # tiny shapes on the CPU: the code paths only
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import moe_decode as moe  # noqa: E402
from _common import out_dir as results_dir  # noqa: E402
from decode import copy_bandwidth, write_config  # noqa: E402
from moe_decode import _ms, _pct, guarded, log  # noqa: E402
from spec_step import measure  # noqa: E402

# zai-org/GLM-4.7-Flash's config.json (the keys specserve and transformers read).
GLM47_FLASH = {
    "architectures": ["Glm4MoeLiteForCausalLM"],
    "model_type": "glm4_moe_lite",
    "hidden_size": 2048,
    "intermediate_size": 10240,
    "moe_intermediate_size": 1536,
    "num_hidden_layers": 47,
    "num_attention_heads": 20,
    "num_key_value_heads": 20,
    "q_lora_rank": 768,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 192,
    "qk_rope_head_dim": 64,
    "v_head_dim": 256,
    "n_routed_experts": 64,
    "n_shared_experts": 1,
    "num_experts_per_tok": 4,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.8,
    "first_k_dense_replace": 1,
    "num_nextn_predict_layers": 1,
    "partial_rotary_factor": 1.0,
    "attention_bias": False,
    "vocab_size": 154880,
    "max_position_embeddings": 202752,
    "rms_norm_eps": 1e-5,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "eos_token_id": [154820, 154827, 154829],
}
# --cpu-smoke: 2 layers, hidden 64, 8 experts (top-2), small MLA ranks, a 512-token vocabulary.
TINY_MLA = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 48,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "vocab_size": 512,
    "max_position_embeddings": 2048,
}
TARGET = 0.70  # the goal: batch-1 decode at >= 70% of the active-weight floor
MTP_LAYERS = 3  # the multi-layer configuration


def kv_layout(cfg: dict, dtype: torch.dtype) -> dict[str, Any]:
    """KV bytes per token of the target: the latent cache vs a full per-head K/V layout."""
    from specserve.models.mla import MLAAttention
    from specserve.models.registry import default_dtype, resolve_architecture

    with torch.device("meta"), default_dtype(dtype):
        m = resolve_architecture(cfg, "").from_config_dict(cfg, 4096)
    layers = [x for x in m.modules() if isinstance(x, MLAAttention)]
    elem = torch.empty((), dtype=dtype).element_size()
    latent = sum(x.kv_elems_per_token() for x in layers) * elem
    full = sum(x.m.full_kv_elems_per_token for x in layers) * elem
    return {
        "layers": len(layers),
        "latent_bytes_per_token": latent,
        "full_kv_bytes_per_token": full,
        "ratio": full / latent if latent else None,
    }


def eager_case(model_dir: str, cfg: dict, args: argparse.Namespace, ref: list | None) -> dict:
    """enforce_eager: the greedy check against the graph run, and the plain eager step."""
    llm = moe.make_llm(model_dir, args, enforce_eager=True, max_num_seqs=max(args.spec_batches))
    tokens = moe.greedy(llm, cfg["vocab_size"], args.check_tokens)
    rows = [
        {"batch": b, **measure(llm.engine, b, args.steps, moe.PROMPT_LEN, cfg["vocab_size"])}
        for b in args.spec_batches
    ]
    del llm
    if ref is None:
        check = "FAIL (no CUDA-graph tokens to compare)"
    else:
        first = next((i for i, (a, b) in enumerate(zip(tokens, ref)) if a != b), None)
        check = "OK" if tokens == ref else f"FAIL (first difference at token {first})"
    return {"check": check, "eager": tokens, "graphs": ref, "rows": rows}


# (label, K, MTP layers of the checkpoint, engine keywords)
SPEC_CASES: list[tuple[str, int, int, dict[str, Any]]] = [
    ("mtp graphs", 1, 1, {}),
    ("mtp eager", 1, 1, {"enforce_eager": True}),
    ("mtp graphs", 3, 1, {}),
    ("mtp eager", 3, 1, {"enforce_eager": True}),
    ("multi graphs", 3, MTP_LAYERS, {"draft_graph_mode": "auto"}),
    ("multi draft-eager", 3, MTP_LAYERS, {"draft_graph_mode": "eager"}),
    ("multi eager", 3, MTP_LAYERS, {"enforce_eager": True}),
]


def print_table(result: dict) -> None:
    bw = result["copy_bandwidth_GBs"]
    m = result["models"][0]
    print(f"\n{result['device']}; copy bandwidth {_ms(bw)} GB/s; {m['name']}")
    for note in result["notes"]:
        print(note)
    kv = result["kv"]
    if kv.get("status", "ok") == "ok":
        print(
            f"KV per token ({kv['layers']} layers): latent {kv['latent_bytes_per_token'] / 1024:.1f}"
            f" KiB vs full per-head K/V {kv['full_kv_bytes_per_token'] / 1024:.1f} KiB "
            f"({kv['ratio']:.1f}x smaller)"
        )
    print(
        f"\n{'B':>3} {'floor ms':>9} {'step ms':>8} {'wall ms':>8} {'of floor':>9} {'graph ms':>9} "
        f"{'of floor':>9} {'tok/s':>8} {'GB/step':>8}"
    )
    p = m["plain"]
    if p["status"] != "ok":
        print(f"plain: {p['status']}")
    for r in p.get("rows", []):
        print(
            f"{r['batch']:>3} {_ms(r['floor_ms']):>9} {r['ms_per_step']:>8.2f} "
            f"{r.get('wall_ms_per_step', 0):>8.2f} {_pct(r['pct_of_floor']):>9} {_ms(r['graph_ms']):>9} "
            f"{_pct(r['graph_pct_of_floor']):>9} {r['tok_s']:>8.0f} "
            f"{r['bytes']['total'] / 1e9:>8.2f}"
        )
    plain = {("graphs", r["batch"]): r["ms_per_step"] for r in p.get("rows", [])}
    plain |= {("eager", r["batch"]): r["ms_per_step"] for r in m["check"].get("rows", [])}
    print(f"\nspeculative steps (synthetic acceptance {result['acceptance']}; x plain: against")
    print("the plain step of the same mode, graphs or enforce_eager)")
    print(
        f"{'case':>18} {'K':>2} {'MTP':>4} {'B':>3} {'plain ms':>9} {'spec ms':>8} "
        f"{'x plain':>8} {'draft ms':>9} {'tokens/step':>12}"
    )
    for s in m["spec"]:
        if s["status"] != "ok":
            print(f"{s['case']:>18} {s['k']:>2} {s['mtp_layers']:>4} {'':>3} {s['status']}")
            continue
        mode = "eager" if s["case"].endswith(" eager") else "graphs"
        for r in s["rows"]:
            base = plain.get((mode, r["batch"]))
            ratio = f"{r['ms_per_step'] / base:.2f}x" if base else "-"
            print(
                f"{s['case']:>18} {s['k']:>2} {s['mtp_layers']:>4} {r['batch']:>3} "
                f"{_ms(base):>9} {r['ms_per_step']:>8.2f} {ratio:>8} {r['draft_ms']:>9.2f} "
                f"{r['tokens_per_step']:>12.2f}"
            )
    by = {(s["case"], s["k"]): s for s in m["spec"] if s["status"] == "ok"}
    g, e = by.get(("multi graphs", 3)), by.get(("multi draft-eager", 3))
    if g and e:
        dg, de = g["rows"][0]["draft_ms"], e["rows"][0]["draft_ms"]
        if dg and de:
            print(
                f"multi-layer MTP chain (K=3, B={g['rows'][0]['batch']}): captured "
                f"{dg:.2f} ms vs eager {de:.2f} ms of drafting ({de / dg:.2f}x)"
            )
    r1 = next((r for r in p.get("rows", []) if r["batch"] == 1), None)
    if r1 and r1["pct_of_floor"]:
        verdict = "meets" if r1["pct_of_floor"] >= TARGET else "SHORT of"
        print(
            f"batch-1 decode at {_pct(r1['pct_of_floor'])} of the active-weight floor "
            f"(graph replay {_pct(r1['graph_pct_of_floor'])}), {verdict} the "
            f"{100 * TARGET:.0f}% target"
        )
    what = "CUDA graphs == eager" if result["device"] != "cpu" else "eager == eager (CPU)"
    c = m["check"]
    print(f"check: greedy {what}: {c.get('check', c['status'])}")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a shorter run (smaller budget)")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU")
    ap.add_argument("--batches", default=None, help="plain decode batches (default 1,16,64)")
    ap.add_argument("--spec-batches", default=None, help="speculative batches (default 1)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 24)")
    ap.add_argument("--layers", type=int, default=None, help="default: as many as fit")
    ap.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="seconds after start past which no configuration starts (default 420, --quick "
        "380: the run ends inside 9 / 8 minutes)",
    )
    args = ap.parse_args()
    quick, smoke = args.quick, args.cpu_smoke
    args.batches = [int(x) for x in (args.batches or ("1,4" if smoke else "1,16,64")).split(",")]
    args.spec_batches = [int(x) for x in (args.spec_batches or "1").split(",")]
    args.steps = args.steps or (4 if smoke else 24)  # 24 in --quick too (moe_decode.py)
    args.check_tokens = 8 if smoke else 16
    args.device = "cpu" if smoke else "cuda"
    args.dtype = "float32" if smoke else "bfloat16"
    args.min_s = 0.0 if smoke else moe.MIN_CASE_S / 2
    args.budget_s = args.budget_s or (380.0 if quick else 420.0)
    args.deadline = moe.T0 + args.budget_s
    return args


def main() -> None:
    args = parse_args()
    out_dir = results_dir()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --cpu-smoke for the CPU code paths")
    torch.backends.cuda.matmul.allow_tf32 = True
    smoke = args.cpu_smoke
    cfg = {**GLM47_FLASH, **TINY_MLA} if smoke else dict(GLM47_FLASH)
    notes = []
    if smoke:
        notes.append("--cpu-smoke: tiny shapes on the CPU (float32); times are not meaningful")
    else:
        gpu_bytes = torch.cuda.get_device_properties(0).total_memory
        n, note = moe.fit_layers(cfg, gpu_bytes, MTP_LAYERS)
        if args.layers:
            n, note = args.layers, f"{args.layers} of 47 layers (--layers)"
        cfg["num_hidden_layers"] = n
        notes.append(f"GLM-4.7-Flash shape: {note}")
    notes.append(
        "floor at batch B: routed experts read = expected distinct experts under uniform "
        "random routing, E * (1 - (1 - k/E)^B) a layer; KV = the latent rows of the context"
    )
    log(f"device {args.device}; {notes[0]}")
    bw_before = copy_bandwidth() if args.device == "cuda" else None
    dirs = {
        n_mtp: write_config(
            {**cfg, "num_nextn_predict_layers": n_mtp}, tempfile.mkdtemp(prefix="mla-dummy-")
        )
        for n_mtp in (1, MTP_LAYERS)
    }
    dtype = torch.float32 if smoke else torch.bfloat16
    name = "GLM-4.7-Flash"
    res: dict[str, Any] = {
        "name": name,
        "layers": cfg["num_hidden_layers"],
        "experts": cfg["n_routed_experts"],
        "top_k": cfg["num_experts_per_tok"],
        "config": cfg,
        "plain": {"status": "not run"},
        "check": {"status": "not run"},
        "spec": [],
    }
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "command": " ".join(sys.argv),
        "copy_bandwidth_GBs": bw_before / 1e9 if bw_before else None,
        "quick": args.quick,
        "acceptance": moe.ACCEPTANCE,
        "notes": notes,
        "kv": kv_layout(cfg, dtype),
        "models": [res],
    }
    path = os.path.join(out_dir, "mla_decode.json")

    def save() -> None:  # after every configuration: a run cut off keeps what it measured
        moe.add_floors(result, bw_before)
        with open(path, "w") as f:
            json.dump(result, f, indent=1)

    res["plain"] = guarded(
        f"{name} plain",
        lambda: moe.plain_case(name, dirs[1], cfg, args),
        args.deadline,
        args.min_s,
    )
    save()
    ref = res["plain"].get("greedy")
    res["check"] = guarded(
        f"{name} eager", lambda: eager_case(dirs[1], cfg, args, ref), args.deadline, args.min_s
    )
    log(f"CUDA graphs == eager: {res['check'].get('check', res['check']['status'])}")
    save()
    for label, k, n_mtp, kw in SPEC_CASES:
        tag = f"{name} {label} K={k}"
        spec = {"method": "mtp", "num_speculative_tokens": k}
        r = guarded(
            tag,
            lambda d=dirs[n_mtp], spec=spec, tag=tag, kw=kw: moe.spec_case(
                tag, d, cfg, spec, args, **kw
            ),
            args.deadline,
            args.min_s,
        )
        res["spec"].append({"case": label, "k": k, "mtp_layers": n_mtp, **kw, **r})
        save()
    bw_after = copy_bandwidth() if args.device == "cuda" else None
    bw = max(bw_before, bw_after) if bw_before and bw_after else None
    result["copy_bandwidth_GBs"] = bw / 1e9 if bw else None
    moe.add_floors(result, bw)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    log(f"wrote {path}")
    print_table(result)


if __name__ == "__main__":
    main()
