"""fused_moe alone (ops/moe_triton.py) at Qwen3-30B-A3B, GLM-4.7-Flash and GLM-4.5-Air experts, bf16.

Per model and token count T (random softmax top-k routing): the Triton op's time per layer in a
CUDA graph that runs it over LAYERS layers of distinct weights and routings (so the experts
stream from HBM as in a forward, not from L2), the bytes of the distinct experts the batch
chose divided by that time as a share of the device-to-device copy bandwidth measured in this
run (the active-weight floor), both Triton paths where both make sense (decode kernels, grouped
GEMM), and the torch reference (`fused_moe_ref`: per-expert F.linear, eager) for comparison.
Every result is checked against the reference before it is timed; a mismatch stops the run.
`--sweep` also times each decode launch config (ops/moe_triton.py DECODE_*_CONFIGS, each with
the other kernel at its shape-table config, T <= 16: `decode_sweep_pairs`) and each
grouped-GEMM config (T >= 16) and reports the
fastest (`--models glm-4.7-flash+shared,glm-4.5-air+shared`: the shapes with
the shared expert fused, top_k + 1 experts). `--route-sweep` times the fused norm + router +
choice (ops/moe_router.py norm_route) at each model's router shape for every ROUTE_CONFIGS
entry, chained over LAYERS distinct routers in one graph (its PDL preload overlaps the
previous call's tail there, as it overlaps o_proj's in a forward).

    python benchmarks/moe.py [--quick] [--sweep] [--route-sweep] [--models a,b]
    # table last; writes $OUT/moe.json
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import out_dir as results_dir  # noqa: E402
from decode import copy_bandwidth  # noqa: E402

# name: (hidden H, moe_intermediate_size I, experts E, top_k, fused shared experts): "+shared",
# the shape the model runs with its shared expert fused (models/moe.py): expert E chosen by
# every token at weight 1.0, so top_k + 1 experts (ops/moe_triton.py's "+ shared" table rows).
MODELS = {
    "qwen3-30b-a3b": (2048, 768, 128, 8, 0),
    "glm-4.7-flash": (2048, 1536, 64, 4, 0),
    "glm-4.5-air": (4096, 1408, 128, 8, 0),
    "glm-4.7-flash+shared": (2048, 1536, 64, 4, 1),
    "glm-4.5-air+shared": (4096, 1408, 128, 8, 1),
}
DEFAULT_MODELS = ("qwen3-30b-a3b", "glm-4.7-flash", "glm-4.5-air")
TOKENS = (1, 2, 4, 8, 16, 64, 512)
QUICK_TOKENS = (1, 8, 64)
LAYERS = 4  # distinct weight sets a graph cycles through: 4.8 GB (Qwen3) / 17.7 GB (GLM)
DEVICE = "cuda"


def graph_us(fn: Callable[[], object], replays: int = 20) -> float:
    """Median microseconds of one replay of `fn` captured in a CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):  # compiles outside the capture
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    times = []
    for _ in range(replays + 3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    del g
    return sorted(times[3:])[len(times[3:]) // 2]


def eager_us(fn: Callable[[], object], reps: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e6)
    return sorted(times)[reps // 2]


def over_layers(
    call: Callable[..., torch.Tensor], xs: list, weights: list, routes: list
) -> Callable[[], None]:
    """One call per layer: its input, its (w13, w2), its (topk_weights, topk_ids)."""

    def fn() -> None:
        for x, w, r in zip(xs, weights, routes):
            call(x, *w, *r)

    return fn


def routing(
    T: int, E: int, top_k: int, gen: torch.Generator, shared: int = 0
) -> tuple[torch.Tensor, ...]:
    """Random softmax top-k over E experts, then `shared` experts E.. at weight 1.0 (the
    router's own arithmetic, select_experts_ref)."""
    from specserve.ops.moe_router import select_experts_ref

    logits = torch.randn(T, E, generator=gen, device=DEVICE)
    w, ids = select_experts_ref(
        logits, None, scoring="softmax", top_k=top_k, renormalize=False, n_shared=shared
    )
    return w, ids.to(torch.int32)


def check(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    if not err < 2e-2:
        raise SystemExit(f"MISMATCH {what}: relative error {err:.3e} against fused_moe_ref")


def bench_model(name: str, tokens: tuple[int, ...], layers: int, sweep: bool, bw: float) -> list:
    from specserve.ops import moe_triton as mt
    from specserve.ops.moe import fused_moe, fused_moe_ref

    H, inter, E, top_k, shared = MODELS[name]
    gen = torch.Generator(device=DEVICE).manual_seed(0)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        x = torch.randn(*shape, device=DEVICE, dtype=torch.bfloat16, generator=gen)
        return x.mul_(scale)

    weights = [
        (
            randn(E + shared, 2 * inter, H, scale=H**-0.5),
            randn(E + shared, H, inter, scale=inter**-0.5),
        )
        for _ in range(layers)
    ]
    expert_bytes = 2 * (3 * inter * H)  # w13 + w2 rows of one expert, bf16
    rows = []
    for T in tokens:
        xs = [randn(T, H) for _ in range(layers)]
        routes = [routing(T, E, top_k, gen, shared) for _ in range(layers)]
        distinct = sum(len(torch.unique(ids)) for _, ids in routes) / layers
        floor_bytes = distinct * expert_bytes

        with torch.inference_mode():
            refs = [fused_moe_ref(x, *w, *r) for x, w, r in zip(xs, weights, routes)]
            paths = ("decode", "gemm") if T <= 64 else ("gemm",)
            us = {}
            for path in paths:
                for x, w, r, ref in zip(xs, weights, routes, refs):
                    check(fused_moe(x, *w, *r, path=path), ref, f"{name} T={T} {path}")
                call = functools.partial(fused_moe, path=path)
                us[path] = graph_us(over_layers(call, xs, weights, routes)) / layers
            auto = "decode" if T <= mt.DECODE_MAX_TOKENS else "gemm"
            x, w, r = xs[0], weights[0], routes[0]
            ref_us = eager_us(lambda x=x, w=w, r=r: fused_moe_ref(x, *w, *r))
            row = {
                "model": name,
                "T": T,
                "distinct_experts": distinct,
                "weight_MB": floor_bytes / 1e6,
                "us": us[auto],
                "path": auto,
                "decode_us": us.get("decode"),
                "gemm_us": us["gemm"],
                "pct_of_copy_bw": 100 * floor_bytes / (us[auto] * 1e-6) / bw,
                "ref_us": ref_us,
            }
            if sweep:
                row.update(sweep_configs(xs, weights, routes, refs, T, layers))
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


# (gate_up config, down config): one decode launch of the sweep.
SweepPoint = tuple[tuple[int, int, int], tuple[int, int, int]]


def decode_sweep_pairs(hidden: int, inter: int, top_k: int) -> list[SweepPoint]:
    """What --sweep times at this expert shape: each gate_up candidate with the table's down
    config and each down candidate with the table's gate_up config (the table pair among
    them). Sorted, no duplicates."""
    from specserve.ops import moe_triton as mt

    gate_up, down = mt.decode_configs(hidden, inter, top_k)
    points = {(g, down) for g in mt.DECODE_GATE_UP_CONFIGS}
    points |= {(gate_up, d) for d in mt.DECODE_DOWN_CONFIGS}
    return sorted(points)


def point_name(point: SweepPoint) -> str:
    """The sweep's label of a point (JSON key and table): "gu(4, 2048, 4) dn(2, 256, 4)"."""
    g, d = point
    return f"gu{g} dn{d}"


def sweep_configs(xs: list, weights: list, routes: list, refs: list, T: int, layers: int) -> dict:
    """The fastest decode config pair (T <= 16), the table pair, and the fastest grouped-GEMM
    config (T >= 16)."""
    from specserve.ops import moe_triton as mt

    def timed(call: Callable[..., torch.Tensor]) -> float:
        for x, w, r, ref in zip(xs, weights, routes, refs):
            check(call(x, *w, *r), ref, f"T={T} sweep")
        return graph_us(over_layers(call, xs, weights, routes)) / layers

    found = {}
    if T <= 16:
        w13, w2 = weights[0]
        shape = (w13.shape[2], w2.shape[2], routes[0][1].shape[1])
        times = {
            p: timed(lambda *a, p=p: mt.fused_moe_decode(*a, configs=p))
            for p in decode_sweep_pairs(*shape)
        }
        best = min(times, key=times.get)
        found.update(best_decode_config=best, best_decode_us=times[best])
        table = mt.decode_configs(*shape)
        found.update(table_decode_config=table, table_decode_us=times[table])
        found["decode_sweep_us"] = {point_name(p): round(t, 2) for p, t in times.items()}
    if T >= 16:
        times = {
            c: timed(lambda *a, c=c: mt.fused_moe_gemm(*a, config=c)) for _, c in mt.GEMM_CONFIGS
        }
        best = min(times, key=times.get)
        found.update(best_gemm_config=best, best_gemm_us=times[best])
    return found


def route_sweep(name: str, tokens: tuple[int, ...], layers: int) -> list:
    """norm_route per layer (us) at the model's router shape (softmax, top-k, renormalized),
    for every ROUTE_CONFIGS entry, each checked against norm_route_ref first."""
    from specserve.ops import moe_router as mr

    H, _, E, top_k, shared = MODELS[name]
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    routing = dict(scoring="softmax", top_k=top_k, renormalize=True, n_shared=shared)
    norm_w = torch.ones(H, device=DEVICE, dtype=torch.bfloat16)
    routers = [
        torch.randn(E, H, device=DEVICE, generator=gen).mul_(H**-0.5).to(torch.bfloat16)
        for _ in range(layers)
    ]
    counter = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    rows = []
    for T in (t for t in tokens if t <= mr.ROUTE_MAX_TOKENS):
        xs = [torch.randn(2, T, H, device=DEVICE, generator=gen).to(torch.bfloat16)
              for _ in range(layers)]  # fmt: skip
        times = {}
        for cfg in mr.ROUTE_CONFIGS:

            def call(x: torch.Tensor, w: torch.Tensor, cfg: tuple = cfg) -> tuple:
                args = (x[0], x[1], norm_w, 1e-6, w, None, counter, cfg)
                return mr.norm_route_triton(*args, **routing)

            with torch.inference_mode():
                for x, w in zip(xs, routers):
                    ref = mr.norm_route_ref(x[0], x[1], norm_w, 1e-6, w, None, **routing)
                    out = call(x, w)
                    if not torch.equal(out[1].sort(-1)[0], ref[1].sort(-1)[0]):
                        raise SystemExit(f"MISMATCH norm_route {name} T={T} {cfg}: experts")

                def fn(xs: list = xs, call: Callable[..., tuple] = call) -> None:
                    for x, w in zip(xs, routers):
                        call(x, w)

                times[cfg] = graph_us(fn) / layers
        best = min(times, key=times.get)
        row = {"model": name, "T": T, "route_us": {str(c): round(t, 2) for c, t in times.items()}}
        row.update(best_route_config=best, best_route_us=times[best])
        row.update(default_route_us=times[mr.ROUTE_CONFIG])
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help=f"T in {QUICK_TOKENS}, 2 layers")
    p.add_argument("--sweep", action="store_true", help="also time every launch config")
    p.add_argument("--route-sweep", action="store_true", help="time norm_route's configs")
    p.add_argument(
        "--models", default=",".join(DEFAULT_MODELS), help=f"comma-separated: {', '.join(MODELS)}"
    )
    args = p.parse_args()
    t0 = time.time()
    tokens = QUICK_TOKENS if args.quick else TOKENS
    layers = 2 if args.quick else LAYERS
    bw = copy_bandwidth(1 << 30, rounds=5)
    rows, route_rows = [], []
    for name in args.models.split(","):
        rows += bench_model(name, tokens, layers, args.sweep, bw)
        torch.cuda.empty_cache()  # the model's weights are gone
        if args.route_sweep:
            route_rows += route_sweep(name, tokens, 16)
    result = {
        "device": torch.cuda.get_device_name(),
        "copy_bw_GBs": bw / 1e9,
        "layers": layers,
        "seconds": time.time() - t0,
        "rows": rows,
        "route_rows": route_rows,
    }
    out_dir = results_dir()
    with open(os.path.join(out_dir, "moe.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"\n{result['device']}  copy bandwidth {bw / 1e9:.0f} GB/s (read + write)")
    print("us: fused_moe per layer in a CUDA graph; % bw: distinct experts' bytes / us / copy bw")
    head = f"{'model':>14} {'T':>4} {'experts':>7} {'MB':>6} {'path':>6} {'us':>8} {'% bw':>6}"
    print(head + f" {'decode us':>9} {'gemm us':>8} {'torch ref us':>12}")
    for r in rows:
        dec = f"{r['decode_us']:9.1f}" if r["decode_us"] is not None else f"{'-':>9}"
        print(
            f"{r['model']:>14} {r['T']:>4} {r['distinct_experts']:>7.1f} {r['weight_MB']:>6.0f} "
            f"{r['path']:>6} {r['us']:>8.1f} {r['pct_of_copy_bw']:>5.1f}% {dec} "
            f"{r['gemm_us']:>8.1f} {r['ref_us']:>12.0f}"
        )
        if "best_decode_config" in r:
            best = point_name(r["best_decode_config"])
            print(f"{'':>20} best decode {best}: {r['best_decode_us']:.1f} us")
            table = point_name(r["table_decode_config"])
            print(f"{'':>20} table decode {table}: {r['table_decode_us']:.1f} us")
        if "best_gemm_config" in r:
            print(f"{'':>20} best gemm {r['best_gemm_config']}: {r['best_gemm_us']:.1f} us")
    for r in route_rows:
        print(
            f"{r['model']:>14} T={r['T']}: norm_route {r['default_route_us']:.2f} us (default), "
            f"best {r['best_route_config']} {r['best_route_us']:.2f} us"
        )
    print(f"({result['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
