"""The MLA Triton kernels over an fp8 latent cache against the torch reference under the Triton
interpreter (`TRITON_INTERPRET=1 pytest -m interpret tests/test_mla_fp8_kernels.py`): latent
attention (attention/mla_triton.py) dequantizes as `mla_attention_ref` does (decode,
verification and prefill rows, split KV), and the fused path (attention/mla_fused.py) writes
the reference's bits (`write_latent`) and attends as the reference does."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from specserve.attention.kv_quant import quantize_kv_ref
from specserve.attention.mla import mla_attention_ref, mla_forward
from specserve.tunables import override

from .test_mla_triton import _batch, _prologue_inputs
from .test_triton_attention import interpreter, needs_interpreter  # noqa: F401

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
# The latent scale: rows of randn / 0.05 span fp8's normals and (near 0) its subnormals.
SCALE = 0.05


def _fp8_batch(
    query_lens: list[int],
    seq_lens: list[int],
    heads: int,
    lora: int,
    rope: int,
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, object]:
    """`_batch`'s (q_latent, q_pe in `dtype`, cache, metadata), the cache quantized to `kv_dtype`
    as `write_latent` stores rows with the scale SCALE."""
    q_lat, q_pe, cache, c = _batch(
        query_lens, seq_lens, heads, lora, rope, 4, torch.float32, "cpu", seed
    )
    cache = quantize_kv_ref(cache, torch.tensor(SCALE), kv_dtype)
    return q_lat.to(dtype), q_pe.to(dtype), cache, c


@needs_interpreter
@pytest.mark.parametrize("kv_dtype", FP8)
@pytest.mark.parametrize(
    "splits,early_kv,with_wuv", [(1, True, False), (4, False, True), (16, True, False)]
)
def test_mla_attention_fp8_matches_reference_interpreter(
    interpreter,  # noqa: F811
    kv_dtype: torch.dtype,
    splits: int,
    early_kv: bool,
    with_wuv: bool,
) -> None:
    """Decode rows (one over 70 keys, one over 7: idle splits at 16), a verification row
    (1 + K = 4) and a prefill chunk (9 tokens) in one batch, split or not, the early tile
    loaded before the scale or not, W_UV applied in the merge or not."""
    from specserve.attention.mla_triton import mla_attention

    heads, lora, rope = 17, 32, 16
    q_lat, q_pe, cache, c = _fp8_batch(
        [1, 1, 4, 9], [7, 70, 13, 9], heads, lora, rope, torch.float32, kv_dtype, seed=1
    )
    kv_scale = torch.tensor([SCALE, 1.0])[0]
    want = mla_attention_ref(q_lat, q_pe, cache, c, 0.2, kv_scale)
    w_uv = None
    if with_wuv:
        w_uv = torch.randn(heads, 24, lora, generator=torch.Generator().manual_seed(2))
        want = torch.einsum("thl,hvl->thv", want, w_uv)
    with override(mla_early_kv=early_kv):
        got = mla_attention(
            q_lat, q_pe, cache, c, 0.2, num_splits=splits, w_uv=w_uv, kv_scale=kv_scale
        )
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@needs_interpreter
def test_mla_attention_fp8_bf16_queries_interpreter(interpreter) -> None:  # noqa: F811
    """bf16 queries: the tiles are dequantized into bf16 and the output is bf16."""
    from specserve.attention.mla_triton import mla_attention

    q_lat, q_pe, cache, c = _fp8_batch(
        [1, 4], [40, 13], 5, 32, 16, torch.bfloat16, torch.float8_e4m3fn
    )
    kv_scale = torch.tensor(SCALE)
    want = mla_attention_ref(q_lat, q_pe, cache, c, 0.2, kv_scale)
    got = mla_attention(q_lat, q_pe, cache, c, 0.2, num_splits=2, kv_scale=kv_scale)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@needs_interpreter
@pytest.mark.parametrize("kv_dtype", FP8)
@pytest.mark.parametrize("calc_kv_scale", [False, True])
def test_mla_forward_fp8_matches_reference_interpreter(
    interpreter,  # noqa: F811
    kv_dtype: torch.dtype,
    calc_kv_scale: bool,
) -> None:
    """mla_forward on the Triton path over an fp8 cache against the torch path: with a given
    scale the fused kernels (the prologue's quantized write holds the reference's bits, a
    padding token writes nothing); with calculate_kv_scales the torch prologue sets the scale
    from this step's rows and the Triton attention reads it."""
    from specserve.attention import mla_fused

    heads, nope, lora, rope, v = 5, 24, 32, 16, 20
    _, _, cache, c = _fp8_batch([1, 1, 4], [7, 70, 13], heads, lora, rope, torch.float32,
                                kv_dtype)  # fmt: skip
    q, kv_a, w = _prologue_inputs(c.num_tokens, heads, nope, lora, rope, v, "cpu")
    # k_pe up to ~60: past e4m3's 448 once divided by SCALE (the write clamps it).
    kv_a = kv_a * 8
    c.slot_mapping[0] = -1  # request 0's token is padding: its row stays as _batch wrote it
    assert mla_fused.fusable(q, w, c)
    w_ref = dataclasses.replace(
        w, kv_scales=torch.tensor([SCALE, 1.0]), calc_kv_scale=calc_kv_scale
    )
    w_tri = dataclasses.replace(w_ref, kv_scales=w_ref.kv_scales.clone())
    want_cache = cache.clone()
    want = mla_forward(c.positions, q, kv_a, w_ref, want_cache, c)
    got = mla_forward(c.positions, q, kv_a, w_tri, cache, c, use_triton=True, split_len=256)
    assert torch.equal(w_tri.kv_scales, w_ref.kv_scales)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    # The reference writes the padding token to the null block's last slot; the kernel skips it.
    assert torch.equal(cache[:-1].view(torch.uint8), want_cache[:-1].view(torch.uint8))
