"""Qwen3-Coder's XML-like format, one block per call::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

A parameter's value is raw text, typed by the tool's JSON schema (as vLLM's ``qwen3_coder``
parser does): a string parameter stays text, any other type is read as JSON (text if it is not
JSON), a parameter the schema does not name stays text. Arguments stream a parameter at a time.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pagedllm.entrypoints.openai.tool_parsers.base import (
    FinishedCallsParser,
    ParsedCall,
    PartialCall,
    PartialToolCalls,
    tagged_calls,
)

START, END = "<tool_call>", "</tool_call>"
_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>")
_PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)
_FUNCTION_END = re.compile(r"\s*</function>")


class Qwen3CoderToolParser(FinishedCallsParser):
    marker = START

    def finished(self, call: PartialCall) -> ParsedCall | None:
        # The arguments are already the JSON object this parser wrote from the parameters.
        return ParsedCall(call.name, call.arguments) if call.done and call.name else None

    def partial(self, text: str) -> PartialToolCalls:
        return tagged_calls(text, START, END, lambda text, start, end: self._call(text[start:end]))

    def _call(self, block: str) -> PartialCall:
        function = _FUNCTION.match(block)
        if function is None:
            return PartialCall(None, "", False)
        name = function.group(1).strip()
        types = self._parameter_types(name)
        members = []
        position = function.end()
        while (parameter := _PARAMETER.match(block, position)) is not None:
            key = parameter.group(1).strip()
            value = _typed(parameter.group(2), types.get(key))
            members.append(f"{json.dumps(key, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}")
            position = parameter.end()
        done = _FUNCTION_END.match(block, position) is not None
        return PartialCall(name, "{" + ", ".join(members) + ("}" if done else ""), done)

    def _parameter_types(self, name: str) -> dict[str, Any]:
        for tool in self.tools:
            function = tool.get("function", {})
            if function.get("name") == name:
                properties = (function.get("parameters") or {}).get("properties") or {}
                return {key: spec.get("type") for key, spec in properties.items() if isinstance(spec, dict)}
        return {}


def _typed(text: str, schema_type: Any) -> Any:
    if schema_type is None or schema_type == "string":
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text
