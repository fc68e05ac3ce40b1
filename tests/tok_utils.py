"""A tiny byte-level BPE tokenizer, trained on the fly, for tests that need real text.

No model hub is reachable in tests, so we train one in a few milliseconds with `tokenizers` and
wrap it in `transformers.PreTrainedTokenizerFast`, which is what `AutoTokenizer` loads back.
"""

from __future__ import annotations

import os

# The special-token ids match the tiny checkpoints in conftest.py (pad=0, bos=1, eos=2), and the
# vocabulary fits their VOCAB=384, so a tokenizer directory can sit next to a model checkpoint.
PAD, BOS, EOS = "<pad>", "<s>", "</s>"
VOCAB_SIZE = 384

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{m.role}}|>{{m.content}}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

# Mixed scripts so the learned merges include multi-byte UTF-8 pieces, while characters seen
# rarely stay split across several byte tokens (what the detokenizer tests need).
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! hello there, how are you today?",
    "héllo wörld 你好 🙂 naïve café résumé über straße",
    "Speculative decoding drafts several tokens and the target model verifies them.",
    "def main(): return [x * 2 for x in range(10)]  # code, numbers 0123456789",
    "日本語のテキスト、中文文本，한국어 텍스트 and emoji 🚀🔥✨ mixed in.",
    "<|user|>What is the capital of France?\n<|assistant|>Paris is the capital.",
]


def make_tokenizer(tmpdir: str | os.PathLike[str], add_bos: bool = True) -> str:
    """Train a small byte-level BPE, save it with `save_pretrained` under `tmpdir`; return the dir.

    `add_bos` makes `encode` prepend `<s>` (Llama style), like most chat models do.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[PAD, BOS, EOS],  # first, so they get ids 0, 1, 2
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte is encodable
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 1)]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        # Cleanup rewrites spaces around punctuation, which would break exact round trips.
        clean_up_tokenization_spaces=False,
    )
    hf.chat_template = CHAT_TEMPLATE
    out = os.path.join(os.fspath(tmpdir), "tokenizer")
    hf.save_pretrained(out)
    return out
