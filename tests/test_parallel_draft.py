"""Parallel token drafting (PTD): lossless end to end, drafts equal to a from-scratch recomputation,
and the input-preparation kernel against its torch reference."""

from __future__ import annotations

import os

import pytest
import torch

from specserve import LLM, SamplingParams

from .conftest import VOCAB, random_prompts
from .spec_utils import (
    scratch_context,
    write_eagle3,
    write_ptd_draft_model,
    write_ptd_eagle,
    write_ptd_eagle3,
)
from .test_triton_attention import needs_interpreter

TARGET = ("llama_gqa", "llama")
PTD_TOKEN = VOCAB - 1
# Different max_tokens: requests finish mid-batch while others keep drafting.
MAX_TOKENS = [40, 9, 27, 3, 33]


def _params(max_tokens: list[int]) -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]


def _generate(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def setup(ckpt_dir, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("ptd")
    target = ckpt_dir(*TARGET)
    small = ckpt_dir("small_draft", "llama", num_hidden_layers=2, seed=5)
    prompts = random_prompts(5, 4, 50, seed=21)
    near = random_prompts(3, 52, 62, seed=4)
    return {
        "target": target,
        "prompts": prompts,
        "ref": _generate(LLM(target, max_model_len=256), prompts, _params(MAX_TOKENS)),
        "near": near,
        "near_ref": _generate(LLM(target, max_model_len=64), near, _params([32] * 3)),
        "eagle3": write_ptd_eagle3(os.path.join(root, "eagle3")),
        "eagle": write_ptd_eagle(os.path.join(root, "eagle")),
        "draft_model": write_ptd_draft_model(small, os.path.join(root, "draft_model")),
        "plain_eagle3": write_eagle3(os.path.join(root, "plain_eagle3")),
    }


def ptd_llm(
    setup: dict,
    method: str,
    k: int,
    target: str | None = None,
    adaptive: bool = True,
    **kw,
) -> LLM:
    cfg = {
        "method": method,
        "model": setup[method],
        "num_speculative_tokens": k,
        "parallel_draft": True,
        "adaptive": adaptive,
    }
    return LLM(target or setup["target"], speculative_config=cfg, **kw)


# A pool that preempts even without drafts (7 blocks of 16 against the prompts' 177 tokens plus
# their outputs): the adaptive budget, which may verify few drafts, preempts too.
PREEMPT = {"num_gpu_blocks_override": 7, "max_num_batched_tokens": 64}


@pytest.mark.parametrize("adaptive", [True, False])
@pytest.mark.parametrize("k", range(2, 9))
def test_greedy_equivalence_all_k(setup: dict, k: int, adaptive: bool) -> None:
    """EAGLE-3 PTD for every K, under the adaptive budget (K switching between steps, 0 runs
    no drafter) and at a fixed K: requests finishing mid-batch, a KV pool small enough to
    preempt, and prompts ending near max_model_len (mask slots past it write no KV, never
    verified)."""
    for mode in ({}, PREEMPT):
        llm = ptd_llm(setup, "eagle3", k, max_model_len=256, adaptive=adaptive, **mode)
        assert _generate(llm, setup["prompts"], _params(MAX_TOKENS)) == setup["ref"]
        m = llm.get_metrics()
        assert m["spec_decode_num_drafts_total"] > 0
        assert m["kv_cache_usage_perc"] == 0.0
        assert m["num_preemptions_total"] > 0 or not mode
    llm = ptd_llm(setup, "eagle3", k, max_model_len=64, adaptive=adaptive)
    outs = _generate(llm, setup["near"], _params([32] * 3))
    assert outs == setup["near_ref"]
    assert all(len(p) + len(o) <= 64 for p, o in zip(setup["near"], outs))


@pytest.mark.parametrize(
    "method, k, mode",
    [
        ("eagle", 3, {}),
        ("eagle", 6, PREEMPT),
        ("draft_model", 2, {}),
        ("draft_model", 5, PREEMPT),
        ("draft_model", 7, {"max_num_batched_tokens": 24}),
        ("eagle3", 4, {"max_num_batched_tokens": 24}),
    ],
)
@pytest.mark.parametrize("adaptive", [True, False])
def test_greedy_equivalence_methods_and_modes(
    setup: dict, method: str, k: int, mode: dict, adaptive: bool
) -> None:
    llm = ptd_llm(setup, method, k, max_model_len=256, adaptive=adaptive, **mode)
    assert _generate(llm, setup["prompts"], _params(MAX_TOKENS)) == setup["ref"]
    if "num_gpu_blocks_override" in mode:
        assert llm.get_metrics()["num_preemptions_total"] > 0


@pytest.mark.parametrize("method, k", [("eagle", 8), ("draft_model", 8)])
def test_near_max_model_len(setup: dict, method: str, k: int) -> None:
    llm = ptd_llm(setup, method, k, max_model_len=64)
    assert _generate(llm, setup["near"], _params([32] * 3)) == setup["near_ref"]


def test_all_drafts_accepted(setup: dict, tmp_path) -> None:
    """A looped target (zero lm_head: always token 0) and a head that always drafts 0: every
    draft is accepted, so the all-accepted layout (no rejected padding) runs every step."""
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(setup["target"])
    with torch.no_grad():
        model.lm_head.weight.zero_()
    looped = str(tmp_path / "looped")
    model.save_pretrained(looped)
    setup = {**setup, "eagle3": write_ptd_eagle3(str(tmp_path / "zero"), zero_lm_head=True)}
    prompts = setup["near"] + setup["prompts"][:2]
    llm = ptd_llm(setup, "eagle3", 6, target=looped, max_model_len=64, max_num_batched_tokens=40)
    outs = _generate(llm, prompts, _params([32, 20, 7, 32, 11]))
    assert outs == [[0] * min(m, 64 - len(p)) for p, m in zip(prompts, [32, 20, 7, 32, 11])]
    m = llm.get_metrics()
    assert m["spec_decode_num_drafts_total"] > 0
    assert m["spec_decode_num_accepted_tokens_total"] == m["spec_decode_num_draft_tokens_total"]


@pytest.mark.parametrize("method, k", [("eagle3", 5), ("draft_model", 4)])
def test_drafts_equal_from_scratch_recomputation(setup: dict, method: str, k: int) -> None:
    """After every step, each request's K drafts in the token buffer equal the drafts of ONE
    from-scratch drafter forward over its accepted sequence followed by K-1 mask slots."""
    # Fixed K: every step's K drafts are compared; the adaptive budget drafts fewer, or none.
    llm = ptd_llm(
        setup,
        method,
        k,
        adaptive=False,
        max_model_len=72,
        max_num_batched_tokens=32,
        max_num_seqs=3,
    )
    eng = llm.engine
    runner, spec = eng.runner, eng.speculator
    d = spec.model
    prompts = setup["near"][:1] + setup["prompts"][:3]
    for i, (p, mt) in enumerate(zip(prompts, [20, 12, 30, 25])):
        eng.add_request(str(i), {"prompt_token_ids": p}, _params([mt])[0])
    sampled: set[str] = set()  # requests that drafted in the latest step
    launch = runner.launch  # the engine launches every step (then finishes it)

    def recording_launch(sched, lp, *a, **kw):  # noqa: ANN001, ANN002, ANN202, ANN003
        sampled.clear()
        sampled.update(s.req.request_id for s in sched.scheduled if s.samples)
        return launch(sched, lp, *a, **kw)

    runner.launch = recording_launch
    checked = 0
    while eng.has_unfinished_requests():
        eng.step()
        for req in eng.scheduler.running:
            if req.row < 0 or req.request_id not in sampled:
                continue  # preempted, mid-prompt or not scheduled: no new drafts
            L = req.num_tokens - 1  # the newest token's position
            toks = torch.tensor(req.all_token_ids)
            n_real = L + 1 - d.shift
            n = n_real + k - 1
            ids = torch.cat([toks[d.shift : d.shift + n_real], torch.full((k - 1,), PTD_TOKEN)])
            h = None
            with torch.inference_mode():
                if d.uses_hidden:
                    ctx = scratch_context(runner, L)
                    hid, aux = runner.model(toks[:L], torch.arange(L), ctx, runner.aux_layers)
                    fused = d.combine_hidden(hid, aux)
                    h = torch.cat([fused, d.mask_hidden[None].expand(k - 1, -1)])
                out, _ = d(ids, torch.arange(n), h, scratch_context(runner, n))
                ref = d.to_target_ids(d.draft_logits(out[n_real - 1 :]).argmax(-1))
            got = runner.states.token_ids[req.row, L + 1 : L + 1 + k]
            # Drafts whose predicting slot sits at or past max_model_len are never verified.
            valid = n_real - 1 + torch.arange(k) < runner.max_model_len
            assert torch.equal(got[valid], ref[valid]), (req.request_id, L)
            checked += 1
    assert checked >= 10


@pytest.mark.parametrize(
    "cfg, match",
    [
        ({"method": "eagle3", "model": "plain_eagle3"}, 'lacks "parallel_draft": true'),
        ({"method": "ngram"}, "parallel drafting is supported for"),
        ({"method": "mtp"}, "parallel drafting is supported for"),
    ],
)
def test_bad_ptd_configs(setup: dict, cfg: dict, match: str) -> None:
    cfg = {**cfg, "parallel_draft": True}
    if "model" in cfg:
        cfg["model"] = setup[cfg["model"]]
    with pytest.raises(ValueError, match=match):
        LLM(setup["target"], speculative_config=cfg)


@pytest.mark.parametrize(
    "extra, match",
    [
        ({"ptd_token_id": VOCAB}, "needs an integer ptd_token_id in"),
        ({"ptd_token_id": 5}, "has no mask_hidden tensor"),
    ],
)
def test_bad_ptd_checkpoints(setup: dict, tmp_path, extra: dict, match: str) -> None:
    import json
    import shutil

    path = str(tmp_path / "bad")
    shutil.copytree(setup["plain_eagle3"], path)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**cfg, "parallel_draft": True, **extra}, f)
    spec = {"method": "eagle3", "model": path, "parallel_draft": True}
    with pytest.raises(ValueError, match=match):
        LLM(setup["target"], speculative_config=spec)


