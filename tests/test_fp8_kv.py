"""fp8 KV cache (kv_cache_dtype fp8 / fp8_e4m3 / fp8_e5m2) through the engine on the CPU's torch
reference backend:

- speculation stays exact under fp8: greedy output with every drafter equals greedy output
  without speculation (both fp8), and a seeded request gives the same tokens alone and in a
  batch;
- capacity: the same kv_cache_memory holds twice the blocks of a bf16 cache;
- scales: the checkpoint's k_scale / v_scale / kv_scale fill the layers' kv_scales (a scale of no
  layer fails the load), calculate_kv_scales sets them from the first prefill;
- accuracy: prompt logprobs with an fp8 cache against the model's own dtype, for a tiny model of
  each family and for the default model (figures printed: `pytest -s`).
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from specserve import LLM, SamplingParams
from specserve.config import EngineConfig
from specserve.models.loader import ModelLoadError

from .conftest import random_prompts
from .mla_utils import make_mla_checkpoint
from .spec_utils import (
    write_eagle,
    write_eagle3,
    write_mtp_target,
    write_multi_mtp_target,
    write_ptd_eagle3,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TARGET = ("llama_gqa", "llama")


@pytest.fixture(scope="module")
def setup(ckpt_dir, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("fp8kv")
    target = ckpt_dir(*TARGET)
    return {
        "target": target,
        "prompts": random_prompts(4, 4, 40, seed=11),
        "draft_model": ckpt_dir("small_draft", "llama", num_hidden_layers=2, seed=5),
        "eagle": write_eagle(os.path.join(root, "eagle")),
        "eagle3": write_eagle3(os.path.join(root, "eagle3")),
        "mtp": write_mtp_target(target, os.path.join(root, "mtp_target")),
        "mtp2": write_multi_mtp_target(target, os.path.join(root, "mtp2"), 2, seed=3),
        "ptd": write_ptd_eagle3(os.path.join(root, "ptd")),
    }


def _spec(setup: dict, kind: str) -> tuple[str, dict]:
    """(target, speculative_config) of a drafter kind."""
    target = setup["target"]
    # A fixed K (the adaptive budget may choose 0 drafts from step times).
    cfg: dict = {"num_speculative_tokens": 3, "adaptive": False}
    if kind in ("draft_model", "eagle", "eagle3"):
        cfg |= {"method": kind, "model": setup[kind]}
    elif kind in ("mtp", "mtp2"):
        cfg |= {"method": "mtp", "num_speculative_tokens": 2 if kind == "mtp2" else 3}
        target = setup[kind]
    elif kind == "ptd":
        cfg |= {"method": "eagle3", "model": setup["ptd"], "parallel_draft": True}
    else:
        cfg |= {"method": "ngram", "prompt_lookup_min": 1}
    return target, cfg


def _tokens(llm: LLM, prompts: list[list[int]], sp: SamplingParams | list) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


# ---- config and capacity -----------------------------------------------------------------------
def test_kv_cache_dtype_names(ckpt_dir) -> None:
    path = ckpt_dir(*TARGET)
    assert EngineConfig(path, kv_cache_dtype="fp8").kv_cache_torch_dtype == torch.float8_e4m3fn
    assert EngineConfig(path, kv_cache_dtype="fp8_e4m3").kv_cache_torch_dtype == (
        torch.float8_e4m3fn
    )
    assert EngineConfig(path, kv_cache_dtype="fp8_e5m2").kv_cache_torch_dtype == torch.float8_e5m2
    assert EngineConfig(path, dtype="bfloat16").kv_cache_torch_dtype == torch.bfloat16
    with pytest.raises(ValueError, match="kv_cache_dtype must be auto, fp8"):
        EngineConfig(path, kv_cache_dtype="int8")


def test_fp8_holds_twice_the_blocks_of_bf16(ckpt_dir) -> None:
    path = ckpt_dir(*TARGET)
    mem = 1 << 20
    counts = {}
    for kv in ("auto", "fp8"):
        llm = LLM(path, dtype="bfloat16", kv_cache_memory=mem, kv_cache_dtype=kv)
        m = llm.get_metrics()
        counts[kv] = m["kv_cache_num_blocks"]
        assert m["kv_cache_num_tokens"] == m["kv_cache_num_blocks"] * 16
        assert llm.engine.runner.kv_caches[0].dtype == (
            torch.bfloat16 if kv == "auto" else torch.float8_e4m3fn
        )
    print(f"\nblocks in {mem} bytes: bf16 {counts['auto']}, fp8 {counts['fp8']}")
    assert counts["fp8"] >= 1.9 * counts["auto"]


# ---- exactness ---------------------------------------------------------------------------------
KINDS = ["draft_model", "eagle", "eagle3", "mtp", "mtp2", "ptd", "ngram"]


@pytest.fixture(scope="module")
def plain_fp8(setup: dict) -> dict[str, list[list[int]]]:
    """Greedy tokens without speculation under fp8, per target checkpoint."""
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    out = {}
    for name in ("target", "mtp", "mtp2"):
        llm = LLM(setup[name], max_model_len=128, kv_cache_dtype="fp8")
        out[setup[name]] = _tokens(llm, setup["prompts"], sp)
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_spec_equals_plain_under_fp8(setup: dict, plain_fp8: dict, kind: str) -> None:
    target, cfg = _spec(setup, kind)
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    llm = LLM(target, max_model_len=128, kv_cache_dtype="fp8", speculative_config=cfg)
    assert _tokens(llm, setup["prompts"], sp) == plain_fp8[target]
    m = llm.get_metrics()
    if kind != "ngram":  # n-gram finds few matches in random prompts
        assert m["spec_decode_num_draft_tokens_total"] > 0


@pytest.mark.parametrize("kind", ["eagle3", "mtp2", "ngram"])
@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2"])
def test_seeded_same_alone_and_in_batch_under_fp8(setup: dict, kind: str, kv: str) -> None:
    target, cfg = _spec(setup, kind)
    prompts = setup["prompts"]
    sps = [SamplingParams(temperature=0.8, seed=100 + i, max_tokens=16) for i in range(4)]
    llm = LLM(target, max_model_len=128, kv_cache_dtype=kv, speculative_config=cfg)
    batch = _tokens(llm, prompts, sps)
    alone = [_tokens(llm, [p], sp)[0] for p, sp in zip(prompts, sps)]
    assert batch == alone
    plain = LLM(target, max_model_len=128, kv_cache_dtype=kv)
    assert _tokens(plain, prompts, sps) == batch  # coupled verification: plain sampling's tokens


def test_prefix_cache_and_preemption_under_fp8(setup: dict, plain_fp8: dict) -> None:
    """A small fp8 pool: requests preempt each other and repeat prompts hit the prefix cache;
    the tokens stay plain decoding's."""
    target, cfg = _spec(setup, "eagle3")
    prompts = setup["prompts"]
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    llm = LLM(
        target,
        max_model_len=128,
        kv_cache_dtype="fp8",
        speculative_config=cfg,
        num_gpu_blocks_override=8,
        max_num_seqs=4,
    )
    assert _tokens(llm, prompts + prompts, sp) == plain_fp8[target] * 2
    llm.engine.kv.check_no_leaks()


