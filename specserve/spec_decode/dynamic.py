"""Automatic K: pick the number of speculative tokens (0 included) that maximizes tokens/s.

`"num_speculative_tokens_per_batch_size": "auto"`. For each batch-size bucket (powers of two) the
controller keeps
  - per-position conditional acceptance a_i = P(draft i accepted | drafts < i accepted), as
    exponentially decayed counts (per position, decayed when that position is observed) shared
    by all buckets (acceptance depends on the drafter and the
    text, not on the batch size);
  - the measured wall time of decode steps per K (exponential moving average).
Expected tokens per step with K drafts is E(K) = 1 + sum_{i<=K} prod_{j<=i} a_j, so the choice is
argmax_K E(K) / t(K). Times of K values never measured in a bucket are interpolated from the
measured ones with a linear model t(K) = t0 + K * dt. Every `explore_every` steps of a bucket the
controller tries the neighbour of its choice that it has measured least, so both estimates stay
fresh (K = 0 teaches nothing about acceptance, so it is left periodically too).
Decode steps only: a step that carries prefill tokens says nothing about the cost of K.
"""

from __future__ import annotations

import numpy as np


class AutoSpecController:
    def __init__(
        self,
        max_k: int,
        decay: float = 0.99,
        explore_every: int = 16,
        prior_acceptance: float = 0.6,
    ) -> None:
        self.max_k = max_k
        self.decay = decay
        self.explore_every = explore_every
        # Decayed counts: reached[i] drafts that got to position i, accepted[i] accepted there.
        self.reached = np.full(max_k, 2.0)
        self.accepted = np.full(max_k, 2.0 * prior_acceptance)
        # bucket -> [K] EMA step seconds (nan = never measured) and sample counts
        self.times: dict[int, np.ndarray] = {}
        self.counts: dict[int, np.ndarray] = {}
        self.steps: dict[int, int] = {}

    @staticmethod
    def bucket(batch: int) -> int:
        return 1 << max(batch - 1, 0).bit_length()

    # ---- estimates -------------------------------------------------------------------------
    def acceptance(self) -> np.ndarray:
        """[max_k] conditional acceptance per position."""
        return self.accepted / np.maximum(self.reached, 1e-9)

    def expected_tokens(self) -> np.ndarray:
        """[max_k + 1]: E(K) for K = 0..max_k."""
        return np.concatenate([[1.0], 1.0 + np.cumsum(np.cumprod(self.acceptance()))])

    def step_times(self, bucket: int) -> np.ndarray | None:
        """[max_k + 1] seconds per step for each K (measured or interpolated), None if unknown."""
        t = self.times.get(bucket)
        if t is None:
            return None
        known = ~np.isnan(t)
        ks = np.arange(self.max_k + 1)
        if known.sum() >= 2:
            slope, icpt = np.polyfit(ks[known], t[known], 1)
        else:  # one point: assume each draft adds 8% of a step until measured otherwise
            k0 = int(ks[known][0])
            icpt = t[known][0] / (1 + 0.08 * k0)
            slope = 0.08 * icpt
        return np.where(known, t, icpt + slope * ks)

    # ---- decisions -------------------------------------------------------------------------
    def choose(self, batch: int) -> int:
        b = self.bucket(batch)
        t = self.step_times(b)
        if t is None:
            return self.max_k  # first visit: measure the configured K
        best = int(np.argmax(self.expected_tokens() / np.maximum(t, 1e-9)))
        n = self.steps.get(b, 0)
        if n % self.explore_every == self.explore_every - 1:
            counts = self.counts[b]
            near = [k for k in (best - 1, best + 1) if 0 <= k <= self.max_k]
            if best == 0:
                near = [1] if self.max_k >= 1 else near
            return min(near, key=lambda k: counts[k]) if near else best
        return best

    # ---- observations ----------------------------------------------------------------------
    def record_step(self, batch: int, k: int, seconds: float) -> None:
        b = self.bucket(batch)
        if b not in self.times:
            self.times[b] = np.full(self.max_k + 1, np.nan)
            self.counts[b] = np.zeros(self.max_k + 1)
        t = self.times[b]
        t[k] = seconds if np.isnan(t[k]) else 0.8 * t[k] + 0.2 * seconds
        self.counts[b][k] += 1
        self.steps[b] = self.steps.get(b, 0) + 1

    def record_acceptance(self, num_draft: int, num_accepted: int) -> None:
        """One request's verification: positions < num_accepted accepted, the next rejected.

        NOTE: only the positions this verification reached decay. Decaying every position made
        the estimate of a position that a small K never reaches fall to 0/0 -> 0, and the
        controller then never tried a larger K again."""
        if num_draft <= 0:
            return
        reached = min(num_accepted + 1, num_draft)
        self.reached[:reached] = self.decay * self.reached[:reached] + 1
        self.accepted[:reached] *= self.decay
        self.accepted[:num_accepted] += 1
