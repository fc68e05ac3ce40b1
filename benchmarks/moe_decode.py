"""MoE decode against the active-weight floor, and the cost of MTP / EAGLE-3 speculative steps.

Random bf16 weights (load_format="dummy") at real shapes: Qwen3-30B-A3B (48 layers, 128 experts,
top-8) and a GLM-4.5-Air-shaped model (128 routed experts + 1 shared, top-8, one MTP layer) with
as many of its 46 layers as fit one GPU next to the MTP layer (the full model is ~212 GB). In
one process, each configuration caught on its own (an OOM or error is a table row, not a crash):

  check   greedy tokens of a short generation with CUDA graphs == with enforce_eager=True
  plain   decode ms/step at batch 1, 16, 64 (engine defaults: async scheduling, CUDA graphs),
          the batch-1 decode graph's replay time, and the step's floor: the bytes one step
          reads (attention, norms, routers, shared experts, dense MLP layers, lm_head and the
          routed experts the batch chose, the embedding rows, the KV of the context) over the
          device-to-device copy bandwidth measured in this run (benchmarks/decode.py). At batch
          B the experts read per MoE layer are the expected distinct ones under uniform random
          routing, E * (1 - (1 - k/E)^B): k at batch 1, ~82 of 128 at 16, ~128 at 64.
  spec    ms per speculative step (synthetic acceptance 0.7, so the step's shape does not
          depend on trained weights) against the plain step: GLM MTP K=1 and K=3, Qwen3-MoE
          with a random EAGLE-3 head (the project's layout, 32000-token draft vocabulary) K=3.

    python benchmarks/moe_decode.py            # < 9 min on one H100; $OUT/moe_decode.json
    python benchmarks/moe_decode.py --quick    # batch 1 only, fewer configurations
    python benchmarks/moe_decode.py --cpu-smoke  # tiny shapes on the CPU: the code paths only
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import out_dir as results_dir  # noqa: E402
from decode import copy_bandwidth, time_graph, write_config  # noqa: E402
from spec_step import EAGLE3_HEAD, measure  # noqa: E402

# Published config.json of Qwen/Qwen3-30B-A3B (the keys specserve and transformers read).
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "attention_bias": False,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}
# zai-org/GLM-4.5-Air's config.json (46 layers: 1 dense + 45 MoE, then 1 MTP layer).
GLM45_AIR = {
    "architectures": ["Glm4MoeForCausalLM"],
    "model_type": "glm4_moe",
    "hidden_size": 4096,
    "intermediate_size": 10944,
    "moe_intermediate_size": 1408,
    "num_hidden_layers": 46,
    "num_attention_heads": 96,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "n_routed_experts": 128,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.0,
    "first_k_dense_replace": 1,
    "num_nextn_predict_layers": 1,
    "partial_rotary_factor": 0.5,
    "attention_bias": True,
    "use_qk_norm": False,
    "vocab_size": 151552,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "eos_token_id": [151329, 151336, 151338],
}
# An EAGLE-3 head for Qwen3-30B-A3B in the project's layout (one 2048-wide Llama layer).
QWEN3_MOE_EAGLE3 = {
    **EAGLE3_HEAD,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "vocab_size": 151936,
    "draft_vocab_size": 32000,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
}
# --cpu-smoke: every model at 2 layers, hidden 64, 8 experts (top-2), a 512-token vocabulary.
TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_experts_per_tok": 2,
    "vocab_size": 512,
    "max_position_embeddings": 2048,
}
ACCEPTANCE = 0.7
PROMPT_LEN = 128
# Seconds an engine build and its timings need at least (GPU); a case that would start with
# less left of --budget-s is skipped and says so.
MIN_CASE_S = 60
TARGET = 0.75  # the goal: batch-1 decode at >= 75% of the active-weight floor
# MXFP4 (gpt-oss checkpoints): 4-bit values and one 8-bit scale per 32 of them.
MXFP4_BITS = 4.25


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


T0 = time.perf_counter()


def tiny(cfg: dict, experts_key: str | None = None) -> dict:
    out = {**cfg, **TINY, **({experts_key: 8} if experts_key else {})}
    if "draft_vocab_size" in cfg:
        out.update(num_hidden_layers=1, draft_vocab_size=128)
    return out


def model_bytes(cfg: dict, num_layers: int, **kw: Any) -> int:
    """Parameter bytes of the target at `num_layers` layers (built on the meta device; `kw`
    to from_config_dict, e.g. gpt-oss's keep_mxfp4)."""
    from specserve.models.registry import default_dtype, resolve_architecture

    c = {**cfg, "num_hidden_layers": num_layers}
    with torch.device("meta"), default_dtype(torch.bfloat16):
        m = resolve_architecture(c, "").from_config_dict(c, 4096, **kw)
    return sum(p.numel() * p.element_size() for p in m.parameters())


def fit_layers(
    cfg: dict, gpu_bytes: int, mtp_layers: int = 1, share: float = 0.72
) -> tuple[int, str]:
    """The most layers whose weights, plus `mtp_layers` more MoE layers for MTP, take <= `share`
    of the GPU (the rest: KV cache, activations, logits, the CUDA context)."""
    dense = cfg["first_k_dense_replace"]
    base = model_bytes(cfg, dense + 1)
    per_moe = model_bytes(cfg, dense + 2) - base
    total = cfg["num_hidden_layers"]
    full = base + (total - dense - 1 + mtp_layers) * per_moe
    n = dense + 1 + int((share * gpu_bytes - base - mtp_layers * per_moe) // per_moe)
    n = max(dense + 1, min(n, total))
    note = (
        f"{n} of {total} layers ({dense} dense), + {mtp_layers} MTP layer(s): "
        f"{(base + (n - dense - 1 + mtp_layers) * per_moe) / 1e9:.0f} GB of bf16 weights (full "
        f"model with MTP {full / 1e9:.0f} GB; GPU {gpu_bytes / 1e9:.0f} GB)"
    )
    return n, note


def expected_distinct(num_experts: int, top_k: int, batch: int) -> float:
    """Distinct experts `batch` tokens choose, each k of E uniformly at random."""
    return num_experts * (1 - (1 - top_k / num_experts) ** batch)


def step_bytes(model: nn.Module, batch: int, context: int) -> dict[str, float]:
    """Bytes one decode step of `batch` requests at `context` tokens each must read: every
    parameter but the routed experts and the embedding table (shared experts too where
    models/moe.py stacks them with the routed ones: every token reads them), the routed
    experts the batch chose (expected distinct ones per layer, biases included, matrices as
    loaded: bf16, or MXFP4's blocks + scales where models/moe.py Mxfp4Experts keeps them
    4-bit), one embedding row a token and the KV. `routed_experts_mxfp4` / `total_mxfp4`: the
    same with the expert matrices at MXFP4's 4.25 bits a weight (biases as loaded), gpt-oss's
    checkpoint format; equal to `routed_experts` / `total` for 4-bit experts."""
    from specserve.models.layers import KVCacheLayer
    from specserve.models.moe import SparseMoE

    routed: set[int] = set()
    experts = experts_mxfp4 = shared = 0.0
    for m in model.modules():
        if isinstance(m, SparseMoE):
            e = m.experts
            params = dict(e.named_parameters())
            biases = [p for name, p in params.items() if name.endswith("_bias")]
            mats = [p for name, p in params.items() if not name.endswith("_bias")]
            routed |= {id(t) for t in params.values()}
            stored = sum(t[0].numel() * t.element_size() for t in mats)
            weights_per_expert = 3 * e.intermediate_size * m.gate.weight.shape[1]
            bias = sum(b[0].numel() * b.element_size() for b in biases)
            n = expected_distinct(m.gate.m.num_experts, m.gate.m.top_k, batch)
            experts += n * (stored + bias)
            shared += len(m.shared_slots) * (stored + bias)
            experts_mxfp4 += n * (weights_per_expert * MXFP4_BITS / 8 + bias)
    embed = model.model.embed_tokens.weight  # type: ignore[union-attr]
    tied = embed is model.lm_head.weight  # type: ignore[union-attr]
    weights = shared + sum(
        p.numel() * p.element_size()
        for p in model.parameters()
        if id(p) not in routed and (tied or p is not embed)
    )
    rows = batch * embed.shape[1] * embed.element_size()
    elem = embed.element_size()
    kv = sum(
        batch * context * m.kv_elems_per_token() * elem
        for m in model.modules()
        if isinstance(m, KVCacheLayer)
    )
    return {
        "weights": weights,
        "routed_experts": experts,
        "embed_rows": rows,
        "kv": kv,
        "total": weights + experts + rows + kv,
        "routed_experts_mxfp4": experts_mxfp4,
        "total_mxfp4": weights + experts_mxfp4 + rows + kv,
    }


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def guarded(label: str, fn: Callable[[], dict], deadline: float, min_s: float) -> dict:
    """Run one configuration: its result, or {"status": "OOM" | "error: ..." | "skipped ..."}."""
    left = deadline - time.perf_counter()
    if left < min_s:
        log(f"{label}: skipped ({left:.0f} s left of the budget)")
        return {"status": f"skipped ({left:.0f} s left)"}
    log(f"{label}: start")
    t = time.perf_counter()
    try:
        out = {"status": "ok", **fn()}
    except torch.cuda.OutOfMemoryError as e:
        out = {"status": "OOM", "detail": str(e).splitlines()[0][:200]}
    except Exception as e:  # noqa: BLE001 - one failed configuration must not end the run
        first = (str(e).splitlines() or [""])[0][:160]
        oom = "out of memory" in str(e).lower() or "no GPU memory left" in str(e)
        out = {"status": "OOM" if oom else f"error: {type(e).__name__}: {first}"}
        if not oom:  # where it failed, for whoever reads the log
            traceback.print_exc(limit=-8, file=sys.stdout)
    free_memory()
    out["seconds"] = time.perf_counter() - t
    log(f"{label}: {out['status']} ({out['seconds']:.0f} s)")
    return out


def make_llm(model_dir: str, args: argparse.Namespace, **kw: Any) -> Any:
    from specserve import LLM

    kw.setdefault("max_num_seqs", max(args.batches))
    # Step timings here follow warm steps of the batch they time; the start-up warm-up of every
    # shape would only lengthen each of the engines a run builds (10-minute device calls).
    kw.setdefault("warmup", False)
    kw.setdefault("mxfp4_experts", getattr(args, "mxfp4_experts", "auto"))
    return LLM(
        model_dir,
        dtype=args.dtype,
        device=args.device,
        load_format="dummy",
        max_model_len=1024,
        max_num_batched_tokens=2048,
        gpu_memory_utilization=0.95,
        **kw,
    )


def greedy(llm: Any, vocab: int, new_tokens: int) -> list[int]:
    from specserve import SamplingParams

    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, vocab, (32,), generator=g).tolist()
    sp = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)
    return list(out[0].outputs[0].token_ids)


