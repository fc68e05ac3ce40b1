"""Evaluating a family's target and drafters through the engine.

Greedy generation with speculation gives each drafter's mean acceptance length; completing code
prompts (signature + docstring) into functions that `ast` parses measures how plausible the
target's Python is (`fraction_parsing`).
"""

from __future__ import annotations

import ast
import gc
import time
from typing import Any

import torch

from specserve.config import EngineConfig
from specserve.engine.engine import LLMEngine
from specserve.sampling_params import SamplingParams
from specserve.train.generate import generate

__all__ = [
    "complete_function",
    "evaluate_acceptance",
    "fraction_parsing",
    "free_memory",
    "parses",
    "spec_config_for",
]


def complete_function(prompt: str, completion: str) -> str | None:
    """The function a completion finishes: prompt + completion up to the first line back at the
    `def`'s indentation (the function ended) or, when generation stopped inside the body, up to its
    last whole line. None when the completion adds no body line."""
    lines = (prompt + completion).split("\n")
    n_prompt = prompt.count("\n") + 1
    body: list[str] = []
    ended = False
    for line in lines[n_prompt:]:
        if line.strip() and not line.startswith((" ", "\t")):
            ended = True
            break
        body.append(line)
    if not ended and len(body) > 1:
        body = body[:-1]  # the last line may have been cut mid-statement
    if not any(line.strip() for line in body):
        return None
    return "\n".join(lines[:n_prompt] + body)


def parses(source: str | None) -> bool:
    if source is None:
        return False
    try:
        ast.parse(source)
    except (SyntaxError, ValueError):
        return False
    return True


def fraction_parsing(engine: LLMEngine, prompts: list[str], max_tokens: int = 128) -> float:
    """Share of greedy completions of code prompts (signature + docstring) that finish into a
    function `ast` parses: plausibility of the target's Python."""
    if not prompts:
        raise ValueError("fraction_parsing needs at least one prompt")
    outs = generate(engine, prompts, [SamplingParams(temperature=0.0, max_tokens=max_tokens)])
    ok = [parses(complete_function(p, o.outputs[0].text)) for p, o in zip(prompts, outs)]
    return sum(ok) / len(ok)


def spec_config_for(method: str, drafter_dir: str | None, k: int) -> dict[str, Any]:
    """The drafter at a fixed K: acceptance is measured at K (the adaptive budget would vary
    it with step timings)."""
    fixed = {"num_speculative_tokens": k, "adaptive": False}
    if method == "ngram":
        return {"method": "ngram", **fixed}
    from specserve.train.drafter import method_class

    return {**method_class(method).spec_config(drafter_dir), **fixed}


def evaluate_acceptance(
    target: str,
    spec_config: dict[str, Any],
    prompts: list[str],
    max_tokens: int,
    device: str,
    parse_prompts: list[str] | None = None,
) -> dict[str, Any]:
    """Greedy generation of every prompt with speculation: the mean acceptance length (and, when
    `parse_prompts` is given, `fraction_parsing` of the same engine)."""
    engine = LLMEngine(
        EngineConfig(
            target,
            device=device,
            speculative_config=spec_config,
            max_num_seqs=min(64, len(prompts)),
            max_model_len=1024,
            # A fixed KV budget (plenty for these prompts) rather than most of the GPU's memory.
            kv_cache_memory=(2 << 30) if device.startswith("cuda") else None,
        )
    )
    t0 = time.perf_counter()
    outs = generate(engine, prompts, [SamplingParams(temperature=0.0, max_tokens=max_tokens)])
    seconds = time.perf_counter() - t0
    m = engine.metrics_snapshot()
    res = {
        "acceptance_length": round(float(m["spec_decode_mean_acceptance_length"]), 4),
        "acceptance_rate": round(float(m.get("spec_decode_acceptance_rate", float("nan"))), 4),
        "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
        "seconds": round(seconds, 2),
    }
    if parse_prompts:
        res["fraction_parsing"] = round(fraction_parsing(engine, parse_prompts, max_tokens), 4)
    del engine, outs
    free_memory(device)
    return res


def free_memory(device: str) -> None:
    """Drop a finished model's memory before the next one starts (engines hold reference
    cycles, so refcounting alone leaves their KV cache allocated)."""
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
