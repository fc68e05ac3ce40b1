"""HTTP side of the benchmark: one streaming request per call (timing every chunk), and the
server's speculative-decoding counters read from /metrics.

Timing follows `vllm bench serve`: TTFT is the first chunk that carries choices, every later
chunk adds one inter-token latency (a chunk can hold several tokens when drafts are accepted),
and the output length is the server's `usage.completion_tokens`.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families


@dataclass
class RequestFuncInput:
    prompt: str
    api_url: str
    prompt_len: int
    output_len: int
    model: str
    ignore_eos: bool = False
    # Sampling fields sent as-is (temperature, top_p, ...).
    extra_body: dict[str, Any] = field(default_factory=dict)


@dataclass
class RequestFuncOutput:
    generated_text: str = ""
    success: bool = False
    latency: float = 0.0
    output_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    # Tokens each chunk carried (first chunk first), from the server's continuous usage stats;
    # empty when the server sends none (then every chunk counts as one token).
    chunk_tokens: list[int] = field(default_factory=list)
    prompt_len: int = 0
    start_time: float = 0.0
    error: str = ""


def auth_headers() -> dict[str, str]:
    key = os.environ.get("OPENAI_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


async def _stream(
    session: aiohttp.ClientSession,
    url: str,
    payload: dict[str, Any],
    inp: RequestFuncInput,
    text_of: Callable[[dict[str, Any]], str],
) -> RequestFuncOutput:
    out = RequestFuncOutput(prompt_len=inp.prompt_len)
    st = out.start_time = time.perf_counter()
    last = st
    try:
        async with session.post(url, json=payload, headers=auth_headers()) as resp:
            if resp.status != 200:
                out.error = f"HTTP {resp.status}: {await resp.text()}"
                return out
            buf = b""
            async for raw in resp.content.iter_any():
                buf += raw
                # SSE events end with a blank line; a network read may split or join them.
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    line = event.decode("utf-8").strip()
                    if not line.startswith("data:"):
                        continue
                    data_str = line[len("data:") :].strip()
                    if data_str == "[DONE]":
                        continue
                    data = json.loads(data_str)
                    if "error" in data:
                        out.error = data["error"].get("message", str(data["error"]))
                        return out
                    now = time.perf_counter()
                    usage = data.get("usage") or {}
                    if data.get("choices") and "completion_tokens" in usage:
                        # Continuous usage: this chunk's tokens are the growth of the count.
                        done = int(usage["completion_tokens"] or 0)
                        out.chunk_tokens.append(done - sum(out.chunk_tokens))
                    if data.get("choices"):
                        if out.ttft == 0.0:
                            out.ttft = now - st
                        else:
                            out.itl.append(now - last)
                        last = now
                        out.generated_text += text_of(data["choices"][0]) or ""
                    if data.get("usage"):
                        out.output_tokens = int(data["usage"].get("completion_tokens") or 0)
                        out.prompt_len = int(data["usage"].get("prompt_tokens") or inp.prompt_len)
            out.latency = last - st
            out.success = out.ttft > 0.0
            if not out.success:
                out.error = "the stream carried no tokens"
    except (aiohttp.ClientError, OSError, ValueError) as e:
        out.error = f"{type(e).__name__}: {e}"
    return out


def _base_payload(inp: RequestFuncInput) -> dict[str, Any]:
    return {
        "model": inp.model,
        "stream": True,
        # Continuous usage stats (vLLM's): per-chunk token counts, for the peak throughput.
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "ignore_eos": inp.ignore_eos,
        **inp.extra_body,
    }


async def request_openai_completions(
    session: aiohttp.ClientSession, inp: RequestFuncInput
) -> RequestFuncOutput:
    payload = {**_base_payload(inp), "prompt": inp.prompt, "max_tokens": inp.output_len}
    return await _stream(session, inp.api_url, payload, inp, lambda c: c.get("text", ""))


async def request_openai_chat(
    session: aiohttp.ClientSession, inp: RequestFuncInput
) -> RequestFuncOutput:
    payload = {
        **_base_payload(inp),
        "messages": [{"role": "user", "content": inp.prompt}],
        "max_completion_tokens": inp.output_len,
    }
    return await _stream(
        session, inp.api_url, payload, inp, lambda c: c.get("delta", {}).get("content", "")
    )


RequestFunc = Callable[[aiohttp.ClientSession, RequestFuncInput], Awaitable[RequestFuncOutput]]
# backend -> (request function, endpoint path)
BACKENDS: dict[str, tuple[RequestFunc, str]] = {
    "openai": (request_openai_completions, "/v1/completions"),
    "openai-chat": (request_openai_chat, "/v1/chat/completions"),
}


@dataclass
class SpecDecodeCounters:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: dict[int, int] = field(default_factory=dict)


async def fetch_spec_decode_counters(
    session: aiohttp.ClientSession, base_url: str
) -> SpecDecodeCounters | None:
    """The server's vllm:spec_decode_* counters, summed over label sets; None when the server
    exposes none (speculation off) or /metrics is unreachable."""
    try:
        async with session.get(f"{base_url}/metrics") as resp:
            if resp.status != 200:
                return None
            text = await resp.text()
    except (aiohttp.ClientError, OSError):
        return None
    c, found = SpecDecodeCounters(), False
    for fam in text_string_to_metric_families(text):
        if not fam.name.startswith("vllm:spec_decode"):
            continue
        for s in fam.samples:
            if not s.name.endswith("_total"):
                continue
            found = True
            v = int(s.value)
            if fam.name == "vllm:spec_decode_num_drafts":
                c.num_drafts += v
            elif fam.name == "vllm:spec_decode_num_draft_tokens":
                c.num_draft_tokens += v
            elif fam.name == "vllm:spec_decode_num_accepted_tokens":
                c.num_accepted_tokens += v
            elif fam.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
                pos = int(s.labels["position"])
                c.accepted_per_pos[pos] = c.accepted_per_pos.get(pos, 0) + v
    return c if found else None


async def fetch_prefix_cache_counters(
    session: aiohttp.ClientSession, base_url: str
) -> tuple[float, float] | None:
    """The server's vllm:prefix_cache_queries and _hits counters (tokens), or None when it
    exposes none or /metrics is unreachable."""
    try:
        async with session.get(f"{base_url}/metrics") as resp:
            if resp.status != 200:
                return None
            text = await resp.text()
    except (aiohttp.ClientError, OSError):
        return None
    found: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        if fam.name in ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits"):
            found[fam.name] = sum(s.value for s in fam.samples if s.name.endswith("_total"))
    if len(found) < 2:
        return None
    return found["vllm:prefix_cache_queries"], found["vllm:prefix_cache_hits"]


def prefix_cache_delta(
    before: tuple[float, float] | None, after: tuple[float, float] | None
) -> dict[str, Any]:
    """The prefix-cache hit rate (%) over the benchmark window, as vLLM logs it."""
    if before is None or after is None:
        return {}
    queries, hits = after[0] - before[0], after[1] - before[1]
    return {"prefix_cache_hit_rate": 100.0 * hits / queries if queries > 0 else 0.0}


def spec_decode_delta(
    before: SpecDecodeCounters | None, after: SpecDecodeCounters | None
) -> dict[str, Any] | None:
    """vLLM's spec-decode result fields over the benchmark window; None without drafts."""
    if before is None or after is None:
        return None
    drafts = after.num_drafts - before.num_drafts
    draft_tokens = after.num_draft_tokens - before.num_draft_tokens
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    if draft_tokens <= 0:
        return None
    per_pos = [
        (after.accepted_per_pos.get(p, 0) - before.accepted_per_pos.get(p, 0)) / drafts
        for p in sorted(after.accepted_per_pos)
    ]
    return {
        "spec_decode_acceptance_rate": 100.0 * accepted / draft_tokens,
        "spec_decode_acceptance_length": 1.0 + accepted / drafts if drafts else 0.0,
        "spec_decode_num_drafts": drafts,
        "spec_decode_draft_tokens": draft_tokens,
        "spec_decode_accepted_tokens": accepted,
        "spec_decode_per_position_acceptance_rates": per_pos,
    }


async def first_model(session: aiohttp.ClientSession, base_url: str) -> tuple[str, str]:
    """(id, root) of the server's first model, for runs without --model."""
    async with session.get(f"{base_url}/v1/models", headers=auth_headers()) as resp:
        resp.raise_for_status()
        data = (await resp.json())["data"]
    if not data:
        raise ValueError(f"the server at {base_url} lists no models.")
    return data[0]["id"], data[0].get("root") or data[0]["id"]
