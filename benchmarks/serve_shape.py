"""Model directories for `serve_sweep.py --shape`: a target config, a tokenizer that decodes
every id of its vocabulary, and an EAGLE-3-shaped head config; weights come from
`--load-format dummy`, so nothing is downloaded or trained.

`llama3-8b` is the shape of vLLM's published Llama-3-8B EAGLE table (benchmarks/decode.py's
LLAMA3_8B, spec_step.py's EAGLE3_HEAD); `llama3-70b` a Llama-3-70B with an EAGLE-3 head of the
published 70B layout (the tensor-parallel runs); `tiny` is the same layout at test size, for the
CPU smoke run (tests/test_serve_sweep.py).
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode import LLAMA3_8B  # noqa: E402
from spec_step import EAGLE3_HEAD  # noqa: E402

TINY = {
    **LLAMA3_8B,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 4096,
    "bos_token_id": 500,
    "eos_token_id": 501,
    "torch_dtype": "float32",
}
TINY_HEAD = {
    **EAGLE3_HEAD,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "draft_vocab_size": 256,
    "max_position_embeddings": 4096,
    "torch_dtype": "float32",
}
LLAMA3_70B = {
    **LLAMA3_8B,
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "rope_theta": 500000.0,
    "torch_dtype": "bfloat16",
}
# The published Llama-3.x-70B EAGLE-3 head's layout: one 8192-wide layer, fc over 3 x 8192,
# a 32000-token draft vocabulary.
EAGLE3_HEAD_70B = {
    **EAGLE3_HEAD,
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_hidden_layers": 1,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "draft_vocab_size": 32000,
}
SHAPES = {
    "llama3-8b": (LLAMA3_8B, EAGLE3_HEAD),
    "llama3-70b": (LLAMA3_70B, EAGLE3_HEAD_70B),
    "tiny": (TINY, TINY_HEAD),
}

UNK = "<unk>"
BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"


def write_tokenizer(path: str, vocab_size: int, bos_id: int, eos_id: int) -> None:
    """A word-level tokenizer over `vocab_size` distinct pieces (`t<id>`; id 0 is <unk>, and
    the config's BOS / EOS ids are Llama-3's special tokens), saved as tokenizer.json +
    tokenizer_config.json for transformers' AutoTokenizer. Pieces are whitespace-separated
    words, so decode(ids) re-encodes to the same ids: the random dataset's prompts keep their
    length, and the server can decode every id a dummy-weight model samples."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(vocab_size)}
    specials = {0: UNK, bos_id: BOS, eos_id: EOS}
    for i, piece in specials.items():
        del vocab[f"t{i}"]
        vocab[piece] = i
    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(list(specials.values()))
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "unk_token": UNK,
                "bos_token": BOS,
                "eos_token": EOS,
                "model_max_length": 131072,
                "clean_up_tokenization_spaces": False,
            },
            f,
            indent=1,
        )


def write_shape(root: str, shape: str) -> tuple[str, str]:
    """Write `shape`'s target (config + tokenizer) and EAGLE-3 head (config) under `root`;
    returns (target dir, head dir)."""
    if shape not in SHAPES:
        raise ValueError(f"--shape must be one of {', '.join(SHAPES)}, got {shape!r}")
    target_cfg, head_cfg = SHAPES[shape]
    target = os.path.join(root, f"{shape}-target")
    head = os.path.join(root, f"{shape}-eagle3")
    for path, cfg in ((target, target_cfg), (head, head_cfg)):
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(cfg, f, indent=1)
    v = target_cfg["vocab_size"]
    write_tokenizer(target, v, target_cfg["bos_token_id"], target_cfg["eos_token_id"])
    return target, head