# ---- input preparation: Triton kernel vs torch reference ------------------------------------
def _random_step(
    g: torch.Generator, k: int, block_size: int, max_model_len: int
) -> tuple[tuple, dict]:
    """A mixed batch: decode rows with random accept counts (incl. 0 and all), rows near
    max_model_len, a mid-prompt chunk, a fresh prefill; shuffled persistent rows."""
    rows_total, B = 12, 7
    max_blocks = (max_model_len + block_size - 1) // block_size
    width = max_model_len + k + 2
    starts, nsched, ndraft, nacc, samples = [], [], [], [], []
    for b in range(B):
        kind = b % 4
        if kind == 0:  # prefill chunk (mid-prompt when b == 4)
            n = int(torch.randint(3, 40, (1,), generator=g))
            starts.append(int(torch.randint(0, max_model_len - n - k - 1, (1,), generator=g)))
            nsched.append(n), ndraft.append(0), nacc.append(0), samples.append(int(b != 4))
        else:
            nd = int(torch.randint(0, k + 1, (1,), generator=g))
            near = kind == 3
            lo = max_model_len - nd - 2 if near else 0
            starts.append(int(torch.randint(lo, max_model_len - nd - 1, (1,), generator=g)))
            nsched.append(nd + 1), ndraft.append(nd)
            nacc.append(int(torch.randint(0, nd + 1, (1,), generator=g)) if b != 1 else nd)
            samples.append(1)
    qsl = torch.tensor([0] + nsched).cumsum(0)
    positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, nsched)])
    i64 = torch.int64
    args = (
        qsl,
        positions,
        torch.randperm(rows_total, generator=g)[:B],
        torch.tensor(ndraft, dtype=i64),
        torch.tensor(nacc, dtype=i64),
        torch.tensor(samples, dtype=i64),
        torch.tensor([s + n for s, n in zip(starts, nsched)], dtype=i64),
        torch.randint(0, VOCAB, (rows_total, width), generator=g),
        torch.randint(0, 500, (rows_total, max_blocks), generator=g).to(torch.int32),
    )
    return args, {"max_query_len": max(nsched)}


