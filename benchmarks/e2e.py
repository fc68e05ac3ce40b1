"""End to end on the GPU reference family: tokens/s per method, PTD vs autoregressive, batch 64.

Builds the GPU reference family first (benchmarks/build_family.py --family gpu, cached in
--family-dir: a later run on the same machine reuses it; --skip-build uses it as it is). Runs:
  1. batch 1, greedy, held-out code prompts: output tokens/s and mean acceptance length (tau) of
     plain decode and of every drafter (K = 5), and the check tok/s(EAGLE-3) >= 0.8 tau plain;
  2. the same prompts under transformers: plain `generate` and assisted generation with a small
     draft LM of the same tokenizer (trained here in about a minute, cached), and specserve's
     draft_model method with that same pair;
  3. PTD vs autoregressive EAGLE-3 at K = 2..8, batch 1: tokens/s and drafting ms per step;
  4. 64 concurrent requests: tokens/s without speculation, with EAGLE-3 K = 5, and the adaptive
     budget;
  5. draft trees (`--parts trees`), batch 1: plain, EAGLE-3 chains K = 2..6 and EAGLE-2 trees of
     8 / 16 / 32 / 64 verified tokens (fixed sizes, adaptive budget off), tokens/s and tau, and
     the best tree's tokens/s over the best chain's; with synchronous steps, then with async
     scheduling.

    python benchmarks/e2e.py                    # $OUT/e2e.json, table last
    python benchmarks/e2e.py --parts methods,batch64 --skip-build   # the family already built
    python benchmarks/e2e.py --parts trees --methods eagle3   # trees: the EAGLE-3 head only
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import write_json  # noqa: E402

MAX_TOKENS = 128


def free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def prompts(n: int) -> list[str]:
    from specserve.data import load_prompts

    return [r["prompt"] for r in load_prompts("code", n)]


def draft_lm(family: str) -> str:
    """A 4-layer 256-wide LM on the family's tokens: the assistant for the draft_model pair."""
    import numpy as np

    from specserve.train.reference import (
        ModelShape,
        TrainConfig,
        llama_config,
        save_hf,
        train_reference,
    )
    from specserve.train.tokenizer import special_ids

    out = os.path.join(family, "draft_lm")
    if os.path.isfile(os.path.join(out, "model.safetensors")):
        return out
    target = os.path.join(family, "target")
    shape = ModelShape(16384, 256, 768, 4, 4, 2, 4096)
    cfg = llama_config(shape, special_ids(target), torch.bfloat16)
    tokens = np.load(os.path.join(family, "tokens_train.npy"))
    train = TrainConfig(seq_len=512, batch_size=64, max_steps=3000, lr=2e-3, max_minutes=1.0)
    model, _ = train_reference(cfg, tokens, train, "cuda", progress=False)
    save_hf(model, cfg, out, torch.bfloat16)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(os.path.join(target, name), out)
    del model
    free()
    return out


def run_specserve(
    target: str, spec: dict | None, ps: list[str], batch1: bool = True, **llm_kw: object
) -> dict:
    from specserve import LLM, SamplingParams

    llm_kw.setdefault("async_scheduling", False)  # the `_async` rows turn it on (CUDA default)
    llm = LLM(
        target,
        max_model_len=1024,
        max_num_seqs=64 if not batch1 else 4,
        speculative_config=spec,
        **llm_kw,
    )
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    # Warm-up: Triton compiles and autotunes, allocator. A batched run warms up on the whole
    # batch: its shapes (prefill chunks, batch sizes) differ from a 2-prompt run's.
    llm.generate(ps[:2] if batch1 else ps, sp, use_tqdm=False)
    base = llm.get_metrics()
    runner = llm.engine.runner
    runner.draft_events = [] if spec and torch.cuda.is_available() else None
    sync()
    t0 = time.perf_counter()
    if batch1:
        outs = [llm.generate(p, sp, use_tqdm=False)[0] for p in ps]
    else:
        outs = llm.generate(ps, sp, use_tqdm=False)
    dt = time.perf_counter() - t0
    m = llm.get_metrics()
    toks = sum(len(o.outputs[0].token_ids) for o in outs)
    drafts = m["spec_decode_num_drafts_total"] - base["spec_decode_num_drafts_total"]
    acc = m["spec_decode_num_accepted_tokens_total"] - base["spec_decode_num_accepted_tokens_total"]
    ev = runner.draft_events or []
    res = {
        "tok_s": toks / dt,
        "tau": 1 + acc / drafts if drafts else 1.0,
        "draft_ms_per_step": sum(s.elapsed_time(e) for s, e in ev) / len(ev) if ev else 0.0,
        "tokens": toks,
        "texts": [o.outputs[0].token_ids for o in outs],
    }
    runner.draft_events = None
    budget = llm.engine.budget
    if budget is not None:  # the adaptive budget: its mean K, and its cost table per bucket
        res["mean_k"] = m["spec_decode_mean_draft_budget"]
        res["budget_ms_per_k"] = {
            b: [round(1e3 * x, 3) for x in c.t.tolist()] for b, c in sorted(budget.costs.items())
        }
    del llm
    free()
    return res


