"""The CPU equivalence tests again on CUDA: Triton attention, CUDA graphs for the target.

Run with `pytest -m gpu`. float32 end to end (TF32 off, IEEE dots in Triton) so greedy tokens
can be compared with transformers on the CPU; one bf16 test compares graphs with eager mode.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.tunables import override

from .conftest import hf_greedy, random_prompts
from .draft_utils import drafts_per_step
from .spec_utils import (
    write_eagle,
    write_eagle3,
    write_mtp_target,
    write_ptd_draft_model,
    write_ptd_eagle3,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
ARCHS = {
    "llama_gqa": ("llama", {}),
    "qwen3_tied": ("qwen3", {"tie_word_embeddings": True, "head_dim": 32}),
    "mistral_swa": ("mistral", {"sliding_window": 24}),
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
MODES = {
    "plain": {},
    "chunked": {"max_num_batched_tokens": 32},
    "preempt": {"num_gpu_blocks_override": 10, "max_num_batched_tokens": 64},
}


@pytest.fixture(autouse=True)
def _no_tf32() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def cuda_llm(path: str, **kw: object) -> LLM:
    kw.setdefault("dtype", "float32")
    kw.setdefault("max_model_len", 256)
    # The tests' batches hold at most 8 requests: capture graphs 1, 2, 4, 8 only (the default
    # 64 captures 11 sizes per query length; device time is what these tests cost).
    kw.setdefault("max_num_seqs", 8)
    return LLM(path, device="cuda", **kw)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(6, 5, 60, seed=3)


@pytest.mark.parametrize("eager", [False, True])
def test_greedy_head_epilogue_in_the_engine_cuda(
    ckpt_dir, prompts, eager: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bf16 greedy decode taking its tokens from the lm_head gemv's argmax epilogue
    (ops/greedy_head.py; decode_matmul "triton" puts every lm_head call of <= 8 rows on the
    gemv) equals the same engine running lm_head then ops.argmax, token for token, at batch 1
    and 6, in CUDA graphs and eager; and the epilogue's path ran."""
    from specserve.ops import greedy_head

    takes: list[int] = []
    take = greedy_head.take_tokens_
    monkeypatch.setattr(greedy_head, "take_tokens_", lambda k: takes.append(len(k)) or take(k))
    path = ckpt_dir("llama_gqa", "llama")
    # No prefix caching: the second run of the same prompts would reuse the first's KV and
    # prefill only the tail (other shapes, other roundings).
    llm = cuda_llm(
        path, dtype="bfloat16", decode_matmul="triton", enforce_eager=eager,
        enable_prefix_caching=False,
    )  # fmt: skip
    takes.clear()  # the warm-up's steps
    for batch in ([prompts[0]], prompts):
        reqs = [{"prompt_token_ids": p} for p in batch]
        fused = [o.outputs[0].token_ids for o in llm.generate(reqs, GREEDY)]
        assert takes and max(takes) == len(batch)
        takes.clear()
        with override(greedy_argmax_epilogue=False):
            plain = [o.outputs[0].token_ids for o in llm.generate(reqs, GREEDY)]
        assert not takes
        assert fused == plain


@pytest.mark.parametrize("name", list(ARCHS))
@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_matches_transformers_cuda(ckpt_dir, prompts, name: str, mode: str) -> None:
    arch, over = ARCHS[name]
    path = ckpt_dir(name, arch, **over)
    llm = cuda_llm(path, **MODES[mode])
    assert llm.engine.runner.backend.name == "triton"
    assert llm.engine.runner.cudagraphs is not None
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(path, p, GREEDY.max_tokens)
    assert llm.engine.kv.usage() == 0.0


@pytest.mark.parametrize(
    "dtype, max_len, matmul",
    [
        ("float32", 256, "cublas"),
        ("float32", 4096, "cublas"),
        ("bfloat16", 256, "cublas"),
        ("bfloat16", 4096, "cublas"),
        ("bfloat16", 4096, "triton"),
        ("bfloat16", 4096, None),
    ],
)
def test_cudagraph_equals_eager(
    ckpt_dir, prompts, dtype: str, max_len: int, matmul: str | None
) -> None:
    """Bit-equal tokens; max_model_len 4096 makes small batches split the keys (split_count
    must choose the same count for a padded graph batch and the eager one); decode_matmul
    "triton": the Triton gemv with the norms fused in (norm_linear) for decode batches; None:
    the CUDA defaults, async scheduling and decode_matmul "auto" (the eager engine reuses the
    plan the graph engine timed)."""
    path = ckpt_dir("llama_gqa", "llama")
    sp = SamplingParams(temperature=0.8, top_p=0.95, seed=11, max_tokens=40, ignore_eos=True)
    batch = [{"prompt_token_ids": p} for p in prompts]
    kw = {"dtype": dtype, "max_model_len": max_len}
    if matmul is not None:
        kw["decode_matmul"] = matmul
    llm = cuda_llm(path, **kw)
    if matmul is None:
        assert llm.engine.config.async_scheduling is True
        assert {p["rows"] for p in llm.engine.decode_matmul_plan} == {1, 2, 4, 8, 16, 32, 64}
    graph = llm.generate(batch, [GREEDY, sp] * 3)
    del llm
    eager = cuda_llm(path, enforce_eager=True, **kw).generate(batch, [GREEDY, sp] * 3)
    for g, e in zip(graph, eager):
        assert g.outputs[0].token_ids == e.outputs[0].token_ids


