"""Block-scaled fp8 checkpoints (DeepSeek-V3's `quant_method: fp8`, `weight_block_size`,
`*.weight_scale_inv`) load dequantized and match their bf16 original within fp8 tolerance."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from specserve.models.loader import ModelLoadError
from specserve.models.registry import load_model

from .mla_utils import mla_ckpt  # noqa: F401 - fixture
from .spec_utils import append_mtp_layers
from .test_triton_attention import interpreter  # noqa: F401  (fixture)

BLOCK = (16, 16)  # DeepSeek uses 128 x 128; 16 gives several blocks and ragged edges here


def _quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight, scale_inv) with one amax / 448 scale per block, as DeepSeek's quantizer."""
    (n, k), (bn, bk) = w.shape, BLOCK
    nb, kb = -(-n // bn), -(-k // bk)
    padded = w.new_zeros(nb * bn, kb * bk)
    padded[:n, :k] = w
    blocks = padded.view(nb, bn, kb, bk)
    scale = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-12) / 448.0
    q = (blocks / scale[:, None, :, None]).view(nb * bn, kb * bk)[:n, :k]
    return q.to(torch.float8_e4m3fn), scale.float()


def _is_quantized(name: str, t: torch.Tensor) -> bool:
    # Linear weights only: embeddings, lm_head, norms and the router stay as they are.
    skip = ("embed_tokens", "lm_head", "norm", "mlp.gate.weight", "eh_proj")
    return t.dim() == 2 and name.endswith(".weight") and not any(s in name for s in skip)


def _write_fp8_and_dequant(src: str, root: str) -> tuple[str, str, str]:
    """bf16 original, its fp8 block-scaled copy, and the fp8 copy dequantized by the test."""
    paths = [os.path.join(root, n) for n in ("bf16", "fp8", "deq")]
    w = {k: t.bfloat16() for k, t in load_file(os.path.join(src, "model.safetensors")).items()}
    fp8: dict[str, torch.Tensor] = {}
    deq: dict[str, torch.Tensor] = {}
    for k, t in w.items():
        if not _is_quantized(k, t):
            fp8[k] = deq[k] = t
            continue
        q, s = _quantize(t.float())
        fp8[k], fp8[k + "_scale_inv"] = q, s
        rows = torch.arange(t.shape[0]) // BLOCK[0]
        cols = torch.arange(t.shape[1]) // BLOCK[1]
        deq[k] = q.float() * s[rows][:, cols]
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    for path, tensors in zip(paths, (w, fp8, deq)):
        shutil.copytree(src, path)
        c = dict(cfg)
        if tensors is fp8:
            c["quantization_config"] = {
                "quant_method": "fp8",
                "fmt": "e4m3",
                "activation_scheme": "dynamic",
                "weight_block_size": list(BLOCK),
            }
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(c, f)
        save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return paths[0], paths[1], paths[2]


@pytest.fixture(scope="module")
def ckpts(mla_ckpt, tmp_path_factory) -> tuple[str, str, str]:  # noqa: F811
    root = str(tmp_path_factory.mktemp("fp8"))
    src = append_mtp_layers(mla_ckpt("deepseek_v3"), os.path.join(root, "src"), 1)
    return _write_fp8_and_dequant(src, root)