@needs_interpreter
@pytest.mark.parametrize("k, shift", [(2, 1), (5, 1), (8, 1), (3, 0), (8, 0)])
def test_prepare_kernel_matches_reference(k: int, shift: int) -> None:
    from specserve.spec_decode.parallel import (
        ParallelDraftBuffers,
        prepare_parallel_inputs,
        prepare_parallel_inputs_ref,
    )

    g = torch.Generator().manual_seed(k * 10 + shift)
    kw = dict(k=k, shift=shift, mask_token_id=PTD_TOKEN, max_model_len=100, block_size=16)
    for block in (16, 128):  # 16: regions span several programs
        args, host = _random_step(g, k, 16, 100)
        ref = prepare_parallel_inputs_ref(*args, **kw)
        bufs = ParallelDraftBuffers(400, 16, k, torch.device("cpu"))
        out = prepare_parallel_inputs(bufs, *args, **kw, **host, block=block)
        for name in ref.__dataclass_fields__:
            assert torch.equal(getattr(out, name), getattr(ref, name)), name
        # Host and device agree on the enlarged layout: rejected drafts stay as padding.
        qsl, B = args[0], args[2].shape[0]
        assert torch.equal(out.query_start_loc, qsl + torch.arange(B + 1) * (k - shift))
        assert (out.slot_mapping[out.positions >= 100] == -1).all()


