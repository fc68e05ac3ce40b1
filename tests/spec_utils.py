"""Writers for tiny random drafter checkpoints in the reference layouts, and drafter checks."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from .conftest import VOCAB


def _layer(
    prefix: str,
    hidden: int,
    inter: int,
    heads: int,
    kv: int,
    hd: int,
    qkv_in: int,
    g: torch.Generator,
    input_norm: bool = True,
) -> dict[str, torch.Tensor]:
    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.1

    t = {
        f"{prefix}self_attn.q_proj.weight": w(heads * hd, qkv_in),
        f"{prefix}self_attn.k_proj.weight": w(kv * hd, qkv_in),
        f"{prefix}self_attn.v_proj.weight": w(kv * hd, qkv_in),
        f"{prefix}self_attn.o_proj.weight": w(hidden, heads * hd),
        f"{prefix}mlp.gate_proj.weight": w(inter, hidden),
        f"{prefix}mlp.up_proj.weight": w(inter, hidden),
        f"{prefix}mlp.down_proj.weight": w(hidden, inter),
        f"{prefix}post_attention_layernorm.weight": 1 + w(hidden),
    }
    if input_norm:
        t[f"{prefix}input_layernorm.weight"] = 1 + w(hidden)
    return t


def _config(path: str, arch: str, **extra: object) -> None:
    cfg = dict(
        architectures=[arch],
        model_type="llama",
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        torch_dtype="float32",
    )
    cfg.update(extra)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)


def write_eagle(path: str, seed: int = 0, with_embed: bool = False) -> str:
    g = torch.Generator().manual_seed(seed)
    _config(path, "LlamaForCausalLMEagle")
    t = _layer("layers.0.", 64, 128, 4, 2, 16, 64, g, input_norm=False)
    t["fc.weight"] = torch.randn(64, 128, generator=g) * 0.1
    t["fc.bias"] = torch.randn(64, generator=g) * 0.1
    if with_embed:
        t["embed_tokens.weight"] = torch.randn(VOCAB, 64, generator=g) * 0.1
    save_file(t, os.path.join(path, "model.safetensors"))
    return path


def write_eagle3(
    path: str,
    seed: int = 0,
    draft_vocab: int = 160,
    aux: list[int] | None = None,
    target_hidden: int = 64,
) -> str:
    g = torch.Generator().manual_seed(seed)
    extra: dict[str, object] = {
        "draft_vocab_size": draft_vocab,
        "target_hidden_size": target_hidden,
    }
    if aux is not None:
        extra["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux}
    _config(path, "LlamaForCausalLMEagle3", **extra)
    t = _layer("midlayer.", 64, 128, 4, 2, 16, 128, g)
    t["midlayer.hidden_norm.weight"] = 1 + torch.randn(64, generator=g) * 0.1
    t["fc.weight"] = torch.randn(64, 3 * target_hidden, generator=g) * 0.1
    t["norm.weight"] = torch.ones(64)
    t["lm_head.weight"] = torch.randn(draft_vocab, 64, generator=g) * 0.1
    # Draft vocabulary: every other target id from 3 on (d2t holds target - draft offsets).
    target_ids = torch.arange(draft_vocab) * 2 % VOCAB
    t["d2t"] = (target_ids - torch.arange(draft_vocab)).long()
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[target_ids] = True
    t["t2d"] = t2d
    save_file(t, os.path.join(path, "model.safetensors"))
    return path


def write_mtp_target(src: str, path: str, seed: int = 0) -> str:
    """Copy the target checkpoint and append a DeepSeek-style MTP layer after its layers."""
    g = torch.Generator().manual_seed(seed)
    shutil.copytree(src, path)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    n = cfg["num_hidden_layers"]
    cfg["num_nextn_predict_layers"] = 1
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    w = load_file(os.path.join(path, "model.safetensors"))
    p = f"model.layers.{n}."
    w.update(_layer(p, 64, 128, 4, 2, 16, 64, g))
    w[p + "enorm.weight"] = torch.ones(64)
    w[p + "hnorm.weight"] = torch.ones(64)
    w[p + "eh_proj.weight"] = torch.randn(64, 128, generator=g) * 0.1
    w[p + "shared_head.norm.weight"] = torch.ones(64)
    save_file(w, os.path.join(path, "model.safetensors"))
    return path


def _add_ptd(path: str, ptd_token_id: int, mask_hidden: torch.Tensor | None) -> None:
    """Mark a drafter checkpoint as trained for parallel drafting (the trainer's layout)."""
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(parallel_draft=True, ptd_token_id=ptd_token_id)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    if mask_hidden is not None:
        files = [n for n in os.listdir(path) if n.endswith(".safetensors")]
        w = load_file(os.path.join(path, files[0]))
        w["mask_hidden"] = mask_hidden
        save_file(w, os.path.join(path, files[0]))


def write_ptd_eagle3(
    path: str, seed: int = 0, ptd_token_id: int = VOCAB - 1, zero_lm_head: bool = False
) -> str:
    """An EAGLE-3 PTD head: config `parallel_draft`, `ptd_token_id`, tensor `mask_hidden`.
    `zero_lm_head` makes it always draft token 0 (with a looped target: every draft accepted)."""
    write_eagle3(path, seed)
    g = torch.Generator().manual_seed(seed + 1)
    _add_ptd(path, ptd_token_id, torch.randn(64, generator=g))
    if zero_lm_head:
        w = load_file(os.path.join(path, "model.safetensors"))
        w["lm_head.weight"].zero_()
        save_file(w, os.path.join(path, "model.safetensors"))
    return path


def write_ptd_eagle(path: str, seed: int = 0, ptd_token_id: int = VOCAB - 1) -> str:
    write_eagle(path, seed)
    g = torch.Generator().manual_seed(seed + 1)
    _add_ptd(path, ptd_token_id, torch.randn(64, generator=g))
    return path


def write_ptd_draft_model(src: str, path: str, ptd_token_id: int = VOCAB - 1) -> str:
    """A PARD-style draft model: a copy of the causal LM `src` marked for parallel drafting."""
    shutil.copytree(src, path)
    _add_ptd(path, ptd_token_id, None)
    return path


def write_multi_mtp_target(src: str, path: str, num_layers: int, seed: int = 0) -> str:
    """Copy the target checkpoint and append `num_layers` DeepSeek-style MTP modules after its
    decoder layers (num_nextn_predict_layers = num_layers)."""
    g = torch.Generator().manual_seed(seed)
    shutil.copytree(src, path)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    n = cfg["num_hidden_layers"]
    cfg["num_nextn_predict_layers"] = num_layers
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    w = load_file(os.path.join(path, "model.safetensors"))
    for i in range(num_layers):
        p = f"model.layers.{n + i}."
        w.update(_layer(p, 64, 128, 4, 2, 16, 64, g))
        w[p + "enorm.weight"] = 1 + torch.randn(64, generator=g) * 0.1
        w[p + "hnorm.weight"] = 1 + torch.randn(64, generator=g) * 0.1
        w[p + "eh_proj.weight"] = torch.randn(64, 128, generator=g) * 0.1
        w[p + "shared_head.norm.weight"] = torch.ones(64)
    save_file(w, os.path.join(path, "model.safetensors"))
    return path


def scratch_context(runner: Any, num_tokens: int) -> Any:
    """ForwardContext of ONE request prefilling positions 0 .. num_tokens - 1 into fresh, zeroed
    KV caches (same layer indices as `runner.kv_caches`): a from-scratch recomputation."""
    from specserve.attention.backend import CommonAttentionMetadata, build_forward_context
    from specserve.attention.torch_ref import TorchAttentionBackend

    bs = runner.block_size
    nblk = (num_tokens + bs - 1) // bs
    caches = [torch.zeros(2, nblk + 1, *c.shape[2:], dtype=c.dtype) for c in runner.kv_caches]
    pos = torch.arange(num_tokens)
    common = CommonAttentionMetadata(
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32),
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32),
        positions=pos,
        block_table=torch.arange(nblk, dtype=torch.int32)[None],
        slot_mapping=pos,
        token_req=torch.zeros(num_tokens, dtype=torch.int64),
        num_reqs=1,
        num_tokens=num_tokens,
        max_query_len=num_tokens,
        max_seq_len=num_tokens,
    )
    return build_forward_context(TorchAttentionBackend(), common, caches, runner.windows)


