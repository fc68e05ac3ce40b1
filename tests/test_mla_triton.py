"""Triton MLA attention (attention/mla_triton.py) vs its torch reference (attention/mla.py) on
random paged latent caches: mixed batches of decode, verification (1 + K) and prefill rows."""

from __future__ import annotations

import pytest
import torch

from specserve.attention.backend import CommonAttentionMetadata
from specserve.attention.mla import mla_attention_ref, write_latent
from specserve.tunables import override

from .test_triton_attention import interpreter, needs_cuda, needs_interpreter  # noqa: F401


def _batch(
    query_lens: list[int],
    seq_lens: list[int],
    heads: int,
    lora: int,
    rope: int,
    page: int,
    dtype: torch.dtype,
    device: str,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, CommonAttentionMetadata]:
    """(q_latent, q_pe, kv_cache, metadata): each request's pages shuffled over the pool, its
    whole context (this step's rows too) written through write_latent."""
    g = torch.Generator().manual_seed(seed)
    B = len(seq_lens)
    max_blocks = max((s + page - 1) // page for s in seq_lens)
    num_blocks = B * max_blocks + 1
    perm = torch.randperm(num_blocks - 1, generator=g).view(B, max_blocks)
    table = perm.to(torch.int32)
    cache = torch.zeros(num_blocks, page, lora + rope, dtype=dtype)
    for b, s in enumerate(seq_lens):
        pos = torch.arange(s)
        slots = table[b, pos // page].long() * page + pos % page
        write_latent(
            cache, torch.randn(s, lora, generator=g), torch.randn(s, rope, generator=g), slots
        )
    T = sum(query_lens)
    token_req = torch.repeat_interleave(torch.arange(B), torch.tensor(query_lens))
    positions = torch.cat([torch.arange(s - q, s) for q, s in zip(query_lens, seq_lens)])
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    slots = table[token_req, positions // page].long() * page + positions % page
    common = CommonAttentionMetadata(
        query_start_loc=qsl.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        positions=positions.to(device),
        block_table=table.to(device),
        slot_mapping=slots.to(device),
        token_req=token_req.to(device),
        num_reqs=B,
        num_tokens=T,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )
    q_lat = (torch.randn(T, heads, lora, generator=g) * 0.3).to(dtype)
    q_pe = (torch.randn(T, heads, rope, generator=g) * 0.3).to(dtype)
    return q_lat.to(device), q_pe.to(device), cache.to(device), common


# decode rows, a verification row (1 + K = 4) and a prefill row, in one batch
MIXED = ([1, 1, 4, 9], [7, 40, 13, 9])


@needs_interpreter
@pytest.mark.parametrize("heads,lora,rope", [(3, 24, 8), (17, 32, 16)])
def test_mla_triton_matches_reference_interpreter(interpreter, heads, lora, rope) -> None:  # noqa: F811
    from specserve.attention.mla_triton import mla_attention

    q_lat, q_pe, cache, c = _batch(*MIXED, heads, lora, rope, 4, torch.float32, "cpu")
    want = mla_attention_ref(q_lat, q_pe, cache, c, 0.2)
    got = mla_attention(q_lat, q_pe, cache, c, 0.2)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@needs_interpreter
@pytest.mark.parametrize("splits", [1, 2, 4, 16])
@pytest.mark.parametrize("with_wuv", [False, True])
@pytest.mark.parametrize("early_kv", [False, True])
def test_mla_split_kv_matches_reference_interpreter(
    interpreter,  # noqa: F811
    splits: int,
    with_wuv: bool,
    early_kv: bool,
) -> None:
    """Split-KV: contexts longer than one split (40 keys over 2 splits of 32-key tiles), splits
    left idle (a 7-key row over 16 splits: the merge reads their zero rows), verification and
    prefill rows; with W_UV applied in the merge kernel, against the reference's latent output
    times W_UV. EARLY_KV (the first tile's older rows loaded before the PDL wait, the rows this
    step may have written after it) computes the same."""
    from specserve.attention.mla_triton import mla_attention

    heads, lora, rope = 17, 32, 16
    q_lat, q_pe, cache, c = _batch([1, 1, 4, 9], [7, 70, 13, 9], heads, lora, rope, 4,
                                   torch.float32, "cpu", seed=1)  # fmt: skip
    want = mla_attention_ref(q_lat, q_pe, cache, c, 0.2)
    w_uv = None
    if with_wuv:
        w_uv = torch.randn(heads, 24, lora, generator=torch.Generator().manual_seed(2))
        want = torch.einsum("thl,hvl->thv", want, w_uv)
    with override(mla_early_kv=early_kv):
        got = mla_attention(q_lat, q_pe, cache, c, 0.2, num_splits=splits, w_uv=w_uv)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@needs_interpreter
@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("with_wuv", [False, True])
def test_mla_merge_matches_reference_interpreter(interpreter, splits, with_wuv) -> None:  # noqa: F811
    """The merge kernel alone equals its torch reference: a split left empty (m = -inf, l = 0),
    latent rows padded to BLOCK_L, W_UV applied or not."""
    from specserve.attention.mla_merge import mla_merge, mla_merge_ref

    g = torch.Generator().manual_seed(3)
    T, H, L, block_l, v = 3, 5, 24, 32, 12
    ws_acc = torch.randn(T * H * splits, block_l, generator=g)
    m = torch.randn(T * H * splits, generator=g) * 4
    ws_ml = torch.stack([m, torch.rand(T * H * splits, generator=g) + 0.5], dim=-1)
    ws_ml[0] = torch.tensor([float("-inf"), 0.0])
    ws_acc[0] = 0.0
    w_uv = torch.randn(H, v, L, generator=g) if with_wuv else None
    out = torch.empty(T, H, v if with_wuv else L)
    mla_merge(out, ws_acc, ws_ml, splits, L, w_uv)
    want = mla_merge_ref(ws_acc, ws_ml, T, H, splits, L, w_uv, torch.float32)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_mla_split_count_follows_host_sizes() -> None:
    """Batch-1 decode on a 132-SM GPU splits as far as mla_max_splits; a short max_model_len or a
    big prefill does not split; padded and real batch sizes round alike."""
    from specserve.attention.mla_triton import mla_split_count

    cpu = torch.device("cpu")
    assert mla_split_count(1, 2, 4096, cpu) == 16
    assert mla_split_count(1, 2, 128, cpu) == 4
    assert mla_split_count(1, 2, 40, cpu) == 1
    assert mla_split_count(512, 2, 4096, cpu) == 1
    assert mla_split_count(3, 8, 4096, cpu) == mla_split_count(4, 8, 4096, cpu) == 4


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mla_triton_matches_reference_gpu(dtype: torch.dtype) -> None:
    """DeepSeek-V3's MLA shape (128 heads, L 512, R 64) over 16-token pages."""
    from specserve.attention.mla_triton import mla_attention

    q_lat, q_pe, cache, c = _batch(
        [1, 1, 4, 37], [300, 1025, 70, 37], 128, 512, 64, 16, dtype, "cuda"
    )
    want = mla_attention_ref(q_lat, q_pe, cache, c, 0.1)
    got = mla_attention(q_lat, q_pe, cache, c, 0.1)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.gpu
@needs_cuda
def test_mla_model_triton_equals_torch_backend_gpu(tmp_path) -> None:
    """A tiny DeepSeek-V3 on CUDA in fp32: the Triton backend (MLA kernel, CUDA graphs) and
    the torch reference backend give the same greedy tokens, with and without MTP."""
    from specserve import LLM, SamplingParams

    from .mla_utils import make_mla_checkpoint
    from .spec_utils import append_mtp_layers

    path = append_mtp_layers(
        make_mla_checkpoint(str(tmp_path / "ds"), "deepseek_v3"), str(tmp_path / "mtp"), 1
    )
    prompts = [list(range(3, 3 + n)) for n in (5, 17, 40)]
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = {}
    for backend in ("torch", "triton"):
        for spec in (None, {"method": "mtp", "num_speculative_tokens": 3}):
            llm = LLM(
                path, max_model_len=256, dtype="float32", attention_backend=backend,
                speculative_config=spec,
            )  # fmt: skip
            res = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
            outs[backend, spec is None] = [o.outputs[0].token_ids for o in res]
    assert len({str(v) for v in outs.values()}) == 1


def _prologue_inputs(
    tokens: int, heads: int, nope: int, lora: int, rope: int, v: int, device: str, seed: int = 3
) -> tuple[torch.Tensor, torch.Tensor, object]:
    """(q [T, H, nope + R], kv_a [T, L + R], MLAWeights) with random weights."""
    from specserve.attention.mla import MLAWeights
    from specserve.models.layers import RotaryEmbedding

    g = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, heads, nope + rope, generator=g)
    kv_a = torch.randn(tokens, lora + rope, generator=g) * 2
    kv_b = torch.randn(heads, nope + v, lora, generator=g) * lora**-0.5
    rot = RotaryEmbedding(rope, 1024, 10000.0, None)  # positions up to the GPU test's 300
    w = MLAWeights(
        kv_b[:, :nope], kv_b[:, nope:], torch.rand(lora, generator=g) + 0.5, 1e-6,
        rot.cos, rot.sin, True, 0.3,
    )  # fmt: skip
    return q.to(device), kv_a.to(device), w


@needs_interpreter
@pytest.mark.parametrize("interleave", [True, False])
def test_mla_fused_forward_matches_reference_interpreter(interpreter, interleave) -> None:  # noqa: F811
    """mla_forward_fused (prologue kernel, split-KV attention, merge + W_UV) against the torch
    path (mla_prologue_ref, mla_attention_ref, bmm): outputs and the written latent rows. A
    padding token (slot -1) writes nothing."""
    import dataclasses

    from specserve.attention.mla import mla_forward
    from specserve.attention.mla_fused import mla_forward_fused

    heads, nope, lora, rope, v = 5, 24, 32, 16, 20
    _, _, cache, c = _batch([1, 1, 4], [7, 70, 13], heads, lora, rope, 4, torch.float32, "cpu")
    q, kv_a, w = _prologue_inputs(c.num_tokens, heads, nope, lora, rope, v, "cpu")
    w = dataclasses.replace(w, rope_interleave=interleave)
    c.slot_mapping[0] = -1  # request 0's token is padding: its row stays as _batch wrote it
    want_cache = cache.clone()
    want = mla_forward(c.positions, q, kv_a, w, want_cache, c)
    got = mla_forward_fused(c.positions, q, kv_a, w, cache, c, split_len=256)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    # The reference writes the padding token to the null block's last slot; the kernel skips it.
    torch.testing.assert_close(cache[:-1], want_cache[:-1], atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@needs_cuda
def test_mla_fused_forward_bf16_and_graph_gpu() -> None:
    """GLM-4.7-Flash's MLA shape (20 heads, nope 192, L 512, R 64, v 256) in bf16: the fused
    path against the torch path at batch 1 and a 4-token verification row, and a CUDA graph
    replay of the fused path equal (bitwise) to its eager run."""
    from specserve.attention.mla import mla_forward
    from specserve.attention.mla_fused import mla_forward_fused

    heads, nope, lora, rope, v = 20, 192, 512, 64, 256
    for qlens, slens in (([1], [128]), ([4], [300])):
        _, _, cache, c = _batch(qlens, slens, heads, lora, rope, 16, torch.bfloat16, "cuda")
        q, kv_a, w = _prologue_inputs(c.num_tokens, heads, nope, lora, rope, v, "cuda")
        q, kv_a = q.bfloat16(), kv_a.bfloat16()
        w.w_uk, w.w_uv = w.w_uk.cuda().bfloat16(), w.w_uv.cuda().bfloat16()
        w.kv_norm_weight = w.kv_norm_weight.cuda().bfloat16()
        w.cos, w.sin = w.cos.cuda(), w.sin.cuda()
        ref_cache = cache.clone()
        want = mla_forward(c.positions, q, kv_a, w, ref_cache, c, use_triton=False)
        eager = mla_forward_fused(c.positions, q, kv_a, w, cache, c, split_len=4096)
        torch.testing.assert_close(eager.float(), want.float(), atol=3e-2, rtol=3e-2)
        graph = torch.cuda.CUDAGraph()
        mla_forward_fused(c.positions, q, kv_a, w, cache, c, split_len=4096)  # warm-up
        with torch.cuda.graph(graph):
            out = mla_forward_fused(c.positions, q, kv_a, w, cache, c, split_len=4096)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)


@pytest.mark.gpu
@needs_cuda
def test_mla_model_bf16_graph_equals_eager_gpu(tmp_path) -> None:
    """A tiny GLM-4.7-Flash in bf16 with the Triton decode gemvs (input and q_a norms inside
    the projections, the fused MLA kernels): CUDA-graph greedy tokens equal eager ones, with
    and without MTP, and a layer's fused norm_forward matches its unfused form."""
    from specserve import LLM, SamplingParams
    from specserve.ops import gemv

    from .mla_utils import make_mla_checkpoint
    from .spec_utils import append_mtp_layers

    path = append_mtp_layers(
        make_mla_checkpoint(str(tmp_path / "glm"), "glm4_moe_lite"), str(tmp_path / "mtp"), 1
    )
    prompts = [list(range(3, 3 + n)) for n in (5, 17, 40)]
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = {}
    for eager in (True, False):
        for spec in (None, {"method": "mtp", "num_speculative_tokens": 3}):
            llm = LLM(
                path, max_model_len=512, dtype="bfloat16", decode_matmul="triton",
                enforce_eager=eager, speculative_config=spec,
            )  # fmt: skip
            res = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
            outs[eager, spec is None] = [o.outputs[0].token_ids for o in res]
    assert outs[True, True] == outs[False, True]
    assert outs[True, False] == outs[False, False]

    # The fused input projection (q_a_proj + kv_a_proj_with_mqa) as norm_forward runs it: the
    # norm inside its gemv.
    layer = llm.engine.runner.model.model.layers[1]
    norm, attn = layer.input_layernorm, layer.self_attn
    x = torch.randn(2, 64, device="cuda", dtype=torch.bfloat16)
    res = torch.randn_like(x)
    lin = attn.fused_qkv_a_proj
    # config() is None where the plan left a row count to cuBLAS: force the Triton gemv then.
    got, h = lin.run_norm(x, norm.weight, norm.eps, res, lin.config(x) or gemv.DEFAULT_CONFIG)
    normed, h_ref = norm(x, res)
    torch.testing.assert_close(h, h_ref)
    want = torch.nn.functional.linear(normed, lin.weight)
    torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=3e-2)
