"""gpt-oss with its MXFP4 experts kept 4-bit (models/moe.py Mxfp4Experts, ops/moe_mxfp4.py):
the tiny MXFP4 checkpoint of test_gpt_oss.py (transformers' bf16 model, experts re-stored as the
published checkpoints store them) through the engine, against the dequantized path and
transformers; random 4-bit weights for load_format="dummy"; strict loading."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from specserve import LLM, SamplingParams

from .conftest import hf_generate, hf_model
from .test_gpt_oss import GREEDY, gpt_oss_ckpt, random_prompts, write_mxfp4
from .test_triton_attention import interpreter, needs_interpreter  # noqa: F401 - a fixture

# Two decode steps after the prefill: each is ~4 s of the interpreter.
FEW = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def mxfp4_path(ckpt_dir, tmp_path_factory) -> str:
    return write_mxfp4(gpt_oss_ckpt(ckpt_dir), str(tmp_path_factory.mktemp("mx4") / "ckpt"))


def _gen(llm: LLM, prompts: list[list[int]], sp: SamplingParams) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
    return [o.outputs[0].token_ids for o in outs]


def _experts(llm: LLM) -> list[torch.nn.Module]:
    return [layer.mlp.experts for layer in llm.engine.model.model.layers]


def _assert_4bit(llm: LLM) -> None:
    from specserve.models.moe import Mxfp4Experts

    for e in _experts(llm):
        assert isinstance(e, Mxfp4Experts)
        for name in ("w13_blocks", "w13_scales", "w2_blocks", "w2_scales"):
            assert getattr(e, name).dtype == torch.uint8, name
        assert not hasattr(e, "w13")


@pytest.mark.interpret
@needs_interpreter
@pytest.mark.usefixtures("interpreter")
def test_4bit_experts_interpreter_match_dequantized(mxfp4_path: str) -> None:
    """mxfp4_experts="mxfp4" on CPU under TRITON_INTERPRET=1: the Triton MXFP4 kernels (the
    grouped GEMM for the 12- and 20-token prefills, the decode kernels after) give the
    dequantized path's tokens."""
    prompts = random_prompts(2, 12, 20, seed=5)
    dense = LLM(mxfp4_path, max_model_len=64)
    assert dense.engine.model.model.layers[0].mlp.experts.w13.dtype == torch.float32
    want = _gen(dense, prompts, FEW)
    llm = LLM(mxfp4_path, max_model_len=64, mxfp4_experts="mxfp4")
    _assert_4bit(llm)
    assert _gen(llm, prompts, FEW) == want


def test_4bit_experts_cpu_fallback_matches_transformers(mxfp4_path: str) -> None:
    """Without the interpreter the 4-bit experts dequantize on each call (the fallback): still
    transformers' tokens on the MXFP4 checkpoint."""
    import transformers as tf

    prompts = random_prompts(2, 5, 20, seed=9)
    hf = hf_model(mxfp4_path, quantization_config=tf.Mxfp4Config(dequantize=True))
    refs = [hf_generate(hf, p, GREEDY.max_tokens) for p in prompts]
    llm = LLM(mxfp4_path, max_model_len=128, mxfp4_experts="mxfp4")
    _assert_4bit(llm)
    assert _gen(llm, prompts, GREEDY) == refs


def test_4bit_rows_are_the_dequantized_rows(mxfp4_path: str) -> None:
    """Blocks and scales are de-interleaved as rows: dequantized, they are exactly the experts
    of the dequantize-at-load path."""
    from specserve.models.registry import load_model
    from specserve.ops.mxfp4 import dequantize_mxfp4

    kept, _ = load_model(mxfp4_path, torch.float32, "cpu", 64, mxfp4_experts="mxfp4")
    dense, _ = load_model(mxfp4_path, torch.float32, "cpu", 64)
    for k, d in zip(kept.model.layers, dense.model.layers, strict=True):
        e, ref = k.mlp.experts, d.mlp.experts
        assert torch.equal(dequantize_mxfp4(e.w13_blocks, e.w13_scales, torch.float32), ref.w13)
        assert torch.equal(dequantize_mxfp4(e.w2_blocks, e.w2_scales, torch.float32), ref.w2)
        assert torch.equal(e.w13_bias, ref.w13_bias)


