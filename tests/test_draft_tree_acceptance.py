"""The default model's own EAGLE-3 head drafting trees on held-out chat prompts: an EAGLE-2
tree of topk 4, depth 4 and 16 verified nodes accepts at least 1.2x the tokens per verification
of the K = 4 chain, with identical (greedy) output."""

from __future__ import annotations

import pytest

from specserve import LLM, SamplingParams
from specserve.data import default_model, load_prompts
from specserve.models.gguf import resolve_gguf
from specserve.train.distill import chat_prompt_ids

NUM_PROMPTS = 6
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def chat() -> list[list[int]]:
    from transformers import AutoTokenizer

    gguf, _ = default_model()
    tok = AutoTokenizer.from_pretrained(resolve_gguf(gguf))
    return chat_prompt_ids(tok, [r["prompt"] for r in load_prompts("chat", NUM_PROMPTS)])


def _run(chat: list[list[int]], tree: dict) -> tuple[float, list[list[int]]]:
    gguf, eagle3 = default_model()
    spec = {**eagle3, "adaptive": False, **tree}
    llm = LLM(gguf, max_model_len=512, max_num_seqs=NUM_PROMPTS, speculative_config=spec)
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    outs = llm.generate([{"prompt_token_ids": p} for p in chat], sp, use_tqdm=False)
    m = llm.get_metrics()
    return m["spec_decode_mean_acceptance_length"], [list(o.outputs[0].token_ids) for o in outs]


def test_tree_accepts_more_than_chain(chat: list[list[int]]) -> None:
    chain, chain_out = _run(chat, {"num_speculative_tokens": 4})
    tree, tree_out = _run(
        chat, {"num_speculative_tokens": 16, "draft_tree": {"topk": 4, "depth": 4}}
    )
    print(
        f"\nheld-out chat, {NUM_PROMPTS} prompts: acceptance length chain K=4 {chain:.3f}, "
        f"tree topk 4 depth 4 16 nodes {tree:.3f} ({tree / chain:.2f}x)"
    )
    assert tree_out == chain_out
    assert tree >= 1.2 * chain
