"""Tensor-parallel sharding of a built model, before its weights load (Megatron's layout, as
vLLM shards):

  attention   qkv_proj column-parallel by heads (KV heads split, or replicated when there are
              fewer KV heads than ranks: rank r keeps KV head r // (ranks / KV heads)); sinks
              by heads; o_proj row-parallel, then an all-reduce
  MLP         gate_up_proj column-parallel, down_proj row-parallel, then an all-reduce
  MoE         every expert split by its intermediate size (w13 rows, w2 columns); the router
              replicated; one all-reduce over routed and shared experts together
  MLA         q_proj / q_b_proj, kv_b_proj and o_proj by heads; the latent projections
              (q_a_proj, kv_a_proj_with_mqa), their norms and the latent KV replicated
  vocab       embed_tokens and lm_head split by vocabulary rows (padded to a multiple of the
              ranks); the embedding all-reduces its masked lookup, lm_head all-gathers the
              logits, so every rank holds the full logits and samples the same tokens

`shard_model_` replaces parameters by empty local ones, each with a `tp_load(tensor, part)`
that cuts this rank's slice from the checkpoint tensor as models/loader.py reads it (`part`:
the fused shard index, or the expert tensor's kind). Norms, routers, EAGLE's fc and MTP's
eh_proj stay replicated: their inputs are the full residual stream on every rank.

A sharded model is built under `params_on_meta()`: its parameters take no memory until
`shard_model_` allocates each rank's part (a Llama-3-70B built whole would need ~131 GiB on
every GPU before sharding); buffers (rotary tables) are built on the device as usual.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from specserve.distributed import TensorParallel
from specserve.models.layers import MLP, Attention
from specserve.models.loader import ModelLoadError
from specserve.models.mla import MLAAttention
from specserve.models.moe import Mxfp4Experts, SparseMoE, StackedExperts

# (checkpoint tensor, fused shard index or expert kind) -> this rank's slice of it
TPLoad = Callable[[torch.Tensor, "int | str | None"], torch.Tensor]


class VocabParallelEmbedding(nn.Embedding):
    """Rows [vocab_start, vocab_start + num_local) of the table; ids elsewhere look up zeros,
    and the all-reduce fills in the rank that holds them."""

    def __init__(self, full: nn.Embedding, tp: TensorParallel) -> None:
        n = -(-full.num_embeddings // tp.world_size)
        w = full.weight
        super().__init__(n, full.embedding_dim, device=w.device, dtype=w.dtype)
        self.tp, self.num_local, self.vocab_start = tp, n, tp.rank * n
        self.weight.requires_grad_(False)
        self.weight.tp_load = _vocab_load(tp.rank, n, full.num_embeddings)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_local)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(out.masked_fill(outside.unsqueeze(-1), 0))


class VocabParallelLMHead(nn.Linear):
    """lm_head over this rank's vocabulary rows; the forward all-gathers the full logits."""

    def __init__(self, full: nn.Linear, tp: TensorParallel, weight: nn.Parameter | None) -> None:
        if full.bias is not None:
            raise ModelLoadError("tensor parallelism: an lm_head with a bias is not supported")
        n = -(-full.out_features // tp.world_size)
        w = full.weight
        super().__init__(full.in_features, n, bias=False, device=w.device, dtype=w.dtype)
        self.tp, self.vocab_size = tp, full.out_features
        if weight is not None:  # tied to the (already sharded) embedding
            self.weight = weight
        else:
            self.weight.requires_grad_(False)
            self.weight.tp_load = _vocab_load(tp.rank, n, full.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [..., world * num_local] -> [..., vocab]
        logits = self.tp.all_gather(F.linear(x, self.weight))
        if logits.shape[-1] != self.vocab_size:
            logits = logits[..., : self.vocab_size].contiguous()
        return logits


def _vocab_load(rank: int, n: int, vocab: int) -> TPLoad:
    def load(t: torch.Tensor, part: int | str | None) -> torch.Tensor:
        start = rank * n
        rows = t.narrow(0, min(start, vocab), max(0, min(n, vocab - start)))
        if rows.shape[0] < n:  # the padded tail of the last rank: zero rows, never chosen
            rows = torch.cat([rows, rows.new_zeros(n - rows.shape[0], *t.shape[1:])])
        return rows

    return load


def _split(total: int, tp: TensorParallel, what: str) -> tuple[int, int]:
    """(start, size) of this rank's share of `total` units."""
    if total % tp.world_size:
        raise ModelLoadError(
            f"tensor_parallel_size {tp.world_size} must divide {what} ({total}); choose a "
            "tensor_parallel_size that divides it"
        )
    n = total // tp.world_size
    return tp.rank * n, n


def _new_param(module: nn.Module, name: str, shape: tuple[int, ...], load: TPLoad) -> None:
    old = getattr(module, name)
    p = nn.Parameter(torch.empty(shape, dtype=old.dtype, device=old.device), requires_grad=False)
    p.tp_load = load
    setattr(module, name, p)


def _rows(spans: dict[int | str | None, tuple[int, int]], dim: int = 0) -> TPLoad:
    """A loader that narrows `dim` to the span of each fused part (a part not listed: whole)."""

    def load(t: torch.Tensor, part: int | str | None) -> torch.Tensor:
        if part not in spans:
            return t
        start, size = spans[part]
        return t.narrow(dim, start, size)

    return load


def _rank0_only(rank: int) -> TPLoad:
    """A row-parallel layer's bias: added once (rank 0), zeros elsewhere, before the sum."""
    return lambda t, part: t if rank == 0 else torch.zeros_like(t)


def _shard_linear(
    linear: nn.Linear,
    out_spans: dict[int | str | None, tuple[int, int]] | None,
    in_span: tuple[int, int] | None,
    rank: int,
) -> None:
    """Column-parallel (`out_spans`: the rows kept per fused part) or row-parallel
    (`in_span`: the input columns kept) in place."""
    if out_spans is not None:
        rows = sum(n for _, n in out_spans.values())
        _new_param(linear, "weight", (rows, linear.in_features), _rows(out_spans))
        if linear.bias is not None:
            _new_param(linear, "bias", (rows,), _rows(out_spans))
        linear.out_features = rows
    if in_span is not None:
        cols = in_span[1]
        _new_param(linear, "weight", (linear.out_features, cols), _rows({None: in_span}, 1))
        if linear.bias is not None:
            _new_param(linear, "bias", tuple(linear.bias.shape), _rank0_only(rank))
        linear.in_features = cols


def _shard_attention(a: Attention, tp: TensorParallel) -> None:
    hd, world = a.head_dim, tp.world_size
    q0, hl = _split(a.num_heads, tp, "num_attention_heads")
    kv = a.num_kv_heads
    if kv >= world:
        k0, kl = _split(kv, tp, "num_key_value_heads")
    elif world % kv:
        raise ModelLoadError(
            f"tensor_parallel_size {world} must be a multiple or a divisor of "
            f"num_key_value_heads ({kv})"
        )
    else:  # fewer KV heads than ranks: each is replicated on world / kv ranks
        k0, kl = tp.rank // (world // kv), 1
    q_span, kv_span = (q0 * hd, hl * hd), (k0 * hd, kl * hd)
    _shard_linear(a.qkv_proj, {0: q_span, 1: kv_span, 2: kv_span}, None, tp.rank)
    _shard_linear(a.o_proj, None, q_span, tp.rank)
    if a.sinks is not None:
        _new_param(a, "sinks", (hl,), _rows({None: (q0, hl)}))
    a.num_heads, a.num_kv_heads = hl, kl
    a.q_size, a.kv_size = hl * hd, kl * hd
    a.tp = tp


def _shard_mlp(m: MLP, tp: TensorParallel) -> None:
    span = _split(m.intermediate_size, tp, "intermediate_size")
    _shard_linear(m.gate_up_proj, {0: span, 1: span}, None, tp.rank)
    _shard_linear(m.down_proj, None, span, tp.rank)
    m.intermediate_size = span[1]
    m.tp = tp


def _expert_load(full_inter: int, span: tuple[int, int], rank: int, bias: bool = False) -> TPLoad:
    """Expert tensors by kind: per-expert gate / up [I, H] and down [H, I]; fused gate_up
    [E, 2I, H] (or [E, H, 2I]) and down [E, H, I] (or [E, I, H]); biases [E, 2I] / [E, H]."""
    start, n = span

    def halves(t: torch.Tensor, dim: int) -> torch.Tensor:
        g, u = t.narrow(dim, start, n), t.narrow(dim, full_inter + start, n)
        return torch.cat([g, u], dim)

    def load(t: torch.Tensor, part: int | str | None) -> torch.Tensor:
        if part in ("gate_proj", "up_proj"):
            return t.narrow(0, start, n)
        if part == "down_proj":  # [H, I] per expert, or fused [E, H, I] / [E, I, H]
            if t.dim() == 2:
                return t.narrow(1, start, n)
            return t.narrow(2 if t.shape[2] == full_inter else 1, start, n)
        if part == "gate_up_proj":
            return halves(t, 1 if t.shape[1] == 2 * full_inter else 2)
        if part == "w13_bias":
            return halves(t, 1)
        if part == "w2_bias":
            return t if rank == 0 else torch.zeros_like(t)
        raise ModelLoadError(f"tensor parallelism: no expert slicing for {part!r}")

    return load


def _shard_experts(e: StackedExperts | Mxfp4Experts, tp: TensorParallel) -> None:
    full = e.intermediate_size
    span = _split(full, tp, "the experts' intermediate size")
    if isinstance(e, Mxfp4Experts):
        # NOTE: the 4-bit experts (CUDA) arrive through gpt-oss's own conversion, which has no
        # sharded form yet; a split must also fall on the 32-value MXFP4 blocks.
        raise ModelLoadError(
            "tensor parallelism with MXFP4 experts is not supported yet; pass "
            "mxfp4_experts='dequantize'"
        )
    load = _expert_load(full, span, tp.rank)
    E, two_i, H = e.w13.shape
    _new_param(e, "w13", (E, 2 * span[1], H), load)
    _new_param(e, "w2", (E, H, span[1]), load)
    if e.w13_bias is not None:
        _new_param(e, "w13_bias", (E, 2 * span[1]), lambda t, p: load(t, "w13_bias"))
        _new_param(e, "w2_bias", (E, H), lambda t, p: load(t, "w2_bias"))
    e.intermediate_size = span[1]


def _shard_mla(a: MLAAttention, tp: TensorParallel) -> None:
    m = a.m
    h0, hl = _split(m.num_heads, tp, "num_attention_heads")
    qk, kv = m.qk_nope_head_dim + m.qk_rope_head_dim, m.qk_nope_head_dim + m.v_head_dim
    if m.q_lora_rank is None:  # q_proj's rows by heads; kv_a_proj_with_mqa's replicated
        _shard_linear(a.fused_qkv_a_proj, {0: (h0 * qk, hl * qk), 1: (0, a.qkv_a_sizes[1])}, None, tp.rank)  # fmt: skip
        a.qkv_a_sizes = (hl * qk, a.qkv_a_sizes[1])
    else:
        _shard_linear(a.q_b_proj, {None: (h0 * qk, hl * qk)}, None, tp.rank)
    _shard_linear(a.kv_b_proj, {None: (h0 * kv, hl * kv)}, None, tp.rank)
    _shard_linear(a.o_proj, None, (h0 * m.v_head_dim, hl * m.v_head_dim), tp.rank)
    a.m = replace(m, num_heads=hl)
    a.tp = tp


@contextlib.contextmanager
def params_on_meta(enabled: bool = True, keep: nn.Module | None = None) -> Iterator[None]:
    """Every parameter registered inside goes to the meta device (no memory; its module keeps
    working as a shape), buffers stay where they are built; `keep`'s own parameters (a
    target a drafter shares weights with) stay as they are. Each parameter is still allocated
    where it is created and moved at once, so the peak is one full parameter at a time.
    `enabled` False: a no-op (a model that will not be sharded)."""
    if not enabled:
        yield
        return
    register = nn.Module.register_parameter
    kept = {id(p) for p in keep.parameters()} if keep is not None else set()

    def on_meta(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta and id(param) not in kept:
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(self, name, param)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def _materialize_(model: nn.Module, device: torch.device) -> None:
    """Allocate every meta parameter left after sharding on `device` (uninitialized: the
    loader or dummy_weights_ fills it), keeping its attributes and its ties."""
    done: dict[int, nn.Parameter] = {}
    for m in model.modules():
        for n, p in list(m._parameters.items()):
            if p is None or not p.is_meta:
                continue
            if id(p) not in done:
                new = nn.Parameter(torch.empty_like(p, device=device), requires_grad=False)
                new.__dict__.update(p.__dict__)
                done[id(p)] = new
            m._parameters[n] = done[id(p)]


def shard_model_(model: nn.Module, tp: TensorParallel) -> None:
    """Shard `model` for this rank of `tp` in place (see the module docstring). Modules it
    shares with a model sharded before (a drafter's target embedding and lm_head) are left
    as they are."""
    # Parameters tied across modules (multi-layer MTP's repeated modules) stay tied.
    tied = {
        (id(m), n): id(p)
        for m in model.modules()
        for n, p in m._parameters.items()
        if p is not None
    }
    # Embeddings first: a tied lm_head takes the sharded embedding's weight.
    embeds: dict[int, nn.Parameter] = {}
    for kind in (nn.Embedding, nn.Linear):
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is not kind or getattr(child, "tp_sharded", False):
                    continue
                if kind is nn.Embedding:
                    new: nn.Module = VocabParallelEmbedding(child, tp)
                    embeds[id(child.weight)] = new.weight
                elif name in ("lm_head", "head"):
                    new = VocabParallelLMHead(child, tp, embeds.get(id(child.weight)))
                else:
                    continue
                new.tp_sharded = True
                setattr(parent, name, new)
    for module in list(model.modules()):
        if getattr(module, "tp_sharded", False):
            continue
        if isinstance(module, Attention):
            _shard_attention(module, tp)
        elif isinstance(module, MLP):
            _shard_mlp(module, tp)
        elif isinstance(module, (StackedExperts, Mxfp4Experts)):
            _shard_experts(module, tp)
        elif isinstance(module, MLAAttention):
            _shard_mla(module, tp)
        elif isinstance(module, SparseMoE):
            module.tp = tp
        module.tp_sharded = True
    first: dict[int, nn.Parameter] = {}
    for m in model.modules():
        for n, p in list(m._parameters.items()):
            key = tied.get((id(m), n))
            if p is not None and key is not None:
                m._parameters[n] = first.setdefault(key, p)
    _materialize_(model, tp.device)
    for m in model.modules():
        # Shared experts add to the routed experts' partial sums: one all-reduce for both.
        if isinstance(m, SparseMoE) and m.shared_experts is not None:
            m.shared_experts.tp = None
