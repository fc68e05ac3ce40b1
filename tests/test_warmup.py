"""Start-up warm-up (worker/warmup.py): it runs the real step over every batch size, query
length, sampling path and prefill size, and leaves nothing behind (CPU: rows, KV blocks and
outputs as without it). On the GPU: after start-up, serving batches of every size with and
without EAGLE-3 compiles no Triton kernel and captures no graph."""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.worker.warmup import FLAVORS, compiled_kernels

from .conftest import random_prompts
from .spec_utils import write_eagle3

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MAX_SEQS = 4


def _spec(kind: str | None, tmp_path: Any) -> dict | None:
    if kind == "eagle3":
        e3 = write_eagle3(os.path.join(tmp_path, "e3"))
        return {"method": "eagle3", "model": e3, "num_speculative_tokens": 3}
    if kind == "ngram":
        return {"method": "ngram", "num_speculative_tokens": 3}
    return None


def _params(n: int) -> list[SamplingParams]:
    """Greedy, seeded temperature and seeded filtered sampling, max_tokens staggered so the
    batch shrinks through several sizes."""
    out = []
    for i in range(n):
        base = FLAVORS[i % len(FLAVORS)]
        out.append(
            SamplingParams(
                temperature=base.temperature, top_k=base.top_k, top_p=base.top_p,
                min_p=base.min_p, seed=100 + i, max_tokens=4 + 3 * i, ignore_eos=True,
            )
        )  # fmt: skip
    return out


@pytest.mark.parametrize(
    "kind,async_sched", [(None, False), ("eagle3", False), ("eagle3", True), ("ngram", False)]
)
def test_warmup_leaves_no_state(ckpt_dir, tmp_path, kind: str | None, async_sched: bool) -> None:
    path = ckpt_dir("llama_gqa", "llama")
    spec = _spec(kind, tmp_path)
    prompts = [{"prompt_token_ids": p} for p in random_prompts(6, 3, 20, seed=1)]
    outs = {}
    for warm in (False, True):
        llm = LLM(
            path, max_model_len=96, max_num_seqs=MAX_SEQS, max_num_batched_tokens=64,
            speculative_config=spec, async_scheduling=async_sched, warmup=warm,
        )  # fmt: skip
        e = llm.engine
        rep = e.warmup_report
        if warm:
            k1 = 4 if kind else 1
            # uniform: 3 flavors x every size x every q = 1 + k, k = 0..K (the adaptive
            # budget may verify any k up to K), async adds placed rows for each q > 1
            uniform = len(FLAVORS) * MAX_SEQS * k1
            if async_sched:
                uniform += len(FLAVORS) * MAX_SEQS * (k1 - 1)  # q = 1 has no drafts to place
            assert rep is not None and rep.steps > uniform
            # prefills of 1..64 tokens beside 0, 1, 2 and 3 decoding rows where they fit
            lens = [1, 2, 3, 4, 5, 8, 9, 16, 17, 32, 33, 64]
            eager = sum(p + d * k1 <= 64 for p in lens for d in (0, 1, 2, 3))
            # several requests prefilling at once (2, 3, and 16 cut to MAX_SEQS), beside 0 / 1
            multi = sum(
                n * p + d * k1 <= 64 and n + d <= MAX_SEQS
                for n in sorted({2, 3, min(16, MAX_SEQS)})
                for p in (1, 2, 17)
                for d in (0, 1)
            )
            assert rep.steps == uniform + eager + multi
        else:
            assert rep is None
        # Nothing left behind: every row free, every KV block free, no request anywhere.
        assert sorted(e.runner.states.free_rows) == list(range(MAX_SEQS))
        assert e.kv.pool.num_free == e.kv.pool.num_blocks
        assert not e.requests and e.scheduler.num_unfinished == 0
        # No prefix-cache entry or lookup, and nothing the adaptive draft budget learns from
        # (a step time or an acceptance would steer the first real steps' K).
        assert not e.kv.pool.cached and e.kv.num_queries == 0
        if kind:
            b = e.budget
            assert b is not None and b.step == 0 and not b.costs and not b.classes
        res = llm.generate(prompts, _params(len(prompts)), use_tqdm=False)
        outs[warm] = [o.outputs[0].token_ids for o in res]
        assert [len(t) for t in outs[warm]] == [4 + 3 * i for i in range(len(prompts))]
        llm.shutdown()
    assert outs[True] == outs[False]


def test_warmup_off_by_default_on_cpu(ckpt_dir) -> None:
    llm = LLM(ckpt_dir("llama_gqa", "llama"), max_model_len=64, max_num_seqs=2)
    assert llm.engine.config.warmup is False and llm.engine.warmup_report is None
    llm.shutdown()


