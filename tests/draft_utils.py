"""Recording the drafts an engine proposes, step by step."""

from __future__ import annotations

from specserve import LLM, SamplingParams


def drafts_per_step(
    llm: LLM, prompts: list[list[int]], sp: SamplingParams
) -> list[tuple[list[int], list[int]]]:
    """Run to completion; after every step record, per running request, (its tokens so far, the
    K drafts it holds in the token buffer for the next step)."""
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
                seen.append((list(r.all_token_ids), tok[r.row, n : n + k].tolist()))
    return seen
