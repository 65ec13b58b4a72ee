"""Chat messages -> a prompt through the model's jinja chat template, tools included.

A template that knows tools (it mentions ``tools``) gets them as the ``tools`` variable, and one
that knows tool calls (it mentions ``tool_calls``) gets assistant ``tool_calls`` with their
``arguments`` parsed into objects (as Hugging Face templates expect). A template that does not --
the default model's ChatML template renders only ``role`` and ``content`` -- gets the Hermes
convention instead, written into the messages: the tools as JSON inside ``<tools></tools>`` in the
system message (one is added if the conversation has none), each assistant call as
``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` in its content, and each tool result
as ``<tool_response>...</tool_response>`` in a ``tool`` message. samebits' tool parser reads the
same ``<tool_call>`` format back out of generated text (server/tools.py).

Content given as a list of parts (OpenAI's ``[{"type": "text", "text": ...}]``) is joined into
one string, its text parts separated by newlines (``join_text_parts``: vLLM's rendering for
string templates; the server joins with it too); other part types are refused.
``continue_final_message`` renders the last message open-ended, cut as transformers cuts it, so
the model continues it instead of starting a new turn.
"""

from __future__ import annotations

import json
from typing import Any

from samebits.text.tokenizer import Tokenizer

TOOLS_PROMPT = (
    "You are a function calling AI model. You are provided with function signatures within "
    "<tools></tools> XML tags. You may call one or more functions to assist with the user query. "
    "Don't make assumptions about what values to plug into functions. Here are the available "
    "tools:\n<tools>\n{tools}\n</tools>\nFor each function call, return a json object with the "
    "function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>')


CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # marks where a continued message ends
# template variables the renderer sets itself (or takes as its own arguments): a request's
# chat_template_kwargs may not name them
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "tools", "template", "add_generation_prompt",
                                      "continue_final_message", "self"})


def render_chat(tokenizer: Tokenizer, messages: list[dict[str, Any]],
                tools: list[dict[str, Any]] | None = None, template: str | None = None,
                template_kwargs: dict[str, Any] | None = None,
                add_generation_prompt: bool = True, continue_final_message: bool = False) -> str:
    """The prompt text; ``ValueError`` when there is no template, it fails, the options
    contradict each other, or ``template_kwargs`` names a reserved variable
    (``RESERVED_TEMPLATE_KWARGS``)."""
    if reserved := sorted(RESERVED_TEMPLATE_KWARGS & set(template_kwargs or ())):
        raise ValueError(f"chat_template_kwargs: {reserved} are set by the server, not by "
                         "chat_template_kwargs")
    template = template or tokenizer.chat_template
    if not template:
        raise ValueError("this model's tokenizer has no chat template")
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be set: "
                         "continue the last message, or start a new assistant turn")
    messages = [_text_content(m) for m in messages]
    if continue_final_message:
        if not messages or not isinstance(messages[-1].get("content"), str):
            raise ValueError("continue_final_message: the final message has no text to continue")
        messages[-1] = {**messages[-1], "content": messages[-1]["content"] + CONTINUE_TAG}
    if "tool_calls" in template:
        messages = [_with_parsed_arguments(m) for m in messages]
    else:
        messages = [_hermes_message(m) for m in messages]
    if tools and "tools" not in template:
        messages, tools = _tools_in_system(messages, tools), None
    text = tokenizer.apply_chat_template(messages, add_generation_prompt, tools=tools or None,
                                         template=template, **(template_kwargs or {}))
    return _cut_at_tag(text) if continue_final_message else text


def join_text_parts(texts: list[str]) -> str:
    """A message's text parts as one content string: newline-separated, as vLLM joins them."""
    return "\n".join(texts)


def _text_content(message: dict[str, Any]) -> dict[str, Any]:
    """The message with list-of-parts content joined into one string."""
    content = message.get("content")
    if not isinstance(content, list | tuple):
        return message
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            raise ValueError(f"message content part of type {kind!r} is not supported: samebits "
                             "models take text parts ({'type': 'text', 'text': ...}) only")
        texts.append(part["text"])
    return {**message, "content": join_text_parts(texts)}


def _cut_at_tag(text: str) -> str:
    """The rendered chat up to where the continued final message ends (transformers' rule)."""
    if CONTINUE_TAG.strip() not in text:
        raise ValueError("continue_final_message: the chat template dropped the final message")
    at = text.rindex(CONTINUE_TAG.strip())
    return text[:at] if text[at:at + len(CONTINUE_TAG)] == CONTINUE_TAG else text[:at].rstrip()


def _with_parsed_arguments(message: dict[str, Any]) -> dict[str, Any]:
    calls = message.get("tool_calls")
    if not calls:
        return message
    parsed = []
    for call in calls:
        fn = dict(call.get("function", {}))
        try:
            fn["arguments"] = json.loads(fn.get("arguments", "{}"))
        except (TypeError, ValueError):
            pass  # not JSON: the template gets the string
        parsed.append({**call, "function": fn})
    return {**message, "tool_calls": parsed}


def _hermes_message(message: dict[str, Any]) -> dict[str, Any]:
    content = message.get("content") or ""
    if message.get("role") == "tool":
        return {"role": "tool", "content": f"<tool_response>\n{content}\n</tool_response>"}
    calls = [c["function"] for c in _with_parsed_arguments(message).get("tool_calls") or ()]
    if calls:
        blocks = [f"<tool_call>\n{json.dumps({'name': f['name'], 'arguments': f['arguments']})}"
                  "\n</tool_call>" for f in calls]
        content = "\n".join(([content] if content else []) + blocks)
    return {"role": message["role"], "content": content}


def _tools_in_system(messages: list[dict[str, Any]], tools: list[dict[str, Any]]
                     ) -> list[dict[str, Any]]:
    section = TOOLS_PROMPT.format(tools="\n".join(json.dumps(t) for t in tools))
    if messages and messages[0].get("role") == "system":
        first = messages[0]
        return [{**first, "content": f"{first.get('content') or ''}\n\n{section}".lstrip()},
                *messages[1:]]
    return [{"role": "system", "content": section}, *messages]