def run_hf(target: str, assistant: str | None, ps: list[str]) -> dict:
    import transformers as tf

    tok = tf.AutoTokenizer.from_pretrained(target)
    model = tf.AutoModelForCausalLM.from_pretrained(target, dtype=torch.bfloat16).cuda().eval()
    kw: dict = dict(do_sample=False, max_new_tokens=MAX_TOKENS, pad_token_id=tok.pad_token_id)
    if assistant:
        kw["assistant_model"] = (
            tf.AutoModelForCausalLM.from_pretrained(assistant, dtype=torch.bfloat16).cuda().eval()
        )
    enc = [tok(p, return_tensors="pt").input_ids.cuda() for p in ps]
    with torch.no_grad():
        model.generate(enc[0], **kw)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        toks = sum(model.generate(e, **kw).shape[1] - e.shape[1] for e in enc)
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    del model, kw
    free()
    return {"tok_s": toks / dt, "tokens": toks}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family-dir", default="/tmp/family")
    ap.add_argument("--num-prompts", type=int, default=24)
    ap.add_argument("--parts", default="methods,batch64,ptd,hf")
    ap.add_argument("--methods", default="eagle3,ptd", help="drafters to build (and measure)")
    ap.add_argument("--skip-build", action="store_true", help="use --family-dir as it is")
    args = ap.parse_args()
    fam, parts = args.family_dir, args.parts.split(",")
    if not args.skip_build:
        from build_family import main as build_family

        build_family(["--family", "gpu", "--cache", fam, "--methods", args.methods])
    target = os.path.join(fam, "target")
    d = lambda m: os.path.join(fam, "drafters", m)  # noqa: E731
    ps = prompts(args.num_prompts)
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    res: dict = {"device": dev, "num_prompts": len(ps)}
    k = 5
    methods = {
        "eagle3": {"method": "eagle3", "model": d("eagle3")},
        "eagle": {"method": "eagle", "model": d("eagle")},
        "mtp": {"method": "mtp", "model": d("mtp")},
        "ptd": {"method": "eagle3", "model": d("ptd"), "parallel_draft": True},
        "ngram": {"method": "ngram"},
    }
    if "methods" in parts:
        plain = run_specserve(target, None, ps)
        res["batch1"] = {"plain": plain}
        for name, cfg in methods.items():
            if cfg.get("model") and not os.path.isdir(cfg["model"]):
                continue
            r = run_specserve(target, {**cfg, "num_speculative_tokens": k}, ps)
            r["lossless"] = r["texts"] == plain["texts"]
            res["batch1"][name] = r
            print(f"{name:>8}: {r['tok_s']:.0f} tok/s tau {r['tau']:.2f} lossless {r['lossless']}")
        print(f"   plain: {plain['tok_s']:.0f} tok/s", flush=True)
        # Async scheduling: step N+1 launched while step N runs (same outputs).
        for name, spec in (("plain", None), ("eagle3", methods["eagle3"])):
            spec = {**spec, "num_speculative_tokens": k} if spec else None
            r = run_specserve(target, spec, ps, async_scheduling=True)
            r["lossless"] = r["texts"] == plain["texts"]
            res["batch1"][f"{name}_async"] = r
            print(f"{name}_async: {r['tok_s']:.0f} tok/s lossless {r['lossless']}", flush=True)
        save(res)
    if "hf" in parts:
        lm = draft_lm(fam)
        res["hf"] = {
            "plain": run_hf(target, None, ps),
            "assisted": run_hf(target, lm, ps),
            "specserve_draft_model": run_specserve(
                target, {"method": "draft_model", "model": lm, "num_speculative_tokens": k}, ps
            ),
        }
        print({n: round(v["tok_s"]) for n, v in res["hf"].items()}, flush=True)
        save(res)
    if "ptd" in parts and os.path.isdir(d("ptd")):
        res["ptd_sweep"] = {}
        for kk in range(2, 9):
            for name in ("eagle3", "ptd"):
                cfg = {**methods[name], "num_speculative_tokens": kk}
                r = run_specserve(target, cfg, ps[:8])
                res["ptd_sweep"][f"{name}-{kk}"] = {
                    x: r[x] for x in ("tok_s", "tau", "draft_ms_per_step")
                }
                print(
                    f"K={kk} {name}: {r['tok_s']:.0f} tok/s tau {r['tau']:.2f} draft {r['draft_ms_per_step']:.3f} ms",
                    flush=True,
                )
        save(res)
    if "batch64" in parts:
        ps64 = prompts(64)
        res["batch64"] = {}
        for name, spec in (
            ("plain", None),
            ("eagle3_k5", {**methods["eagle3"], "num_speculative_tokens": k}),
            (
                "eagle3_auto",
                {
                    **methods["eagle3"],
                    "num_speculative_tokens": k,
                    "num_speculative_tokens_per_batch_size": "auto",
                },
            ),
        ):
            r = run_specserve(target, spec, ps64, batch1=False)
            keep = ("tok_s", "tau", "mean_k", "budget_ms_per_k")
            res["batch64"][name] = {x: r[x] for x in keep if x in r}
            print(f"64 concurrent {name}: {r['tok_s']:.0f} tok/s", flush=True)
            for b, v in r.get("budget_ms_per_k", {}).items():
                print(f"  bucket {b}: ms per K {v} (mean K {r['mean_k']:.2f})")
        # Async scheduling (fixed K: the automatic controller times synchronous steps).
        for name, spec in (
            ("plain_async", None),
            ("eagle3_k5_async", {**methods["eagle3"], "num_speculative_tokens": k}),
        ):
            r = run_specserve(target, spec, ps64, batch1=False, async_scheduling=True)
            res["batch64"][name] = {x: r[x] for x in ("tok_s", "tau")}
            print(f"64 concurrent {name}: {r['tok_s']:.0f} tok/s", flush=True)
        save(res)
    if "trees" in parts:
        trees(res, target, methods["eagle3"], ps)
        save(res)
    save(res)
    print_table(res)


