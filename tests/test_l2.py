"""ops/l2.py: the weight loads of the decode kernels carry an L2 evict-first hint when asked,
and only then (sm_90 compiles on the CPU; the hint changes no result: GPU tests in
test_moe_mxfp4.py / test_gpu.py compare outputs bit for bit)."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from specserve.ops import l2  # noqa: E402
from specserve.tunables import override  # noqa: E402

from .test_moe_ops import _compile  # noqa: E402
from .test_pdl import compile_sm90  # noqa: E402

HINT = "L2::cache_hint"


def test_policy_validated() -> None:
    assert l2.weight_eviction() == "evict_first" and l2.weights_evict_first()  # the default
    with override(weight_eviction=""):
        assert not l2.weights_evict_first()
    with override(weight_eviction="evict_last"), pytest.raises(ValueError, match="evict_last"):
        l2.weight_eviction()


def _hinted_loads(ptx: str) -> int:
    return sum(1 for line in ptx.splitlines() if "ld.global" in line and HINT in line)


@pytest.mark.parametrize("policy", ["", "evict_first"])
def test_gemv_and_skinny_weight_loads(policy: str) -> None:
    from specserve.ops.gemv import _gemv_kernel
    from specserve.ops.skinny import CONFIGS, _skinny_kernel

    consts = dict(HAS_BIAS=True, SILU_MUL=True, NORM=True, HAS_RES=True, BLOCK_M=1, BLOCK_N=4)
    consts.update(BLOCK_K=512, PDL=True, EARLY_TRIGGER=False, PRELOAD=True, W_EVICT=policy)
    div = ("x_ptr", "w_ptr", "stride_xm", "stride_wn", "K")
    ptx = compile_sm90(_gemv_kernel, consts, num_stages=4, divisible_by_16=div)
    # gate and up tiles: 4 rows x 512 bf16 over 128 threads in 16-byte loads, each hinted, at
    # two sites (the tile preloaded before the wait, the K loop's)
    assert _hinted_loads(ptx) == (2 * 2 * 4 * 512 * 2 // 16 // 128 if policy else 0)
    cfg = CONFIGS[0]
    types = {"ws_ptr": "*fp32", "ss_ptr": "*fp32", "counter_ptr": "*i32", "eps": "fp32"}
    consts = dict(HAS_BIAS=False, SILU_MUL=False, NORM=False, HAS_RES=False, BLOCK_M=16)
    consts.update(BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, DOT_PRECISION="tf32", PDL=True)
    consts.update(PRELOAD=True, W_EVICT=policy)
    ptx = compile_sm90(_skinny_kernel, consts, 4, 3, types)
    assert (_hinted_loads(ptx) > 0) == bool(policy)
    assert ("createpolicy.fractional.L2::evict_first" in ptx) == bool(policy)


@pytest.mark.parametrize("policy", ["", "evict_first"])
def test_moe_decode_weight_loads(policy: str) -> None:
    from specserve.ops import moe_triton as mt

    silu = mt.Epilogue(activation="silu").consts()
    consts = dict(BLOCK_N=4, BLOCK_K=2048, PDL=True, HAS_BIAS=False, **silu)
    ptx = _compile(mt._moe_decode_gate_up_kernel, dict(W_EVICT=policy, **consts), 4)
    # gate and up: 4 rows x 2048 bf16 each over 128 threads in 16-byte loads; x is not a weight
    assert _hinted_loads(ptx) == (2 * 4 * 2048 * 2 // 16 // 128 if policy else 0)
    consts = dict(BLOCK_TOPK=8, BLOCK_N=2, BLOCK_K=256, STEPS=3, PDL=True, PRELOAD=True)
    ptx = _compile(mt._moe_decode_down_kernel, dict(HAS_BIAS=False, W_EVICT=policy, **consts))
    # the [8, 2, 768] bf16 slab over 128 threads; inter (the activations) is not hinted
    assert _hinted_loads(ptx) == (8 * 2 * 768 * 2 // 16 // 128 if policy else 0)


@pytest.mark.gpu
def test_evict_first_bit_equal_gpu() -> None:
    """The hint changes no result: the gemv, the skinny matmul and the bf16 MoE decode kernels
    give bit-equal outputs with and without it (bf16, Llama-3-8B-like widths)."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from specserve.ops import moe_triton as mt
    from specserve.ops.gemv import gemv
    from specserve.ops.skinny import skinny_matmul

    from .test_moe_ops import make_moe

    g = torch.Generator("cuda").manual_seed(0)
    w = torch.randn(2 * 1024, 4096, device="cuda", generator=g).mul_(0.02).bfloat16()
    x1 = torch.randn(1, 4096, device="cuda", generator=g).bfloat16()
    x16 = torch.randn(16, 4096, device="cuda", generator=g).bfloat16()
    moe = make_moe(4, E=16, H=2048, inter=768, top_k=4, dtype=torch.bfloat16, device="cuda")

    def run() -> list[torch.Tensor]:
        return [
            gemv(x1, w),
            gemv(x1, w, silu_mul=True),
            skinny_matmul(x16, w),
            skinny_matmul(x16, w, silu_mul=True),
            mt.fused_moe_decode(*moe),
        ]

    with override(weight_eviction=""):
        base = run()
    for a, b in zip(run(), base):  # the default: evict-first
        assert torch.equal(a, b)
