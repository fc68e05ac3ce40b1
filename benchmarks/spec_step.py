"""Cost of a speculative step vs a plain decode step, Llama-3-8B shape, EAGLE-3-shaped head.

Random bf16 weights (load_format=dummy) for the target of benchmarks/decode.py and an EAGLE-3
head of the published Llama-3-8B layout (one 4096-wide layer, fc over 3 x 4096, 32000-token
draft vocabulary); `synthetic` acceptance so the step's shape does not depend on trained weights.
For batch 1, 16 and 64: ms per plain decode step, and per speculative step for K = 1..7 with the
draft loop as one fused graph and as a per-step graph replayed K-1 times, the drafting share of
the step (CUDA events around drafting), and output tokens per second.

    python benchmarks/spec_step.py [--ks 1,2,3,4,5,6,7] [--batches 1,16,64]  # $OUT/spec_step.json
    python benchmarks/spec_step.py --async-scheduling ...             # $OUT/spec_step_async.json
    python benchmarks/spec_step.py --methods eagle3,ptd --modes fused --batches 1 --ks 2,...,8
    python benchmarks/spec_step.py --prompt-len 600 ...   # the same steps at a longer context
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import write_json  # noqa: E402
from decode import LLAMA3_8B, log_plans, write_config  # noqa: E402

EAGLE3_HEAD = {
    "architectures": ["LlamaForCausalLMEagle3"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 1,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "draft_vocab_size": 32000,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "torch_dtype": "bfloat16",
}
# The same head trained for parallel drafting: K drafts from one forward (mask slots).
PTD_HEAD = {**EAGLE3_HEAD, "parallel_draft": True, "ptd_token_id": 128255}


def synthetic_spec(head: str, k: int, acceptance: float, parallel_draft: bool = False) -> dict:
    """An EAGLE-3 (or parallel-drafting) config over the head at `head`, K drafts, accepted
    at the synthetic rate `acceptance` (the step costs of real acceptance, any weights). K is
    fixed: the adaptive draft budget (the engine's default) would choose its own."""
    return {
        "method": "eagle3",
        "model": head,
        "num_speculative_tokens": k,
        "rejection_sample_method": "synthetic",
        "synthetic_acceptance_rate": acceptance,
        "parallel_draft": parallel_draft,
        "adaptive": False,
    }


def make_engine(
    target: str,
    spec: dict | None,
    mode: str,
    max_seqs: int,
    async_scheduling: bool = False,
    decode_matmul: str = "auto",
    max_num_batched_tokens: int = 8192,
    max_model_len: int = 1024,
) -> object:
    """`max_num_batched_tokens`: the logits headroom the KV sizing reserves scales with it
    (4 x tokens x vocab fp32: 20 GB at 8192 x 151936), so big-vocabulary targets that fill
    most of the GPU (Qwen3-30B-A3B) pass less. `max_model_len`: raise it for long prompts (it
    also sets the attention's split count)."""
    from specserve.config import EngineConfig
    from specserve.engine.engine import LLMEngine

    cfg = EngineConfig(
        model=target,
        dtype="bfloat16",
        load_format="dummy",
        max_model_len=max_model_len,
        max_num_seqs=max_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        gpu_memory_utilization=0.85,
        speculative_config=spec,
        draft_graph_mode=mode,
        async_scheduling=async_scheduling,
        decode_matmul=decode_matmul,
        # `measure` runs warm steps of the batch it times first; the start-up warm-up of every
        # shape would only lengthen each of the many engines a sweep builds.
        warmup=False,
    )
    return LLMEngine(cfg)


def measure(
    engine: object, batch: int, steps: int = 24, prompt_len: int = 128, vocab_size: int = 128000
) -> dict:
    """Per-step device time (and wall time) and drafting time once `batch` requests are all
    decoding (on CPU, where there are no CUDA events: the wall time, and drafting time 0)."""
    from specserve import SamplingParams

    cuda = engine.config.torch_device.type == "cuda"  # type: ignore[attr-defined]
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sp = SamplingParams(temperature=0.0, max_tokens=600, ignore_eos=True)
    g = torch.Generator().manual_seed(batch)
    ids = [torch.randint(0, vocab_size, (prompt_len,), generator=g).tolist() for _ in range(batch)]
    for i, p in enumerate(ids):
        engine.add_request(f"b{batch}-{i}", {"prompt_token_ids": p}, sp)
    while engine.scheduler.waiting or any(  # type: ignore[attr-defined]
        r.num_computed_tokens < len(r.prompt_token_ids)
        for r in engine.requests.values()  # type: ignore[attr-defined]
    ):
        engine.step()  # type: ignore[attr-defined]
    for _ in range(4):
        engine.step()  # type: ignore[attr-defined]
    runner = engine.runner  # type: ignore[attr-defined]
    runner.draft_events = [] if cuda else None
    gen_before = sum(len(r.output_token_ids) for r in engine.requests.values())  # type: ignore[attr-defined]
    # The step time is the device's, between two events on the stream: the first queued behind
    # a step in flight (async scheduling: each call launches a step, then reads the one
    # before), the second behind the last timed step. So it covers `steps` whole device steps
    # in a running loop, idle gaps included (a host that falls behind shows), and not the
    # pipeline's start: the wall clock below (its first launch's host latency counted, 1/steps
    # of it a step) is kept beside it.
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if cuda else None
    sync()
    t0 = time.perf_counter()
    for i in range(steps + 1):
        if ev is not None and i == 1:
            ev[0].record()
        engine.step()  # type: ignore[attr-defined]
    if ev is not None:
        ev[1].record()
    sync()
    dt = time.perf_counter() - t0
    gen = sum(len(r.output_token_ids) for r in engine.requests.values()) - gen_before  # type: ignore[attr-defined]
    draft_ms = sum(s.elapsed_time(e) for s, e in (runner.draft_events or [])[1 : steps + 1]) / steps
    runner.draft_events = None
    for rid in list(engine.requests):  # type: ignore[attr-defined]
        engine.abort_request(rid)  # type: ignore[attr-defined]
    wall_ms = 1e3 * dt / (steps + 1)
    ms = ev[0].elapsed_time(ev[1]) / steps if ev is not None else wall_ms
    return {
        "ms_per_step": ms,
        "wall_ms_per_step": wall_ms,
        "draft_ms": draft_ms,
        "tok_s": gen / dt,
        "tokens_per_step": gen / (steps + 1) / batch,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ks", default="1,2,3,4,5,6,7")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--modes", default="fused,per_step")
    ap.add_argument(
        "--methods",
        default="eagle3",
        help="eagle3 (autoregressive drafting, each --modes) and/or ptd (one graph, K drafts "
        "from one forward)",
    )
    ap.add_argument("--acceptance", type=float, default=0.7)
    ap.add_argument(
        "--async-scheduling", action="store_true", help="launch step N+1 while step N runs"
    )
    ap.add_argument("--decode-matmul", default="auto", help="cublas | triton | auto (default)")
    ap.add_argument(
        "--prompt-len", type=int, default=128,
        help="tokens of context each request has when the timed steps start",
    )  # fmt: skip
    args = ap.parse_args()
    log_plans()
    batches = [int(b) for b in args.batches.split(",")]
    target = write_config(LLAMA3_8B)
    heads = {"eagle3": write_config(EAGLE3_HEAD), "ptd": write_config(PTD_HEAD)}
    results: dict = {
        "device": torch.cuda.get_device_name(),
        "async_scheduling": args.async_scheduling,
        "decode_matmul": args.decode_matmul,
        "prompt_len": args.prompt_len,
        "rows": [],
    }

    def run(label: str, k: int, mode: str, spec: dict | None) -> None:
        engine = make_engine(
            target, spec, mode, max(batches), args.async_scheduling, args.decode_matmul,
            max_model_len=max(1024, args.prompt_len + 700),
        )  # fmt: skip
        for b in batches:
            r = measure(engine, b, prompt_len=args.prompt_len)
            results["rows"].append({"label": label, "k": k, "mode": mode, "batch": b, **r})
            print(
                f"{label:>6} K={k} {mode:>8} B={b:>3}: {r['ms_per_step']:.2f} ms/step, "
                f"draft {r['draft_ms']:.2f} ms, {r['tok_s']:.0f} tok/s",
                flush=True,
            )
        del engine
        gc.collect()
        torch.cuda.empty_cache()

    run("plain", 0, "auto", None)
    for k in [int(x) for x in args.ks.split(",")]:
        for method in args.methods.split(","):
            for mode in args.modes.split(",") if method == "eagle3" else ["graph"]:
                spec = synthetic_spec(heads[method], k, args.acceptance, method == "ptd")
                run(method, k, "auto" if mode == "graph" else mode, spec)
    ctx = f"_ctx{args.prompt_len}" if args.prompt_len != 128 else ""
    name = f"spec_step{'_async' * args.async_scheduling}_{args.decode_matmul}{ctx}.json"
    write_json(name, results)
    plain = {r["batch"]: r["ms_per_step"] for r in results["rows"] if r["label"] == "plain"}
    print(
        f"\n{results['device']}; {args.prompt_len}-token contexts; ms per step (x plain decode "
        "step), drafting share"
    )
    print(f"{'K':>2} {'drafter':>15} " + " ".join(f"{'B=' + str(b):>22}" for b in batches))
    print(f"{0:>2} {'plain':>15} " + " ".join(f"{plain[b]:>10.2f} ms {'':>10}" for b in batches))
    for r0 in results["rows"]:
        if r0["label"] == "plain" or r0["batch"] != batches[0]:
            continue
        cells = []
        for b in batches:
            r = next(
                x
                for x in results["rows"]
                if x["label"] == r0["label"]
                and x["k"] == r0["k"]
                and x["mode"] == r0["mode"]
                and x["batch"] == b
            )
            share = r["draft_ms"] / r["ms_per_step"]
            cells.append(
                f"{r['ms_per_step']:>6.2f} ({r['ms_per_step'] / plain[b]:.2f}x) {100 * share:>3.0f}%"
            )
        name = "ptd" if r0["label"] == "ptd" else f"{r0['label']} {r0['mode']}"
        print(f"{r0['k']:>2} {name:>15} " + " ".join(f"{c:>22}" for c in cells))


if __name__ == "__main__":
    main()
