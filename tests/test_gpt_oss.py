"""gpt-oss targets against transformers' generate: attention sinks, alternating sliding-window
and full layers (prompts longer than the window), YaRN, biased router and experts with the
clamped SwiGLU; bf16-stored and MXFP4-stored checkpoints."""

from __future__ import annotations

import json
import math
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from specserve import LLM, SamplingParams

from .conftest import hf_generate, hf_greedy, hf_model, random_prompts
from .test_triton_attention import interpreter, needs_interpreter  # noqa: F401 - a fixture

WINDOW = 8
GPT_OSS = dict(
    num_hidden_layers=3,  # sliding, full, sliding
    head_dim=16,
    intermediate_size=32,
    num_local_experts=8,
    num_experts_per_tok=2,
    sliding_window=WINDOW,
    # A limit the tiny model's activations reach, so the clamps matter.
    swiglu_limit=0.6,
    # YaRN whose ramp lands inside head_dim 16's frequencies.
    rope_parameters=dict(
        rope_type="yarn",
        rope_theta=10000.0,
        factor=8.0,
        beta_fast=32.0,
        beta_slow=1.0,
        truncate=False,
        original_max_position_embeddings=64,
    ),
)
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


def _randomize_biases(path: str, dtype: torch.dtype) -> None:
    """transformers initializes biases to zero: random ones check the q/k/v/o, router and
    (interleaved) expert biases load where they belong; sinks get a wider spread."""
    f = os.path.join(path, "model.safetensors")
    w = load_file(f)
    g = torch.Generator().manual_seed(3)
    for k, t in w.items():
        if k.endswith("bias") or k.endswith("sinks"):
            scale = 1.0 if k.endswith("sinks") else 0.1
            w[k] = (torch.randn(t.shape, generator=g) * scale).to(dtype)
    save_file(w, f, metadata={"format": "pt"})


def gpt_oss_ckpt(ckpt_dir, name: str = "gpt_oss", **over) -> str:
    """A bf16-stored tiny gpt-oss with random biases and sinks (cached per session)."""
    path = ckpt_dir(name, "gpt_oss", **{**GPT_OSS, **over})
    marker = os.path.join(path, "bf16_biases")
    if not os.path.exists(marker):
        f = os.path.join(path, "model.safetensors")
        save_file({k: t.bfloat16() for k, t in load_file(f).items()}, f)
        _randomize_biases(path, torch.bfloat16)
        open(marker, "w").close()
    return path


@pytest.fixture(scope="module")
def gpt_oss(ckpt_dir) -> dict:
    """The tiny gpt-oss and transformers' greedy output on it (computed in fp32)."""
    path = gpt_oss_ckpt(ckpt_dir)
    prompts = random_prompts(4, 5, 30, seed=9)
    assert max(map(len, prompts)) > 2 * WINDOW
    refs = [hf_greedy(path, p, GREEDY.max_tokens) for p in prompts]
    assert all(len(set(r)) > 3 for r in refs)  # not a degenerate repeat
    return {"path": path, "prompts": prompts, "refs": refs}


def _gen(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize(
    "engine_kw",
    [
        {},
        {"max_num_batched_tokens": 16},  # chunked prefill
        {"num_gpu_blocks_override": 6, "max_num_batched_tokens": 64},  # preemption
    ],
    ids=["plain", "chunked", "preempt"],
)
def test_greedy_matches_transformers(gpt_oss: dict, engine_kw: dict) -> None:
    llm = LLM(gpt_oss["path"], max_model_len=128, **engine_kw)
    assert _gen(llm, gpt_oss["prompts"]) == gpt_oss["refs"]
    if "num_gpu_blocks_override" in engine_kw:
        assert llm.engine.stats.num_preemptions > 0
    assert llm.engine.kv.usage() == 0.0


def test_layers_and_parameters(gpt_oss: dict) -> None:
    from specserve.models.registry import load_model

    model, _ = load_model(gpt_oss["path"], torch.float32, "cpu", 128)
    layers = model.model.layers
    assert [layer.self_attn.sliding_window for layer in layers] == [WINDOW, None, WINDOW]
    assert all(layer.self_attn.sinks.abs().sum() > 0 for layer in layers)
    assert layers[0].mlp.experts.w13_bias.abs().sum() > 0
    assert layers[0].mlp.gate.bias.abs().sum() > 0


@pytest.mark.parametrize("truncate", [True, False])
def test_yarn_matches_transformers(truncate: bool) -> None:
    import transformers as tf
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from specserve.models.layers import RotaryEmbedding

    rope = {**GPT_OSS["rope_parameters"], "truncate": truncate}
    cfg = tf.GptOssConfig(head_dim=16, hidden_size=64, num_attention_heads=4, rope_parameters=rope)
    inv_freq, mscale = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    ours = RotaryEmbedding(16, 100, rope["rope_theta"], rope)
    pos = torch.arange(100, dtype=torch.float32)
    freqs = torch.outer(pos, inv_freq)
    assert mscale == pytest.approx(0.1 * math.log(8.0) + 1.0)
    torch.testing.assert_close(ours.cos[:, :8], freqs.cos() * mscale, atol=2e-5, rtol=0)
    torch.testing.assert_close(ours.sin[:, 8:], freqs.sin() * mscale, atol=2e-5, rtol=0)


def test_reference_takes_config_swiglu(gpt_oss: dict) -> None:
    """The reference clamps at the checkpoint's swiglu_limit, not transformers' hard-coded 7.0
    of releases before 5.24 (conftest.honour_swiglu_config): with 7.0 the reference alone
    changed, from the first generated token on (the GPU image's 5.17 did)."""
    hf = hf_model(gpt_oss["path"])
    for layer in hf.model.layers:
        assert layer.mlp.experts.limit == GPT_OSS["swiglu_limit"]
        assert layer.mlp.experts.alpha == pytest.approx(1.702)


@needs_interpreter
@pytest.mark.parametrize("engine_kw", [{}, {"max_num_batched_tokens": 16}], ids=["plain", "chunk"])
def test_triton_backend_interpreter(
    gpt_oss: dict,
    interpreter: None,  # noqa: F811
    engine_kw: dict,
) -> None:
    """The engine through the Triton attention backend on CPU (interpreter): RoPE + KV write
    kernel for prefill, RoPE and KV write inside the attention kernel for decode, sinks and
    per-layer windows at the tiny model's shapes (head_dim 16, GQA 2, window 8)."""
    llm = LLM(gpt_oss["path"], max_model_len=128, attention_backend="triton", **engine_kw)
    assert llm.engine.runner.backend.name == "triton"
    prompts = gpt_oss["prompts"][:2]
    few = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], few)
    assert [o.outputs[0].token_ids for o in outs] == [r[:6] for r in gpt_oss["refs"][:2]]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("engine_kw", [{}, {"max_num_batched_tokens": 16}], ids=["plain", "chunk"])
