"""MLA targets (DeepSeek-V3, GLM-4.7-Flash) against transformers' generate; the latent KV
cache and its size."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file

from specserve import LLM, SamplingParams
from specserve.tunables import override, tunables

from .conftest import hf_greedy, random_prompts
from .mla_utils import MLA_ARCHS, mla_ckpt  # noqa: F401 - fixture
from .test_triton_attention import interpreter, needs_interpreter  # noqa: F401 - fixture

GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def hf_refs(mla_ckpt) -> dict:  # noqa: F811
    prompts = random_prompts(4, 5, 40, seed=7)
    refs: dict = {"_prompts": prompts}
    for name in MLA_ARCHS:
        refs[name] = [hf_greedy(mla_ckpt(name), p, GREEDY.max_tokens) for p in prompts]
    return refs


@pytest.mark.parametrize("name", list(MLA_ARCHS))
@pytest.mark.parametrize(
    "engine_kw",
    [
        {},
        {"max_num_batched_tokens": 16},  # chunked prefill
        {"num_gpu_blocks_override": 6, "max_num_batched_tokens": 64},  # preemption
    ],
    ids=["plain", "chunked", "preempt"],
)
def test_greedy_matches_transformers(mla_ckpt, hf_refs, name: str, engine_kw: dict) -> None:  # noqa: F811
    llm = LLM(mla_ckpt(name), max_model_len=128, **engine_kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in hf_refs["_prompts"]], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == hf_refs[name]
    if "num_gpu_blocks_override" in engine_kw:
        assert llm.engine.stats.num_preemptions > 0
    assert llm.engine.kv.usage() == 0.0


@pytest.mark.usefixtures("unfused_shared_experts")
def test_unfused_shared_experts_match_transformers(mla_ckpt, hf_refs) -> None:  # noqa: F811
    """The shared expert as its own MLP (fuse_shared_experts False; fused above): the same
    greedy tokens as transformers."""
    from specserve.models.moe import SparseMoE

    for name in ("deepseek_v3", "glm4_moe_lite"):
        llm = LLM(mla_ckpt(name), max_model_len=128)
        moe = [m for m in llm.engine.model.modules() if isinstance(m, SparseMoE)]
        assert moe and all(m.shared_experts is not None for m in moe)
        outs = llm.generate([{"prompt_token_ids": p} for p in hf_refs["_prompts"]], GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == hf_refs[name]


def test_structure_loads(mla_ckpt) -> None:  # noqa: F811
    """Dense first layers, MoE after; fp32 routers with the checkpoint's correction bias;
    q_lora_rank null gives a plain q_proj; YaRN's mscale lands in the softmax scale."""
    from specserve.models.layers import MLP, yarn_mscale
    from specserve.models.moe import SparseMoE
    from specserve.models.registry import load_model

    model, _ = load_model(mla_ckpt("deepseek_v3"), torch.float32, "cpu", 256)
    layers = model.model.layers
    assert isinstance(layers[0].mlp, MLP) and all(isinstance(x.mlp, SparseMoE) for x in layers[1:])
    assert all(x.mlp.gate.e_score_correction_bias.abs().sum() > 0 for x in layers[1:])
    assert all(x.mlp.gate.weight.dtype == torch.float32 for x in layers[1:])
    # The shared expert runs as routed expert 8 (models/moe.py), not as its own MLP.
    assert all(x.mlp.shared_experts is None and list(x.mlp.shared_slots) == [8] for x in layers[1:])
    attn = layers[0].self_attn
    # q_a_proj (48 rows) and kv_a_proj_with_mqa (32 + 8) stacked in one matmul, as stored
    assert attn.qkv_a_sizes == (48, 40) and hasattr(attn, "q_b_proj")
    stored = load_file(os.path.join(mla_ckpt("deepseek_v3"), "model.safetensors"))
    fused = attn.fused_qkv_a_proj.weight
    assert torch.equal(fused[:48], stored["model.layers.0.self_attn.q_a_proj.weight"].float())
    kv_a = stored["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"].float()
    assert torch.equal(fused[48:], kv_a)
    m = yarn_mscale(4.0, 0.8)
    assert attn.scale == pytest.approx((16 + 8) ** -0.5 * m * m)
    plain, _ = load_model(mla_ckpt("deepseek_v3_no_q_lora"), torch.float32, "cpu", 256)
    attn = plain.model.layers[0].self_attn
    # q_proj: 4 heads x (16 + 8)
    assert not hasattr(attn, "q_b_proj") and attn.qkv_a_sizes[1] == 40
    stored = load_file(os.path.join(mla_ckpt("deepseek_v3_no_q_lora"), "model.safetensors"))
    q = stored["model.layers.0.self_attn.q_proj.weight"].float()
    assert attn.qkv_a_sizes[0] == q.shape[0]
    assert torch.equal(attn.fused_qkv_a_proj.weight[: q.shape[0]], q)


