"""CPU tests for counter-based RNG, logits processing, sampling and lossless rejection sampling."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from torch import Tensor

from specserve.sample.gumbel import (
    SALT_ACCEPT,
    SALT_DRAFT,
    SALT_SAMPLE,
    SALT_SYNTHETIC,
    gumbel,
    hash_u32,
    uniform,
)
from specserve.sample.rejection import rejection_sample, sample_draft
from specserve.sample.sampler import SamplingTensors, compute_logprobs, process_logits, sample

Verifier = Callable[..., tuple[Tensor, Tensor]]


def make_st(
    n: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    seed0: int = 0,
) -> SamplingTensors:
    return SamplingTensors.from_lists(
        [temperature] * n,
        [top_k] * n,
        [top_p] * n,
        [min_p] * n,
        list(range(seed0, seed0 + n)),
        "cpu",
    )


def chi2_pvalue(counts: Tensor, probs: Tensor) -> float:
    """Pearson chi-square goodness of fit; cells with tiny expectation are pooled."""
    counts = counts.double().flatten()
    expected = probs.double().flatten() * counts.sum()
    small = expected < 5
    if small.any():
        counts = torch.cat([counts[~small], counts[small].sum().view(1)])
        expected = torch.cat([expected[~small], expected[small].sum().view(1)])
    stat = ((counts - expected) ** 2 / expected).sum()
    dof = counts.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), stat / 2.0))


def ks_statistic(u: Tensor) -> float:
    """Kolmogorov-Smirnov distance of samples from Uniform(0, 1)."""
    u = u.double().flatten().sort().values
    n = u.numel()
    i = torch.arange(1, n + 1, dtype=torch.float64)
    return float(torch.maximum(i / n - u, u - (i - 1) / n).max())


# ---------------------------------------------------------------------------- counter-based RNG


def test_hash_u32_range_and_input_untouched() -> None:
    x = torch.tensor([0, 1, 2, 0xFFFFFFFF, 0x80000000, 123456789], dtype=torch.int64)
    before = x.clone()
    h = hash_u32(x)
    assert torch.equal(x, before)
    assert h.dtype == torch.int64
    assert bool((h >= 0).all()) and bool((h < 2**32).all())
    assert h.unique().numel() == x.numel()


def test_uniform_range_and_distribution() -> None:
    n = 200_000
    g = torch.Generator().manual_seed(0)
    seeds = torch.randint(-(2**62), 2**62, (n,), generator=g)
    pos = torch.randint(0, 2**31, (n,), generator=g)
    u = uniform(seeds, pos, SALT_SAMPLE)
    assert u.dtype == torch.float32 and u.shape == (n,)
    assert bool((u > 0).all()) and bool((u < 1).all())
    assert abs(float(u.mean()) - 0.5) < 0.005
    assert ks_statistic(u) < 1.63 / math.sqrt(n)  # KS critical value at alpha = 0.01

    # Per-vocab values of consecutive positions of one seed: the common engine access pattern.
    rows = 400
    uv = uniform(torch.full((rows,), 7), torch.arange(rows), SALT_SAMPLE, vocab_size=500)
    assert uv.shape == (rows, 500)
    assert bool((uv > 0).all()) and bool((uv < 1).all())
    assert ks_statistic(uv) < 1.63 / math.sqrt(uv.numel())
    # Neighbouring columns and neighbouring positions are uncorrelated.
    c = uv - 0.5
    col_corr = float((c[:, 1:] * c[:, :-1]).mean() / c.var())
    row_corr = float((c[1:] * c[:-1]).mean() / c.var())
    assert abs(col_corr) < 0.01 and abs(row_corr) < 0.01


def test_uniform_extreme_keys_stay_in_range() -> None:
    seeds = torch.tensor([0, -1, 2**63 - 1, -(2**63), 2**32, 1])
    pos = torch.tensor([0, 0, 2**40, 5, 0, 2**32 - 1])
    for salt in (SALT_SAMPLE, SALT_ACCEPT, SALT_DRAFT, SALT_SYNTHETIC):
        u = uniform(seeds, pos, salt, vocab_size=64)
        assert bool((u > 0).all()) and bool((u < 1).all())
        g = gumbel(seeds, pos, salt, 64)
        assert bool(torch.isfinite(g).all())


def test_uniform_batch_independent() -> None:
    seed, pos = 1234, 77
    alone = uniform(torch.tensor([seed]), torch.tensor([pos]), SALT_ACCEPT)
    alone_v = gumbel(torch.tensor([seed]), torch.tensor([pos]), SALT_SAMPLE, 100)
    seeds = torch.tensor([5, 6, 7, seed, 9, 10, 11, 12])
    poss = torch.tensor([1, 2, 3, pos, 5, 6, 7, 8])
    batch = uniform(seeds, poss, SALT_ACCEPT)
    batch_v = gumbel(seeds, poss, SALT_SAMPLE, 100)
    assert torch.equal(alone[0], batch[3])
    assert torch.equal(alone_v[0], batch_v[3])


def test_uniform_keys_differ() -> None:
    base = uniform(torch.tensor([1]), torch.tensor([10]), SALT_SAMPLE, 256)
    for seeds, pos, salt in [
        ([2], [10], SALT_SAMPLE),
        ([1 + 2**32], [10], SALT_SAMPLE),  # high half of the seed matters
        ([1], [11], SALT_SAMPLE),
        ([1], [10], SALT_ACCEPT),
    ]:
        other = uniform(torch.tensor(seeds), torch.tensor(pos), salt, 256)
        assert float((other == base).float().mean()) < 0.05
    scalar = uniform(torch.arange(1000), torch.zeros(1000, dtype=torch.int64), SALT_SAMPLE)
    assert scalar.unique().numel() > 990


# ---------------------------------------------------------------------------- logits processing


def reference_process(
    logits: Tensor, temperature: float, top_k: int, top_p: float, min_p: float
) -> Tensor:
    """Per-row reference of process_logits on one [V] row."""
    x = logits.double() / (temperature if temperature > 0 else 1.0)
    vocab = x.numel()
    keep = torch.ones(vocab, dtype=torch.bool)
    order = x.argsort(descending=True).tolist()
    if top_k > 0:
        keep[:] = False
        keep[order[: min(top_k, vocab)]] = True
    if top_p < 1.0:
        probs = torch.where(keep, x, torch.tensor(float("-inf"), dtype=x.dtype)).softmax(-1)
        mass, kept = 0.0, torch.zeros(vocab, dtype=torch.bool)
        for i in order:
            if not keep[i]:
                break
            kept[i] = True
            mass += float(probs[i])
            if mass >= top_p:
                break
        keep = kept
    if min_p > 0.0:
        probs = x.softmax(-1)
        keep &= probs >= min_p * probs.max()
    return torch.where(keep, x, torch.tensor(float("-inf"), dtype=x.dtype))


def test_process_logits_matches_reference() -> None:
    g = torch.Generator().manual_seed(1)
    vocab = 50
    params = [
        (1.0, 0, 1.0, 0.0),
        (0.7, 5, 1.0, 0.0),
        (1.3, 0, 0.8, 0.0),
        (0.5, 0, 1.0, 0.2),
        (1.0, 10, 0.6, 0.0),
        (0.9, 20, 0.9, 0.05),
        (0.0, 3, 0.5, 0.1),  # greedy row: temperature treated as 1
        (1.0, 1, 1.0, 0.0),
        (2.0, 100, 0.3, 0.0),  # top_k > vocab
        (1.0, 0, 0.999, 0.9),
    ]
    logits = torch.randn(len(params), vocab, generator=g) * 3
    st = SamplingTensors.from_lists(
        [p[0] for p in params],
        [p[1] for p in params],
        [p[2] for p in params],
        [p[3] for p in params],
        list(range(len(params))),
        "cpu",
    )
    out = process_logits(logits, st)
    assert out.dtype == torch.float32 and out.shape == logits.shape
    for i, (t, k, p, m) in enumerate(params):
        ref = reference_process(logits[i], t, k, p, m)
        assert torch.equal(torch.isinf(out[i]), torch.isinf(ref)), f"row {i}"
        finite = torch.isfinite(ref)
        torch.testing.assert_close(out[i][finite].double(), ref[finite], rtol=1e-5, atol=1e-5)
        assert bool(torch.isfinite(out[i, logits[i].argmax()]))  # the top token always survives


def test_process_logits_flags_off_is_temperature_only() -> None:
    logits = torch.randn(4, 30)
    st = make_st(4, temperature=0.5)
    torch.testing.assert_close(process_logits(logits, st), logits / 0.5)
    greedy = make_st(4, temperature=0.0)
    assert greedy.all_greedy
    torch.testing.assert_close(process_logits(logits, greedy), logits)


def test_sampling_tensors_index_keeps_flags() -> None:
    st = SamplingTensors.from_lists([0.0, 0.8], [0, 5], [1.0, 0.9], [0.0, 0.0], [3, 4], "cpu")
    assert (st.all_greedy, st.any_top_k, st.any_top_p, st.any_min_p) == (False, True, True, False)
    rep = st.index(torch.arange(2).repeat_interleave(3))
    assert rep.seeds.tolist() == [3, 3, 3, 4, 4, 4]
    assert rep.top_k.tolist() == [0, 0, 0, 5, 5, 5]
    assert (rep.any_top_k, rep.any_top_p) == (True, True)


# ---------------------------------------------------------------------------- sampling


def test_sample_greedy_is_argmax() -> None:
    logits = torch.randn(16, 100)
    st = make_st(16, temperature=0.0, top_k=3)
    assert torch.equal(sample(logits, st, torch.arange(16)), logits.argmax(-1))
    # Mixed batch: greedy rows stay argmax regardless of the sampled rows around them.
    mixed = SamplingTensors.from_lists(
        [0.0, 1.0] * 8, [0] * 16, [1.0] * 16, [0.0] * 16, list(range(16)), "cpu"
    )
    out = sample(logits * 0.1, mixed, torch.arange(16))
    assert torch.equal(out[0::2], logits[0::2].argmax(-1))


def test_sample_reproducible_and_batch_independent() -> None:
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(8, 64, generator=g)
    st = SamplingTensors.from_lists(
        [1.0, 0.7, 1.2, 0.0, 1.0, 0.9, 1.5, 1.0],
        [0, 10, 0, 0, 5, 0, 0, 20],
        [1.0, 1.0, 0.9, 1.0, 1.0, 0.8, 1.0, 0.95],
        [0.0, 0.0, 0.0, 0.0, 0.1, 0.0, 0.0, 0.0],
        [11, 22, 33, 44, 55, 66, 77, 88],
        "cpu",
    )
    pos = torch.tensor([5, 6, 7, 8, 9, 10, 11, 12])
    a = sample(logits, st, pos)
    assert torch.equal(a, sample(logits, st, pos))
    for i in range(8):
        row = st.index(torch.tensor([i]))
        assert torch.equal(sample(logits[i : i + 1], row, pos[i : i + 1]), a[i : i + 1])
    # A different salt is a different stream.
    many = torch.zeros(512, dtype=torch.int64)
    flat = torch.zeros(1, 64)
    st1 = make_st(1)
    a0 = torch.stack([sample(flat, st1, many[:1] + i) for i in range(64)])
    a1 = torch.stack([sample(flat, st1, many[:1] + i, SALT_DRAFT) for i in range(64)])
    assert not torch.equal(a0, a1)


@pytest.mark.parametrize(
    "temperature,top_k,top_p,min_p", [(1.0, 0, 1.0, 0.0), (0.7, 6, 1.0, 0.0), (1.3, 0, 0.8, 0.05)]
)
def test_sample_distribution(temperature: float, top_k: int, top_p: float, min_p: float) -> None:
    n, vocab = 20_000, 10
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(3))
    st = SamplingTensors.from_lists(
        [temperature] * n, [top_k] * n, [top_p] * n, [min_p] * n, [42] * n, "cpu"
    )
    tokens = sample(logits.expand(n, vocab), st, torch.arange(n) + 1000)
    probs = reference_process(logits, temperature, top_k, top_p, min_p).softmax(-1)
    counts = torch.bincount(tokens, minlength=vocab)
    assert int(counts[probs == 0].sum()) == 0
    assert chi2_pvalue(counts[probs > 0], probs[probs > 0]) > 1e-3
    assert 0.5 * float((counts / n - probs).abs().sum()) < 0.02


def test_compute_logprobs() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.0, 0.0, 5.0, -1.0]])
    tok = torch.tensor([2, 2])
    lp, rank, top_ids, top_lp = compute_logprobs(logits, tok, 2)
    ref = logits.log_softmax(-1)
    torch.testing.assert_close(lp, ref[[0, 1], [2, 2]])
    assert rank.tolist() == [2, 1]
    assert top_ids.tolist() == [[1, 2], [2, 0]] or top_ids.tolist() == [[1, 2], [2, 1]]
    torch.testing.assert_close(top_lp, ref.gather(1, top_ids))
    assert compute_logprobs(logits, tok, 0)[2].shape == (2, 0)


# ---------------------------------------------------------------------------- drafting


def test_sample_draft() -> None:
    logits = torch.randn(6, 40)
    st = SamplingTensors.from_lists(
        [0.0, 1.0, 0.5, 0.0, 1.0, 1.0],
        [0, 0, 5, 0, 0, 0],
        [1.0] * 6,
        [0.0] * 6,
        list(range(6)),
        "cpu",
    )
    pos = torch.arange(6) + 3
    tok, probs = sample_draft(logits, st, pos, greedy_draft=True)
    assert probs is None and torch.equal(tok, logits.argmax(-1))
    tok, probs = sample_draft(logits, st, pos, greedy_draft=False)
    assert probs is not None and probs.shape == (6, 40)
    torch.testing.assert_close(probs.sum(-1), torch.ones(6))
    assert torch.equal(tok[[0, 3]], logits[[0, 3]].argmax(-1))
    assert torch.equal(probs[[0, 3]].argmax(-1), tok[[0, 3]])
    assert bool((probs[[0, 3]].max(-1).values == 1).all())
    assert bool((probs.gather(1, tok[:, None]) > 0).all())
    assert int((probs[2] > 0).sum()) == 5  # top-k applies to the draft distribution too


# ---------------------------------------------------------------------------- rejection sampling

V, K, B, TEMP = 6, 3, 20_000, 0.8


def markov_chain(seed: int, draft_noise: float) -> tuple[Tensor, Tensor]:
    """Target logits table P[prev] -> [V] and a related draft table Q[prev] -> [V]."""
    g = torch.Generator().manual_seed(seed)
    p_logits = torch.randn(V, V, generator=g) * 0.8
    q_logits = p_logits + torch.randn(V, V, generator=g) * draft_noise
    return p_logits, q_logits


def verify_step(
    verifier: Verifier,
    prev: Tensor,
    pos: Tensor,
    st: SamplingTensors,
    tables: tuple[Tensor, Tensor],
    greedy_draft: bool,
    g: torch.Generator,
    counter_drafts: bool = False,
) -> tuple[Tensor, Tensor]:
    """One speculative step for B independent trials: draft K tokens from Q, verify against P.

    Drafts come from torch's generator, or (counter_drafts) from sample_draft's counter-based
    noise keyed by the same seeds and positions the verifier uses, as in the engine.
    """
    p_logits, q_logits = tables
    cur, drafts, dprobs = prev, [], []
    for i in range(K):
        if counter_drafts:
            tok, q = sample_draft(q_logits[cur], st, pos + i, greedy_draft)
        else:
            q = q_logits[cur].softmax(-1)
            tok = q.argmax(-1) if greedy_draft else torch.multinomial(q, 1, generator=g)[:, 0]
        drafts.append(tok)
        dprobs.append(q)
        cur = tok
    d = torch.stack(drafts, 1)
    ctx = torch.cat([prev[:, None], d], 1)
    target_logits = p_logits[ctx]  # [B, K+1, V]
    num_draft = torch.randint(0, K + 1, (prev.numel(),), generator=g)
    q = None if greedy_draft else torch.stack(dprobs, 1)
    return verifier(target_logits, d, q, num_draft, st, pos)


def first_two_tokens(
    verifier: Verifier,
    tables: tuple[Tensor, Tensor],
    greedy_draft: bool,
    seed: int,
    counter_drafts: bool = False,
) -> tuple[Tensor, Tensor]:
    """Generate >= 2 tokens per trial from context token 0 (a second step where needed)."""
    g = torch.Generator().manual_seed(seed)
    st = make_st(B, temperature=TEMP, seed0=seed * B)
    pos = torch.randint(0, 10_000, (B,), generator=g)
    prev = torch.zeros(B, dtype=torch.int64)
    args = (st, tables, greedy_draft, g, counter_drafts)
    out1, acc1 = verify_step(verifier, prev, pos, *args)
    out2, _ = verify_step(verifier, out1[:, 0], pos + 1, *args)
    second = torch.where(acc1 >= 1, out1[:, 1], out2[:, 0])
    return out1[:, 0], second


def target_pvalues(first: Tensor, second: Tensor, p_logits: Tensor) -> tuple[float, float]:
    p = (p_logits / TEMP).softmax(-1)
    pair = p[0][:, None] * p  # P(a | 0) * P(b | a)
    c1 = torch.bincount(first, minlength=V)
    c2 = torch.bincount(first * V + second, minlength=V * V)
    return chi2_pvalue(c1, p[0]), chi2_pvalue(c2, pair)


def biased_recover_from_p(
    target_logits: Tensor,
    draft_tokens: Tensor,
    draft_probs: Tensor | None,
    num_draft: Tensor,
    st: SamplingTensors,
    positions: Tensor,
) -> tuple[Tensor, Tensor]:
    """WRONG verifier: correct acceptance test, but the recovered token is drawn from p instead
    of norm(max(p - q, 0))."""
    g = torch.Generator().manual_seed(99)
    p = (target_logits / TEMP).softmax(-1)
    p_d = p[:, :K].gather(2, draft_tokens[..., None]).squeeze(2)
    if draft_probs is None:
        q_d = torch.ones_like(p_d)
    else:
        q_d = draft_probs.gather(2, draft_tokens[..., None]).squeeze(2)
    accept = torch.rand(p_d.shape, generator=g) * q_d < p_d
    valid = torch.arange(K)[None] < num_draft[:, None]
    n_acc = (accept & valid).long().cumprod(1).sum(1)
    final = torch.multinomial(p[torch.arange(p.shape[0]), n_acc], 1, generator=g).squeeze(1)
    out = torch.cat([draft_tokens, torch.zeros_like(draft_tokens[:, :1])], 1)
    out[torch.arange(out.shape[0]), n_acc] = final
    return out, n_acc


def biased_always_accept(
    target_logits: Tensor,
    draft_tokens: Tensor,
    draft_probs: Tensor | None,
    num_draft: Tensor,
    st: SamplingTensors,
    positions: Tensor,
) -> tuple[Tensor, Tensor]:
    """WRONG verifier: accepts every valid draft, then samples the bonus from p."""
    g = torch.Generator().manual_seed(98)
    p = (target_logits / TEMP).softmax(-1)
    bonus = torch.multinomial(p[torch.arange(p.shape[0]), num_draft], 1, generator=g).squeeze(1)
    out = torch.cat([draft_tokens, torch.zeros_like(draft_tokens[:, :1])], 1)
    out[torch.arange(out.shape[0]), num_draft] = bonus
    return out, num_draft


@pytest.mark.parametrize("counter_drafts", [False, True])
@pytest.mark.parametrize("greedy_draft", [False, True])
def test_rejection_sample_is_lossless(greedy_draft: bool, counter_drafts: bool) -> None:
    tables = markov_chain(seed=5, draft_noise=0.4 if greedy_draft else 1.0)
    first, second = first_two_tokens(rejection_sample, tables, greedy_draft, 1, counter_drafts)
    p1, p2 = target_pvalues(first, second, tables[0])
    assert p1 > 1e-3 and p2 > 1e-3, (p1, p2)


@pytest.mark.parametrize("greedy_draft", [False, True])
@pytest.mark.parametrize("biased", [biased_recover_from_p, biased_always_accept])
def test_distribution_check_has_power(biased: Verifier, greedy_draft: bool) -> None:
    """The same statistic must reject verifiers that are known to be lossy."""
    tables = markov_chain(seed=5, draft_noise=0.4 if greedy_draft else 1.0)
    first, second = first_two_tokens(biased, tables, greedy_draft, seed=1)
    p1, p2 = target_pvalues(first, second, tables[0])
    assert min(p1, p2) < 1e-6, (p1, p2)


def test_rejection_bonus_matches_plain_sample() -> None:
    """With no drafts, the verifier's token equals what `sample` draws at that position."""
    n, vocab = 64, 30
    logits = torch.randn(n, 1 + K, vocab)
    st = SamplingTensors.from_lists(
        [0.9] * n, [0, 7] * (n // 2), [1.0, 0.9] * (n // 2), [0.0] * n, list(range(n)), "cpu"
    )
    pos = torch.arange(n) * 3
    drafts = torch.zeros(n, K, dtype=torch.int64)
    out, acc = rejection_sample(logits, drafts, None, torch.zeros(n, dtype=torch.int64), st, pos)
    assert bool((acc == 0).all()) and bool((out[:, 1:] == -1).all())
    assert torch.equal(out[:, 0], sample(logits[:, 0], st, pos))


def test_rejection_batch_independent() -> None:
    n, vocab = 8, 20
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(n, K + 1, vocab, generator=g)
    drafts = torch.randint(0, vocab, (n, K), generator=g)
    q = torch.rand(n, K, vocab, generator=g)
    q = q / q.sum(-1, keepdim=True)
    nd = torch.tensor([3, 2, 0, 1, 3, 3, 2, 1])
    st = SamplingTensors.from_lists(
        [1.0, 0.0, 0.7, 1.0, 1.2, 0.0, 1.0, 0.8],
        [0] * n,
        [1.0] * n,
        [0.0] * n,
        list(range(100, 100 + n)),
        "cpu",
    )
    pos = torch.arange(n) + 50
    for probs in (q, None):
        out, acc = rejection_sample(logits, drafts, probs, nd, st, pos, method="probabilistic")
        for i in range(n):
            sl = slice(i, i + 1)
            o, a = rejection_sample(
                logits[sl],
                drafts[sl],
                None if probs is None else probs[sl],
                nd[sl],
                st.index(torch.tensor([i])),
                pos[sl],
                method="probabilistic",
            )
            assert torch.equal(o, out[sl]) and torch.equal(a, acc[sl])


def greedy_case() -> tuple[Tensor, Tensor, Tensor, list[list[int]], list[int]]:
    """Hand-built strict example: returns logits, drafts, num_draft, expected outputs, accepts."""
    argmax = torch.tensor(
        [[1, 2, 3, 4], [0, 1, 2, 3], [4, 0, 1, 2], [3, 1, 1, 1], [2, 3, 4, 0]]
    )  # target argmax per slot
    drafts = torch.tensor(
        [[1, 2, 0], [0, 1, 2], [4, 0, -1], [2, 2, 2], [2, 3, 4]]
    )  # row 2 has padding -1; row 4 matches everywhere but only 1 draft is valid
    num_draft = torch.tensor([3, 3, 2, 0, 1])
    expected = [
        [1, 2, 3, -1],  # d3 mismatches at slot 2 -> target argmax there
        [0, 1, 2, 3],  # all accepted -> bonus argmax at slot 3
        [4, 0, 1, -1],  # both valid drafts accepted -> bonus at slot 2
        [3, -1, -1, -1],  # no drafts -> plain greedy token
        [2, 3, -1, -1],  # padding drafts are ignored even when they match
    ]
    logits = torch.nn.functional.one_hot(argmax, 5).float() * 4 + torch.rand(5, 4, 5)
    return logits, drafts, num_draft, expected, [2, 3, 2, 0, 1]


@pytest.mark.parametrize("method", ["strict", "probabilistic"])
@pytest.mark.parametrize("with_probs", [False, True])
def test_strict_greedy_example(method: str, with_probs: bool) -> None:
    logits, drafts, num_draft, expected, accepted = greedy_case()
    st = make_st(5, temperature=0.0)
    probs = torch.full((5, K, 5), 0.2) if with_probs else None
    out, acc = rejection_sample(logits, drafts, probs, num_draft, st, torch.arange(5), method)
    assert out.tolist() == expected
    assert acc.tolist() == accepted
    # Greedy rows behave the same inside a batch with sampled rows.
    mixed = SamplingTensors.from_lists(
        [0.0, 1.0] * 5, [0] * 10, [1.0] * 10, [0.0] * 10, list(range(10)), "cpu"
    )
    rows = torch.arange(10) // 2
    out2, acc2 = rejection_sample(
        logits[rows],
        drafts[rows],
        None if probs is None else probs[rows],
        num_draft[rows],
        mixed,
        torch.arange(10),
        method,
    )
    assert out2[0::2].tolist() == expected and acc2[0::2].tolist() == accepted


def test_synthetic_acceptance() -> None:
    logits, drafts, num_draft, _, _ = greedy_case()
    drafts = (logits.argmax(-1)[:, :K] + 1) % 5  # never what the target would pick
    st = make_st(5, temperature=0.0)
    pos = torch.arange(5)
    out, acc = rejection_sample(logits, drafts, None, num_draft, st, pos, "synthetic", 0.0)
    assert acc.tolist() == [0] * 5
    assert torch.equal(out[:, 0], logits[:, 0].argmax(-1))
    assert bool((out[:, 1:] == -1).all())
    out, acc = rejection_sample(logits, drafts, None, num_draft, st, pos, "synthetic", 1.0)
    assert torch.equal(acc, num_draft)
    for i, n in enumerate(num_draft.tolist()):
        assert out[i, :n].tolist() == drafts[i, :n].tolist()
        assert int(out[i, n]) == int(logits[i, n].argmax())
    # Rate 0.5 over many sampled requests: P(first draft accepted) ~ 0.5.
    n = 4000
    big = torch.randn(n, K + 1, 5)
    _, acc = rejection_sample(
        big,
        torch.zeros(n, K, dtype=torch.int64),
        None,
        torch.full((n,), K),
        make_st(n),
        torch.arange(n),
        "synthetic",
        0.5,
    )
    assert abs(float((acc >= 1).float().mean()) - 0.5) < 0.04
    assert abs(float((acc == K).float().mean()) - 0.125) < 0.03


def test_rejection_rejects_unknown_method() -> None:
    logits, drafts, num_draft, _, _ = greedy_case()
    with pytest.raises(ValueError):
        rejection_sample(logits, drafts, None, num_draft, make_st(5), torch.arange(5), "bogus")
