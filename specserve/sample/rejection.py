"""Lossless verification of draft tokens for all requests at once (no per-request Python loop).

Layout: request b has num_draft[b] valid drafts d_1..d_K (padding after), and target logits for
K+1 slots: slot j is the target's next-token distribution after [last token, d_1..d_j]. Output
slot j is the token at absolute position positions[b] + j. Draft d_{j+1} competes for slot j, so
every random decision about slot j is keyed by that slot's position:
  - acceptance of d_{j+1}:            uniform(seed, pos + j, SALT_ACCEPT)
  - recovered / bonus token at slot j: gumbel(seed, pos + j, SALT_SAMPLE)
  - the draft itself (sample_draft):  gumbel(seed, pos + j, SALT_DRAFT)
Distinct salts make the three independent, which speculative sampling's proof of losslessness
requires; each key is consumed at most once because a decided position is never re-verified.

"coupled" (the default method) verifies against the target's own sample instead: slot j's token
is argmax(processed target logits + gumbel(seed, pos + j, SALT_SAMPLE)), the very draw plain
decoding makes at that position, and d_{j+1} is accepted iff it equals it. The output is then
exactly plain sampling's output for the request's seed (so lossless), whatever the drafts; the
drafter keeps acceptance high by drawing its drafts with the same noise on its own distribution
(`sample_draft(coupled=True)`), so a draft is accepted whenever the two Gumbel-max draws agree.
With greedy drafts (q one-hot) it accepts with probability p(d), as speculative sampling does.
"""

from __future__ import annotations

import torch
from torch import Tensor

from specserve.sample.gumbel import SALT_ACCEPT, SALT_DRAFT, SALT_SAMPLE, SALT_SYNTHETIC, uniform
from specserve.sample.sampler import SamplingTensors, gumbel_argmax, process_logits

METHODS = ("coupled", "strict", "probabilistic", "synthetic")


def _repeat_rows(st: SamplingTensors, reps: int) -> SamplingTensors:
    """One SamplingTensors row per (request, slot), request-major, to match .view(B * reps, V)."""
    n = st.seeds.shape[0]
    return st.index(torch.arange(n, device=st.seeds.device).repeat_interleave(reps))


def _slot_uniform(
    st: SamplingTensors,
    # [B, S] int64 slot positions
    slot_pos: Tensor,
    salt: int,
) -> Tensor:
    """[B, S] float32 uniforms keyed by (request seed, slot position, salt)."""
    seeds = st.seeds[:, None].expand_as(slot_pos).reshape(-1)
    return uniform(seeds, slot_pos.reshape(-1), salt).view(slot_pos.shape)


def _accept_prefix(
    # [B, K] bool, per-slot acceptance (ignoring earlier rejections)
    accept: Tensor,
    # [B] int64
    num_draft: Tensor,
) -> Tensor:
    """[B] int64 number of leading drafts accepted: stop at the first rejection or padding."""
    k = accept.shape[1]
    valid = torch.arange(k, device=accept.device)[None, :] < num_draft[:, None]
    return (accept & valid).long().cumprod(dim=1).sum(dim=1)


def _assemble(
    # [B, K] int64
    draft_tokens: Tensor,
    # [B] int64, recovered or bonus token for slot num_accepted
    final_tokens: Tensor,
    # [B] int64
    num_accepted: Tensor,
) -> Tensor:
    """[B, K+1] int64: accepted drafts, then the recovered/bonus token, then -1."""
    b, k = draft_tokens.shape
    j = torch.arange(k + 1, device=draft_tokens.device)[None, :]
    drafts = torch.cat([draft_tokens, draft_tokens.new_zeros(b, 1)], dim=1)
    out = torch.where(j < num_accepted[:, None], drafts, final_tokens[:, None])
    return out.masked_fill(j > num_accepted[:, None], -1)


