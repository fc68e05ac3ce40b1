"""Multi-layer MTP (N chained modules): lossless end to end, and every module's paged KV (and
drafts) equal to a from-scratch recomputation of the accepted sequence after every step."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from specserve import LLM, SamplingParams

from .conftest import random_prompts
from .draft_utils import drafts_per_step
from .spec_utils import paged_kv, scratch_context, write_multi_mtp_target

TARGET = ("llama_gqa", "llama")
MAX_TOKENS = [40, 9, 27, 3, 33]


def _params(max_tokens: list[int]) -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]


def _generate(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def setup(ckpt_dir, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("mtp_n")
    target = ckpt_dir(*TARGET)
    prompts = random_prompts(5, 4, 50, seed=21)
    near = random_prompts(3, 52, 62, seed=4)
    return {
        "target": target,
        "prompts": prompts,
        "ref": _generate(LLM(target, max_model_len=256), prompts, _params(MAX_TOKENS)),
        "near": near,
        "near_ref": _generate(LLM(target, max_model_len=64), near, _params([32] * 3)),
        2: write_multi_mtp_target(target, os.path.join(root, "mtp2"), 2, seed=3),
        3: write_multi_mtp_target(target, os.path.join(root, "mtp3"), 3, seed=4),
    }


def mtp_llm(target: str, k: int, **kw) -> LLM:
    cfg = {"method": "mtp", "num_speculative_tokens": k, **kw.pop("spec", {})}
    return LLM(target, speculative_config=cfg, **kw)


MODES = {
    "plain": {},
    "chunked": {"max_num_batched_tokens": 24},
    # Preempts even without drafts (7 blocks of 16 against the prompts' 177 tokens plus their
    # outputs): the adaptive budget, which may verify few drafts, preempts too.
    "preempt": {"num_gpu_blocks_override": 7, "max_num_batched_tokens": 64},
}


@pytest.mark.parametrize("adaptive", [True, False])
@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_equivalence(setup: dict, n: int, mode: str, adaptive: bool) -> None:
    """Under the adaptive budget (K switching between steps, 0 running no module: the carried
    hidden states and module KV go stale, which costs acceptance only) and at a fixed K."""
    spec = {"adaptive": adaptive}
    llm = mtp_llm(setup[n], n, spec=spec, max_model_len=256, **MODES[mode])
    assert len(llm.engine.speculator.model.mtp) == n
    assert _generate(llm, setup["prompts"], _params(MAX_TOKENS)) == setup["ref"]
    m = llm.get_metrics()
    assert m["spec_decode_num_drafts_total"] > 0
    if mode == "preempt":
        assert m["num_preemptions_total"] > 0
    assert m["kv_cache_usage_perc"] == 0.0


@pytest.mark.parametrize("n", [2, 3])
def test_near_max_model_len(setup: dict, n: int) -> None:
    outs = _generate(mtp_llm(setup[n], n, max_model_len=64), setup["near"], _params([32] * 3))
    assert outs == setup["near_ref"]


def test_fewer_drafts_than_modules(setup: dict) -> None:
    """K < N loads the first K modules only."""
    llm = mtp_llm(setup[3], 2, max_model_len=256)
    assert len(llm.engine.speculator.model.mtp) == 2
    assert _generate(llm, setup["prompts"], _params(MAX_TOKENS)) == setup["ref"]


def test_more_drafts_than_modules(setup: dict) -> None:
    """K > N: step i runs module i mod N (vLLM's `spec_step_idx % num_mtp_layers`), its
    weights module i mod N's own tensors and its KV layer its own; lossless end to end."""
    llm = mtp_llm(setup[2], 5, max_model_len=256, max_num_batched_tokens=24)
    mtp = llm.engine.speculator.model.mtp
    layers = llm.engine.model.config.num_hidden_layers
    assert len(mtp) == 5 and len(llm.engine.runner.kv_caches) == layers + 5
    assert mtp[4].eh_proj.weight is mtp[2].eh_proj.weight is mtp[0].eh_proj.weight
    assert mtp[3].layer.mlp.gate_up_proj.weight is mtp[1].layer.mlp.gate_up_proj.weight
    assert mtp[0].eh_proj.weight is not mtp[1].eh_proj.weight
    assert len({m.layer.self_attn.kv_index for m in mtp}) == 5
    assert _generate(llm, setup["prompts"], _params(MAX_TOKENS)) == setup["ref"]
    assert llm.get_metrics()["spec_decode_num_drafts_total"] > 0


def test_all_drafts_accepted(setup: dict, tmp_path) -> None:
    """Looped target (zero lm_head, shared by the MTP heads): every draft is accepted."""
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(setup["target"])
    with torch.no_grad():
        model.lm_head.weight.zero_()
    looped = str(tmp_path / "looped")
    model.save_pretrained(looped)
    target = write_multi_mtp_target(looped, str(tmp_path / "looped_mtp"), 3)
    llm = mtp_llm(target, 3, max_model_len=64, max_num_batched_tokens=40)
    prompts = setup["near"] + setup["prompts"][:2]
    mts = [32, 20, 7, 32, 11]
    outs = _generate(llm, prompts, _params(mts))
    assert outs == [[0] * min(m, 64 - len(p)) for p, m in zip(prompts, mts)]
    m = llm.get_metrics()
    assert m["spec_decode_num_accepted_tokens_total"] == m["spec_decode_num_draft_tokens_total"] > 0


def _from_scratch(runner, mtp, toks: list[int], L: int) -> tuple[list[torch.Tensor], list[int]]:
    """Chain the modules over positions 0 .. L-1 of the accepted tokens t_0 .. t_L (drafts
    appended as they are made): per module k (1-based) its KV at positions 0 .. L-k and d_k."""
    t = torch.tensor(toks[: L + 1])
    ctx = scratch_context(runner, L)
    h, _ = runner.model(t[:L], torch.arange(L), ctx)
    kvs, drafts = [], []
    for k, m in enumerate(mtp, 1):
        ctx = scratch_context(runner, L)
        out, _ = m(t[k : L + k], torch.arange(L), h, ctx)
        drafts.append(int(m.draft_logits(out[L - 1]).argmax()))
        t = torch.cat([t, torch.tensor(drafts[-1:])])
        cache = ctx.kv_caches[m.layer.self_attn.kv_index]
        kvs.append(cache.flatten(1, 2)[:, : L - k + 1])
        h = out
    return kvs, drafts


@pytest.mark.parametrize(("n", "k"), [(2, 2), (3, 3), (2, 5)])
def test_module_kv_equals_from_scratch(setup: dict, n: int, k: int) -> None:
    """Synthetic acceptance (lossy, 50%) mixes all-rejected, partial and all-accepted steps;
    chunked prefill, a small KV pool (preemption), max_num_seqs 3 (rows reused, reordered) and
    staggered arrivals with different max_tokens. After every step every running request's
    module-k KV over its verified positions, and its drafts, equal a from-scratch chain. With
    K > N (steps 3 and 5 rerun module 1, step 4 module 2) each step's own KV is checked."""
    spec = {
        "rejection_sample_method": "synthetic",
        "synthetic_acceptance_rate": 0.5,
        "adaptive": False,  # fixed K: the budget's k = 0 runs no module (KV holes, stale carry)
    }
    llm = mtp_llm(
        setup[n],
        k,
        spec=spec,
        max_model_len=96,
        max_num_seqs=3,
        max_num_batched_tokens=20,
        num_gpu_blocks_override=10,
    )
    eng = llm.engine
    runner, mtp = eng.runner, eng.speculator.model.mtp
    accepted: list[int] = []
    sampled: set[str] = set()  # requests that drafted in the latest step
    launched: list = []  # the scheduled requests of the step in flight
    # The engine launches every step, then finishes it (synchronous steps: one at a time).
    launch, finish = runner.launch, runner.finish

    def recording_launch(sched, lp, *a, **kw):  # noqa: ANN001, ANN002, ANN202, ANN003
        launched[:] = sched.scheduled
        sampled.clear()
        sampled.update(s.req.request_id for s in sched.scheduled if s.samples)
        return launch(sched, lp, *a, **kw)

    def recording_finish(pending):  # noqa: ANN001, ANN202
        out = finish(pending)
        accepted.extend(int(a) for s, a in zip(launched, out.num_accepted) if s.num_draft)
        return out

    runner.launch, runner.finish = recording_launch, recording_finish
    prompts = random_prompts(6, 3, 30, seed=9)
    arrivals = {0: [0, 1], 2: [2], 5: [3, 4], 9: [5]}
    mts = [30, 8, 25, 14, 3, 20]
    step, checked = 0, 0
    while step in arrivals or eng.has_unfinished_requests():
        for i in arrivals.get(step, []):
            eng.add_request(str(i), {"prompt_token_ids": prompts[i]}, _params([mts[i]])[0])
        eng.step()
        step += 1
        for req in eng.scheduler.running:
            L = req.num_computed_tokens
            if req.row < 0 or L < 2:
                continue
            toks = req.all_token_ids
            with torch.inference_mode():
                kvs, drafts = _from_scratch(runner, mtp, toks + [0] * k, L)
            for k, (m, ref) in enumerate(zip(mtp, kvs), 1):
                got = paged_kv(runner, m.layer.self_attn.kv_index, req.block_ids, L - k + 1)
                torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
            if req.request_id in sampled:  # the K drafts for the next step are ready
                got_d = runner.states.token_ids[req.row, L + 1 : L + 1 + k].tolist()
                assert got_d == drafts, (req.request_id, L)
            checked += 1
    assert checked >= 30
    assert llm.get_metrics()["num_preemptions_total"] > 0
    assert 0 in accepted and k in accepted and any(0 < a < k for a in accepted)


def test_seeded_probabilistic_drafting_is_batch_invariant(setup: dict) -> None:
    spec = {
        "draft_sample_method": "probabilistic",
        "rejection_sample_method": "probabilistic",
        "adaptive": False,  # fixed K: probabilistic verification's draws depend on K
    }
    llm = mtp_llm(setup[3], 3, spec=spec, max_model_len=256)
    sp = SamplingParams(temperature=0.9, seed=77, max_tokens=24, ignore_eos=True)
    p = {"prompt_token_ids": setup["prompts"][0]}
    alone = llm.generate(p, sp)[0].outputs[0].token_ids
    others = [{"prompt_token_ids": q} for q in setup["prompts"][1:]]
    osp = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    batch = llm.generate(others[:2] + [p] + others[2:], [osp, osp, sp, osp, osp])
    assert batch[2].outputs[0].token_ids == alone


def _padded_propose(spec, q_pad: int):  # noqa: ANN001, ANN202
    """The eager proposal over the batch a captured graph sees: one padded row appended (the
    scratch row, q_pad tokens at positions 0.., 0 of q_pad - 1 drafts accepted, no samples,
    random hidden) and max_seq_len = max_model_len."""

    def propose(runner, t, num_drafts=None):  # noqa: ANN001, ANN202
        inp, dev = t.inp, t.hidden.device
        B, T = inp.num_reqs, inp.num_tokens

        def cat(x: torch.Tensor, fill: torch.Tensor | int, n: int = 1) -> torch.Tensor:
            tail = fill if isinstance(fill, torch.Tensor) else x.new_full((n,), fill)
            return torch.cat([x, tail.to(x.dtype)])

        ar = torch.arange(q_pad, device=dev)
        padded = SimpleNamespace(
            idx_mapping=cat(inp.idx_mapping, runner.states.scratch_row),
            positions=cat(inp.positions, ar),
            query_start_loc=cat(inp.query_start_loc, T + q_pad),
            seq_lens=cat(inp.seq_lens, q_pad),
            num_draft=cat(inp.num_draft, q_pad - 1),
            samples=cat(inp.samples, 0),
            token_req=cat(inp.token_req, B, q_pad),
            num_reqs=B + 1,
            num_tokens=T + q_pad,
            max_query_len=max(inp.max_query_len, q_pad),
            max_seq_len=runner.max_model_len,
        )
        # A padded row's hidden states are whatever the target graph left there: not zeros
        # (with zeros and the pad token a module's K/V would be zeros, hiding stray writes).
        g = torch.Generator(device=dev).manual_seed(T)
        noise = torch.randn(q_pad, t.hidden.shape[1], generator=g, device=dev)
        hidden = torch.cat([t.hidden, noise.to(t.hidden.dtype)])
        num_acc = cat(t.num_acc, 0)
        spec.draft_prefill(
            runner,
            padded,
            None,
            hidden,
            [],
            num_acc,
            t.st.index(
                torch.cat(
                    [torch.arange(B, device=dev), torch.zeros(1, dtype=torch.long, device=dev)]
                )
            ),
        )

    return propose


@pytest.mark.parametrize("q_pad", [1, 4])
def test_padded_row_is_inert(setup: dict, q_pad: int) -> None:
    """What the captured proposal adds to an eager one (a padded scratch row, max_seq_len at
    max_model_len) changes no draft and no verified token: the padded row writes no KV."""
    runs = []
    for pad in (False, True):
        # Fixed K: the two runs' drafts are compared step by step.
        llm = mtp_llm(setup[3], 3, spec={"adaptive": False}, max_model_len=128)
        if pad:
            spec = llm.engine.speculator
            spec.propose = _padded_propose(spec, q_pad)
        sp = _params([20])[0]
        runs.append(drafts_per_step(llm, setup["prompts"][:3], sp))
    assert runs[0] == runs[1] and len(runs[0]) > 10
    # The scratch row's pages are the null block: its slots at the padded positions 0.. stay
    # zero (slot -1 goes to the block's last slot, which padding may overwrite).
    runner = llm.engine.runner
    for m in llm.engine.speculator.model.mtp:
        kv = runner.kv_caches[m.layer.self_attn.kv_index]  # [2, blocks, block_size, heads, dim]
        assert not kv[:, runner.null_block, :q_pad].any()