def paged_kv(runner: Any, layer_index: int, block_ids: list[int], num_tokens: int) -> Any:
    """[2, num_tokens, kv_heads, head_dim] KV of positions 0 .. num_tokens - 1 of one request,
    read through the runner's paged cache `layer_index` and the request's blocks."""
    cache = runner.kv_caches[layer_index]
    return cache[:, torch.tensor(block_ids)].flatten(1, 2)[:, :num_tokens]


def append_mtp_layers(src: str, path: str, num_layers: int = 1, seed: int = 0) -> str:
    """Copy a target checkpoint (any architecture) and append `num_layers` MTP layers at
    model.layers.{L + i} as GLM / DeepSeek checkpoints store them: enorm, hnorm, eh_proj,
    shared_head.norm and a decoder layer shaped like the target's last one (for an MoE target:
    router, correction bias, experts, shared experts), its weights the last layer's plus noise."""
    g = torch.Generator().manual_seed(seed)
    shutil.copytree(src, path)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    n, hidden = cfg["num_hidden_layers"], cfg["hidden_size"]
    cfg["num_nextn_predict_layers"] = num_layers
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    w = load_file(os.path.join(path, "model.safetensors"))
    last = f"model.layers.{n - 1}."
    for i in range(num_layers):
        p = f"model.layers.{n + i}."
        for k, t in list(w.items()):
            if k.startswith(last):
                noise = torch.randn(t.shape, generator=g) * 0.05
                w[p + k[len(last) :]] = (t + noise) if t.is_floating_point() else t.clone()
        w[p + "enorm.weight"] = 1 + torch.randn(hidden, generator=g) * 0.1
        w[p + "hnorm.weight"] = 1 + torch.randn(hidden, generator=g) * 0.1
        w[p + "eh_proj.weight"] = torch.randn(hidden, 2 * hidden, generator=g) * 0.1
        w[p + "shared_head.norm.weight"] = torch.ones(hidden)
    save_file(w, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return path


def write_speculators_eagle3(
    path: str,
    seed: int = 0,
    hidden: int = 64,
    target_hidden: int = 64,
    draft_vocab: int = 160,
    aux: list[int] | None = None,
    norm_before_residual: bool = True,
    speculative_tokens: int = 3,
    with_embed: bool = False,
    drop: str | None = None,
) -> str:
    """An EAGLE-3 head in the `speculators` format (as RedHatAI/*-speculator.eagle3): nested
    transformer_layer_config, speculators_config, tensors under layers.0.; `drop` removes one
    top-level config field (or "speculators_config.<field>") to test validation."""
    g = torch.Generator().manual_seed(seed)
    heads, kv, hd, inter = 4, 2, hidden // 4, 2 * hidden
    cfg: dict[str, Any] = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": "0.1.0",
        "draft_vocab_size": draft_vocab,
        "target_hidden_size": target_hidden,
        "norm_before_residual": norm_before_residual,
        "transformer_layer_config": {
            "model_type": "llama",
            "vocab_size": VOCAB,
            "hidden_size": hidden,
            "intermediate_size": inter,
            "num_hidden_layers": 1,
            "num_attention_heads": heads,
            "num_key_value_heads": kv,
            "head_dim": hd,
            "max_position_embeddings": 512,
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
        },
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {"proposal_type": "greedy", "speculative_tokens": speculative_tokens}
            ],
            "verifier": {"name_or_path": "tiny-target", "architectures": ["Qwen3ForCausalLM"]},
        },
    }
    if aux is not None:
        cfg["eagle_aux_hidden_state_layer_ids"] = aux
    if drop is not None:
        outer, _, inner = drop.partition(".")
        del (cfg[outer] if inner else cfg)[inner or outer]
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    t = _layer("layers.0.", hidden, inter, heads, kv, hd, 2 * hidden, g)
    t["layers.0.hidden_norm.weight"] = 1 + torch.randn(hidden, generator=g) * 0.1
    t["fc.weight"] = torch.randn(hidden, 3 * target_hidden, generator=g) * 0.1
    t["norm.weight"] = torch.ones(hidden)
    t["lm_head.weight"] = torch.randn(draft_vocab, hidden, generator=g) * 0.1
    target_ids = torch.arange(draft_vocab) * 2 % VOCAB
    t["d2t"] = (target_ids - torch.arange(draft_vocab)).long()
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[target_ids] = True
    t["t2d"] = t2d
    if with_embed:
        t["embed_tokens.weight"] = torch.randn(VOCAB, hidden, generator=g) * 0.1
    save_file(t, os.path.join(path, "model.safetensors"))
    return path