# ---- scales ------------------------------------------------------------------------------------
def _with_tensors(src: str, dst: str, extra: dict[str, torch.Tensor]) -> str:
    shutil.copytree(src, dst)
    w = load_file(os.path.join(dst, "model.safetensors"))
    w.update(extra)
    save_file(w, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_checkpoint_scales_fill_kv_scales(setup: dict, tmp_path) -> None:
    scales = {
        "model.layers.0.self_attn.k_scale": torch.tensor(0.5),
        "model.layers.0.self_attn.v_scale": torch.tensor(0.25),
        "model.layers.1.self_attn.kv_scale": torch.tensor([0.125]),
    }
    path = _with_tensors(setup["target"], str(tmp_path / "scaled"), scales)
    llm = LLM(path, max_model_len=128, kv_cache_dtype="fp8")
    layers = llm.engine.runner.attention_layers()
    assert layers[0].kv_scales.tolist() == [0.5, 0.25]
    assert layers[1].kv_scales.tolist() == [0.125, 0.125]
    assert layers[2].kv_scales.tolist() == [1.0, 1.0]
    # The scales change what the cache holds, not the tokens' meaning: close to unscaled.
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    assert len(_tokens(llm, setup["prompts"][:1], sp)[0]) == 8
    # kv_cache_dtype auto loads them too (known tensors) and leaves the cache unscaled.
    LLM(path, max_model_len=128)

    bad = {"model.layers.0.mlp.k_scale": torch.tensor(1.0)}
    bad_path = _with_tensors(setup["target"], str(tmp_path / "bad"), bad)
    with pytest.raises(ModelLoadError, match="layers.0.mlp.k_scale"):
        LLM(bad_path, max_model_len=128, kv_cache_dtype="fp8")


def test_calculate_kv_scales_from_first_prefill(setup: dict) -> None:
    target, cfg = _spec(setup, "eagle3")
    llm = LLM(
        target,
        max_model_len=128,
        kv_cache_dtype="fp8",
        calculate_kv_scales=True,
        speculative_config=cfg,
    )
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = setup["prompts"]
    first = _tokens(llm, prompts[:1], sp)
    layers = llm.engine.runner.attention_layers()
    assert not llm.engine.runner.kv_scales_todo
    for layer in layers:  # target and drafter layers alike
        k_scale, v_scale = layer.kv_scales.tolist()
        assert 0 < k_scale < 1 and 0 < v_scale < 1 and k_scale != v_scale
    # Value scale = amax(v) / 100 of layer 0's first prefill, recomputed here.
    model = llm.engine.model
    emb = model.model.embed_tokens(torch.tensor(prompts[0]))
    attn = layers[0]
    h = model.model.layers[0].input_layernorm(emb)
    v = attn.qkv_proj(h).split([attn.q_size, attn.kv_size, attn.kv_size], -1)[2]
    torch.testing.assert_close(attn.kv_scales[1], v.abs().amax() / 100.0)
    # Later requests keep the scales; speculation stays exact under them.
    before = [layer.kv_scales.clone() for layer in layers]
    plain = LLM(target, max_model_len=128, kv_cache_dtype="fp8")
    for layer, s in zip(plain.engine.runner.attention_layers(), before):
        layer.kv_scales.copy_(s)
    assert _tokens(llm, prompts, sp) == _tokens(plain, prompts, sp)
    assert first[0] == _tokens(plain, prompts[:1], sp)[0]
    for layer, s in zip(layers, before):
        assert torch.equal(layer.kv_scales, s)


# ---- accuracy ----------------------------------------------------------------------------------
def prompt_logprob_diff(path: str, prompts: list[list[int]], kv: str, **kw) -> float:
    """Mean |logprob(fp8 KV) - logprob(the model's dtype)| over the prompt tokens (nats)."""
    sp = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    out = {}
    for kv_dtype in ("auto", kv):
        llm = LLM(path, max_model_len=512, kv_cache_dtype=kv_dtype, **kw)
        res = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        vals = []
        for p, r in zip(prompts, res):
            for tok, lp in zip(p[1:], r.prompt_logprobs[1:]):
                vals.append(lp[tok])
        out[kv_dtype] = torch.tensor(vals, dtype=torch.float64)
        del llm
    return (out[kv] - out["auto"]).abs().mean().item()


FAMILIES = {
    "llama": ("llama_gqa", "llama", {}),
    "qwen3": ("qwen3_fp8kv", "qwen3", {"head_dim": 16}),
    "qwen3_moe": (
        "qwen3_moe_fp8kv",
        "qwen3_moe",
        {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
    ),
    "gpt_oss": (
        "gpt_oss_fp8kv",
        "gpt_oss",
        {
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "head_dim": 16,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention"] * 2,
        },
    ),
}


@pytest.mark.parametrize("family", [*FAMILIES, "deepseek_mla"])
@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2"])
def test_prompt_logprobs_fp8_close_to_model_dtype(
    ckpt_dir, tmp_path_factory, family: str, kv: str
) -> None:
    if family == "deepseek_mla":
        path = make_mla_checkpoint(str(tmp_path_factory.mktemp("mla") / "ds"), "deepseek_v3")
    else:
        name, arch, overrides = FAMILIES[family]
        path = ckpt_dir(name, arch, **overrides)
    prompts = random_prompts(3, 40, 120, seed=7)
    diff = prompt_logprob_diff(path, prompts, kv)
    print(f"\n{family} {kv}: mean |prompt logprob diff| = {diff:.5f} nats/token")
    # Random tiny models (fp32 on the CPU, initializer_range 0.15: sharper attention than a
    # trained model's) measured 0.07-0.24 (e4m3) and 0.14-0.36 (e5m2), gpt-oss the largest.
    assert diff < (0.3 if kv == "fp8_e4m3" else 0.5)


def test_default_model_prompt_logprobs_fp8() -> None:
    from specserve.data import default_model, load_prompts

    try:
        gguf, _ = default_model()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    llm = LLM(gguf, max_model_len=512)
    tok = llm.engine.tokenizer
    del llm
    # 8 held-out code prompts, 514 scored tokens. Measured 0.097 nats (fp32 weights, e4m3,
    # scales 1.0); keys carry most of it (keys alone 0.083, values alone 0.038; a bf16 cache
    # 0.006).
    prompts = [tok.encode(r["prompt"])[:256] for r in load_prompts("code", 8)]
    diff = prompt_logprob_diff(gguf, prompts, "fp8")
    print(f"\nSmolLM2-135M fp8_e4m3: mean |prompt logprob diff| = {diff:.5f} nats/token")
    assert diff <= 0.1
