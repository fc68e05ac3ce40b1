"""Tensor parallelism on the CPU: TP = 2 over gloo, in two processes, gives TP = 1's greedy tokens
for dense, MoE and MLA targets and every drafter, with chunked prefill, preemption and prefix
caching; structured outputs (rank 0's grammar masks sent to the worker) give TP = 1's tokens too;
every step the engine compares the tokens each rank sampled (SPECSERVE_TP_CHECK); a killed rank
fails the engine with a clear error."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Iterator

import jsonschema
import pytest
import torch
from torch import nn

from specserve import LLM, SamplingParams, StructuredOutputsParams
from specserve.data import embedded_model_dir, load_prompts
from specserve.distributed import TensorParallelError
from specserve.engine.tp_executor import CHECK_ENV

from .conftest import random_prompts
from .mla_utils import mla_ckpt  # noqa: F401 - fixture
from .spec_utils import (
    write_eagle,
    write_eagle3,
    write_mtp_target,
    write_multi_mtp_target,
    write_ptd_eagle3,
)
from .test_structured import CHOICES, NGRAM, REGEX, SCHEMA

pytestmark = pytest.mark.usefixtures("one_torch_thread", "tp_check")

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
PROMPTS = random_prompts(3, 4, 24, seed=11)
# Dense: qkv biases, one KV head (replicated on both ranks), tied embeddings and a vocabulary
# that does not split evenly (the last rank's shard is padded).
DENSE = dict(num_key_value_heads=1, tie_word_embeddings=True, vocab_size=385)
QWEN3_MOE = dict(
    num_hidden_layers=3, head_dim=16, moe_intermediate_size=32, num_experts=8,
    num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1],
)  # fmt: skip
GLM4_MOE = dict(
    num_hidden_layers=3, head_dim=16, moe_intermediate_size=32, n_routed_experts=8,
    num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
    first_k_dense_replace=1, routed_scaling_factor=2.5, attention_bias=True, use_qk_norm=True,
)  # fmt: skip


@pytest.fixture(scope="module")
def tp_check() -> Iterator[None]:
    """Every TP engine of this module compares the ranks' sampled tokens after each step."""
    old = os.environ.get(CHECK_ENV)
    os.environ[CHECK_ENV] = "1"
    yield
    if old is None:
        del os.environ[CHECK_ENV]
    else:
        os.environ[CHECK_ENV] = old


def generate(path: str, tp: int, prompts: list[list[int]] = PROMPTS, **kw) -> list[list[int]]:
    llm = LLM(path, tensor_parallel_size=tp, max_model_len=128, **kw)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
        return [o.outputs[0].token_ids for o in outs]
    finally:
        llm.shutdown()


def assert_tp_equal(path: str, **kw) -> None:
    assert generate(path, 2, **kw) == generate(path, 1, **kw)


@pytest.mark.parametrize(
    "name,arch,over",
    [("tp_qwen2", "qwen2", DENSE), ("tp_qwen3_moe", "qwen3_moe", QWEN3_MOE),
     ("tp_glm4_moe", "glm4_moe", GLM4_MOE)],
)  # fmt: skip
def test_target_equals_tp1(ckpt_dir, name: str, arch: str, over: dict) -> None:
    assert_tp_equal(ckpt_dir(name, arch, **over))


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v3_no_q_lora"])
def test_mla_equals_tp1(mla_ckpt, name: str) -> None:  # noqa: F811 - fixture
    assert_tp_equal(mla_ckpt(name))