def check_tracked_kv_writes(make_llm: Callable[[], Any], prompts: list, sp: Any) -> list:
    """Generate twice under a pinned budget whose k = 0 steps keep the drafter's KV (tracked):
    through `Drafter.write_kv`, then through the drafter's full forward. The drafter's KV
    caches after, the drafts and the acceptance must be equal, bit for bit. Returns the
    outputs' token ids."""

    def run(full: bool) -> tuple[list, list, int, int]:
        llm = make_llm()
        eng = llm.engine
        pattern = [3, 3, 0, 0, 0, 0, 2, 2, 0, 0, 0, 1, 1]
        calls = iter(range(10**6))
        eng.budget.choose = lambda batch, reqs: pattern[next(calls) % len(pattern)]
        eng.budget._since_draft = 0  # every k = 0 step keeps the drafter's KV
        drafter = eng.runner.speculator.model
        writes = []

        def write_kv(ids, pos, hidden, ctx) -> None:  # noqa: ANN001
            writes.append(ids.shape[0])
            if full:
                drafter.forward(ids, pos, hidden, ctx)
            else:
                type(drafter).write_kv(drafter, ids, pos, hidden, ctx)

        drafter.write_kv = write_kv
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
        caches = [c.clone() for c in eng.runner.kv_caches[eng.runner.num_target_kv :]]
        m = llm.get_metrics()
        assert m["spec_decode_num_drafts_total"] > 0
        return outs, caches, m["spec_decode_num_accepted_tokens_total"], len(writes)

    outs, caches, accepted, writes = run(full=False)
    ref_outs, ref_caches, ref_accepted, ref_writes = run(full=True)
    assert outs == ref_outs
    assert writes == ref_writes > 0
    assert accepted == ref_accepted
    assert len(caches) == len(ref_caches) > 0
    for c, r in zip(caches, ref_caches):
        assert c.abs().sum() > 0
        torch.testing.assert_close(c, r, rtol=0, atol=0)
    return outs