def plain_case(name: str, model_dir: str, cfg: dict, args: argparse.Namespace) -> dict:
    """Greedy tokens (CUDA graphs) and decode step times at each batch size."""
    llm = make_llm(model_dir, args)
    engine = llm.engine
    tokens = greedy(llm, cfg["vocab_size"], args.check_tokens)
    rows = []
    for b in args.batches:
        r = measure(engine, b, args.steps, PROMPT_LEN, cfg["vocab_size"])
        context = PROMPT_LEN + 4 + args.steps // 2  # mean context over the timed steps
        r["bytes"] = step_bytes(engine.model, b, context)
        r["graph_ms"] = time_graph(engine, b) if engine.runner.cudagraphs else None
        rows.append({"batch": b, **r})
        log(
            f"  {name} B={b}: {r['ms_per_step']:.2f} ms/step (wall {r['wall_ms_per_step']:.2f}), graph {r['graph_ms']} ms"
        )
    del llm, engine
    return {"greedy": tokens, "rows": rows}


def eager_check(model_dir: str, cfg: dict, args: argparse.Namespace, ref: list | None) -> dict:
    llm = make_llm(model_dir, args, enforce_eager=True, max_num_seqs=1)
    tokens = greedy(llm, cfg["vocab_size"], args.check_tokens)
    del llm
    if ref is None:
        return {"check": "FAIL (no CUDA-graph tokens to compare)", "eager": tokens}
    same = tokens == ref
    first = next((i for i, (a, b) in enumerate(zip(tokens, ref)) if a != b), None)
    return {
        "check": "OK" if same else f"FAIL (first difference at token {first})",
        "eager": tokens,
        "graphs": ref,
    }