@pytest.fixture(scope="module")
def spec_setup(ckpt_dir, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("tp_drafters")
    target = ckpt_dir("llama_gqa", "llama")
    return {
        "target": target,
        "ref": generate(target, 1),
        "draft_model": ckpt_dir("small_draft", "llama", num_hidden_layers=2, seed=5),
        "eagle": write_eagle(os.path.join(root, "eagle")),
        "eagle3": write_eagle3(os.path.join(root, "eagle3")),
        "ptd": write_ptd_eagle3(os.path.join(root, "ptd_eagle3")),
        "mtp": write_mtp_target(target, os.path.join(root, "mtp_target")),
        "mtp2": write_multi_mtp_target(target, os.path.join(root, "mtp2"), 2, seed=3),
    }


# name -> (speculative_config without K, target key)
DRAFTERS = {
    "draft_model": ({"method": "draft_model", "model": "draft_model"}, "target"),
    "eagle": ({"method": "eagle", "model": "eagle"}, "target"),
    "eagle3": ({"method": "eagle3", "model": "eagle3"}, "target"),
    "eagle3_unsharded": (
        {"method": "eagle3", "model": "eagle3", "draft_tensor_parallel_size": 1},
        "target",
    ),
    "parallel_draft": ({"method": "eagle3", "model": "ptd", "parallel_draft": True}, "target"),
    "mtp": ({"method": "mtp"}, "mtp"),
    "multi_layer_mtp": ({"method": "mtp"}, "mtp2"),
    "ngram": ({"method": "ngram"}, "target"),
    # Rank 0's adaptive budget picks each step's draft count; the message carries it.
    "eagle3_adaptive": ({"method": "eagle3", "model": "eagle3", "adaptive": True}, "target"),
    "eagle3_tree": (
        {"method": "eagle3", "model": "eagle3", "draft_tree": {"topk": 2, "depth": 2}},
        "target",
    ),
}


def spec_config(setup: dict, name: str) -> tuple[dict, str]:
    cfg, target = DRAFTERS[name]
    cfg = {"num_speculative_tokens": 3, "adaptive": False, **cfg}
    if "model" in cfg:
        cfg["model"] = setup[cfg["model"]]
    return cfg, setup[target]


@pytest.mark.parametrize("name", list(DRAFTERS))
def test_drafters_equal_plain(spec_setup: dict, name: str) -> None:
    cfg, target = spec_config(spec_setup, name)
    assert generate(target, 2, speculative_config=cfg) == spec_setup["ref"]


def test_chunked_prefill_preemption_prefix_cache(spec_setup: dict) -> None:
    """Shared prefixes (cache hits), prompts longer than the token budget (chunks) and a pool
    too small for every request at once (preemption), with an EAGLE-3 drafter."""
    base = random_prompts(1, 40, 40, seed=3)[0]
    prompts = [base + p for p in random_prompts(4, 3, 12, seed=5)]
    cfg, target = spec_config(spec_setup, "eagle3")
    kw = dict(
        prompts=prompts,
        speculative_config=cfg,
        max_num_batched_tokens=32,
        num_gpu_blocks_override=12,
        block_size=8,
    )
    plain = generate(target, 1, prompts=prompts, max_num_batched_tokens=32, block_size=8)
    assert generate(target, 2, **kw) == plain


def test_killed_rank_fails_the_engine(ckpt_dir) -> None:
    llm = LLM(ckpt_dir("llama_gqa", "llama"), tensor_parallel_size=2, max_model_len=128)
    try:
        (worker,) = llm.engine.runner.procs
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(10)
        t0 = time.monotonic()
        with pytest.raises(TensorParallelError, match="rank 1 .* exited with code -9"):
            llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY)
        assert time.monotonic() - t0 < 60
    finally:
        llm.shutdown()


def test_config_errors(ckpt_dir) -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        LLM(ckpt_dir("llama_gqa", "llama"), tensor_parallel_size=0)
    spec = {"method": "ngram", "draft_tensor_parallel_size": 3}
    with pytest.raises(ValueError, match="draft_tensor_parallel_size must be 1"):
        LLM(ckpt_dir("llama_gqa", "llama"), tensor_parallel_size=2, speculative_config=spec)


