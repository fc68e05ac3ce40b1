"""Building a speculator from SpeculativeConfig: loads the drafter and checks it fits."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from specserve.config.speculative import SpeculativeConfig, is_speculators_config
from specserve.models.drafters import (
    Drafter,
    DraftModelDrafter,
    Eagle1Drafter,
    Eagle3Drafter,
    MTPDrafter,
    MultiLayerMTPDrafter,
    eagle3_aux_layers,
    tie_weights_,
)
from specserve.models.llama import ArchConfig, LlamaForCausalLM
from specserve.models.loader import (
    ModelLoadError,
    dummy_weights_,
    iter_weights,
    load_weights,
    read_config,
)
from specserve.models.registry import default_dtype, resolve_architecture
from specserve.models.speculators_format import eagle3_config as speculators_eagle3_config
from specserve.spec_decode.interface import Speculator

if TYPE_CHECKING:
    from specserve.distributed import TensorParallel

# Methods whose drafter can propose all K tokens in one forward (spec_decode/parallel.py).
PARALLEL_DRAFT_METHODS = ("draft_model", "eagle", "eagle3")


def _fit_error(field: str, msg: str) -> ValueError:
    return ValueError(f"speculative_config.{field}: {msg}")


def _check_fit(spec: SpeculativeConfig, c: ArchConfig, target: ArchConfig, hidden: bool) -> None:
    if hidden and c.hidden_size != target.hidden_size and spec.method != "eagle3":
        raise _fit_error(
            "model",
            f"drafter hidden_size {c.hidden_size} does not match the target's {target.hidden_size}",
        )
    if c.vocab_size != target.vocab_size:
        raise _fit_error(
            "model",
            f"drafter vocab_size {c.vocab_size} does not match the target's "
            f"{target.vocab_size} (the drafter must share the target's tokenizer)",
        )


def _own_or_shared(names: set[str], key: str) -> bool:
    return any(n.endswith(key) for n in names)


def _drafter_config(spec: SpeculativeConfig, target_dir: str) -> tuple[str, dict[str, Any]]:
    """(drafter directory, its config.json); MTP without a model reads the target's."""
    if spec.method == "mtp" and spec.model is None:
        return target_dir, read_config(target_dir)
    draft_dir = spec.model or ""
    if not os.path.isdir(draft_dir):
        raise _fit_error("model", f"drafter directory {draft_dir!r} does not exist")
    return draft_dir, read_config(draft_dir)


def _has_weights(model_dir: str) -> bool:
    return any(f.endswith(".safetensors") for f in os.listdir(model_dir))


def _iter_names(model_dir: str) -> list[tuple[str, Any, str]]:
    from safetensors import safe_open

    from specserve.models.loader import safetensors_files

    out = []
    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt") as f:
            out += [(n, None, path) for n in f.keys()]  # noqa: SIM118
    return out


def _construct(
    spec: SpeculativeConfig,
    cfg: dict[str, Any],
    tc: ArchConfig,
    target: LlamaForCausalLM,
    max_position: int,
    names: set[str],
) -> tuple[Drafter, Any, tuple[str, ...]]:
    if spec.method == "draft_model":
        # The draft model's own family (a gpt-oss or MoE draft model is not a Llama).
        lm = resolve_architecture(cfg, spec.model or "").from_config_dict(cfg, max_position)
        _check_fit(spec, lm.config, tc, hidden=False)

        def rename(n: str) -> str | None:
            m = lm.checkpoint_rename(n)
            return None if m is None else "lm." + m

        return DraftModelDrafter(lm), rename, ()
    if spec.method == "mtp":
        return _construct_mtp(spec, cfg, tc, target, max_position, names)
    c = ArchConfig.from_dict({**cfg, "architectures": ["LlamaForCausalLM"]})
    if spec.method == "eagle":
        _check_fit(spec, c, tc, hidden=True)
        d = Eagle1Drafter(c, max_position, _own_or_shared(names, "fc.bias"), target)
        allow: tuple[str, ...] = ("lm_head",)
        if _own_or_shared(names, "embed_tokens.weight"):
            d.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        else:
            allow += ("embed_tokens",)

        def rename(n: str) -> str | None:
            n = n.removeprefix("model.")
            return None if n.startswith("lm_head") else n

        return d, rename, allow
    return _construct_eagle3(spec, cfg, c, tc, target, max_position, names)


