"""Deleting an LLM returns its memory at once: no reference cycle (graph runners, drafters,
closures) and no module-level cache keeps an engine, its model or its KV cache alive, so `del
llm` frees them by reference counting alone, without waiting for a garbage collection (which a
notebook or a benchmark script may not run before it builds the next LLM). The same holds for
an LLMEngine built directly (the benchmarks' way), and benchmarks/fp8_kv.py lets go of each
engine before it builds the next: every engine sizes its KV pool from the memory free then."""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import subprocess
import sys
import weakref
from typing import Any

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.config import EngineConfig
from specserve.engine.engine import LLMEngine

from .spec_utils import write_eagle3

ROOT = os.path.join(os.path.dirname(__file__), "..")
SP = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": [1, 5, 9, 3 + i]} for i in range(3)]


def _refs(llm: LLM | LLMEngine) -> dict[str, weakref.ref]:
    e = llm.engine if isinstance(llm, LLM) else llm
    refs = {
        "engine": weakref.ref(e),
        "runner": weakref.ref(e.runner),
        "model": weakref.ref(e.model),
        "weight": weakref.ref(next(e.model.parameters())),
    }
    if e.speculator is not None:
        refs["speculator"] = weakref.ref(e.speculator)
        if e.speculator.model is not None:
            refs["draft_model"] = weakref.ref(e.speculator.model)
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


@pytest.mark.parametrize("kv,spec", [("auto", False), ("fp8", False), ("fp8", True)])
def test_deleted_engine_frees_everything(ckpt_dir, tmp_path, kv: str, spec: bool) -> None:
    """An LLMEngine built directly as benchmarks/fp8_kv.py builds its capacity engines (eager,
    no warm-up, an fp8 or model-dtype KV cache, EAGLE-3 or none), run and deleted with the
    collector off: its model, weights, drafter and KV cache are gone right after `del`."""
    path = ckpt_dir("llama_gqa", "llama")
    cfg = None
    if spec:
        e3 = write_eagle3(str(tmp_path / "e3"))
        cfg = {"method": "eagle3", "model": e3, "num_speculative_tokens": 3}
    gc.collect()
    gc.disable()
    try:
        engine = LLMEngine(
            EngineConfig(
                model=path, max_model_len=128, max_num_seqs=4, kv_cache_dtype=kv,
                enforce_eager=True, warmup=False, speculative_config=cfg,
            )
        )  # fmt: skip
        for i, p in enumerate(PROMPTS):
            engine.add_request(str(i), p, SP)
        engine.run_to_completion()
        refs = _refs(engine)
        del engine
        alive = {k: r for k, r in refs.items() if r() is not None}
        assert not alive, f"kept alive: {_holders(alive)}"
    finally:
        gc.enable()


def _fp8_kv_script() -> Any:
    """benchmarks/fp8_kv.py as a module."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    path = os.path.join(ROOT, "benchmarks", "fp8_kv.py")
    spec = importlib.util.spec_from_file_location("fp8_kv", path)
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


def test_fp8_kv_benchmark_frees_each_engine_before_the_next(monkeypatch) -> None:
    """benchmarks/fp8_kv.py builds engine after engine in one process: when each is built, no
    earlier one's model may still be referenced (a caller's `eng` that outlived its close()
    kept the Llama-3-8B shape's weights, ~15 GB, out of the next engine's KV pool)."""
    mod = _fp8_kv_script()
    models: list[weakref.ref] = []
    make = mod.make_engine

    def make_engine(*a: object, **kw: object) -> object:
        alive = [i for i, r in enumerate(models) if r() is not None]
        assert not alive, f"engines {alive} still referenced when engine {len(models)} is built"
        engine = make(*a, **kw)
        models.append(weakref.ref(engine.model))
        return engine

    monkeypatch.setattr(mod, "make_engine", make_engine)
    # The steps' times are not under test (the engines' release after running steps is).
    monkeypatch.setattr(mod, "measure", lambda *a, **kw: {"ms_per_step": 1.0})
    target_cfg, head_cfg = mod.SHAPES["tiny"]
    target = mod.write_config({**target_cfg, "max_position_embeddings": 16384})
    args = mod.argparse.Namespace(shape="tiny", device="cpu", quick=True, long_ctx=64)
    rows = mod.decode_rows(target, mod.write_config(head_cfg), args)
    assert len(rows) == len(models) == 6
    assert all(r() is None for r in models)


def test_fp8_kv_capacity_only_prints_one_pool(tmp_path) -> None:
    """`fp8_kv.py --capacity-only KV`, the fresh process each KV dtype's pool is measured in,
    prints that pool as its last stdout line."""
    env = {**os.environ, "OUT": str(tmp_path), "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    script = os.path.join(ROOT, "benchmarks", "fp8_kv.py")
    cmd = [sys.executable, script, "--capacity-only", "fp8", "--device", "cpu", "--shape", "tiny"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    pool = json.loads(proc.stdout.strip().splitlines()[-1])
    assert pool["max_concurrency"] == pool["kv_cache_num_tokens"] // 256 > 0
    assert pool["kv_cache_num_blocks"] > 0


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