def _logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """One prefill of `ids` through the torch reference backend: [len(ids), vocab]."""
    from specserve.attention.backend import CommonAttentionMetadata, ForwardContext
    from specserve.attention.torch_ref import TorchAttentionBackend
    from specserve.models.layers import KVCacheLayer

    S, bs = len(ids), 16
    nblk = -(-S // bs)
    caches = []
    for i, layer in enumerate(m for m in model.modules() if isinstance(m, KVCacheLayer)):
        layer.kv_index = i
        caches.append(torch.zeros(layer.kv_cache_shape(nblk + 1, bs)))
    pos = torch.arange(S)
    common = CommonAttentionMetadata(
        query_start_loc=torch.tensor([0, S], dtype=torch.int32),
        seq_lens=torch.tensor([S], dtype=torch.int32),
        positions=pos,
        block_table=torch.arange(nblk, dtype=torch.int32)[None],
        slot_mapping=pos,
        token_req=torch.zeros(S, dtype=torch.long),
        num_reqs=1,
        num_tokens=S,
        max_query_len=S,
        max_seq_len=S,
    )
    backend = TorchAttentionBackend()
    ctx = ForwardContext(backend, caches, {None: backend.build(common, None)})
    with torch.no_grad():
        hidden, _ = model(torch.tensor(ids), pos, ctx)
        return model.compute_logits(hidden).float()


def test_fp8_loads_dequantized_and_matches_bf16(ckpts: tuple[str, str, str]) -> None:
    bf16_dir, fp8_dir, deq_dir = ckpts
    orig, _ = load_model(bf16_dir, torch.float32, "cpu", 256)
    fp8, _ = load_model(fp8_dir, torch.float32, "cpu", 256)
    deq, _ = load_model(deq_dir, torch.float32, "cpu", 256)
    so, sf, sd = orig.state_dict(), fp8.state_dict(), deq.state_dict()
    assert sf.keys() == sd.keys() == so.keys()
    # Exactly the block dequantization (fused gate/up and stacked experts included) ...
    assert all(torch.equal(sf[k], sd[k]) for k in sf)
    changed = [k for k in sf if not torch.equal(sf[k], so[k])]
    assert any("kv_b_proj" in k for k in changed) and any("experts.w13" in k for k in changed)
    # ... within e4m3's 3 mantissa bits of the original, relative to each tensor's range.
    for k in changed:
        assert (sf[k] - so[k]).abs().max() <= so[k].abs().max() / 16, k
    # The shared expert, fused as expert 8 of the stacked ones (models/moe.py), dequantized too.
    stored = load_file(os.path.join(deq_dir, "model.safetensors"))
    p = "model.layers.1.mlp."
    gate_up = [stored[f"{p}shared_experts.{n}_proj.weight"] for n in ("gate", "up")]
    assert torch.equal(sf[p + "experts.w13"][8], torch.cat(gate_up))
    assert torch.equal(sf[p + "experts.w2"][8], stored[p + "shared_experts.down_proj.weight"])
    ids = list(range(5, 45))
    a, b = _logits(orig, ids), _logits(fp8, ids)
    assert torch.equal(b, _logits(deq, ids))
    # This random tiny model is chaotic (initializer_range 0.15, a random router): 3%
    # multiplicative weight noise alone moves its logits by ~25% on average; fp8's ~3% rounding
    # moves them by ~29%. The bound is loose on purpose; the weights above are the exact check.
    assert (a - b).abs().mean() < 0.5 * a.abs().mean()
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.4


def test_fp8_mtp_layer_loads_dequantized(ckpts: tuple[str, str, str]) -> None:
    """The checkpoint's MTP layer (the drafter's weights, same files) comes out dequantized."""
    from specserve import LLM

    spec = {"method": "mtp", "num_speculative_tokens": 1}
    a = LLM(ckpts[1], max_model_len=64, speculative_config=spec).engine.speculator.model
    b = LLM(ckpts[2], max_model_len=64, speculative_config=spec).engine.speculator.model
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_fp8_scale_errors_name_the_tensor(ckpts: tuple[str, str, str], tmp_path) -> None:
    path = str(tmp_path / "broken")
    shutil.copytree(ckpts[1], path)
    f = os.path.join(path, "model.safetensors")
    w = load_file(f)
    name = "model.layers.0.self_attn.o_proj.weight_scale_inv"
    w[name] = w[name][:, :1].contiguous()
    save_file(w, f, metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="needs a scale of shape"):
        load_model(path, torch.float32, "cpu", 256)
    del w[name]
    save_file(w, f, metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="o_proj.weight"):
        load_model(path, torch.float32, "cpu", 256)


def _greedy(path: str, fp8_weights: str, **kw) -> tuple[list[list[int]], object]:
    from specserve import LLM, SamplingParams

    llm = LLM(path, max_model_len=64, fp8_weights=fp8_weights, **kw)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs = llm.generate([[5, 9, 13, 2], list(range(20, 31))], params)
    return [o.outputs[0].token_ids for o in outs], llm.engine.model


@pytest.mark.interpret
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="set TRITON_INTERPRET=1")
@pytest.mark.usefixtures("interpreter")
def test_fp8_kept_8bit_matches_dequantized(ckpts: tuple[str, str, str]) -> None:
    """fp8_weights="keep" on CPU (the kernel under the interpreter): the linear layers hold the
    checkpoint's bytes as stored, and greedy tokens equal the dequantized model's."""
    from specserve.models.fp8_linear import Fp8Linear

    kept_tokens, kept = _greedy(ckpts[1], "keep")
    deq_tokens, deq = _greedy(ckpts[1], "dequantize")
    fp8 = {n: m for n, m in kept.named_modules() if isinstance(m, Fp8Linear)}
    # Every quantized linear but MLA's kv_b_proj (read as W_UK / W_UV) and the experts.
    assert any(n.endswith("self_attn.o_proj") for n in fp8)
    assert any(n.endswith("mlp.gate_up_proj") for n in fp8)
    # MLA's fused q_a + kv_a projection (48 + 40 rows: both parts start on a 16-row block)
    assert any(n.endswith("self_attn.fused_qkv_a_proj") for n in fp8)
    assert not any("kv_b_proj" in n or "experts" in n for n in fp8)  # shared ones: fused
    assert not any(isinstance(m, Fp8Linear) for m in deq.modules())
    stored = load_file(os.path.join(ckpts[1], "model.safetensors"))
    name = next(n for n in fp8 if n.endswith("self_attn.o_proj"))
    assert fp8[name].weight.dtype == torch.float8_e4m3fn
    assert torch.equal(
        fp8[name].weight.view(torch.uint8), stored[f"{name}.weight"].view(torch.uint8)
    )
    assert torch.equal(fp8[name].weight_scale_inv, stored[f"{name}.weight_scale_inv"])
    # ... and the fused one holds its two parts' bytes and scales, stacked
    attn = name.removesuffix("o_proj")
    fused = fp8[f"{attn}fused_qkv_a_proj"]
    for what in ("weight", "weight_scale_inv"):
        parts = [stored[f"{attn}{p}.{what}"] for p in ("q_a_proj", "kv_a_proj_with_mqa")]
        got, want = getattr(fused, what), torch.cat(parts)
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert kept_tokens == deq_tokens


