"""Speculative decoding end to end: lossless greedy equivalence for every method and K."""

from __future__ import annotations

import os

import pytest

from specserve import LLM, SamplingParams

from .conftest import random_prompts
from .spec_utils import check_tracked_kv_writes, write_eagle, write_eagle3, write_mtp_target

GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
TARGET = ("llama_gqa", "llama")


@pytest.fixture(scope="module")
def setup(ckpt_dir, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("drafters")
    target = ckpt_dir(*TARGET)
    prompts = random_prompts(5, 4, 50, seed=21)
    ref = LLM(target, max_model_len=256).generate(
        [{"prompt_token_ids": p} for p in prompts], GREEDY
    )
    return {
        "target": target,
        "prompts": prompts,
        "ref": [o.outputs[0].token_ids for o in ref],
        "draft_model": ckpt_dir("small_draft", "llama", num_hidden_layers=2, seed=5),
        "eagle": write_eagle(os.path.join(root, "eagle")),
        "eagle3": write_eagle3(os.path.join(root, "eagle3")),
        "mtp": write_mtp_target(target, os.path.join(root, "mtp_target")),
    }


def spec_llm(setup: dict, method: str, k: int, adaptive: bool = True, **kw) -> LLM:
    target = setup["target"]
    cfg = {"method": method, "num_speculative_tokens": k, "adaptive": adaptive}
    if method in ("draft_model", "eagle", "eagle3"):
        cfg["model"] = setup[method]
    if method == "mtp":
        target = setup["mtp"]
    return LLM(target, max_model_len=256, speculative_config=cfg, **kw)


METHODS = ["draft_model", "eagle", "eagle3", "mtp", "ngram"]
MODES = {
    "plain": {},
    "chunked": {"max_num_batched_tokens": 24},
    "preempt": {"num_gpu_blocks_override": 9, "max_num_batched_tokens": 64},
}


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("adaptive", [True, False])
def test_greedy_equivalence(setup: dict, method: str, k: int, mode: str, adaptive: bool) -> None:
    llm = spec_llm(setup, method, k, adaptive=adaptive, **MODES[mode])
    outs = llm.generate([{"prompt_token_ids": p} for p in setup["prompts"]], GREEDY)
    for o, ref in zip(outs, setup["ref"]):
        assert o.outputs[0].token_ids == ref
    m = llm.get_metrics()
    if method != "ngram":
        assert m["spec_decode_num_drafts_total"] > 0
    if mode == "preempt":
        assert m["num_preemptions_total"] > 0
    assert m["kv_cache_usage_perc"] == 0.0


@pytest.mark.parametrize("k", [1, 3, 5])
def test_self_drafting_accepts_everything(setup: dict, k: int) -> None:
    # Fixed K: under the adaptive budget a stretch without drafting leaves the drafter's KV
    # with holes, and its next drafts may differ from the target's.
    cfg = {
        "method": "draft_model",
        "model": setup["target"],
        "num_speculative_tokens": k,
        "adaptive": False,
    }
    llm = LLM(setup["target"], max_model_len=256, speculative_config=cfg)
    sp = SamplingParams(temperature=0.0, max_tokens=31, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in setup["prompts"]], sp)
    m = llm.get_metrics()
    assert m["spec_decode_num_accepted_tokens_total"] == m["spec_decode_num_draft_tokens_total"]
    for o in outs:
        assert o.metrics.num_accepted_tokens == o.metrics.num_draft_tokens


def test_ngram_rides_a_loop(setup: dict, tmp_path) -> None:
    """A target stuck in a loop (zero lm_head: greedy always picks token 0) is what prompt lookup
    is for: once the loop is in the context, nearly every n-gram draft must be accepted."""
    import torch
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(setup["target"])
    with torch.no_grad():
        model.lm_head.weight.zero_()
    looped = str(tmp_path / "looped")
    model.save_pretrained(looped)
    cfg = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
    prompt = {"prompt_token_ids": [7, 8, 9, 0, 0, 0, 5, 0, 0, 0]}
    llm = LLM(looped, max_model_len=256, speculative_config=cfg)
    out = llm.generate(prompt, GREEDY)[0].outputs[0].token_ids
    ref = LLM(looped, max_model_len=256).generate(prompt, GREEDY)[0].outputs[0].token_ids
    assert out == ref == [0] * GREEDY.max_tokens
    m = llm.get_metrics()
    assert m["spec_decode_num_drafts_total"] >= 5
    assert m["spec_decode_acceptance_rate"] > 0.9, m
    # Real prompts from the random target: n-gram drafts rarely match but never change the output.
    llm = LLM(setup["target"], max_model_len=256, speculative_config=cfg)
    p = setup["prompts"][0] * 3
    ref = LLM(setup["target"], max_model_len=256).generate({"prompt_token_ids": p}, GREEDY)
    out = llm.generate({"prompt_token_ids": p}, GREEDY)
    assert out[0].outputs[0].token_ids == ref[0].outputs[0].token_ids
    assert llm.get_metrics()["spec_decode_num_drafts_total"] > 0


