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

Draft trees (`fill_tree_masks`): node m's mask is the grammar's allowed set after the path
root -> m, each node's path walked with the matcher's rollback. Which path verification
accepts is known only after it, so the walk leaves the matcher where it started and `commit`
walks the accepted path (the verified tokens come in the chain's layout). A node the grammar
forbids, its descendants, a drafted stop token and its descendants copy their parent's mask:
the masked target never accepts a forbidden node, and the output ends at a stop token, so
those rows never decide an output token (as a chain's slots after its walk ended).

Delayed start (`DelayedStart`, a chat request's `response_format` or tool grammar behind a
reasoning parser): until the output holds the end-of-thinking marker every token is allowed and
the matcher does not move; the token completing the marker is the last free one. The walk above
runs through the same code, so when a draft completes the marker the next slots of that very
step already get the grammar's masks, and a rejected draft rolls the start back with it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class GrammarViolationError(RuntimeError):
    """A verified token the grammar does not accept: masks and verification disagree (a bug)."""


class RequestGrammar:
    def __init__(self, matcher: Any, vocab_size: int, start: DelayedStart | None = None) -> None:
        # xgrammar.GrammarMatcher: the parse state after the request's committed output tokens
        # (plus the tentative drafts while a step is in flight).
        self.matcher = matcher
        self.vocab_size = vocab_size
        # None: the grammar applies from the first output token.
        self.start = start
        # Per tentatively accepted draft: True if the matcher took it, False if it went to the
        # delayed start's text (before the grammar started).
        self._tentative: list[bool] = []
        # Host copy of the drafts the next step verifies (device drafters read them back with
        # the step's one device-to-host copy; n-gram proposes them on the host).
        self.drafts: list[int] = []
        # Draft trees: the parent of each node 0..K of the next step's tree, read back with the
        # drafts (node m's token is drafts[m - 1]); None for chains.
        self.parents: list[int] | None = None
        # The last fill walked a tree: `commit` walks the accepted path itself.
        self._tree_step = False

    @property
    def num_tentative(self) -> int:
        return len(self._tentative)

    @property
    def started(self) -> bool:
        return self.start is None or self.start.started

    @property
    def is_terminated(self) -> bool:
        """The grammar accepted a stop token: the output is complete."""
        return self.started and self.matcher.is_terminated()

    def _accept(self, tok: int) -> bool:
        """Take one token (tentatively): into the matcher once started, else into the delayed
        start's text (any token is allowed there)."""
        if self.started:
            if not self.matcher.accept_token(tok):
                return False
            self._tentative.append(True)
        else:
            self.start.push(tok)  # type: ignore[union-attr]
            self._tentative.append(False)
        return True

    def _rollback(self, n: int) -> None:
        if n <= 0:
            return
        undone = self._tentative[-n:]
        del self._tentative[-n:]
        in_matcher = sum(undone)
        if in_matcher:
            self.matcher.rollback(in_matcher)
        if n - in_matcher:
            self.start.pop(n - in_matcher)  # type: ignore[union-attr]

    def _fill(self, bitmask: torch.Tensor, row: int) -> None:
        if self.started:
            self.matcher.fill_next_token_bitmask(bitmask, row)
        else:
            bitmask[row] = -1  # before the grammar starts: every token

    def fill_masks(
        self,
        drafts: list[int],
        # [rows, ceil(vocab / 32)] int32 CPU bitmask; rows start .. start + len(drafts) written
        bitmask: torch.Tensor,
        start: int,
    ) -> None:
        """Masks for slots 0..len(drafts); leaves the accepted drafts tentatively accepted."""
        self._rollback(self.num_tentative)  # a step whose results were dropped (preempted)
        self._tree_step = False
        self._fill(bitmask, start)
        n = len(drafts)
        for j, d in enumerate(drafts, 1):
            if not self._accept(int(d)):
                break
            if self.is_terminated:  # a drafted stop token: no mask exists after it
                break
            # NOTE: the draft that completes a delayed start's marker makes this slot's mask
            # the grammar's first: the grammar starts inside the step, as it would without it.
            self._fill(bitmask, start + j)
        # The last slot with a mask of its own; the slots after it copy it.
        last = start + self.num_tentative - (1 if self.is_terminated else 0)
        bitmask[last + 1 : start + n + 1] = bitmask[last]

    def fill_tree_masks(
        self,
        # tokens of nodes 1..n (node 0, the root, is the newest committed token)
        tokens_by_node: list[int],
        # parent of each node 0..n (topological: parents[m] < m; parents[0] is ignored)
        parents: list[int],
        # [rows, ceil(vocab / 32)] int32 CPU bitmask; rows start .. start + n written
        bitmask: torch.Tensor,
        start: int,
    ) -> None:
        """Row start + m: the mask after the path root -> node m. Leaves the matcher where it
        started; `commit` then walks the path verification accepted."""
        self._rollback(self.num_tentative)  # a step whose results were dropped (preempted)
        n = len(tokens_by_node)
        paths: list[list[int]] = [[]]
        for m in range(1, n + 1):
            paths.append(paths[parents[m]] + [m])
        # live[m]: the grammar accepts m's path and it does not end at a stop token, so the
        # row is the grammar's own (and m's children are worth walking).
        live = [True] + [False] * n
        self._fill(bitmask, start)
        # Depth-first (paths in lexicographic order): the matcher holds a prefix of the last
        # node's path, so reaching a node's parent is a rollback to the parent's depth.
        for m in sorted(range(1, n + 1), key=paths.__getitem__):
            p = parents[m]
            if live[p]:
                self._rollback(self.num_tentative - len(paths[p]))
                live[m] = self._accept(int(tokens_by_node[m - 1])) and not self.is_terminated
            if live[m]:
                self._fill(bitmask, start + m)
            else:
                bitmask[start + m] = bitmask[start + p]
        self._rollback(self.num_tentative)
        self._tree_step = True

    def commit(self, tokens: list[int], num_accepted: int) -> int:
        """Record a verified step: `tokens` = the n accepted drafts then the recovered / bonus
        token. Returns how many of them the output keeps (all, unless an accepted draft was
        the stop token: the output ends there)."""
        if self._tree_step:
            # The tree walk left the matcher at the root: take the accepted path now, then
            # finish as a chain step whose drafts were these.
            self._tree_step = False
            for tok in tokens[:num_accepted]:
                if self.is_terminated or not self._accept(int(tok)):
                    break
        a = self.num_tentative
        if a > 0 and num_accepted >= a and self.is_terminated:
            self._tentative.clear()
            return a  # draft a, accepted, was the stop token: nothing after it counts
        if num_accepted > a:
            raise GrammarViolationError(
                f"verification accepted {num_accepted} drafts but the grammar only {a}"
            )
        self._rollback(a - num_accepted)
        tok = int(tokens[num_accepted])
        if not self._accept(tok):
            raise GrammarViolationError(f"token {tok} does not match the request's grammar")
        self._tentative.clear()
        return num_accepted + 1

    def valid_prefix(self, drafts: list[int]) -> int:
        """How many leading `drafts` the grammar accepts (up to and including a stop token);
        the state is left unchanged. Host drafters (n-gram) cut their drafts there."""
        before = self.num_tentative
        n = 0
        for d in drafts:
            if self.is_terminated or not self._accept(int(d)):
                break
            n += 1
        self._rollback(self.num_tentative - before)
        return n


class DelayedStart:
    """The grammar starts after the output's first `marker` (a reasoning parser's end of
    thinking): the tokens up to and including the one that completes it are outside the
    grammar. Detected on the text of the last tokens, so a marker split over several tokens, or
    ending inside one, counts."""

    def __init__(self, marker: str, decode: Callable[[list[int]], str]) -> None:
        if not marker:
            raise ValueError("a delayed grammar start needs a non-empty marker")
        self.marker = marker
        self.decode = decode
        # Output tokens before the grammar started (committed and tentative).
        self.ids: list[int] = []
        # len(ids) when the marker was completed; None while it has not been.
        self.marker_end: int | None = None
        # Each token decodes to at least one character, so the marker lies within this many.
        self._window = len(marker) + 2

    @property
    def started(self) -> bool:
        return self.marker_end is not None

    def push(self, tok: int) -> None:
        self.ids.append(tok)
        if self.marker in self.decode(self.ids[-self._window :]):
            self.marker_end = len(self.ids)

    def pop(self, n: int) -> None:
        del self.ids[-n:]
        if self.marker_end is not None and len(self.ids) < self.marker_end:
            self.marker_end = None
