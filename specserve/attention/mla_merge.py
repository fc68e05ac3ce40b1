"""The split-KV merge of MLA attention, with the absorbed value up-projection W_UV applied to
the merged latent where given (torch reference: `mla_merge_ref`). Each key split of mla_triton.py
left its partial softmax state (m, l, unnormalized acc over the latent; log2 domain) in a
workspace; the splits merge in a fixed order, so results are deterministic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.ops import l2, pdl


@triton.jit
def _mla_merge_kernel(
    out_ptr,
    ws_acc_ptr,
    ws_ml_ptr,
    w_uv_ptr,
    num_tokens,
    num_heads,
    stride_ot,
    stride_oh,
    stride_wh,
    stride_wv,
    L: tl.constexpr,
    V: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_V: tl.constexpr,
    SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    HAS_WUV: tl.constexpr,
    PDL: tl.constexpr,
    W_EVICT: tl.constexpr = "",  # ops/l2.py's policy for the W_UV tile
):
    """out[t, h] for every token t of head h: the SPLITS partial states merged (rescaled to the
    global max, log2 domain, summed in split order, normalized once), rounded to the output
    dtype as the attention output is; with HAS_WUV then times W_UV[h] rows vb (fp32 sums).
    grid = (num_heads, cdiv(V, BLOCK_V)): each W_UV tile is read once for all tokens."""
    h = tl.program_id(0)
    vb = tl.program_id(1)
    dl = tl.arange(0, BLOCK_L)
    # BLOCK_S = max(SPLITS, 2): a one-split workspace still gets a two-lane (masked) vector.
    sp = tl.arange(0, BLOCK_S)
    sp_ok = sp < SPLITS
    lm = dl < L
    if HAS_WUV:
        v = vb * BLOCK_V + tl.arange(0, BLOCK_V)
        vm = v < V
        # Weights never depend on the previous kernel: request the tile before waiting.
        w = tl.load(
            w_uv_ptr + h * stride_wh + v[:, None] * stride_wv + dl[None, :],
            mask=vm[:, None] & lm[None, :],
            other=0.0,
            eviction_policy=W_EVICT,
        )
    pdl.trigger(PDL)
    pdl.wait(PDL)
    for t in range(num_tokens):
        row = (t * num_heads + h) * SPLITS + sp
        m = tl.load(ws_ml_ptr + 2 * row, mask=sp_ok, other=float("-inf"))
        lse = tl.load(ws_ml_ptr + 2 * row + 1, mask=sp_ok, other=0.0)
        m_max = tl.max(m, axis=0)
        m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
        wt = tl.math.exp2(m - m_safe)
        denom = tl.sum(lse * wt, axis=0)
        denom = tl.where(denom == 0.0, 1.0, denom)
        # Every split's rows, requested beside m rather than masked on it (one dependent L2
        # round trip less: GLM-4.7-Flash batch 1, H100, 3473 -> 3450 us a step): an empty
        # split's acc rows are zeros (its program stores them) and its wt 0.
        part = tl.load(
            ws_acc_ptr + row[:, None] * BLOCK_L + dl[None, :], mask=sp_ok[:, None], other=0.0
        )
        lat = tl.sum(part * wt[:, None], axis=0) / denom
        lat = lat.to(out_ptr.dtype.element_ty)
        if HAS_WUV:
            o = tl.sum(w.to(tl.float32) * lat.to(tl.float32)[None, :], axis=1)
            tl.store(out_ptr + t * stride_ot + h * stride_oh + v, o.to(lat.dtype), mask=vm)
        else:
            tl.store(out_ptr + t * stride_ot + h * stride_oh + dl, lat, mask=lm)


def mla_merge(
    # [T, H, L] or with w_uv [T, H, v]: written
    out: torch.Tensor,
    # [T * H * num_splits, BLOCK_L] fp32: each split's unnormalized latent accumulator
    ws_acc: torch.Tensor,
    # [T * H * num_splits, 2] fp32: each split's (m, l)
    ws_ml: torch.Tensor,
    num_splits: int,
    # the latent width (ws_acc's rows are padded to BLOCK_L)
    L: int,
    # [H, v, L] or None
    w_uv: torch.Tensor | None,
) -> None:
    T, H = out.shape[0], out.shape[1]
    if w_uv is not None and w_uv.stride(-1) != 1:
        w_uv = w_uv.contiguous()
    block_v = 32 if w_uv is not None else 1
    V = out.shape[2] if w_uv is not None else 1
    _mla_merge_kernel[(H, triton.cdiv(V, block_v))](
        out, ws_acc, ws_ml, w_uv if w_uv is not None else out, T, H,
        out.stride(0), out.stride(1),
        w_uv.stride(0) if w_uv is not None else 0,
        w_uv.stride(1) if w_uv is not None else 0,
        L=L, V=V, BLOCK_L=ws_acc.shape[1], BLOCK_V=block_v, SPLITS=num_splits,
        BLOCK_S=max(2, num_splits),
        HAS_WUV=w_uv is not None,
        W_EVICT=l2.weight_eviction(),
        num_warps=4,
        **pdl.launch_kwargs(out.device),
    )  # fmt: skip


def mla_merge_ref(
    # [T * H * num_splits, BLOCK_L] fp32
    ws_acc: torch.Tensor,
    # [T * H * num_splits, 2] fp32
    ws_ml: torch.Tensor,
    T: int,
    H: int,
    num_splits: int,
    L: int,
    # [H, v, L] or None
    w_uv: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """`mla_merge` in torch: [T, H, L] (or [T, H, v] with w_uv) in `dtype`, the merged latent
    rounded to `dtype` before W_UV as the kernel rounds it."""
    acc = ws_acc.view(T, H, num_splits, -1)[..., :L]
    m, lse = ws_ml.view(T, H, num_splits, 2).unbind(-1)
    m_max = m.amax(-1, keepdim=True)
    wt = torch.exp2(m - m_max.masked_fill(m_max == float("-inf"), 0.0))
    denom = (lse * wt).sum(-1, keepdim=True)
    denom = denom.masked_fill(denom == 0.0, 1.0)
    lat = ((acc * wt[..., None]).sum(-2) / denom).to(dtype)
    if w_uv is None:
        return lat
    return torch.einsum("thl,hvl->thv", lat.float(), w_uv.float()).to(dtype)
