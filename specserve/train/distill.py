"""Self-distillation data: a target's own chat replies, for training its drafter.

A drafter is judged by how often it guesses the target's next token, so the best training text
is what the target itself writes. `distill` runs the prompts through the engine as chat turns
(the target's chat template) and returns prompt + reply token ids, ready for `train_drafter`.
One greedy reply per prompt (what greedy serving will ask the head to predict) and, for
variety, `sampled` more at `temperature`, each seeded.
"""

from __future__ import annotations

from typing import Any

from specserve.sampling_params import SamplingParams


def chat_prompt_ids(tokenizer: Any, prompts: list[str]) -> list[list[int]]:
    """Each prompt as one user turn in the tokenizer's chat template, ready for a reply."""
    return [
        list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": p}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            )
        )
        for p in prompts
    ]


def distill(
    target_dir: str,
    prompts: list[str],
    *,
    max_tokens: int = 256,
    sampled: int = 1,
    temperature: float = 0.8,
    seed: int = 0,
    **engine_kwargs: Any,
) -> tuple[list[list[int]], dict[str, float]]:
    """(documents: prompt + reply token ids, stats). engine_kwargs go to `EngineConfig` (device,
    dtype, max_num_seqs, ...)."""
    from specserve.config import EngineConfig
    from specserve.engine.engine import LLMEngine
    from specserve.train.generate import generate

    engine = LLMEngine(EngineConfig(target_dir, seed=seed, **engine_kwargs))
    tok = engine.tokenizer
    ids = chat_prompt_ids(tok, prompts)
    reqs: list[dict[str, list[int]]] = []
    params: list[SamplingParams] = []
    for i, p in enumerate(ids):
        reqs.append({"prompt_token_ids": p})
        params.append(SamplingParams(temperature=0.0, max_tokens=max_tokens))
        for j in range(sampled):
            reqs.append({"prompt_token_ids": p})
            params.append(
                SamplingParams(
                    temperature=temperature, max_tokens=max_tokens, seed=seed + i * 1000 + j
                )
            )
    outs = generate(engine, reqs, params)
    docs = []
    reply_tokens = finished = 0
    for req, out in zip(reqs, outs):
        reply = list(out.outputs[0].token_ids)
        docs.append(req["prompt_token_ids"] + reply)
        reply_tokens += len(reply)
        finished += out.outputs[0].finish_reason == "stop"
    stats = {
        "documents": float(len(docs)),
        "reply_tokens": float(reply_tokens),
        "finished_fraction": finished / max(len(docs), 1),
    }
    del engine
    return docs, stats
