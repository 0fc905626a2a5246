"""vLLM's ``hermes`` tool parser, answering a tool call whose arguments are not an object as text.

Loaded by the vLLM server tracerl starts with ``tool_call_parser="hermes"``
(``--tool-parser-plugin`` this file, ``--tool-call-parser tracerl_hermes``); it runs in vLLM's
process. vLLM's own parser passes ``{"name": "f", "arguments": [11]}`` on as a call with
arguments ``"[11]"``, which LangChain's ``AIMessage`` refuses (a ValidationError that ends a
stock agent's rollout instead of scoring a wrong answer). Here, as in tracerl's parser for the
transformers engine (:func:`tracerl.backend.engines.tool_parsers.parse_hermes`), such a block
stays in the content; the calls with object arguments are answered as calls. Streamed answers
are vLLM's: LangChain and the openai SDK take a streamed non-object argument as an invalid
tool call, not an error.
"""

from __future__ import annotations

import functools
import importlib.util
import json
from pathlib import Path
from typing import Any

from vllm.entrypoints.generate.base.protocol import ExtractedToolCallInformation
from vllm.tool_parsers.abstract_tool_parser import ToolParserManager
from vllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser

NAME = "tracerl_hermes"


@functools.cache
def _tracerl_tool_parsers() -> Any:
    """tracerl's tool_parsers module by its path (stdlib only: tracerl is not installed here)."""
    path = Path(__file__).resolve().parent.parent / "tool_parsers.py"
    spec = importlib.util.spec_from_file_location("tracerl_tool_parsers", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _object_arguments(arguments: str) -> str | None:
    """A call's arguments as the client should get them, or None where they are not an object.

    vLLM serialises what the model wrote, so ``"arguments": "{\\"a\\": 1}"`` (a string
    holding JSON) arrives encoded twice: its inner text is the arguments, as tracerl's parser
    passes them (a string that is no JSON too: the client's to report)."""
    value = json.loads(arguments)  # vLLM's json.dumps of the parsed block
    text = value if isinstance(value, str) else arguments
    return text if _tracerl_tool_parsers().arguments_are_an_object(text) else None


@ToolParserManager.register_module(NAME)
class ObjectArgumentsHermesParser(Hermes2ProToolParser):
    """vLLM's hermes parser; a call whose arguments are not a JSON object stays in the text."""

    def extract_tool_calls(self, model_output: str, request: Any) -> ExtractedToolCallInformation:
        info = super().extract_tool_calls(model_output, request)
        if not info.tools_called:
            return info
        blocks = [m.group(0) for m in self.tool_call_regex.finditer(model_output)]
        kept, content = [], model_output
        for block, call in zip(blocks, info.tool_calls, strict=True):
            arguments = _object_arguments(call.function.arguments)
            if arguments is not None:
                call.function.arguments = arguments
                kept.append(call)
                content = content.replace(block, "", 1)
        if len(kept) == len(info.tool_calls):
            return info
        if not kept:
            return ExtractedToolCallInformation(tools_called=False, tool_calls=[],
                                                content=model_output)
        return ExtractedToolCallInformation(tools_called=True, tool_calls=kept,
                                            content=content.strip() or None)
