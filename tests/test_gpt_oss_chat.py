"""gpt-oss chat through the real server: a tiny random `GptOssForCausalLM` whose
model directory ships a harmony tokenizer as transformers saves it (`chat_template.jinja`,
`tokenizer.json`, `generation_config.json` with `<|return|>` / `<|call|>` among the eos ids),
served on 127.0.0.1 and called with the `openai` client.

The prompt the server tokenizes must be `apply_chat_template(messages,
add_generation_prompt=True)` token for token (read back through `prompt_logprobs`, which name
each prompt token's id), `reasoning_effort` reaches the template, and the template's stop tokens
end generation. Reasoning and tool channels are not parsed."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from specserve.config import EngineConfig

from .conftest import make_checkpoint
from .test_gpt_oss import GPT_OSS
from .test_server import LiveServer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 384
# o200k_harmony's special tokens (ids 0..8 here, 199998.. in the published tokenizer).
STARTOFTEXT, ENDOFTEXT, RETURN, CALL = "<|startoftext|>", "<|endoftext|>", "<|return|>", "<|call|>"
SPECIALS = [
    STARTOFTEXT, ENDOFTEXT, RETURN, "<|constrain|>", "<|channel|>", "<|start|>", "<|end|>",
    "<|message|>", CALL,
]  # fmt: skip

# The harmony format as gpt-oss's published template renders a plain conversation (abridged:
# no tools, no thinking field): a system turn with the model identity, dates and the reasoning
# effort (template variables; "medium" when the request names none), the request's first
# system / developer message as the developer turn's instructions, then the other turns, and
# `<|start|>assistant` as the generation prompt. `strftime_now` and `raise_exception` are
# transformers' template globals, which the published template uses too.
HARMONY_TEMPLATE = """\
{%- if reasoning_effort is not defined %}{%- set reasoning_effort = "medium" %}{%- endif %}
{%- if model_identity is not defined %}
    {%- set model_identity = "You are ChatGPT, a large language model trained by OpenAI." %}
{%- endif %}
{{- "<|start|>system<|message|>" + model_identity + "\\n" }}
{{- "Knowledge cutoff: 2024-06\\nCurrent date: " + strftime_now("%Y-%m-%d") + "\\n\\n" }}
{{- "Reasoning: " + reasoning_effort + "\\n\\n" }}
{{- "# Valid channels: analysis, commentary, final. Channel must be included for every message." }}
{{- "<|end|>" }}
{%- if messages[0].role in ("system", "developer") %}
    {{- "<|start|>developer<|message|># Instructions\\n\\n" + messages[0].content + "\\n\\n<|end|>" }}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- for message in loop_messages %}
    {%- if message.role == "user" %}
        {{- "<|start|>user<|message|>" + message.content + "<|end|>" }}
    {%- elif message.role == "assistant" %}
        {{- "<|start|>assistant<|channel|>final<|message|>" + message.content + "<|end|>" }}
    {%- else %}
        {{- raise_exception("harmony: unexpected role " + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start|>assistant{%- endif %}"""

CORPUS = [
    "You are ChatGPT, a large language model trained by OpenAI.",
    "Knowledge cutoff: 2024-06 Current date: 2025-08-05 Reasoning: medium low high",
    "# Valid channels: analysis, commentary, final. Channel must be included for every message.",
    "# Instructions Answer in one short sentence. What is the capital of France?",
    "Paris is the capital of France. The quick brown fox jumps over the lazy dog.",
]

MESSAGES = [
    {"role": "system", "content": "Answer in one short sentence."},
    {"role": "user", "content": "What is the capital of France?"},
]


def _harmony_tokenizer(path: str) -> Any:
    """A byte-level BPE with the harmony special tokens and template, saved into `path` the way
    transformers saves gpt-oss's (the template as chat_template.jinja)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=STARTOFTEXT,
        eos_token=RETURN,
        pad_token=ENDOFTEXT,
        clean_up_tokenization_spaces=False,
    )
    hf.chat_template = HARMONY_TEMPLATE
    hf.save_pretrained(path)
    assert os.path.isfile(os.path.join(path, "chat_template.jinja"))
    return hf


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("gpt-oss-harmony"))
    ids = {t: SPECIALS.index(t) for t in SPECIALS}
    # As the published config: eos <|return|>, pad <|endoftext|>; <|call|> and <|endoftext|>
    # end generation through generation_config.json only.
    make_checkpoint(
        path, "gpt_oss", **{**GPT_OSS, "bos_token_id": ids[STARTOFTEXT],
        "eos_token_id": ids[RETURN], "pad_token_id": ids[ENDOFTEXT]},
    )  # fmt: skip
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        eos = [ids[RETURN], ids[ENDOFTEXT], ids[CALL]]
        json.dump({"bos_token_id": ids[STARTOFTEXT], "eos_token_id": eos,
                   "pad_token_id": ids[ENDOFTEXT], "do_sample": True}, f)  # fmt: skip
    _harmony_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def tok(model_dir: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def server(model_dir: str) -> Iterator[LiveServer]:
    s = LiveServer(EngineConfig(model=model_dir, max_model_len=512, dtype="float32"))
    yield s
    s.close()


def _template_ids(tok: Any, messages: list[dict[str, str]], **kw: Any) -> list[int]:
    return list(
        tok.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False, **kw
        )
    )


def test_the_model_dir_tokenizer_is_harmony(tok: Any) -> None:
    ids = _template_ids(tok, MESSAGES)
    text = tok.decode(ids)
    assert text.startswith("<|start|>system<|message|>") and text.endswith("<|start|>assistant")
    assert "Reasoning: medium" in text and "# Instructions\n\nAnswer in one short sentence." in text
    # The special tokens are single tokens, not spelled out in bytes.
    for t in ("<|start|>", "<|message|>", "<|end|>"):
        assert tok.convert_tokens_to_ids(t) in ids
    assert "Reasoning: low" in tok.decode(_template_ids(tok, MESSAGES, reasoning_effort="low"))


def _prompt_ids(r: Any) -> list[int]:
    """The prompt the server ran, from vLLM's `prompt_logprobs` with top-0: one entry (the
    prompt token's own) per position after the first."""
    pl = r.model_extra["prompt_logprobs"]
    assert pl[0] is None and all(len(d) == 1 for d in pl[1:])
    return [int(next(iter(d))) for d in pl[1:]]


def test_chat_prompt_is_the_template_and_stream_agrees(server: LiveServer, tok: Any) -> None:
    c = server.client()
    want = _template_ids(tok, MESSAGES)
    kw: dict[str, Any] = dict(model=server.model, messages=MESSAGES, max_tokens=6, temperature=0)
    r = c.chat.completions.create(**kw, extra_body={"prompt_logprobs": 0, "ignore_eos": True})
    assert r.usage.prompt_tokens == len(want)
    assert _prompt_ids(r) == want[1:]
    ch = r.choices[0]
    assert r.object == "chat.completion" and ch.message.role == "assistant"
    assert ch.finish_reason == "length" and r.usage.completion_tokens == 6
    assert isinstance(ch.message.content, str)

    chunks = list(c.chat.completions.create(**kw, stream=True, extra_body={"ignore_eos": True},
                                            stream_options={"include_usage": True}))  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(x.object == "chat.completion.chunk" and x.id == chunks[0].id for x in chunks)
    text = "".join(x.choices[0].delta.content or "" for x in chunks if x.choices)
    assert text == ch.message.content
    assert [x.choices[0].finish_reason for x in chunks if x.choices][-1] == "length"
    assert chunks[-1].usage.prompt_tokens == len(want)


def test_reasoning_effort_reaches_the_template(server: LiveServer, tok: Any) -> None:
    c = server.client()
    for effort in ("low", "high"):
        want = _template_ids(tok, MESSAGES, reasoning_effort=effort)
        assert want != _template_ids(tok, MESSAGES)
        r = c.chat.completions.create(
            model=server.model, messages=MESSAGES, max_tokens=1, reasoning_effort=effort,
            extra_body={"prompt_logprobs": 0},
        )  # fmt: skip
        assert _prompt_ids(r) == want[1:], effort
    # A level the harmony format does not have is a 400 naming the field, not a silent default.
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(
            model=server.model, messages=MESSAGES, max_tokens=1, reasoning_effort="extreme"
        )
    assert e.value.body["param"] == "reasoning_effort"


def test_chat_template_kwargs_reach_the_template(server: LiveServer, tok: Any) -> None:
    """vLLM's chat_template_kwargs: a variable the template reads changes the prompt; one it
    does not read, or one the server sets itself, is a 400."""
    c = server.client()
    ident = {"model_identity": "You are a tiny test model."}
    want = _template_ids(tok, MESSAGES, reasoning_effort="high", **ident)
    assert "tiny test model" in tok.decode(want)
    r = c.chat.completions.create(
        model=server.model, messages=MESSAGES, max_tokens=1, reasoning_effort="high",
        extra_body={"prompt_logprobs": 0, "chat_template_kwargs": ident},
    )  # fmt: skip
    assert _prompt_ids(r) == want[1:]
    for bad in ({"enable_thinking": False}, {"messages": []}, {"add_generation_prompt": False}):
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(
                model=server.model, messages=MESSAGES, max_tokens=1,
                extra_body={"chat_template_kwargs": bad},
            )  # fmt: skip
        assert e.value.body["param"] == "chat_template_kwargs", bad
        assert next(iter(bad)) in e.value.body["message"]


def test_template_stop_tokens_end_generation(server: LiveServer, tok: Any) -> None:
    """<|return|> (config and tokenizer eos) and <|call|> (generation_config.json only) end a
    reply; <|end|>, which closes a message inside a reply, does not."""
    c = server.client()
    kw: dict[str, Any] = dict(model=server.model, messages=MESSAGES, max_tokens=5, temperature=0)
    for stop in (RETURN, CALL):
        tid = tok.convert_tokens_to_ids(stop)
        for stream in (False, True):
            r = c.chat.completions.create(
                **kw, logit_bias={str(tid): 100}, logprobs=True, stream=stream
            )
            if stream:
                chunks = [x.choices[0] for x in r if x.choices]
                assert chunks[-1].finish_reason == "stop", stop
                got = [t.token for x in chunks if x.logprobs for t in x.logprobs.content]
            else:
                assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 1
                got = [t.token for t in r.choices[0].logprobs.content]
            assert got == [stop], (stop, stream)
    end = tok.convert_tokens_to_ids("<|end|>")
    r = c.chat.completions.create(**kw, logit_bias={str(end): 100})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5
    # A role the template refuses (its raise_exception) is the request's fault: a 400.
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(**kw | {"messages": [{"role": "narrator", "content": "x"}]})
    assert "unexpected role" in str(e.value) and e.value.body["param"] == "messages"
