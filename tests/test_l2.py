"""ops/l2.py: the weight loads of the decode kernels carry an L2 evict-first hint when asked,
and only then (sm_90 compiles on the CPU; the hint changes no result: GPU tests in
test_moe_mxfp4.py / test_gpu.py compare outputs bit for bit)."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from specserve.ops import l2  # noqa: E402

from .mla_utils import mla_ckpt  # noqa: E402, F401 - fixture
from .test_moe_ops import _compile  # noqa: E402
from .test_pdl import compile_sm90  # noqa: E402

HINT = "L2::cache_hint"


def test_policy_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    assert l2.weight_eviction() == "evict_first" and l2.weights_evict_first()  # the default
    monkeypatch.setattr(l2, "WEIGHT_EVICTION", "")
    assert not l2.weights_evict_first()
    monkeypatch.setattr(l2, "WEIGHT_EVICTION", "evict_last")
    with pytest.raises(ValueError, match="evict_last"):
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
    consts = dict(BLOCK_N=4, BLOCK_K=2048, PDL=True, HAS_BIAS=False, EARLY_TRIGGER=True, **silu)
    ptx = _compile(mt._moe_decode_gate_up_kernel, dict(W_EVICT=policy, **consts), 4)
    # gate and up: 4 rows x 2048 bf16 each over 128 threads in 16-byte loads; x is not a weight
    assert _hinted_loads(ptx) == (2 * 4 * 2048 * 2 // 16 // 128 if policy else 0)
    consts = dict(BLOCK_TOPK=8, BLOCK_N=2, BLOCK_K=256, STEPS=3, PDL=True, PRELOAD=True)
    ptx = _compile(mt._moe_decode_down_kernel, dict(HAS_BIAS=False, W_EVICT=policy, **consts))
    # the [8, 2, 768] bf16 slab over 128 threads; inter (the activations) is not hinted
    assert _hinted_loads(ptx) == (8 * 2 * 768 * 2 // 16 // 128 if policy else 0)


@pytest.mark.gpu
def test_evict_first_bit_equal_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
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

    monkeypatch.setattr(l2, "WEIGHT_EVICTION", "")
    base = run()
    monkeypatch.setattr(l2, "WEIGHT_EVICTION", "evict_first")
    for a, b in zip(run(), base):
        assert torch.equal(a, b)


def test_moe_routers_point_at_the_next_layers_first_weights() -> None:
    """Each MoE layer's router reads the next decoder layer's first weights at call time (the
    qkv projection; MLA: fused q_a / kv_a, then q_b where the model has it), none after the
    last layer, and the link registers no second copy of any parameter."""
    import transformers as tf

    from specserve.models.deepseek import DeepseekV3ForCausalLM
    from specserve.models.moe import SparseMoE
    from specserve.models.qwen3_moe import Qwen3MoeForCausalLM

    from .conftest import TINY_DECODER
    from .mla_utils import _COMMON, MLA_ARCHS

    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    qwen = tf.Qwen3MoeConfig(**TINY_DECODER, **moe, mlp_only_layers=[1]).to_dict()
    models = [Qwen3MoeForCausalLM.from_config_dict(qwen, 64)]
    for name in ("deepseek_v3", "deepseek_v3_no_q_lora"):
        cfg = tf.DeepseekV3Config(**{**_COMMON, **MLA_ARCHS[name][1]}).to_dict()
        models.append(DeepseekV3ForCausalLM.from_config_dict(cfg, 64))
    for model in models:
        layers = model.model.layers
        linked = 0
        for i, layer in enumerate(layers):
            if not isinstance(layer.mlp, SparseMoE):
                continue
            got = layer.mlp.gate.next_weights
            if i + 1 == len(layers):
                assert got is None
                continue
            attn = layers[i + 1].self_attn
            if hasattr(attn, "qkv_proj"):
                want = [attn.qkv_proj.weight]
            else:
                want = [attn.fused_qkv_a_proj.weight]
                want += [attn.q_b_proj.weight] if hasattr(attn, "q_b_proj") else []
            assert [id(w) for w in got()] == [id(w) for w in want]
            linked += 1
        assert linked >= 1
        names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
        assert len(names) == len(set(names)) == len(list(model.parameters()))


def test_prefetch_regions_cap_and_skip() -> None:
    """Regions keep the tensors' order, stop at the byte cap (multiples of 16) and at
    MAX_REGIONS, and skip what a bulk prefetch cannot take (CPU or non-contiguous tensors)."""
    import torch

    assert l2.prefetch_regions([torch.zeros(64)], 1 << 20) == []  # CPU: never
    if not torch.cuda.is_available():
        return
    a = torch.zeros(1000, device="cuda", dtype=torch.bfloat16)  # 2000 bytes
    b = torch.zeros(64, 64, device="cuda")
    got = l2.prefetch_regions([b.t(), a, b, a], 2000 + 100)
    assert [(t.data_ptr(), n) for t, n in got] == [(a.data_ptr(), 2000), (b.data_ptr(), 96)]


@pytest.mark.gpu
@pytest.mark.parametrize("late", [False, True])
def test_route_prefetch_bit_equal_gpu(
    ckpt_dir,
    mla_ckpt,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    late: bool,
) -> None:
    """With the routers prefetching the next layer's first weights (ops/l2.ROUTE_PREFETCH_BYTES,
    after the wait or after the logits), CUDA-graph decode gives the tokens it gives without
    (bf16 Qwen3-MoE and GLM-4.7-Flash-style MLA, greedy and sampled), and the decode kernels
    did get regions to prefetch."""
    import torch

    from specserve import LLM, SamplingParams

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    prompts = [{"prompt_token_ids": [5 + i, 9, 13 + 2 * i, 7]} for i in range(3)]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, seed=3, max_tokens=24, ignore_eos=True)
    kw = dict(device="cuda", dtype="bfloat16", max_model_len=256, max_num_seqs=4)
    moe = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
    paths = [ckpt_dir("qwen3_moe_route_pf", "qwen3_moe", **moe), mla_ckpt("glm4_moe_lite")]

    def run(path: str) -> list[list[int]]:
        llm = LLM(path, **kw)
        outs = llm.generate(prompts, [greedy, sampled, greedy])
        del llm
        return [o.outputs[0].token_ids for o in outs]

    seen: list[int] = []
    real = l2.prefetch_regions
    monkeypatch.setattr(l2, "prefetch_regions", lambda t, n: seen.append(len(t)) or real(t, n))
    monkeypatch.setattr(l2, "ROUTE_PREFETCH_LATE", late)
    for path in paths:
        monkeypatch.setattr(l2, "ROUTE_PREFETCH_BYTES", 0)
        plain = run(path)
        seen.clear()
        monkeypatch.setattr(l2, "ROUTE_PREFETCH_BYTES", 1 << 20)
        assert run(path) == plain
        assert seen and max(seen) >= 1
