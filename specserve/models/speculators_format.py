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

import json
import os
from typing import Any

SUPPORTED_TYPES = ("eagle3",)


def is_speculators_config(cfg: dict[str, Any]) -> bool:
    return "speculators_model_type" in cfg


def _require(d: Any, key: str, where: str, path: str) -> Any:
    if not isinstance(d, dict) or key not in d:
        raise ValueError(f"{path}/config.json: speculators config is missing {where}{key}")
    return d[key]


def _proposal_tokens(cfg: dict[str, Any], path: str) -> int:
    spec = _require(cfg, "speculators_config", "", path)
    methods = _require(spec, "proposal_methods", "speculators_config.", path)
    if not isinstance(methods, list) or not methods:
        raise ValueError(
            f"{path}/config.json: speculators config is missing "
            "speculators_config.proposal_methods[0]"
        )
    k = _require(methods[0], "speculative_tokens", "speculators_config.proposal_methods[0].", path)
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(
            f"{path}/config.json: speculators_config.proposal_methods[0].speculative_tokens "
            f"must be a positive integer, got {k!r}"
        )
    return k


def eagle3_config(cfg: dict[str, Any], path: str) -> dict[str, Any]:
    """The flat, Llama-style drafter config of a speculators EAGLE-3 head; raises a one-line
    ValueError naming the first required field it lacks."""
    kind = cfg["speculators_model_type"]
    if kind not in SUPPORTED_TYPES:
        raise ValueError(
            f"{path}/config.json: speculators_model_type {kind!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_TYPES)})"
        )
    layer = _require(cfg, "transformer_layer_config", "", path)
    for key in ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size"):
        _require(layer, key, "transformer_layer_config.", path)
    draft_vocab = _require(cfg, "draft_vocab_size", "", path)
    _require(_require(cfg, "speculators_config", "", path), "verifier", "speculators_config.", path)
    _proposal_tokens(cfg, path)
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


def default_num_speculative_tokens(model_dir: str | None) -> int | None:
    """`speculators_config.proposal_methods[0].speculative_tokens` of a speculators head in
    `model_dir`, the K to use when the user gives none (None: not such a head)."""
    path = os.path.join(model_dir or "", "config.json")
    if not model_dir or not os.path.isfile(path):
        return None
    with open(path) as f:
        try:
            cfg = json.load(f)
        except json.JSONDecodeError:
            return None  # the loader reports it with the file's name
    if not isinstance(cfg, dict) or not is_speculators_config(cfg):
        return None
    return _proposal_tokens(cfg, model_dir)
