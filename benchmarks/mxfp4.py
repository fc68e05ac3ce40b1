"""MXFP4 MoE decode kernels (ops/moe_mxfp4.py) against the MXFP4 bandwidth floor.

Random 4-bit experts at gpt-oss-20b (32 experts) and gpt-oss-120b (128 experts) shapes
(H = I = 2880, top-4, bf16 activations, biases + swiglu_oai): code bytes uniform in 0..255,
E8M0 scales in 119..127 (2^-8 .. 2^0: finite), LAYERS distinct layers with their own
random routing, so a pass over them does not sit in the 50 MB L2. For T = 1, 4, 8 tokens, each
launch config (the shape table's, and every MXFP4_GATE_UP_CONFIGS / MXFP4_DOWN_CONFIGS
candidate with the other kernel at its table config) is first checked against `fused_moe_mxfp4_ref` in float32 on the chosen experts (relative error
under 2e-2, outputs poisoned with NaN first; a mismatch stops the run), then timed in CUDA
graphs over the layers, median of the replays: the gate_up kernel alone, down alone, and
the whole `fused_moe_mxfp4_decode`. Bandwidth: the bytes a kernel must read (the distinct chosen
experts' code blocks, scales and biases) per microsecond, as a share of the device-to-device
copy bandwidth (read + write) measured in the same run.

    python benchmarks/mxfp4.py                        # $OUT/mxfp4.json; ~2 min on an H100
    python benchmarks/mxfp4.py --configs table
    python benchmarks/mxfp4.py --cpu-smoke            # tiny shapes, TRITON_INTERPRET=1: checks only
    python benchmarks/mxfp4.py --crossover 8,16,32,64 # decode kernels vs grouped GEMM per T
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

if "--cpu-smoke" in sys.argv:  # before Triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import out_dir as results_dir  # noqa: E402

# name: (hidden H, moe_intermediate_size I, experts E, top_k)
MODELS = {"gpt-oss-20b": (2880, 2880, 32, 4), "gpt-oss-120b": (2880, 2880, 128, 4)}
SMOKE_MODELS = {"tiny": (96, 160, 8, 2)}
TOKENS = (1, 4, 8)
SMOKE_TOKENS = (1, 3)
LAYERS = 8  # gpt-oss-20b: 8 x 4 chosen experts x 7.3 MB = 233 MB a pass, far over the L2
Config = tuple[int, int, int]


@dataclass
class Layer:
    w13_blocks: torch.Tensor  # [E, 2I, H / 32, 16] uint8
    w13_scales: torch.Tensor  # [E, 2I, H / 32] uint8
    w2_blocks: torch.Tensor  # [E, H, I / 32, 16] uint8
    w2_scales: torch.Tensor  # [E, H, I / 32] uint8
    w13_bias: torch.Tensor  # [E, 2I]
    w2_bias: torch.Tensor  # [E, H]


def make_layer(H: int, inter: int, E: int, gen: torch.Generator, device: str) -> Layer:
    def codes(*shape: int) -> torch.Tensor:
        return torch.randint(0, 256, shape, generator=gen, device=device, dtype=torch.uint8)

    def scales(*shape: int) -> torch.Tensor:
        return torch.randint(119, 128, shape, generator=gen, device=device, dtype=torch.uint8)

    def bias(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device).to(torch.bfloat16)

    return Layer(
        codes(E, 2 * inter, H // 32, 16), scales(E, 2 * inter, H // 32),
        codes(E, H, inter // 32, 16), scales(E, H, inter // 32),
        bias(E, 2 * inter), bias(E, H),
    )  # fmt: skip


def routing(T: int, E: int, top_k: int, gen: torch.Generator, device: str) -> tuple:
    logits = torch.randn(T, E, generator=gen, device=device)
    w, ids = logits.softmax(-1).topk(top_k, dim=-1)
    return w, ids.to(torch.int32)


def epilogue(layer: Layer):  # -> moe_triton.Epilogue
    from specserve.ops.moe_triton import Epilogue

    return Epilogue(
        w13_bias=layer.w13_bias, w2_bias=layer.w2_bias, activation="swiglu_oai", alpha=1.702,
        limit=7.0,
    )  # fmt: skip


def reference(x: torch.Tensor, layer: Layer, route: tuple) -> torch.Tensor:
    """`fused_moe_mxfp4_ref` on the chosen experts only (dequantizing all 128 would take GBs)."""
    from specserve.ops.moe_mxfp4 import fused_moe_mxfp4_ref

    tw, ids = route
    chosen, local = torch.unique(ids, return_inverse=True)
    pick = [
        t[chosen.long()]
        for t in (layer.w13_blocks, layer.w13_scales, layer.w2_blocks, layer.w2_scales)
    ]
    small = Layer(*pick, *(b[chosen.long()].float() for b in (layer.w13_bias, layer.w2_bias)))
    # NOTE: in float32, so the error measured is the kernels' own (a bf16 reference rounds
    # its gate / up products too, and would add its rounding to theirs).
    ref = fused_moe_mxfp4_ref(x.float(), *pick, tw, local.to(torch.int32), epilogue(small))
    return ref.to(x.dtype)


def floor_bytes(layer: Layer, ids: torch.Tensor) -> tuple[int, int]:
    """(gate_up, down) bytes the kernels must read: the distinct chosen experts' blocks,
    scales and biases."""
    n = len(torch.unique(ids))

    def per_expert(*ts: torch.Tensor) -> int:
        return sum(t[0].numel() * t.element_size() for t in ts)

    l = layer  # noqa: E741
    return (
        n * per_expert(l.w13_blocks, l.w13_scales, l.w13_bias),
        n * per_expert(l.w2_blocks, l.w2_scales, l.w2_bias),
    )


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def config_pairs(H: int, inter: int, top_k: int, keep: list[str]) -> list:
    """(gate_up, down) pairs to run: the table's, and each candidate with the other kernel at
    its table config; `keep`: substrings of pair names ("table": the table pair)."""
    from specserve.ops import moe_mxfp4 as mx

    table = mx.mxfp4_decode_configs(H, inter, top_k)
    pairs = [table]
    pairs += [(g, table[1]) for g in mx.MXFP4_GATE_UP_CONFIGS]
    pairs += [(table[0], d) for d in mx.MXFP4_DOWN_CONFIGS]
    pairs = list(dict.fromkeys(pairs))
    if not keep:
        return pairs
    return [p for p in pairs if any(k == "table" and p == table or k in name(p) for k in keep)]


def name(pair: tuple[Config, Config]) -> str:
    (g, d) = pair
    return "gu" + "x".join(map(str, g)) + "_dn" + "x".join(map(str, d))


def kernels(pair: tuple[Config, Config]) -> dict[str, Callable]:
    """Per-layer calls: gate_up alone, down alone (its input precomputed), the whole op."""
    from specserve.ops import moe_mxfp4 as mx

    def gate_up(x: torch.Tensor, layer: Layer, route: tuple, bufs: dict) -> None:
        mx._gate_up(
            x, layer.w13_blocks, layer.w13_scales, route[1], bufs["inter"],
            epilogue(layer), pair[0],
        )  # fmt: skip

    def down(x: torch.Tensor, layer: Layer, route: tuple, bufs: dict) -> None:
        mx._down(
            bufs["inter"], layer.w2_blocks, layer.w2_scales, route[0], route[1],
            bufs["out"], epilogue(layer), pair[1],
        )  # fmt: skip

    def fused(x: torch.Tensor, layer: Layer, route: tuple, bufs: dict) -> None:
        mx.fused_moe_mxfp4_decode(
            x, layer.w13_blocks, layer.w13_scales, layer.w2_blocks, layer.w2_scales, *route,
            epilogue=epilogue(layer), configs=pair,
        )  # fmt: skip

    return {"gate_up": gate_up, "down": down, "fused": fused}


def check(pair: tuple, xs: list, layers: list, routes: list, refs: list) -> float:
    """The worst relative error over the layers of the two kernels (into NaN-poisoned buffers)
    and of the whole op against a float32 reference; stops the run above 2e-2 (as
    benchmarks/moe.py). NOTE: the kernels in float32 match it to ~1e-7; in bf16, rounding the
    intermediate to bf16 alone puts them ~7e-3 off at random weights."""
    from specserve.ops import moe_mxfp4 as mx

    worst = 0.0
    for x, layer, route, ref in zip(xs, layers, routes, refs):
        T, top_k = route[1].shape
        inter_size = layer.w2_blocks.shape[2] * 32
        bufs = {
            "inter": torch.full(
                (T * top_k, inter_size), float("nan"), dtype=x.dtype, device=x.device
            ),
            "out": torch.full_like(x, float("nan")),
        }
        calls = kernels(pair)
        calls["gate_up"](x, layer, route, bufs)
        calls["down"](x, layer, route, bufs)
        out = mx.fused_moe_mxfp4_decode(
            x, layer.w13_blocks, layer.w13_scales, layer.w2_blocks, layer.w2_scales, *route,
            epilogue=epilogue(layer), configs=pair,
        )  # fmt: skip
        worst = max(worst, rel_err(bufs["out"], ref), rel_err(out, ref))
    if not worst < 2e-2:
        raise SystemExit(f"MISMATCH {name(pair)}: relative error {worst:.3e}")
    return worst


def timed(call: Callable, xs: list, layers: list, routes: list, bufs: list) -> float:
    """Microseconds a layer: one call a layer, all layers in one CUDA graph."""
    from moe import graph_us

    def fn() -> None:
        for x, layer, route, b in zip(xs, layers, routes, bufs):
            call(x, layer, route, b)

    return graph_us(fn, replays=20) / len(xs)


def bench_model(model: str, shape: tuple, args: argparse.Namespace, bw: float | None) -> list:
    H, inter, E, top_k = shape
    device = "cpu" if args.cpu_smoke else "cuda"
    gen = torch.Generator(device).manual_seed(0)
    n_layers = 1 if args.cpu_smoke else args.layers
    layers = [make_layer(H, inter, E, gen, device) for _ in range(n_layers)]
    keep = args.configs.split(",") if args.configs else []
    rows = []
    for T in SMOKE_TOKENS if args.cpu_smoke else TOKENS:
        xs = [torch.randn(T, H, generator=gen, device=device).bfloat16() for _ in layers]
        routes = [routing(T, E, top_k, gen, device) for _ in layers]
        with torch.inference_mode():
            refs = [reference(x, layer, r) for x, layer, r in zip(xs, layers, routes)]
            sizes = [floor_bytes(layer, r[1]) for layer, r in zip(layers, routes)]
            gate_up_bytes = sum(s[0] for s in sizes) / len(sizes)
            down_bytes = sum(s[1] for s in sizes) / len(sizes)
            distinct = sum(len(torch.unique(r[1])) for r in routes) / len(routes)
            for pair in config_pairs(H, inter, top_k, keep):
                row = {
                    "model": model, "T": T,
                    "gate_up_config": pair[0], "down_config": pair[1],
                    "distinct_experts": distinct, "gate_up_MB": gate_up_bytes / 1e6,
                    "down_MB": down_bytes / 1e6,
                    "rel_err": check(pair, xs, layers, routes, refs),
                }  # fmt: skip
                if not args.cpu_smoke:
                    row.update(time_pair(pair, xs, layers, routes, bw))
                    row["pct_bw"] = {
                        k: 100 * b / (row[f"{k}_us"] * 1e-6) / bw
                        for k, b in (
                            ("gate_up", gate_up_bytes), ("down", down_bytes),
                            ("fused", gate_up_bytes + down_bytes),
                        )
                    }  # fmt: skip
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def time_pair(pair: tuple, xs: list, layers: list, routes: list, bw: float) -> dict:
    T, top_k = routes[0][1].shape
    inter_size = layers[0].w2_blocks.shape[2] * 32
    bufs = [
        {
            "inter": torch.empty(T * top_k, inter_size, dtype=x.dtype, device=x.device),
            "out": torch.empty_like(x),
        }
        for x in xs
    ]
    calls = kernels(pair)
    for x, layer, r, b in zip(xs, layers, routes, bufs):  # down's inputs, as gate_up leaves them
        calls["gate_up"](x, layer, r, b)
    return {f"{k}_us": timed(call, xs, layers, routes, bufs) for k, call in calls.items()}


def crossover(model: str, shape: tuple, tokens: list[int], args: argparse.Namespace, bw) -> list:
    """Per T: the whole op by the decode kernels (table configs) and by the
    grouped GEMM (its table config), each checked against the reference, then timed."""
    from specserve.ops import moe_mxfp4 as mx
    from specserve.ops.moe_mxfp4_gemm import fused_moe_mxfp4_gemm

    H, inter, E, top_k = shape
    device = "cpu" if args.cpu_smoke else "cuda"
    gen = torch.Generator(device).manual_seed(1)
    layers = [
        make_layer(H, inter, E, gen, device) for _ in range(1 if args.cpu_smoke else args.layers)
    ]

    def decode(x: torch.Tensor, layer: Layer, route: tuple, bufs: dict) -> torch.Tensor:
        blocks = (layer.w13_blocks, layer.w13_scales, layer.w2_blocks, layer.w2_scales)
        return mx.fused_moe_mxfp4_decode(x, *blocks, *route, epilogue=epilogue(layer))

    def gemm(x: torch.Tensor, layer: Layer, route: tuple, bufs: dict) -> torch.Tensor:
        blocks = (layer.w13_blocks, layer.w13_scales, layer.w2_blocks, layer.w2_scales)
        return fused_moe_mxfp4_gemm(x, *blocks, *route, epilogue=epilogue(layer))

    rows = []
    for T in tokens:
        xs = [torch.randn(T, H, generator=gen, device=device).bfloat16() for _ in layers]
        routes = [routing(T, E, top_k, gen, device) for _ in layers]
        with torch.inference_mode():
            refs = [reference(x, layer, r) for x, layer, r in zip(xs, layers, routes)]
            nbytes = sum(sum(floor_bytes(ly, r[1])) for ly, r in zip(layers, routes)) / len(layers)
            for path, call in (("decode", decode), ("gemm", gemm)):
                err = max(
                    rel_err(call(x, ly, r, {}), ref)
                    for x, ly, r, ref in zip(xs, layers, routes, refs)
                )
                if not err < 2e-2:
                    raise SystemExit(f"MISMATCH {path} T={T}: relative error {err:.3e}")
                row = {"model": model, "T": T, "path": path, "rel_err": err, "MB": nbytes / 1e6}
                if not args.cpu_smoke:
                    us = timed(call, xs, layers, routes, [{} for _ in xs])
                    row.update(us=us, pct_bw=100 * nbytes / (us * 1e-6) / bw)
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def crossover_summary(rows: list) -> None:
    print("the whole op, us a layer in CUDA graphs (% of copy bandwidth on the distinct experts)")
    print(f"{'model':>13} {'T':>3} {'decode us':>10} {'%':>4} {'gemm us':>9} {'%':>4}")
    by = {(r["model"], r["T"], r["path"]): r for r in rows}
    for model, T in dict.fromkeys((r["model"], r["T"]) for r in rows):
        d, g = by[(model, T, "decode")], by[(model, T, "gemm")]
        print(
            f"{model:>13} {T:>3} {d['us']:10.1f} {d['pct_bw']:4.0f} {g['us']:9.1f} "
            f"{g['pct_bw']:4.0f}"
        )


def summary(rows: list) -> None:
    """Per model and T: the table pair and the fastest pair (whole op)."""
    print("us a layer in CUDA graphs; % of copy bandwidth on the bytes each kernel must read")
    head = f"{'model':>13} {'T':>2} {'pair':>6} {'configs':>28}"
    print(head + f" {'gate_up us':>10} {'%':>4} {'down us':>8} {'%':>4} {'fused us':>9} {'%':>4}")
    groups: dict[tuple, list] = {}
    for r in rows:
        groups.setdefault((r["model"], r["T"]), []).append(r)
    for (model, T), rs in groups.items():
        best = min(rs, key=lambda r: r["fused_us"])
        for label, r in (("table", rs[0]), ("best", best)):
            p = r["pct_bw"]
            print(
                f"{model:>13} {T:>2} {label:>6} "
                f"{name((r['gate_up_config'], r['down_config'])):>28} "
                f"{r['gate_up_us']:10.1f} {p['gate_up']:4.0f} {r['down_us']:8.1f} {p['down']:4.0f}"
                f" {r['fused_us']:9.1f} {p['fused']:4.0f}"
            )


def patch_interpreter() -> None:
    """As tests/test_triton_attention.py's `interpreter` fixture: Triton 3.6's interpreter
    holds scalars as 1-element arrays and int()s them, which numpy >= 2.3 rejects (`range`
    with tensor bounds fails)."""
    from triton.runtime import interpreter as ti

    patch_tensor = ti._patch_lang_tensor

    def patch_lang_tensor(tensor: type, scope: ti._LangPatchScope) -> None:
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    ti._patch_lang_tensor = patch_lang_tensor


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU, no timing")
    ap.add_argument("--models", default=None, help=f"comma-separated of {list(MODELS)}")
    ap.add_argument(
        "--configs", default=None,
        help="keep config pairs whose name (gu8x1024x4_dn8x256x4) contains one of these "
        "comma-separated strings; 'table': the shape tables' pair",
    )  # fmt: skip
    ap.add_argument("--layers", type=int, default=LAYERS)
    ap.add_argument(
        "--crossover", default=None,
        help="comma-separated token counts: time the default decode kernels against the "
        "grouped GEMM at each (which path fused_moe_mxfp4_triton should take), then stop",
    )  # fmt: skip
    args = ap.parse_args()
    t0 = time.time()
    models = SMOKE_MODELS if args.cpu_smoke else MODELS
    if args.models:
        models = {m: models[m] for m in args.models.split(",")}
    bw = None
    if args.cpu_smoke:
        patch_interpreter()
    else:
        from decode import copy_bandwidth

        bw = copy_bandwidth(1 << 30, rounds=3)
    rows = []
    for model, shape in models.items():
        if args.crossover:
            rows += crossover(model, shape, [int(t) for t in args.crossover.split(",")], args, bw)
            continue
        rows += bench_model(model, shape, args, bw)
        if not args.cpu_smoke:
            torch.cuda.empty_cache()
    result = {
        "device": "cpu" if args.cpu_smoke else torch.cuda.get_device_name(),
        "command": " ".join(sys.argv),
        "copy_bw_GBs": None if bw is None else bw / 1e9,
        "layers": args.layers,
        "seconds": time.time() - t0,
        "rows": rows,
    }
    out_dir = results_dir()
    with open(os.path.join(out_dir, "mxfp4.json"), "w") as f:
        json.dump(result, f, indent=1)
    if args.cpu_smoke:
        print(f"cpu smoke: {len(rows)} checks OK")
        return
    print(f"\n{result['device']}  copy bandwidth {bw / 1e9:.0f} GB/s (read + write)")
    if args.crossover:
        crossover_summary(rows)
        return
    summary(rows)


if __name__ == "__main__":
    main()
