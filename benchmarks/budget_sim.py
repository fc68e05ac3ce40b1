"""The adaptive draft budget at batch 1, simulated: how far from the best fixed K one request's
own acceptance draws put it.

`never_slower.py`'s concurrency-1 cells are one 512-token request each, and synthetic
verification accepts the draft at position p iff a uniform keyed by (request seed, p) is below
the rate, so every arm of one call sees the same draw and another call sees another. This
replays that: per draw, a fixed Bernoulli(r) sequence over positions, run through plain
decoding, every fixed K and the controller (`DraftBudget`, fed each step's acceptance and
time, the engine's one-step lag between a decision and its verification included), with step
costs in ms per k (default: the Llama-3-8B shape's batch-1 graphs on an H100, from
`never_slower.py`'s traces). The table gives the budget's tokens/s over the best fixed K of
the same draw: the mean, the 10th percentile and the share of draws below 0.95 (the issue's
5% margin). The best of six arms in one draw is a maximum of noisy figures, so it favours
fixed K a little. CPU only, seconds.

    python benchmarks/budget_sim.py
    python benchmarks/budget_sim.py --tokens 2048            # longer requests
    python benchmarks/budget_sim.py --costs 1.0,1.3,1.45,1.6 --rates 0.7  # other step costs
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import write_json  # noqa: E402

from specserve.spec_decode.dynamic import DraftBudget  # noqa: E402

LLAMA3_8B_B1_MS = (5.19, 6.0, 6.29, 6.61, 6.9, 7.14)


def run(accepted: np.ndarray, costs: list[float], track: float, policy: int | DraftBudget) -> float:
    """Tokens per ms of one request over `accepted` ([N] bool: whether a draft at each
    position is accepted), at a fixed K (`policy` an int) or under the budget."""
    budget = policy if isinstance(policy, DraftBudget) else None
    req = [("r", True)]
    end = len(accepted) - len(costs)
    pos, ms, verify = 0, 0.0, 0
    while pos < end:
        if budget is None:
            propose, tracked = int(policy), False
        else:
            propose = budget.choose(1, req)
            tracked = propose == 0 and budget.tracks_drafter_kv
        n = 0  # the step verifies the drafts proposed by the one before
        while n < verify and accepted[pos + 1 + n]:
            n += 1
        dt = costs[max(verify, propose)] * (track if tracked else 1.0)
        ms += dt
        pos += n + 1
        if budget is not None:
            budget.record_acceptance("r", True, verify, n)
            if verify == propose:
                budget.record_step(1, verify, dt / 1e3, tracked)
            budget.tick()
        verify = propose
    return pos / ms


def simulate(rate: float, tokens: int, draws: int, costs: list[float], track: float) -> dict:
    max_k = len(costs) - 1
    ratios, best_k = [], []
    for seed in range(draws):
        accepted = np.random.default_rng(seed).random(tokens + max_k + 1) < rate
        fixed = [run(accepted, costs, track, k) for k in range(max_k + 1)]
        ratios.append(run(accepted, costs, track, DraftBudget(max_k)) / max(fixed))
        best_k.append(int(np.argmax(fixed)))
    x = np.array(ratios)
    return {
        "rate": rate,
        "tokens": tokens,
        "draws": draws,
        "x_best_mean": float(x.mean()),
        "x_best_p10": float(np.percentile(x, 10)),
        "below_0.95": float((x < 0.95).mean()),
        "best_fixed_k": np.bincount(best_k, minlength=max_k + 1).tolist(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rates", default="0.3,0.6,0.85")
    ap.add_argument("--tokens", type=int, default=512, help="output tokens of the request")
    ap.add_argument("--draws", type=int, default=100)
    ap.add_argument("--costs", default=",".join(map(str, LLAMA3_8B_B1_MS)), help="ms, k = 0..K")
    ap.add_argument("--track", type=float, default=1.05, help="tracked k = 0 step / plain step")
    args = ap.parse_args()
    costs = [float(c) for c in args.costs.split(",")]
    rows = [
        simulate(float(r), args.tokens, args.draws, costs, args.track)
        for r in args.rates.split(",")
    ]
    path = write_json("budget_sim.json", {"costs_ms": costs, "track": args.track, "rows": rows})
    print(f"wrote {path}")
    print(f"{'rate':>5} {'tokens':>6} {'draws':>5} {'x best':>7} {'p10':>6} {'< 0.95':>7}  best K")
    for r in rows:
        print(
            f"{r['rate']:5.2f} {r['tokens']:6d} {r['draws']:5d} {r['x_best_mean']:7.3f} "
            f"{r['x_best_p10']:6.3f} {r['below_0.95']:7.2f}  {r['best_fixed_k']}"
        )


if __name__ == "__main__":
    main()
