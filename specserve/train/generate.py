"""Offline generation through the engine for the trainer's measurements (the `LLM` API lives
above this layer, in entrypoints)."""

from __future__ import annotations

import itertools
from typing import Any

from specserve.engine.engine import LLMEngine
from specserve.outputs import RequestOutput
from specserve.sampling_params import SamplingParams

_batches = itertools.count()


def generate(
    engine: LLMEngine, prompts: list[Any], params: list[SamplingParams]
) -> list[RequestOutput]:
    """Each prompt's final output, in prompt order; `params` is one for all or one per prompt."""
    if len(params) == 1:
        params = params * len(prompts)
    if len(params) != len(prompts):
        raise ValueError("params must be one SamplingParams or one per prompt")
    batch = next(_batches)
    ids = [f"train-{batch}-{i}" for i in range(len(prompts))]
    for rid, prompt, sp in zip(ids, prompts, params):
        engine.add_request(rid, prompt, sp)
    done = engine.run_to_completion()
    return [done[rid] for rid in ids]
