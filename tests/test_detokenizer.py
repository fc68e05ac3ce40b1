"""IncrementalDetokenizer: streamed text equals a full decode; stop strings never leak."""

from __future__ import annotations

import random
import time
from typing import Any

import pytest

from specserve.engine.detokenizer import (
    IncrementalDetokenizer,
    check_stop_strings,
    partial_stop_len,
)

from .tok_utils import make_tokenizer

TEXTS = [
    "héllo wörld 你好 🙂 naïve",
    "The quick brown fox 🦊 jumps over the lazy dog 🐶.",
    "日本語のテキスト、中文文本，한국어 텍스트 🚀🔥✨",
    "Ünïcödé ßtraße — “quotes” … ½ ∑ ∞ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "\n\n  code:\tdef f(x): return x ** 2  # ok\n",
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(make_tokenizer(tmp_path_factory.mktemp("tok")))


def ids_of(tok: Any, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def groups(ids: list[int], rng: random.Random | None) -> list[list[int]]:
    """Split ids one by one (rng None) or into random-size groups of 1..5."""
    if rng is None:
        return [[i] for i in ids]
    out, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 5)
        out.append(ids[i : i + n])
        i += n
    return out


def stream(
    tok: Any, prompt: list[int], ids: list[int], rng: random.Random | None = None, **kw: Any
) -> tuple[IncrementalDetokenizer, list[str], str | None]:
    """Feed ids like the engine does; return the detokenizer, every delta, the stop string."""
    det = IncrementalDetokenizer(tok, prompt, **kw)
    deltas, stop = [], None
    for g in groups(ids, rng):
        stop = det.update(g)
        if stop is not None:
            det.flush()
        deltas.append(det.get_delta())
        if stop is not None:
            break
    if stop is None:
        det.flush()
        deltas.append(det.get_delta())
    return det, deltas, stop


# ---- round trips ------------------------------------------------------------------------
@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("text", TEXTS)
def test_text_round_trip(tok: Any, text: str, grouped: bool) -> None:
    ids = ids_of(tok, text)
    assert tok.decode(ids) == text
    for seed in range(5 if grouped else 1):
        rng = random.Random(seed) if grouped else None
        for prompt in ([], tok.encode("Hi there"), tok.encode("你")):
            det, deltas, _ = stream(tok, prompt, ids, rng)
            assert "".join(deltas) == text == det.output_text
            assert not any("\ufffd" in d for d in deltas)


def test_multibyte_chars_really_split(tok: Any) -> None:
    # Guards the tests above: some characters must span several tokens, each decoding alone
    # to U+FFFD, or the incomplete-UTF-8 path would go untested.
    ids = ids_of(tok, TEXTS[0])
    assert sum(tok.decode([i]) == "\ufffd" for i in ids) >= 4


@pytest.mark.parametrize("skip", [True, False])
def test_random_token_sequences(tok: Any, skip: bool) -> None:
    rng = random.Random(0)
    vocab = len(tok)
    for trial in range(200):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(0, 40))]
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(0, 8))]
        full = tok.decode(ids, skip_special_tokens=skip)
        det, deltas, _ = stream(
            tok, prompt, ids, rng if trial % 2 else None, skip_special_tokens=skip
        )
        assert "".join(deltas) == full == det.output_text
        if "\ufffd" not in full:
            assert not any("\ufffd" in d for d in deltas)


def test_random_valid_text(tok: Any) -> None:
    rng = random.Random(1)
    alphabet = list("abc xyz.,!\n") + list("éöïß你好世界日本🙂🚀🔥€∑𝔘")
    for trial in range(100):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30)))
        det, deltas, _ = stream(tok, tok.encode("ok"), ids_of(tok, text), random.Random(trial))
        assert "".join(deltas) == text
        assert not any("\ufffd" in d for d in deltas)


def test_prompt_ending_inside_a_character(tok: Any) -> None:
    # The first output ids complete a character the prompt started: the text must still be
    # what decoding the outputs alone gives, not a shifted slice of the prompt's text.
    emoji = ids_of(tok, "🙂")
    assert len(emoji) >= 2
    prompt = tok.encode("hi") + emoji[:1]
    out = emoji[1:] + ids_of(tok, " ok")
    det, deltas, _ = stream(tok, prompt, out)
    assert "".join(deltas) == tok.decode(out) == det.output_text


def test_special_tokens_kept_when_asked(tok: Any) -> None:
    ids = ids_of(tok, "hello") + [tok.eos_token_id] + ids_of(tok, " wörld")
    det, deltas, _ = stream(tok, [], ids, skip_special_tokens=False)
    assert "".join(deltas) == "hello</s> wörld"
    det, deltas, _ = stream(tok, [], ids, skip_special_tokens=True)
    assert "".join(deltas) == "hello wörld"


def test_decodes_small_windows(tok: Any) -> None:
    """Each step decodes a few ids, not the whole output (checked through the slow path)."""

    class Counting:
        def __init__(self, inner: Any) -> None:
            self.inner, self.longest, self.calls = inner, 0, 0

        def decode(self, ids: list[int], **kw: Any) -> str:
            self.longest, self.calls = max(self.longest, len(ids)), self.calls + 1
            return self.inner.decode(ids, **kw)

    counting = Counting(tok)
    text = " ".join(TEXTS) * 5
    ids = ids_of(tok, text)
    det, deltas, _ = stream(counting, tok.encode("prompt"), ids)  # type: ignore[arg-type]
    assert "".join(deltas) == text
    assert counting.longest <= 12
    assert counting.calls <= 2 * len(ids) + 2