def test_latent_kv_cache_and_its_size(mla_ckpt) -> None:  # noqa: F811
    """Each MLA layer caches kv_lora_rank + qk_rope_head_dim values per token (one row for all
    heads), not per-head K and V: the KV bytes per token show the saving."""
    from specserve.worker.model_runner import ModelRunner

    llm = LLM(mla_ckpt("deepseek_v3"), max_model_len=128)
    runner = llm.engine.runner
    assert len(runner.kv_caches) == 3
    assert all(c.shape[1:] == (16, 32 + 8) for c in runner.kv_caches)
    layers = runner.attention_layers()
    per_token = ModelRunner.kv_bytes_per_block(layers, 1, torch.float32)
    assert per_token == 3 * (32 + 8) * 4
    full = sum(m.m.full_kv_elems_per_token for m in layers) * 4
    assert full == 3 * 4 * (16 + 8 + 16) * 4
    assert per_token * 4 == full  # a quarter here; DeepSeek-V3's 576 vs 128 * 320: 1/71
    # The cache really holds what the layers wrote: a request's rows are nonzero latents.
    llm.generate([{"prompt_token_ids": list(range(3, 20))}], GREEDY)
    assert runner.kv_caches[0][:-1].abs().sum() > 0


@pytest.mark.parametrize("name", list(MLA_ARCHS))
@pytest.mark.parametrize(
    "engine_kw", [{}, {"max_num_batched_tokens": 16}], ids=["plain", "chunked"]
)
def test_expanded_prefill_matches_transformers(
    mla_ckpt,  # noqa: F811
    hf_refs,
    monkeypatch,
    name: str,
    engine_kw: dict,  # noqa: F811
) -> None:
    """Prefill through per-head K/V (attention.mla_expanded.mla_prefill_expanded: every step
    with a query of >= 2 tokens, decode rows beside prefills included): greedy still equals
    transformers on the mixed-length batch; the path really ran."""
    from specserve.attention import mla_expanded

    calls = []
    run = mla_expanded.mla_prefill_expanded
    monkeypatch.setattr(mla_expanded, "mla_prefill_expanded", lambda *a: calls.append(1) or run(*a))
    with override(mla_expand_prefill_min_query=2):
        llm = LLM(mla_ckpt(name), max_model_len=128, **engine_kw)
        outs = llm.generate([{"prompt_token_ids": p} for p in hf_refs["_prompts"]], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == hf_refs[name]
    assert calls


def test_expanded_prefill_stays_latent_past_its_budget(mla_ckpt) -> None:  # noqa: F811
    """mla_expand_max_elements bounds the expanded K/V of a step: past it the step stays
    latent."""
    from specserve.attention.backend import CommonAttentionMetadata
    from specserve.attention.mla_expanded import expand_fits

    model = LLM(mla_ckpt("deepseek_v3"), max_model_len=64).engine.model
    w = model.model.layers[1].self_attn.weights()
    c = CommonAttentionMetadata(
        query_start_loc=torch.tensor([0, 32], dtype=torch.int32),
        seq_lens=torch.tensor([32], dtype=torch.int32), positions=torch.arange(32),
        block_table=torch.zeros(1, 4, dtype=torch.int32), slot_mapping=torch.arange(32),
        token_req=torch.zeros(32, dtype=torch.long), num_reqs=1, num_tokens=32,
        max_query_len=32, max_seq_len=32,
    )  # fmt: skip
    assert not expand_fits(c, w, 8)  # off by default
    need = 32 * w.w_uk.shape[0] * (w.nope + 8 + w.w_uv.shape[1])  # S x H x (nope + R + v)
    with override(mla_expand_prefill_min_query=16):
        assert expand_fits(c, w, 8)
        with override(mla_expand_max_elements=need):
            assert expand_fits(c, w, 8)
        with override(mla_expand_max_elements=need - 1):
            assert not expand_fits(c, w, 8)
    with override(mla_expand_prefill_min_query=33, mla_expand_max_elements=1 << 28):
        assert not expand_fits(c, w, 8)


def test_absorbed_attention_equals_expanded(mla_ckpt) -> None:  # noqa: F811
    """One MLA layer over a paged latent cache (absorbed W_UK / W_UV, latent-space attention)
    equals transformers' DeepseekV3Attention (per-head K/V expanded from the latent) in fp32,
    across prefill and a later decode step reading the cache."""
    from specserve.attention.torch_ref import TorchAttentionBackend

    _absorbed_vs_expanded(mla_ckpt, TorchAttentionBackend())


@needs_interpreter
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "glue"])
@pytest.mark.parametrize("name", ["deepseek_v3", "glm4_moe_lite"])
def test_triton_mla_layer_equals_expanded_interpreter(
    interpreter,  # noqa: F811
    mla_ckpt,  # noqa: F811
    monkeypatch,
    fused: bool,
    name: str,
) -> None:
    """The same through the Triton backend under the interpreter: the fused prologue (norm,
    de-interleaved RoPE, W_UK absorb, latent write), split-KV attention over max_model_len-bound
    splits and the merge kernel's W_UV (`fused`), or the torch glue around the split kernel."""
    from specserve.attention import mla_fused
    from specserve.attention.triton_paged import TritonAttentionBackend

    calls = []
    run_fused = mla_fused.mla_forward_fused
    monkeypatch.setattr(mla_fused, "mla_forward_fused", lambda *a: calls.append(1) or run_fused(*a))
    # glue: no step is small enough for the fused kernels
    with override(mla_fuse_max_tokens=tunables().mla_fuse_max_tokens if fused else 0):
        _absorbed_vs_expanded(mla_ckpt, TritonAttentionBackend(max_model_len=256), name)
    assert len(calls) == (3 if fused else 0)


