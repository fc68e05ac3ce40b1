"""SpeculativeConfig: `speculative_config={...}` / `--speculative-config '<json>'`."""

from __future__ import annotations

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
        if self.num_speculative_tokens is None:
            k = default_num_speculative_tokens(self.model) if self.method == "eagle3" else None
            self.num_speculative_tokens = k or 3
        check_type("num_speculative_tokens", (int,))
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(
                "speculative_config.num_speculative_tokens must be in 1..16, "
                f"got {self.num_speculative_tokens}."
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