# verified tokens -> (drafts, topk, depth), as benchmarks/trees.py sizes them
TREES = {8: (7, 2, 3), 16: (15, 4, 4), 32: (31, 4, 6), 64: (63, 8, 6)}


def trees(res: dict, target: str, eagle3: dict, ps: list[str]) -> None:
    """Batch 1: chains K = 2..6 against trees of 8..64 verified tokens, the adaptive budget off
    (fixed shapes), each checked against plain decoding's tokens; synchronous steps (the host's
    work in series with the device's), then async scheduling (the CUDA default: the next step
    launched while this one runs). `same` counts prompts whose tokens equal plain decoding's
    (bf16: the plain step's gemv and verification's matmuls round differently, so greedy paths
    may split at near-ties)."""
    out = res["trees"] = {}
    configs = [(f"chain K={k}", {"num_speculative_tokens": k}) for k in range(2, 7)]
    for size, (n, k, d) in TREES.items():
        tree = {"num_speculative_tokens": n, "draft_tree": {"topk": k, "depth": d}}
        configs.append((f"tree {size} (topk {k}, depth {d})", tree))
    for mode, kw in (("sync", {}), ("async", {"async_scheduling": True})):
        plain = run_specserve(target, None, ps, **kw)
        out[f"plain {mode}"] = plain
        print(f"{'plain ' + mode:>32}: {plain['tok_s']:.0f} tok/s", flush=True)
        for name, extra in configs:
            r = run_specserve(target, {**eagle3, "adaptive": False, **extra}, ps, **kw)
            r["same"] = sum(a == b for a, b in zip(r["texts"], plain["texts"]))
            r["lossless"] = r["same"] == len(ps)
            out[f"{name} {mode}"] = r
            print(
                f"{name + ' ' + mode:>32}: {r['tok_s']:.0f} tok/s tau {r['tau']:.2f} "
                f"same as plain {r['same']}/{len(ps)}",
                flush=True,
            )
            save(res)
        rows = [(v["tok_s"], n) for n, v in out.items() if n.endswith(mode)]
        c, cn = max(r for r in rows if r[1].startswith("chain"))
        t, tn = max(r for r in rows if r[1].startswith("tree"))
        res.setdefault("tree_vs_chain", {})[mode] = {
            "best_chain": cn, "best_tree": tn, "ratio": t / c,
        }  # fmt: skip
        print(f"best tree {tn} {t:.0f} tok/s / best chain {cn} {c:.0f} tok/s = {t / c:.2f}x")


def print_table(res: dict) -> None:
    """The measured rows, one line each: part, configuration, tokens/s, tau, lossless."""
    print(f"\n{res['device']}, {res['num_prompts']} prompts, max {MAX_TOKENS} tokens")
    print("| part | configuration | tokens/s | tau | output == plain |")
    print("|---|---|---|---|---|")
    for part in ("batch1", "hf", "ptd_sweep", "batch64", "trees"):
        for name, r in res.get(part, {}).items():
            tau = f"{r['tau']:.2f}" if r.get("tau") else "-"
            same = {True: "yes", False: "NO"}.get(r.get("lossless"), "-")
            if "same" in r:
                same = f"{r['same']}/{res['num_prompts']}"
            print(f"| {part} | {name} | {r['tok_s']:.0f} | {tau} | {same} |")
    for mode, v in res.get("tree_vs_chain", {}).items():
        print(
            f"best tree / best chain ({mode}): {v['ratio']:.2f}x ({v['best_tree']} / "
            f"{v['best_chain']})"
        )


def save(res: dict) -> None:
    """Written after every part, so a run cut short still brings back what it measured."""
    clean = json.loads(json.dumps(res, default=str))
    for group in clean.values():
        if isinstance(group, dict):
            for v in group.values():
                if isinstance(v, dict):
                    v.pop("texts", None)
    write_json("e2e.json", clean)


if __name__ == "__main__":
    main()
