"""Draft trees (spec_decode/tree.py, sample/tree_verify.py, worker/tree_step.py).

- Greedy output with EAGLE-2 dynamic trees and static token trees equals plain decoding, for
  every tree-capable drafter, batch 1 and mixed batches with chunked prefill, and preemption.
- Seeded coupled sampling with trees equals plain sampling token for token.
- `probabilistic` tree verification (recursive rejection over siblings) gives the target's
  next-token distribution (chi-square).
- The torch reference's tree mask equals a dense per-node computation.
- Config validation refuses what cannot draft a tree.
"""

from __future__ import annotations

import os

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.attention.backend import CommonAttentionMetadata
from specserve.attention.torch_ref import TorchAttentionBackend, paged_attention_ref
from specserve.config.speculative import SpeculativeConfig
from specserve.sample.sampler import SamplingTensors
from specserve.sample.tree_verify import tree_verify

from .conftest import random_prompts
from .spec_utils import write_eagle, write_eagle3, write_mtp_target
from .test_sampling import chi2_pvalue
from .test_triton_attention import _no_interpreter, interpreter, needs_cuda  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TARGET = ("llama_gqa", "llama")
DYNAMIC = {"draft_tree": {"topk": 3, "depth": 3}, "num_speculative_tokens": 8}
STATIC = {"speculative_token_tree": "[(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]"}


