"""`specserve train-draft`: train an EAGLE / EAGLE-3 / MTP / PTD head for a local target.

One loop for every method, built from the engine's own classes (the target from the model
registry, the drafter from the speculator's `_construct`), so training sees exactly what
inference sees. Per batch of token windows `t` [B, S]:

  target   dense causal forward, no grad: final-norm hidden h [B*S, H], aux taps (EAGLE-3),
           and the next-token distribution at every position
  drafter  unrolled over `num_steps` draft steps (EAGLE-3's training-time test). Step k at row i
           sits at position i + k, reads token t[i+k+1] and, for k = 0, the target's hidden at
           i (through `combine_hidden`), for k > 0 its own carry from step k - 1; it is trained
           to match the target's distribution at position i + k + 1.

That is what `AutoregressiveSpeculator.propose` feeds the drafter: the draft prefill at position
p reads token p + 1 with the target hidden at p, then decode steps at P + 1, P + 2, ... read the
drafted token and the carry. Attention in step k (see `UnrolledBackend`): row i sees step-0 keys
at rows <= i (what the draft prefill left in the KV cache) and its own keys of steps 1..k (what
the decode steps wrote). Drafters with one module per step (multi-module MTP) get plain causal
attention per module instead.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specserve.attention.backend import AttentionBackend, ForwardContext
from specserve.attention.dense import dense_context, dense_positions
from specserve.models.drafters import Drafter, default_aux_layers
from specserve.models.layers import Attention
from specserve.models.llama import LlamaForCausalLM
from specserve.models.registry import load_model
from specserve.spec_decode.config import SpeculativeConfig
from specserve.spec_decode.speculator import _construct
from specserve.train.data import batch_starts, draft_vocab, gather_windows, training_data

logger = logging.getLogger(__name__)

__all__ = ["DraftTrainConfig", "UnrolledBackend", "train_drafter"]

METHODS = ("eagle", "eagle3", "mtp", "ptd")


@dataclass
class DraftTrainConfig:
    """Hyperparameters of `train_drafter`; the CLI flags map 1:1 onto these fields."""

    method: str
    steps: int = 1000
    batch_size: int = 16
    seq_len: int = 512
    lr: float = 3e-4
    # Draft steps unrolled in training (EAGLE-3's training-time test); 1 = teacher forcing only.
    ttt_steps: int = 3
    # EAGLE-3 / PTD reduced vocabulary from token frequencies; None = the target's vocabulary.
    draft_vocab_size: int | None = None
    # EAGLE: decoder layers; MTP: modules (module k predicts k + 2 tokens ahead).
    num_layers: int = 1
    # PTD: K trained for (1 accepted slot + K - 1 mask slots); None = eval_k.
    ptd_k: int | None = None
    device: str = "auto"
    dtype: str = "auto"
    seed: int = 0
    eval_k: int = 3
    eval_num_prompts: int = 8
    eval_prompt_tokens: int = 64
    eval_max_tokens: int = 64
    progress: bool = True

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}; got {self.method!r}")
        positive = ("batch_size", "ttt_steps", "num_layers", "eval_num_prompts")
        for name in positive + ("eval_prompt_tokens", "eval_max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.steps < 0:
            raise ValueError(f"steps must be >= 0, got {self.steps}")
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if not 1 <= self.eval_k <= 16:
            raise ValueError(f"eval_k (num_speculative_tokens) must be in 1..16, got {self.eval_k}")
        if self.ptd_k is not None and not 2 <= self.ptd_k <= 16:
            raise ValueError(f"ptd_k must be in 2..16, got {self.ptd_k}")
        if self.method in ("eagle3", "ptd") and self.num_layers != 1:
            raise ValueError(f"num_layers: an {self.method} head has one layer; drop --num-layers")
        if self.method == "mtp" and 1 < self.num_layers < self.eval_k:
            raise ValueError(
                f"eval_k (num_speculative_tokens) {self.eval_k}: multi-layer MTP drafts one token "
                f"per module; pass a value <= num_layers {self.num_layers}"
            )
        if self.seq_len < self.num_steps + 2:
            raise ValueError(f"seq_len must be >= {self.num_steps + 2} (draft steps + 2)")
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"dtype must be auto, float32 or bfloat16; got {self.dtype!r}")

    @property
    def num_steps(self) -> int:
        """Draft steps per training example."""
        if self.method == "ptd":
            return max(self.ptd_k or self.eval_k, 2)
        if self.method == "mtp" and self.num_layers > 1:
            return self.num_layers
        return self.ttt_steps

    @property
    def autocast(self) -> bool:
        """bf16 autocast over fp32 master weights (CUDA, unless float32 was asked for)."""
        dev = torch.device(self.device)
        return dev.type == "cuda" and self.dtype != "float32" or self.dtype == "bfloat16"


# ---- attention over unrolled draft steps ------------------------------------------------------
@dataclass
class UnrolledMeta:
    batch: int
    seq_len: int


class UnrolledBackend(AttentionBackend):
    """Dense attention for draft steps unrolled in training (EAGLE-3's training-time test).

    `kv_cache` is the layer's list of (k, v) [B, kv_heads, S, D] from the earlier steps of the
    same batch. Step 0 is plain causal; step n > 0 at row i sees step-0 keys at rows <= i and
    the keys of steps 1..n at row i only: the KV the engine's draft decode steps see.
    """

    name = "unrolled"

    def build(self, common: Any, sliding_window: int | None) -> Any:
        raise NotImplementedError("built by unrolled_context(), not from pages")

    def forward(
        self,
        # [B * S, num_heads, head_dim]
        q: torch.Tensor,
        # [B * S, num_kv_heads, head_dim]
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: Any,
        meta: UnrolledMeta,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        if sliding_window is not None:
            raise ValueError("drafter heads train with full attention (no sliding window)")
        B, S = meta.batch, meta.seq_len
        qh, kh, vh = (t.view(B, S, t.shape[1], t.shape[2]).transpose(1, 2) for t in (q, k, v))
        kv_cache.append((kh, vh))
        n = len(kv_cache)
        kh = torch.cat([c[0] for c in kv_cache], 2)
        vh = torch.cat([c[1] for c in kv_cache], 2)
        rep = qh.shape[1] // kh.shape[1]
        if rep > 1:  # GQA: each kv head serves `rep` query heads
            kh, vh = kh.repeat_interleave(rep, dim=1), vh.repeat_interleave(rep, dim=1)
        if n == 1:
            out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)
        else:
            i = torch.arange(S, device=q.device)
            # [S, S * n]: causal over step 0, then the diagonal of each later step
            mask = torch.cat([i[:, None] >= i[None, :]] + [i[:, None] == i[None, :]] * (n - 1), 1)
            out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)
        return out.transpose(1, 2).reshape(B * S, q.shape[1], q.shape[2])


def unrolled_context(batch: int, seq_len: int, device: torch.device, layers: int) -> ForwardContext:
    """A fresh context: every attention layer (kv_index 0..layers-1) starts with no steps."""
    caches: list[Any] = [[] for _ in range(layers)]
    meta = {None: UnrolledMeta(batch, seq_len)}
    return ForwardContext(backend=UnrolledBackend(), kv_caches=caches, metadata=meta)


# ---- methods: the hooks each drafter plugs into the loop --------------------------------------
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


def train_drafter(
    target_dir: str,
    method: str,
    out_dir: str,
    texts: Sequence[str | list[int]],
    *,
    eval_prompts: Sequence[str | list[int]] | None = None,
    **kwargs: Any,
) -> dict[str, Any]:
    """Train a `method` drafter for the target in `target_dir`; write it to `out_dir`.

    `texts` are documents: strings (tokenized with the target's tokenizer) or token-id lists
    (e.g. the target's own generations). kwargs are DraftTrainConfig fields (steps, batch_size,
    seq_len, lr, ttt_steps, draft_vocab_size, num_layers, device, dtype, seed, eval_k,
    progress, ...). Acceptance is measured through the engine, greedy, on `eval_prompts` (None:
    windows of held-out documents; []: skip). Returns {"losses", "step_accuracy",
    "acceptance_length", "eval_token_ids", "eval_prompt_ids", "train_seconds", "out_dir"}.
    """
    cfg = DraftTrainConfig(method=method, **kwargs)
    device = torch.device(cfg.device)
    stream, prompt_ids = training_data(
        target_dir,
        texts,
        eval_prompts,
        cfg.seq_len,
        cfg.eval_num_prompts,
        cfg.eval_prompt_tokens,
    )
    target_dtype = torch.bfloat16 if cfg.autocast else torch.float32
    target, tcfg = load_model(target_dir, target_dtype, device, cfg.seq_len + cfg.num_steps + 2)
    if cfg.seq_len > tcfg.get("max_position_embeddings", cfg.seq_len):
        raise ValueError(f"seq_len {cfg.seq_len} exceeds the target's max_position_embeddings")
    target.requires_grad_(False)
    torch.manual_seed(cfg.seed)
    with torch.device(device):
        dm = method_class(method)(target, tcfg, cfg, stream)
    t0 = time.perf_counter()
    losses, accs = _train(dm, target, stream, cfg, device)
    train_s = time.perf_counter() - t0
    os.makedirs(out_dir, exist_ok=True)
    dm.save(out_dir, target)
    _write_log(out_dir, cfg, losses, accs)
    del dm, target
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the engine sizes its KV cache from free memory
    acc_len, outputs = float("nan"), []
    if prompt_ids:
        spec = {**method_class(method).spec_config(out_dir), "num_speculative_tokens": cfg.eval_k}
        acc_len, outputs = measure_acceptance(target_dir, spec, prompt_ids, cfg)
        logger.info("%s: mean acceptance length %.3f at K=%d", method, acc_len, cfg.eval_k)
    return {
        "losses": losses,
        "step_accuracy": accs,
        "acceptance_length": acc_len,
        "eval_token_ids": outputs,
        "eval_prompt_ids": prompt_ids,
        "train_seconds": train_s,
        "out_dir": out_dir,
    }


def _lr_at(step: int, cfg: DraftTrainConfig) -> float:
    """Linear warm-up, then cosine decay to 10% of lr."""
    warm = max(1, min(100, cfg.steps // 10))
    if step < warm:
        return cfg.lr * (step + 1) / warm
    frac = (step - warm) / max(1, cfg.steps - warm)
    return cfg.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * frac)))


def _train(
    dm: DraftMethod,
    target: LlamaForCausalLM,
    stream: torch.Tensor,
    cfg: DraftTrainConfig,
    device: torch.device,
) -> tuple[list[float], list[float]]:
    from tqdm import tqdm

    params = [p for p in dm.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(
        params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0, fused=device.type == "cuda"
    )
    starts = batch_starts(len(stream), cfg.steps, cfg.batch_size, cfg.seq_len, cfg.seed)
    stream, starts = stream.to(device), starts.to(device)
    losses: list[torch.Tensor] = []
    accs: list[torch.Tensor] = []
    bar = tqdm(range(cfg.steps), desc=f"train-draft {cfg.method}", disable=not cfg.progress)
    dm.train()
    for step in bar:
        tokens = gather_windows(stream, starts[step], cfg.seq_len)
        for g in opt.param_groups:
            g["lr"] = _lr_at(step, cfg)
        with torch.autocast(device.type, torch.bfloat16, enabled=cfg.autocast):
            loss, acc = unrolled_loss(dm, target, tokens)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(loss.detach())
        accs.append(acc)
        # NOTE: read the loss back only every few steps: .item() waits for the device.
        if step % 10 == 0 or step == cfg.steps - 1:
            bar.set_postfix(loss=f"{loss.item():.3f}", acc=f"{acc[0].item():.2f}")
    dm.eval()
    tail = accs[-max(1, len(accs) // 10) :]
    mean_acc = torch.stack(tail).mean(0).tolist() if tail else []
    return [float(x) for x in torch.stack(losses).tolist()] if losses else [], mean_acc


@dataclass
class TargetSignals:
    """What the drafter learns from, for one batch of [B, S] windows (no grad)."""

    # [B * S, hidden] final-norm hidden states; aux: EAGLE-3 taps, [B * S, hidden] each
    hidden: torch.Tensor
    aux: list[torch.Tensor]
    # [B, S] the target's greedy next token at every position
    greedy: torch.Tensor
    # [B, S] bool: the drafter's vocabulary holds `greedy` (always, without a draft vocab)
    valid: torch.Tensor
    # [B, S, draft vocab] next-token distribution restricted to the drafter's vocabulary
    probs: torch.Tensor
    # [B, S] its entropy: the reported loss is CE minus this (a KL; 0 = a perfect copy)
    entropy: torch.Tensor


@torch.no_grad()
def target_signals(
    dm: DraftMethod,
    target: LlamaForCausalLM,
    # [B, S]
    tokens: torch.Tensor,
) -> TargetSignals:
    """The target's dense causal forward: the same hidden states and aux taps the engine's
    model runner hands the drafter (`model(ids, positions, ctx, aux_layers)`)."""
    B, S = tokens.shape
    ctx = dense_context(B, S, tokens.device, target.sliding_windows())
    pos = dense_positions(B, S, tokens.device)
    hidden, aux = target(tokens.flatten(), pos, ctx, dm.aux_layers())
    logits = target.compute_logits(hidden).float()
    greedy = logits.argmax(-1).view(B, S)
    valid = torch.ones_like(greedy, dtype=torch.bool)
    if dm.draft_ids is not None:
        valid = dm.t2d[greedy]
        logits = logits[:, dm.draft_ids]
    logp = logits.log_softmax(-1).view(B, S, -1)
    probs = logp.exp()
    return TargetSignals(hidden, aux, greedy, valid, probs, -(probs * logp).sum(-1))


def unrolled_outputs(
    dm: DraftMethod,
    sig: TargetSignals,
    # [B, S]
    tokens: torch.Tensor,
) -> Iterator[tuple[Drafter, torch.Tensor]]:
    """Per draft step k: (module, its output [B, S - 1 - k, H]); row i's output stands for the
    draft at position i + k + 2."""
    B, S = tokens.shape
    dev = tokens.device
    pos = dense_positions(B, S, dev)
    h = dm.first_hidden(sig.hidden, sig.aux)
    shared = unrolled_context(B, S, dev, dm.num_attention_layers())
    for k in range(dm.num_steps):
        module = dm.module_for_step(k)
        ctx = shared if dm.reuse_module else unrolled_context(B, S, dev, dm.num_attention_layers())
        # Step k at row i reads token i + k + 1 (rows past the window read padding, unused).
        ids, h = dm.step_inputs(k, F.pad(tokens[:, k + 1 :], (0, k + 1)).flatten(), h)
        # A reused module drafts step k at position i + k (the engine advances draft positions);
        # chained MTP modules all sit at the row's own position i.
        out, h = module(ids, pos + k if dm.reuse_module else pos, h, ctx)
        yield module, out.view(B, S, -1)[:, : S - 1 - k]


def unrolled_loss(
    dm: DraftMethod,
    target: LlamaForCausalLM,
    # [B, S] token windows
    tokens: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, per-step top-1 agreement with the target [num_steps]) over one batch."""
    B, S = tokens.shape
    sig = target_signals(dm, target, tokens)
    total, weights, accs = torch.zeros((), device=tokens.device), 0.0, []
    for k, (module, out) in enumerate(unrolled_outputs(dm, sig, tokens)):
        # Row i matches the target's distribution at position i + k + 1.
        z = module.draft_logits(out).float()
        kl = -(sig.probs[:, k + 1 :] * z.log_softmax(-1)).sum(-1) - sig.entropy[:, k + 1 :]
        mask = sig.valid[:, k + 1 :].float()
        loss_k = (kl * mask).sum() / mask.sum().clamp_min(1.0)
        if dm.feature_loss_weight:
            feat = sig.hidden.view(B, S, -1)[:, k + 1 :].float()
            loss_k = loss_k + dm.feature_loss_weight * F.smooth_l1_loss(out.float(), feat)
        # Later steps count less (SpecForge's 0.8^k): their inputs are noisier.
        total, weights = total + 0.8**k * loss_k, weights + 0.8**k
        with torch.no_grad():
            agree = module.to_target_ids(z.argmax(-1)) == sig.greedy[:, k + 1 :]
            accs.append(agree.float().mean())
    return total / weights, torch.stack(accs)


def measure_acceptance(
    target_dir: str, spec: dict[str, Any], prompts: list[list[int]], cfg: DraftTrainConfig
) -> tuple[float, list[list[int]]]:
    """Mean acceptance length of greedy generation through the engine; also the token ids."""
    from specserve import LLM, SamplingParams

    longest = max(len(p) for p in prompts) + cfg.eval_max_tokens + spec["num_speculative_tokens"]
    llm = LLM(
        target_dir,
        device=cfg.device,
        dtype=cfg.dtype,
        seed=cfg.seed,
        max_model_len=longest + 16,
        max_num_seqs=len(prompts),
        speculative_config=spec,
    )
    sp = SamplingParams(temperature=0.0, max_tokens=cfg.eval_max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    metrics = llm.get_metrics()
    return float(metrics["spec_decode_mean_acceptance_length"]), [
        list(o.outputs[0].token_ids) for o in outs
    ]


def _write_log(out_dir: str, cfg: DraftTrainConfig, losses: list[float], accs: list[float]) -> None:
    with open(os.path.join(out_dir, "train_log.json"), "w") as f:
        json.dump({"config": asdict(cfg), "losses": losses, "step_accuracy": accs}, f)
    if not losses:
        return
    from matplotlib.figure import Figure  # no pyplot: no global backend state

    fig = Figure(figsize=(7, 4))
    ax = fig.add_subplot()
    ax.plot(losses, lw=0.6, alpha=0.4, label="loss")
    span = max(1, len(losses) // 50)
    smooth = [
        sum(losses[max(0, i - span) : i + 1]) / len(losses[max(0, i - span) : i + 1])
        for i in range(len(losses))
    ]
    ax.plot(smooth, lw=1.5, label=f"mean of last {span + 1}")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (KL to the target)")
    ax.set_title(f"train-draft {cfg.method} (seed {cfg.seed})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "loss_curve.png"), dpi=100)
