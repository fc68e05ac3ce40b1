"""Host-side preparation of one step's inputs: O(num_tokens) numpy, then ONE upload."""

from __future__ import annotations

import numpy as np
import torch

from specserve.scheduler_output import SchedulerOutput
from specserve.step_inputs import StepInputs
from specserve.worker import copy_streams


def prepare_inputs(
    sched: SchedulerOutput, num_spec_tokens: int, device: torch.device
) -> StepInputs:
    s = sched.scheduled
    B = len(s)
    k1 = num_spec_tokens + 1
    rows = np.fromiter((x.req.row for x in s), np.int64, B)
    num_sched = np.fromiter((x.num_tokens for x in s), np.int64, B)
    starts = np.fromiter((x.start for x in s), np.int64, B)
    num_draft = np.fromiter((x.num_draft for x in s), np.int64, B)
    samples = np.fromiter((x.samples for x in s), np.int64, B)
    on_device = np.fromiter((x.start_on_device for x in s), np.int64, B)
    qsl = np.zeros(B + 1, np.int64)
    np.cumsum(num_sched, out=qsl[1:])
    T = int(qsl[-1])
    token_req = np.repeat(np.arange(B), num_sched)
    positions = starts[token_req] + np.arange(T) - qsl[token_req]
    last = qsl[1:] - 1
    logits_idx = np.minimum((last - num_draft)[:, None] + np.arange(k1), last[:, None])
    out_pos0 = starts + num_sched - num_draft
    seq_lens = starts + num_sched
    hd = [
        (x.req.row, x.start + 1 + j, t)
        for x in s
        for j, t in enumerate(x.req.host_draft_tokens[: x.num_draft])
    ]
    host_drafts = np.array(hd, np.int64).reshape(-1, 3).T
    parts = [
        rows,
        qsl,
        token_req,
        positions,
        logits_idx.ravel(),
        num_draft,
        out_pos0,
        seq_lens,
        samples,
        on_device,
        host_drafts.ravel(),
    ]
    packed = torch.from_numpy(np.concatenate(parts))
    if device.type == "cuda":
        packed = copy_streams.upload(packed, device)
    sizes = [B, B + 1, T, T, B * k1, B, B, B, B, B, host_drafts.size]
    v = torch.split(packed, sizes)
    return StepInputs(
        num_reqs=B,
        num_tokens=T,
        max_query_len=int(num_sched.max()),
        max_seq_len=int(seq_lens.max()),
        num_draft_np=num_draft,
        samples_np=samples,
        idx_mapping=v[0],
        query_start_loc=v[1],
        token_req=v[2],
        positions=v[3],
        logits_indices=v[4].view(B, k1),
        num_draft=v[5],
        out_pos0=v[6],
        seq_lens=v[7],
        samples=v[8],
        host_drafts=v[10].view(3, -1),
        start_on_device=v[9] if on_device.any() else None,
    )