@pytest.mark.parametrize("method", ["eagle3", "draft_model"])
def test_seeded_probabilistic_drafting_is_batch_invariant(setup: dict, method: str) -> None:
    """Sampled drafts (their probabilities feed the rejection sampler, EAGLE-3's through d2t)
    are keyed by (seed, position): a seeded request gives the same tokens alone or batched."""
    spec = {"draft_sample_method": "probabilistic", "rejection_sample_method": "probabilistic"}
    # Fixed K: probabilistic verification's draws depend on K, which the budget sets per batch.
    cfg = {"method": method, "model": setup[method], "num_speculative_tokens": 4, "adaptive": False}
    llm = LLM(
        setup["target"],
        max_model_len=256,
        speculative_config={**cfg, **spec, "parallel_draft": True},
    )
    sp = SamplingParams(temperature=0.9, seed=77, max_tokens=24, ignore_eos=True)
    p = {"prompt_token_ids": setup["prompts"][0]}
    alone = llm.generate(p, sp)[0].outputs[0].token_ids
    others = [{"prompt_token_ids": q} for q in setup["prompts"][1:]]
    osp = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    batch = llm.generate(others[:2] + [p] + others[2:], [osp, osp, sp, osp, osp])
    assert batch[2].outputs[0].token_ids == alone
    assert llm.get_metrics()["spec_decode_num_drafts_total"] > 0


@pytest.mark.parametrize("k", [2, 5, 8])
def test_buffers_cover_every_captured_batch(k: int) -> None:
    """The PTD buffers hold the largest enlarged batch of any captured target graph, also when
    the token budget is smaller than a full uniform batch (a GPU run with
    max_num_batched_tokens=32 overflowed them), and the kernel refuses a batch that does not
    fit instead of writing past the buffers."""
    pytest.importorskip("triton")
    from specserve.spec_decode.parallel import (
        ParallelDraftBuffers,
        ParallelDraftSpeculator,
        prepare_parallel_inputs,
    )
    from specserve.worker.cudagraph import capture_sizes

    for budget, seqs in ((32, 64), (2048, 64), (64, 256), (8192, 8)):
        n = ParallelDraftSpeculator.max_slots(budget, seqs, k)
        graph = max(b * (k + 1 + k) for b in capture_sizes(seqs))
        assert n >= max(graph, budget + seqs * k)
    g = torch.Generator().manual_seed(k)
    args, host = _random_step(g, k, 16, 100)
    small = ParallelDraftBuffers(8, 16, k, torch.device("cpu"))
    with pytest.raises(ValueError, match="PTD buffers hold 8 slots"):
        prepare_parallel_inputs(
            small, *args, k=k, shift=1, mask_token_id=PTD_TOKEN, max_model_len=100,
            block_size=16, **host,
        )  # fmt: skip
