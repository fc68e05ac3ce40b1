"""The engine's configuration. CLI flags map 1:1 onto these fields."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from specserve.config.speculative import SpeculativeConfig

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


# vLLM's --kv-cache-dtype names; "fp8" is e4m3 (the format with the finer mantissa).
KV_CACHE_DTYPES = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's element type: the model's dtype for auto, else an fp8 format."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype must be auto, {', '.join(KV_CACHE_DTYPES)}; got {kv_cache_dtype!r}."
        )
    return KV_CACHE_DTYPES[kv_cache_dtype]


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        # NOTE: fp32 on CPU: bf16 matmuls there are slow and make equivalence tests noisy.
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {dtype!r}.")
    return _DTYPES[dtype]


@dataclass
class EngineConfig:
    model: str
    tokenizer: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    # Automatic prefix caching (engine/kv_cache.py): full blocks shared by requests whose
    # tokens agree, target and drafter KV alike; on by default, as in vLLM.
    enable_prefix_caching: bool = True
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    kv_cache_memory: int | None = None  # bytes
    # KV cache element type (vLLM's names): auto (the model's dtype) | fp8 (= fp8_e4m3) |
    # fp8_e4m3 | fp8_e5m2. fp8 holds twice the tokens of bf16 in the same memory; K and V are
    # divided by per-layer scales when written and multiplied back inside the attention kernels.
    kv_cache_dtype: str = "auto"
    # fp8 KV scales from the first prefill (amax / K_SCALE_CONSTANT 200 for keys, amax / 100
    # for values, as vLLM computes them) instead of the checkpoint's k_scale / v_scale (or 1.0).
    # Ignored with kv_cache_dtype auto, as in vLLM.
    calculate_kv_scales: bool = False
    num_gpu_blocks_override: int | None = None
    # The most logprobs (sample or prompt) one request may ask for; -1: the vocabulary size
    # (vLLM's field and default). Checked when a request is added.
    max_logprobs: int = 20
    enforce_eager: bool = False
    # Schedule and launch step N+1 while step N runs: the host's per-step work no longer leaves
    # the GPU idle. None: on for CUDA (as in vLLM), off on CPU, where the host is the device
    # and there is nothing to overlap.
    async_scheduling: bool | None = None
    # Run every step shape serving can produce once at start-up (worker/warmup.py): every
    # batch size and query length, each sampling path, prefills up to the token budget, so no
    # Triton compile or first-use allocation lands on a request. None: on for CUDA, off on CPU
    # (nothing compiles there).
    warmup: bool | None = None
    # Drafting loop on CUDA: auto (one graph for the whole loop where the attention backend
    # updates metadata in place, else one step graph replayed per step) | fused | per_step | eager
    draft_graph_mode: str = "auto"
    # auto: read the safetensors; dummy: random weights from config.json alone (benchmarks).
    load_format: str = "auto"
    # MXFP4 checkpoints (gpt-oss): auto (experts stay 4-bit on CUDA, read by the MXFP4 MoE
    # kernels; dequantized at load on CPU) | mxfp4 (4-bit anywhere) | dequantize (bf16 experts).
    mxfp4_experts: str = "auto"
    # Block-scaled fp8 checkpoints (DeepSeek-V3): auto (linear layers stay 8-bit on CUDA, read
    # by ops/fp8_matmul.py; dequantized at load on CPU) | keep (8-bit anywhere) | dequantize.
    fp8_weights: str = "auto"
    attention_backend: str = "auto"  # auto | torch | triton
    # Matmuls of decode batches (<= 8 rows) on CUDA: cublas (F.linear) | triton (ops/gemv.py)
    # | auto (per bf16/fp16 weight shape and row count 1-2, whichever was faster when timed at
    # start-up, once per process); float32 weights use F.linear there. On the CPU, auto and
    # triton run float32 products of 2-32 rows as W @ x^T (ops/cpu_linear.py: verification
    # and small decode batches), cublas keeps F.linear.
    decode_matmul: str = "auto"
    speculative_config: SpeculativeConfig | dict[str, Any] | str | None = None
    # Tensor parallelism (engine/tp_executor.py): the target (and the drafter, unless
    # speculative_config.draft_tensor_parallel_size is 1) sharded over this many ranks, one
    # process each (NCCL on CUDA, gloo on CPU); across machines, NNODES / NODE_RANK /
    # MASTER_ADDR / MASTER_PORT in the environment of every node (README).
    tensor_parallel_size: int = 1
    # Seconds a tensor-parallel collective or rendezvous may wait for a rank before the engine
    # fails with an error naming it (a dead rank fails the next step sooner).
    distributed_timeout_seconds: float = 300.0
    served_model_name: str | None = None
    disable_log_stats: bool = True
    log_stats_interval: float = 10.0
    trust_remote_code: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError("model must be a path to a local Hugging Face model directory.")
        if self.model.endswith(".gguf"):
            # NOTE: the engine converts it once into a cached HF directory (models/gguf.py) and
            # loads that like any other; the name served stays the file's.
            self.served_model_name = self.served_model_name or os.path.basename(self.model)
            if not os.path.isfile(self.model):
                raise FileNotFoundError(f"GGUF file {self.model!r} does not exist")
        elif not os.path.isdir(self.model):
            raise FileNotFoundError(
                f"model directory {self.model!r} does not exist (specserve loads local "
                "Hugging Face-format directories only; no hub access)."
            )
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}.")
        if not isinstance(self.max_logprobs, int) or self.max_logprobs < -1:
            raise ValueError(
                f"max_logprobs must be -1 or an integer >= 0, got {self.max_logprobs!r}."
            )
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}.")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1].")
        if self.draft_graph_mode not in ("auto", "fused", "per_step", "eager"):
            raise ValueError(
                "draft_graph_mode must be auto, fused, per_step or eager, "
                f"got {self.draft_graph_mode!r}."
            )
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be auto or dummy, got {self.load_format!r}.")
        if self.mxfp4_experts not in ("auto", "mxfp4", "dequantize"):
            raise ValueError(
                f"mxfp4_experts must be auto, mxfp4 or dequantize, got {self.mxfp4_experts!r}."
            )
        if self.fp8_weights not in ("auto", "keep", "dequantize"):
            raise ValueError(
                f"fp8_weights must be auto, keep or dequantize, got {self.fp8_weights!r}."
            )
        if self.kv_cache_dtype != "auto" and self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be auto, {', '.join(KV_CACHE_DTYPES)}; "
                f"got {self.kv_cache_dtype!r}."
            )
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError("attention_backend must be auto, torch or triton.")
        if self.decode_matmul not in ("cublas", "triton", "auto"):
            raise ValueError(
                f"decode_matmul must be cublas, triton or auto; got {self.decode_matmul!r}."
            )
        if isinstance(self.speculative_config, str):
            try:
                self.speculative_config = json.loads(self.speculative_config)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from e
        if isinstance(self.speculative_config, dict):
            self.speculative_config = SpeculativeConfig.from_dict(self.speculative_config)
        elif self.speculative_config is not None and not isinstance(
            self.speculative_config, SpeculativeConfig
        ):
            raise ValueError(
                "speculative_config must be a JSON object such as "
                '\'{"method": "ngram", "num_speculative_tokens": 3}\', got '
                f"{type(self.speculative_config).__name__} {self.speculative_config!r}."
            )
        self._check_tensor_parallel()
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        try:
            dev = torch.device(self.device)
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"device must be auto, cpu or cuda[:N], got {self.device!r}.") from e
        if dev.type not in ("cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda[:N], got {self.device!r}.")
        if self.async_scheduling is None:
            self.async_scheduling = self.torch_device.type == "cuda"
        if self.warmup is None:
            self.warmup = self.torch_device.type == "cuda"

    def _check_tensor_parallel(self) -> None:
        tp = self.tensor_parallel_size
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {tp!r}.")
        if not self.distributed_timeout_seconds > 0:
            raise ValueError("distributed_timeout_seconds must be > 0.")
        spec = self.speculative_config
        draft_tp = getattr(spec, "draft_tensor_parallel_size", None)
        if draft_tp not in (None, 1, tp):
            raise ValueError(
                f"speculative_config.draft_tensor_parallel_size must be 1 (the drafter whole on "
                f"every rank) or tensor_parallel_size ({tp}), got {draft_tp!r}."
            )

    def check_device_available(self) -> None:
        """Before anything touches the device (engine start): a one-line error, not CUDA's
        traceback from deep inside the first allocation. (Not in __post_init__: a config for
        another machine may be built here.)"""
        if self.torch_device.type == "cuda" and not torch.cuda.is_available():
            why = (
                "this torch build has no CUDA support"
                if torch.version.cuda is None
                else "no CUDA GPU is visible"
            )
            raise ValueError(f"device {self.device!r} was asked for, but {why}; use --device cpu.")

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        return resolve_dtype(self.dtype, self.torch_device)

    @property
    def kv_cache_torch_dtype(self) -> torch.dtype:
        return resolve_kv_cache_dtype(self.kv_cache_dtype, self.torch_dtype)

    @property
    def spec(self) -> SpeculativeConfig | None:
        assert not isinstance(self.speculative_config, (dict, str))
        return self.speculative_config

    def describe(self, off_hint: str = "--speculative-config null") -> str:
        """One start-up line: the model, the drafter, and how to turn speculation off."""
        model = self.served_model_name or self.model
        spec = self.spec
        if spec is None:
            return f"model {model}; speculative decoding off"
        head = f", drafter {spec.model}" if spec.model else ""
        return (
            f"model {model}; speculative decoding on: {spec.method}, "
            f"num_speculative_tokens {spec.num_speculative_tokens}{head} "
            f"(turn it off with {off_hint})"
        )

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls) if f.name != "extra"]
