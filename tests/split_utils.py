"""Ways to cut a text into streamed pieces (the parser tests stream every split)."""

from __future__ import annotations

import random


def splits(text: str) -> list[list[str]]:
    """`text` in pieces of 1, 2 and 7 characters, and in three seeded random cuttings."""
    out = [[text[i : i + n] for i in range(0, len(text), n)] for n in (1, 2, 7)]
    for seed in range(3):
        rng = random.Random(seed)
        pieces, i = [], 0
        while i < len(text):
            n = rng.randint(1, 12)
            pieces.append(text[i : i + n])
            i += n
        out.append(pieces)
    return out
