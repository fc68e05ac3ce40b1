"""Recording the drafts an engine proposes, step by step, and transformers' MTP drafts."""

from __future__ import annotations

from typing import Any

import torch

from specserve import LLM, SamplingParams


def drafts_per_step(
    llm: LLM, prompts: list[list[int]], sp: SamplingParams, with_parents: bool = False
) -> list[tuple]:
    """Run to completion; after every step record, per running request, (its tokens so far, the
    K drafts it holds in the token buffer for the next step[, with_parents: its draft tree's
    parents])."""
    eng = llm.engine
    k = eng.num_spec_tokens
    for i, p in enumerate(prompts):
        eng.add_request(f"d{i}", {"prompt_token_ids": p}, sp)
    seen = []
    while eng.has_unfinished_requests():
        eng.step()
        tok = eng.runner.states.token_ids
        for r in sorted(eng.requests.values(), key=lambda r: r.request_id):
            n = len(r.all_token_ids)
            if r.row >= 0 and not r.is_finished() and r.num_computed_tokens == n - 1:
                row = (list(r.all_token_ids), tok[r.row, n : n + k].tolist())
                if with_parents:
                    row += (eng.runner.tree.state.parent[r.row].tolist(),)
                seen.append(row)
    return seen


def transformers_mtp_drafts(
    path: str, prompts: list[list[int]], max_new_tokens: int, monkeypatch: Any
) -> tuple[list[list[int]], dict[tuple[int, ...], list[int]]]:
    """transformers' greedy outputs with the checkpoint's MTP layer drafting
    (`generate(use_mtp=True)`, batch 1), and the drafts its MTP candidate generator proposed,
    keyed by the context they extend."""
    import transformers as tf
    from transformers.generation import candidate_generator as cg

    from .conftest import hf_generate

    theirs: dict[tuple[int, ...], list[int]] = {}
    original = cg.MTPCandidateGenerator.get_candidates

    def recording(self, input_ids, *args, **kwargs):  # records, then returns unchanged
        ids, logits = original(self, input_ids, *args, **kwargs)
        theirs[tuple(input_ids[0].tolist())] = ids[0, input_ids.shape[1] :].tolist()
        return ids, logits

    monkeypatch.setattr(cg.MTPCandidateGenerator, "get_candidates", recording)
    hf = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    # transformers finds MTP tensors by the real checkpoints' layer numbers (GLM's 46 / 92,
    # DeepSeek-V3's 61); point it at the tiny model's MTP layer.
    n = hf.config.num_hidden_layers
    monkeypatch.setattr(hf, "_keys_to_ignore_on_load_unexpected", [rf"model\.layers\.{n}\..*"])
    outs = [hf_generate(hf, p, max_new_tokens, use_mtp=True) for p in prompts]
    return outs, theirs


def assert_same_drafts(
    ours: list[tuple[list[int], list[int]]], theirs: dict[tuple[int, ...], list[int]]
) -> None:
    """Our drafts (drafts_per_step) equal transformers' wherever both drafted from the same
    context, and that is nearly every step."""
    common = [(tuple(ctx), d) for ctx, d in ours if tuple(ctx) in theirs]
    assert len(common) >= len(ours) - 1 and len(common) > 10
    assert all(theirs[ctx] == d for ctx, d in common)