def _sampled_accept(
    # [B, K+1, V] float32 processed target logits
    logits: Tensor,
    # [B, K] int64
    draft_tokens: Tensor,
    # [B, K, V] or None (q one-hot at the draft)
    draft_probs: Tensor | None,
    st: SamplingTensors,
    # [B, K+1] int64 positions of the output slots
    slot_pos: Tensor,
) -> Tensor:
    """[B, K] bool speculative-sampling test per slot: u < p(d) / q(d)."""
    k = draft_tokens.shape[1]
    lk = logits[:, :k]
    # p(d) without materializing softmax over the whole [B, K, V] tensor.
    p_d = (lk.gather(2, draft_tokens[..., None]).squeeze(2) - lk.logsumexp(dim=-1)).exp()
    if draft_probs is None:
        q_d = torch.ones_like(p_d)
    else:
        q_d = draft_probs.float().gather(2, draft_tokens[..., None]).squeeze(2)
    u = _slot_uniform(st, slot_pos[:, :k], SALT_ACCEPT)
    # Multiplied out to avoid dividing; q(d) == 0 cannot have been drafted (accepts iff p > 0).
    return u * q_d < p_d


def _final_log_weights(
    # [B, V] float32 processed target logits at each request's final slot
    logits: Tensor,
    # [B] int64 draft that was rejected at that slot (any value where none was)
    draft: Tensor,
    # [B, V] draft probabilities at that slot, or None (q one-hot at the draft)
    q: Tensor | None,
    # [B] bool, the final slot held a rejected draft (else it is the bonus slot)
    rejected: Tensor,
) -> Tensor:
    """[B, V] log-weights of norm(max(p - q, 0)) after a rejection, of p for the bonus token.

    The bonus slot uses the processed logits themselves, so a bonus token is bit-identical to
    what `sample` draws at that position. With q one-hot the residual is p without the draft,
    i.e. the logits with that entry at -inf (no log(softmax) rounding). An all-zero residual
    (p == q up to rounding, which the acceptance test never rejects) falls back to p.
    """
    if q is None:
        kept = logits.gather(1, draft[:, None]).masked_fill(rejected[:, None], float("-inf"))
        logw = logits.scatter(1, draft[:, None], kept)
        empty = (logw == float("-inf")).all(dim=-1, keepdim=True)
        return torch.where(empty, logits, logw)
    p = logits.softmax(dim=-1)
    residual = (p - q.float()).clamp_(min=0.0)
    empty = residual.sum(dim=-1, keepdim=True) <= 0.0
    logw = torch.where(empty, p, residual).log()
    return torch.where(rejected[:, None], logw, logits)


def _synthetic_accept(
    st: SamplingTensors,
    # [B, K+1] int64
    slot_pos: Tensor,
    rate: float,
) -> Tensor:
    """[B, K] bool: each draft independently 'accepted' with probability `rate` (lossy)."""
    return _slot_uniform(st, slot_pos[:, :-1], SALT_SYNTHETIC) < rate


