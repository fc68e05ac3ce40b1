"""Offline `LLM.chat` passes `chat_template_kwargs` and `reasoning_effort` to the model's chat
template as the server does (entrypoints/openai/chat_template.py), and refuses with a ValueError
one the template does not read. A tiny random Llama whose tokenizer's template reads
`reasoning_effort` and `enable_thinking`; the prompt the engine ran is compared token for token
with transformers' own `apply_chat_template` with the same variables."""

from __future__ import annotations

import os
import shutil

import pytest

from specserve import LLM, SamplingParams

from .conftest import make_checkpoint
from .tok_utils import make_tokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TEMPLATE = (
    "{% if reasoning_effort is defined %}Reasoning: {{ reasoning_effort }}\n{% endif %}"
    "{% if enable_thinking is defined and not enable_thinking %}no think\n{% endif %}"
    "{% for m in messages %}<|{{m.role}}|>{{m.content}}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
MSGS = [{"role": "user", "content": "Hello world!"}]
SP = SamplingParams(temperature=0.0, max_tokens=2)


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("llm_chat")
    path = make_checkpoint(os.path.join(root, "model"), "llama")
    tok_dir = make_tokenizer(root)
    tok = AutoTokenizer.from_pretrained(tok_dir)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    shutil.rmtree(tok_dir)
    return LLM(path, max_model_len=64)


def _prompt(llm: LLM, **kw: object) -> list[int]:
    return llm.chat(MSGS, SP, use_tqdm=False, **kw)[0].prompt_token_ids


def _expected(llm: LLM, **kw: object) -> list[int]:
    tok = llm.engine.tokenizer
    return tok.apply_chat_template(
        MSGS, add_generation_prompt=True, tokenize=True, return_dict=False, **kw
    )


def test_template_variables_reach_the_template(llm: LLM) -> None:
    plain = _prompt(llm)
    assert plain == _expected(llm)
    high = _prompt(llm, reasoning_effort="high")
    assert high == _expected(llm, reasoning_effort="high") != plain
    assert llm.engine.tokenizer.decode(high).startswith("Reasoning: high")
    off = _prompt(llm, chat_template_kwargs={"enable_thinking": False})
    assert off == _expected(llm, enable_thinking=False) != plain
    both = _prompt(llm, reasoning_effort="low", chat_template_kwargs={"enable_thinking": False})
    assert both == _expected(llm, reasoning_effort="low", enable_thinking=False)


def test_unread_variables_are_refused(llm: LLM) -> None:
    with pytest.raises(ValueError, match=r"does not read \['model_identity'\]"):
        _prompt(llm, chat_template_kwargs={"model_identity": "a test"})
    with pytest.raises(ValueError, match="not both"):
        _prompt(llm, reasoning_effort="low", chat_template_kwargs={"reasoning_effort": "high"})
    # A template that reads no reasoning_effort (the shared test tokenizer's plain one).
    tok = llm.engine.tokenizer
    saved = tok.chat_template
    try:
        tok.chat_template = "{% for m in messages %}{{m.content}}{% endfor %}"
        with pytest.raises(ValueError, match="does not read reasoning_effort"):
            _prompt(llm, reasoning_effort="high")
    finally:
        tok.chat_template = saved
