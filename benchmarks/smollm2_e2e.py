"""End to end on the default model: SmolLM2-135M-Instruct (from its GGUF) with its EAGLE-3 head.

Greedy chat replies (max 128 new tokens, EOS allowed) to chat-templated prompts:
  batch 1   the 20 held-out instruct prompts, sent one at a time
  batch 64  64 prompts at once (the held-out ones, then the shipped chat prompts)
per method: specserve without speculation, with EAGLE-3 (K = 3), with n-gram (K = 3); output
tokens/s, mean acceptance length and whether the tokens equal the plain run's. References on
the same checkpoint: transformers' `generate`, and at batch 1 its assisted generation by prompt
lookup (transformers' assisted generation takes a draft model or prompt lookup, not an EAGLE-3
head).

    python benchmarks/smollm2_e2e.py --gguf PATH.gguf      # $OUT/smollm2_e2e.json, table last
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import out_dir as results_dir  # noqa: E402

MAX_TOKENS = 128


def prompt_sets(target: str) -> tuple[list[list[int]], list[list[int]]]:
    from specserve.data import load_prompts
    from specserve.train.data import load_tokenizer
    from specserve.train.distill import chat_prompt_ids

    tok = load_tokenizer(target)
    held = [r["prompt"] for r in load_prompts("instruct") if r["split"] == "heldout"]
    wide = (held + [r["prompt"] for r in load_prompts("chat")])[:64]
    return chat_prompt_ids(tok, held), chat_prompt_ids(tok, wide)


def run_specserve(
    target: str, spec: dict[str, Any] | None, batches: dict[str, list[list[int]]]
) -> dict[str, Any]:
    from specserve import LLM, SamplingParams

    llm = LLM(
        target, dtype="bfloat16", max_num_seqs=64, max_model_len=1024, speculative_config=spec
    )
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    llm.generate([{"prompt_token_ids": batches["1"][0]}], sp, use_tqdm=False)  # warm-up
    out: dict[str, Any] = {}
    for name, prompts in batches.items():
        before = llm.get_metrics()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if name == "1":
            res = [llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)[0] for p in prompts]
        else:
            res = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        after = llm.get_metrics()
        toks = [list(r.outputs[0].token_ids) for r in res]
        drafts = after["spec_decode_num_drafts_total"] - before["spec_decode_num_drafts_total"]
        acc = (
            after["spec_decode_num_accepted_tokens_total"]
            - before["spec_decode_num_accepted_tokens_total"]
        )
        out[name] = {
            "seconds": dt,
            "output_tokens": sum(map(len, toks)),
            "tokens_per_s": sum(map(len, toks)) / dt,
            "acceptance_length": 1 + acc / drafts if drafts else None,
            "tokens": toks,
        }
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return out


def run_transformers(target: str, batches: dict[str, list[list[int]]]) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.bfloat16).cuda().eval()
    kw = dict(max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=tok.pad_token_id or 0)
    out: dict[str, Any] = {}
    with torch.inference_mode():
        model.generate(torch.tensor([batches["1"][0]], device="cuda"), **kw)  # warm-up
        for mode, extra in (("generate", {}), ("prompt_lookup", {"prompt_lookup_num_tokens": 3})):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            n = 0
            for p in batches["1"]:
                ids = torch.tensor([p], device="cuda")
                n += model.generate(ids, **kw, **extra).shape[1] - len(p)
            torch.cuda.synchronize()
            out[f"1/{mode}"] = n / (time.perf_counter() - t0)
        # Batch 64: left-padded, one generate call.
        width = max(map(len, batches["64"]))
        pad = tok.pad_token_id or 0
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batches["64"]], device="cuda")
        mask = torch.tensor(
            [[0] * (width - len(p)) + [1] * len(p) for p in batches["64"]], device="cuda"
        )
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        gen = model.generate(ids, attention_mask=mask, **kw)[:, width:]
        torch.cuda.synchronize()
        n = sum(_until_eos(row, tok.eos_token_id) for row in gen.tolist())
        out["64/generate"] = n / (time.perf_counter() - t0)
    return out


def _until_eos(row: list[int], eos: int | None) -> int:
    return row.index(eos) + 1 if eos in row else len(row)


def main() -> int:
    from specserve.data import DATA_DIR, EMBEDDED_K, default_gguf
    from specserve.models.gguf import resolve_gguf

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", help="the target's GGUF file (default: the packaged one)")
    args = p.parse_args()
    head = os.path.join(DATA_DIR, "smollm2_eagle3")
    eagle3 = {"method": "eagle3", "model": head, "num_speculative_tokens": EMBEDDED_K}
    target = resolve_gguf(args.gguf or default_gguf())
    b1, b64 = prompt_sets(target)
    batches = {"1": b1, "64": b64}
    specs = {
        "plain": None,
        "eagle3": eagle3,
        "ngram": {"method": "ngram", "num_speculative_tokens": 3},
    }
    results: dict[str, Any] = {}
    for name, spec in specs.items():
        print(f"specserve {name} ...", flush=True)
        results[name] = run_specserve(target, spec, batches)
    print("transformers ...", flush=True)
    hf = run_transformers(target, batches)
    plain = results["plain"]
    rows = []
    for name, r in results.items():
        for b in ("1", "64"):
            same = sum(a == c for a, c in zip(r[b]["tokens"], plain[b]["tokens"]))
            rows.append(
                (
                    name,
                    b,
                    r[b]["tokens_per_s"],
                    r[b]["acceptance_length"],
                    same,
                    len(r[b]["tokens"]),
                )
            )
    out_dir = results_dir()
    summary = {
        "device": torch.cuda.get_device_name(),
        "max_tokens": MAX_TOKENS,
        "specserve": {
            n: {b: {k: v for k, v in r[b].items() if k != "tokens"} for b in r}
            for n, r in results.items()
        },
        "transformers": hf,
    }
    with open(os.path.join(out_dir, "smollm2_e2e.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print("| engine / method | batch | tokens/s | acceptance length | output == plain |")
    print("|---|---|---|---|---|")
    for name, b, tps, tau, same, n in rows:
        tau_s = f"{tau:.2f}" if tau else "-"
        print(f"| specserve {name} | {b} | {tps:.0f} | {tau_s} | {same}/{n} |")
    for k, v in hf.items():
        b, mode = k.split("/")
        print(f"| transformers {mode} | {b} | {v:.0f} | - | - |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