def test_near_max_model_len(setup: dict) -> None:
    """Prompts ending close to max_model_len: fewer drafts, never a position past the end."""
    target = setup["target"]
    prompts = random_prompts(3, 56, 62, seed=4)
    sp = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    ref = LLM(target, max_model_len=64).generate([{"prompt_token_ids": p} for p in prompts], sp)
    cfg = {"method": "eagle3", "model": setup["eagle3"], "num_speculative_tokens": 5}
    outs = LLM(target, max_model_len=64, speculative_config=cfg).generate(
        [{"prompt_token_ids": p} for p in prompts], sp
    )
    for o, r in zip(outs, ref):
        assert o.outputs[0].token_ids == r.outputs[0].token_ids
        assert len(o.prompt_token_ids) + len(o.outputs[0].token_ids) <= 64


def test_seeded_sampling_with_spec_is_batch_invariant(setup: dict) -> None:
    cfg = {
        "method": "eagle3",
        "model": setup["eagle3"],
        "num_speculative_tokens": 3,
        "draft_sample_method": "probabilistic",
        "rejection_sample_method": "probabilistic",
        # Speculative sampling's draws depend on the drafts verified, so on K: fixed here.
        "adaptive": False,
    }
    llm = LLM(setup["target"], max_model_len=256, speculative_config=cfg)
    sp = SamplingParams(temperature=0.9, seed=77, max_tokens=24, ignore_eos=True)
    p = {"prompt_token_ids": setup["prompts"][0]}
    alone = llm.generate(p, sp)[0].outputs[0].token_ids
    others = [{"prompt_token_ids": q} for q in setup["prompts"][1:]]
    osp = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    batch = llm.generate(others[:2] + [p] + others[2:], [osp, osp, sp, osp, osp])
    assert batch[2].outputs[0].token_ids == alone