def _construct_eagle3(
    spec: SpeculativeConfig,
    cfg: dict[str, Any],
    c: ArchConfig,
    tc: ArchConfig,
    target: LlamaForCausalLM,
    max_position: int,
    names: set[str],
) -> tuple[Drafter, Any, tuple[str, ...]]:
    """EAGLE-3 in the EAGLE / vLLM layout (`midlayer.*`) or the speculators one
    (`layers.0.*`, config mapped by models/speculators_format.py)."""
    draft_vocab = cfg.get("draft_vocab_size") or c.vocab_size
    if draft_vocab > c.vocab_size:
        raise _fit_error(
            "model", f"draft_vocab_size {draft_vocab} exceeds vocab_size {c.vocab_size}"
        )
    _check_fit(spec, c, tc, hidden=True)
    target_hidden = cfg.get("target_hidden_size") or c.hidden_size
    if target_hidden != tc.hidden_size:
        raise _fit_error(
            "model",
            f"EAGLE-3 head expects target hidden size {target_hidden}, the target has "
            f"{tc.hidden_size}",
        )
    aux = eagle3_aux_layers(cfg, tc.num_hidden_layers)
    if any(not 0 <= i < tc.num_hidden_layers for i in aux):
        raise _fit_error("model", f"aux hidden-state layers {aux} are outside the target's layers")
    own_embed = _own_or_shared(names, "embed_tokens.weight")
    if c.hidden_size != tc.hidden_size and not own_embed:
        raise _fit_error(
            "model",
            f"EAGLE-3 head hidden size {c.hidden_size} differs from the target's "
            f"{tc.hidden_size}, so it needs its own embed_tokens.weight, which it lacks",
        )
    d = Eagle3Drafter(
        c,
        max_position,
        target,
        draft_vocab,
        aux,
        target_hidden,
        fc_bias=_own_or_shared(names, "fc.bias"),
        norm_before_residual=bool(cfg.get("norm_before_residual", False)),
    )
    allow = ("t2d",)
    if own_embed:
        d.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
    else:
        allow += ("embed_tokens",)
    if "d2t" not in names:
        allow += ("d2t",)

    def rename(n: str) -> str | None:
        n = n.removeprefix("model.")
        # speculators names the single decoder layer layers.0, EAGLE's code midlayer.
        return "midlayer." + n.removeprefix("layers.0.") if n.startswith("layers.0.") else n

    return d, rename, allow


def _construct_mtp(
    spec: SpeculativeConfig,
    cfg: dict[str, Any],
    tc: ArchConfig,
    target: LlamaForCausalLM,
    max_position: int,
    names: set[str],
) -> tuple[Drafter, Any, tuple[str, ...]]:
    n_mtp = cfg.get("num_nextn_predict_layers", 0 if spec.model is None else 1)
    if n_mtp < 1:
        raise _fit_error(
            "model",
            "the target checkpoint has no MTP layers (num_nextn_predict_layers is 0); "
            "pass the MTP module directory as speculative_config.model",
        )
    # MTP layers inside the target checkpoint are the target architecture's own layers (an MoE
    # layer for GLM / DeepSeek); a separate MTP module directory brings a dense Llama layer.
    c = (
        tc
        if spec.model is None
        else ArchConfig.from_dict({**cfg, "architectures": [tc.architecture]})
    )
    _check_fit(spec, c, tc, hidden=True)
    layer_ids = sorted({int(n.split(".")[2]) for n in names if n.startswith("model.layers.")})
    # The MTP module is the first layer past the target's decoder layers (or the only one).
    mtp_ids = (
        [i for i in layer_ids if i >= tc.num_hidden_layers] if spec.model is None else layer_ids
    )
    if not names:
        # load_format "dummy" with a bare config.json (benchmarks): no tensors to list, so the
        # MTP layers sit where checkpoints put them, right after the decoder layers.
        first = tc.num_hidden_layers if spec.model is None else 0
        mtp_ids = list(range(first, first + n_mtp))
    if not mtp_ids:
        raise ModelLoadError("no MTP layer weights (model.layers.<N>.eh_proj ...) found")
    own_layers = spec.model is None
    if n_mtp > 1:
        return _construct_multi_mtp(
            spec, c, target, max_position, names, mtp_ids, n_mtp, own_layers
        )
    return _mtp_module(c, max_position, target, names, mtp_ids[0], own_layers)