@pytest.mark.parametrize("matmul", ["auto", "triton"])
def test_verification_graphs_equal_eager_skinny(drafters, prompts, matmul: str) -> None:
    """EAGLE-3 at K = 4, bf16, 8 requests: verification batches of 5-40 rows run the planned
    kernels (auto: whatever start-up timed fastest; triton: the gemv up to 8 rows, the split-K
    skinny matmul above, with the norms fused), and captured graphs give eager's tokens bit for
    bit (the eager engine reuses the plan the graph engine timed)."""
    # A fixed K: the adaptive budget's choices follow each engine's own step timings (other
    # verification shapes, other roundings).
    spec = {
        "method": "eagle3",
        "model": drafters["eagle3"],
        "num_speculative_tokens": 4,
        "adaptive": False,
    }
    kw = {"dtype": "bfloat16", "decode_matmul": matmul, "speculative_config": spec}
    sp = SamplingParams(temperature=0.8, top_p=0.95, seed=11, max_tokens=40, ignore_eos=True)
    batch = [{"prompt_token_ids": p} for p in prompts + prompts[:2]]
    params = [GREEDY, sp] * 4
    llm = cuda_llm(drafters["target"], **kw)
    if matmul == "auto":
        assert {p["rows"] for p in llm.engine.decode_matmul_plan} == {1, 2, 4, 8, 16, 32, 64}
    graph = llm.generate(batch, params)
    del llm
    eager = cuda_llm(drafters["target"], enforce_eager=True, **kw).generate(batch, params)
    for g, e in zip(graph, eager):
        assert g.outputs[0].token_ids == e.outputs[0].token_ids


def test_seeded_request_batch_invariant_cuda(ckpt_dir, prompts) -> None:
    llm = cuda_llm(ckpt_dir("llama_gqa", "llama"))
    sp = SamplingParams(temperature=0.9, top_k=40, seed=5, max_tokens=24, ignore_eos=True)
    p = {"prompt_token_ids": prompts[0]}
    alone = llm.generate(p, sp)[0].outputs[0].token_ids
    osp = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    others = [{"prompt_token_ids": q} for q in prompts[1:]]
    batch = llm.generate(others[:2] + [p] + others[2:], [osp, osp, sp, osp, osp, osp])
    assert batch[2].outputs[0].token_ids == alone


