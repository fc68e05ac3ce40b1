"""One-token MoE decode in ONE persistent launch: gate_up, a grid-wide barrier, down.

The decode path's two kernels (moe_triton.py: gate_up, then down under PDL) stream a layer's
chosen experts at ~2.7 TB/s alone (benchmarks/moe_stream.py, RESULTS.md session 24) where a
long gemv streams ~3.1 TB/s: between the kernels, down's programs mostly wait for gate_up's
to leave the SMs (gate_up holds most of the registers), then ramp up in waves. Here a grid
that the SMs hold at once (`resident_per_sm` of the compiled kernel) runs both phases:

  phase 1  items (pair p, column block c) of gate_up, item i = p + c * P, program pid taking
           i = pid, pid + G, ...: inter[p, block] = silu(W1[e_p] x) * (W3[e_p] x), the next
           item's weights requested before the current item's sums (moe_triton's persistent
           gate_up, whose one K tile needs GK >= H);
  preload  the routing and the program's first down slab W2[e_j, n-block, :] for every pair
           j, requested before the barrier, so HBM keeps streaming while the last gate_up
           items finish;
  barrier  an arrival counter (release / acquire, gpu scope): every program waits for all G,
           which is safe only because all G are resident (grid <= SMs x resident_per_sm;
           a process held to a share of the SMs, e.g. under MPS's thread percentage, must
           leave this off);
           then the next kernel may launch (PDL trigger: not before, or its programs could
           take the slots of ours not yet resident and wait on us forever);
  phase 2  inter (all pairs, from L2) once, then down items n-block = pid, pid + G, ...:
           out[n] = sum_j w_j * (W2[e_j, n] @ inter[j]), the next slab requested before the
           current one's sums.

The counters ([2] int32, zero between launches: the last program to leave resets them) belong
to the experts module, so a captured graph holds their address and no two layers share them.
On the CPU interpreter programs run one after another, so the launch there is ONE program that
does every item: the arithmetic is tested there, the barrier on a GPU.
Experiment (FUSED_DECODE, off): not yet timed on a GPU.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from specserve.ops import graph_rows, l2, pdl
from specserve.ops.moe_triton import Epilogue, _down_store, _gate_up_store, _routing, _sm_count

FUSED_DECODE = False
# (GN, GK, warps, programs an SM at most): gate_up column blocks of GN rows over one K tile
# of GK >= H (moe_triton's persistent config at Qwen3-30B-A3B); down blocks of DOWN_N rows.
FUSED_CONFIG = (4, 2048, 8, 2)
DOWN_N = 1


def fusable(x: torch.Tensor, w13: torch.Tensor, epilogue: Epilogue, counters: object) -> bool:
    """Whether a decode call takes this kernel: on, a counter buffer, one token (judged on the
    rows a captured graph runs, as moe_triton.uses_decode_path), plain SwiGLU, H <= GK."""
    plain = epilogue.w13_bias is None and epilogue.w2_bias is None
    plain = plain and epilogue.activation == "silu"
    return (
        FUSED_DECODE
        and counters is not None
        and graph_rows.row_bound(x.shape[0]) == 1
        and plain
        and w13.shape[2] <= FUSED_CONFIG[1]
    )


def resident_per_sm(n_regs: int, shared: int, warps: int, props: dict[str, int]) -> int:
    """Programs of a compiled kernel one SM holds at once (registers allocated a warp at a
    time in units of 256, i.e. 8 a thread; shared memory; threads; the block limit)."""
    regs = -(-max(n_regs, 1) // 8) * 8 * 32 * warps
    by_regs = props["regs"] // regs
    by_smem = props["smem"] // shared if shared else props["blocks"]
    by_threads = props["threads"] // (32 * warps)
    return max(0, min(by_regs, by_smem, by_threads, props["blocks"]))


@functools.cache
def _sm_limits(index: int | None) -> dict[str, int]:
    """An SM's registers, shared memory (bytes), threads and blocks (Hopper's where torch's
    properties lack a field)."""
    p = torch.cuda.get_device_properties(index)
    return dict(
        regs=getattr(p, "regs_per_multiprocessor", 65536),
        smem=getattr(p, "shared_memory_per_multiprocessor", 233472),
        threads=getattr(p, "max_threads_per_multi_processor", 2048),
        blocks=32,
    )


@triton.jit
def _gate_up_item(
    topk_ids_ptr, w13_ptr, n_items, P, c, k, k_ok, N_INTER, stride_we, stride_wn, i,
    W_EVICT: tl.constexpr,
):  # fmt: skip
    """(expert, gate tile, up tile [GN, GK]) of gate_up item i (pair i % P, column block
    i // P); zeros past the last item."""
    ok = i < n_items
    e = tl.load(topk_ids_ptr + i % P, mask=ok, other=0).to(tl.int64)
    n = (i // P) * c.shape[0] + c
    rows = w13_ptr + e * stride_we + n.to(tl.int64)[:, None] * stride_wn + k[None, :]
    t_ok = (ok & (n < N_INTER))[:, None] & k_ok[None, :]
    gate = tl.load(rows, mask=t_ok, other=0.0, eviction_policy=W_EVICT)
    up = tl.load(rows + N_INTER * stride_wn, mask=t_ok, other=0.0, eviction_policy=W_EVICT)
    return e, gate, up


@triton.jit
def _moe_decode_fused_kernel(
    x_ptr,
    w13_ptr,
    w2_ptr,
    topk_ids_ptr,
    topk_w_ptr,
    inter_ptr,
    out_ptr,
    counter_ptr,
    N_INTER,
    H,
    P,
    stride_we13,
    stride_wn13,
    stride_we2,
    stride_wn2,
    stride_im,
    ACT: tl.constexpr,
    ALPHA: tl.constexpr,
    LIMIT: tl.constexpr,
    GN: tl.constexpr,
    GK: tl.constexpr,
    DN: tl.constexpr,
    DK: tl.constexpr,
    BLOCK_TOPK: tl.constexpr,
    PDL: tl.constexpr,
    W_EVICT: tl.constexpr = "",
):
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    # The routing and x are the router's outputs (the previous kernel): nothing to preload.
    pdl.wait(PDL)
    # ---- phase 1: gate_up items (pair i % P, column block i // P)
    k = tl.arange(0, GK)
    k_ok = k < H
    xk = tl.load(x_ptr + k, mask=k_ok, other=0.0).to(tl.float32)[None, :]
    c = tl.arange(0, GN)
    n_items = P * tl.cdiv(N_INTER, GN)
    item = (topk_ids_ptr, w13_ptr, n_items, P, c, k, k_ok, N_INTER, stride_we13, stride_wn13)
    e, gate, up = _gate_up_item(*item, pid, W_EVICT)
    for i in range(pid, n_items, G):
        e2, gate2, up2 = _gate_up_item(*item, i + G, W_EVICT)
        acc = tl.sum(gate.to(tl.float32) * xk, axis=1)
        acc_up = tl.sum(up.to(tl.float32) * xk, axis=1)
        n = (i // P) * GN + c
        _gate_up_store(
            acc, acc_up, w13_ptr, e, 0, n, n < N_INTER, N_INTER, inter_ptr, i % P, stride_im,
            False, ACT, ALPHA, LIMIT,
        )  # fmt: skip
        gate, up, e = gate2, up2, e2
    # ---- the routing and the first down slab, before the barrier
    j = tl.arange(0, BLOCK_TOPK)
    j_ok = j < P
    expert, route_w = _routing(topk_ids_ptr, topk_w_ptr, j, j_ok)
    kd = tl.arange(0, DK)
    kd_ok = kd < N_INTER
    nd0 = tl.arange(0, DN)
    w_experts = w2_ptr + expert[:, None, None] * stride_we2 + kd[None, None, :]
    s_ok = j_ok[:, None, None] & kd_ok[None, None, :]
    nd = pid * DN + nd0
    slab = tl.load(
        w_experts + nd.to(tl.int64)[None, :, None] * stride_wn2,
        mask=s_ok & (nd < H)[None, :, None], other=0.0, eviction_policy=W_EVICT,
    )  # fmt: skip
    # ---- barrier: every program's inter rows stored and visible (bar.sync, then a release
    # by one thread: cumulative over the others' stores), then wait for all G programs.
    tl.debug_barrier()
    seen = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu") + 1
    while seen < G:
        seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()
    pdl.trigger(PDL)  # every program is resident now: the next kernel takes no slot of ours
    if tl.atomic_add(counter_ptr + 1, 1, sem="acq_rel", scope="gpu") == G - 1:
        tl.store(counter_ptr, 0)  # the last to leave: zero for the next launch
        tl.store(counter_ptr + 1, 0)
    # ---- phase 2: down items (output rows pid * DN, (pid + G) * DN, ...)
    h_ok = j_ok[:, None] & kd_ok[None, :]
    h = tl.load(
        inter_ptr + j[:, None] * stride_im + kd[None, :], mask=h_ok, other=0.0,
        cache_modifier=".cg",
    )  # fmt: skip
    hf = h.to(tl.float32)[:, None, :]  # [BLOCK_TOPK, 1, DK]
    for d in range(pid, tl.cdiv(H, DN), G):
        nd2 = (d + G) * DN + nd0
        slab2 = tl.load(
            w_experts + nd2.to(tl.int64)[None, :, None] * stride_wn2,
            mask=s_ok & (nd2 < H)[None, :, None], other=0.0, eviction_policy=W_EVICT,
        )  # fmt: skip
        acc2 = tl.sum(slab.to(tl.float32) * hf, axis=2)  # [BLOCK_TOPK, DN]
        nd = d * DN + nd0
        _down_store(acc2, w2_ptr, expert, 0, nd, nd < H, j_ok, route_w, out_ptr, pid * 0, 0, False)
        slab = slab2


def fused_moe_decode_one(
    # [1, H]
    x: torch.Tensor,
    # [E, 2I, H]
    w13: torch.Tensor,
    # [E, H, I]
    w2: torch.Tensor,
    # [1, P] float32
    topk_weights: torch.Tensor,
    # [1, P]
    topk_ids: torch.Tensor,
    # [2] int32, zero
    counters: torch.Tensor,
    epilogue: Epilogue,
    config: tuple[int, int, int, int] = FUSED_CONFIG,
) -> torch.Tensor:
    """moe_triton.fused_moe_decode for one token in one launch (`fusable` said so)."""
    _, two_i, H = w13.shape
    inter_size, P = two_i // 2, topk_ids.shape[1]
    gn, gk, warps, per_sm = config
    inter = torch.empty(P, inter_size, dtype=x.dtype, device=x.device)
    out = torch.empty(1, H, dtype=x.dtype, device=x.device)
    kw = pdl.launch_kwargs(x.device)
    args = (
        x, w13, w2, topk_ids, topk_weights, inter, out, counters, inter_size, H, P,
        w13.stride(0), w13.stride(1), w2.stride(0), w2.stride(1), inter.stride(0),
    )  # fmt: skip
    consts = dict(
        **epilogue.consts(), GN=gn, GK=gk, DN=DOWN_N,
        DK=triton.next_power_of_2(inter_size), BLOCK_TOPK=triton.next_power_of_2(P),
        W_EVICT=l2.weight_eviction(), num_warps=warps, **kw,
    )  # fmt: skip
    key = (x.device.index, x.dtype, H, inter_size, P, config, consts["W_EVICT"], kw["PDL"])
    grid = _GRIDS.get(key) if x.is_cuda else 1
    if grid is None:
        grid = _GRIDS[key] = _grid(x.device, args, consts, per_sm, warps)
    _moe_decode_fused_kernel[(grid,)](*args, **consts)
    return out


# (device, dtype, H, I, P, config, eviction, PDL) -> programs: the compiled kernel's residency
# is read once per shape, not at every launch (a warmup call costs host time).
_GRIDS: dict[tuple, int] = {}


def _grid(device: torch.device, args: tuple, consts: dict, per_sm: int, warps: int) -> int:
    """Programs of a GPU launch: as many as the SMs hold at once, at most per_sm an SM, from
    the compiled kernel's registers and shared memory. (On the CPU interpreter, programs run
    in turn, so a barrier over several would never open: one program does every item.)"""
    compiled = _moe_decode_fused_kernel.warmup(*args, grid=(1,), **consts)
    compiled._init_handles()  # loads the binary: its register count
    limits = _sm_limits(device.index)
    fits = resident_per_sm(compiled.n_regs, compiled.metadata.shared, warps, limits)
    if fits < 1:
        raise RuntimeError("the fused MoE decode kernel does not fit an SM")
    return min(per_sm, fits) * _sm_count(device)