def spec_case(
    name: str, model_dir: str, cfg: dict, spec: dict, args: argparse.Namespace, **kw: Any
) -> dict:
    """ms per speculative step at each of args.spec_batches; `kw` goes to the engine
    (enforce_eager, draft_graph_mode)."""
    # A fixed K: the adaptive draft budget (the engine's default) would choose its own.
    spec = {
        **spec,
        "rejection_sample_method": "synthetic",
        "synthetic_acceptance_rate": ACCEPTANCE,
        "adaptive": False,
    }
    kw.setdefault("max_num_seqs", max(args.spec_batches))
    llm = make_llm(model_dir, args, speculative_config=spec, **kw)
    rows = []
    for b in args.spec_batches:
        r = measure(llm.engine, b, args.steps, PROMPT_LEN, cfg["vocab_size"])
        rows.append({"batch": b, **r})
        log(f"  {name} B={b}: {r['ms_per_step']:.2f} ms/step, draft {r['draft_ms']:.2f} ms")
    del llm
    return {"rows": rows}


def run_model(
    res: dict,
    cfg: dict,
    specs: list[tuple[str, dict]],
    args: argparse.Namespace,
    save: Callable[[], None],
) -> None:
    """Every configuration of one model into `res`, saving the JSON after each."""
    name = res["name"]
    model_dir = write_config(cfg, tempfile.mkdtemp(prefix="moe-dummy-"))
    res["plain"] = guarded(
        f"{name} plain", lambda: plain_case(name, model_dir, cfg, args), args.deadline, args.min_s
    )
    save()
    ref = res["plain"].get("greedy")
    res["check"] = guarded(
        f"{name} eager check",
        lambda: eager_check(model_dir, cfg, args, ref),
        args.deadline,
        args.min_s,
    )
    log(f"{name}: CUDA graphs == eager: {res['check'].get('check', res['check']['status'])}")
    save()
    for label, spec in specs:
        k = spec["num_speculative_tokens"]
        tag = f"{name} {label} K={k}"
        r = guarded(
            tag,
            lambda spec=spec, tag=tag: spec_case(tag, model_dir, cfg, spec, args),
            args.deadline,
            args.min_s,
        )
        res["spec"].append({"drafter": label, "k": k, **r})
        save()


