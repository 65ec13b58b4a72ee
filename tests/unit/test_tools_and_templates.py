"""Tool-call parsing (whole and streamed), tool_choice planning, the Hermes fallback rendering of
tools and tool histories, chat_template_kwargs, and StructuredOutputsParams checks. No model."""

from __future__ import annotations

import json

import pytest

from samebits.server.app import read_chat_template
from samebits.server.errors import APIError
from samebits.server.protocol_chat import ChatCompletionRequest
from samebits.server.tools import ToolPlan, ToolStream, tool_plan
from samebits.structured_outputs import StructuredOutputsParams
from samebits.text.chat_template import render_chat
from samebits.text.tokenizer import Tokenizer

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
AUTO_TEXT = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
             '\n</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}'
             "\n</tool_call>")


def _streamed(plan: ToolPlan, text: str, step: int) -> tuple[str, dict[int, dict]]:
    stream, content, calls = ToolStream(plan), "", {}
    chunks = [text[i:i + step] for i in range(0, len(text), step)]
    deltas = [stream.push(c) for c in chunks] + [stream.finish()]
    for piece, tool_deltas in deltas:
        content += piece or ""
        for d in tool_deltas:
            call = calls.setdefault(d.index, {"id": d.id, "name": d.function.name, "arguments": ""})
            call["arguments"] += d.function.arguments or ""
    return content, calls


def test_auto_parses_hermes_tool_calls_and_keeps_the_text_before_as_content():
    content, calls = ToolStream(ToolPlan("auto")).parse(AUTO_TEXT)
    assert content == "Let me check."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]
    assert len({c.id for c in calls}) == 2


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
def test_auto_streamed_in_any_chunking_reassembles_to_the_whole_parse(step):
    content, calls = _streamed(ToolPlan("auto"), AUTO_TEXT, step)
    assert content.strip() == "Let me check."
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        ("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]


def test_auto_text_without_calls_or_with_broken_json_stays_content():
    for text in ["plain answer < not a tag", "<tool_call>{not json</tool_call>"]:
        assert ToolStream(ToolPlan("auto")).parse(text) == (text, [])
        assert _streamed(ToolPlan("auto"), text, 2) == (text, {})


def test_named_call_is_sent_whole_under_one_call_when_complete():
    content, calls = _streamed(ToolPlan("named", "get_weather"), '{"city": "Oslo"}', 4)
    assert content == "" and list(calls) == [0]
    assert calls[0]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    assert json.loads(calls[0]["arguments"]) == {"city": "Oslo"}


def test_required_array_becomes_calls():
    text = '[{"name": "get_weather", "arguments": {"city": "Lima"}}]'
    content, calls = ToolStream(ToolPlan("required")).parse(text)
    assert content is None and calls[0].function.name == "get_weather"
    assert json.loads(calls[0].function.arguments) == {"city": "Lima"}


def _req(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}],
                                                 **kw})


def _plan(req: ChatCompletionRequest) -> ToolPlan:
    return tool_plan(req.tool_list(), req.tool_choice_value())


def test_tool_choice_plans_and_errors_name_the_field():
    assert _plan(_req()).mode == "none"
    assert _plan(_req(tools=[TOOL])).mode == "auto"
    named = _plan(_req(tools=[TOOL], tool_choice={"type": "function",
                                                       "function": {"name": "get_weather"}}))
    assert named.constraint.json == TOOL["function"]["parameters"]
    assert _plan(_req(tools=[TOOL], tool_choice="required")).constraint.json["type"] == "array"
    for bad in [dict(tool_choice="required"),
                dict(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "x"}})]:
        with pytest.raises(APIError) as e:
            _plan(_req(**bad))
        assert e.value.param == "tool_choice"


def test_server_emitted_assistant_message_is_accepted_back():
    returned = {"role": "assistant", "content": None, "refusal": None, "annotations": None,
                "audio": None, "function_call": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
    req = _req(messages=[{"role": "user", "content": "hi"}, returned,
                         {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}])
    assert req.messages[1].tool_calls[0].function.name == "get_weather"


class _Tok(Tokenizer):
    def __init__(self, template: str) -> None:  # only what rendering needs
        self.chat_template, self.bos_token, self.eos_token = template, None, None


def test_template_without_tools_gets_hermes_sections_for_tools_calls_and_results():
    msgs = [{"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "c", "content": "sunny"}]
    text = render_chat(_Tok(CHATML), msgs, [TOOL])
    assert text.startswith("<|im_start|>system\nYou are a function calling AI model.")
    assert json.dumps(TOOL) in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<|im_start|>tool\n<tool_response>\nsunny\n</tool_response><|im_end|>" in text


def test_template_with_tools_gets_them_as_variables_with_parsed_arguments():
    template = ("{{ tools[0].function.name }}|{% for m in messages %}"
                "{% for c in m.tool_calls or [] %}{{ c.function.arguments.city }}{% endfor %}"
                "{% endfor %}|{{ flavour }}")
    msgs = [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]}]
    assert render_chat(_Tok(template), msgs, [TOOL], template_kwargs={"flavour": "x"}) == \
        "get_weather|Oslo|x"


def test_chat_template_option_reads_a_file_or_inline_template(tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text(CHATML)
    assert read_chat_template(str(f)) == CHATML
    assert read_chat_template("{{ messages }}") == "{{ messages }}"
    with pytest.raises(ValueError, match="--chat-template"):
        read_chat_template(str(tmp_path / "missing.jinja"))


@pytest.mark.parametrize("kwargs", [{}, {"json": {}, "regex": "a"}, {"choice": []},
                                    {"regex": 3}, {"json": 5}])
def test_structured_outputs_params_need_exactly_one_valid_constraint(kwargs):
    with pytest.raises(ValueError, match="structured_outputs"):
        StructuredOutputsParams(**kwargs)