@pytest.fixture(scope="module")
def drafters(ckpt_dir, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("gpu_drafters")
    target = ckpt_dir("llama_gqa", "llama")
    return {
        "target": target,
        "draft_model": ckpt_dir("small_draft", "llama", num_hidden_layers=2, seed=5),
        "eagle": write_eagle(os.path.join(root, "eagle")),
        "eagle3": write_eagle3(os.path.join(root, "eagle3")),
        "mtp": write_mtp_target(target, os.path.join(root, "mtp_target")),
        "ptd_eagle3": write_ptd_eagle3(os.path.join(root, "ptd_eagle3")),
        "ptd_draft_model": write_ptd_draft_model(
            ckpt_dir("small_draft", "llama", num_hidden_layers=2, seed=5),
            os.path.join(root, "ptd_draft_model"),
        ),
    }


@pytest.mark.parametrize("method", ["draft_model", "eagle", "eagle3", "mtp", "ngram"])
@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("mode", list(MODES))
def test_spec_greedy_equivalence_cuda(drafters, prompts, method: str, k: int, mode: str) -> None:
    target = drafters["mtp"] if method == "mtp" else drafters["target"]
    cfg: dict = {"method": method, "num_speculative_tokens": k}
    if method in ("draft_model", "eagle", "eagle3"):
        cfg["model"] = drafters[method]
    batch = [{"prompt_token_ids": p} for p in prompts]
    ref = cuda_llm(target, **MODES[mode]).generate(batch, GREEDY)
    llm = cuda_llm(target, speculative_config=cfg, **MODES[mode])
    outs = llm.generate(batch, GREEDY)
    for o, r in zip(outs, ref):
        assert o.outputs[0].token_ids == r.outputs[0].token_ids
    if method != "ngram":
        assert llm.get_metrics()["spec_decode_num_drafts_total"] > 0


def test_self_drafting_accepts_everything_cuda(drafters, prompts) -> None:
    cfg = {
        "method": "draft_model",
        "model": drafters["target"],
        "num_speculative_tokens": 4,
        "adaptive": False,  # every step drafts: all of them accepted
    }
    llm = cuda_llm(drafters["target"], speculative_config=cfg)
    llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    m = llm.get_metrics()
    assert m["spec_decode_num_accepted_tokens_total"] == m["spec_decode_num_draft_tokens_total"]


@pytest.mark.parametrize("method", ["draft_model_swa", "eagle3", "mtp"])
@pytest.mark.parametrize("sampled", [False, True])
def test_draft_graphs_give_eager_drafts(drafters, ckpt_dir, prompts, method, sampled) -> None:
    """Fused loop graph, per-step graph and eager drafting propose identical drafts, also with a
    drafter whose sliding window (4) is crossed while drafting K = 5."""
    target = drafters["mtp"] if method == "mtp" else drafters["target"]
    # A fixed K: the adaptive budget's choices follow each mode's own step timings.
    cfg: dict = {"method": method, "num_speculative_tokens": 5, "adaptive": False}
    if method == "draft_model_swa":
        cfg = {
            "method": "draft_model",
            "num_speculative_tokens": 5,
            "adaptive": False,
            "model": ckpt_dir("swa_draft", "mistral", num_hidden_layers=2, sliding_window=4),
        }
    elif method == "eagle3":
        cfg["model"] = drafters["eagle3"]
    if sampled:
        cfg["draft_sample_method"] = "probabilistic"
        cfg["rejection_sample_method"] = "probabilistic"
    sp = SamplingParams(temperature=0.8 if sampled else 0.0, seed=3, max_tokens=24, ignore_eos=True)
    runs = {}
    for mode in ("fused", "per_step", "eager"):
        llm = cuda_llm(target, speculative_config=cfg, draft_graph_mode=mode)
        assert (llm.engine.runner.draft_graphs is None) == (mode == "eager")
        runs[mode] = drafts_per_step(llm, prompts[:4], sp)
    assert runs["fused"] == runs["eager"]
    assert runs["per_step"] == runs["eager"]


class _CountedGraph:
    def __init__(self, graph: torch.cuda.CUDAGraph, count: list[int]) -> None:
        self.graph, self.count = graph, count

    def replay(self) -> None:
        self.count[0] += 1
        self.graph.replay()


def _pin_budget(budget: Any, pattern: list[int]) -> list[int]:
    """The budget chooses `pattern` cyclically; returns the list of its choices so far."""
    calls = iter(range(10**6))
    chosen: list[int] = []

    def choose(batch: int, requests: list) -> int:
        # Through `_chosen`, which counts the decisions since drafting (tracked k = 0).
        chosen.append(budget._chosen(pattern[next(calls) % len(pattern)]))
        return chosen[-1]

    budget.choose = choose
    return chosen


@pytest.mark.parametrize("method", ["draft_model", "eagle3", "mtp"])
def test_k0_steps_keep_the_drafters_kv_in_graphs(drafters, prompts, method) -> None:
    """A k = 0 step of the adaptive budget that keeps the drafter's KV replays the draft
    prefill's forward alone (the "kv" graph, no d1): the drafts proposed after stretches at 0
    equal eager drafting's, so the graph wrote the same drafter KV, and outputs equal plain
    decoding's."""
    target = drafters["mtp"] if method == "mtp" else drafters["target"]
    cfg: dict = {"method": method, "num_speculative_tokens": 3}
    if method != "mtp":
        cfg["model"] = drafters[method]
    pattern = [0, 0, 0, 2, 2, 0, 0, 3, 3, 1, 0]
    batch = prompts[:4]
    runs, finals = {}, {}
    for mode in ("fused", "eager"):
        llm = cuda_llm(
            target, speculative_config=cfg, draft_graph_mode=mode, async_scheduling=False
        )
        eng = llm.engine
        chosen = _pin_budget(eng.budget, pattern)
        kv_replays = [0]
        if mode == "fused":
            graphs = eng.runner.draft_graphs.graphs
            for key in [key for key in graphs if key[0] == "kv"]:
                graphs[key] = _CountedGraph(graphs[key], kv_replays)
        for i, p in enumerate(batch):
            eng.add_request(f"d{i}", {"prompt_token_ids": p}, GREEDY)
        seen, final = [], {}
        while eng.has_unfinished_requests():
            final.update({o.request_id: o.outputs[0].token_ids for o in eng.step() if o.finished})
            tok = eng.runner.states.token_ids
            for r in sorted(eng.requests.values(), key=lambda r: r.request_id):
                n = len(r.all_token_ids)
                if r.row >= 0 and not r.is_finished() and r.num_computed_tokens == n - 1:
                    seen.append((list(r.all_token_ids), tok[r.row, n : n + chosen[-1]].tolist()))
        assert 0 in chosen and max(chosen) > 0
        if mode == "fused":
            assert kv_replays[0] > 0
        runs[mode], finals[mode] = seen, final
    assert runs["fused"] == runs["eager"]
    ref = cuda_llm(target).generate([{"prompt_token_ids": p} for p in batch], GREEDY)
    for i, r in enumerate(ref):
        assert list(finals["fused"][f"d{i}"]) == r.outputs[0].token_ids


@pytest.mark.parametrize("method", ["eagle3", "draft_model"])
@pytest.mark.parametrize("k", [2, 5, 8])
@pytest.mark.parametrize("mode", list(MODES))
def test_ptd_greedy_equivalence_cuda(drafters, prompts, method: str, k: int, mode: str) -> None:
    """PTD with its captured proposal graph (uniform batches) and eagerly (the rest)."""
    cfg = {
        "method": method,
        "model": drafters[f"ptd_{method}"],
        "num_speculative_tokens": k,
        "parallel_draft": True,
    }
    batch = [{"prompt_token_ids": p} for p in prompts]
    ref = cuda_llm(drafters["target"], **MODES[mode]).generate(batch, GREEDY)
    llm = cuda_llm(drafters["target"], speculative_config=cfg, **MODES[mode])
    assert llm.engine.runner.draft_graphs is not None
    outs = llm.generate(batch, GREEDY)
    for o, r in zip(outs, ref):
        assert o.outputs[0].token_ids == r.outputs[0].token_ids
    assert llm.get_metrics()["spec_decode_num_drafts_total"] > 0


@pytest.mark.parametrize("method", ["eagle3", "draft_model"])
@pytest.mark.parametrize("sampled", [False, True])
def test_ptd_graph_gives_eager_drafts(drafters, prompts, method: str, sampled: bool) -> None:
    """The captured PTD proposal (one graph per target graph) drafts exactly what the eager
    forward drafts, greedy and probabilistic."""
    cfg: dict = {
        "method": method,
        "model": drafters[f"ptd_{method}"],
        "num_speculative_tokens": 6,
        "parallel_draft": True,
        "adaptive": False,  # the adaptive budget's choices follow each mode's step timings
    }
    if sampled:
        cfg["draft_sample_method"] = "probabilistic"
        cfg["rejection_sample_method"] = "probabilistic"
    sp = SamplingParams(temperature=0.8 if sampled else 0.0, seed=3, max_tokens=24, ignore_eos=True)
    runs = {}
    for mode in ("auto", "eager"):
        llm = cuda_llm(drafters["target"], speculative_config=cfg, draft_graph_mode=mode)
        assert (llm.engine.runner.draft_graphs is None) == (mode == "eager")
        runs[mode] = drafts_per_step(llm, prompts[:4], sp)
    assert runs["auto"] == runs["eager"]


@pytest.mark.parametrize("method", [None, "eagle3", "mtp", "ptd_eagle3"])
@pytest.mark.parametrize("mode", list(MODES))
def test_async_scheduling_cuda(drafters, prompts, method: str | None, mode: str) -> None:
    """Async scheduling with CUDA graphs (target, draft loop, PTD proposal): the same tokens as
    the synchronous engine, greedy and seeded sampling."""
    target = drafters["mtp"] if method == "mtp" else drafters["target"]
    cfg: dict | None = None
    if method == "mtp":
        cfg = {"method": "mtp", "num_speculative_tokens": 3}
    elif method == "eagle3":
        cfg = {"method": "eagle3", "model": drafters["eagle3"], "num_speculative_tokens": 3}
    elif method == "ptd_eagle3":
        cfg = {
            "method": "eagle3",
            "model": drafters["ptd_eagle3"],
            "num_speculative_tokens": 3,
            "parallel_draft": True,
        }
    sp = SamplingParams(temperature=0.8, seed=7, max_tokens=40, ignore_eos=True)
    batch = [{"prompt_token_ids": p} for p in prompts]
    params = [GREEDY, sp] * 3
    ref = cuda_llm(target, speculative_config=cfg, **MODES[mode]).generate(batch, params)
    llm = cuda_llm(target, speculative_config=cfg, async_scheduling=True, **MODES[mode])
    outs = llm.generate(batch, params)
    for o, r in zip(outs, ref):
        assert o.outputs[0].token_ids == r.outputs[0].token_ids
    assert llm.engine._inflight is None and llm.engine.kv.usage() == 0.0


def test_split_kv_in_the_engine_cuda(ckpt_dir, prompts) -> None:
    """max_model_len 4096: batch-1 decode graphs split the keys (flash-decoding); greedy tokens
    still equal transformers'."""
    from specserve.attention import launch_policy

    path = ckpt_dir("llama_gqa", "llama")
    llm = LLM(path, device="cuda", dtype="float32", max_model_len=4096, max_num_seqs=4)
    assert launch_policy._num_splits(2, 4096, torch.device("cuda")) > 1
    for p in prompts[:2]:
        out = llm.generate({"prompt_token_ids": p}, GREEDY)[0].outputs[0].token_ids
        assert out == hf_greedy(path, p, GREEDY.max_tokens)


@pytest.mark.parametrize("method", [None, "eagle3"])
def test_pdl_bit_equal_to_plain_launches(drafters, prompts, method: str | None) -> None:
    """Programmatic dependent launch (specserve/ops/pdl.py) changes when kernels start, never
    what they compute: bf16, Triton gemv for every decode matmul (every kernel of a layer is a
    PDL launch), split keys (max_model_len 4096), CUDA graphs, greedy and seeded sampling: the
    same tokens with PDL on and off."""
    from specserve.ops import pdl

    if not pdl.on(torch.device("cuda")):
        pytest.skip("PDL needs sm_90+")
    sp = SamplingParams(temperature=0.8, top_p=0.95, seed=11, max_tokens=40, ignore_eos=True)
    batch = [{"prompt_token_ids": p} for p in prompts]
    spec = None
    if method:
        spec = {"method": method, "model": drafters[method], "num_speculative_tokens": 3}
    kw = {"dtype": "bfloat16", "max_model_len": 4096, "decode_matmul": "triton"}
    runs = []
    for on in (False, True):  # PDL off; on (the metadata loads before the wait)
        with override(pdl=on):
            llm = cuda_llm(drafters["target"], speculative_config=spec, **kw)
            outs = llm.generate(batch, [GREEDY, sp] * 3)
        runs.append([o.outputs[0].token_ids for o in outs])
    assert all(r == runs[0] for r in runs[1:])


@pytest.mark.parametrize("fuse_rope_kv", [False, True])
@pytest.mark.parametrize("name", ["llama_gqa", "mistral_swa"])
def test_attention_paths_in_the_engine_cuda(
    ckpt_dir, drafters, prompts, fuse_rope_kv: bool, name: str
) -> None:
    """RoPE + KV write outside the attention kernel (tunables attn_fuse_rope_kv off) and
    inside it (the default: decode and verification batches fuse it). Greedy tokens equal
    transformers' (one request at a time, then a batch), and with RoPE fused EAGLE-3's
    (4-token verification batches) equal plain decoding's."""
    with override(attn_fuse_rope_kv=fuse_rope_kv):
        _attention_path_in_the_engine(ckpt_dir, drafters, prompts, fuse_rope_kv, name)


def _attention_path_in_the_engine(
    ckpt_dir, drafters, prompts, fuse_rope_kv: bool, name: str
) -> None:
    arch, over = ARCHS[name]
    path = ckpt_dir(name, arch, **over)
    llm = cuda_llm(path)
    for p in prompts[:2]:
        out = llm.generate({"prompt_token_ids": p}, GREEDY)[0].outputs[0].token_ids
        assert out == hf_greedy(path, p, GREEDY.max_tokens)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(path, p, GREEDY.max_tokens)
    if name == "llama_gqa" and fuse_rope_kv:
        spec = {"method": "eagle3", "model": drafters["eagle3"], "num_speculative_tokens": 3}
        batch = [{"prompt_token_ids": p} for p in prompts]
        with_spec = cuda_llm(drafters["target"], speculative_config=spec).generate(batch, GREEDY)
        plain = cuda_llm(drafters["target"]).generate(batch, GREEDY)
        for a, b in zip(with_spec, plain):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
