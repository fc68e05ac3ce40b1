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
drafted token and the carry. The unrolled steps and their attention live in `unrolled.py`, the
per-method hooks (`DraftMethod` and its subclasses) in `heads.py`; this file holds the config,
the optimizer loop, saving and the acceptance measurement through the engine.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from specserve.models.llama import LlamaForCausalLM
from specserve.models.registry import load_model
from specserve.train.data import batch_starts, gather_windows, training_data
from specserve.train.heads import METHODS, DraftMethod, method_class
from specserve.train.unrolled import unrolled_loss

logger = logging.getLogger(__name__)

# METHODS and method_class are re-exported: callers pick methods through this module.
__all__ = ["METHODS", "DraftTrainConfig", "method_class", "train_drafter"]


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
    # EAGLE: decoder layers; MTP: modules (module k predicts k + 2 tokens ahead). eval_k may
    # exceed the MTP modules: serving's draft step i runs module i mod num_layers.
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
        # A fixed K: the acceptance length "at K" (the adaptive budget would vary it by timing).
        spec = {
            **method_class(method).spec_config(out_dir),
            "num_speculative_tokens": cfg.eval_k,
            "adaptive": False,
        }
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


def measure_acceptance(
    target_dir: str, spec: dict[str, Any], prompts: list[list[int]], cfg: DraftTrainConfig
) -> tuple[float, list[list[int]]]:
    """Mean acceptance length of greedy generation through the engine; also the token ids."""
    from specserve.config import EngineConfig
    from specserve.engine.engine import LLMEngine
    from specserve.sampling_params import SamplingParams
    from specserve.train.generate import generate

    longest = max(len(p) for p in prompts) + cfg.eval_max_tokens + spec["num_speculative_tokens"]
    engine = LLMEngine(
        EngineConfig(
            target_dir,
            device=cfg.device,
            dtype=cfg.dtype,
            seed=cfg.seed,
            max_model_len=longest + 16,
            max_num_seqs=len(prompts),
            speculative_config=spec,
        )
    )
    sp = SamplingParams(temperature=0.0, max_tokens=cfg.eval_max_tokens, ignore_eos=True)
    outs = generate(engine, [{"prompt_token_ids": p} for p in prompts], [sp])
    metrics = engine.metrics_snapshot()
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
