"""Tensor parallelism: plain decode and speculative step cost at TP = 1 / 2 / 4 / 8 (dummy weights).

For each tensor-parallel size (one engine process per GPU, NCCL) and batch 1 / 16 / 64:
  - ms per plain decode step (engine.step after the prefill, as benchmarks/spec_step.py times
    it), against the per-GPU bandwidth floor: the bytes each GPU must read a step (its shard of
    the weights, its share of the KV cache read) over the copy bandwidth measured here on GPU 0
    (benchmarks/decode.py's step_bytes and copy_bandwidth);
  - ms per speculative K = 3 step (fixed K, synthetic acceptance 0.7; an EAGLE-3-shaped head
    sharded like the target, or the model's own MTP layer where it has one) against the plain
    step;
  - the all-reduce time a step: one all-reduce of [batch, hidden] in the model dtype, timed
    over many iterations (CUDA events; replayed from a CUDA graph, as the engine's captured
    steps run it, and launched eagerly), x 2 a layer (o_proj, down_proj) x the layers, and its
    share of the plain step. Not counted: the embedding's all-reduce and lm_head's all-gather
    (one each a step) and the drafter's collectives.
The all-reduces run in a separate group of the engine's kind (specserve.distributed's
TensorParallel: NCCL, NVLink multicast off) that this script starts over the same GPUs with
torch.multiprocessing, while no engine holds them: the engine's own group is reachable from rank
0 (`llm.engine.tp`) but useless alone, since a collective needs every rank and ranks 1..N-1 only
run the steps rank 0 sends them (specserve/engine/tp_executor.py).

Shapes: llama3-8b (TP 1, 2 by default) and llama3-70b (TP 4, 8; an EAGLE-3 head of the
published 70B layout), bf16; gpt-oss-120b (TP 1, 2; MXFP4 experts, the gpt-oss EAGLE-3 head
shape) and glm-4.5-air (TP 2; its MTP layer; bf16, ~212 GB of weights: two H200s), batches 1 and
16, no floor (the floor counts dense weights); tiny: a float32 test-size Llama for the CPU smoke run (gloo, wall
clock instead of CUDA events, no floor). Prints a table last; $OUT/tp_decode.json (OUT default
./out). Exits 1 if any part failed (after writing what it has), and refuses to start when the
machine has fewer GPUs than the largest TP size.

    python benchmarks/tp_decode.py                              # llama3-8b, TP 1 and 2
    python benchmarks/tp_decode.py --shape llama3-70b           # TP 4 and 8 (8 GPUs)
    python benchmarks/tp_decode.py --shape llama3-70b --tp 4    # 4 GPUs
    python benchmarks/tp_decode.py --tp 1,2 --batches 1,16 --steps 12
    python benchmarks/tp_decode.py --shape gpt-oss-120b        # TP 1 and 2 (2 GPUs)
    python benchmarks/tp_decode.py --shape glm-4.5-air         # TP 2 (2 H200s)
    python benchmarks/tp_decode.py --device cpu --shape tiny --tp 1,2   # smoke run (gloo)
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import queue
import sys
import tempfile
import time
import traceback
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import write_json  # noqa: E402
from decode import LLAMA3_8B, copy_bandwidth, step_bytes, write_config  # noqa: E402
from gpt_oss_decode import GPT_OSS_120B, GPT_OSS_EAGLE3  # noqa: E402
from moe_decode import GLM45_AIR  # noqa: E402
from serve_shape import EAGLE3_HEAD_70B, LLAMA3_70B, TINY, TINY_HEAD  # noqa: E402
from spec_step import EAGLE3_HEAD, measure, synthetic_spec  # noqa: E402

# shape -> (target config, EAGLE-3 head config, or None: the target's own MTP layer drafts)
SHAPES: dict[str, tuple[dict, dict | None]] = {
    "llama3-8b": (LLAMA3_8B, EAGLE3_HEAD),
    "llama3-70b": (LLAMA3_70B, EAGLE3_HEAD_70B),
    "gpt-oss-120b": (GPT_OSS_120B, GPT_OSS_EAGLE3),
    "glm-4.5-air": (GLM45_AIR, None),
    "tiny": (TINY, TINY_HEAD),
}
DEFAULT_TP = {
    "llama3-8b": [1, 2], "llama3-70b": [4, 8], "gpt-oss-120b": [1, 2], "glm-4.5-air": [2],
    "tiny": [1, 2],
}  # fmt: skip
MOE_BATCHES = "1,16"  # the MoE shapes' default batches
K = 3
ACCEPTANCE = 0.7
HOST = "127.0.0.1"
WHY_SEPARATE_GROUP = (
    "all-reduce timed in a separate group of the engine's kind (specserve TensorParallel) over "
    "the same devices, started by this script with torch.multiprocessing while no engine runs: "
    "the engine's group (llm.engine.tp) is reachable from rank 0, but its ranks 1..N-1 only run "
    "the steps rank 0 sends them, so a collective rank 0 issued alone would wait for them forever"
)


# ---- the all-reduce, in a group of this script's own ------------------------------------------
def _time_allreduce_eager(tp: Any, x: torch.Tensor, iters: int) -> float:
    """Microseconds per all-reduce of `x`, launched `iters` times back to back (CUDA events;
    the wall clock on the CPU, where gloo returns when the sum is done)."""
    for _ in range(5):  # NCCL's communicator starts at the first collective
        tp.all_reduce(x)
    if not x.is_cuda:
        t0 = time.perf_counter()
        for _ in range(iters):
            tp.all_reduce(x)
        return 1e6 * (time.perf_counter() - t0) / iters
    # All ranks leave this synchronized point together, so no rank's first collective waits
    # for a late peer inside the timed window.
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        tp.all_reduce(x)
    end.record()
    end.synchronize()
    return 1e3 * start.elapsed_time(end) / iters


def _time_allreduce_graph(tp: Any, x: torch.Tensor, iters: int, per_graph: int = 20) -> float:
    """Microseconds per all-reduce of `x` replayed from a CUDA graph of `per_graph` of them: the
    engine captures its collectives inside its step graphs, so no launch cost per call."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # the capture stream warmed first, as torch advises
        for _ in range(3):
            tp.all_reduce(x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(per_graph):
            tp.all_reduce(x)
    graph.replay()
    torch.cuda.synchronize()
    reps = max(1, iters // per_graph)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return 1e3 * start.elapsed_time(end) / (reps * per_graph)


def _allreduce_rank(
    rank: int,
    world: int,
    port: int,
    device_type: str,
    dtype: torch.dtype,
    hidden: int,
    rows: list[int],
    iters: int,
    results: Any,
) -> None:
    """One rank of the timing group (a torch.multiprocessing child): eager times of every row
    count first, posted at once, then graph times, so a failed capture keeps the eager ones."""
    from specserve.distributed import TensorParallel

    torch.set_num_threads(1)  # gloo ranks share the cores; the sums are tiny
    device = torch.device("cpu")
    if device_type == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=120)
    store = dist.TCPStore(HOST, port, world, is_master=False, timeout=timeout)
    tp = TensorParallel(rank, world, HOST, port, device, 120.0, store)
    # Zeros: the sum stays zero however many times it runs (the data does not change the cost).
    xs = {n: torch.zeros(n, hidden, dtype=dtype, device=device) for n in rows}
    results.put(("eager", rank, {n: _time_allreduce_eager(tp, x, iters) for n, x in xs.items()}))
    if device.type == "cuda":
        try:
            graph = {n: _time_allreduce_graph(tp, x, iters) for n, x in xs.items()}
            results.put(("graph", rank, graph))
        except Exception:  # noqa: BLE001 - reported by the parent; the eager times stand
            results.put(("graph_error", rank, traceback.format_exc(limit=3)))
    results.put(("done", rank, None))


def allreduce_times(
    tp: int, device: str, dtype: torch.dtype, hidden: int, rows: list[int], iters: int
) -> dict[str, Any]:
    """Per row count: microseconds per all-reduce of [rows, hidden], the slowest rank's (every
    rank waits for it), eager and (CUDA) graph-replayed, from `tp` processes on devices
    0..tp-1. {"eager": {rows: us}, "graph": {rows: us}, "errors": [...]}."""
    import torch.distributed as dist
    import torch.multiprocessing as tmp

    # This process serves the rendezvous store (any free port), so no rank races for a port.
    master = dist.TCPStore(
        HOST, 0, tp, is_master=True, timeout=datetime.timedelta(seconds=120),
        wait_for_workers=False,
    )  # fmt: skip
    results = tmp.get_context("spawn").Queue()
    args = (tp, master.port, device, dtype, hidden, rows, iters, results)
    ctx = tmp.spawn(_allreduce_rank, args=args, nprocs=tp, join=False)
    out: dict[str, Any] = {"eager": {}, "graph": {}, "errors": []}
    per_rank: dict[str, dict[int, dict[int, float]]] = {"eager": {}, "graph": {}}
    done, deadline = 0, time.monotonic() + 300
    try:
        while done < tp and time.monotonic() < deadline:
            try:
                kind, rank, payload = results.get(timeout=1.0)
            except queue.Empty:
                # A rank that died posts nothing more: join() raises with its traceback.
                ctx.join(timeout=0)
                continue
            if kind == "done":
                done += 1
            elif kind == "graph_error":
                out["errors"].append(f"rank {rank} graph capture: {payload}")
            else:
                per_rank[kind][rank] = payload
        if done < tp:
            out["errors"].append(f"timing group did not finish in 300 s ({done}/{tp} ranks)")
        ctx.join(timeout=30)
    except Exception as e:  # noqa: BLE001 - a rank failed: keep what the others posted
        out["errors"].append(f"{type(e).__name__}: {e}")
    finally:
        for p in ctx.processes:  # only this call's children
            if p.is_alive():
                p.kill()
                p.join(5)
        del master
    for kind, ranks in per_rank.items():
        if len(ranks) == tp:
            out[kind] = {n: max(r[n] for r in ranks.values()) for n in rows}
    return out


# ---- engines ----------------------------------------------------------------------------------
def engine_rows(
    target: str, spec: dict | None, tp: int, args: argparse.Namespace, vocab: int
) -> dict[int, dict]:
    """measure() of every batch on one engine of `tp` ranks, shut down (workers ended, KV cache
    and graphs freed) and dropped before this returns, so the next engine finds the GPUs free."""
    from specserve import LLM

    cuda = args.device == "cuda"
    max_len = max(1024, args.prompt_len + 700)  # measure() asks 600 new tokens a request
    llm = LLM(
        target,
        tensor_parallel_size=tp,
        load_format="dummy",
        device=args.device,
        dtype="bfloat16" if cuda else "float32",
        max_model_len=max_len,
        max_num_seqs=max(args.batches),
        # A pool of exactly max_num_seqs full-length sequences (the most the engine would size
        # anyway), not one sized from free memory: every TP size gets the same pool.
        num_gpu_blocks_override=max(args.batches) * -(-max_len // 16),
        block_size=16,
        speculative_config=spec,
        # Under TP the engine never times the Triton gemv plan (engine.py): cuBLAS at every TP
        # size keeps the sizes on the same kernels.
        decode_matmul=args.decode_matmul,
        async_scheduling=False if args.sync else None,  # None: the device's default
        # measure() warms the batch it times; the start-up warm-up of every shape would only
        # lengthen each engine.
        warmup=False,
        disable_log_stats=True,
    )
    try:
        out = {}
        for b in args.batches:
            r = measure(llm.engine, b, steps=args.steps, prompt_len=args.prompt_len,
                        vocab_size=vocab)  # fmt: skip
            # draft_ms: measure() arms the drafting events on the engine's runner, which under
            # TP is the executor, not the ModelRunner that records them: 0, so not reported.
            r.pop("draft_ms")
            out[b] = r
            print(f"  TP={tp} {spec['method'] if spec else 'plain':>6} B={b:>3}: "
                  f"{r['ms_per_step']:.3f} ms/step", flush=True)  # fmt: skip
        return out
    finally:
        llm.shutdown()
        del llm
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()


def per_gpu_step_bytes(cfg: dict, tp: int, batch: int, context: int) -> float:
    """Bytes each GPU must read a decode step: its shard of the weights decode.step_bytes counts
    (all but the embedding; norms are replicated but count as sharded here: < 0.01% of them)
    and its share of the KV read, KV heads being split over min(tp, KV heads) GPUs."""
    weights = step_bytes(cfg, 0, context)
    kv = step_bytes(cfg, batch, context) - weights
    return weights / tp + kv / min(tp, cfg["num_key_value_heads"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama3-8b", choices=list(SHAPES))
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--tp", default=None, help="TP sizes, e.g. 1,2 (default: per shape)")
    ap.add_argument("--batches", default=None, help="default 1,16,64 (MoE shapes: 1,16)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (20; tiny: 4)")
    ap.add_argument("--prompt-len", type=int, default=None, help="context (128; tiny: 16)")
    ap.add_argument("--ar-iters", type=int, default=None, help="all-reduces timed (200; cpu 50)")
    ap.add_argument("--decode-matmul", default="cublas", help="cublas (default) | triton | auto")
    ap.add_argument("--sync", action="store_true", help="synchronous steps (default: async)")
    args = ap.parse_args()
    tiny, cuda = args.shape == "tiny", args.device == "cuda"
    tps = [int(t) for t in args.tp.split(",")] if args.tp else DEFAULT_TP[args.shape]
    moe = args.shape in ("gpt-oss-120b", "glm-4.5-air")
    args.batches = [
        int(b) for b in (args.batches or (MOE_BATCHES if moe else "1,16,64")).split(",")
    ]
    args.steps = args.steps or (4 if tiny else 20)
    args.prompt_len = args.prompt_len or (16 if tiny else 128)
    iters = args.ar_iters or (200 if cuda else 50)
    if not cuda:
        # Every rank is a process on the same cores: one intra-op thread each (the engine's
        # workers take this process's count), or OpenMP spin-waits slow each step many times.
        torch.set_num_threads(1)
    else:
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if have < max(tps):
            sys.exit(
                f"tp_decode.py: TP {max(tps)} needs {max(tps)} GPUs, this machine has {have}; "
                "pass --tp with smaller sizes (or --device cpu --shape tiny for the smoke run)"
            )
    t_start = time.time()
    target_cfg, head_cfg = SHAPES[args.shape]
    hidden, layers = target_cfg["hidden_size"], target_cfg["num_hidden_layers"]
    notes: list[str] = []
    vocab = min(target_cfg["vocab_size"] - 16, 128000)
    dtype = torch.bfloat16 if cuda else torch.float32
    root = tempfile.mkdtemp(prefix="tp-decode-")
    target = write_config(target_cfg, os.makedirs(f"{root}/target") or f"{root}/target")
    if head_cfg is not None:
        head = write_config(head_cfg, os.makedirs(f"{root}/eagle3") or f"{root}/eagle3")
        spec = synthetic_spec(head, K, ACCEPTANCE)
    else:  # the target's MTP layer, K = 3 recurrent steps of it
        spec = {
            "method": "mtp", "num_speculative_tokens": K, "rejection_sample_method": "synthetic",
            "synthetic_acceptance_rate": ACCEPTANCE, "adaptive": False,
        }  # fmt: skip
    bw_before = None
    if cuda:
        bw_before = copy_bandwidth()
        torch.cuda.empty_cache()  # its 4 GB stay cached otherwise, and GPU 0's KV pool shrinks
    errors: list[str] = []
    per_tp: dict[int, dict[str, Any]] = {}
    for tp in tps:
        got: dict[str, Any] = {"plain": {}, "spec": {}, "allreduce": None}
        per_tp[tp] = got
        if tp > 1:
            # Before this size's engines, while none holds the GPUs: the same NCCL group kind.
            verify = [b * (K + 1) for b in args.batches]  # a speculative step's verified rows
            rows = sorted(set(args.batches) | set(verify))
            print(f"TP={tp}: all-reduce of [rows, {hidden}] {str(dtype)[6:]} x {iters}", flush=True)
            got["allreduce"] = ar = allreduce_times(tp, args.device, dtype, hidden, rows, iters)
            errors += [f"TP={tp} all-reduce: {e}" for e in ar["errors"]]
        for name, s in (("plain", None), ("spec", spec)):
            print(f"TP={tp}: {name} engine", flush=True)
            try:
                got[name] = engine_rows(target, s, tp, args, vocab)
            except Exception as e:  # noqa: BLE001 - the other sizes still run; exit 1 at the end
                errors.append(f"TP={tp} {name}: {type(e).__name__}: {e}")
                traceback.print_exc()
    bw = None
    if cuda:
        bw = max(bw_before or 0.0, copy_bandwidth())  # the better of before and after (decode.py)
        torch.cuda.empty_cache()
    # Mean context over the timed steps: the prompt, measure()'s prefill token and 4 warm-up
    # steps, half the timed ones.
    ctx = args.prompt_len + 5 + args.steps // 2
    table = []
    for tp, got in per_tp.items():
        ar = got["allreduce"] or {}
        ar_us = ar.get("graph") or ar.get("eager") or {}
        for b in args.batches:
            plain, drafted = got["plain"].get(b), got["spec"].get(b)
            row: dict[str, Any] = {"tp": tp, "batch": b, "plain": plain, "spec": drafted}
            p_ms = plain["ms_per_step"] if plain else None
            e_ms = drafted["ms_per_step"] if drafted else None
            if bw and not moe:
                row["floor_ms"] = 1e3 * per_gpu_step_bytes(target_cfg, tp, b, ctx) / bw
                row["of_floor"] = row["floor_ms"] / p_ms if p_ms else None
            row["spec_x_plain"] = e_ms / p_ms if p_ms and e_ms else None
            if b in ar_us:
                # 2 all-reduces a layer: o_proj's and down_proj's row-parallel outputs.
                row["allreduce_us"] = ar_us[b]
                row["allreduce_eager_us"] = ar.get("eager", {}).get(b)
                row["allreduce_graph_us"] = ar.get("graph", {}).get(b)
                row["allreduce_ms_per_step"] = ms = ar_us[b] * 2 * layers / 1e3
                row["allreduce_share"] = ms / p_ms if p_ms else None
                v_us = ar_us.get(b * (K + 1))
                if v_us is not None:  # the target's verification of K + 1 rows a request
                    row["verify_allreduce_ms_per_step"] = v_ms = v_us * 2 * layers / 1e3
                    row["verify_allreduce_share"] = v_ms / e_ms if e_ms else None
            table.append(row)
    timing = "CUDA graph replay" if cuda else "wall clock (gloo)"
    if cuda and any((g["allreduce"] or {}).get("errors") for g in per_tp.values()):
        timing = "CUDA graph replay where captured, else eager (CUDA events)"
    result = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "gpus": torch.cuda.device_count() if cuda else 0,
        "shape": args.shape,
        "config": target_cfg,
        "spec_method": spec["method"],
        "eagle3_head": head_cfg,
        "tp_sizes": tps,
        "batches": args.batches,
        "steps": args.steps,
        "prompt_len": args.prompt_len,
        "k": K,
        "acceptance": ACCEPTANCE,
        "decode_matmul": args.decode_matmul,
        "async_scheduling": cuda and not args.sync,
        "copy_bandwidth_GBs": bw / 1e9 if bw else None,
        "floor_context": ctx,
        "allreduce_group": "separate",
        "allreduce_note": WHY_SEPARATE_GROUP,
        "allreduce_timing": timing,
        "allreduce_iters": iters,
        "allreduce": {tp: g["allreduce"] for tp, g in per_tp.items()},
        "rows": table,
        "errors": errors,
        "notes": notes,
        "torch": torch.__version__,
        "wall_s": time.time() - t_start,
    }
    path = write_json("tp_decode.json", result)
    print(f"\nwrote {path}")
    for line in notes + [f"ERROR {e}" for e in errors]:
        print(line)

    def f(v: float | None, spec: str) -> str:
        return "-" if v is None else format(v, spec)

    def pct(v: float | None) -> str:
        return "-" if v is None else f"{100 * v:.1f}%"

    bw_txt = f"copy bandwidth {bw / 1e9:.0f} GB/s on GPU 0" if bw else "no floor on the CPU"
    where = f"{result['device']} x{max(tps)}" if cuda else "cpu"
    print(
        f"\n{where}; {args.shape} (dummy {str(dtype)[6:]}); {args.steps} timed steps after "
        f"{args.prompt_len}-token prompts; {bw_txt}"
    )
    print(f"{spec['method']} K={K}, synthetic acceptance {ACCEPTANCE}; AR: one all-reduce of [batch, "
          f"{hidden}] x 2 x {layers} layers, {timing}")  # fmt: skip
    print(f"NOTE {WHY_SEPARATE_GROUP}")
    print(
        f"{'TP':>3} {'batch':>5} {'plain ms':>9} {'floor ms':>9} {'of floor':>9} "
        f"{'spec ms':>10} {'x plain':>8} {'tok/step':>8} {'AR us':>8} {'AR ms/step':>10} "
        f"{'of step':>8}"
    )
    for r in table:
        p, e = r["plain"] or {}, r["spec"] or {}
        print(
            f"{r['tp']:>3} {r['batch']:>5} {f(p.get('ms_per_step'), '.3f'):>9} "
            f"{f(r.get('floor_ms'), '.3f'):>9} {pct(r.get('of_floor')):>9} "
            f"{f(e.get('ms_per_step'), '.3f'):>10} {f(r['spec_x_plain'], '.2f'):>8} "
            f"{f(e.get('tokens_per_step'), '.2f'):>8} {f(r.get('allreduce_us'), '.1f'):>8} "
            f"{f(r.get('allreduce_ms_per_step'), '.3f'):>10} {pct(r.get('allreduce_share')):>8}"
        )
    if errors:
        sys.exit(1)


if __name__ == "__main__":
    main()