def add_floors(result: dict, bw: float | None) -> None:
    """Floor ms (bytes / copy bandwidth) and the share of it each timing reached."""
    for m in result["models"]:
        for r in m["plain"].get("rows", []):
            r["experts_per_layer"] = expected_distinct(m["experts"], m["top_k"], r["batch"])
            r["floor_ms"] = 1e3 * r["bytes"]["total"] / bw if bw else None
            r["pct_of_floor"] = r["floor_ms"] / r["ms_per_step"] if bw else None
            g = r["graph_ms"]
            r["graph_pct_of_floor"] = r["floor_ms"] / g if bw and g else None
            r["floor_mxfp4_ms"] = 1e3 * r["bytes"]["total_mxfp4"] / bw if bw else None


def _pct(x: float | None) -> str:
    return f"{100 * x:.1f}%" if x else "-"


def _ms(x: float | None) -> str:
    return f"{x:.2f}" if x else "-"


def print_plain_table(result: dict, mxfp4: bool = False) -> None:
    """Plain decode per model and batch against the floor; `mxfp4`: with the floor the step
    would have with the experts read at MXFP4's 4.25 bits."""
    bw = result["copy_bandwidth_GBs"]
    print(f"\n{result['device']}; copy bandwidth {_ms(bw)} GB/s (read + write, best of before")
    print("and after the engines); engine defaults (async scheduling, CUDA graphs)")
    print(
        "step ms: device time a step in a running loop (CUDA events; spec_step.measure); "
        "wall ms: the wall clock over the same loop, its start included"
    )
    for note in result["notes"]:
        print(note)
    extra = f" {'mxfp4 fl':>9} {'of it':>7}" if mxfp4 else ""
    print(
        f"\n{'model':>14} {'B':>3} {'floor ms':>9} {'step ms':>8} {'wall ms':>8} {'of floor':>9} "
        f"{'graph ms':>9} {'of floor':>9} {'tok/s':>8} {'GB/step':>8} {'experts':>8}" + extra
    )
    for m in result["models"]:
        p = m["plain"]
        if p["status"] != "ok":
            print(f"{m['name']:>14} {'':>3} {p['status']}")
            continue
        for r in p["rows"]:
            fl = r.get("floor_mxfp4_ms")
            of_it = _pct(fl / r["ms_per_step"]) if fl else "-"
            print(
                f"{m['name']:>14} {r['batch']:>3} {_ms(r['floor_ms']):>9} "
                f"{r['ms_per_step']:>8.2f} {r.get('wall_ms_per_step', 0):>8.2f} "
                f"{_pct(r['pct_of_floor']):>9} "
                f"{_ms(r['graph_ms']):>9} {_pct(r['graph_pct_of_floor']):>9} "
                f"{r['tok_s']:>8.0f} {r['bytes']['total'] / 1e9:>8.2f} "
                f"{r['experts_per_layer']:>8.1f}" + (f" {_ms(fl):>9} {of_it:>7}" if mxfp4 else "")
            )


