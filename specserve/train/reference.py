"""Training the reference target from scratch with the engine's own Llama class.

The model is `specserve.models.llama.LlamaForCausalLM`, run over dense [batch, seq] blocks through
the cache-free attention backend (`specserve.attention.dense`), so training and serving share one
implementation of every layer. The result is saved in Hugging Face layout (`save_hf`): the fused
`qkv_proj` / `gate_up_proj` weights are split back into q/k/v and gate/up, so transformers and the
engine's loader read it like any other Llama checkpoint.

Reproducible: fixed seeds, weights initialised on the CPU, a seeded block order; on the CPU the same
seed gives bit-identical losses. On CUDA: bf16 autocast (flash SDPA), TF32, fused AdamW and optional
`torch.compile`.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from specserve.attention.dense import dense_context, dense_positions
from specserve.models.llama import LlamaForCausalLM

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@dataclass(frozen=True)
class ModelShape:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} must be a multiple of num_attention_heads "
                f"{self.num_attention_heads}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )


def llama_config(shape: ModelShape, ids: dict[str, int], dtype: torch.dtype) -> dict[str, Any]:
    """A transformers LlamaConfig-style config.json. `ids` holds bos / eos / pad / end_of_turn."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **asdict(shape),
        "head_dim": shape.hidden_size // shape.num_attention_heads,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "bos_token_id": ids["bos"],
        # Both end a generation: <|endoftext|> after code, <|end|> after a chat turn.
        "eos_token_id": sorted({ids["eos"], ids["end_of_turn"]}),
        "pad_token_id": ids["pad"],
        "torch_dtype": _DTYPE_NAMES[dtype],
        "use_cache": True,
    }


