"""LLMEngine: requests in, RequestOutputs out; one `step()` = schedule -> execute -> update."""

from __future__ import annotations

import functools
import json
import logging
import os
import time
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from typing import Any

import numpy as np
import torch

from specserve.config import EngineConfig
from specserve.distributed import TensorParallel
from specserve.engine.kv_cache import KVCacheManager
from specserve.engine.output_processor import RequestState
from specserve.engine.scheduler import Scheduler
from specserve.engine.tp_executor import TPExecutor, start_tensor_parallel, stop_workers
from specserve.metrics.stats import EngineStats
from specserve.models.gguf import resolve_gguf
from specserve.models.registry import load_model
from specserve.outputs import CompletionOutput, RequestOutput
from specserve.request import Request, RequestStatus
from specserve.sampling_params import SamplingParams
from specserve.scheduler_output import SchedulerOutput
from specserve.spec_decode.dynamic import DraftBudget
from specserve.spec_decode.interface import NO_DRAFTER
from specserve.spec_decode.speculator import build_speculator
from specserve.structured.grammar import StructuredOutputs
from specserve.worker.model_runner import ModelRunner
from specserve.worker.step_results import PendingStep, StepOutput

logger = logging.getLogger("specserve")


class PromptTooLongError(ValueError):
    pass


def _load_tokenizer(path: str) -> Any:
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not any(os.path.exists(os.path.join(path, n)) for n in names):
        logger.warning("%s has no tokenizer files: only token-id prompts will work", path)
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _eos_ids(model_dir: str, cfg: dict[str, Any], tokenizer: Any) -> set[int]:
    ids: set[int] = set()

    def add(v: Any) -> None:
        if isinstance(v, int):
            ids.add(v)
        elif isinstance(v, list):
            ids.update(int(x) for x in v)

    add(cfg.get("eos_token_id"))
    gen = os.path.join(model_dir, "generation_config.json")
    if os.path.isfile(gen):
        with open(gen) as f:
            add(json.load(f).get("eos_token_id"))
    if tokenizer is not None:
        add(tokenizer.eos_token_id)
    return ids


