"""specserve: a speculative-decoding-first LLM inference and serving engine."""

from __future__ import annotations

from typing import Any

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # Lazy: `import specserve.models` should not pull in the engine, server or sampler.
    if name == "LLM":
        from specserve.entrypoints.llm import LLM

        return LLM
    if name == "SamplingParams":
        from specserve.sampling_params import SamplingParams

        return SamplingParams
    if name == "StructuredOutputsParams":
        from specserve.sampling_params import StructuredOutputsParams

        return StructuredOutputsParams
    if name in ("RequestOutput", "CompletionOutput"):
        from specserve import outputs

        return getattr(outputs, name)
    raise AttributeError(name)