def _mtp_module(
    c: ArchConfig,
    max_position: int,
    target: LlamaForCausalLM,
    names: set[str],
    layer_id: int,
    own_layers: bool,
) -> tuple[MTPDrafter, Any, tuple[str, ...]]:
    """One MTP module from the checkpoint tensors under model.layers.<layer_id>.; with
    `own_layers` its decoder layer is the target's layer <layer_id> by architecture."""
    prefix = f"model.layers.{layer_id}."
    make_layer = (lambda rope: target.make_layer(layer_id, rope, None)) if own_layers else None
    mask0 = getattr(target, "mtp_mask_position0", True) if own_layers else True
    d = MTPDrafter(c, max_position, target, make_layer, mask0)
    allow: tuple[str, ...] = ()
    if _own_or_shared(names, prefix + "embed_tokens.weight"):
        d.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
    else:
        allow += ("embed_tokens",)
    if _own_or_shared(names, prefix + "shared_head.head.weight"):
        d.head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
    else:
        allow += ("head",)
    own = ("enorm.", "hnorm.", "eh_proj.", "embed_tokens.")

    def rename(n: str) -> str | None:
        if not n.startswith(prefix):
            return None
        n = n[len(prefix) :]
        if n.startswith(own):
            return n
        if n.startswith("shared_head.norm."):
            return "shared_head_norm." + n.removeprefix("shared_head.norm.")
        if n.startswith("shared_head.head."):
            return "head." + n.removeprefix("shared_head.head.")
        return "layer." + n

    return d, rename, allow


def _construct_multi_mtp(
    spec: SpeculativeConfig,
    c: ArchConfig,
    target: LlamaForCausalLM,
    max_position: int,
    names: set[str],
    mtp_ids: list[int],
    n_mtp: int,
    own_layers: bool,
) -> tuple[Drafter, Any, tuple[str, ...]]:
    """N > 1 MTP modules, chained (spec_decode/multi_layer_mtp.py): one draft per chain step.
    With K < N only the first K modules are loaded (the others get no KV layers). With K > N
    step i runs module i mod N, as vLLM's DeepSeek MTP (`spec_step_idx % num_mtp_layers`): step
    i >= N is a fresh module object whose parameters ARE module i mod N's (tied before loading,
    so the checkpoint fills both and no weight memory is added) but whose attention layer is its
    own, hence its own KV layers: step i's keys come from step i-1's hidden states, which differ
    from those step i - N's keys come from at the same positions."""
    k = spec.num_speculative_tokens
    if len(mtp_ids) < n_mtp:
        raise ModelLoadError(
            f"num_nextn_predict_layers is {n_mtp} but the checkpoint holds {len(mtp_ids)} MTP "
            "layer(s) (model.layers.<N>.eh_proj ...)"
        )
    parts = []
    for i in range(k):
        part = _mtp_module(c, max_position, target, names, mtp_ids[i % n_mtp], own_layers)
        if i >= n_mtp:
            tie_weights_(part[0], parts[i % n_mtp][0])  # frees this module's own copies now
        parts.append(part)
    drafter = MultiLayerMTPDrafter([m for m, _, _ in parts])

    def rename(n: str) -> str | None:
        # The first N modules own the checkpoint's tensors (a repeat's are the same tensors).
        for i, (_, module_rename, _) in enumerate(parts[:n_mtp]):
            m = module_rename(n)
            if m is not None:
                return f"mtp.{i}.{m}"
        return None

    allow = tuple(f"mtp.{i}.{a}" for i, (_, _, al) in enumerate(parts[:n_mtp]) for a in al)
    return drafter, rename, allow


