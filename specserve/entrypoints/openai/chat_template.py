"""What a model's own chat template reads, so that request fields which only matter through the
template are passed to it where it reads them and refused with a 400 where it does not, never
accepted and then dropped by a template that ignores them:
  - `reasoning_effort`: gpt-oss's harmony template writes "Reasoning: <effort>" into its system
    turn;
  - vLLM's `chat_template_kwargs`: any other variable the template reads (`model_identity` in
    the harmony template, `enable_thinking` in Qwen3's).
Tools reach the template as transformers passes them (`tools=[{"type": "function", "function":
{...}}]`); a template that reads no `tools` gets them described in a system message instead,
and one that reads no `tool_calls` gets an assistant's earlier calls written into its text
(`tool_conversation`)."""

from __future__ import annotations

import inspect
import re
from typing import Any

from specserve.entrypoints.openai.protocol import APIError
from specserve.entrypoints.openai.tools import describe_tools, hermes_call_text

# Set by the server or transformers, or requests' own fields: never overridden through
# chat_template_kwargs.
_RESERVED = frozenset(
    {"messages", "tools", "documents", "add_generation_prompt", "continue_final_message",
     "raise_exception", "strftime_now"}
)  # fmt: skip


def template_variables(tokenizer: Any) -> frozenset[str]:
    """The names a request may set in the tokenizer's chat template(s): the variables they read
    from their context (jinja2's undeclared variables), less the ones transformers or the
    server set (messages, special tokens, jinja2's and transformers' globals)."""
    tpl = getattr(tokenizer, "chat_template", None)
    if tpl is None:
        return frozenset()
    from jinja2.defaults import DEFAULT_NAMESPACE

    sources = list(tpl.values()) if isinstance(tpl, dict) else [tpl]
    out: set[str] = set()
    for src in sources:
        out |= _variables(src)
    reserved = set(_RESERVED) | set(DEFAULT_NAMESPACE)
    reserved |= set(inspect.signature(tokenizer.apply_chat_template).parameters)
    reserved |= set(getattr(tokenizer, "special_tokens_map", {}))
    return frozenset(out - reserved)


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
        # name the template spells (it still reaches the template).
        return set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", src))


def template_kwargs(
    variables: frozenset[str], reasoning_effort: str | None, extra: dict[str, Any] | None
) -> dict[str, Any]:
    """The extra template context of a chat request: `reasoning_effort` and vLLM's
    `chat_template_kwargs`; a 400 naming a field the template does not read."""
    out = dict(extra or {})
    unread = sorted(k for k in out if k not in variables)
    if unread:
        raise APIError(
            f"chat_template_kwargs: this model's chat template does not read {unread} (it reads "
            f"{sorted(variables)}), so they would have no effect.",
            param="chat_template_kwargs",
        )
    if reasoning_effort is None:
        return out
    if "reasoning_effort" not in variables:
        raise APIError(
            "reasoning_effort: this model's chat template does not read reasoning_effort, so "
            "it would have no effect; leave it out.",
            param="reasoning_effort",
        )
    if "reasoning_effort" in out:
        raise APIError(
            "set reasoning_effort either as a field or in chat_template_kwargs, not both.",
            param="reasoning_effort",
        )
    return {**out, "reasoning_effort": reasoning_effort}


def template_reads(tokenizer: Any) -> tuple[bool, bool]:
    """(reads `tools`, reads messages' `tool_calls`) for the tokenizer's chat template(s)."""
    tpl = getattr(tokenizer, "chat_template", None)
    if tpl is None:
        return False, False
    sources = list(tpl.values()) if isinstance(tpl, dict) else [tpl]
    tools = any("tools" in _variables(src) for src in sources)
    return tools, any("tool_calls" in src for src in sources)


def tool_conversation(
    conv: list[dict[str, Any]],
    functions: list[dict[str, Any]],
    choice: str,
    reads: tuple[bool, bool],
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, `tools` for the template) of a chat request with tools. A template that reads
    no `tools` gets them in a system message (the first one's text, else one of its own),
    unless tool_choice is "none"; one that reads no `tool_calls` gets earlier calls appended to
    the assistant's text in the hermes form."""
    reads_tools, reads_calls = reads
    if not reads_calls:
        conv = [_calls_as_text(m) for m in conv]
    if not functions:
        return conv, None
    if reads_tools:
        return conv, [{"type": "function", "function": f} for f in functions]
    if choice == "none":
        return conv, None
    text = describe_tools(functions, choice)
    if conv and conv[0]["role"] in ("system", "developer"):
        first = {**conv[0], "content": f"{conv[0]['content']}\n\n{text}".lstrip()}
        return [first, *conv[1:]], None
    return [{"role": "system", "content": text}, *conv], None


def _calls_as_text(m: dict[str, Any]) -> dict[str, Any]:
    calls = m.get("tool_calls")
    if not calls:
        return m
    import json

    text = "\n".join(
        hermes_call_text(c["function"]["name"], json.dumps(c["function"]["arguments"]))
        for c in calls
    )
    out = {k: v for k, v in m.items() if k != "tool_calls"}
    out["content"] = f"{m['content']}\n{text}".lstrip()
    return out
