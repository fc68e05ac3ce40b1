"""SpeculativeConfig: `speculative_config={...}` / `--speculative-config '<json>'`."""

from __future__ import annotations

import ast
import json
import os
from dataclasses import dataclass, fields
from typing import Any

METHODS = ("draft_model", "eagle", "eagle3", "mtp", "ngram")


@dataclass
class SpeculativeConfig:
    method: str
    model: str | None = None
    # None: the drafter's own default (a speculators-format head's
    # speculators_config.proposal_methods[0].speculative_tokens), else 3.
    num_speculative_tokens: int | None = None
    draft_sample_method: str = "greedy"  # greedy | probabilistic
    # coupled (the target's own seeded draw at every slot: output == plain sampling's) |
    # strict | probabilistic (speculative sampling) | synthetic (benchmarks, lossy)
    rejection_sample_method: str = "coupled"
    synthetic_acceptance_rate: float = 1.0
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    disable_by_batch_size: int | None = None
    # K per batch size ({batch size: K}: K for batches up to that size, 0 past the largest);
    # "auto" is the adaptive budget (below).
    num_speculative_tokens_per_batch_size: dict[int, int] | str | None = None
    parallel_draft: bool = False
    # The adaptive draft budget (spec_decode/dynamic.py): each step verifies the number of
    # drafts, 0..num_speculative_tokens, that maximizes expected tokens per second from live
    # acceptance and measured step times. False: always num_speculative_tokens (or the
    # batch-size map above, which also turns the budget off).
    adaptive: bool = True
    # Draft trees (spec_decode/tree.py). {"topk": k, "depth": d}: EAGLE-2 dynamic trees, the k
    # best children of the k best frontier nodes at each of d levels, the best
    # num_speculative_tokens nodes by cumulative draft log-probability verified. topk 1 is the
    # chain. speculative_token_tree: vLLM's static tree, a string of child-index paths such as
    # "[(0,), (1,), (0, 0)]" (its length is num_speculative_tokens).
    draft_tree: dict[str, int] | None = None
    speculative_token_tree: str | None = None
    # Tensor parallelism: the drafter sharded like the target (None: the target's
    # tensor_parallel_size) or 1: whole on every rank (it still shares the target's sharded
    # embedding and lm_head where it uses them), as vLLM's draft_tensor_parallel_size.
    draft_tensor_parallel_size: int | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SpeculativeConfig:
        if not isinstance(d, dict):
            raise ValueError("speculative_config must be a JSON object / dict.")
        known = {f.name: f for f in fields(cls)}
        for k in d:
            if k not in known:
                raise ValueError(
                    f"speculative_config has unknown field {k!r}; known fields: {', '.join(known)}."
                )
        if "method" not in d:
            raise ValueError(
                f"speculative_config.method is required (one of {', '.join(METHODS)})."
            )
        return cls(**d)

    def __post_init__(self) -> None:
        def check_type(name: str, types: tuple[type, ...], allow_none: bool = False) -> None:
            v = getattr(self, name)
            if v is None and allow_none:
                return
            if isinstance(v, bool) and bool not in types or not isinstance(v, types):
                raise ValueError(
                    f"speculative_config.{name} must be {' or '.join(t.__name__ for t in types)}"
                    f", got {type(v).__name__} {v!r}."
                )

        check_type("method", (str,))
        if self.method not in METHODS:
            raise ValueError(
                f"speculative_config.method must be one of {', '.join(METHODS)}; got {self.method!r}."
            )
        check_type("model", (str,), allow_none=True)
        self._k_given = self.num_speculative_tokens is not None
        if self.num_speculative_tokens is None:
            k = default_num_speculative_tokens(self.model) if self.method == "eagle3" else None
            self.num_speculative_tokens = k or 3
        check_type("num_speculative_tokens", (int,))
        self._check_tree()
        top = MAX_TREE_NODES if self.is_tree else 16
        if not 1 <= self.num_speculative_tokens <= top:
            raise ValueError(
                f"speculative_config.num_speculative_tokens must be in 1..{top}"
                f"{' with a draft tree' if self.is_tree else ''}, got {self.num_speculative_tokens}."
            )
        check_type("draft_sample_method", (str,))
        if self.draft_sample_method not in ("greedy", "probabilistic"):
            raise ValueError(
                "speculative_config.draft_sample_method must be greedy or probabilistic, "
                f"got {self.draft_sample_method!r}."
            )
        check_type("rejection_sample_method", (str,))
        if self.rejection_sample_method not in ("coupled", "strict", "probabilistic", "synthetic"):
            raise ValueError(
                "speculative_config.rejection_sample_method must be coupled, strict, "
                f"probabilistic or synthetic, got {self.rejection_sample_method!r}."
            )
        check_type("synthetic_acceptance_rate", (float, int))
        if not 0 <= self.synthetic_acceptance_rate <= 1:
            raise ValueError("speculative_config.synthetic_acceptance_rate must be in [0, 1].")
        check_type("prompt_lookup_min", (int,))
        check_type("prompt_lookup_max", (int,))
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                "speculative_config needs 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                f"{self.prompt_lookup_min}, {self.prompt_lookup_max}."
            )
        check_type("disable_by_batch_size", (int,), allow_none=True)
        check_type("parallel_draft", (bool,))
        check_type("adaptive", (bool,))
        check_type("draft_tensor_parallel_size", (int,), allow_none=True)
        sched = self.num_speculative_tokens_per_batch_size
        name = "speculative_config.num_speculative_tokens_per_batch_size"
        if isinstance(sched, str):
            if sched != "auto":
                raise ValueError(
                    f'{name} must be "auto" or a {{batch size: K}} object, got {sched!r}.'
                )
        elif isinstance(sched, dict):
            try:  # JSON object keys arrive as strings
                parsed = {int(b): int(k) for b, k in sched.items()}
            except (TypeError, ValueError) as e:
                raise ValueError(f"{name} must map batch sizes to K (integers): {e}") from e
            if any(b < 1 or not 0 <= k <= self.num_speculative_tokens for b, k in parsed.items()):
                raise ValueError(
                    f"{name} needs batch sizes >= 1 and K in 0..num_speculative_tokens "
                    f"({self.num_speculative_tokens}), got {sched}."
                )
            self.num_speculative_tokens_per_batch_size = parsed
        elif sched is not None:
            raise ValueError(f'{name} must be "auto" or a {{batch size: K}} object, got {sched!r}.')
        if self.method in ("draft_model", "eagle", "eagle3") and self.model is None:
            raise ValueError(
                f"speculative_config.model (the drafter directory) is required for {self.method}."
            )

    def _check_tree(self) -> None:
        """Parse and validate draft_tree / speculative_token_tree (sets tree_paths)."""
        self.tree_paths: list[tuple[int, ...]] | None = None
        self.tree_topk = 1
        self.tree_depth = 0
        dt, st = self.draft_tree, self.speculative_token_tree
        if dt is None and st is None:
            return
        if dt is not None and st is not None:
            raise ValueError(
                "speculative_config: give draft_tree (dynamic) or speculative_token_tree "
                "(static), not both."
            )
        if dt is not None:
            if not isinstance(dt, dict) or set(dt) != {"topk", "depth"}:
                raise ValueError(
                    f'speculative_config.draft_tree must be {{"topk": k, "depth": d}}, got {dt!r}.'
                )
            k, d = dt["topk"], dt["depth"]
            if any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in (k, d)):
                raise ValueError(
                    f"speculative_config.draft_tree topk and depth must be integers >= 1, got {dt}."
                )
            if k == 1:  # a chain: today's drafting, unchanged
                return
            n = self.num_speculative_tokens
            if k * (d - 1) >= n:
                raise ValueError(
                    f"speculative_config.draft_tree: topk * (depth - 1) = {k * (d - 1)} drafter "
                    f"queries must fit below num_speculative_tokens ({n}), the KV slots a "
                    "step reserves for drafts; raise num_speculative_tokens or lower topk/depth."
                )
            self.tree_topk, self.tree_depth = k, d
        else:
            self.tree_paths = parse_token_tree(st)
            n = len(self.tree_paths)
            if self._k_given and self.num_speculative_tokens != n:
                raise ValueError(
                    f"speculative_config.speculative_token_tree has {n} nodes but "
                    f"num_speculative_tokens is {self.num_speculative_tokens}; drop one of them."
                )
            self.num_speculative_tokens = n
            self.tree_depth = max(len(p) for p in self.tree_paths)
            if all(p == (0,) * len(p) for p in self.tree_paths):  # a chain
                self.tree_paths = None
                return
        if self.method not in TREE_METHODS or self.parallel_draft:
            raise ValueError(
                f"speculative_config: method {self.method!r}"
                f"{' with parallel_draft' if self.parallel_draft else ''} cannot draft a tree; "
                f"draft trees need one of {', '.join(TREE_METHODS)} (single-layer MTP), or drop "
                "draft_tree / speculative_token_tree."
            )
        if self.rejection_sample_method == "synthetic":
            raise ValueError(
                "speculative_config.rejection_sample_method synthetic times chains only; use "
                "coupled, strict or probabilistic with a draft tree."
            )

    @property
    def is_tree(self) -> bool:
        return self.tree_topk > 1 or self.tree_paths is not None

    @property
    def adaptive_budget(self) -> bool:
        """Whether the engine picks each step's K (spec_decode/dynamic.py): `adaptive` unless a
        batch-size map or disable_by_batch_size fixes it; "auto" always."""
        sched = self.num_speculative_tokens_per_batch_size
        if sched == "auto":
            return True
        return self.adaptive and sched is None and self.disable_by_batch_size is None

    @property
    def uses_hidden_states(self) -> bool:
        return self.method in ("eagle", "eagle3", "mtp")


