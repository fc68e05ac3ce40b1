"""Reading Hugging Face-format directories: config.json and (sharded) safetensors."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterator
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

# (fused parameter, HF name part, shard index): q/k/v and gate/up live in one matmul each, and
# MLA's two input projections (q_a_proj or its q_proj, and kv_a_proj_with_mqa) in one.
STACKED_PARAMS = [
    (".qkv_proj", ".q_proj", 0),
    (".qkv_proj", ".k_proj", 1),
    (".qkv_proj", ".v_proj", 2),
    (".gate_up_proj", ".gate_proj", 0),
    (".gate_up_proj", ".up_proj", 1),
    (".fused_qkv_a_proj", ".q_a_proj", 0),
    (".fused_qkv_a_proj", ".q_proj", 0),
    (".fused_qkv_a_proj", ".kv_a_proj_with_mqa", 1),
]
# A fused projection's parts (row counts, in order) from the module that owns it.
FUSED_PARTS: dict[str, Callable[[Any], tuple[int, ...]]] = {
    "qkv_proj": lambda m: (m.q_size, m.kv_size, m.kv_size),
    "gate_up_proj": lambda m: (m.intermediate_size, m.intermediate_size),
    "fused_qkv_a_proj": lambda m: m.qkv_a_sizes,
}


# Checkpoint tensors that no model reads: caches some exporters save next to the weights.
KNOWN_UNUSED_SUFFIXES = (
    "rotary_emb.inv_freq",
    "rotary_emb.cos_cached",
    "rotary_emb.sin_cached",
)

# MoE experts (models/moe.py StackedExperts): checkpoints store them per expert, transformers 5
# holds them fused in memory; both land in the stacked w13 [E, 2I, H] (gate rows, then up) and
# w2 [E, H, I].
_PER_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_FUSED_EXPERTS = re.compile(r"^(.*\.experts)\.(gate_up_proj|down_proj)$")
# Shared experts a SparseMoE runs as routed experts E.. (models/moe.py `shared_slots`): their
# MLP's tensors load as those experts' per-expert tensors.
_SHARED_EXPERTS = re.compile(r"^(.*)\.shared_experts\.(gate_proj|up_proj|down_proj)\.weight$")


# fp8 KV cache scales by the names vLLM reads (its maybe_remap_kv_scale_name): per attention
# layer `<layer>.self_attn.k_scale` / `.v_scale`, the older single `.kv_scale` (both), and the
# k / v projections' `output_scale`; they fill the layer's kv_scales ([2]: key, value).
_KV_SCALE_SUFFIXES = (
    (".k_scale", (0,)),
    (".v_scale", (1,)),
    (".kv_scale", (0, 1)),
    (".k_proj.output_scale", (0,)),
    (".v_proj.output_scale", (1,)),
)

# A block-scaled fp8 weight's scale is stored beside it as `<weight name>_scale_inv`.
SCALE_SUFFIX = "_scale_inv"
_FUSED_SUFFIXES = ("weight", "bias", "weight" + SCALE_SUFFIX)


class ModelLoadError(ValueError):
    pass


def _expert_target(
    name: str, params: dict[str, torch.Tensor], tensor: torch.Tensor
) -> tuple[str, Callable[[torch.Tensor], torch.Tensor], list[str], str] | None:
    """(stacked parameter, its slice for this tensor, completeness keys, the tensor's kind:
    gate_proj, up_proj, down_proj or gate_up_proj) for an expert tensor."""
    m = _PER_EXPERT.match(name)
    if m is not None:
        prefix, e, kind = m.group(1), int(m.group(2)), m.group(3)
        target = f"{prefix}.{'w2' if kind == 'down_proj' else 'w13'}"
        if target not in params:
            return None
        if kind == "down_proj":
            return target, lambda p: p[e], [f"{target}#{e}"], kind
        inter = params[target].shape[1] // 2
        shard = 0 if kind == "gate_proj" else 1
        keys = [f"{target}#{e}.{shard}"]
        return target, lambda p: p[e].narrow(0, shard * inter, inter), keys, kind
    m = _FUSED_EXPERTS.match(name)
    if m is not None:
        target = f"{m.group(1)}.{'w13' if m.group(2) == 'gate_up_proj' else 'w2'}"
        if target in params:
            # The routed experts (slots past them hold fused shared experts).
            n = tensor.shape[0]
            return target, lambda p: p[:n], _expert_keys(target, n), m.group(2)
    return None


def _expert_keys(pname: str, num_experts: int) -> list[str]:
    """Completeness keys of experts 0 .. num_experts - 1 of a stacked expert parameter."""
    if pname.endswith(".w13"):
        return [f"{pname}#{e}.{s}" for e in range(num_experts) for s in (0, 1)]
    return [f"{pname}#{e}" for e in range(num_experts)]


def _shared_as_experts(
    name: str, tensor: torch.Tensor, modules: dict[str, nn.Module]
) -> list[tuple[str, torch.Tensor]]:
    """A shared-expert MLP tensor of a SparseMoE that fuses its shared experts (models/moe.py):
    the per-expert tensors of slots E.. (n shared experts of I channels split the MLP's n * I
    evenly: gate / up rows, down columns); any other tensor as it is."""
    m = _SHARED_EXPERTS.match(name)
    slots = getattr(modules.get(m.group(1)), "shared_slots", None) if m else None
    if not slots:
        return [(name, tensor)]
    prefix, kind = m.group(1), m.group(2)  # type: ignore[union-attr]
    parts = tensor.chunk(len(slots), dim=1 if kind == "down_proj" else 0)
    return [(f"{prefix}.experts.{e}.{kind}.weight", t) for e, t in zip(slots, parts)]


def _kv_scale_target(
    name: str, modules: dict[str, nn.Module]
) -> tuple[torch.Tensor, tuple[int, ...]] | None:
    """(the attention layer's kv_scales, the entries this tensor fills) for a KV scale tensor
    of a layer of this model; None for any other tensor (a scale of a layer the model lacks
    stays unused, which fails the load)."""
    for suffix, idx in _KV_SCALE_SUFFIXES:
        if name.endswith(suffix):
            scales = getattr(modules.get(name[: -len(suffix)]), "kv_scales", None)
            return None if scales is None else (scales, idx)
    return None


def read_config(model_dir: str) -> dict[str, Any]:
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise ModelLoadError(f"{path}: missing (a Hugging Face model directory needs config.json)")
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path}: not valid JSON ({e})") from e


def safetensors_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        files = sorted(set(weight_map.values()))
        for name in files:
            if not os.path.isfile(os.path.join(model_dir, name)):
                raise ModelLoadError(f"{index}: lists shard {name}, which is missing")
        return [os.path.join(model_dir, n) for n in files]
    files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not files:
        raise ModelLoadError(f"{model_dir}: no *.safetensors weight files found")
    return [os.path.join(model_dir, n) for n in files]


def iter_weights(
    model_dir: str, keep_fp8: Callable[[str], bool] | None = None
) -> Iterator[tuple[str, torch.Tensor, str]]:
    """Yields (name, tensor, file) for every tensor in the directory's safetensors files; a
    block-scaled fp8 checkpoint's weights come out dequantized (models/fp8.py), except those
    `keep_fp8(name)` names (kept 8-bit: the weight and its `_scale_inv` pass through)."""
    from specserve.models.fp8 import dequantize_weights, fp8_block_size

    has_cfg = os.path.isfile(os.path.join(model_dir, "config.json"))
    block = fp8_block_size(read_config(model_dir)) if has_cfg else None
    weights = _iter_files(model_dir)
    return dequantize_weights(weights, block, keep_fp8) if block is not None else weights


def checkpoint_names(model_dir: str) -> list[str]:
    """Every tensor name in the directory's safetensors files (headers only, no data read)."""
    names: list[str] = []
    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt") as f:
            names += list(f.keys())  # noqa: SIM118 - safe_open has no __iter__
    return names


def _iter_files(model_dir: str) -> Iterator[tuple[str, torch.Tensor, str]]:
    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                yield name, f.get_tensor(name), path


def stacked_target(name: str, params: dict[str, torch.Tensor]) -> tuple[str, int | None]:
    """(parameter, shard) a checkpoint tensor fills: q/k/v and gate/up go to their fused
    parameter's shard; a model without the fused parameter (MLA's own q_proj) takes the name."""
    for fused, part, idx in STACKED_PARAMS:
        if part in name and name.replace(part, fused) in params:
            return name.replace(part, fused), idx
    return name, None


def fused_parts(module: nn.Module, fused: str) -> tuple[int, ...] | None:
    """The row counts of fused projection `fused` (its attribute name in `module`, which
    owns it), or None for a projection that is not fused."""
    parts = FUSED_PARTS.get(fused)
    return None if parts is None else tuple(parts(module))


def fused_rows(module: nn.Module, fused: str, shard: int) -> tuple[int, int]:
    """(first row, row count) of shard `shard` of fused projection `fused` in `module`."""
    sizes = fused_parts(module, fused)
    assert sizes is not None, fused
    return sum(sizes[:shard]), sizes[shard]


def _fused_slice(
    param: nn.Parameter, name: str, shard: int, module: nn.Module, rows: int = 1
) -> torch.Tensor:
    """The shard's rows of fused parameter `name` (`<module>.<projection>.<tensor>`); `rows` >
    1: of its block scale, one row per `rows` weight rows (the fp8 layer was only kept where
    each shard starts on a block)."""
    start, size = fused_rows(module, name.rsplit(".", 2)[-2], shard)
    return param.data.narrow(0, start // rows, -(-size // rows))


def load_weights(
    model: nn.Module,
    weights: Iterator[tuple[str, torch.Tensor, str]],
    rename: Any = None,
    allow_missing: tuple[str, ...] = (),
) -> None:
    """Copy HF tensors into `model`, fusing stacked params, checking every shape.

    `rename(name) -> str | None` maps a checkpoint name to this model's name (None: the model
    says the tensor is deliberately not its own, e.g. a tied lm_head or MTP layers that the
    drafter loads). Strict both ways: a parameter nothing fills, or a checkpoint tensor nothing
    reads (other than KNOWN_UNUSED_SUFFIXES), fails the load by name; a dropped tensor (an
    o_proj bias, say) would otherwise give wrong tokens without an error.
    """
    params: dict[str, torch.Tensor] = dict(model.named_parameters())
    # Persistent buffers (e.g. EAGLE-3's d2t / t2d) load like parameters.
    for bname, buf in model.named_buffers():
        if bname in model.state_dict():
            params[bname] = buf
    modules = dict(model.named_modules())
    loaded: set[str] = set()
    unused: list[str] = []
    for hf_name, name, tensor, path in _renamed(weights, rename, modules):
        kv_scale = _kv_scale_target(name, modules)
        if kv_scale is not None:
            if tensor.numel() != 1:
                raise ModelLoadError(
                    f"{path}: KV scale {hf_name} has shape {tuple(tensor.shape)}; specserve "
                    "reads one scale per layer (per-tensor), as vLLM does"
                )
            # NOTE: read whatever the cache dtype; only an fp8 cache uses them (as in vLLM).
            for i in kv_scale[1]:
                kv_scale[0][i] = tensor.float().reshape(())
            continue
        expert = _expert_target(name, params, tensor)
        if expert is not None:
            target, view, keys, kind = expert
            dst = view(params[target].data)
            tp_load = getattr(params[target], "tp_load", None)
            if tp_load is not None:  # tensor parallelism: this rank's slice
                tensor = tp_load(tensor, kind)
            if tensor.dim() == 3 and tensor.shape != dst.shape and tensor.mT.shape == dst.shape:
                tensor = tensor.mT  # fused experts saved as [E, H, 2I] / [E, I, H]
            if tuple(dst.shape) != tuple(tensor.shape):
                raise ModelLoadError(
                    f"{path}: tensor {hf_name} has shape {tuple(tensor.shape)} but the config "
                    f"implies {tuple(dst.shape)}" + (f" (as {name})" if name != hf_name else "")
                )
            dst.copy_(tensor.to(dst.dtype))
            loaded.update(keys)
            continue
        target, shard = stacked_target(name, params)
        if target not in params:
            unused.append(f"{hf_name} ({os.path.basename(path)})")
            continue
        param = params[target]
        dst = param.data if isinstance(param, nn.Parameter) else param
        if shard is not None:
            # A kept fp8 projection's scale (models/fp8_linear.py): one row per bn weight rows.
            owner = modules.get(target.rsplit(".", 1)[0])
            rows = owner.block[0] if target.endswith(SCALE_SUFFIX) else 1  # type: ignore[union-attr]
            dst = _fused_slice(param, target, shard, modules[target.rsplit(".", 2)[0]], rows)
        tp_load = getattr(param, "tp_load", None)
        if tp_load is not None:  # tensor parallelism (models/tensor_parallel.py): its slice
            tensor = tp_load(tensor, shard)
        if tuple(dst.shape) != tuple(tensor.shape):
            raise ModelLoadError(
                f"{path}: tensor {name} has shape {tuple(tensor.shape)} but the config implies "
                f"{tuple(dst.shape)}"
            )
        dst.copy_(tensor.to(dst.dtype))
        loaded.add(target if shard is None else f"{target}#{shard}")
    if unused:
        shown = ", ".join(unused[:8]) + (" ..." if len(unused) > 8 else "")
        raise ModelLoadError(
            f"checkpoint has {len(unused)} tensor(s) this model does not use: {shown}; "
            "its config probably asks for something specserve does not implement"
        )
    missing = []
    for pname in params:
        want = [pname]
        owner, _, leaf = pname.rpartition(".")
        parent, _, proj = owner.rpartition(".")
        parts = fused_parts(modules[parent], proj) if leaf in _FUSED_SUFFIXES else None
        # (A kept fp8 projection's scale fills like its weight: models/fp8_linear.py.)
        if parts is not None:
            want = [f"{pname}#{i}" for i in range(len(parts))]
        elif pname.endswith((".experts.w13", ".experts.w2")):
            want = _expert_keys(pname, params[pname].shape[0])
        if any(w not in loaded for w in want) and not pname.startswith(allow_missing):
            missing.append(pname)
    if missing:
        shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
        raise ModelLoadError(f"checkpoint is missing {len(missing)} weight(s): {shown}")


def _renamed(
    weights: Iterator[tuple[str, torch.Tensor, str]],
    rename: Any,
    modules: dict[str, nn.Module],
) -> Iterator[tuple[str, str, torch.Tensor, str]]:
    """(checkpoint name, model name, tensor, file) of the tensors the model may read: renamed,
    known caches and tensors `rename` disowns dropped, fused shared experts split per expert."""
    for hf_name, tensor, path in weights:
        name = rename(hf_name) if rename is not None else hf_name
        if name is None or hf_name.endswith(KNOWN_UNUSED_SUFFIXES):
            continue
        for part, t in _shared_as_experts(name, tensor, modules):
            yield hf_name, part, t, path


@torch.no_grad()
def dummy_weights_(model: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Random weights in place (norm weights 1): same shapes, bytes and kernels as real ones
    (MXFP4 experts: random 4-bit codes, models/mxfp4.py dummy_mxfp4_)."""
    gens: dict[torch.device, torch.Generator] = {}
    for name, p in model.named_parameters():
        if "norm" in name.rsplit(".", 2)[-2]:
            p.fill_(1.0)
            continue
        if p.device not in gens:  # generate where the weights live: fast on a GPU
            gens[p.device] = torch.Generator(device=p.device).manual_seed(seed)
        if p.dtype == torch.uint8:  # MXFP4 experts kept 4-bit (models/moe.py Mxfp4Experts)
            from specserve.models.mxfp4 import dummy_mxfp4_

            dummy_mxfp4_(name, p, gens[p.device])
            continue
        p.normal_(0.0, std, generator=gens[p.device])