def test_cuda_matches_transformers(gpt_oss: dict, engine_kw: dict) -> None:
    """Triton attention with sinks and per-layer windows, fp32 (TF32 off): transformers' tokens.
    Eager: the experts' biases and clamped SwiGLU run in fused_moe's torch reference on CUDA,
    which syncs with the host and so cannot be captured in a CUDA graph."""
    torch.backends.cuda.matmul.allow_tf32 = False
    kw = dict(device="cuda", dtype="float32", max_model_len=128, enforce_eager=True)
    llm = LLM(gpt_oss["path"], **kw, **engine_kw)
    assert _gen(llm, gpt_oss["prompts"]) == gpt_oss["refs"]


def write_mxfp4(src: str, dst: str) -> str:
    """`src` with its experts stored as the published checkpoints store them: quantization_config
    mxfp4, `experts.{gate_up,down}_proj_{blocks,scales}` over [E, out, in] rows."""
    from specserve.ops.mxfp4 import quantize_mxfp4

    shutil.copytree(src, dst)
    w = load_file(os.path.join(src, "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    for k, t in w.items():
        if k.endswith(("experts.gate_up_proj", "experts.down_proj")):
            out[k + "_blocks"], out[k + "_scales"] = quantize_mxfp4(t.float().mT)
        else:
            out[k] = t
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(dst, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    return dst


@pytest.fixture(scope="module")
def mxfp4(gpt_oss: dict, tmp_path_factory) -> dict:
    """The tiny gpt-oss in MXFP4, and transformers' greedy output loading that checkpoint
    (dequantized on the CPU by its own integrations/mxfp4.py)."""
    import transformers as tf

    path = write_mxfp4(gpt_oss["path"], str(tmp_path_factory.mktemp("mxfp4") / "ckpt"))
    hf = hf_model(path, quantization_config=tf.Mxfp4Config(dequantize=True))
    refs = [hf_generate(hf, p, GREEDY.max_tokens) for p in gpt_oss["prompts"]]
    return {"path": path, "refs": refs, "hf": hf}


@pytest.mark.parametrize(
    "engine_kw",
    [{}, {"num_gpu_blocks_override": 6, "max_num_batched_tokens": 16}],
    ids=["plain", "chunked_preempt"],
)
def test_mxfp4_greedy_matches_transformers(gpt_oss: dict, mxfp4: dict, engine_kw: dict) -> None:
    llm = LLM(mxfp4["path"], max_model_len=128, **engine_kw)
    assert _gen(llm, gpt_oss["prompts"]) == mxfp4["refs"]
    if engine_kw:
        assert llm.engine.stats.num_preemptions > 0


def test_mxfp4_dequantizes_as_transformers(gpt_oss: dict, mxfp4: dict) -> None:
    """Our experts equal transformers' dequantized ones exactly (after our de-interleave), and
    differ from the bf16 originals (the checkpoint really is 4-bit)."""
    from specserve.models.registry import load_model

    ours, _ = load_model(mxfp4["path"], torch.float32, "cpu", 128)
    dense, _ = load_model(gpt_oss["path"], torch.float32, "cpu", 128)
    theirs = mxfp4["hf"].model.layers[0].mlp.experts
    e = ours.model.layers[0].mlp.experts
    gate_up = theirs.gate_up_proj.mT  # [E, 2I, H], gate/up rows interleaved
    assert torch.equal(e.w13, torch.cat([gate_up[:, 0::2], gate_up[:, 1::2]], dim=1))
    assert torch.equal(e.w2, theirs.down_proj.mT)
    assert not torch.equal(e.w13, dense.model.layers[0].mlp.experts.w13)


def test_mxfp4_missing_scales_is_named(mxfp4: dict, tmp_path) -> None:
    from specserve.models.loader import ModelLoadError
    from specserve.models.registry import load_model

    dst = str(tmp_path / "broken")
    shutil.copytree(mxfp4["path"], dst)
    f = os.path.join(dst, "model.safetensors")
    w = load_file(f)
    del w["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(w, f)
    with pytest.raises(ModelLoadError, match=r"layers\.1\.mlp\.experts\.down_proj_scales"):
        load_model(dst, torch.float32, "cpu", 128)