@dataclass
class TrainConfig:
    seq_len: int = 512
    batch_size: int = 32
    max_steps: int = 1000
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    seed: int = 0
    # A wall-clock cap: after timing the first steps, max_steps shrinks to fit (the schedule is
    # fixed then, still before the warmup ends, so the curve stays a proper cosine).
    max_minutes: float | None = None
    compile: bool = False
    init_std: float = 0.02

    def __post_init__(self) -> None:
        for name in ("seq_len", "batch_size", "max_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"TrainConfig.{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.warmup_steps <= self.max_steps:
            raise ValueError("TrainConfig.warmup_steps must be in [0, max_steps]")
        if self.lr <= 0 or not 0 <= self.min_lr_ratio <= 1:
            raise ValueError("TrainConfig.lr must be > 0 and min_lr_ratio in [0, 1]")


def cosine_lr(step: int, total: int, cfg: TrainConfig) -> float:
    """Linear warmup to cfg.lr, then cosine decay to cfg.lr * min_lr_ratio at `total`."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    frac = min(1.0, (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps))
    lo = cfg.lr * cfg.min_lr_ratio
    return lo + 0.5 * (cfg.lr - lo) * (1 + math.cos(math.pi * frac))


class TokenBlocks:
    """Deterministic [batch, seq + 1] blocks from one token stream: non-overlapping windows in a
    seeded order that is reshuffled every epoch."""

    def __init__(
        self,
        # [num_tokens]
        tokens: torch.Tensor,
        seq_len: int,
        batch_size: int,
        seed: int,
    ) -> None:
        self.num_blocks = (tokens.numel() - 1) // seq_len
        if self.num_blocks < batch_size:
            raise ValueError(
                f"{tokens.numel()} tokens make {self.num_blocks} blocks of {seq_len}; a batch "
                f"needs {batch_size}: use more text or a smaller batch"
            )
        self.tokens, self.seq_len, self.batch_size, self.seed = tokens, seq_len, batch_size, seed
        self.per_epoch = self.num_blocks // batch_size
        self._offsets = torch.arange(seq_len + 1, device=tokens.device)
        self._epoch, self._perm = -1, torch.empty(0, dtype=torch.long)

    def batch(self, step: int) -> torch.Tensor:
        """[batch, seq + 1] token ids of training step `step`."""
        epoch, i = divmod(step, self.per_epoch)
        if epoch != self._epoch:
            g = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
            self._epoch, self._perm = epoch, torch.randperm(self.num_blocks, generator=g)
        starts = self._perm[i * self.batch_size : (i + 1) * self.batch_size] * self.seq_len
        idx = starts.to(self.tokens.device)[:, None] + self._offsets
        return self.tokens[idx]


@torch.no_grad()
def init_weights_(model: LlamaForCausalLM, std: float, seed: int) -> None:
    """GPT-2 style init: N(0, std), residual output projections scaled by 1/sqrt(2 * layers)."""
    g = torch.Generator().manual_seed(seed)
    layers = model.config.num_hidden_layers
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif p.dim() == 1:
            p.zero_()
        else:
            s = (
                std / math.sqrt(2 * layers)
                if name.endswith(("o_proj.weight", "down_proj.weight"))
                else std
            )
            p.copy_(torch.randn(p.shape, generator=g) * s)


def count_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _optimizer(model: torch.nn.Module, cfg: TrainConfig, device: torch.device) -> Any:
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    fused = {"fused": True} if device.type == "cuda" else {}
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), **fused)


def train_reference(
    cfg: dict[str, Any],
    # [num_tokens] the whole training stream
    tokens: np.ndarray | torch.Tensor,
    train: TrainConfig,
    device: str | torch.device = "cpu",
    progress: bool = True,
) -> tuple[LlamaForCausalLM, dict[str, Any]]:
    """Train a fresh LlamaForCausalLM described by `cfg` (config.json dict) on `tokens`.

    Returns the model (fp32, on `device`) and a JSON-able record: losses (one per step), steps,
    tokens, seconds, tokens_per_s, params."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(train.seed)
    max_position = max(train.seq_len, cfg.get("max_position_embeddings", 0))
    model = LlamaForCausalLM.from_config_dict(cfg, max_position)
    init_weights_(model, train.init_std, train.seed)
    model.to(device).train()
    stream = torch.as_tensor(np.asarray(tokens), dtype=torch.long).to(device)
    blocks = TokenBlocks(stream, train.seq_len, train.batch_size, train.seed)
    step_fn = _StepFn(model, train, device)
    losses, seconds = _run(step_fn, blocks, train, device, progress)
    total, per_step = len(losses), train.batch_size * train.seq_len
    record = {
        "losses": [round(v, 5) for v in losses],
        "steps": total,
        "tokens": total * per_step,
        "seconds": round(seconds, 2),
        "tokens_per_s": round(total * per_step / seconds, 1),
        "params": count_params(model),
        "corpus_tokens": int(stream.numel()),
        "epochs": round(total * per_step / max(1, stream.numel()), 2),
        "compiled": step_fn.compiled,
    }
    print(
        f"target: {record['params'] / 1e6:.1f}M params, {total} steps, "
        f"{record['tokens'] / 1e6:.1f}M tokens in {seconds:.0f}s "
        f"({record['tokens_per_s']:,.0f} tokens/s), final loss {losses[-1]:.3f}"
    )
    return model.eval(), record


class _StepFn:
    """One optimizer step: forward (bf16 autocast on CUDA), backward, clip, AdamW.

    With train.compile the forward + loss runs through torch.compile; a compile failure falls back
    to eager once, with a message, rather than losing the run."""

    def __init__(self, model: LlamaForCausalLM, train: TrainConfig, device: torch.device) -> None:
        self.model, self.train, self.device = model, train, device
        self.opt = _optimizer(model, train, device)
        B, S = train.batch_size, train.seq_len
        self.ctx = dense_context(B, S, device)
        self.positions = dense_positions(B, S, device)
        self.compiled = train.compile
        self.loss_fn = torch.compile(self._loss) if train.compile else self._loss

    def _loss(
        self,
        # [batch * seq]
        x: torch.Tensor,
        # [batch * seq]
        y: torch.Tensor,
    ) -> torch.Tensor:
        hidden, _ = self.model(x, self.positions, self.ctx)
        return F.cross_entropy(self.model.compute_logits(hidden).float(), y)

    def __call__(self, block: torch.Tensor, lr: float) -> torch.Tensor:
        for group in self.opt.param_groups:
            group["lr"] = lr
        x, y = block[:, :-1].reshape(-1), block[:, 1:].reshape(-1)
        try:
            loss = self._forward_backward(x, y)
        except Exception as e:
            if not self.compiled:
                raise
            print(f"torch.compile failed ({type(e).__name__}: {e}); training eagerly")
            self.opt.zero_grad(set_to_none=True)
            self.compiled, self.loss_fn = False, self._loss
            loss = self._forward_backward(x, y)
        if self.train.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.train.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.detach()

    def _forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.device.type == "cuda"):
            loss = self.loss_fn(x, y)
        loss.backward()
        return loss


def _run(
    step_fn: _StepFn, blocks: TokenBlocks, train: TrainConfig, device: torch.device, progress: bool
) -> tuple[list[float], float]:
    """The training loop: cosine schedule, optional wall-clock fit, progress bar with the loss."""
    total = train.max_steps
    # Losses stay on the device and are read every few steps: a sync per step costs on a GPU.
    losses = torch.zeros(total, device=device)
    bar = _progress(total, progress)
    t0 = time.perf_counter()
    t_calib = t0
    step = 0
    while step < total:
        losses[step] = step_fn(blocks.batch(step), cosine_lr(step, total, train))
        step += 1
        if step == 3:  # after compilation and allocator warm-up
            _sync(device)
            t_calib = time.perf_counter()
        if step == 13 and train.max_minutes is not None:
            total = _fit_steps(total, step, t0, t_calib, train)
        every = 10 if bar is not None else max(1, total // 10)
        if step % every == 0 or step == total:
            tok_s = step * train.batch_size * train.seq_len / (time.perf_counter() - t0)
            loss = losses[step - 1].item()
            if bar is not None:
                bar.total = total
                bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tok_s:,.0f}")
                bar.update(step - bar.n)
            else:  # a log line every 10%: logs of remote runs stay short
                print(f"step {step}/{total} loss {loss:.3f} {tok_s:,.0f} tokens/s", flush=True)
    _sync(device)
    seconds = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    return losses[:total].tolist(), seconds


def _fit_steps(total: int, step: int, t0: float, t_calib: float, train: TrainConfig) -> int:
    """Shrink the step count so the run ends inside train.max_minutes."""
    assert train.max_minutes is not None
    now = time.perf_counter()
    per_step = (now - t_calib) / (step - 3)
    left = train.max_minutes * 60 - (now - t0)
    fit = step + int(left / per_step)
    if fit < total:
        print(
            f"{per_step * 1e3:.1f} ms/step: {total} steps would take "
            f"{(now - t0 + (total - step) * per_step) / 60:.1f} min; training {fit} steps to fit "
            f"max_minutes={train.max_minutes}"
        )
        return max(fit, step + 1)
    return total


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _progress(total: int, enabled: bool) -> Any:
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="train target", dynamic_ncols=True, mininterval=1.0)