def print_spec_table(result: dict) -> None:
    """Speculative step cost per model, drafter, K and batch against the plain step."""
    print(f"(experts: routed experts read per MoE layer; acceptance {result['acceptance']}:")
    print(" tokens/step and speedup = plain ms x tokens/step / spec ms are at that rate)")
    print(
        f"{'model':>14} {'drafter':>7} {'K':>2} {'B':>3} {'plain ms':>9} {'spec ms':>8} "
        f"{'x plain':>8} {'draft ms':>9} {'tokens/step':>12} {'speedup':>8}"
    )
    for m in result["models"]:
        plain = {r["batch"]: r["ms_per_step"] for r in m["plain"].get("rows", [])}
        for s in m["spec"]:
            if s["status"] != "ok":
                print(f"{m['name']:>14} {s['drafter']:>7} {s['k']:>2} {'':>3} {s['status']}")
                continue
            for r in s["rows"]:
                p = plain.get(r["batch"])
                ratio = f"{r['ms_per_step'] / p:.2f}x" if p else "-"
                speedup = f"{p * r['tokens_per_step'] / r['ms_per_step']:.2f}x" if p else "-"
                print(
                    f"{m['name']:>14} {s['drafter']:>7} {s['k']:>2} {r['batch']:>3} "
                    f"{_ms(p):>9} {r['ms_per_step']:>8.2f} {ratio:>8} "
                    f"{r['draft_ms']:>9.2f} {r['tokens_per_step']:>12.2f} {speedup:>8}"
                )


def print_verdicts(result: dict, target: float = TARGET) -> None:
    """Batch-1 decode against the floor's target, and the greedy check, per model."""
    for m in result["models"]:
        r1 = next((r for r in m["plain"].get("rows", []) if r["batch"] == 1), None)
        if r1 and r1["pct_of_floor"]:
            verdict = "meets" if r1["pct_of_floor"] >= target else "SHORT of"
            print(
                f"{m['name']}: batch-1 decode at {_pct(r1['pct_of_floor'])} of the active-weight "
                f"floor, {verdict} the {100 * target:.0f}% target"
            )
    what = "CUDA graphs == eager" if result["device"] != "cpu" else "eager == eager (CPU)"
    for m in result["models"]:
        c = m["check"]
        print(f"check {m['name']}: greedy {what}: {c.get('check', c['status'])}")


def print_tables(result: dict) -> None:
    print_plain_table(result)
    print_spec_table(result)
    print_verdicts(result)


def common_args(ap: argparse.ArgumentParser, budget_s: float = 440.0) -> None:
    """The flags every MoE decode benchmark shares (this script, gpt_oss_decode.py)."""
    ap.add_argument(
        "--quick", action="store_true", help="batch 1 only, fewer configurations and graphs"
    )
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU")
    ap.add_argument("--batches", default=None, help="plain decode batches (default 1,16,64)")
    ap.add_argument("--spec-batches", default=None, help="speculative batches (default 1,16)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 24)")
    ap.add_argument(
        "--budget-s",
        type=float,
        default=budget_s,
        help=f"seconds after start past which no configuration starts (default {budget_s:.0f})",
    )


def finish_args(args: argparse.Namespace) -> argparse.Namespace:
    """The settings `common_args`' flags imply (device, dtype, steps, deadline, ...)."""
    quick, smoke = args.quick, args.cpu_smoke
    args.batches = [int(x) for x in (args.batches or ("1" if quick else "1,16,64")).split(",")]
    default_spec = "1" if quick else "1,16"
    args.spec_batches = [int(x) for x in (args.spec_batches or default_spec).split(",")]
    # 24 timed steps in --quick too: a timing pays the first launch's host latency once, 1/24
    # of a step at most (spec_step.measure), and steps are milliseconds.
    args.steps = args.steps or (6 if smoke else 24)
    args.check_tokens = 8 if smoke else 16
    args.device = "cpu" if smoke else "cuda"
    args.dtype = "float32" if smoke else "bfloat16"
    args.min_s = 0.0 if smoke else MIN_CASE_S
    args.deadline = T0 + args.budget_s
    return args


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common_args(ap)
    ap.add_argument("--models", default="qwen3,glm", help="qwen3 and/or glm")
    ap.add_argument("--glm-layers", type=int, default=None, help="default: as many as fit")
    args = finish_args(ap.parse_args())
    unknown = set(args.models.split(",")) - {"qwen3", "glm"}
    if unknown:
        ap.error(f"--models: unknown {', '.join(sorted(unknown))} (choose qwen3 and/or glm)")
    return args