@pytest.mark.interpret
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="set TRITON_INTERPRET=1")
@pytest.mark.usefixtures("interpreter", "unfused_shared_experts")
def test_fp8_kept_unfused_shared_mlp(ckpts: tuple[str, str, str]) -> None:
    """With the shared experts left unfused (fuse_shared_experts False), "keep" keeps their
    MLP's projections 8-bit like any linear, and greedy tokens equal the dequantized model's."""
    from specserve.models.fp8_linear import Fp8Linear

    kept_tokens, kept = _greedy(ckpts[1], "keep")
    deq_tokens, _ = _greedy(ckpts[1], "dequantize")
    fp8 = {n for n, m in kept.named_modules() if isinstance(m, Fp8Linear)}
    shared = "model.layers.1.mlp.shared_experts."
    assert {shared + "gate_up_proj", shared + "down_proj"} <= fp8
    assert kept_tokens == deq_tokens


@pytest.mark.gpu
def test_fp8_kept_on_gpu_graph_equals_eager(ckpts: tuple[str, str, str]) -> None:
    """On CUDA with "keep": weights float8, CUDA-graph replay == eager exactly in bf16, and
    greedy == the dequantized model's in float32. (Not in bf16: this tiny random model is
    chaotic, see above, and the two paths round their bf16 products in different orders, which
    flipped a first token on the H100.)"""
    from specserve.models.fp8_linear import Fp8Linear

    graph, model = _greedy(ckpts[1], "keep", device="cuda", dtype="bfloat16")
    eager, _ = _greedy(ckpts[1], "keep", device="cuda", dtype="bfloat16", enforce_eager=True)
    fp8 = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    assert fp8 and all(m.weight.dtype == torch.float8_e4m3fn for m in fp8)
    assert graph == eager
    kept, _ = _greedy(ckpts[1], "keep", device="cuda", dtype="float32", enforce_eager=True)
    deq, _ = _greedy(ckpts[1], "dequantize", device="cuda", dtype="float32", enforce_eager=True)
    assert [t[:2] for t in kept] == [t[:2] for t in deq]


def test_fp8_weights_mode_is_validated(ckpts: tuple[str, str, str]) -> None:
    from specserve.config import EngineConfig

    with pytest.raises(ValueError, match="fp8_weights must be auto, keep or dequantize"):
        EngineConfig(model=ckpts[1], fp8_weights="fp8")
