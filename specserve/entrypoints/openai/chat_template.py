"""What a model's own chat template reads, so that request fields which only matter through the
template (`reasoning_effort`: gpt-oss's harmony template writes "Reasoning: <effort>" into its
system turn) are passed to it where it reads them and refused with a 400 where it does not,
never accepted and then dropped by a template that ignores them."""

from __future__ import annotations

import re
from typing import Any

from specserve.entrypoints.openai.protocol import APIError


def template_variables(tokenizer: Any) -> frozenset[str]:
    """The names the tokenizer's chat template(s) read from their context (jinja2's undeclared
    variables: `reasoning_effort`, `messages`, `add_generation_prompt`, ...)."""
    tpl = getattr(tokenizer, "chat_template", None)
    if tpl is None:
        return frozenset()
    sources = list(tpl.values()) if isinstance(tpl, dict) else [tpl]
    out: set[str] = set()
    for src in sources:
        out |= _variables(src)
    return frozenset(out)


def _variables(src: str) -> set[str]:
    import jinja2
    from jinja2 import meta
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"])
    try:
        return set(meta.find_undeclared_variables(env.parse(src)))
    except jinja2.TemplateSyntaxError:
        # NOTE: transformers adds its own tags ({% generation %}) that plain jinja2 cannot
        # parse; then any identifier in the source counts, which errs towards accepting a
        # field the template names (it still reaches the template).
        return set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", src))


def template_kwargs(variables: frozenset[str], reasoning_effort: str | None) -> dict[str, Any]:
    """The extra template context of a chat request; a 400 naming a field the template does not
    read."""
    if reasoning_effort is None:
        return {}
    if "reasoning_effort" not in variables:
        raise APIError(
            "reasoning_effort: this model's chat template does not read reasoning_effort, so "
            "it would have no effect; leave it out.",
            param="reasoning_effort",
        )
    return {"reasoning_effort": reasoning_effort}
