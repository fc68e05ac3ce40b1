"""Token ids in, what the client sees out: text, stop strings, the token ids up to the stop point.

The engine (model steps, on the engine thread) decides only what token ids tell: EOS,
`stop_token_ids`, `max_tokens`, a grammar's end. Everything that needs the tokenizer happens here,
as in vLLM's OutputProcessor:

    engine thread:  RequestOutput(delta_token_ids, finish by ids)  --> RequestState.process
    serving side:   incremental detokenization, stop strings, truncation at the stop point

A stop string can end a request the engine still runs. `process` then cuts the step's token ids
(and logprobs) after the token that completed it, reports `finish_reason "stop"` with the stop
string as `stop_reason`, and sets `needs_abort`: the caller aborts the request in the engine
through its ordinary abort path. Outputs the engine made before it saw the abort are dropped
(`process` returns None). Usage counts the returned tokens: those through the stop point.

Two callers, one implementation:
- `AsyncLLMEngine` (the server) runs it on the request's event loop, so the engine thread never
  decodes: per-step detokenization of a large batch no longer lengthens every step.
- `LLMEngine` used offline (`LLM.generate`) runs it inline in `_append`, right after the step:
  there is no other thread to hand the work to, and a stop string then ends the request before
  the next step is scheduled (no wasted step). The outputs are the same either way.
"""

from __future__ import annotations

from typing import Any

from specserve.engine.detokenizer import IncrementalDetokenizer
from specserve.outputs import RequestOutput
from specserve.sampling_params import SamplingParams


class RequestState:
    """One request's output as the client sees it: token ids, logprobs and text."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.detokenizer: IncrementalDetokenizer | None = None
        if tokenizer is not None:
            self.detokenizer = IncrementalDetokenizer(
                tokenizer,
                prompt_token_ids,
                params.skip_special_tokens,
                params.stop_strings,
                params.include_stop_str_in_output,
                params.min_tokens,
            )
        # Our own lists: the engine's grow on another thread (and past a stop point).
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, float]] | None = [] if params.logprobs is not None else None
        self.finished = False
        # Set by `process` when a stop string ended a request the engine has not finished.
        self.needs_abort = False

    def process(self, out: RequestOutput) -> RequestOutput | None:
        """Add text to one engine output (in place) and apply stop strings; None when the
        request already ended here (the engine had not yet seen the abort)."""
        if self.finished:
            return None
        comp = out.outputs[0]
        ids, lps = out.delta_token_ids, out.delta_logprobs
        finish, stop_reason = comp.finish_reason, comp.stop_reason
        det = self.detokenizer
        delta_text = ""
        if det is not None:
            # A token that ends the request by itself (EOS, a grammar's end) is not shown.
            hide_last = finish == "stop" and stop_reason is None and len(ids) > 0
            stop = det.update(ids[:-1] if hide_last else ids)
            if stop is not None:
                if det.num_ids_used < len(ids):
                    ids = ids[: det.num_ids_used]
                    lps = lps[: det.num_ids_used] if lps is not None else None
                self.needs_abort = finish is None
                finish, stop_reason = "stop", stop
            elif finish is not None:
                det.flush()
            delta_text = det.get_delta()
        self.token_ids += ids
        if self.logprobs is not None and lps:
            self.logprobs += lps
        self.finished = finish is not None
        comp.text = det.output_text if det is not None else ""
        comp.token_ids = self.token_ids
        comp.logprobs = self.logprobs
        comp.finish_reason, comp.stop_reason = finish, stop_reason
        out.finished = self.finished
        out.delta_text, out.delta_token_ids, out.delta_logprobs = delta_text, ids, lps
        return out


__all__ = ["RequestState"]
