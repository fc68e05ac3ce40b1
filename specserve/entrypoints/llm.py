"""Offline API: `LLM(model=DIR, ...).generate(prompts, sampling_params)`, vLLM-style."""

from __future__ import annotations

from typing import Any

from specserve.config import EngineConfig
from specserve.engine.engine import LLMEngine
from specserve.outputs import RequestOutput
from specserve.sampling_params import SamplingParams

PromptType = str | dict[str, Any] | list[int]


class LLM:
    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        """`model`: a local Hugging Face directory or .gguf file; None: the default model
        (SmolLM2-135M-Instruct) with its EAGLE-3 head, as `specserve generate` runs it, unless
        `speculative_config` is given (None turns speculation off)."""
        unknown = set(kwargs) - set(EngineConfig.field_names())
        if unknown:
            raise TypeError(f"LLM() got unknown argument(s): {', '.join(sorted(unknown))}")
        if model is None:
            from specserve.data import default_model

            model, spec = default_model()
            kwargs.setdefault("speculative_config", spec)
        self.config = EngineConfig(model=model, **kwargs)
        self.engine = LLMEngine(self.config)
        self._counter = 0

    def shutdown(self) -> None:
        """Free the engine's CUDA graphs and KV cache now (also on `with LLM(...) as llm:`
        exit). Not needed before `del llm`: nothing keeps an LLM's engine alive in a cycle, so
        its GPU memory returns at once (then torch.cuda.empty_cache() hands it to the driver)."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | list[PromptType],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError("sampling_params must be one SamplingParams or one per prompt")
        order: list[tuple[str, int]] = []
        # Validate and add every prompt first: a bad prompt fails before any work starts.
        for prompt, sp in zip(prompts, params):
            base = str(self._counter)
            self._counter += 1
            for i in range(sp.n):
                child = sp if sp.n == 1 else _child_params(sp, i)
                self.engine.add_request(f"{base}-{i}", prompt, child)
                order.append((base, i))
        finished = self._run(len(order), use_tqdm)
        outs: list[RequestOutput] = []
        for base, i in order:
            r = finished[f"{base}-{i}"]
            if i == 0:
                r.request_id = base
                outs.append(r)
            else:
                r.outputs[0].index = i
                outs[-1].outputs.append(r.outputs[0])
        return outs

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        reasoning_effort: str | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, each rendered by the model's
        chat template with the generation prompt. `chat_template_kwargs` (vLLM's) and
        `reasoning_effort` (gpt-oss's harmony template) reach the template as the server passes
        them; a ValueError where the template does not read one (it would have no effect)."""
        from specserve.entrypoints.openai.chat_template import template_kwargs, template_variables
        from specserve.entrypoints.openai.protocol import APIError

        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.engine.tokenizer
        if tok is None:
            raise ValueError("this model has no tokenizer, so chat is not available")
        extra: dict[str, Any] = {}
        if chat_template_kwargs or reasoning_effort is not None:
            try:
                extra = template_kwargs(
                    template_variables(tok), reasoning_effort, chat_template_kwargs
                )
            except APIError as e:
                raise ValueError(e.message) from None
        prompts = [
            {
                "prompt_token_ids": tok.apply_chat_template(
                    c, add_generation_prompt=True, tokenize=True, return_dict=False, **extra
                )
            }
            for c in convs
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def get_metrics(self) -> dict[str, Any]:
        return self.engine.metrics_snapshot()

    def _run(self, total: int, use_tqdm: bool) -> dict[str, RequestOutput]:
        bar = None
        if use_tqdm and total >= 8:
            from tqdm import tqdm

            bar = tqdm(total=total, desc="Processed prompts", dynamic_ncols=True)
        finished = self.engine.run_to_completion(None if bar is None else lambda _: bar.update(1))
        if bar is not None:
            bar.close()
        return finished


def _child_params(sp: SamplingParams, i: int) -> SamplingParams:
    from dataclasses import replace

    seed = None if sp.seed is None else sp.seed + i
    return replace(sp, n=1, seed=seed)
