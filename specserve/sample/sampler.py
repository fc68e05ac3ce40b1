"""Per-request logits processing (temperature, top-k, top-p, min-p), sampling and logprobs.

Everything is vectorized over rows with per-row parameters; host-side flags skip the kernels of
features no request in the batch uses. Random draws come from the counter-based Gumbel noise in
`gumbel.py`, so sampled tokens are independent of batch composition and device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from specserve import ops
from specserve.sample.gumbel import SALT_SAMPLE, gumbel

# Temperatures below this are greedy (matches SamplingParams.greedy).
_GREEDY_EPS = 1e-5


@dataclass
class SamplingTensors:
    # [N] float32, 0.0 = greedy
    temperature: Tensor
    # [N] int64, 0 = off
    top_k: Tensor
    # [N] float32, 1.0 = off
    top_p: Tensor
    # [N] float32, 0.0 = off
    min_p: Tensor
    # [N] int64
    seeds: Tensor
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool

    @classmethod
    def from_lists(
        cls,
        temperature: list[float],
        top_k: list[int],
        top_p: list[float],
        min_p: list[float],
        seeds: list[int],
        device: torch.device | str,
    ) -> SamplingTensors:
        # Snap near-zero temperatures to exactly 0 so "greedy" is one well-defined test.
        temps = [0.0 if t < _GREEDY_EPS else float(t) for t in temperature]
        ks = [max(int(k), 0) for k in top_k]

        def f32(xs: list[float]) -> Tensor:
            return torch.tensor(xs, dtype=torch.float32, device=device)

        def i64(xs: list[int]) -> Tensor:
            return torch.tensor(xs, dtype=torch.int64, device=device)

        return cls(
            temperature=f32(temps),
            top_k=i64(ks),
            top_p=f32(top_p),
            min_p=f32(min_p),
            seeds=i64(seeds),
            all_greedy=all(t == 0.0 for t in temps),
            any_top_k=any(k > 0 for k in ks),
            any_top_p=any(p < 1.0 for p in top_p),
            any_min_p=any(p > 0.0 for p in min_p),
        )

    def index(
        self,
        # [M] int64 row indices
        idx: Tensor,
    ) -> SamplingTensors:
        """Gather rows (e.g. each request repeated K+1 times); host flags stay conservative."""
        return SamplingTensors(
            temperature=self.temperature[idx],
            top_k=self.top_k[idx],
            top_p=self.top_p[idx],
            min_p=self.min_p[idx],
            seeds=self.seeds[idx],
            all_greedy=self.all_greedy,
            any_top_k=self.any_top_k,
            any_top_p=self.any_top_p,
            any_min_p=self.any_min_p,
        )

    @property
    def greedy(self) -> Tensor:
        """[N] bool, rows sampled by argmax."""
        return self.temperature == 0.0


def apply_temperature(
    # [N, V] float32
    logits: Tensor,
    st: SamplingTensors,
) -> Tensor:
    """logits / T; greedy rows divide by 1 (they are argmaxed on raw logits anyway)."""
    temp = torch.where(st.greedy, torch.ones_like(st.temperature), st.temperature)
    return logits / temp[:, None]


def _top_k_top_p_threshold(
    # [N, V] float32, temperature-scaled
    logits: Tensor,
    st: SamplingTensors,
) -> Tensor:
    """[N] smallest logit kept by top-k then top-p (one descending sort).

    Thresholds on values (rather than scattering a sorted mask back) keep tokens tied with the
    last kept one; this is independent of the sort's tie order, hence identical across devices.
    """
    n, vocab = logits.shape
    srt = logits.sort(dim=-1, descending=True).values
    ranks = torch.arange(vocab, device=logits.device)
    k = torch.where(st.top_k > 0, st.top_k.clamp(max=vocab), torch.full_like(st.top_k, vocab))
    thr = srt.gather(1, (k - 1)[:, None]).squeeze(1)
    if st.any_top_p:
        if st.any_top_k:
            srt = srt.masked_fill(srt < thr[:, None], float("-inf"))
        probs = srt.softmax(dim=-1)
        # Keep a sorted token iff the mass strictly before it is < top_p: the smallest prefix
        # with mass >= top_p. The top token has zero mass before it, so it is always kept.
        mass_before = probs.cumsum(dim=-1) - probs
        keep = (mass_before < st.top_p[:, None]) | (ranks == 0)
        count = keep.sum(dim=-1).clamp(min=1)
        thr = torch.maximum(thr, srt.gather(1, (count - 1)[:, None]).squeeze(1))
    return thr


def process_logits(
    # [N, V] float
    logits: Tensor,
    st: SamplingTensors,
) -> Tensor:
    """Temperature, then top-k, top-p and min-p by setting dropped tokens to -inf -> [N, V] f32."""
    logits = logits.float()
    if not st.all_greedy:
        logits = apply_temperature(logits, st)
    if not (st.any_top_k or st.any_top_p or st.any_min_p):
        return logits
    thr = torch.full_like(logits[:, 0], float("-inf"))
    if st.any_top_k or st.any_top_p:
        thr = _top_k_top_p_threshold(logits, st)
    if st.any_min_p:
        # p_i >= min_p * p_max  <=>  l_i >= l_max + log(min_p); independent of normalization,
        # so top-k/top-p having run first does not change it. log(0) = -inf keeps everything.
        lmax = logits.max(dim=-1).values
        thr = torch.maximum(thr, lmax + st.min_p.log())
    return logits.masked_fill(logits < thr[:, None], float("-inf"))


def gumbel_argmax(
    # [N, V] float32 log-weights (unnormalized log-probs)
    logw: Tensor,
    st: SamplingTensors,
    # [N] int64 position the sampled token will occupy
    positions: Tensor,
    salt: int,
    # [V] int64: the vocab index whose noise each column draws (default: its own)
    cols: Tensor | None = None,
) -> Tensor:
    """[N] int64 sample from softmax(logw) via the Gumbel-max trick with counter-based noise."""
    g = gumbel(st.seeds, positions, salt, logw.shape[-1], cols)
    return (logw + g).argmax(dim=-1)


def sample(
    # [N, V] float
    logits: Tensor,
    st: SamplingTensors,
    # [N] int64 absolute position the sampled token will occupy
    positions: Tensor,
    salt: int = SALT_SAMPLE,
) -> Tensor:
    """[N] int64 tokens: argmax of raw logits for greedy rows, a seeded sample otherwise."""
    greedy_tokens = ops.argmax(logits)
    if st.all_greedy:
        return greedy_tokens
    sampled = gumbel_argmax(process_logits(logits, st), st, positions, salt)
    return torch.where(st.greedy, greedy_tokens, sampled)


def compute_logprobs(
    # [N, V] float raw logits
    logits: Tensor,
    # [N] int64
    token_ids: Tensor,
    num_top: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Raw logprobs (vLLM default): chosen token's logprob and rank (1 = most likely), top-n.

    Returns token_logprobs [N] f32, token_ranks [N] int64, top_ids [N, num_top] int64,
    top_logprobs [N, num_top] f32.
    """
    logprobs = logits.float().log_softmax(dim=-1)
    token_lp = logprobs.gather(1, token_ids.long()[:, None])
    # Like vLLM, count tokens at least as likely as the chosen one (ties share the lower rank).
    ranks = (logprobs >= token_lp).sum(dim=-1)
    top_lp, top_ids = logprobs.topk(num_top, dim=-1)
    return token_lp.squeeze(1), ranks, top_ids, top_lp


__all__ = [
    "SamplingTensors",
    "apply_temperature",
    "compute_logprobs",
    "gumbel_argmax",
    "process_logits",
    "sample",
]