def test_server_answers_503_and_exits_when_a_rank_dies(ckpt_dir) -> None:
    """`specserve serve --tensor-parallel-size 2`: a killed worker rank fails the request in
    flight with a 503, and the server process exits with status 1."""
    import socket
    import subprocess
    import sys

    import httpx
    import psutil

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    url = f"http://127.0.0.1:{port}"
    args = [sys.executable, "-m", "specserve.entrypoints.cli", "serve", ckpt_dir("llama_gqa")]
    args += ["--port", str(port), "--tensor-parallel-size", "2", "--device", "cpu"]
    args += ["--uvicorn-log-level", "warning"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(args, env=env, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline, "server did not start"
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        workers = [
            p
            for p in psutil.Process(proc.pid).children(recursive=True)
            if "_worker_main" in " ".join(p.cmdline()) or "spawn_main" in " ".join(p.cmdline())
        ]
        assert workers
        for w in workers:
            if "resource_tracker" not in " ".join(w.cmdline()):
                w.kill()
        t0 = time.monotonic()
        body = {"prompt": PROMPTS[0], "max_tokens": 4}
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 503
        assert proc.wait(60) == 1
        assert time.monotonic() - t0 < 60
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_two_nodes_rendezvous(ckpt_dir, monkeypatch) -> None:
    """The documented multi-machine launch, both "nodes" on this machine: node 0 (this process)
    holds the engine, node 1 runs the same LLM(...) with NODE_RANK=1 and only serves steps,
    exiting when the engine shuts down."""
    import socket
    import subprocess
    import sys

    path = ckpt_dir("llama_gqa")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    rdv = {"NNODES": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    code = f"from specserve import LLM; LLM({path!r}, tensor_parallel_size=2, max_model_len=128)"
    env = {**os.environ, **rdv, "NODE_RANK": "1", "OMP_NUM_THREADS": "1"}
    node1 = subprocess.Popen([sys.executable, "-c", code], env=env)
    try:
        for k, v in {**rdv, "NODE_RANK": "0"}.items():
            monkeypatch.setenv(k, v)
        assert generate(path, 2) == generate(path, 1)
        assert node1.wait(30) == 0
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait()


@pytest.mark.parametrize("drafter", [None, "eagle3", "ngram"])
def test_structured_outputs_equal_tp1(drafter: str | None) -> None:
    """Greedy requests under a JSON schema, a regex and a choice list: TP = 2 gives TP = 1's
    tokens (rank 0's masks reach the worker each step), plain and with a fixed K of device and
    host drafts; the JSON validates against its schema."""
    target, eagle3 = embedded_model_dir()
    spec = {"eagle3": eagle3, "ngram": NGRAM, None: None}[drafter]
    kw = {} if spec is None else {"speculative_config": {**spec, "adaptive": False}}
    constraints = [
        StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
        StructuredOutputsParams(regex=REGEX),
        StructuredOutputsParams(choice=CHOICES),
    ]
    prompts = [r["prompt"] for r in load_prompts("code", 2)]
    reqs = [(p, so) for p in prompts for so in constraints]
    sps = [SamplingParams(temperature=0.0, max_tokens=48, structured_outputs=so) for _, so in reqs]
    outs = {}
    for tp in (1, 2):
        llm = LLM(target, tensor_parallel_size=tp, max_model_len=256, **kw)
        try:
            got = llm.generate([p for p, _ in reqs], sps, use_tqdm=False)
            outs[tp] = [o.outputs[0] for o in got]
        finally:
            llm.shutdown()
    assert [c.token_ids for c in outs[2]] == [c.token_ids for c in outs[1]]
    for c, (_, so) in zip(outs[2], reqs):
        assert c.finish_reason == "stop", c.text
        if so.json is not None:
            jsonschema.validate(json.loads(c.text), SCHEMA)
        elif so.regex is not None:
            assert re.fullmatch(REGEX, c.text), c.text
        else:
            assert c.text in CHOICES, c.text


def test_a_sharded_model_is_built_without_its_full_weights(ckpt_dir) -> None:
    """Under tensor parallelism the model is built with its parameters on the meta device and
    each rank allocates only its shard (a Llama-3-70B built whole would need ~131 GiB on each
    GPU first); buffers such as the rotary tables are built for real. A one-rank group: the
    shard is the whole tensor, loaded equal to the unsharded model's."""
    from specserve.distributed import TensorParallel
    from specserve.models.registry import load_model
    from specserve.models.tensor_parallel import params_on_meta

    path = ckpt_dir("tp_qwen2", "qwen2", **DENSE)
    with torch.device("cpu"), params_on_meta():
        lin = nn.Linear(4, 8)
        lin.register_buffer("table", torch.arange(3.0))
    assert lin.weight.is_meta and lin.bias.is_meta and not lin.table.is_meta
    assert lin.table.tolist() == [0.0, 1.0, 2.0]
    assert not nn.Linear(2, 2).weight.is_meta  # outside the context: real again
    tp = TensorParallel(0, 1, "127.0.0.1", 0, torch.device("cpu"), 30.0)
    sharded, _ = load_model(path, torch.float32, "cpu", 128, tp=tp)
    whole, _ = load_model(path, torch.float32, "cpu", 128)
    got, want = dict(sharded.named_parameters()), dict(whole.named_parameters())
    assert not any(p.is_meta for p in got.values())
    assert not any(b.is_meta for b in sharded.buffers())
    for name, p in want.items():
        torch.testing.assert_close(got[name], p, rtol=0, atol=0, msg=name)
