"""The reference family's parts on CPU: corpus, tokenizer, target training and its checkpoint."""

from __future__ import annotations

import ast
import json
import os
import shutil
from dataclasses import replace
from typing import Any

import pytest
import torch

from specserve.train import corpus
from specserve.train.family import complete_function, fraction_parsing, parses
from specserve.train.reference import (
    ModelShape,
    TrainConfig,
    cosine_lr,
    hf_state_dict,
    llama_config,
    save_hf,
    train_reference,
)
from specserve.train.tokenizer import (
    CHAT_TEMPLATE,
    SPECIAL_TOKENS,
    encode_documents,
    render_chat,
    special_ids,
    train_tokenizer,
)

VOCAB = 640
SHAPE = ModelShape(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)
TRAIN = TrainConfig(seq_len=32, batch_size=8, max_steps=60, lr=1e-2, warmup_steps=5, seed=3)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def files() -> list[corpus.SourceFile]:
    return corpus.load_corpus("train", limit=24)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory, files: list[corpus.SourceFile]) -> str:
    return train_tokenizer((f.text for f in files), VOCAB, str(tmp_path_factory.mktemp("tok")))


@pytest.fixture(scope="module")
def tokens(tok_dir: str, files: list[corpus.SourceFile]) -> Any:
    return encode_documents(tok_dir, [f.text for f in files])


@pytest.fixture(scope="module")
def trained(tok_dir: str, tokens: Any) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    cfg = llama_config(SHAPE, special_ids(tok_dir), torch.float32)
    model, record = train_reference(cfg, tokens, TRAIN, "cpu", progress=False)
    return model, cfg, record


@pytest.fixture(scope="module")
def ckpt(
    tmp_path_factory: pytest.TempPathFactory, tok_dir: str, trained: tuple[Any, Any, Any]
) -> str:
    model, cfg, _ = trained
    out = str(tmp_path_factory.mktemp("target"))
    save_hf(model, cfg, out, torch.float32)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(os.path.join(tok_dir, name), out)
    return out


# ---- corpus -------------------------------------------------------------------------------------
def test_corpus_is_deterministic_and_split_by_file() -> None:
    train = corpus.load_corpus("train")
    again = corpus.load_corpus("train")
    held = corpus.load_corpus("heldout")
    assert [f.path for f in train] == [f.path for f in again]
    assert [f.path for f in train] == sorted(f.path for f in train)
    assert train and held
    assert not {f.path for f in train} & {f.path for f in held}
    assert all(corpus.is_held_out(f.path) for f in held)
    assert not any(corpus.is_held_out(f.path) for f in train)
    assert not any("/test/" in f.path or "/tests/" in f.path for f in train)
    # The split depends on the path alone: a stable hash, not Python's salted hash().
    assert corpus.stable_hash("stdlib/json/decoder.py") == corpus.stable_hash(
        "stdlib/json/decoder.py"
    )


def test_prompts_come_from_held_out_files() -> None:
    held = corpus.load_corpus("heldout")
    prompts = corpus.code_prompts(held, n=20)
    assert prompts == corpus.code_prompts(held, n=20)
    for p in prompts:
        assert corpus.is_held_out(p["source"])
        assert p["prompt"].startswith(("def ", "async def "))
        ast.parse(p["prompt"] + "\n    pass\n")  # a signature + docstring, ready for a body
    chats = corpus.chat_prompts(held, n=10)
    assert chats and all(corpus.is_held_out(c["source"]) and "`" in c["prompt"] for c in chats)


def test_shipped_prompt_files() -> None:
    from specserve.data import default_prompt, load_prompts

    code, chat = load_prompts("code"), load_prompts("chat")
    assert 100 <= len(code) <= 200 and 80 <= len(chat) <= 200
    assert all(isinstance(r["prompt"], str) and r["prompt"] for r in code + chat)
    # Held out under the path rule on every Python version (the files are written once).
    assert all(corpus.is_held_out(r["source"]) for r in code + chat)
    assert default_prompt() == code[0]["prompt"]
    with pytest.raises(ValueError, match="code, chat or instruct"):
        load_prompts("poetry")