def rejection_sample(
    # [B, K+1, V] target logits for [last token, d1..dK]'s next-token distributions (raw)
    target_logits: Tensor,
    # [B, K] draft tokens (entries past num_draft are padding, any value)
    draft_tokens: Tensor,
    # [B, K, V] draft probabilities over the TARGET vocab, or None for greedy drafting (q one-hot)
    draft_probs: Tensor | None,
    # [B] int64, number of valid drafts per request (0..K)
    num_draft: Tensor,
    st: SamplingTensors,
    # [B] int64, absolute position of the token that output slot 0 becomes
    positions: Tensor,
    method: str = "strict",
    synthetic_acceptance_rate: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """Verify drafts -> (output_tokens [B, K+1] int64, -1 after the last valid; num_accepted [B]).

    Greedy rows accept a draft iff it equals the target argmax and emit the argmax at the first
    mismatch. Sampled rows use speculative sampling (exactly lossless) under both "strict" and
    "probabilistic"; under "coupled" they accept a draft iff it equals the target's seeded
    Gumbel-max sample at its slot (draft_probs unused), so the output is plain sampling's.
    "synthetic" (benchmarking only) accepts drafts with a fixed probability.
    The recovered/bonus token is drawn only at each request's final slot, so Gumbel noise costs
    [B, V], not [B, K+1, V]. On CUDA every method runs as Triton kernels
    (sample/rejection_triton.py: "coupled" and "synthetic" in `coupled_sample_triton`) checked
    against `rejection_sample_ref`, the CPU path.
    """
    if method not in METHODS:
        raise ValueError(f"rejection_sample method must be one of {METHODS}, got {method!r}.")
    k = target_logits.shape[1] - 1
    if target_logits.is_cuda and k > 0:
        if method in ("coupled", "synthetic"):
            rate = synthetic_acceptance_rate if method == "synthetic" else None
            return coupled_sample_kernel(
                target_logits, draft_tokens, num_draft, st, positions, rate
            )
        return rejection_sample_kernel(
            target_logits, draft_tokens, draft_probs, num_draft, st, positions
        )
    return rejection_sample_ref(
        target_logits,
        draft_tokens,
        draft_probs,
        num_draft,
        st,
        positions,
        method,
        synthetic_acceptance_rate,
    )


def _processed_rows(target_logits: Tensor, st: SamplingTensors) -> Tensor | None:
    """[B * (K + 1), V] `process_logits` output when top-k / top-p / min-p need a sort; None
    when temperature is the only processing (the kernels scale by it themselves)."""
    if st.all_greedy or not (st.any_top_k or st.any_top_p or st.any_min_p):
        return None
    b, k1, vocab = target_logits.shape
    flat = target_logits.float().reshape(b * k1, vocab)
    return process_logits(flat, _repeat_rows(st, k1))


def coupled_sample_kernel(
    target_logits: Tensor,
    draft_tokens: Tensor,
    num_draft: Tensor,
    st: SamplingTensors,
    positions: Tensor,
    synthetic_rate: float | None = None,
) -> tuple[Tensor, Tensor]:
    """The Triton path of `rejection_sample(method="coupled")`, or of "synthetic" given its
    rate (CUDA, or CPU tensors under TRITON_INTERPRET=1); same arguments and results, K >= 1."""
    from specserve.sample.rejection_triton import coupled_sample_triton

    return coupled_sample_triton(
        target_logits,
        draft_tokens,
        num_draft,
        st.temperature,
        st.seeds,
        positions,
        st.all_greedy,
        _processed_rows(target_logits, st),
        synthetic_rate=synthetic_rate,
    )


def rejection_sample_kernel(
    target_logits: Tensor,
    draft_tokens: Tensor,
    draft_probs: Tensor | None,
    num_draft: Tensor,
    st: SamplingTensors,
    positions: Tensor,
) -> tuple[Tensor, Tensor]:
    """The Triton path of `rejection_sample` for "strict" and "probabilistic" (CUDA, or CPU
    tensors under TRITON_INTERPRET=1); same arguments and results, K >= 1."""
    from specserve.sample.rejection_triton import rejection_sample_triton

    # The thresholds need a sort: filtered logits come from the torch code; the
    # temperature-only case is scaled inside the kernels.
    processed = _processed_rows(target_logits, st)
    return rejection_sample_triton(
        target_logits,
        draft_tokens,
        draft_probs,
        num_draft,
        st.temperature,
        st.seeds,
        positions,
        st.all_greedy,
        processed,
    )


def rejection_sample_ref(
    # [B, K+1, V] target logits for [last token, d1..dK]'s next-token distributions (raw)
    target_logits: Tensor,
    # [B, K] draft tokens (entries past num_draft are padding, any value)
    draft_tokens: Tensor,
    # [B, K, V] draft probabilities over the TARGET vocab, or None for greedy drafting (q one-hot)
    draft_probs: Tensor | None,
    # [B] int64, number of valid drafts per request (0..K)
    num_draft: Tensor,
    st: SamplingTensors,
    # [B] int64, absolute position of the token that output slot 0 becomes
    positions: Tensor,
    method: str = "strict",
    synthetic_acceptance_rate: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """Torch reference of `rejection_sample` (any device); the CPU path."""
    b, k1, vocab = target_logits.shape
    k = k1 - 1
    rows = torch.arange(b, device=target_logits.device)
    target_logits = target_logits.float()
    num_draft = num_draft.long()
    # Padding drafts may hold anything (e.g. -1); clamp so gathers stay in range. Their
    # acceptance is masked by num_draft and their value never reaches the output.
    draft_tokens = draft_tokens.long().clamp(0, vocab - 1)
    slot_pos = positions.long()[:, None] + torch.arange(k1, device=positions.device)[None, :]

    argmax = target_logits.argmax(dim=-1)
    if method == "coupled":
        return _coupled_ref(target_logits, argmax, draft_tokens, num_draft, st, slot_pos)
    logits: Tensor | None = None
    if method == "synthetic":
        accept = _synthetic_accept(st, slot_pos, synthetic_acceptance_rate)
    else:
        accept = draft_tokens == argmax[:, :k]
        if not st.all_greedy:
            st_rep = _repeat_rows(st, k1)
            logits = process_logits(target_logits.reshape(b * k1, vocab), st_rep)
            logits = logits.view(b, k1, vocab)
            sampled = _sampled_accept(logits, draft_tokens, draft_probs, st, slot_pos)
            accept = torch.where(st.greedy[:, None], accept, sampled)
    num_accepted = _accept_prefix(accept, num_draft)

    final = argmax[rows, num_accepted]
    if not st.all_greedy:
        if logits is None:  # synthetic: plain target sample at the final slot
            logw = process_logits(target_logits[rows, num_accepted], st)
        else:
            rejected = num_accepted < num_draft
            pad = torch.cat([draft_tokens, draft_tokens.new_zeros(b, 1)], dim=1)
            q = None
            if draft_probs is not None and k > 0:
                q = draft_probs[rows, num_accepted.clamp(max=k - 1)]
            logw = _final_log_weights(
                logits[rows, num_accepted], pad[rows, num_accepted], q, rejected
            )
        sampled_tok = gumbel_argmax(logw, st, positions.long() + num_accepted, SALT_SAMPLE)
        final = torch.where(st.greedy, final, sampled_tok)
    return _assemble(draft_tokens, final, num_accepted), num_accepted


def _coupled_ref(
    # [B, K+1, V] float32 raw target logits
    target_logits: Tensor,
    # [B, K+1] int64 their argmax
    argmax: Tensor,
    # [B, K] int64, clamped into the vocabulary
    draft_tokens: Tensor,
    # [B] int64
    num_draft: Tensor,
    st: SamplingTensors,
    # [B, K+1] int64
    slot_pos: Tensor,
) -> tuple[Tensor, Tensor]:
    """ "coupled": every slot's token is the target's own draw at that position (argmax for
    greedy rows, the seeded Gumbel-max sample otherwise); drafts are accepted while equal."""
    b, k1, vocab = target_logits.shape
    target = argmax
    if not st.all_greedy:
        st_rep = _repeat_rows(st, k1)
        logw = process_logits(target_logits.reshape(b * k1, vocab), st_rep)
        sampled = gumbel_argmax(logw, st_rep, slot_pos.reshape(-1), SALT_SAMPLE).view(b, k1)
        target = torch.where(st.greedy[:, None], argmax, sampled)
    num_accepted = _accept_prefix(draft_tokens == target[:, : k1 - 1], num_draft)
    final = target[torch.arange(b, device=target.device), num_accepted]
    return _assemble(draft_tokens, final, num_accepted), num_accepted


def sample_draft(
    # [B, V] float draft-model logits
    draft_logits: Tensor,
    st: SamplingTensors,
    # [B] int64 absolute position the drafted token will occupy
    positions: Tensor,
    greedy_draft: bool,
    coupled: bool = False,
    # [V] int64 target-vocabulary id of each draft-vocabulary column (reduced vocabularies)
    target_cols: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Draft one token per row -> (tokens [B] int64, probs [B, V] float32 or None if greedy).

    The returned probs are exactly the distribution the token was drawn from (one-hot at the
    argmax for greedy rows), as rejection_sample's acceptance test requires. `coupled`: the
    verification needs no probs (None) and the draft is drawn with the noise the target's
    sample at that position uses (SALT_SAMPLE, each column keyed by its target-vocabulary id),
    so draft and target agree whenever their Gumbel-max draws do.
    """
    argmax = draft_logits.argmax(dim=-1)
    if greedy_draft:
        return argmax, None
    if coupled:
        if st.all_greedy:
            return argmax, None
        logits = process_logits(draft_logits, st)
        sampled = gumbel_argmax(logits, st, positions, SALT_SAMPLE, target_cols)
        return torch.where(st.greedy, argmax, sampled), None
    one_hot = torch.zeros_like(draft_logits, dtype=torch.float32)
    one_hot.scatter_(1, argmax[:, None], 1.0)
    if st.all_greedy:
        return argmax, one_hot
    logits = process_logits(draft_logits, st)
    sampled = gumbel_argmax(logits, st, positions, SALT_DRAFT)
    greedy = st.greedy
    tokens = torch.where(greedy, argmax, sampled)
    probs = torch.where(greedy[:, None], one_hot, logits.softmax(dim=-1))
    return tokens, probs