class LLMEngine:
    def __init__(self, config: EngineConfig, tp: TensorParallel | None = None) -> None:
        """`tp`: this process is a tensor-parallel worker rank of that group (it builds the
        same engine over its shards and runs the steps rank 0 sends: engine/tp_executor.py).
        With tensor_parallel_size > 1 and no `tp`, this engine is rank 0 and starts the
        workers."""
        self.config = config
        config.check_device_available()
        if config.model.endswith(".gguf"):
            config.model = resolve_gguf(config.model)
        self._tp_procs: list[Any] | None = None
        if tp is None and config.tensor_parallel_size > 1:
            tp, self._tp_procs = start_tensor_parallel(config)
        self.tp = tp
        try:
            self._init(config, tp)
        except BaseException:
            if self._tp_procs:
                stop_workers(self._tp_procs, timeout=0.1)
            raise

    def _init(self, config: EngineConfig, tp: TensorParallel | None) -> None:
        device, dtype = config.torch_device, config.torch_dtype
        from specserve.models.loader import read_config

        # Before the tokenizer, which would read config.json too and fail with a traceback.
        raw_cfg = read_config(config.model)
        self.tokenizer = _load_tokenizer(config.tokenizer or config.model)
        spec = config.spec
        self.num_spec_tokens = spec.num_speculative_tokens if spec else 0
        max_pos = raw_cfg.get("max_position_embeddings", 4096)
        self.max_model_len = config.max_model_len or max_pos
        rope_len = max(self.max_model_len, max_pos) + self.num_spec_tokens + 2
        self.model, self.hf_config = load_model(
            config.model,
            dtype,
            device,
            rope_len,
            config.load_format,
            config.mxfp4_experts,
            config.fp8_weights,
            tp,
        )
        self.eos_token_ids = _eos_ids(config.model, self.hf_config, self.tokenizer)
        # Structured outputs: xgrammar objects are built at the first request that has one.
        self.structured = StructuredOutputs(
            self.tokenizer, self.hf_config["vocab_size"], self.eos_token_ids
        )
        self.speculator = (
            build_speculator(
                spec, self.model, config.model, rope_len, dtype, device, config.load_format, tp
            )
            if spec is not None
            else None
        )
        from specserve.worker.warmup import engine_startup

        # Its Triton compiles (plan timing, graph capture, warm-up) are start-up, not the
        # serving stalls warmup.watch_late_compiles reports (an engine built after another).
        with engine_startup():
            num_blocks = self._prepare_device(config, device)
        if self._tp_procs is not None:  # rank 0: each step goes to the workers first
            self.runner = TPExecutor(self.runner, tp, self._tp_procs)
        self.kv = KVCacheManager(
            num_blocks,
            config.block_size,
            self.max_model_len,
            config.enable_prefix_caching,
            lookahead=self.speculator.kv_lookahead if self.speculator is not None else 0,
            # Whatever else the KV depends on: the target, the drafter, the KV dtype.
            salt=(config.model, repr(spec), str(dtype), str(config.kv_cache_torch_dtype)),
        )
        self.scheduler = Scheduler(
            self.kv,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            self.max_model_len,
            config.enable_chunked_prefill,
            num_lookahead_tokens=self.num_spec_tokens,
        )
        self.requests: dict[str, Request] = {}
        self.stats = EngineStats(self.num_spec_tokens)
        # The adaptive draft budget (spec_decode/dynamic.py), on unless the config fixes K.
        self.budget: DraftBudget | None = None
        if spec is not None and spec.adaptive_budget:
            self.budget = DraftBudget(self.num_spec_tokens)
        # Drafts the last launched step proposed: what the next step may verify.
        self._draft_cap = self.num_spec_tokens
        # What the budget needs of each launched step: (decode batch, k verified and proposed,
        # whether a k = 0 step ran the draft prefill), None for a step that says nothing about
        # the cost of k; and when the last step ended.
        self._launched: dict[int, tuple[int, int, bool] | None] = {}
        self._last_finish: float | None = None
        # Async scheduling: the launched step whose results the host has not read yet.
        self._inflight: tuple[SchedulerOutput, PendingStep] | None = None
        self._rng = np.random.default_rng(config.seed)
        self._last_log = time.monotonic()
        # Outputs of requests the scheduler ended (they can never fit), for the next step().
        self._ended: list[RequestOutput] = []
        # Whether the last step found nothing to run (the engine loop then waits for commands).
        self.last_step_idle = False
        # Text and stop strings in `step()` (offline use). AsyncLLMEngine turns this off and
        # does that work on the serving side: outputs then carry token ids only
        # (output_processor.py).
        self.detokenize = True

    # ---- sizing --------------------------------------------------------------------------
    def _num_kv_blocks(self) -> int:
        c = self.config
        from specserve.models.layers import KVCacheLayer

        layers = [m for m in self.model.modules() if isinstance(m, KVCacheLayer)]
        if self.speculator is not None and self.speculator.model is not None:
            layers += [m for m in self.speculator.model.modules() if isinstance(m, KVCacheLayer)]
        # The KV dtype's element size: an fp8 cache holds twice bf16's blocks.
        per_block = ModelRunner.kv_bytes_per_block(layers, c.block_size, c.kv_cache_torch_dtype)
        if c.num_gpu_blocks_override is not None:
            return c.num_gpu_blocks_override
        if c.kv_cache_memory is not None:
            return max(1, c.kv_cache_memory // per_block)
        full = c.max_num_seqs * ((self.max_model_len + c.block_size - 1) // c.block_size)
        if c.torch_device.type == "cuda":
            free, total = torch.cuda.mem_get_info()
            # Headroom for activations and logits of the largest step.
            reserve = (1 - c.gpu_memory_utilization) * total + (1 << 30)
            reserve += 4 * c.max_num_batched_tokens * self.hf_config["vocab_size"] * 4
            budget = int(free - reserve)
            if budget < per_block:
                raise RuntimeError(
                    "no GPU memory left for the KV cache; lower max_num_seqs or "
                    "raise gpu_memory_utilization"
                )
            return min(budget // per_block, full)
        return max(1, min(full, (1 << 30) // per_block))

    def _fit_max_model_len(self, num_blocks: int) -> None:
        """A cache too small for one full-length sequence would admit requests that can never
        finish: clamp max_model_len to it (vLLM refuses to start instead) and say so."""
        cap = num_blocks * self.config.block_size
        if self.max_model_len > cap:
            logger.warning(
                "the KV cache holds %d tokens (%d blocks of %d), fewer than max_model_len %d: "
                "max_model_len is clamped to %d. Give the KV cache more memory "
                "(gpu_memory_utilization, kv_cache_memory, num_gpu_blocks_override) or pass a "
                "smaller max_model_len to silence this.",
                cap,
                num_blocks,
                self.config.block_size,
                self.max_model_len,
                cap,
            )
            self.max_model_len = cap

    def _prepare_device(self, config: EngineConfig, device: torch.device) -> int:
        """The decode-matmul plan, the KV pool's size, the runner (CUDA graphs) and the warm-up;
        returns the number of KV blocks."""
        # Decode matmuls (before graph capture): `triton` always, `auto` where timed faster.
        self.decode_matmul_plan: list[dict] = []
        models = [m for m in (self.model, getattr(self.speculator, "model", None)) if m is not None]
        if config.decode_matmul == "triton" and device.type == "cuda":
            from specserve.ops.gemv import use_decode_gemv_

            for m in models:
                use_decode_gemv_(m)
        elif config.decode_matmul == "auto" and device.type == "cuda" and self.tp is None:
            # NOTE: not under tensor parallelism: replicated matmuls (routers, EAGLE's fc)
            # must compute the same bits on every rank, and each rank would time its own plan.
            from specserve.ops.gemv_plan import tune_decode_gemv_

            self.decode_matmul_plan = tune_decode_gemv_(models)
        elif config.decode_matmul != "cublas" and device.type == "cpu":
            # Verification's few rows a request (ops/cpu_linear.py says why).
            from specserve.ops.cpu_linear import use_cpu_linear_

            for m in models:
                use_cpu_linear_(m)
        num_blocks = self._num_kv_blocks()
        if self.tp is not None:  # every rank's pool holds the same blocks
            num_blocks = self.tp.min_int(num_blocks)
        self._fit_max_model_len(num_blocks)
        self.runner = ModelRunner(
            config, self.model, self.max_model_len, num_blocks, self.speculator
        )
        self.runner.eos_token_ids = frozenset(self.eos_token_ids)
        # Every step shape once, before the first request (no compile on the serving path).
        self.warmup_report = None
        if config.warmup:
            from specserve.worker.warmup import warm_up

            self.warmup_report = warm_up(self.runner, config.max_num_batched_tokens)
        if config.calculate_kv_scales and config.kv_cache_dtype != "auto":
            # After the warm-up: the first real prefill sets every layer's fp8 scales.
            self.runner.kv_scales_todo.update(range(len(self.runner.kv_caches)))
        # vLLM's "GPU KV cache size: N tokens".
        logger.info(
            "KV cache size: %d tokens (%d blocks of %d, %s)",
            num_blocks * config.block_size,
            num_blocks,
            config.block_size,
            str(config.kv_cache_torch_dtype).removeprefix("torch."),
        )
        return num_blocks

    # ---- requests ------------------------------------------------------------------------
    def tokenize(
        self, prompt: str | dict[str, Any] | list[int], truncating: bool = False
    ) -> tuple[str | None, list[int]]:
        """`truncating`: the request keeps only its prompt's last tokens
        (truncate_prompt_tokens), so a text too long to fit is tokenized by its tail."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), _integer_ids(prompt["prompt_token_ids"])
            if "prompt" not in prompt:
                raise ValueError("a prompt dict needs 'prompt' (text) or 'prompt_token_ids'")
            prompt = prompt["prompt"]
        if isinstance(prompt, list):
            return None, _integer_ids(prompt)
        if not isinstance(prompt, str):
            raise ValueError(
                "a prompt is a string, a list of token ids or a dict with 'prompt' or "
                f"'prompt_token_ids', got {type(prompt).__name__}"
            )
        if self.tokenizer is None:
            raise ValueError("this model directory has no tokenizer: pass prompt_token_ids")
        if len(prompt) > self.max_prompt_chars and truncating:
            # Twice the characters any max_model_len tokens can span: the tail holds at least
            # 2 * max_model_len tokens, so the kept ones (fewer than max_model_len) lie far from
            # where the cut split a word, and are the full text's last tokens unless one word
            # (no pre-tokenizer split) runs from the cut to them.
            return prompt, self.tokenizer.encode(prompt[-2 * self.max_prompt_chars :])
        if len(prompt) > self.max_prompt_chars:
            # NOTE: tokenizing 4 MB takes ~20 s; a text this long cannot fit, so say so now.
            raise PromptTooLongError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"your prompt has {len(prompt)} characters, more than any prompt of that many "
                f"tokens can hold (at most {self.max_prompt_chars} with this tokenizer). "
                "Please reduce the length of the input messages."
            )
        return prompt, self.tokenizer.encode(prompt)

    @functools.cached_property
    def max_prompt_chars(self) -> int:
        """An upper bound on the characters of a prompt that fits max_model_len: no token
        covers more characters than its vocabulary string has (byte-level BPE and
        SentencePiece alike), doubled for normalizers that merge characters."""
        longest = max((len(t) for t in self.tokenizer.get_vocab()), default=1)
        return 2 * max(longest, 1) * self.max_model_len

    def add_request(
        self,
        request_id: str,
        prompt: str | dict[str, Any] | list[int],
        sampling_params: SamplingParams,
        arrival_time: float | None = None,
        grammar: Any | None = None,
    ) -> Request:
        """`grammar`: the compiled grammar of `sampling_params.structured_outputs`, where the
        caller compiled it off this thread (the server); None compiles it here."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already running")
        text, ids = self.tokenize(prompt, sampling_params.truncate_prompt_tokens is not None)
        if not ids:
            raise ValueError("the prompt is empty")
        keep = sampling_params.truncate_prompt_tokens
        if keep is not None:
            # vLLM's left truncation: the prompt's end is what the next token follows (its text
            # stays the request's own). -1: the longest prompt that leaves room for one token.
            ids = ids[-(self.max_model_len - 1 if keep == -1 else keep) :]
        if len(ids) >= self.max_model_len:
            raise PromptTooLongError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"your request has {len(ids)} input tokens. Please reduce the length of the "
                "input messages."
            )
        c = self.config
        if not c.enable_chunked_prefill and len(ids) > c.max_num_batched_tokens:
            raise PromptTooLongError(
                f"your request has {len(ids)} input tokens, more than max_num_batched_tokens "
                f"{c.max_num_batched_tokens}, and chunked prefill is off: it could never be "
                "scheduled. Please reduce the length of the input."
            )
        vocab = self.hf_config["vocab_size"]
        _check_token_ids("prompt token id", ids, vocab)
        _check_token_ids(
            "stop_token_ids", sampling_params.stop_token_ids, vocab, param="stop_token_ids"
        )
        bad_bias = [t for t in sampling_params.logit_bias or {} if t >= vocab]
        if bad_bias:
            raise RequestFieldError(
                f"logit_bias token ids must be in [0, {vocab}), got {bad_bias[0]}.", "logit_bias"
            )
        _check_logprobs(
            sampling_params, vocab if c.max_logprobs == -1 else min(c.max_logprobs, vocab)
        )
        allowed = sampling_params.allowed_token_ids or []
        _check_token_ids("allowed_token_ids", allowed, vocab, param="allowed_token_ids")
        bad_words = self._bad_words_token_ids(sampling_params.bad_words or [], vocab)
        if c.spec is not None and c.spec.is_tree and sampling_params.uses_logits_processors:
            raise RequestFieldError(
                "logits processors (penalties, logit_bias, min_tokens, allowed_token_ids, "
                "bad_words) are not supported with draft trees; run without speculative_config "
                "draft_tree / speculative_token_tree for this request.",
                "logits_processors",
            )
        seed = sampling_params.seed
        if seed is None:
            seed = int(self._rng.integers(0, 2**62))
        req = Request(request_id, ids, sampling_params, text, seed, arrival_time)
        req.bad_words_token_ids = bad_words
        if self.detokenize:
            req.output_state = RequestState(self.tokenizer, ids, sampling_params)
        if sampling_params.structured_outputs is not None:
            # Compiled here unless given (cached per constraint): a bad schema fails at once.
            req.grammar = self.structured.new_request(sampling_params.structured_outputs, grammar)
        self.requests[request_id] = req
        self.scheduler.add(req)
        self.stats.prompt_tokens += len(ids)
        return req

    def _bad_words_token_ids(self, words: list[str], vocab: int) -> list[list[int]]:
        """vLLM's tokenization of bad words: each as written (leading spaces dropped) and with
        one leading space, the latter only where it is a different word of as many tokens
        (tokenizers that mark a word start encode " word" with another first token)."""
        if not words:
            return []
        if self.tokenizer is None:
            raise RequestFieldError(
                "bad_words needs a tokenizer: this model directory has none", "bad_words"
            )
        out: list[list[int]] = []
        for word in words:
            plain = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            if not plain:
                raise RequestFieldError(
                    f"bad_words entry {word!r} encodes to no tokens", "bad_words"
                )
            out.append(plain)
            if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                out.append(spaced)
        for ids in out:
            _check_token_ids("bad_words token id", ids, vocab, param="bad_words")
        return out

    def close(self) -> None:
        """Free the GPU memory the engine holds beyond its weights (graphs, KV cache, the step
        in flight) now; the engine is unusable afterwards."""
        self._inflight = None
        self.requests.clear()
        self.runner.close()

    def abort_request(self, request_id: str) -> None:
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        req.status = RequestStatus.FINISHED_ABORTED
        self._release(req)

    def _release(self, req: Request) -> None:
        self.scheduler.remove(req)
        self.runner.remove_request(req)
        if self.budget is not None:
            self.budget.forget(req.request_id)

    def run_to_completion(
        self, on_finished: Callable[[RequestOutput], None] | None = None
    ) -> dict[str, RequestOutput]:
        """Step until no request is left (offline use): each request's final output by id."""
        finished: dict[str, RequestOutput] = {}
        while self.has_unfinished_requests():
            for out in self.step():
                if out.finished:
                    finished[out.request_id] = out
                    if on_finished is not None:
                        on_finished(out)
        return finished

    def metrics_snapshot(self) -> dict[str, Any]:
        """The counters of `stats` with the scheduler's and the KV cache's gauges, and the KV
        cache's size (kv_cache_num_blocks, kv_cache_num_tokens)."""
        snap = self.stats.snapshot(
            len(self.scheduler.running),
            len(self.scheduler.waiting),
            self.kv.usage(),
            self.kv.num_queries,
            self.kv.num_hits,
        )
        snap["kv_cache_num_blocks"] = self.kv.pool.num_blocks
        snap["kv_cache_num_tokens"] = self.kv.pool.num_blocks * self.kv.block_size
        return snap

    def _maybe_log(self) -> None:
        kv = self.kv
        prefix = (kv.num_queries, kv.num_hits) if kv.enable_prefix_caching else None
        self.stats.maybe_log(self.config.disable_log_stats, self.config.log_stats_interval, prefix)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # ---- the step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        self.last_step_idle = False
        outputs = self._step_async() if self.config.async_scheduling else self._step_sync()
        if self._ended:
            outputs, self._ended = self._ended + outputs, []
        return outputs

    def _step_sync(self) -> list[RequestOutput]:
        sched = self._schedule(self._spec_budget())
        if sched.is_empty:
            self.last_step_idle = True
            self._last_finish = None
            return []
        out = self.runner.finish(self._launch(sched))
        self._step_finished(sched)
        outputs = self._update(sched, out)
        self._maybe_log()
        return outputs

    def _launch(self, sched: SchedulerOutput) -> PendingStep:
        """Launch a scheduled step; under the adaptive budget it also proposes the number of
        drafts the budget chooses for the next step (which that step may verify)."""
        if self.budget is None:
            return self.runner.launch(sched, self._logprobs(sched), self._spec_budget())
        reqs = self.scheduler.running
        batch = min(len(reqs) + len(self.scheduler.waiting), self.config.max_num_seqs)
        classes = [(r.request_id, r.sampling_params.temperature == 0) for r in reqs]
        p = self.budget.choose(batch, classes)
        # NOTE: read before launch, after which `samples` still describes this step.
        decode = [s for s in sched.scheduled if s.samples and s.num_tokens == 1 + s.num_draft]
        v = {s.num_draft for s in decode}
        steady = len(decode) == len(sched.scheduled) and v == {p}
        self._draft_cap = p
        self.stats.draft_budget = p
        self.stats.mean_draft_budget = self.budget.mean_budget
        propose = p
        # NO_DRAFTER only on pure decode steps: a step with prompt chunks runs the draft
        # prefill (its KV over every prompt stays complete, so a request that arrived while
        # drafting was off drafts from its whole prompt once the budget turns drafting on).
        tracks = self.speculator.tracks_kv_at_zero and self.budget.tracks_drafter_kv
        if p == 0 and not tracks and len(decode) == len(sched.scheduled):
            propose = NO_DRAFTER
        tracked = p == 0 and propose != NO_DRAFTER
        self._launched[id(sched)] = (len(decode), p, tracked) if steady else None
        return self.runner.launch(sched, self._logprobs(sched), propose)

    def _step_finished(self, sched: SchedulerOutput) -> None:
        """A step's results are read: its wall time since the previous step's end is the cost
        of its k (steady decode steps only: k verified and k proposed, no prefill)."""
        now = time.perf_counter()
        shape = self._launched.pop(id(sched), None)
        if self.budget is not None:
            if shape is not None and self._last_finish is not None:
                self.budget.record_step(shape[0], shape[1], now - self._last_finish, shape[2])
            self.budget.tick()
        self._last_finish = now

    def _schedule(self, k: int | None) -> SchedulerOutput:
        sched = self.scheduler.schedule(k)
        for r in sched.preempted:
            self.runner.remove_request(r)
            self.stats.num_preemptions += 1
        for r in sched.ended:  # already out of the scheduler, blocks freed
            self.runner.remove_request(r)
            self.requests.pop(r.request_id, None)
            r.metrics.finished_time = time.time()
            self._ended.append(self._output(r, [], None))
        return sched

    @staticmethod
    def _logprobs(sched: SchedulerOutput) -> list[int]:
        return [
            s.req.sampling_params.logprobs
            for s in sched.scheduled
            if s.req.sampling_params.logprobs is not None
        ]

    def _step_async(self) -> list[RequestOutput]:
        """Async scheduling: while step N runs on the device, schedule and launch step N+1 on
        the assumption that N's requests all continue, then read N's results.

        Step N+1's input tokens are N's outputs, which N writes into the persistent token
        buffer on the device; the host only needs to know how many there are, kept in
        `num_pending_tokens` until N's results are read. Without drafts that is one per
        sampling request. With drafts N accepts an unknown number: N+1 is scheduled (and KV
        allocated) as if N accepted all of them, and the device shifts N+1's positions to the
        true start it recorded (`start_on_device`, `ModelRunner._place_on_device`). A request
        N finishes (EOS, stop string) got a wasted step in N+1, dropped by `_update`. Steps that
        could preempt or run past max_model_len, n-gram drafting and dynamic K are not
        overlapped."""
        if self._inflight is None:
            sched = self._schedule(self._spec_budget())
            if sched.is_empty:
                self.last_step_idle = True
                return []
            self._inflight = (sched, self._launch(sched))
        sched, pending = self._inflight
        nxt = None
        if self._can_overlap(sched):
            saved = [(s.req, s.req.num_computed_tokens) for s in sched.scheduled]
            on_device = self.speculator is not None
            for s in sched.scheduled:
                # What N computes if every draft is accepted: exact without drafts, else the
                # upper bound KV is allocated for (the device places the step exactly).
                s.req.num_computed_tokens = s.end_bound()
                if s.samples:
                    s.req.num_pending_tokens = 1 + s.num_draft
                    s.req.start_on_device = on_device
            # `_can_overlap` leaves room for every running request, so this should preempt
            # nothing; a request it does preempt anyway restarts from its host tokens, and
            # `_update` drops what N computed for it.
            sched2 = self._schedule(self._draft_cap if self.budget is not None else None)
            # (A preempted request may even be scheduled again in sched2, as a new prefill.)
            preempted = {id(r) for r in sched2.preempted}
            if not sched2.is_empty:
                nxt = (sched2, self._launch(sched2))
            for req, computed in saved:  # `_update` records what N really computed
                if id(req) not in preempted:
                    req.num_computed_tokens = computed
                req.num_pending_tokens = 0
                req.start_on_device = False
        else:
            preempted = set()
        out = self.runner.finish(pending)
        self._step_finished(sched)
        outputs = self._update(sched, out, skip=preempted)
        if nxt is not None and all(s.req.is_finished() for s in nxt[0].scheduled):
            self.runner.finish(nxt[1])  # nothing left to read from it
            self._launched.pop(id(nxt[0]), None)
            self._last_finish = None
            nxt = None
        self._inflight = nxt
        self._maybe_log()
        return outputs

    def _can_overlap(self, sched: SchedulerOutput) -> bool:
        if not self.config.async_scheduling:
            return False
        spec = self.speculator
        if spec is not None and (
            spec.proposes_on_host  # n-gram drafts are found in tokens the host has not seen
            # A batch-size map decides K per step, after N. (The adaptive budget decides at
            # each launch the drafts the next step verifies: nothing waits for N.)
            or (self.budget is None and self._spec_budget() is not None)
        ):
            return False
        k1 = self.num_spec_tokens + 1
        for s in sched.scheduled:
            req = s.req
            if req.grammar is not None:
                return False  # its next masks need this step's tokens on the host
            if not s.samples:
                continue
            if spec is None and req.num_output_tokens + 1 >= req.max_tokens:
                return False  # N finishes it by length: N+1 must not schedule it
            # N+1 must stay inside max_model_len even if N and N+1 accept every draft. (With
            # drafts, tokens past max_tokens are dropped by `_append` as in synchronous steps.)
            if req.num_tokens + 3 * k1 >= self.max_model_len:
                return False
        # No preemption while scheduling N+1: room for what every running request can grow by
        # in N+1 (1 + K tokens past N's upper bound when decoding; the prefilling ones share
        # one token budget). Waiting requests need none: new work never preempts running work,
        # it waits for blocks. (A reserve for them made a KV cache sized to max_num_seqs *
        # max_model_len, the default, never overlap.)
        kv = self.kv
        after = {id(s.req): s.end_bound() for s in sched.scheduled}
        per_decode = kv.blocks_needed(k1 + self.num_spec_tokens) + 1
        room, prefilling = 0, False
        for req in self.scheduler.running:
            done = after.get(id(req), req.num_computed_tokens)
            if req.num_scheduling_tokens - done > 1:
                prefilling = True
            else:
                room += per_decode
        if prefilling:
            room += kv.blocks_needed(self.config.max_num_batched_tokens) + 1
        return kv.pool.num_free > room

    def _spec_budget(self) -> int | None:
        spec = self.config.spec
        if spec is None:
            return None
        n = len(self.scheduler.running) + len(self.scheduler.waiting)
        if self.budget is not None:
            return self._draft_cap  # what the last launched step proposed
        if spec.disable_by_batch_size is not None and n >= spec.disable_by_batch_size:
            return 0
        sched = spec.num_speculative_tokens_per_batch_size
        if isinstance(sched, dict) and sched:
            fits = [k for bs, k in sorted((int(b), int(k)) for b, k in sched.items()) if n <= bs]
            return fits[0] if fits else 0
        return None

    def _update(
        self, sched: SchedulerOutput, out: StepOutput, skip: AbstractSet[int] = frozenset()
    ) -> list[RequestOutput]:
        """Record a step's results. `skip`: ids of requests whose results are void (preempted
        after the step was launched)."""
        outputs = []
        verified: tuple[list[str], list[bool], list[int], list[int]] = ([], [], [], [])
        for i, s in enumerate(sched.scheduled):
            req = s.req
            if req.is_finished() or id(req) in skip:
                continue  # finished, aborted or preempted after this step was launched
            if out.prompt_logprobs is not None and i in out.prompt_logprobs:
                self._add_prompt_logprobs(req, *out.prompt_logprobs[i])
            if not s.samples:
                req.num_computed_tokens = s.start + s.num_tokens
                self.kv.cache_blocks(req)
                continue
            n_acc = int(out.num_accepted[i])
            # A start placed on the device is the one the previous step's `_update` recorded.
            start = req.num_computed_tokens if s.start_on_device else s.start
            req.num_computed_tokens = start + s.num_tokens - s.num_draft + n_acc
            if s.num_draft > 0:
                self.stats.record_draft(req, s.num_draft, n_acc)
                for col, x in zip(
                    verified,
                    (req.request_id, req.sampling_params.temperature == 0, s.num_draft, n_acc),
                ):
                    col.append(x)  # type: ignore[attr-defined]
            new = out.tokens[i, : n_acc + 1].tolist()
            if req.grammar is not None:
                # Rejected drafts leave the matcher, the emitted token enters it (the output
                # ends at an accepted stop token).
                new = new[: req.grammar.commit(new, n_acc)]
                if out.next_drafts is not None:
                    req.grammar.drafts = out.next_drafts[i].tolist()
                if out.next_parents is not None:
                    req.grammar.parents = out.next_parents[i].tolist()
            lps = out.logprobs[i] if out.logprobs is not None else None
            outputs.append(self._append(req, new, lps))
        if self.budget is not None and verified[0]:
            self.budget.record_acceptances(*verified)
            for rid in verified[0]:
                if rid not in self.requests:  # finished in this step
                    self.budget.forget(rid)
        return outputs

    @staticmethod
    def _add_prompt_logprobs(
        req: Request, first: int, lps: list[dict[int, float]], ranks: list[int]
    ) -> None:
        """Keep the part of a step's prompt logprobs that continues what the request has
        (a recompute never adds a token twice)."""
        have = len(req.prompt_logprobs)
        if first <= have < first + len(lps):
            n_top = req.sampling_params.prompt_logprobs or 0
            req.prompt_logprob_ranks += ranks[have - first :]
            for j, d in enumerate(lps[have - first :], start=have):
                tok = req.prompt_token_ids[j]
                top = sorted(((t, v) for t, v in d.items()), key=lambda x: -x[1])[:n_top]
                req.prompt_logprobs.append({**dict(top), tok: d[tok]})

    def _append(
        self, req: Request, new: list[int], lps: list[dict[int, float]] | None
    ) -> RequestOutput:
        sp = req.sampling_params
        added: list[int] = []
        # A grammar that accepted its stop token (the last of `new`) ends the request, even
        # with ignore_eos or before min_tokens: nothing can follow it.
        grammar_done = req.grammar is not None and req.grammar.is_terminated
        for j, tok in enumerate(new):
            req.output_token_ids.append(tok)
            added.append(tok)
            n = req.num_output_tokens
            if n >= sp.min_tokens:
                if not sp.ignore_eos and tok in self.eos_token_ids:
                    req.status = RequestStatus.FINISHED_STOPPED
                elif tok in sp.stop_token_ids:
                    req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, tok
            if grammar_done and j == len(new) - 1 and not req.is_finished():
                req.status = RequestStatus.FINISHED_STOPPED
            if not req.is_finished() and (
                n >= req.max_tokens or req.num_tokens >= self.max_model_len
            ):
                req.status = RequestStatus.FINISHED_LENGTH
            if req.is_finished():
                break
        if lps is not None:
            req.output_logprobs.extend(lps[: len(added)])
        self.stats.generation_tokens += len(added)
        now = time.time()
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
        output = self._output(req, added, lps[: len(added)] if lps else None)
        # After the tokens are appended (a block's key reads the tokens after it), before a
        # finished request's blocks are freed.
        self.kv.cache_blocks(req)
        if req.is_finished():
            req.metrics.finished_time = now
            self.requests.pop(req.request_id, None)
            self._release(req)
        elif self.speculator is not None:
            self._plan_drafts(req)
        return output

    def _output(
        self, req: Request, delta_ids: list[int], delta_lps: list[dict[int, float]] | None
    ) -> RequestOutput:
        """The step's output; with `detokenize`, with its text, and a stop string in it ends
        the request here (its token ids end at the stop point)."""
        out = self._make_output(req, delta_ids, delta_lps)
        state = req.output_state
        if state is None or state.process(out) is None:
            return out
        stop = out.outputs[0].stop_reason
        if isinstance(stop, str):  # a stop string: the request ends at it, like on EOS
            state.needs_abort = False
            req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, stop
            del req.output_token_ids[len(state.token_ids) :]
            del req.output_logprobs[len(state.token_ids) :]
        return out

    def _plan_drafts(self, req: Request) -> None:
        """How many of the K drafts the next step may verify (never past max_model_len);
        n-gram drafts are found here, on the host.

        NOTE: not capped by max_tokens: tokens verified past it are dropped by `_append`, and a
        request keeping all K drafts keeps decode batches uniform (1 + K tokens per request),
        which is what the captured graphs need. Capping here put ~40% of the decode steps of a
        64-request batch off the graph path."""
        room = self.max_model_len - 1 - req.num_tokens
        k = max(0, min(self.num_spec_tokens, room))
        if self.speculator.proposes_on_host:
            drafts = self.speculator.propose_host(req.all_token_ids, k)
            if req.grammar is not None:
                # Cheap on the host: drafts past the first one the grammar rejects could never
                # be accepted, so they are not verified.
                drafts = drafts[: req.grammar.valid_prefix(drafts)]
                req.grammar.drafts = drafts
            req.host_draft_tokens = drafts
            k = len(drafts)
        req.num_draft_tokens = k

    def _make_output(
        self,
        req: Request,
        delta_ids: list[int],
        delta_lps: list[dict[int, float]] | None,
    ) -> RequestOutput:
        """Token ids only: text and stop strings are RequestState's (output_processor.py)."""
        finish = req.status.value if req.is_finished() else None
        comp = CompletionOutput(
            index=0,
            text="",
            # NOTE: the request's own list, not a copy (a copy per step is O(length) for every
            # running request); complete once the request finishes. Streaming reads the deltas.
            token_ids=req.output_token_ids,
            finish_reason=finish,
            stop_reason=req.stop_reason,
            logprobs=req.output_logprobs if req.sampling_params.logprobs is not None else None,
        )
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=[comp],
            finished=req.is_finished(),
            metrics=req.metrics,
            delta_token_ids=delta_ids,
            delta_logprobs=delta_lps,
            prompt_logprobs=(
                req.prompt_logprobs if req.sampling_params.prompt_logprobs is not None else None
            ),
            prompt_logprob_ranks=(
                req.prompt_logprob_ranks
                if req.sampling_params.prompt_logprobs is not None
                else None
            ),
            num_cached_tokens=max(req.num_cached_tokens, 0),
        )


def _integer_ids(ids: Any) -> list[int]:
    """Prompt token ids as Python ints: a float or a string among them is refused, not
    truncated or left to fail inside a step."""
    out = []
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
            raise ValueError(f"prompt token id {t!r} (position {i}) is not an integer")
        out.append(int(t))
    return out


class RequestFieldError(ValueError):
    """A request field add_request refuses; `param` names it for the server's 400 (errors of
    the prompt itself carry none: the endpoint knows whether it was a prompt or messages)."""

    def __init__(self, msg: str, param: str | None) -> None:
        super().__init__(msg)
        self.param = param


def _check_token_ids(what: str, ids: list[int], vocab: int, param: str | None = None) -> None:
    """Token ids must index the vocabulary: say which one does not, and where."""
    for i, t in enumerate(ids):
        if not 0 <= t < vocab:
            raise RequestFieldError(
                f"{what} {t} (position {i}) is outside this model's vocabulary: "
                f"token ids must be in [0, {vocab})",
                param,
            )


def _check_logprobs(sp: SamplingParams, limit: int) -> None:
    """vLLM's check and wording. Why here: a top-k wider than the vocabulary would fail inside
    the step, taking every running request down with it."""
    for what, n in (("sample", sp.logprobs), ("prompt", sp.prompt_logprobs)):
        if n is not None and n > limit:
            raise RequestFieldError(
                f"Requested {what} logprobs of {n}, which is greater than max allowed: {limit}",
                "logprobs" if what == "sample" else "prompt_logprobs",
            )
