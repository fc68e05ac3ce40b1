"""The drafting methods: per-method hooks (EAGLE, EAGLE-3, MTP; PTD in `ptd.py`) for the
shared training loop in `drafter.py`.

A `DraftMethod` builds its drafter module(s) with the engine's own `_construct`, warm-starts
them from the target, names their tensors in the checkpoint layout the engine loads, and picks
each unrolled step's inputs. A new method is a subclass with a few of these hooks overridden.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from specserve.config.speculative import SpeculativeConfig
from specserve.models.drafters import Drafter, default_aux_layers
from specserve.models.layers import Attention
from specserve.models.llama import LlamaForCausalLM
from specserve.spec_decode.speculator import _construct
from specserve.train.data import draft_vocab

if TYPE_CHECKING:
    from specserve.train.drafter import DraftTrainConfig

__all__ = ["METHODS", "DraftMethod", "EagleMethod", "Eagle3Method", "MTPMethod", "method_class"]

METHODS = ("eagle", "eagle3", "mtp", "ptd")

# Target config keys a separate EAGLE / EAGLE-3 head copies (shapes, rope, special tokens).
_ARCH_KEYS = (
    "vocab_size hidden_size intermediate_size num_attention_heads num_key_value_heads head_dim "
    "rms_norm_eps max_position_embeddings rope_theta rope_scaling rope_parameters "
    "attention_bias bos_token_id eos_token_id pad_token_id"
).split()


def _save_dtype(tcfg: dict[str, Any]) -> torch.dtype:
    name = tcfg.get("torch_dtype") or tcfg.get("dtype") or "float32"
    return {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(name, torch.float32)


def export_state(module: nn.Module, skip: set[int]) -> dict[str, torch.Tensor]:
    """`module`'s tensors in the HF layout: fused qkv_proj / gate_up_proj split back into
    q/k/v_proj and gate/up_proj; tensors shared with the target (data_ptr in `skip`) left out."""
    mods = dict(module.named_modules())
    out: dict[str, torch.Tensor] = {}
    for name, t in module.state_dict().items():
        if t.data_ptr() in skip:
            continue
        if ".qkv_proj." in name:
            attn = mods[name.split(".qkv_proj.")[0]]
            parts = t.split([attn.q_size, attn.kv_size, attn.kv_size])
            for part, p in zip(("q_proj", "k_proj", "v_proj"), parts):
                out[name.replace("qkv_proj", part)] = p
        elif ".gate_up_proj." in name:
            for part, p in zip(("gate_proj", "up_proj"), t.chunk(2)):
                out[name.replace("gate_up_proj", part)] = p
        else:
            out[name] = t
    return out


class DraftMethod(nn.Module):
    """One drafting method: its checkpoint config, its drafter module(s) built by the engine's
    `_construct`, and the hooks the shared loop calls."""

    engine_method = "eagle"
    architecture = "LlamaForCausalLMEagle"
    feature_loss_weight = 0.0

    def __init__(
        self,
        target: LlamaForCausalLM,
        tcfg: dict[str, Any],
        cfg: DraftTrainConfig,
        stream: torch.Tensor,
    ) -> None:
        super().__init__()
        self.num_steps = cfg.num_steps
        self.save_dtype = _save_dtype(tcfg)
        self.register_buffer("draft_ids", None)
        self.config = self.build_config(tcfg, cfg, stream)
        spec = SpeculativeConfig(method=self.engine_method, model="(training)")
        max_pos = cfg.seq_len + self.num_steps + 2
        self.drafters = nn.ModuleList(
            _construct(spec, self.module_config(), target.config, target, max_pos, self.names(i))[0]
            for i in range(self.num_modules(cfg))
        )
        attn = [m for m in self.drafters.modules() if isinstance(m, Attention)]
        for i, m in enumerate(attn):
            m.kv_index = i
        with torch.no_grad():
            self.init_from_target(target)

    # -- what the subclasses change ---------------------------------------------------------
    def build_config(
        self, tcfg: dict[str, Any], cfg: DraftTrainConfig, stream: torch.Tensor
    ) -> dict[str, Any]:
        c = {k: tcfg[k] for k in _ARCH_KEYS if k in tcfg}
        c.update(architectures=[self.architecture], model_type="llama", num_hidden_layers=1)
        c["torch_dtype"] = str(self.save_dtype).removeprefix("torch.")
        return c

    def names(self, i: int) -> set[str]:
        """Tensor names the engine's `_construct` is told the checkpoint has."""
        return set()

    def module_config(self) -> dict[str, Any]:
        """The config `_construct` builds each drafter module from."""
        return self.config

    def init_from_target(self, target: LlamaForCausalLM) -> None:
        """Warm starts copied from the target (no grad)."""

    def num_modules(self, cfg: DraftTrainConfig) -> int:
        return 1

    def checkpoint_name(self, i: int, name: str) -> str:
        return name

    def step_inputs(
        self, k: int, ids: torch.Tensor, carry: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Step k's (input ids [B*S], hidden [B*S, H]); autoregressive: the data's tokens and
        the previous step's carry."""
        return ids, carry

    def extra_tensors(self) -> dict[str, torch.Tensor]:
        return {}

    @classmethod
    def spec_config(cls, out_dir: str) -> dict[str, Any]:
        return {"method": cls.engine_method, "model": out_dir}

    # -- shared -------------------------------------------------------------------------------
    @property
    def reuse_module(self) -> bool:
        return len(self.drafters) == 1

    def module_for_step(self, k: int) -> Drafter:
        return self.drafters[0 if self.reuse_module else k]

    def num_attention_layers(self) -> int:
        return sum(isinstance(m, Attention) for m in self.drafters.modules())

    def aux_layers(self) -> tuple[int, ...]:
        return self.drafters[0].aux_layers()

    @property
    def t2d(self) -> torch.Tensor | None:
        return getattr(self.drafters[0], "t2d", None)

    def first_hidden(self, hidden: torch.Tensor, aux: list[torch.Tensor]) -> torch.Tensor:
        return self.drafters[0].combine_hidden(hidden, aux)

    def save(self, out_dir: str, target: LlamaForCausalLM) -> None:
        from safetensors.torch import save_file

        skip = {p.data_ptr() for p in target.parameters()}
        tensors: dict[str, torch.Tensor] = {}
        for i, d in enumerate(self.drafters):
            for name, t in export_state(d, skip).items():
                tensors[self.checkpoint_name(i, name)] = t
        tensors.update(self.extra_tensors())
        tensors = {
            n: (t.to(self.save_dtype) if t.is_floating_point() else t).detach().cpu().contiguous()
            for n, t in tensors.items()
        }
        save_file(tensors, os.path.join(out_dir, "model.safetensors"))
        with open(os.path.join(out_dir, "config.json"), "w") as f:
            json.dump(self.config, f, indent=2)


class EagleMethod(DraftMethod):
    """EAGLE-1: fc([embed; h_last]) + decoder layer(s); the target's lm_head reads its output,
    which is also regressed onto the target's next hidden state (smooth L1)."""

    feature_loss_weight = 0.1

    def build_config(
        self, tcfg: dict[str, Any], cfg: DraftTrainConfig, stream: torch.Tensor
    ) -> dict[str, Any]:
        return {**super().build_config(tcfg, cfg, stream), "num_hidden_layers": cfg.num_layers}

    def names(self, i: int) -> set[str]:
        return {"fc.bias"}  # the reference EAGLE fc has a bias


class Eagle3Method(DraftMethod):
    """EAGLE-3: 3 aux taps fused by fc, own norm and lm_head over the reduced vocabulary."""

    engine_method = "eagle3"
    architecture = "LlamaForCausalLMEagle3"

    def init_from_target(self, target: LlamaForCausalLM) -> None:
        d = self.drafters[0]
        d.d2t.copy_(self._d2t)
        d.t2d.copy_(self._t2d)
        self.draft_ids = torch.arange(len(self._d2t), device=d.d2t.device) + d.d2t
        # The target's head rows of the draft vocabulary and its final norm.
        d.lm_head.weight.copy_(target.lm_head.weight[self.draft_ids])
        d.norm.weight.copy_(target.model.norm.weight)

    def build_config(
        self, tcfg: dict[str, Any], cfg: DraftTrainConfig, stream: torch.Tensor
    ) -> dict[str, Any]:
        vocab = tcfg["vocab_size"]
        self._d2t, self._t2d = draft_vocab(stream, vocab, cfg.draft_vocab_size or vocab)
        return {
            **super().build_config(tcfg, cfg, stream),
            "draft_vocab_size": len(self._d2t),
            "target_hidden_size": tcfg["hidden_size"],
            "eagle_config": {
                "eagle_aux_hidden_state_layer_ids": list(
                    default_aux_layers(tcfg["num_hidden_layers"])
                )
            },
        }

    def names(self, i: int) -> set[str]:
        return {"d2t", "t2d"}


class MTPMethod(DraftMethod):
    """DeepSeek-style MTP module(s) in a separate dir: the target's config plus
    `num_nextn_predict_layers`, weights under `model.layers.{L + i}.` (L = target layers).

    One module is reused for every draft step (trained unrolled over `ttt_steps`). N > 1
    modules are chained as spec_decode/multi_layer_mtp.py drafts with them: module i (0-based)
    at position r reads token r + i + 1 and module i - 1's output at r (the target's hidden
    for i = 0), predicts token r + i + 2, with plain causal attention per module (its KV holds
    states computed from module i - 1's outputs over the accepted sequence)."""

    engine_method = "mtp"

    def init_from_target(self, target: LlamaForCausalLM) -> None:
        for d in self.drafters:
            d.shared_head_norm.weight.copy_(target.model.norm.weight)

    def build_config(
        self, tcfg: dict[str, Any], cfg: DraftTrainConfig, stream: torch.Tensor
    ) -> dict[str, Any]:
        self.first_layer = tcfg["num_hidden_layers"]
        c = {k: v for k, v in tcfg.items() if not k.startswith("_")}
        c["num_nextn_predict_layers"] = cfg.num_layers
        c["torch_dtype"] = str(self.save_dtype).removeprefix("torch.")
        return c

    def num_modules(self, cfg: DraftTrainConfig) -> int:
        return cfg.num_layers

    def module_config(self) -> dict[str, Any]:
        # One module at a time (the engine chains N of them from the same classes).
        return {**self.config, "num_nextn_predict_layers": 1}

    def names(self, i: int) -> set[str]:
        return {f"model.layers.{self.first_layer + i}.eh_proj.weight"}

    def checkpoint_name(self, i: int, name: str) -> str:
        prefix = f"model.layers.{self.first_layer + i}."
        if name.startswith("layer."):
            return prefix + name.removeprefix("layer.")
        if name.startswith("shared_head_norm."):
            return prefix + "shared_head.norm." + name.removeprefix("shared_head_norm.")
        return prefix + name


def method_class(method: str) -> type[DraftMethod]:
    from specserve.train.ptd import PTDMethod

    table: dict[str, type[DraftMethod]] = {
        "eagle": EagleMethod,
        "eagle3": Eagle3Method,
        "mtp": MTPMethod,
        "ptd": PTDMethod,
    }
    return table[method]