def build_speculator(
    spec: SpeculativeConfig,
    target: LlamaForCausalLM,
    target_dir: str,
    max_position: int,
    dtype: torch.dtype,
    device: torch.device,
    load_format: str = "auto",
    tp: TensorParallel | None = None,
) -> Speculator:
    """The speculator for `spec`: its method's builder from `SPECULATOR_BUILDERS`. `tp`: the
    drafter is sharded like the target unless draft_tensor_parallel_size is 1."""
    if spec.parallel_draft and spec.method not in PARALLEL_DRAFT_METHODS:
        raise _fit_error(
            "parallel_draft",
            f"parallel drafting is supported for {', '.join(PARALLEL_DRAFT_METHODS)}, "
            f"not {spec.method!r}",
        )
    build = SPECULATOR_BUILDERS[spec.method]
    if tp is not None and spec.draft_tensor_parallel_size == 1:
        tp = None
    return build(spec, target, target_dir, max_position, dtype, device, load_format, tp)


def _build_ngram(spec: SpeculativeConfig, *_: Any) -> Speculator:
    from specserve.spec_decode.ngram import NgramSpeculator

    return NgramSpeculator(spec)


def _build_device(
    spec: SpeculativeConfig,
    target: LlamaForCausalLM,
    target_dir: str,
    max_position: int,
    dtype: torch.dtype,
    device: torch.device,
    load_format: str,
    tp: TensorParallel | None = None,
) -> Speculator:
    """A device speculator with its drafter loaded (in `dtype`, on `device`; random weights
    with load_format "dummy") and checked to fit the target."""
    tc = target.config
    draft_dir, cfg = _drafter_config(spec, target_dir)
    if is_speculators_config(cfg):
        if spec.method != "eagle3":
            raise _fit_error(
                "method", f"{draft_dir} is a speculators-format EAGLE-3 head; use method eagle3"
            )
        cfg = speculators_eagle3_config(cfg, draft_dir)
    # A dummy-weight drafter (benchmarks) may be a bare config.json.
    dummy = load_format == "dummy" and not _has_weights(draft_dir)
    names = set() if dummy else {n for n, _, _ in _iter_names(draft_dir)}
    from specserve.models.tensor_parallel import params_on_meta

    # Under TP each rank allocates only its shard (shard_model_ below).
    with torch.device(device), default_dtype(dtype), params_on_meta(tp is not None, target):
        drafter, rename, allow_missing = _construct(spec, cfg, tc, target, max_position, names)
        if spec.parallel_draft:
            from specserve.spec_decode.parallel import configure_parallel_drafter

            configure_parallel_drafter(drafter, cfg, None if dummy else names, draft_dir)
    if tp is not None:
        from specserve.models.tensor_parallel import shard_model_

        shard_model_(drafter, tp)
    if load_format == "dummy":  # random weights of the right shapes (speed benchmarks)
        dummy_weights_(drafter)
    else:
        weights = iter_weights(draft_dir)
        if hasattr(drafter, "convert_weights"):  # a gpt-oss draft model's expert layout
            weights = drafter.convert_weights(weights)
        load_weights(drafter, weights, rename, allow_missing)
    return _device_speculator(spec, drafter.eval(), device)


# method -> builder(spec, target, target_dir, max_position, dtype, device, load_format, tp)
SPECULATOR_BUILDERS: dict[str, Callable[..., Speculator]] = {
    "ngram": _build_ngram,
    "draft_model": _build_device,
    "eagle": _build_device,
    "eagle3": _build_device,
    "mtp": _build_device,
}


def _device_speculator(
    spec: SpeculativeConfig, drafter: Drafter, device: torch.device
) -> Speculator:
    from specserve.spec_decode.autoregressive import AutoregressiveSpeculator

    if spec.parallel_draft:
        from specserve.spec_decode.parallel import ParallelDraftSpeculator

        return ParallelDraftSpeculator(spec, drafter, device)
    if isinstance(drafter, MultiLayerMTPDrafter):
        if spec.is_tree:
            raise ValueError(
                "speculative_config: multi-layer MTP (a module per draft position) cannot "
                "draft a tree; drop draft_tree / speculative_token_tree, or use a single MTP "
                "layer."
            )
        from specserve.spec_decode.multi_layer_mtp import MultiLayerMTPSpeculator

        return MultiLayerMTPSpeculator(spec, drafter, device)
    return AutoregressiveSpeculator(spec, drafter, device)
