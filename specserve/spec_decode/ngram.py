"""N-gram prompt lookup: the training-free baseline, proposed on the host from each request's
own tokens (no model, no device work)."""

from __future__ import annotations

import numpy as np

from specserve.config.speculative import SpeculativeConfig
from specserve.spec_decode.interface import Speculator


def ngram_propose(tokens: np.ndarray, n_min: int, n_max: int, k: int) -> list[int]:
    """Find the longest suffix n-gram (n_max down to n_min) that occurred earlier; return up to k
    tokens that followed its most recent earlier occurrence."""
    L = len(tokens)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        suffix = tokens[L - n :]
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: L - 1], n)
        hits = np.nonzero((windows == suffix).all(axis=1))[0]
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start : start + k].tolist()
    return []


class NgramSpeculator(Speculator):
    proposes_on_host = True

    def __init__(self, spec: SpeculativeConfig) -> None:
        self.spec = spec
        self.k = spec.num_speculative_tokens

    def propose_host(self, token_ids: list[int], max_drafts: int) -> list[int]:
        if max_drafts <= 0:
            return []
        toks = np.asarray(token_ids, dtype=np.int64)
        s = self.spec
        return ngram_propose(
            toks, s.prompt_lookup_min, s.prompt_lookup_max, min(self.k, max_drafts)
        )
