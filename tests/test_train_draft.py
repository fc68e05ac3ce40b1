"""`specserve train-draft`: every method trains, writes a dir the engine loads, stays lossless.

A tiny random Llama target with a tiny BPE tokenizer; a few dozen CPU steps per method. The
stronger check trains EAGLE on a target it can learn in seconds and measures acceptance through
the engine against an untrained head.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from collections import Counter

import pytest
import torch
from safetensors.torch import load_file, save_file

from specserve import LLM, SamplingParams
from specserve.train.data import read_texts, tokenize
from specserve.train.drafter import train_drafter

from .conftest import VOCAB, make_checkpoint
from .tok_utils import CORPUS, make_tokenizer

EVAL = dict(eval_k=3, eval_num_prompts=3, eval_prompt_tokens=12, eval_max_tokens=16)
FAST = dict(steps=30, batch_size=4, seq_len=32, lr=3e-3, progress=False, **EVAL)
DRAFT_VOCAB = 200
# name -> (method, extra train_drafter arguments)
RUNS = {
    "eagle": ("eagle", {}),
    "eagle3": ("eagle3", {"draft_vocab_size": DRAFT_VOCAB}),
    "mtp": ("mtp", {}),
    "ptd": ("ptd", {"draft_vocab_size": DRAFT_VOCAB}),
    # Two chained MTP modules (spec_decode/multi_layer_mtp.py), evaluated at K = 3 > 2 modules
    # (draft step i runs module i mod 2).
    "mtp2": ("mtp", {"num_layers": 2}),
}


def corpus(n: int = 40, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(CORPUS) for _ in range(5)) for _ in range(n)]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("train_draft")
    path = make_checkpoint(os.path.join(root, "target"), "llama")
    tok = make_tokenizer(root)
    for name in os.listdir(tok):
        shutil.copy(os.path.join(tok, name), path)
    return path


@pytest.fixture(scope="module")
def trained(target: str, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Each method trained once; greedy outputs without speculation on the same prompts."""
    root = tmp_path_factory.mktemp("heads")
    texts = corpus()
    runs = {}
    for name in RUNS:
        method, extra = RUNS[name]
        runs[name] = train_drafter(target, method, os.path.join(root, name), texts, **FAST | extra)
    prompts = runs["eagle"]["eval_prompt_ids"]
    sp = SamplingParams(temperature=0.0, max_tokens=EVAL["eval_max_tokens"], ignore_eos=True)
    ref = LLM(target, max_model_len=128).generate(
        [{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False
    )
    return {"runs": runs, "ref": [list(o.outputs[0].token_ids) for o in ref], "texts": texts}


@pytest.mark.parametrize("name", list(RUNS))
def test_trains_loads_and_stays_lossless(trained: dict, name: str) -> None:
    r = trained["runs"][name]
    losses = r["losses"]
    assert len(losses) == FAST["steps"]
    assert sum(losses[-5:]) / 5 < 0.9 * sum(losses[:5]) / 5, losses
    for name in ("model.safetensors", "config.json", "loss_curve.png", "train_log.json"):
        assert os.path.isfile(os.path.join(r["out_dir"], name)), name
    # The engine loaded the dir and drafted with it; greedy output is the target's own.
    assert r["eval_prompt_ids"] == trained["runs"]["eagle"]["eval_prompt_ids"]
    assert r["eval_token_ids"] == trained["ref"]
    assert r["acceptance_length"] >= 1.0


def _tensors(run: dict) -> tuple[dict, dict]:
    with open(os.path.join(run["out_dir"], "config.json")) as f:
        cfg = json.load(f)
    return cfg, load_file(os.path.join(run["out_dir"], "model.safetensors"))


def test_eagle_layouts(trained: dict) -> None:
    cfg, t = _tensors(trained["runs"]["eagle"])
    assert {"fc.weight", "fc.bias", "layers.0.self_attn.q_proj.weight"} <= set(t)
    assert "layers.0.mlp.gate_proj.weight" in t and "layers.0.input_layernorm.weight" not in t
    assert not any(n.startswith(("embed_tokens", "lm_head")) for n in t)  # shared with target
    cfg, t = _tensors(trained["runs"]["mtp"])
    assert cfg["num_nextn_predict_layers"] == 1 and cfg["num_hidden_layers"] == 4
    assert {"model.layers.4.eh_proj.weight", "model.layers.4.shared_head.norm.weight"} <= set(t)
    assert all(n.startswith("model.layers.4.") for n in t)
    cfg, t = _tensors(trained["runs"]["mtp2"])
    assert cfg["num_nextn_predict_layers"] == 2
    assert {n.split(".")[2] for n in t} == {"4", "5"}


@pytest.mark.parametrize("method", ["eagle3", "ptd"])
def test_eagle3_draft_vocab(trained: dict, method: str) -> None:
    cfg, t = _tensors(trained["runs"][method])
    assert cfg["draft_vocab_size"] == DRAFT_VOCAB
    assert len(cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]) == 3
    d2t, t2d = t["d2t"], t["t2d"]
    assert d2t.dtype == torch.int64 and d2t.shape == (DRAFT_VOCAB,)
    assert t2d.dtype == torch.bool and t2d.shape == (VOCAB,) and int(t2d.sum()) == DRAFT_VOCAB
    ids = torch.arange(DRAFT_VOCAB) + d2t  # draft id + d2t[draft id] = target id
    assert bool((ids[1:] > ids[:-1]).all()) and bool(t2d[ids].all())
    assert t["lm_head.weight"].shape[0] == DRAFT_VOCAB


def test_draft_vocab_is_most_frequent(target: str, trained: dict) -> None:
    """The draft vocabulary holds the most frequent tokens of the training documents."""
    from transformers import AutoTokenizer

    _, t = _tensors(trained["runs"]["eagle3"])
    docs = tokenize(AutoTokenizer.from_pretrained(target), trained["texts"])
    counts = Counter(i for d in docs[: -max(1, len(docs) // 20)] for i in d)
    inside = [counts[i] for i in range(VOCAB) if t["t2d"][i]]
    outside = [counts[i] for i in range(VOCAB) if not t["t2d"][i]]
    assert min(inside) >= max(outside)


def test_ptd_layout(trained: dict) -> None:
    cfg, t = _tensors(trained["runs"]["ptd"])
    assert cfg["parallel_draft"] is True
    assert cfg["ptd_max_k"] == EVAL["eval_k"] and 0 <= cfg["ptd_token_id"] < VOCAB
    assert t["mask_hidden"].shape == (cfg["hidden_size"],)
    assert {"midlayer.hidden_norm.weight", "fc.weight", "norm.weight"} <= set(t)


@pytest.mark.parametrize("method", ["eagle", "eagle3", "mtp", "ptd"])
def test_unrolled_steps_match_step_by_step_drafting(target: str, method: str) -> None:
    """Training's unrolled steps (one batched forward per step, `UnrolledBackend`) give what
    drafting one slot at a time with plain causal attention gives, as the engine drafts: the
    accepted context 0..i from target hidden states, then slots at i + 1, i + 2, ... fed the
    drafted token and the carry (PTD: the mask token and mask_hidden)."""
    from specserve.attention.dense import dense_context
    from specserve.models.registry import load_model
    from specserve.train.drafter import DraftTrainConfig, method_class
    from specserve.train.unrolled import target_signals, unrolled_outputs

    S = 12
    cfg = DraftTrainConfig(method=method, seq_len=S, ttt_steps=3, eval_k=4, device="cpu")
    tgt, tcfg = load_model(target, torch.float32, torch.device("cpu"), 64)
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    dm = method_class(method)(tgt, tcfg, cfg, torch.randint(0, VOCAB, (500,), generator=g))
    tokens = torch.randint(3, VOCAB, (2, S), generator=g)
    with torch.no_grad():
        sig = target_signals(dm, tgt, tokens)
        outs = [out for _, out in unrolled_outputs(dm, sig, tokens)]
        fused = dm.first_hidden(sig.hidden, sig.aux).view(2, S, -1)
        d = dm.drafters[0]
        for b, i in [(0, 0), (0, 5), (1, 8)]:
            ids, hid, pos = tokens[b, 1 : i + 2], fused[b, : i + 1], torch.arange(i + 1)
            for k in range(dm.num_steps):
                out, carry = d(ids, pos, hid, dense_context(1, len(ids), ids.device))
                torch.testing.assert_close(out[-1], outs[k][b, i], atol=1e-5, rtol=1e-4)
                if method == "ptd":
                    nxt, h = torch.tensor([dm.ptd_token_id]), dm.mask_hidden[None]
                else:
                    nxt, h = tokens[b, i + k + 2 : i + k + 3], carry[-1:]
                ids, hid = torch.cat([ids, nxt]), torch.cat([hid, h])
                pos = torch.arange(i + k + 2)
                if i + k + 3 >= S:
                    break


def test_same_seed_same_losses(target: str, tmp_path) -> None:
    kw = dict(FAST, steps=6, eval_prompts=[], draft_vocab_size=DRAFT_VOCAB)
    a = train_drafter(target, "eagle3", str(tmp_path / "a"), corpus(), **kw)
    b = train_drafter(target, "eagle3", str(tmp_path / "b"), corpus(), **kw)
    c = train_drafter(target, "eagle3", str(tmp_path / "c"), corpus(), **dict(kw, seed=1))
    assert a["losses"] == b["losses"]
    assert a["losses"] != c["losses"]
    wa = load_file(str(tmp_path / "a" / "model.safetensors"))
    wb = load_file(str(tmp_path / "b" / "model.safetensors"))
    assert all(torch.equal(wa[n], wb[n]) for n in wa)


def test_cli_end_to_end(target: str, tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    from specserve.entrypoints.cli import main

    data = tmp_path / "data"
    (data / "pkg").mkdir(parents=True)
    texts = corpus(12, seed=3)
    (data / "a.txt").write_text("\n".join(texts[:4]))
    (data / "pkg" / "b.py").write_text("def main():\n    return [x * 2 for x in range(10)]\n")
    rows = [{"text": t} for t in texts[4:8]] + [{"prompt": t} for t in texts[8:]]
    (data / "c.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (data / "skip.bin").write_bytes(b"\x00\x01")
    assert len(read_texts([str(data)])) == 1 + 1 + 8
    out = tmp_path / "head"
    rc = main(
        ["train-draft", "--target", target, "--method", "eagle3", "--data", str(data)]
        + ["--out", str(out), "--steps", "4", "--batch-size", "2", "--seq-len", "16"]
        + ["--draft-vocab-size", "100", "--num-speculative-tokens", "2", "--ttt-steps", "2"]
        + ["--eval-num-prompts", "2", "--eval-max-tokens", "8", "--no-progress"]
    )
    assert rc == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["steps"] == 4 and summary["acceptance_length"] >= 1.0
    assert os.path.isfile(out / "loss_curve.png")
    with open(out / "config.json") as f:
        assert json.load(f)["draft_vocab_size"] == 100


def _learnable_target(path: str) -> str:
    """A near-bigram target (attention and MLP outputs scaled down): what it predicts depends
    mostly on the current token, which a short CPU run can learn."""
    make_checkpoint(path, "llama", seed=1)
    w = load_file(os.path.join(path, "model.safetensors"))
    for n in w:
        if n.endswith(("o_proj.weight", "down_proj.weight")):
            w[n] = w[n] * 0.05
    save_file(w, os.path.join(path, "model.safetensors"))
    return path


def test_training_beats_untrained_head(tmp_path) -> None:
    target = _learnable_target(str(tmp_path / "target"))
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(3, VOCAB, (64,), generator=g).tolist() for _ in range(64)]
    kw = dict(batch_size=8, seq_len=32, lr=1e-2, ttt_steps=1, progress=False)
    kw.update(eval_k=3, eval_num_prompts=4, eval_prompt_tokens=16, eval_max_tokens=32)
    untrained = train_drafter(target, "eagle", str(tmp_path / "h0"), docs, steps=0, **kw)
    trained = train_drafter(target, "eagle", str(tmp_path / "h1"), docs, steps=150, **kw)
    a0, a1 = untrained["acceptance_length"], trained["acceptance_length"]
    assert trained["eval_token_ids"] == untrained["eval_token_ids"]  # both lossless
    assert a1 > a0 + 0.3, (a0, a1, trained["step_accuracy"])
