"""A byte-level BPE tokenizer for the reference models, trained on the corpus.

Saved as the usual Hugging Face files (tokenizer.json, tokenizer_config.json with a chat template,
special_tokens_map.json), so `transformers.AutoTokenizer.from_pretrained(dir)` loads it and
`apply_chat_template` works; the engine loads it the same way.

Every document starts with `<|endoftext|>` (the bos token, added by the post-processor), so a prompt
encoded by the engine looks like the start of a training document. A chat turn is
`<|role|>\\n{content}<|end|>\\n`; `<|end|>` is an eos id of the reference models, so chat answers stop.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from typing import Any

import numpy as np

BOS = EOS = "<|endoftext|>"
PAD = "<|pad|>"
END_OF_TURN = "<|end|>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
# First, so they get ids 0..5 whatever the vocabulary size.
SPECIAL_TOKENS = [BOS, PAD, *ROLE_TOKENS, END_OF_TURN]

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('chat roles are system, user and assistant') }}"
    "{% endif %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def train_tokenizer(texts: Iterable[str], vocab_size: int, out_dir: str) -> str:
    """Train a byte-level BPE on `texts` and save it under `out_dir` in HF layout; returns out_dir."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte is encodable
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 0)]
    )
    save_tokenizer(tok, out_dir)
    return out_dir


def save_tokenizer(tok: Any, out_dir: str) -> None:
    """Write tokenizer.json, tokenizer_config.json (with the chat template) and
    special_tokens_map.json; readable by transformers 4.x and 5.x."""
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    added = {
        str(tok.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "additional_special_tokens": [*ROLE_TOKENS, END_OF_TURN],
        "added_tokens_decoder": added,
        # Cleanup rewrites spaces around punctuation, which would break code round trips.
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1 << 20,
        "chat_template": CHAT_TEMPLATE,
    }
    special = {
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "additional_special_tokens": [*ROLE_TOKENS, END_OF_TURN],
    }
    for name, obj in (("tokenizer_config.json", config), ("special_tokens_map.json", special)):
        with open(os.path.join(out_dir, name), "w") as f:
            json.dump(obj, f, indent=2)


def special_ids(tok_dir: str) -> dict[str, int]:
    """bos / eos / pad / end-of-turn ids, for config.json and generation_config.json."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(tok_dir, "tokenizer.json"))
    return {
        "bos": tok.token_to_id(BOS),
        "eos": tok.token_to_id(EOS),
        "pad": tok.token_to_id(PAD),
        "end_of_turn": tok.token_to_id(END_OF_TURN),
    }


def render_chat(messages: list[dict[str, str]]) -> str:
    """The chat template applied to a whole conversation, as text (bos token included).

    Same output as `apply_chat_template(messages, tokenize=False)`, without loading transformers
    in the worker that tokenizes the corpus."""
    for m in messages:
        if m["role"] not in ("system", "user", "assistant"):
            raise ValueError("chat roles are system, user and assistant")
    return BOS + "".join(f"<|{m['role']}|>\n{m['content']}{END_OF_TURN}\n" for m in messages)


def encode_documents(
    tok_dir: str, texts: list[str], add_bos: bool = True, batch: int = 512
) -> np.ndarray:
    """All documents encoded and concatenated into one int32 array (bos before each document
    when `add_bos`; chat texts rendered by `render_chat` already start with it)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(tok_dir, "tokenizer.json"))
    parts: list[np.ndarray] = []
    for i in range(0, len(texts), batch):
        for enc in tok.encode_batch(texts[i : i + batch], add_special_tokens=add_bos):
            parts.append(np.asarray(enc.ids, dtype=np.int32))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
