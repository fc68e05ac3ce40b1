"""What a grammar costs a speculative step: engine steps with and without a JSON schema, and
the grammar's own host and device work per step.

    python benchmarks/structured_cost.py                 # embedded model, EAGLE-3, K = 3, CPU
    python benchmarks/structured_cost.py --device cuda   # $OUT/structured_cost.json

Part 1 (end to end): the same prompts, greedy, each request under the schema or unconstrained
(ignore_eos, the same max_tokens); ms per engine step over all steps after the first (prefill),
the fastest of `--repeats` interleaved runs.
Part 2 (the grammar alone): per request and step, `fill_masks` over K real drafts (K + 1 masks,
K tentative accepts) + `commit` (rollback + accept), and `apply_grammar_bitmask_` over a batch's
[B, K + 1, V] logits, timed in isolation.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import write_json  # noqa: E402

from specserve import LLM, SamplingParams, StructuredOutputsParams
from specserve.data import embedded_model_dir, load_prompts
from specserve.structured.bitmask import GrammarStep, apply_grammar_bitmask_, bitmask_width

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "color": {"enum": ["red", "green", "blue"]},
        "n": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
    },
    "required": ["name", "color", "n", "tags"],
}


def engine_steps(llm: LLM, prompts: list[str], sp: SamplingParams) -> tuple[float, int, int]:
    """(ms per decode step, steps, generated tokens) for one batch run to completion."""
    eng = llm.engine
    for i, p in enumerate(prompts):
        eng.add_request(f"r{time.monotonic_ns()}-{i}", p, sp)
    times, tokens = [], 0
    while eng.has_unfinished_requests():
        t0 = time.perf_counter()
        outs = eng.step()
        if eng.config.torch_device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        tokens += sum(len(o.delta_token_ids) for o in outs)
    decode = times[1:] or times
    return 1e3 * sum(decode) / len(decode), len(times), tokens


def grammar_alone(llm: LLM, text: str, k: int, batch: int, reps: int) -> dict[str, float]:
    eng = llm.engine
    so = StructuredOutputsParams(json=SCHEMA)
    tok = eng.tokenizer
    ids = [t for t in tok.encode(text) if t not in tok.all_special_ids]
    vocab = eng.hf_config["vocab_size"]
    bm = torch.full(((k + 1), bitmask_width(vocab)), -1, dtype=torch.int32)
    t_fill = t_commit = 0.0
    n = 0
    for _ in range(reps):
        g = eng.structured.new_request(so)
        pos = 0
        # Every draft valid and all accepted: the most masks and accepts a step can need.
        while pos + k + 1 <= len(ids):
            drafts = ids[pos : pos + k]
            t0 = time.perf_counter()
            g.fill_masks(drafts, bm, 0)
            t1 = time.perf_counter()
            g.commit(ids[pos : pos + k + 1], k)
            t2 = time.perf_counter()
            t_fill += t1 - t0
            t_commit += t2 - t1
            pos += k + 1
            n += 1
    dev = eng.config.torch_device
    logits = torch.randn(batch, k + 1, vocab, device=dev, dtype=eng.config.torch_dtype)
    step = GrammarStep(
        torch.arange(batch, device=dev),
        bm.to(dev)[None].expand(batch, -1, -1).contiguous(),
    )
    for _ in range(3):
        apply_grammar_bitmask_(logits, step)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        apply_grammar_bitmask_(logits, step)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    t_apply = (time.perf_counter() - t0) / 20
    return {
        "fill_masks_us_per_request_step": 1e6 * t_fill / n,
        "commit_us_per_request_step": 1e6 * t_commit / n,
        "apply_ms_per_step": 1e3 * t_apply,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1) if args.device == "cpu" else None
    target, spec = embedded_model_dir()
    llm = LLM(target, speculative_config=spec, device=args.device)
    k = spec["num_speculative_tokens"]
    rows: list[dict[str, Any]] = []
    so = StructuredOutputsParams(json=SCHEMA)
    print(f"device {args.device}, EAGLE-3, K = {k}, max_tokens {args.max_tokens}")
    print("| batch | plain ms/step | schema ms/step | grammar cost ms/step |")
    print("|---|---|---|---|")
    for b in args.batch:
        prompts = [r["prompt"] for r in load_prompts("code", b)]
        mk = args.max_tokens
        engine_steps(llm, prompts[:1], SamplingParams(temperature=0, max_tokens=4))  # warm-up
        # Interleaved repeats, the fastest of each kept: a shared CPU is noisy.
        runs_p, runs_g = [], []
        for _ in range(args.repeats):
            sp = SamplingParams(temperature=0, max_tokens=mk, ignore_eos=True)
            runs_p.append(engine_steps(llm, prompts, sp))
            sp = SamplingParams(temperature=0, max_tokens=mk, structured_outputs=so)
            runs_g.append(engine_steps(llm, prompts, sp))
        plain, gram = min(runs_p), min(runs_g)
        rows.append({"batch": b, "plain": plain, "schema": gram})
        print(f"| {b} | {plain[0]:.2f} | {gram[0]:.2f} | {gram[0] - plain[0]:+.2f} |")
    text = '{"name": "config", "color": "green", "n": 42, "tags": ["fast", "small", "json"]}'
    alone = grammar_alone(llm, text, k, max(args.batch), reps=20)
    print(
        f"grammar alone: fill_masks {alone['fill_masks_us_per_request_step']:.1f} us and commit "
        f"{alone['commit_us_per_request_step']:.1f} us per request per step (K = {k}, all drafts "
        f"valid); bitmask apply {alone['apply_ms_per_step']:.3f} ms per step at batch "
        f"{max(args.batch)}"
    )
    write_json("structured_cost.json", {"steps": rows, "grammar_alone": alone})


if __name__ == "__main__":
    main()