def _absorbed_vs_expanded(mla_ckpt, backend, name: str = "deepseek_v3") -> None:  # noqa: F811
    import transformers as tf

    from specserve.attention.backend import CommonAttentionMetadata, ForwardContext
    from specserve.models.registry import load_model

    path = mla_ckpt(name)
    ours, _ = load_model(path, torch.float32, "cpu", 256)
    hf = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    attn, ref = ours.model.layers[1].self_attn, hf.model.layers[1].self_attn
    S, bs = 11, 4
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, S, 64, generator=g)
    pos = torch.arange(S)
    cos, sin = hf.model.rotary_emb(x, pos[None])
    mask = torch.full((S, S), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        want, _ = ref(x, (cos, sin), mask)
    cache = torch.zeros(*attn.kv_cache_shape(6, bs))
    attn.kv_index = 0
    table = torch.tensor([[5, 2, 0, 3]], dtype=torch.int32)  # pages out of order

    def run(lo: int, hi: int) -> torch.Tensor:
        p = pos[lo:hi]
        blocks = table[0, p // bs].long()
        common = CommonAttentionMetadata(
            query_start_loc=torch.tensor([0, hi - lo], dtype=torch.int32),
            seq_lens=torch.tensor([hi], dtype=torch.int32),
            positions=p,
            block_table=table,
            slot_mapping=blocks * bs + p % bs,
            token_req=torch.zeros(hi - lo, dtype=torch.long),
            num_reqs=1,
            num_tokens=hi - lo,
            max_query_len=hi - lo,
            max_seq_len=hi,
        )
        ctx = ForwardContext(backend, [cache], {None: backend.build(common, None)})
        with torch.no_grad():
            return attn(p, x[0, lo:hi], ctx)

    got = torch.cat([run(0, 8), run(8, 9), run(9, S)])
    torch.testing.assert_close(got, want[0], atol=2e-5, rtol=1e-4)
