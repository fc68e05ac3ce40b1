"""`glm45`: GLM-4.5 / 4.6 calls, one block per call with the arguments as key/value tags:

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    <arg_key>days</arg_key>
    <arg_value>3</arg_value>
    </tool_call>

GLM's template writes string values raw and other values as JSON, so a value is JSON-decoded
where it is valid JSON and kept as a string otherwise. NOTE: vLLM also consults the request's
tool schema to keep a string-typed "3" a string; this parser sees no schema, so "3" becomes 3.
The name may be followed by a newline or directly by the first `<arg_key>` (GLM-4.7)."""

from __future__ import annotations

import json
import re
from typing import Any

from specserve.entrypoints.openai.tool_parsers.base import ToolCall
from specserve.entrypoints.openai.tool_parsers.tagged import TaggedToolParser

_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


def _decode(value: str) -> Any:
    try:
        return json.loads(value)
    except ValueError:
        return value


class Glm45ToolParser(TaggedToolParser):
    name = "glm45"
    call_start = "<tool_call>"
    call_end = "</tool_call>"

    def _parse_body(self, body: str) -> ToolCall | None:
        head, sep, rest = body.partition("<arg_key>")
        name = head.strip()
        if not name or any(c.isspace() for c in name) or "<" in name:
            return None
        args = {k.strip(): _decode(v.strip()) for k, v in _ARG.findall(sep + rest)}
        return ToolCall(name, json.dumps(args, ensure_ascii=False))