# (name, config, [(drafter label, speculative_config)], config key of the expert count)
Plan = tuple[str, dict, list[tuple[str, dict]], str]


def start(args: argparse.Namespace) -> None:
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --cpu-smoke for the CPU code paths")
    torch.backends.cuda.matmul.allow_tf32 = True


def run_plans(
    args: argparse.Namespace,
    plans: list[Plan],
    notes: list[str],
    json_name: str,
    bw_before: float | None,
) -> dict:
    """Every plan's configurations (run_model), the JSON under $OUT saved after each, the copy
    bandwidth measured again at the end; the result."""
    out_dir = results_dir()
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "command": " ".join(sys.argv),
        "copy_bandwidth_GBs": bw_before / 1e9 if bw_before else None,
        "quick": args.quick,
        "acceptance": ACCEPTANCE,
        "notes": notes,
        "models": [],
    }
    path = os.path.join(out_dir, json_name)

    def save() -> None:  # after every configuration: a run cut off keeps what it measured
        add_floors(result, bw_before)
        with open(path, "w") as f:
            json.dump(result, f, indent=1)

    for name, cfg, specs, experts_key in plans:
        res = {
            "name": name,
            "layers": cfg["num_hidden_layers"],
            "experts": cfg[experts_key],
            "top_k": cfg["num_experts_per_tok"],
            "config": cfg,
            "plain": {"status": "not run"},
            "check": {"status": "not run"},
            "spec": [],
        }
        result["models"].append(res)
        run_model(res, cfg, specs, args, save)
    bw_after = copy_bandwidth() if args.device == "cuda" else None
    bw = max(bw_before, bw_after) if bw_before and bw_after else None
    result["copy_bandwidth_GBs"] = bw / 1e9 if bw else None
    result["copy_bandwidth_before_after_GBs"] = [
        x / 1e9 if x else None for x in (bw_before, bw_after)
    ]
    add_floors(result, bw)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    log(f"wrote {path}")
    return result


def main() -> None:
    args = parse_args()
    start(args)
    smoke = args.cpu_smoke
    qwen = tiny(QWEN3_30B_A3B, "num_experts") if smoke else dict(QWEN3_30B_A3B)
    glm = tiny(GLM45_AIR, "n_routed_experts") if smoke else dict(GLM45_AIR)
    head = tiny(QWEN3_MOE_EAGLE3) if smoke else dict(QWEN3_MOE_EAGLE3)
    notes = []
    if not smoke:
        gpu_bytes = torch.cuda.get_device_properties(0).total_memory
        n, note = fit_layers(glm, gpu_bytes)
        if args.glm_layers:
            n, note = args.glm_layers, f"{args.glm_layers} of 46 layers (--glm-layers)"
        glm["num_hidden_layers"] = n
        notes.append(f"GLM-4.5-Air shape: {note}")
    else:
        notes.append("--cpu-smoke: tiny shapes on the CPU (float32); times are not meaningful")
    notes.append(
        "floor at batch B: routed experts read = expected distinct experts under uniform "
        "random routing, E * (1 - (1 - k/E)^B) a layer (dummy routers are near uniform)"
    )
    log(f"device {args.device}; {'; '.join(notes[:1])}")
    bw_before = copy_bandwidth() if args.device == "cuda" else None
    head_dir = write_config(head, tempfile.mkdtemp(prefix="qwen3-moe-eagle3-"))
    plans: dict[str, Plan] = {
        "qwen3": (
            "Qwen3-30B-A3B",
            qwen,
            [("eagle3", {"method": "eagle3", "model": head_dir, "num_speculative_tokens": 3})],
            "num_experts",
        ),
        "glm": (
            "GLM-4.5-Air",
            glm,
            [("mtp", {"method": "mtp", "num_speculative_tokens": k}) for k in (1, 3)],
            "n_routed_experts",
        ),
    }
    chosen = [plans[key] for key in args.models.split(",")]
    print_tables(run_plans(args, chosen, notes, "moe_decode.json", bw_before))


if __name__ == "__main__":
    main()