# ---- stop strings -----------------------------------------------------------------------
STOP_TEXT = "héllo wörld 你好 🙂 naïve and more text after it"


@pytest.mark.parametrize("stop", ["wörld", "你好", "🙂", "o w", "naïve a"])
@pytest.mark.parametrize("grouped", [False, True])
def test_stop_string_split_across_tokens(tok: Any, stop: str, grouped: bool) -> None:
    ids = ids_of(tok, STOP_TEXT)
    before = STOP_TEXT.split(stop)[0]
    for seed in range(4 if grouped else 1):
        rng = random.Random(seed) if grouped else None
        det, deltas, found = stream(tok, [], ids, rng, stop=[stop])
        assert found == stop == det.stop_reason
        assert det.output_text == before
        # Deltas only ever append, so this says no part of the stop string was ever streamed.
        assert "".join(deltas) == before


def test_stop_strings_span_tokens(tok: Any) -> None:
    # Guards the test above: the stop strings must not each be one token.
    for stop in ["wörld", "你好", "🙂", "o w", "naïve a"]:
        assert len(ids_of(tok, stop)) >= 2


@pytest.mark.parametrize("grouped", [False, True])
def test_include_stop_str_in_output(tok: Any, grouped: bool) -> None:
    ids = ids_of(tok, STOP_TEXT)
    for seed in range(4 if grouped else 1):
        rng = random.Random(seed) if grouped else None
        det, deltas, found = stream(
            tok, [], ids, rng, stop=["你好"], include_stop_str_in_output=True
        )
        assert found == "你好"
        assert det.output_text == "".join(deltas) == "héllo wörld 你好"


@pytest.mark.parametrize("grouped", [False, True])
def test_earliest_stop_wins(tok: Any, grouped: bool) -> None:
    ids = ids_of(tok, STOP_TEXT)
    for order in (["naïve", "你好", "wörld"], ["wörld", "naïve", "你好"]):
        det, deltas, found = stream(tok, [], ids, random.Random(0) if grouped else None, stop=order)
        assert found == "wörld"
        assert det.output_text == "".join(deltas) == "héllo "


def test_stop_found_whatever_the_grouping(tok: Any) -> None:
    # Speculative decoding must not change where text stops: feeding all ids at once gives the
    # same result as feeding them one by one, even for overlapping stop strings.
    ids = ids_of(tok, STOP_TEXT)
    stops = ["wörld 你好 🙂", "d 你", "ö"]
    ref, _, ref_stop = stream(tok, [], ids, None, stop=stops)
    det = IncrementalDetokenizer(tok, [], stop=stops)
    assert det.update(ids) == ref_stop == "ö"
    assert det.output_text == ref.output_text == "héllo w"


def test_partial_stop_held_then_released(tok: Any) -> None:
    # "wörl" looks like the start of the stop string "wörlx" until "d" arrives.
    ids = ids_of(tok, "héllo wörld!")
    det = IncrementalDetokenizer(tok, [], stop=["wörlx"])
    streamed = ""
    for i in ids:
        assert det.update([i]) is None
        streamed += det.get_delta()
        held = det.output_text[len(streamed) :]
        assert det.output_text.startswith(streamed)
        assert held == "" or "wörlx".startswith(held)
    det.flush()
    assert streamed + det.get_delta() == "héllo wörld!"


def test_flush_releases_held_partial_stop(tok: Any) -> None:
    det = IncrementalDetokenizer(tok, [], stop=["wörld"])
    assert det.update(ids_of(tok, "héllo wö")) is None
    assert det.get_delta() == "héllo "
    assert det.flush() is None
    assert det.get_delta() == "wö"
    assert det.output_text == "héllo wö"


def test_stop_inside_one_token_and_updates_after_stop(tok: Any) -> None:
    det = IncrementalDetokenizer(tok, [], stop=["ll"])
    assert det.update(ids_of(tok, "héllo wörld")) == "ll"
    assert det.output_text == "hé"
    assert det.get_delta() == "hé"
    assert det.update(ids_of(tok, "more")) is None  # finished: ignored
    det.flush()
    assert det.output_text == "hé" and det.get_delta() == ""


def test_stop_helpers() -> None:
    assert check_stop_strings("abcdef", 3, ["ef", "cd"], False) == ("cd", 2)
    assert check_stop_strings("abcdef", 1, ["cd"], False) is None  # ended before the new text
    assert check_stop_strings("abcdef", 3, ["cdef", "de"], True) == ("de", 5)
    assert check_stop_strings("abcdef", 3, ["def", "cdef"], False) == ("cdef", 2)
    assert partial_stop_len("hello wo", ["world", "o"]) == 2
    assert partial_stop_len("hello", ["xyz"]) == 0
    assert partial_stop_len("ab", ["abc"]) == 2


# ---- speed ------------------------------------------------------------------------------
def test_speed_2000_tokens(tok: Any) -> None:
    rng = random.Random(0)
    ids = ids_of(tok, "".join(rng.choice(TEXTS) for _ in range(200)))[:2000]
    assert len(ids) == 2000
    det = IncrementalDetokenizer(tok, tok.encode("prompt"), stop=["never appears", "\x00"])
    t0 = time.perf_counter()
    out = []
    for i in ids:
        det.update([i])
        out.append(det.get_delta())
    det.flush()
    out.append(det.get_delta())
    elapsed = time.perf_counter() - t0
    assert "".join(out) == tok.decode(ids)
    assert elapsed < 0.5, f"{elapsed:.3f}s for 2000 tokens"