@pytest.mark.parametrize(
    "cfg, match",
    [
        ({"method": "medusa"}, "method must be one of"),
        (
            {"method": "ngram", "num_speculative_tokens": 0},
            "num_speculative_tokens must be in 1..16",
        ),
        ({"method": "ngram", "num_speculative_tokens": 17}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": "3"}, "num_speculative_tokens must be int"),
        ({"method": "ngram", "bogus": 1}, "unknown field 'bogus'"),
        ({"method": "eagle"}, "speculative_config.model"),
        ({"method": "ngram", "draft_sample_method": "beam"}, "draft_sample_method"),
        ({"method": "ngram", "rejection_sample_method": "x"}, "rejection_sample_method"),
    ],
)
def test_bad_configs(setup: dict, cfg: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LLM(setup["target"], speculative_config=cfg)


def test_drafter_that_does_not_fit(setup: dict, ckpt_dir) -> None:
    wrong_vocab = ckpt_dir("wrong_vocab", "llama", vocab_size=400)
    with pytest.raises(ValueError, match="speculative_config.model: drafter vocab_size 400"):
        LLM(setup["target"], speculative_config={"method": "draft_model", "model": wrong_vocab})
    wide = ckpt_dir("wide", "llama", hidden_size=96)
    with pytest.raises(ValueError, match="hidden_size 96 does not match"):
        LLM(setup["target"], speculative_config={"method": "eagle", "model": wide})


def test_draft_metadata_is_rebuilt_every_step(ckpt_dir, monkeypatch) -> None:
    """A draft model with a 2-token sliding window: drafting K = 5 crosses the window at every
    step. Drafts must equal the draft model's own greedy continuation computed from scratch, and
    reusing the first step's (position-dependent) metadata must break that."""
    from specserve.spec_decode.autoregressive import AutoregressiveSpeculator

    from .draft_utils import drafts_per_step

    target = ckpt_dir(*TARGET)
    draft = ckpt_dir("swa2_draft", "mistral", num_hidden_layers=2, sliding_window=2, seed=9)
    # Fixed K: the check compares every step's drafts with a from-scratch continuation.
    cfg = {"method": "draft_model", "model": draft, "num_speculative_tokens": 5, "adaptive": False}
    prompts = random_prompts(2, 10, 20, seed=8)
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = LLM(draft, max_model_len=256)

    def from_scratch(tokens: list[int]) -> list[int]:
        out = alone.generate(
            {"prompt_token_ids": tokens}, SamplingParams(temperature=0, max_tokens=5)
        )
        return out[0].outputs[0].token_ids

    good = drafts_per_step(LLM(target, max_model_len=256, speculative_config=cfg), prompts, sp)
    assert len(good) > 5
    assert all(d == from_scratch(toks) for toks, d in good)

    def stale_propose(self, runner, t, num_drafts=None) -> None:
        inp, st, rows = t.inp, t.st, t.inp.idx_mapping
        pos, h = self.draft_prefill(runner, inp, t.ctx, t.hidden, t.aux, t.num_acc, st)
        ctx0 = None
        for j in range(self.num_decode_steps):
            fresh = self.decode_metadata(runner, rows, pos + j, inp.max_seq_len + j + 1)
            if ctx0 is None:
                ctx0 = runner.forward_context(fresh)
            else:  # advance the common tensors only: the builder's window bounds go stale
                c = next(iter(ctx0.metadata.values())).common
                for name in ("positions", "seq_lens", "slot_mapping"):
                    getattr(c, name).copy_(getattr(fresh, name))
                c.max_seq_len = fresh.max_seq_len
            h = self.draft_step(runner, rows, pos + j, h, inp.samples, st, ctx0)

    monkeypatch.setattr(AutoregressiveSpeculator, "propose", stale_propose)
    stale = drafts_per_step(LLM(target, max_model_len=256, speculative_config=cfg), prompts, sp)
    assert any(d != from_scratch(toks) for toks, d in stale)


def test_speculator_switches(setup: dict) -> None:
    """`model_returns_tuple=False` (a drafter returning one tensor, carried as is) gives MTP the same
    drafts; `advance_draft_positions=False` (Q-only MTP style: every step at one position) stays
    lossless."""
    from .draft_utils import drafts_per_step

    prompts = setup["prompts"][:3]
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    # A fixed K: drafts are compared step by step (the adaptive budget's K follows timings).
    base = drafts_per_step(spec_llm(setup, "mtp", 3, adaptive=False), prompts, sp)

    llm = spec_llm(setup, "mtp", 3, adaptive=False)
    spec = llm.engine.speculator
    drafter_forward = spec.model.forward
    spec.model.forward = lambda *a: drafter_forward(*a)[0]  # MTP carries its output: same tensor
    spec.model_returns_tuple = False
    assert drafts_per_step(llm, prompts, sp) == base

    llm = spec_llm(setup, "mtp", 3)
    llm.engine.speculator.advance_draft_positions = False
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
    ref = spec_llm(setup, "mtp", 3).generate([{"prompt_token_ids": p} for p in prompts], sp)
    for o, r in zip(outs, ref):
        assert o.outputs[0].token_ids == r.outputs[0].token_ids


def test_decode_batches_stay_uniform_near_max_tokens(setup: dict) -> None:
    """Drafts are not capped by max_tokens (tokens verified past it are dropped), so every decode
    step gives each request 1 + K tokens: the shape the CUDA graphs capture."""
    llm = spec_llm(setup, "eagle3", 3, adaptive=False)  # the check counts K per step
    eng = llm.engine
    shapes: list[set[int]] = []
    schedule = eng.scheduler.schedule

    def recording(k: int | None = None):  # noqa: ANN202
        out = schedule(k)
        if out.scheduled and all(
            s.samples and not s.req.num_output_tokens == 0 for s in out.scheduled
        ):
            shapes.append({s.num_tokens for s in out.scheduled})
        return out

    eng.scheduler.schedule = recording
    sps = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (5, 9, 14, 20)]
    outs = llm.generate([{"prompt_token_ids": p} for p in setup["prompts"][:4]], sps)
    assert [len(o.outputs[0].token_ids) for o in outs] == [5, 9, 14, 20]
    for o, r in zip(outs, setup["ref"]):
        assert o.outputs[0].token_ids == r[: len(o.outputs[0].token_ids)]
    assert shapes and all(s == {4} for s in shapes), shapes


@pytest.mark.parametrize("method", ["draft_model", "eagle", "eagle3", "mtp"])
def test_tracked_steps_write_only_the_drafters_kv(setup: dict, method: str) -> None:
    """A k = 0 step that keeps the drafter's KV (the adaptive budget's tracked steps) runs
    `Drafter.write_kv`, which stops after the last layer's KV write: the drafter's KV cache
    after such steps, and so every later draft, equals that of the drafter's full forward."""
    n = 3
    prompts = [{"prompt_token_ids": p} for p in setup["prompts"][:n]]
    outs = check_tracked_kv_writes(lambda: spec_llm(setup, method, 3), prompts, GREEDY)
    assert outs == setup["ref"][:n]
