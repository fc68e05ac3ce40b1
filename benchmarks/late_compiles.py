"""Triton compiles after the warm-up, found by driving an engine as the serving sweep loads it.

    python benchmarks/late_compiles.py --shape llama3-8b --method eagle3   # (or plain)

Builds `serve_sweep.py --shape`'s model (target config + tokenizer, dummy weights; with
`--method eagle3` its EAGLE-3-shaped head, K = 3, synthetic acceptance 0.505) with the engine's
defaults and the warm-up on, then runs a closed loop of requests (--input-len random prompt
tokens, max_tokens drawn from 1..--max-tokens so that requests end, and with them short final
verifications, all the time) at each concurrency of --concurrency for --steps engine steps,
a new request arriving as soon as one finishes (prefills beside decodes). Prints every compile
`warmup.watch_late_compiles` logged, with its specialization, and writes them to
$OUT/late_compiles.json. (`--shape tiny --device cpu`: a smoke run; nothing compiles on a CPU.)
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import write_json  # noqa: E402
from serve_shape import write_shape  # noqa: E402
from serve_sweep import SHAPE_EAGLE3  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama3-8b")
    ap.add_argument("--method", default="eagle3", choices=("eagle3", "plain"))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--input-len", type=int, default=84)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--concurrency", default="1,16,64")
    ap.add_argument("--steps", type=int, default=300, help="engine steps at each concurrency")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    args = ap.parse_args()

    from specserve import SamplingParams
    from specserve.config import EngineConfig
    from specserve.engine.engine import LLMEngine
    from specserve.worker import warmup

    root = tempfile.mkdtemp(prefix="late_compiles_")
    target, head = write_shape(root, args.shape)
    spec = {**SHAPE_EAGLE3, "model": head} if args.method == "eagle3" else None
    cfg = EngineConfig(
        model=target,
        load_format="dummy",
        device=args.device,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.input_len + args.max_tokens + 64,
        speculative_config=spec,
    )
    t0 = time.perf_counter()
    engine = LLMEngine(cfg)
    print(f"engine up in {time.perf_counter() - t0:.1f} s; late compiles so far: "
          f"{len(warmup.late_compiles)}", flush=True)  # fmt: skip
    rng = random.Random(0)
    vocab = engine.hf_config["vocab_size"]
    found: list[dict] = []
    n = 0
    for conc in (int(c) for c in args.concurrency.split(",")):
        before = len(warmup.late_compiles)
        live = 0
        for step in range(args.steps):
            while live < conc:
                ids = [rng.randrange(1, min(vocab, 32000)) for _ in range(args.input_len)]
                sp = SamplingParams(
                    temperature=0.0, max_tokens=rng.randint(1, args.max_tokens), ignore_eos=True
                )
                engine.add_request(f"r{n}", {"prompt_token_ids": ids}, sp)
                n, live = n + 1, live + 1
            for out in engine.step():
                live -= out.finished
            new = warmup.late_compiles[before:]
            if new:
                for what in new:
                    print(f"  c={conc} step {step} (live {live}): {what}", flush=True)
                    found.append({"concurrency": conc, "step": step, "live": live, "what": what})
                before = len(warmup.late_compiles)
        print(f"concurrency {conc}: {args.steps} steps, {n} requests so far", flush=True)
        while engine.has_unfinished_requests():
            engine.step()
    print(f"late compiles: {len(found)}")
    write_json("late_compiles.json", {"args": vars(args), "late_compiles": found})


if __name__ == "__main__":
    main()
