"""EAGLE-3 heads in the `speculators` format (vllm-project/speculators, e.g.
`RedHatAI/Qwen3-8B-speculator.eagle3`), mapped onto the config the Eagle3Drafter reads.

Their config.json:
    speculators_model_type        "eagle3"
    transformer_layer_config      the head's decoder-layer config (Llama-style)
    draft_vocab_size              the head's reduced vocabulary (d2t / t2d map it)
    target_hidden_size            the verifier's hidden size (default: the head's)
    eagle_aux_hidden_state_layer_ids  the verifier layers whose inputs fc fuses (default: vLLM's)
    norm_before_residual          hidden_norm before the residual branch (default True, as vLLM)
    speculators_config            {proposal_methods: [{speculative_tokens: K, ...}], verifier}
Tensors: fc, layers.0.* (the midlayer), norm, lm_head, d2t, t2d and possibly embed_tokens.
"""

from __future__ import annotations

from typing import Any

from specserve.config.speculative import proposal_tokens, require_key

SUPPORTED_TYPES = ("eagle3",)


def eagle3_config(cfg: dict[str, Any], path: str) -> dict[str, Any]:
    """The flat, Llama-style drafter config of a speculators EAGLE-3 head; raises a one-line
    ValueError naming the first required field it lacks."""
    kind = cfg["speculators_model_type"]
    if kind not in SUPPORTED_TYPES:
        raise ValueError(
            f"{path}/config.json: speculators_model_type {kind!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_TYPES)})"
        )
    layer = require_key(cfg, "transformer_layer_config", "", path)
    for key in ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size"):
        require_key(layer, key, "transformer_layer_config.", path)
    draft_vocab = require_key(cfg, "draft_vocab_size", "", path)
    require_key(
        require_key(cfg, "speculators_config", "", path), "verifier", "speculators_config.", path
    )
    proposal_tokens(cfg, path)
    flat = {
        **layer,
        "num_hidden_layers": 1,
        "draft_vocab_size": draft_vocab,
        "target_hidden_size": cfg.get("target_hidden_size") or layer["hidden_size"],
        "norm_before_residual": bool(cfg.get("norm_before_residual", True)),
        "architectures": ["LlamaForCausalLM"],
    }
    if cfg.get("eagle_aux_hidden_state_layer_ids"):
        flat["eagle_aux_hidden_state_layer_ids"] = cfg["eagle_aux_hidden_state_layer_ids"]
    return flat