# Drafters that can expand a tree: one autoregressive drafter over the paged KV.
TREE_METHODS = ("draft_model", "eagle", "eagle3", "mtp")
# A tree's ancestor masks are int64 bitmasks over the root and its nodes.
MAX_TREE_NODES = 63


def parse_token_tree(text: str) -> list[tuple[int, ...]]:
    """vLLM's `speculative_token_tree`: a Python literal list of tuples, each the child indices
    of a path from the root ((0,) the root's best child, (0, 1) that child's second best). Sorted
    breadth-first (by length, then values) as vLLM does; every node's parent must be present."""
    name = "speculative_config.speculative_token_tree"
    try:
        paths = ast.literal_eval(text) if isinstance(text, str) else None
    except (ValueError, SyntaxError) as e:
        raise ValueError(
            f'{name} must be a list of tuples such as "[(0,), (1,), (0, 0)]": {e}'
        ) from e
    if not isinstance(paths, (list, tuple)) or not paths:
        raise ValueError(f'{name} must be a non-empty list of tuples such as "[(0,), (0, 0)]".')
    out = []
    for p in paths:
        if (
            not isinstance(p, tuple)
            or not p
            or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in p)
        ):
            raise ValueError(f"{name}: {p!r} is not a tuple of child indices >= 0.")
        out.append(p)
    out.sort(key=lambda p: (len(p), p))
    have = set(out)
    if len(have) != len(out):
        raise ValueError(f"{name} lists a node twice.")
    for p in out:
        if len(p) > 1 and p[:-1] not in have:
            raise ValueError(f"{name}: node {p} has no parent {p[:-1]} in the tree.")
    if len(out) > MAX_TREE_NODES:
        raise ValueError(f"{name} has {len(out)} nodes; at most {MAX_TREE_NODES}.")
    return out


