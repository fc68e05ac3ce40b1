"""The runner's part of a draft-tree step (spec_decode/tree.py has the trees themselves).

forward    the target runs with the tree's rotary positions and ancestor masks
           (CommonAttentionMetadata's tree fields): a CUDA graph replay with them copied into
           its buffers (worker/cudagraph.py), or eagerly
verify     `sample/tree_verify.py` walks each tree -> chain-layout tokens + accepted path
KV move    the accepted nodes' target KV is copied into the chain slots root + 1.. root + n
           (one gather and one scatter over every target layer at once, B * K rows a layer;
           rejected nodes' slots hold stale KV past what the request has computed, rewritten
           by later steps)
propose    the drafter's prefill sees the accepted path as a chain: hidden states gathered
           into chain order, causal metadata at chain positions
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from specserve.attention.backend import AttentionBackend, CommonAttentionMetadata
from specserve.sample.sampler import SamplingTensors
from specserve.sample.tree_verify import tree_verify
from specserve.spec_decode.tree import TreeDrafter, target_tree_metadata
from specserve.step_inputs import StepInputs

if TYPE_CHECKING:
    from specserve.worker.model_runner import ModelRunner


@dataclasses.dataclass
class TreeFields:
    # [T] int64 each: rotary positions, tree start, ancestor bitmask (attention/backend.py)
    rope_positions: Tensor
    tree_start: Tensor
    tree_mask: Tensor


def check_tree_support(backend: AttentionBackend, windows: set[int | None], k: int) -> None:
    """Refuse what cannot run a tree: a backend without tree masks, windows a tree could
    outgrow (tree keys skip the window test)."""
    if not backend.supports_tree:
        raise ValueError(
            f"attention_backend {backend.name!r} has no tree attention; draft trees need the "
            "torch or triton backend, or no speculative_config draft_tree."
        )
    short = [w for w in windows if w is not None and w <= k + 1]
    if short:
        raise ValueError(
            f"a sliding window of {min(short)} tokens is not longer than a draft tree of "
            f"{k} nodes can be deep; lower num_speculative_tokens below {min(short) - 1}."
        )


def tree_fields(tree: TreeDrafter | None, inp: StepInputs) -> TreeFields | None:
    """The step's tree metadata, or None when no request verifies a tree this step."""
    if tree is None or not inp.num_draft_np.any():
        return None
    return TreeFields(*target_tree_metadata(tree.state, inp))


def with_tree(common: CommonAttentionMetadata, tf: TreeFields | None) -> CommonAttentionMetadata:
    if tf is None:
        return common
    return dataclasses.replace(
        common,
        tree_start=tf.tree_start,
        tree_mask=tf.tree_mask,
        tree_positions=tf.rope_positions,
    )


def chain_metadata(common: CommonAttentionMetadata) -> CommonAttentionMetadata:
    """The same batch as a plain causal chain (the draft prefill over accepted paths)."""
    return dataclasses.replace(common, tree_start=None, tree_mask=None, tree_positions=None)


def verify_tree(
    runner: ModelRunner,
    inp: StepInputs,
    # [B, K + 1, V] float32 target logits at the nodes
    target_logits: Tensor,
    st: SamplingTensors | None,
    method: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """-> (out_tokens [B, K + 1], num_accepted [B], path [B, K + 1])."""
    tree = runner.speculator.tree
    k = runner.num_spec_tokens
    rows = inp.idx_mapping
    cols = inp.out_pos0[:, None] + torch.arange(k, device=rows.device)
    draft_tokens = runner.states.token_ids[rows[:, None], cols]
    return tree_verify(
        target_logits, draft_tokens, tree.state.parent[rows], tree.state.depth[rows],
        inp.num_draft, st, inp.out_pos0, tree.max_depth, method,
    )  # fmt: skip


def move_accepted_kv(
    # one cache a layer, or the runner's `target_kv` ([layers, *one layer's shape]) alone
    kv_caches: list[Tensor],
    # [T] int64 the step's slot mapping
    slot_mapping: Tensor,
    # [T] from chain_order
    perm: Tensor,
) -> None:
    """Copy each accepted node's target KV into its chain slot (identity elsewhere): one
    gather and one scatter a tensor (the gather copies first, so a slot that is both a source
    and a destination is read before it is written)."""
    src, dst = slot_mapping[perm], slot_mapping
    for cache in kv_caches:
        if cache.dim() in (5, 6):  # [(layers,) 2, blocks, block_size, heads, dim]
            flat = cache.view(*cache.shape[:-4], -1, *cache.shape[-2:])
            flat[..., dst, :, :] = flat[..., src, :, :]
        else:  # MLA: [(layers,) blocks, block_size, width]
            flat = cache.view(*cache.shape[:-3], -1, cache.shape[-1])
            flat[..., dst, :] = flat[..., src, :]
