"""Streamed completions under load, some of whose clients disconnect (fault-load tests)."""

from __future__ import annotations

import asyncio
import json

import httpx


def stream_with_disconnects(
    url: str,
    prompts: list,
    num_requests: int,
    leave: set[int],
    concurrency: int,
    max_tokens: int,
) -> list[str | None]:
    """Request i streams prompts[i % len(prompts)] greedily; the clients in `leave` disconnect
    after the first chunk (None). Others return their text, or "<lost>" without [DONE]."""

    async def one(h: httpx.AsyncClient, sem: asyncio.Semaphore, i: int) -> str | None:
        body = {
            "prompt": prompts[i % len(prompts)],
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        text, done = "", False
        async with sem, h.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if i in leave:
                    return None  # disconnect after the first chunk
                if line == "data: [DONE]":
                    done = True
                    break
                text += json.loads(line[6:])["choices"][0]["text"]
        return text if done else "<lost>"

    async def run() -> list[str | None]:
        sem = asyncio.Semaphore(concurrency)
        limits = httpx.Limits(max_connections=concurrency)
        async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as h:
            return await asyncio.gather(*(one(h, sem, i) for i in range(num_requests)))

    return asyncio.run(run())