def _graph_count(llm: LLM) -> int:
    r = llm.engine.runner
    n = len(r.cudagraphs.graphs) if r.cudagraphs is not None else 0
    return n + (len(r.draft_graphs.graphs) if r.draft_graphs is not None else 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind,async_sched", [(None, True), ("eagle3", True), ("eagle3", False)])
def test_nothing_compiles_or_captures_after_startup(
    ckpt_dir, tmp_path, kind: str | None, async_sched: bool
) -> None:
    """bf16 (so decode_matmul=auto plans Triton gemv / skinny kernels), max_num_seqs 16: after
    start-up, batches of 1..16 requests (greedy, sampled, filtered; prompts of 3-80 tokens,
    max_tokens staggered so each batch shrinks through every smaller size, prefills chunked
    beside decodes) add no Triton kernel to any cache and capture no graph."""
    path = ckpt_dir("llama_gqa", "llama")
    t0 = time.perf_counter()
    llm = LLM(
        path, device="cuda", dtype="bfloat16", max_model_len=256, max_num_seqs=16,
        max_num_batched_tokens=256, speculative_config=_spec(kind, tmp_path),
        async_scheduling=async_sched,
    )  # fmt: skip
    start = time.perf_counter() - t0
    rep = llm.engine.warmup_report
    assert rep is not None and rep.steps > 0
    print(
        f"\nstart-up {start:.1f} s, of which warm-up {rep.seconds:.1f} s "
        f"({rep.steps} steps, {rep.compiled} kernels compiled)"
    )
    kernels, graphs = compiled_kernels(), _graph_count(llm)
    assert graphs > 0
    for b in range(1, 17):
        prompts = [{"prompt_token_ids": p} for p in random_prompts(b, 3, 80, seed=b)]
        llm.generate(prompts, _params(b), use_tqdm=False)
        new = compiled_kernels() - kernels
        assert not new, f"batch of {b}: compiled after start-up: {sorted(new)}"
        assert _graph_count(llm) == graphs, f"batch of {b}: a graph captured after start-up"
    llm.shutdown()


def test_late_compiles_are_logged(monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    """After the warm-up every specserve Triton compile is logged as a serving stall, naming the
    kernel (Triton's post-compile hook, called here with the keywords Triton 3.6 passes); other
    packages' kernels and manual warmups (decode_matmul=auto's compile pool) are not, and a hook
    set before keeps being called."""
    import logging
    from types import SimpleNamespace

    triton = pytest.importorskip("triton")
    from specserve.worker import warmup

    calls = []
    monkeypatch.setattr(
        triton.knobs.runtime, "jit_post_compile_hook", lambda **kw: calls.append(kw)
    )
    warmup.watch_late_compiles()
    warmup.watch_late_compiles()  # idempotent: one hook, not a chain of two
    hook = triton.knobs.runtime.jit_post_compile_hook

    def compiled(module: str, name: str, manual: bool) -> None:
        fn = SimpleNamespace(module=module, name=name, jit_function=None)
        repr_ = f"{name}[num_warps=4, num_ctas=1, num_stages=3](x_ptr: *bf16, n: i32)"
        hook(key=("k",), repr=repr_, fn=fn, compile={}, is_manual_warmup=manual,
             already_compiled=False)  # fmt: skip

    with caplog.at_level(logging.WARNING, logger="specserve"):
        compiled("specserve.ops.gemv", "_gemv_kernel", manual=False)
        compiled("specserve.ops.skinny", "_skinny_kernel", manual=True)
        compiled("other_package.kernels", "_other_kernel", manual=False)
    logged = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(logged) == 1 and "_gemv_kernel[num_warps=4" in logged[0]
    assert "after the warm-up" in logged[0]
    assert len(calls) == 3  # the earlier hook still sees every compile
    assert warmup.late_compiles[-1] in logged[0]
    # Another engine's start-up (its plan timing, capture, warm-up) compiles without a warning.
    with caplog.at_level(logging.WARNING, logger="specserve"), warmup.engine_startup():
        compiled("specserve.ops.gemv", "_gemv_kernel", manual=False)
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1
    assert len(calls) == 4


def test_describe_compile_names_the_specialization() -> None:
    """The hook's `compile` keywords as Triton 3.6 passes them (constants and divisibility
    attributes keyed by argument paths) become argument names: which int was 1, which pointers
    and ints were multiples of 16."""
    from types import SimpleNamespace

    from specserve.worker.warmup import describe_compile

    params = [SimpleNamespace(name=n) for n in ("x_ptr", "y_ptr", "M", "K", "BLOCK_M")]
    fn = SimpleNamespace(name="_skinny_kernel", jit_function=SimpleNamespace(params=params))
    comp = {
        "constants": {(2,): 1, (4,): 32},
        "configs": [{(0,): [["tt.divisibility", 16]], (3,): [["tt.divisibility", 16]]}],
        "num_warps": 4,
        "num_stages": 3,
    }
    text = describe_compile({"fn": fn, "compile": comp, "repr": "unused"})
    assert text == (
        "_skinny_kernel[num_warps=4, num_stages=3](M=1, BLOCK_M=32; 16-divisible: x_ptr, K)"
    )
    # Nothing to name: Triton's own text
    assert describe_compile({"fn": fn, "compile": {}, "repr": "r"}) == "r"


@pytest.mark.gpu
def test_late_compile_is_logged_gpu(caplog: Any) -> None:
    """A real compile after watch_late_compiles: the RMSNorm kernel at a width no model here
    has (BLOCK 16384) is logged with its name; running it again logs nothing."""
    import logging

    from specserve.ops.triton_kernels import rms_norm_triton
    from specserve.worker.warmup import watch_late_compiles

    watch_late_compiles()
    x = torch.randn(3, 8200, device="cuda", dtype=torch.bfloat16)
    w = torch.ones(8200, device="cuda", dtype=torch.bfloat16)
    with caplog.at_level(logging.WARNING, logger="specserve"):
        rms_norm_triton(x, w, 1e-6, None)
        first = [r.getMessage() for r in caplog.records if "after the warm-up" in r.getMessage()]
        rms_norm_triton(x, w, 1e-6, None)
    again = [r.getMessage() for r in caplog.records if "after the warm-up" in r.getMessage()]
    assert len(first) == 1 and "_rms_norm_kernel[" in first[0]
    assert "BLOCK=16384" in first[0]  # the specialization, by argument name
    assert again == first
