"""The hermes tool parser tracerl loads into vLLM (``vllm_plugins/hermes_tool_parser.py``), run by
vLLM's own plugin loader in vLLM's environment: it answers as the transformers engine's parser
does, where vLLM's own passed list arguments on as a call that LangChain refuses."""

from __future__ import annotations

import json
import os
import subprocess

from tests.conftest import VLLM_TESTS
from tests.test_gateway_recorder import BROKEN_BLOCKS, TWO_CALLS
from tracerl.backend.engines.tool_parsers import parse_hermes
from tracerl.backend.engines.vllm_engine import tool_parser_flags, vllm_python

pytestmark = VLLM_TESTS

RUN_PLUGIN = """
import json, sys
from vllm.tokenizers import get_tokenizer
from vllm.tool_parsers.abstract_tool_parser import ToolParserManager
ToolParserManager.import_tool_parser(sys.argv[1])
parser = ToolParserManager.get_tool_parser(sys.argv[2])(get_tokenizer(sys.argv[3]))
for text in json.loads(sys.stdin.read()):
    info = parser.extract_tool_calls(text, None)
    calls = [[c.function.name, c.function.arguments] for c in info.tool_calls]
    print(json.dumps([info.content if info.tools_called else text, calls]))
"""
MIXED = ('Hi <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
         '<tool_call>{"name": "g", "arguments": [3]}</tool_call>')
# vLLM's own rules, kept: an unclosed block whose JSON is whole is a call; a block that is not
# JSON makes the whole answer text (tracerl's parser keeps the valid calls beside it)
BROKEN_BESIDE_VALID = ('<tool_call>{not json}</tool_call>'
                       '<tool_call>{"name": "f", "arguments": {}}</tool_call>')
VLLM_RULES = {"unclosed": (None, [["get_weather", "{}"]]),
              "broken-beside-valid": (BROKEN_BESIDE_VALID, [])}


def test_vllms_hermes_flags_name_the_plugin_and_other_parsers_stay_vllms():
    flags = tool_parser_flags("hermes")
    assert flags[0] == "--tool-parser-plugin" and os.path.isfile(flags[1])
    assert flags[2:] == ["--tool-call-parser", "tracerl_hermes"]
    assert tool_parser_flags("llama3_json") == ["--tool-call-parser", "llama3_json"]


def test_the_plugin_answers_as_the_transformers_engines_parser(smollm2_path):
    texts = {"valid": TWO_CALLS, "mixed": MIXED, "broken-beside-valid": BROKEN_BESIDE_VALID,
             **BROKEN_BLOCKS}
    flags = tool_parser_flags("hermes")
    out = subprocess.run(
        [vllm_python(), "-c", RUN_PLUGIN, flags[1], flags[3], str(smollm2_path)],
        input=json.dumps(list(texts.values())), capture_output=True, text=True, timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    answers = dict(zip(texts, (json.loads(line) for line in out.stdout.splitlines()),
                       strict=True))
    for name, text in texts.items():
        content, calls = parse_hermes(text)
        want = [content or None, [[c["function"]["name"], c["function"]["arguments"]]
                                  for c in calls]]
        assert answers[name] == list(VLLM_RULES.get(name, want)), name
    assert answers["mixed"] == [
        'Hi <tool_call>{"name": "g", "arguments": [3]}</tool_call>', [["f", '{"a": 1}']]]
