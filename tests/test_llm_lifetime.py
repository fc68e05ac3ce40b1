"""Deleting an LLM returns its memory at once: no reference cycle (graph runners, drafters,
closures) and no module-level cache keeps an engine, its model or its KV cache alive, so `del
llm` frees them by reference counting alone, without waiting for a garbage collection (which a
notebook or a benchmark script may not run before it builds the next LLM)."""

from __future__ import annotations

import gc
import os
import weakref

import pytest
import torch

from specserve import LLM, SamplingParams

from .spec_utils import write_eagle3

SP = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": [1, 5, 9, 3 + i]} for i in range(3)]


def _refs(llm: LLM) -> dict[str, weakref.ref]:
    e = llm.engine
    refs = {
        "engine": weakref.ref(e),
        "runner": weakref.ref(e.runner),
        "model": weakref.ref(e.model),
    }
    if e.speculator is not None:
        refs["speculator"] = weakref.ref(e.speculator)
    for i, kv in enumerate(e.runner.kv_caches):
        refs[f"kv{i}"] = weakref.ref(kv)
    return refs


def _delete_without_gc(make: object) -> dict[str, weakref.ref]:
    """Build an LLM with `make`, run a batch, delete it with the collector off; the refs."""
    gc.collect()
    gc.disable()
    try:
        llm = make()  # type: ignore[operator]
        llm.generate(PROMPTS, SP, use_tqdm=False)
        refs = _refs(llm)
        del llm
        return {k: r for k, r in refs.items() if r() is not None}
    finally:
        gc.enable()


def _holders(refs: dict[str, weakref.ref]) -> str:
    out = []
    for name, r in refs.items():
        obj = r()
        if obj is not None:
            kinds = [type(h).__name__ for h in gc.get_referrers(obj) if h is not refs]
            out.append(f"{name} <- {kinds}")
    return "; ".join(out)


@pytest.mark.parametrize("spec", [None, "eagle3", "ngram"])
def test_deleted_llm_frees_everything(ckpt_dir, tmp_path, spec: str | None) -> None:
    """Create, delete (collector off) and re-create an LLM: the engine, runner, model, drafter
    and every KV cache tensor are gone right after `del`; the second LLM works."""
    path = ckpt_dir("llama_gqa", "llama")
    cfg = None
    if spec == "eagle3":
        e3 = write_eagle3(str(tmp_path / "e3"))
        cfg = {"method": "eagle3", "model": e3, "num_speculative_tokens": 3}
    elif spec == "ngram":
        cfg = {"method": "ngram", "num_speculative_tokens": 3}

    def make() -> LLM:
        return LLM(path, max_model_len=128, max_num_seqs=4, speculative_config=cfg)

    for _ in range(2):
        alive = _delete_without_gc(make)
        assert not alive, f"kept alive: {_holders(alive)}"


def test_shutdown_frees_while_referenced(ckpt_dir) -> None:
    """`llm.shutdown()` (or leaving `with LLM(...)`) drops the KV cache even while something
    still holds the LLM (a notebook variable, a traceback)."""
    path = ckpt_dir("llama_gqa", "llama")
    with LLM(path, max_model_len=128, max_num_seqs=4) as llm:
        llm.generate(PROMPTS, SP, use_tqdm=False)
        kv = [weakref.ref(t) for t in llm.engine.runner.kv_caches]
    assert kv and all(r() is None for r in kv)
    assert llm.engine.runner.cudagraphs is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("spec", [None, "eagle3"])
def test_recreate_llm_at_90_percent_gpu(ckpt_dir, tmp_path, spec: str | None) -> None:
    """An LLM whose KV cache takes 90% of the GPU, with CUDA graphs (target and draft loop),
    deleted and re-created twice in one process with the collector off: no OOM, and the memory
    PyTorch holds returns to where it started."""
    path = ckpt_dir("llama_gqa", "llama")
    cfg = None
    if spec == "eagle3":
        e3 = write_eagle3(os.path.join(tmp_path, "e3"))
        cfg = {"method": "eagle3", "model": e3, "num_speculative_tokens": 4}
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()

    def make() -> LLM:
        return LLM(
            path,
            device="cuda",
            dtype="bfloat16",
            max_model_len=256,
            max_num_seqs=8,
            gpu_memory_utilization=0.9,
            speculative_config=cfg,
        )

    for _ in range(3):
        alive = _delete_without_gc(make)
        assert not alive, f"kept alive: {_holders(alive)}"
        torch.cuda.empty_cache()
        assert torch.cuda.memory_allocated() - base < 64 << 20