# ---- saving -------------------------------------------------------------------------------------
def hf_state_dict(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """Our parameters under Hugging Face Llama names: fused qkv / gate_up split back apart."""
    c = model.config
    q = c.num_attention_heads * c.head_dim
    kv = c.num_key_value_heads * c.head_dim
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        if c.tie_word_embeddings and name == "lm_head.weight":
            continue
        if ".qkv_proj." in name:
            for part, piece in zip(("q_proj", "k_proj", "v_proj"), t.split([q, kv, kv])):
                out[name.replace("qkv_proj", part)] = piece
        elif ".gate_up_proj." in name:
            for part, piece in zip(("gate_proj", "up_proj"), t.chunk(2)):
                out[name.replace("gate_up_proj", part)] = piece
        else:
            out[name] = t
    return out


def save_hf(model: LlamaForCausalLM, cfg: dict[str, Any], out_dir: str, dtype: torch.dtype) -> str:
    """Write config.json, generation_config.json and model.safetensors (in `dtype`) to out_dir."""
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    # NOTE: clone so no two saved tensors share storage (safetensors refuses shared views).
    tensors = {
        k: v.detach().to("cpu", dtype).clone().contiguous() for k, v in hf_state_dict(model).items()
    }
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    cfg = {**cfg, "torch_dtype": _DTYPE_NAMES[dtype]}
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    gen = {
        "bos_token_id": cfg.get("bos_token_id"),
        "eos_token_id": cfg.get("eos_token_id"),
        "pad_token_id": cfg.get("pad_token_id"),
        "do_sample": False,
    }
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump(gen, f, indent=2)
    return out_dir


def plot_losses(losses: list[float], path: str, title: str) -> None:
    """A loss-curve PNG (raw and smoothed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(losses, lw=0.6, alpha=0.4, label="loss")
    w = max(1, len(losses) // 50)
    if w > 1:
        smooth = np.convolve(losses, np.ones(w) / w, mode="valid")
        ax.plot(np.arange(w - 1, len(losses)), smooth, lw=1.5, label=f"mean of {w}")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
