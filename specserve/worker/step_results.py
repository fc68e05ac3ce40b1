"""A step's results on their way to the host: named device tensors packed into ONE buffer for
the step's single device-to-host copy, and unpacked by name on the other side.

`HostPacket` keeps the layout (name, shape) of each field, so no code counts offsets by hand.
The buffer is int64 when every field holds ids, float64 when any holds logprobs (float64 holds
token ids exactly).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from specserve.worker import copy_streams


@dataclass
class HostPacket:
    """Named tensors in one flat host buffer, and the event that says it has landed."""

    # [N] host buffer (pinned on CUDA)
    host: torch.Tensor
    # recorded after the copy (None on CPU: the copy was synchronous)
    event: torch.cuda.Event | None
    # (name, shape) of each field, in buffer order
    layout: list[tuple[str, tuple[int, ...]]]

    @staticmethod
    def send(fields: dict[str, torch.Tensor]) -> HostPacket:
        """Start the copy of `fields` (device tensors) to the host; nothing waits for it."""
        parts = list(fields.values())
        floating = any(p.is_floating_point() for p in parts)
        dtype = torch.float64 if floating else torch.int64
        flat = torch.cat([p.reshape(-1).to(dtype) for p in parts])
        layout = [(name, tuple(p.shape)) for name, p in fields.items()]
        if flat.device.type != "cuda":
            return HostPacket(flat, None, layout)
        # NOTE: pinned, so the copy is asynchronous and the host can prepare the next step
        # meanwhile; on a side stream (worker/copy_streams.py), so the next step need not wait.
        host, event = copy_streams.download(flat)
        return HostPacket(host, event, layout)

    def receive(self) -> dict[str, np.ndarray]:
        """Wait for the copy; each field by name, in its shape (ids as int64)."""
        if self.event is not None:
            self.event.synchronize()
        host = self.host.numpy()
        out, off = {}, 0
        for name, shape in self.layout:
            n = int(np.prod(shape, dtype=np.int64))
            out[name] = host[off : off + n].reshape(shape)
            off += n
        return out


@dataclass
class PendingStep:
    """A launched step whose results are still on their way to the host."""

    packet: HostPacket
    num_reqs: int
    k1: int
    # top-N logprobs asked for (-1: none)
    n_top: int
    # prompt logprobs: (batch row, first token position, count) per request, and their top-N
    # (None: no request of the step asked)
    prompt_spans: list[tuple[int, int, int]] | None = None
    prompt_top: int = 0


@dataclass
class StepOutput:
    # [B, K + 1] sampled / verified tokens (only the first num_accepted + 1 are valid)
    tokens: np.ndarray
    # [B]
    num_accepted: np.ndarray
    # Per batch row: per valid slot, {token: logprob} of the sampled token and the top-N.
    logprobs: list[list[dict[int, float]]] | None
    # batch row -> (position of the first prompt token covered, per covered prompt token
    # {token: logprob} of that token and the top-N, per covered prompt token its rank):
    # prompt logprobs computed this step
    prompt_logprobs: dict[int, tuple[int, list[dict[int, float]], list[int]]] | None = None
    # [B, K] drafts the drafter proposed for the next step, read back only for steps with
    # structured requests (their grammar walks the drafts on the host); else None
    next_drafts: np.ndarray | None = field(default=None)
    # [B, K + 1] parents of the next step's tree nodes, read back with `next_drafts` under
    # draft trees; else None
    next_parents: np.ndarray | None = field(default=None)


def unpack_step(pending: PendingStep) -> StepOutput:
    """Wait for a launched step's results and turn them into the engine's `StepOutput`."""
    got = pending.packet.receive()
    B, n_top = pending.num_reqs, pending.n_top
    tokens = got["tokens"].astype(np.int64)
    num_accepted = (
        got["num_accepted"].astype(np.int64) if "num_accepted" in got else np.zeros(B, np.int64)
    )
    next_drafts = got["next_drafts"].astype(np.int64) if "next_drafts" in got else None
    next_parents = got["next_parents"].astype(np.int64) if "next_parents" in got else None
    logprobs = None
    if n_top >= 0:
        lp, top_ids, top_lp = got["lp"], got["top_ids"].astype(np.int64), got["top_lp"]
        logprobs = []
        for b in range(B):
            rows = []
            for j in range(int(num_accepted[b]) + 1):
                d = {int(top_ids[b, j, i]): float(top_lp[b, j, i]) for i in range(n_top)}
                d[int(tokens[b, j])] = float(lp[b, j])
                rows.append(d)
            logprobs.append(rows)
    prompt_lps = None
    if pending.prompt_spans is not None:
        prompt_lps = _prompt_logprobs(got, pending.prompt_spans, pending.prompt_top)
    return StepOutput(tokens, num_accepted, logprobs, prompt_lps, next_drafts, next_parents)


def _prompt_logprobs(
    got: dict[str, np.ndarray], spans: list[tuple[int, int, int]], n_top: int
) -> dict[int, tuple[int, list[dict[int, float]], list[int]]]:
    lp, tok = got["prompt_lp"], got["prompt_ids"].astype(np.int64)
    ranks = got["prompt_ranks"].astype(np.int64).tolist()
    top_ids, top_lp = got["prompt_top_ids"].astype(np.int64), got["prompt_top_lp"]
    out, i = {}, 0
    for b, first, count in spans:
        rows = []
        for _ in range(count):
            d = {int(top_ids[i, j]): float(top_lp[i, j]) for j in range(n_top)}
            d[int(tok[i])] = float(lp[i])
            rows.append(d)
            i += 1
        out[b] = (first, rows, ranks[i - count : i])
    return out
