"""Triton MLA attention (attention/mla_triton.py) vs its torch reference (attention/mla.py) on
random paged latent caches: mixed batches of decode, verification (1 + K) and prefill rows."""

from __future__ import annotations

import pytest
import torch

from specserve.attention.backend import CommonAttentionMetadata
from specserve.attention.mla import mla_attention_ref, write_latent

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
@pytest.mark.parametrize("splits", [2, 4, 16])
@pytest.mark.parametrize("with_wuv", [False, True])
def test_mla_split_kv_matches_reference_interpreter(interpreter, splits, with_wuv) -> None:  # noqa: F811
    """Split-KV: contexts longer than one split (40 keys over 2 splits of 32-key tiles), splits
    left idle (a 7-key row over 16 splits), verification and prefill rows; with W_UV applied in
    the merge kernel, against the reference's latent output times W_UV."""
    from specserve.attention.mla_triton import mla_attention

    heads, lora, rope = 17, 32, 16
    q_lat, q_pe, cache, c = _batch([1, 1, 4, 9], [7, 70, 13, 9], heads, lora, rope, 4,
                                   torch.float32, "cpu", seed=1)  # fmt: skip
    want = mla_attention_ref(q_lat, q_pe, cache, c, 0.2)
    w_uv = None
    if with_wuv:
        w_uv = torch.randn(heads, 24, lora, generator=torch.Generator().manual_seed(2))
        want = torch.einsum("thl,hvl->thv", want, w_uv)
    got = mla_attention(q_lat, q_pe, cache, c, 0.2, num_splits=splits, w_uv=w_uv)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_mla_split_count_follows_host_sizes() -> None:
    """Batch-1 decode on a 132-SM GPU splits as far as MAX_SPLITS; a short max_model_len or a
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