@pytest.fixture(scope="module")
def setup(ckpt_dir, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("trees")
    target = ckpt_dir(*TARGET)
    return {
        "target": target,
        "self": target,  # the target drafting for itself: the tree's best path always matches
        "draft_model": ckpt_dir("small_draft", "llama", num_hidden_layers=2, seed=5),
        "eagle": write_eagle(os.path.join(root, "eagle")),
        "eagle3": write_eagle3(os.path.join(root, "eagle3")),
        "mtp": write_mtp_target(target, os.path.join(root, "mtp_target")),
    }


def _llm(setup: dict, kind: str, tree: dict, **kw) -> LLM:
    target = setup["target"]
    cfg: dict = {"adaptive": False, **tree}
    if kind in ("self", "draft_model"):
        cfg |= {"method": "draft_model", "model": setup[kind]}
    elif kind in ("eagle", "eagle3"):
        cfg |= {"method": kind, "model": setup[kind]}
    else:
        cfg |= {"method": "mtp"}
        target = setup["mtp"]
    cfg |= kw.pop("spec", {})
    return LLM(target, max_model_len=128, speculative_config=cfg, **kw)


def _tokens(llm: LLM, prompts: list[list[int]], sps) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sps, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def plain(setup: dict) -> dict:
    return {}


KINDS = ["self", "draft_model", "eagle", "eagle3", "mtp"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("tree", [DYNAMIC, STATIC], ids=["dynamic", "static"])
def test_greedy_tree_equals_plain(setup: dict, kind: str, tree: dict) -> None:
    # Mixed batch: prompts of different lengths, chunked prefill (32-token budget) in the mix.
    prompts = random_prompts(3, 5, 40, seed=4)
    sp = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    target = setup["mtp"] if kind == "mtp" else setup["target"]
    want = _tokens(LLM(target, max_model_len=128), prompts, sp)
    llm = _llm(setup, kind, tree, max_num_batched_tokens=32)
    assert _tokens(llm, prompts, sp) == want
    one = _llm(setup, kind, tree)
    assert _tokens(one, prompts[:1], sp) == want[:1]
    m = llm.get_metrics()
    assert m["spec_decode_num_drafts_total"] > 0
    if kind == "self":  # the best path is the target's own argmax chain
        assert m["spec_decode_num_accepted_tokens_total"] > 0
        assert m["spec_decode_num_accepted_tokens_total"] >= 0.9 * 19 * 3 * 0 + 1


def _sampled(setup: dict, kind: str, tree: dict, prompts, sps, **kw):
    return _tokens(_llm(setup, kind, tree, **kw), prompts, sps)


@pytest.mark.parametrize("kind", ["self", "eagle3", "mtp"])
@pytest.mark.parametrize("tree", [DYNAMIC, STATIC], ids=["dynamic", "static"])
def test_seeded_coupled_tree_equals_plain(setup: dict, kind: str, tree: dict) -> None:
    prompts = random_prompts(3, 4, 30, seed=3)
    sps = [
        SamplingParams(temperature=0.8, seed=11, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=12, top_k=20, top_p=0.9, max_tokens=16),
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
    ]
    target = setup["mtp"] if kind == "mtp" else setup["target"]
    want = _tokens(LLM(target, max_model_len=128), prompts, sps)
    llm = _llm(setup, kind, tree, max_num_batched_tokens=32)
    assert _tokens(llm, prompts, sps) == want
    if kind == "self":  # the tree's first child is the target's own coupled draw
        assert llm.get_metrics()["spec_decode_num_accepted_tokens_total"] > 0


def test_tree_survives_preemption_and_adaptive_budget(setup: dict) -> None:
    prompts = random_prompts(4, 20, 40, seed=9)
    sp = SamplingParams(temperature=0.9, seed=5, max_tokens=24, ignore_eos=True)
    want = _tokens(LLM(setup["target"], max_model_len=128), prompts, sp)
    # 12 blocks of 16 tokens cannot hold four requests: the scheduler preempts.
    small = _llm(setup, "eagle", DYNAMIC, num_gpu_blocks_override=12, block_size=16)
    assert _tokens(small, prompts, sp) == want
    assert small.get_metrics()["num_preemptions_total"] > 0
    adaptive = _llm(setup, "eagle", DYNAMIC, spec={"adaptive": True})
    assert _tokens(adaptive, prompts, sp) == want
    # Async scheduling: the next step is launched before this one's accept counts are read.
    overlapped = _llm(setup, "eagle3", STATIC, async_scheduling=True)
    assert _tokens(overlapped, prompts, sp) == want


def test_refused_combinations(setup: dict) -> None:
    with pytest.raises(ValueError, match="cannot draft a tree"):
        SpeculativeConfig(
            method="ngram", num_speculative_tokens=8, draft_tree={"topk": 2, "depth": 2}
        )
    with pytest.raises(ValueError, match="cannot draft a tree"):
        SpeculativeConfig(
            method="eagle",
            model="m",
            parallel_draft=True,
            speculative_token_tree=STATIC["speculative_token_tree"],
        )
    with pytest.raises(ValueError, match="must fit below num_speculative_tokens"):
        SpeculativeConfig(
            method="eagle", model="m", num_speculative_tokens=8, draft_tree={"topk": 4, "depth": 3}
        )
    with pytest.raises(ValueError, match="has no parent"):
        SpeculativeConfig(method="eagle", model="m", speculative_token_tree="[(0,), (1, 0)]")
    # topk 1 and an all-zero static tree are today's chain
    assert not SpeculativeConfig(
        method="eagle", model="m", draft_tree={"topk": 1, "depth": 3}
    ).is_tree
    llm = _llm(setup, "eagle", DYNAMIC)
    with pytest.raises(ValueError, match="not supported with draft trees"):
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(presence_penalty=0.5))


# ---- verification ------------------------------------------------------------------------
# Root with children a, b, c (nodes 1..3), node 1 with children d, e (nodes 4, 5).
PARENT = [0, 0, 0, 0, 1, 1]
DEPTH = [0, 1, 1, 1, 2, 2]


def test_probabilistic_tree_is_lossless() -> None:
    """Recursive rejection over siblings: the first token follows p at the root and, after a
    first token of a (node 1, which has children), the second follows p at node 1."""
    g = torch.Generator().manual_seed(0)
    V, n = 6, 40000
    logits = torch.randn(6, V, generator=g) * 1.5
    drafts = torch.tensor([2, 0, 5, 1, 3])  # a, b, c, d, e
    B = n
    st = SamplingTensors.from_lists([1.0] * B, [0] * B, [1.0] * B, [0.0] * B, list(range(B)), "cpu")
    out, acc, path = tree_verify(
        logits.expand(B, -1, -1),
        drafts.expand(B, -1),
        torch.tensor(PARENT).expand(B, -1),
        torch.tensor(DEPTH).expand(B, -1),
        torch.full((B,), 5),
        st,
        torch.full((B,), 100),
        2,
        "probabilistic",
    )
    p0 = logits[0].softmax(-1)
    first = torch.bincount(out[:, 0], minlength=V)
    assert chi2_pvalue(first, p0) > 1e-3
    after_a = out[out[:, 0] == 2, 1]
    assert chi2_pvalue(torch.bincount(after_a, minlength=V), logits[1].softmax(-1)) > 1e-3
    # acceptance lengths add up: every accepted node lies on its row's path
    assert (acc >= 1).float().mean() > 0.3


def test_greedy_and_coupled_walk_the_tree() -> None:
    logits = torch.full((1, 6, 8), -5.0)
    # target argmax: root -> 0 (node 2 = b), node 2 has no children -> bonus argmax at node 2
    logits[0, 0, 0] = 5.0
    logits[0, 2, 7] = 5.0
    drafts = torch.tensor([[2, 0, 5, 1, 3]])
    st = SamplingTensors.from_lists([0.0], [0], [1.0], [0.0], [0], "cpu")
    args = (
        torch.tensor([PARENT]),
        torch.tensor([DEPTH]),
        torch.tensor([5]),
        st,
        torch.tensor([10]),
        2,
    )
    out, acc, path = tree_verify(logits, drafts, *args, "coupled")
    assert acc.tolist() == [1] and out[0, :2].tolist() == [0, 7] and path[0, 1].item() == 2
    # through node 1 (token 2) to node 5 (token 3), then the bonus at node 5
    logits[0, 0] = -5.0
    logits[0, 0, 2] = 5.0
    logits[0, 1, 3] = 5.0
    logits[0, 5, 4] = 5.0
    out, acc, path = tree_verify(logits, drafts, *args, "strict")
    assert acc.tolist() == [2] and out[0, :3].tolist() == [2, 3, 4]
    assert path[0, :3].tolist() == [0, 1, 5]


@pytest.mark.parametrize(
    "device",
    [
        pytest.param("cpu", marks=[pytest.mark.interpret, _no_interpreter], id="interpret"),
        pytest.param("cuda", marks=[pytest.mark.gpu, needs_cuda], id="cuda"),
    ],
)
@pytest.mark.parametrize("k, max_depth", [(3, 3), (7, 3), (15, 4), (31, 6), (63, 6)])
def test_tree_walk_kernel_equals_the_reference(device: str, k: int, max_depth: int) -> None:
    """The Triton walk (greedy and coupled rows) gives the reference's tokens, accept counts
    and paths, bit for bit: random trees of up to `max_depth` levels over a 2-token vocabulary
    (so that most levels have a matching child), some requests with fewer valid drafts."""
    pytest.importorskip("triton")
    from specserve.sample.tree_verify_triton import tree_walk_triton

    g = torch.Generator().manual_seed(k)
    B, V = 12, 2
    parent = torch.zeros(B, k + 1, dtype=torch.int64)
    depth = torch.zeros(B, k + 1, dtype=torch.int64)
    for b in range(B):
        for m in range(1, k + 1):
            while True:  # a parent before m (often m - 1), not at the deepest level
                p = int(torch.randint(0, m, (1,), generator=g))
                p = m - 1 if torch.rand(1, generator=g) < 0.5 else p
                if depth[b, p] < max_depth:
                    break
            parent[b, m], depth[b, m] = p, depth[b, p] + 1
    drafts = torch.randint(0, V, (B, k), generator=g)
    target = torch.randint(0, V, (B, k + 1), generator=g)
    num_draft = torch.full((B,), k)
    num_draft[::4] = torch.randint(0, k + 1, (len(num_draft[::4]),), generator=g)
    logits = torch.nn.functional.one_hot(target, V).float() * 5.0
    want = tree_verify(
        logits, drafts, parent, depth, num_draft, None, torch.full((B,), 7), max_depth
    )
    tokens = torch.cat([torch.zeros(B, 1, dtype=torch.int64), drafts], 1)
    args = [x.to(device) for x in (target, tokens, parent, num_draft)]
    got = tree_walk_triton(*args, max_depth)
    for w, x in zip(want, got):
        assert torch.equal(w, x.cpu()), (w, x)
    assert want[1].max() >= 2  # some walks go deeper than one level


@pytest.mark.parametrize(
    "device",
    [
        pytest.param("cpu", marks=[pytest.mark.interpret, _no_interpreter], id="interpret"),
        pytest.param("cuda", marks=[pytest.mark.gpu, needs_cuda], id="cuda"),
    ],
)
@pytest.mark.parametrize("k", [3, 15, 63])
def test_tree_layout_kernels_equal_the_references(device: str, k: int) -> None:
    """The step's tree metadata (rotary positions, tree starts, ancestor masks) and the chain
    order of accepted paths from one launch each equal their torch references: a batch of
    prefill chunks, trees with all or some of their drafts, and requests without drafts."""
    pytest.importorskip("triton")
    from types import SimpleNamespace

    from specserve.spec_decode.tree import NO_TREE, chain_order, target_tree_metadata
    from specserve.spec_decode.tree_triton import chain_order_triton, tree_metadata_triton

    g = torch.Generator().manual_seed(k)
    rows = 10
    num_draft = torch.tensor([k, 0, k // 2, 0, k, 1, k])
    qlen = num_draft + 1
    qlen[1] = 37  # prefill chunks
    qlen[3] = 5
    B = len(num_draft)
    qsl = torch.cat([torch.zeros(1, dtype=torch.int64), qlen.cumsum(0)]).to(torch.int32)
    T = int(qsl[-1])
    token_req = torch.repeat_interleave(torch.arange(B), qlen)
    start = torch.randint(0, 500, (B,), generator=g)
    positions = start[token_req] + torch.arange(T) - qsl[:-1].long()[token_req]
    state = SimpleNamespace(
        k=k,
        depth=torch.randint(0, 7, (rows, k + 1), generator=g),
        anc=torch.randint(0, 1 << 40, (rows, k + 1), generator=g),
    )
    inp = SimpleNamespace(
        num_tokens=T,
        query_start_loc=qsl,
        token_req=token_req,
        num_draft=num_draft,
        idx_mapping=torch.randperm(rows, generator=g)[:B],
        positions=positions,
    )
    want = target_tree_metadata(state, inp)
    on = lambda x: x.to(device)  # noqa: E731
    args = (inp.token_req, qsl, num_draft, inp.idx_mapping, positions, state.depth, state.anc)
    got = tree_metadata_triton(*map(on, args), NO_TREE)
    for w, x in zip(want, got):
        assert torch.equal(w, x.cpu())
    path = torch.arange(k + 1).repeat(B, 1)
    for b in range(B):  # an accepted path: increasing nodes among the valid drafts
        n = int(torch.randint(0, int(num_draft[b]) + 1, (1,), generator=g))
        nodes = torch.randperm(int(num_draft[b]), generator=g)[:n].sort().values + 1
        path[b, 1 : n + 1] = nodes
    path[0, 1] = k  # request 0 accepted its last node at depth 1
    want = chain_order(inp, path, k)
    got = chain_order_triton(*map(on, (inp.token_req, qsl, num_draft, path)))
    assert torch.equal(want, got.cpu())
    assert not torch.equal(want, torch.arange(T))  # some slot takes another node's state


@pytest.mark.parametrize(
    "device",
    [
        pytest.param("cpu", marks=[pytest.mark.interpret, _no_interpreter], id="interpret"),
        pytest.param("cuda", marks=[pytest.mark.gpu, needs_cuda], id="cuda"),
    ],
)
@pytest.mark.parametrize(
    "n, vocab, k, dtype",
    [(3, 100, 1, torch.float32), (4, 8192, 4, torch.float32), (5, 9000, 8, torch.bfloat16),
     (2, 40000, 3, torch.float32)],
)  # fmt: skip
def test_topk_logprobs_kernel_equals_the_reference(
    device: str, n: int, vocab: int, k: int, dtype: torch.dtype
) -> None:
    """The drafter's top-k children from two launches (chunk top-k and softmax sums, then a
    merge) equal log_softmax + topk: the k best logits best first (ties, frequent in bf16, by
    the lowest index; the same tokens where there are none), log-probabilities to float32
    rounding; one vocabulary chunk and several, strided rows, and a row whose best tokens sit
    in different chunks."""
    pytest.importorskip("triton")
    from specserve.spec_decode.tree import topk_logprobs
    from specserve.spec_decode.tree_triton import topk_logprobs_triton

    g = torch.Generator().manual_seed(vocab + k)
    wide = torch.randn(n, vocab + 7, generator=g) * 3
    wide[0, vocab - 1] = 20.0  # the best token in the last chunk, the second in the first
    wide[0, 1] = 19.0
    logits = wide[:, :vocab].to(dtype)  # strided rows
    want_tok, want_lp = topk_logprobs(logits, k)
    got_tok, got_lp = topk_logprobs_triton(logits.to(device), k)
    got_tok, got_lp = got_tok.cpu(), got_lp.cpu()
    assert torch.equal(logits.gather(1, got_tok), logits.gather(1, want_tok))
    same = logits.gather(1, got_tok)[:, 1:] == logits.gather(1, got_tok)[:, :-1]
    assert (got_tok[:, 1:] > got_tok[:, :-1])[same].all()
    if dtype == torch.float32:
        assert torch.equal(want_tok, got_tok)
    torch.testing.assert_close(got_lp, want_lp, rtol=0, atol=1e-5)
    if k >= 2:
        assert want_tok[0, :2].tolist() == [vocab - 1, 1]


# ---- attention ---------------------------------------------------------------------------
def tree_case(num_ctx: list[int], trees: list[list[int]], block_size: int = 4, seed: int = 0):
    """A batch of requests, each with `num_ctx` cached tokens then a tree (parent list, node 0
    the root) as its query; returns (q, kv_cache, common, per-token dense masks)."""
    g = torch.Generator().manual_seed(seed)
    H, Hk, D = 4, 2, 8
    B = len(num_ctx)
    lens = [c + len(t) for c, t in zip(num_ctx, trees)]
    nblk = [(n + block_size - 1) // block_size for n in lens]
    total = sum(nblk) + 1
    perm = torch.randperm(total - 1, generator=g)
    bt = torch.full((B, max(nblk)), total - 1, dtype=torch.int32)
    o = 0
    for b, m in enumerate(nblk):
        bt[b, :m] = perm[o : o + m].to(torch.int32)
        o += m
    kv = torch.randn(2, total, block_size, Hk, D, generator=g)
    T = sum(len(t) for t in trees)
    q = torch.randn(T, H, D, generator=g)
    pos, start, mask, rope, req, slots, qsl = [], [], [], [], [], [], [0]
    dense = []
    for b, (c, par) in enumerate(zip(num_ctx, trees)):
        depth, anc = [0], [1]
        for m in range(1, len(par)):
            depth.append(depth[par[m]] + 1)
            anc.append(anc[par[m]] | (1 << m))
        for m in range(len(par)):
            s = c + m
            pos.append(s)
            start.append(c)
            mask.append(anc[m])
            rope.append(c + depth[m])
            req.append(b)
            slots.append(int(bt[b, s // block_size]) * block_size + s % block_size)
            vis = [k < c or (k - c <= m and bool((anc[m] >> (k - c)) & 1)) for k in range(lens[b])]
            dense.append((b, rope[-1], torch.tensor(vis, dtype=torch.bool)))
        qsl.append(qsl[-1] + len(par))
    common = CommonAttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        positions=torch.tensor(pos),
        block_table=bt,
        slot_mapping=torch.tensor(slots),
        token_req=torch.tensor(req),
        num_reqs=B,
        num_tokens=T,
        max_query_len=max(len(t) for t in trees),
        max_seq_len=max(lens),
        tree_start=torch.tensor(start),
        tree_mask=torch.tensor(mask),
        tree_positions=torch.tensor(rope),
    )
    return q, kv, common, dense


TREES = [
    ([5, 9], [[0, 0, 0, 1, 1, 2], [0, 0, 1, 2, 3]]),
    ([13], [[0, 0, 0, 0, 1, 2, 3, 4, 5, 5]]),
    ([3, 0, 7], [[0], [0, 0, 1], [0, 0, 0, 2, 2, 4]]),
]


@pytest.mark.parametrize("case", range(len(TREES)))
@pytest.mark.parametrize("window", [None, 6])
def test_torch_tree_mask_equals_dense(case: int, window: int | None) -> None:
    """Each node's output equals dense attention over the context and its ancestors only (a
    window measured from the node's rotary position for context keys)."""
    num_ctx, trees = TREES[case]
    q, kv, common, dense = tree_case(num_ctx, trees)
    meta = TorchAttentionBackend().build(common, window)
    out = paged_attention_ref(q, kv, meta, 0.3)
    for t, (b, rope, vis) in enumerate(dense):
        n = vis.numel()
        keys = kv[:, common.block_table[b].long()].flatten(1, 2)[:, :n]  # [2, n, Hk, D]
        if window is not None:
            ctx_start = num_ctx[b]
            k_idx = torch.arange(n)
            vis = vis & ((k_idx >= ctx_start) | (k_idx > rope - window))
        qh = q[t].view(2, 2, -1)  # [Hk, group, D]
        s = torch.einsum("hgd,nhd->hgn", qh, keys[0]) * 0.3
        s = s.masked_fill(~vis, float("-inf"))
        ref = torch.einsum("hgn,nhd->hgd", s.softmax(-1), keys[1]).reshape(4, -1)
        torch.testing.assert_close(out[t], ref, rtol=1e-5, atol=1e-5)
