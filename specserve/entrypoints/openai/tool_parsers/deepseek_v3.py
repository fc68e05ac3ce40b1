"""`deepseek_v3` (also `deepseek_v31`): DeepSeek's call tokens. Two body layouts, told apart per
call:

    V3 / R1:  <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
              ```json
              {"city": "Paris"}
              ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>
    V3.1:     <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>

Parallel calls are consecutive `<｜tool▁call▁begin｜>...<｜tool▁call▁end｜>` inside one
calls-begin/calls-end group; the group tokens are dropped from content. The arguments are the
model's JSON text, stripped. (The `|` and `_` lookalikes are U+FF5C and U+2581, as in the
tokenizer.) DeepSeek-V3.2's DSML markup is a different format, not parsed here."""

from __future__ import annotations

import re

from specserve.entrypoints.openai.tool_parsers.base import ToolCall, loads_or_none
from specserve.entrypoints.openai.tool_parsers.tagged import TaggedToolParser

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
TOOL_SEP = "<｜tool▁sep｜>"

_V3_BODY = re.compile(r"\s*([^\n]+?)\s*\n```(?:json)?\n(.*)\n```\s*", re.DOTALL)


class DeepSeekV3ToolParser(TaggedToolParser):
    name = "deepseek_v3"
    call_start = CALL_BEGIN
    call_end = CALL_END
    drop_tokens = (CALLS_BEGIN, CALLS_END)

    def _parse_body(self, body: str) -> ToolCall | None:
        head, sep, rest = body.partition(TOOL_SEP)
        if not sep:
            return None
        m = _V3_BODY.fullmatch(rest) if head.strip() == "function" else None
        name, args = (m.group(1), m.group(2)) if m else (head.strip(), rest)
        args = args.strip()
        if not name or not isinstance(loads_or_none(args), dict):
            return None
        return ToolCall(name, args)
