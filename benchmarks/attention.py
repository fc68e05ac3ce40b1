"""Triton paged attention vs the torch reference: decode batches, verification and a prefill.

Llama-3-8B attention shapes (32 query heads, 8 KV heads, head_dim 128), bf16, block size 16,
shuffled pages. Each row times one backend `forward` (KV write + attention) eagerly and replayed
from a CUDA graph (launch overhead removed). Long-context batch-1 rows also time the Triton
kernel with split-KV off ("triton-1split").

    python benchmarks/attention.py            # table last; $OUT/attention.json
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import write_json  # noqa: E402

from specserve.attention.backend import AttentionBackend, CommonAttentionMetadata  # noqa: E402
from specserve.attention.torch_ref import TorchAttentionBackend  # noqa: E402
from specserve.attention.triton_paged import TritonAttentionBackend  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16


def make_batch(
    num_reqs: int, context: int, query_len: int, dtype: torch.dtype, device: torch.device
) -> tuple[CommonAttentionMetadata, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`num_reqs` requests of `context` tokens whose last `query_len` are this step's queries."""
    g = torch.Generator().manual_seed(0)
    blocks_per_req = (context + BLOCK_SIZE - 1) // BLOCK_SIZE
    num_blocks = num_reqs * blocks_per_req + 1  # + the null block
    perm = torch.randperm(num_blocks - 1, generator=g).to(torch.int32)
    block_table = perm.view(num_reqs, blocks_per_req).to(device)
    T = num_reqs * query_len
    token_req = torch.arange(num_reqs, device=device).repeat_interleave(query_len)
    positions = context - query_len + torch.arange(T, device=device) % query_len
    pages = block_table[token_req, positions // BLOCK_SIZE].long()
    common = CommonAttentionMetadata(
        query_start_loc=torch.arange(num_reqs + 1, device=device, dtype=torch.int32) * query_len,
        seq_lens=torch.full((num_reqs,), context, dtype=torch.int32, device=device),
        positions=positions,
        block_table=block_table,
        slot_mapping=pages * BLOCK_SIZE + positions % BLOCK_SIZE,
        token_req=token_req,
        num_reqs=num_reqs,
        num_tokens=T,
        max_query_len=query_len,
        max_seq_len=context,
    )
    shape = (2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    kv_cache = torch.randn(shape, generator=g).to(dtype=dtype, device=device)
    q = torch.randn(T, NUM_HEADS, HEAD_DIM, generator=g).to(dtype=dtype, device=device)
    k = torch.randn(T, NUM_KV_HEADS, HEAD_DIM, generator=g).to(dtype=dtype, device=device)
    v = torch.randn(T, NUM_KV_HEADS, HEAD_DIM, generator=g).to(dtype=dtype, device=device)
    return common, q, k, v, kv_cache


def time_us(fn: Callable[[], object], iters: int) -> float:
    for _ in range(5):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def time_graph_us(fn: Callable[[], object], iters: int) -> float | None:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
    except RuntimeError:  # a backend that cannot be captured reports no graph time
        return None
    return time_us(graph.replay, iters)


def bench_case(
    name: str, num_reqs: int, context: int, query_len: int, iters: int
) -> list[dict[str, object]]:
    device = torch.device("cuda")
    common, q, k, v, kv_cache = make_batch(num_reqs, context, query_len, torch.bfloat16, device)
    scale = HEAD_DIM**-0.5
    rows = []
    outs = {}
    backends: list[AttentionBackend] = [TorchAttentionBackend(), TritonAttentionBackend()]
    for backend in backends:
        meta = backend.build(common, None)

        def fn(backend: AttentionBackend = backend, meta: object = meta) -> torch.Tensor:
            return backend.forward(q, k, v, kv_cache, meta, scale, None)

        outs[backend.name] = fn().float()
        rows.append(
            dict(
                case=name,
                backend=backend.name,
                num_reqs=num_reqs,
                context=context,
                query_len=query_len,
                eager_us=time_us(fn, iters),
                graph_us=time_graph_us(fn, iters),
            )
        )
    # The Triton kernel again with split-KV off, where the launcher would split.
    from unittest import mock

    from specserve.attention import launch_policy as tp

    if tp._num_splits(num_reqs * 2 * NUM_KV_HEADS, context + query_len, device) > 1:
        backend = TritonAttentionBackend()
        meta = backend.build(common, None)

        def one_split() -> torch.Tensor:
            return backend.forward(q, k, v, kv_cache, meta, scale, None)

        with mock.patch.object(tp, "_num_splits", lambda *a: 1):
            outs["triton-1split"] = one_split().float()
            rows.append(
                dict(
                    case=name,
                    backend="triton-1split",
                    num_reqs=num_reqs,
                    context=context,
                    query_len=query_len,
                    eager_us=time_us(one_split, iters),
                    graph_us=time_graph_us(one_split, iters),
                )
            )
    ref = outs["torch"]
    for r in rows:
        out = outs[r["backend"]]  # type: ignore[index]
        r["max_rel_err_vs_torch"] = ((out - ref).abs().max() / ref.abs().max()).item()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=384)
    ap.add_argument("--iters", type=int, default=100)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/attention.py needs a CUDA device.")
    cases = [(f"decode B={b}", b, args.context, 1) for b in (1, 16, 64)]
    cases += [("verify B=16 q=5", 16, args.context, 5), ("prefill 128", 1, 128, 128)]
    # Long contexts at batch 1: where split-KV applies (compared with one split).
    cases += [(f"decode B=1 ctx {c}", 1, c, 1) for c in (4096, 16384)]
    cases += [("verify B=1 q=5 ctx 8192", 1, 8192, 5)]
    rows = [r for c in cases for r in bench_case(*c, iters=args.iters)]

    def fmt(x: object) -> str:
        return "-" if x is None else f"{x:.1f}"

    print(f"device: {torch.cuda.get_device_name()}  heads {NUM_HEADS}/{NUM_KV_HEADS} d={HEAD_DIM}")
    print(f"{'case':<24}{'backend':<15}{'eager us':>10}{'graph us':>10}{'rel err':>10}")
    for r in rows:
        print(
            f"{r['case']:<24}{r['backend']:<15}{fmt(r['eager_us']):>10}{fmt(r['graph_us']):>10}"
            f"{r['max_rel_err_vs_torch']:>10.1e}"
        )
    path = write_json("attention.json", {"device": torch.cuda.get_device_name(), "results": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