# A speculators-format EAGLE-3 head (models/speculators_format.py) names its own K.
def is_speculators_config(cfg: dict[str, Any]) -> bool:
    return "speculators_model_type" in cfg


def require_key(d: Any, key: str, where: str, path: str) -> Any:
    if not isinstance(d, dict) or key not in d:
        raise ValueError(f"{path}/config.json: speculators config is missing {where}{key}")
    return d[key]


def proposal_tokens(cfg: dict[str, Any], path: str) -> int:
    spec = require_key(cfg, "speculators_config", "", path)
    methods = require_key(spec, "proposal_methods", "speculators_config.", path)
    if not isinstance(methods, list) or not methods:
        raise ValueError(
            f"{path}/config.json: speculators config is missing "
            "speculators_config.proposal_methods[0]"
        )
    k = require_key(
        methods[0], "speculative_tokens", "speculators_config.proposal_methods[0].", path
    )
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(
            f"{path}/config.json: speculators_config.proposal_methods[0].speculative_tokens "
            f"must be a positive integer, got {k!r}"
        )
    return k


def default_num_speculative_tokens(model_dir: str | None) -> int | None:
    """`speculators_config.proposal_methods[0].speculative_tokens` of a speculators head in
    `model_dir`, the K to use when the user gives none (None: not such a head)."""
    path = os.path.join(model_dir or "", "config.json")
    if not model_dir or not os.path.isfile(path):
        return None
    with open(path) as f:
        try:
            cfg = json.load(f)
        except json.JSONDecodeError:
            return None  # the loader reports it with the file's name
    if not isinstance(cfg, dict) or not is_speculators_config(cfg):
        return None
    return proposal_tokens(cfg, model_dir)