def test_4bit_strict_loading(mxfp4_path: str, tmp_path) -> None:
    """A missing scales tensor is named by its checkpoint name; an unknown one fails too."""
    from specserve.models.loader import ModelLoadError
    from specserve.models.registry import load_model

    for edit, match in (
        ("drop", r"layers\.1\.mlp\.experts\.gate_up_proj_scales"),
        ("extra", r"layers\.0\.mlp\.experts\.extra_blocks"),
    ):
        dst = str(tmp_path / edit)
        shutil.copytree(mxfp4_path, dst)
        f = os.path.join(dst, "model.safetensors")
        w = load_file(f)
        if edit == "drop":
            del w["model.layers.1.mlp.experts.gate_up_proj_scales"]
        else:
            pre = "model.layers.0.mlp.experts."
            for kind in ("blocks", "scales"):
                w[f"{pre}extra_{kind}"] = w[f"{pre}down_proj_{kind}"].clone()
        save_file(w, f)
        with pytest.raises(ModelLoadError, match=match):
            load_model(dst, torch.float32, "cpu", 64, mxfp4_experts="mxfp4")


def test_dummy_4bit_weights(mxfp4_path: str) -> None:
    """load_format="dummy" on an MXFP4 config gives random 4-bit experts at the dense dummy
    weights' scale (~0.02), so benchmarks read the bytes a real checkpoint would."""
    from specserve.models.mxfp4 import DUMMY_SCALES, dequantize_mxfp4
    from specserve.models.registry import load_model

    model, _ = load_model(
        mxfp4_path, torch.float32, "cpu", 64, load_format="dummy", mxfp4_experts="mxfp4"
    )
    e = model.model.layers[0].mlp.experts
    assert e.w13_blocks.dtype == torch.uint8
    assert e.w13_blocks.unique().numel() > 200  # random code bytes, not a constant
    assert set(e.w2_scales.unique().tolist()) == set(DUMMY_SCALES)
    w = dequantize_mxfp4(e.w13_blocks, e.w13_scales, torch.float32)
    assert 0.01 < w.std().item() < 0.04
    x = torch.randn(3, model.config.hidden_size)
    with torch.no_grad():
        out = model.model.layers[0].mlp(x)
    assert out.isfinite().all() and out.abs().sum() > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_4bit_experts_match_transformers_and_dequantized(mxfp4_path: str) -> None:
    """On CUDA the experts stay 4-bit by default (uint8 parameters) and the MXFP4 kernels give
    transformers' tokens in fp32 (TF32 off), the dequantized path's, and with CUDA graphs the
    eager tokens, in fp32 and bf16. Prompts of 5-30 tokens: the grouped GEMM (prefill) and
    the decode kernels."""
    import transformers as tf

    torch.backends.cuda.matmul.allow_tf32 = False
    prompts = random_prompts(4, 5, 30, seed=9)
    hf = hf_model(mxfp4_path, quantization_config=tf.Mxfp4Config(dequantize=True))
    refs = [hf_generate(hf, p, GREEDY.max_tokens) for p in prompts]
    kw = dict(device="cuda", max_model_len=128)
    graph = LLM(mxfp4_path, dtype="float32", **kw)
    _assert_4bit(graph)
    assert _gen(graph, prompts, GREEDY) == refs
    eager = LLM(mxfp4_path, dtype="float32", enforce_eager=True, **kw)
    assert _gen(eager, prompts, GREEDY) == refs
    dense = LLM(mxfp4_path, dtype="float32", mxfp4_experts="dequantize", **kw)
    assert _experts(dense)[0].w13.dtype == torch.float32
    assert _gen(dense, prompts, GREEDY) == refs
    del graph, eager, dense
    bf16 = LLM(mxfp4_path, dtype="bfloat16", **kw)
    _assert_4bit(bf16)
    bf16_eager = LLM(mxfp4_path, dtype="bfloat16", enforce_eager=True, **kw)
    assert _gen(bf16, prompts, GREEDY) == _gen(bf16_eager, prompts, GREEDY)
