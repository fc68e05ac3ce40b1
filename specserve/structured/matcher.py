"""One request's grammar state under speculation: masks for every draft position, then the
verified tokens committed.

Per step, for a request verifying drafts d1..dn:
  fill_masks   mask 0 from the current state; accept d1 tentatively, mask 1; ... up to n + 1
               masks. A draft the grammar rejects (or one after the stop token) ends the walk:
               the remaining masks copy the last one. Those slots are never read: the rejected
               draft has probability 0 under the masked target at the slot before, so the
               verification stops there.
  commit       after verification: roll back the drafts that were rejected, accept the
               recovered / bonus token.
Every token the engine appends has been accepted by the matcher, so none breaks the grammar.
"""

from __future__ import annotations

from typing import Any

import torch


class GrammarViolationError(RuntimeError):
    """A verified token the grammar does not accept: masks and verification disagree (a bug)."""


class RequestGrammar:
    def __init__(self, matcher: Any, vocab_size: int) -> None:
        # xgrammar.GrammarMatcher: the parse state after the request's committed output tokens
        # (plus `num_tentative` drafts while a step is in flight).
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.num_tentative = 0
        # Host copy of the drafts the next step verifies (device drafters read them back with
        # the step's one device-to-host copy; n-gram proposes them on the host).
        self.drafts: list[int] = []

    @property
    def is_terminated(self) -> bool:
        """The grammar accepted a stop token: the output is complete."""
        return self.matcher.is_terminated()

    def _take_tentative(self) -> int:
        n, self.num_tentative = self.num_tentative, 0
        return n

    def fill_masks(
        self,
        drafts: list[int],
        # [rows, ceil(vocab / 32)] int32 CPU bitmask; rows start .. start + len(drafts) written
        bitmask: torch.Tensor,
        start: int,
    ) -> None:
        """Masks for slots 0..len(drafts); leaves the accepted drafts tentatively accepted."""
        m = self.matcher
        stale = self._take_tentative()  # a step whose results were dropped (preempted)
        if stale:
            m.rollback(stale)
        m.fill_next_token_bitmask(bitmask, start)
        n = len(drafts)
        for j, d in enumerate(drafts, 1):
            if not m.accept_token(int(d)):
                break
            self.num_tentative += 1
            if m.is_terminated():  # a drafted stop token: no mask exists after it
                break
            m.fill_next_token_bitmask(bitmask, start + j)
        # The last slot with a mask of its own; the slots after it copy it.
        last = start + self.num_tentative - (1 if m.is_terminated() else 0)
        bitmask[last + 1 : start + n + 1] = bitmask[last]

    def commit(self, tokens: list[int], num_accepted: int) -> int:
        """Record a verified step: `tokens` = the n accepted drafts then the recovered / bonus
        token. Returns how many of them the output keeps (all, unless an accepted draft was
        the stop token: the output ends there)."""
        a = self._take_tentative()
        m = self.matcher
        if a > 0 and num_accepted >= a and m.is_terminated():
            return a  # draft a, accepted, was the stop token: nothing after it counts
        if num_accepted > a:
            raise GrammarViolationError(
                f"verification accepted {num_accepted} drafts but the grammar only {a}"
            )
        if a > num_accepted:
            m.rollback(a - num_accepted)
        tok = int(tokens[num_accepted])
        if not m.accept_token(tok):
            raise GrammarViolationError(f"token {tok} does not match the request's grammar")
        return num_accepted + 1

    def valid_prefix(self, drafts: list[int]) -> int:
        """How many leading `drafts` the grammar accepts (up to and including a stop token);
        the state is left unchanged. Host drafters (n-gram) cut their drafts there."""
        m = self.matcher
        n = 0
        for d in drafts:
            if m.is_terminated() or not m.accept_token(int(d)):
                break
            n += 1
        if n:
            m.rollback(n)
        return n