def test_embedded_model_missing_is_a_clear_error(tmp_path) -> None:
    from specserve.data import embedded_model_dir

    with pytest.raises(FileNotFoundError, match="build_family.py --family embedded"):
        embedded_model_dir(root=str(tmp_path))
    for sub in ("target", "eagle3"):
        d = tmp_path / "embedded" / sub
        d.mkdir(parents=True)
        (d / "config.json").write_text("{}")
        (d / "model.safetensors").write_bytes(b"")
    target, spec = embedded_model_dir(root=str(tmp_path))
    assert target.endswith(os.path.join("embedded", "target"))
    assert spec["method"] == "eagle3" and spec["num_speculative_tokens"] == 3
    assert spec["model"].endswith(os.path.join("embedded", "eagle3"))


# ---- tokenizer ----------------------------------------------------------------------------------
def test_tokenizer_round_trip_and_chat_template(tok_dir: str, files: list) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir)
    assert len(tok) == VOCAB
    assert [tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == list(range(6))
    ids = special_ids(tok_dir)
    assert tok.bos_token_id == tok.eos_token_id == ids["bos"] == 0 and tok.pad_token_id == 1
    for text in (files[0].text[:2000], "déjà vu 🙂 \t\n  x = {'a': 1}\n"):
        enc = tok.encode(text)
        assert enc[0] == ids["bos"]
        assert tok.decode(enc, skip_special_tokens=True) == text
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Write `f(x)`."},
        {"role": "assistant", "content": "```python\ndef f(x):\n    return x\n```"},
    ]
    text = tok.apply_chat_template(msgs, tokenize=False)
    assert text == render_chat(msgs)
    assert text.startswith("<|endoftext|><|system|>\nBe brief.<|end|>\n<|user|>\n")
    prompt = tok.apply_chat_template(msgs[:2], add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<|end|>\n<|assistant|>\n")
    chat_ids = tok.apply_chat_template(msgs, tokenize=True, return_dict=False)
    assert chat_ids.count(ids["end_of_turn"]) == 3 and chat_ids[0] == ids["bos"]
    with open(os.path.join(tok_dir, "tokenizer_config.json")) as f:
        assert json.load(f)["chat_template"] == CHAT_TEMPLATE


# ---- training -----------------------------------------------------------------------------------
def test_cosine_schedule() -> None:
    cfg = TrainConfig(max_steps=100, lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    assert cosine_lr(0, 100, cfg) == pytest.approx(0.1)
    assert cosine_lr(9, 100, cfg) == pytest.approx(1.0)
    assert cosine_lr(10, 100, cfg) == pytest.approx(1.0)
    assert cosine_lr(55, 100, cfg) == pytest.approx(0.55)
    assert cosine_lr(100, 100, cfg) == pytest.approx(0.1)


def test_training_loss_decreases_and_is_reproducible(
    tok_dir: str, tokens: Any, trained: tuple[Any, Any, dict]
) -> None:
    _, cfg, record = trained
    losses = record["losses"]
    assert len(losses) == TRAIN.max_steps
    # Starts near uniform over the vocabulary, then learns.
    assert abs(losses[0] - torch.log(torch.tensor(float(VOCAB))).item()) < 0.3
    assert sum(losses[-4:]) / 4 < losses[0] - 0.8
    # Same seed, same corpus: the identical loss curve on CPU.
    _, again = train_reference(cfg, tokens, TRAIN, "cpu", progress=False)
    assert again["losses"] == losses
    _, other = train_reference(cfg, tokens, replace(TRAIN, seed=4), "cpu", progress=False)
    assert other["losses"] != losses


def test_saved_checkpoint_matches_transformers_and_engine(
    ckpt: str, trained: tuple[Any, Any, Any], tokens: Any
) -> None:
    import transformers as tf

    from specserve import LLM, SamplingParams
    from specserve.attention.dense import dense_context, dense_positions

    model, cfg, _ = trained
    names = set(hf_state_dict(model))
    assert "model.layers.1.self_attn.k_proj.weight" in names
    assert "model.layers.0.mlp.up_proj.weight" in names
    assert not any("qkv_proj" in n or "gate_up_proj" in n for n in names)

    ids = torch.as_tensor(tokens[:40], dtype=torch.long)
    with torch.no_grad():
        hidden, _ = model(ids, dense_positions(1, 40, ids.device), dense_context(1, 40, ids.device))
        ours = model.compute_logits(hidden)
        ref = tf.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
        want = ref(ids[None]).logits[0]
    assert ((ours - want).norm() / want.norm()) < 1e-5

    llm = LLM(ckpt, device="cpu", max_model_len=128)
    prompt = ids[:12].tolist()
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": prompt}, sp, False)
    with torch.no_grad():
        hf = ref.generate(
            ids[None, :12], max_new_tokens=8, do_sample=False, min_new_tokens=8, eos_token_id=None
        )
    assert list(out[0].outputs[0].token_ids) == hf[0, 12:].tolist()
    # Text prompts go through the saved tokenizer.
    assert llm.generate("def f(x):", SamplingParams(max_tokens=4), False)[0].outputs[0].token_ids


# ---- plausibility check -------------------------------------------------------------------------
def test_complete_function_cuts_at_the_function_end() -> None:
    prompt = 'def f(x):\n    """Double x."""'
    done = complete_function(prompt, "\n    y = 2 * x\n    return y\n\n\ndef g():\n    pass\n")
    assert done == prompt + "\n    y = 2 * x\n    return y\n\n"
    assert parses(done)
    # Stopped mid-body: the last (possibly cut) line is dropped.
    cut = complete_function(prompt, "\n    return x +\n    if (")
    assert cut == prompt + "\n    return x +" and not parses(cut)
    assert complete_function(prompt, "") is None and not parses(None)
    assert parses(complete_function(prompt, "\n    return [i for i in x]\n    return"))


def test_fraction_parsing_runs_through_the_engine(ckpt: str) -> None:
    from specserve import LLM
    from specserve.data import load_prompts

    llm = LLM(ckpt, device="cpu", max_model_len=256)
    prompts = [r["prompt"] for r in load_prompts("code", 2)]
    frac = fraction_parsing(llm.engine, prompts, max_tokens=12)
    assert 0.0 <= frac <= 1.0


# ---- the family builder, end to end -------------------------------------------------------------
def _build_family_script() -> Any:
    import importlib.util

    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "build_family.py")
    spec = importlib.util.spec_from_file_location("build_family", path)
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


def test_tiny_family_builds_evaluates_and_packs(tmp_path) -> None:
    from specserve.data import embedded_model_dir
    from specserve.train.family import FamilySpec, build_family

    spec = FamilySpec(
        name="tiny",
        shape=SHAPE,
        train=replace(TRAIN, max_steps=8),
        save_dtype=torch.bfloat16,
        packages=False,
        corpus_max_bytes=None,
        tokenizer_max_bytes=300_000,
        max_chat_examples=20,
        drafters={"eagle3": dict(steps=2, batch_size=2, seq_len=32, draft_vocab_size=128)},
        drafter_text_bytes=100_000,
        num_speculative_tokens=2,
        eval_max_tokens=6,
        eval_num_prompts=2,
        parse_num_prompts=1,
    )
    fam = str(tmp_path / "fam")
    summary = build_family(spec, fam, "cpu", methods=["eagle3"], progress=False, corpus_limit=24)
    ev = summary["eval"]["methods"]
    assert set(ev) == {"eagle3", "ngram"}
    assert 1.0 <= ev["eagle3"]["acceptance_length"] <= 3.0
    assert 0.0 <= ev["eagle3"]["fraction_parsing"] <= 1.0
    assert summary["target"]["steps"] == 8
    with open(os.path.join(fam, "target", "config.json")) as f:
        assert json.load(f)["torch_dtype"] == "bfloat16"
    # A second call finds everything cached: same summary, nothing retrained.
    mtime = os.path.getmtime(os.path.join(fam, "target", "model.safetensors"))
    again = build_family(spec, fam, "cpu", methods=["eagle3"], progress=False, corpus_limit=24)
    assert again["eval"] == summary["eval"]
    assert os.path.getmtime(os.path.join(fam, "target", "model.safetensors")) == mtime

    # Pack into parts (tiny parts here: the split is exercised), install, load as the package.
    script = _build_family_script()
    parts_dir = tmp_path / "out"
    parts_dir.mkdir()
    manifest = script.pack(fam, str(parts_dir), part_bytes=200_000)
    assert len(manifest["parts"]) >= 2
    dest = tmp_path / "data" / "embedded"
    script.install(str(parts_dir), str(dest))
    target, spec_cfg = embedded_model_dir(root=str(tmp_path / "data"))
    assert sorted(os.listdir(target)) == sorted(script.TARGET_FILES)
    with open(os.path.join(fam, "drafters", "eagle3", "model.safetensors"), "rb") as f:
        with open(os.path.join(spec_cfg["model"], "model.safetensors"), "rb") as g:
            assert f.read() == g.read()
