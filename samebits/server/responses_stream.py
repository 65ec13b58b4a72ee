"""The Responses API's event stream, as OpenAI sends it (``event: TYPE`` + ``data: JSON``, numbered
by ``sequence_number``, no ``[DONE]``):

``response.created``, ``response.in_progress``; for the text, ``response.output_item.added`` (a
message), ``response.content_part.added``, ``response.output_text.delta`` ...,
``response.output_text.done``, ``response.content_part.done``, ``response.output_item.done``; for
each tool call, ``response.output_item.added`` (a function_call),
``response.function_call_arguments.delta`` ..., ``response.function_call_arguments.done``,
``response.output_item.done``; then ``response.completed`` with the whole response (its
``status`` is ``incomplete`` when cut by ``max_output_tokens``; it carries ``output_hash``).

Text streams as it is generated (held back only where a stop string or a tool call could still
start, as chat); tool calls are sent when complete (each call's arguments in one delta), and an
answer cut by ``max_output_tokens`` streams its held text as text, as chat (server/tools.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask

from samebits.outputs import CompletionOutput
from samebits.server.async_engine import RequestGroup
from samebits.server.errors import APIError
from samebits.server.protocol_chat import TokenLogprob
from samebits.server.protocol_tools import DeltaToolCall
from samebits.server.responses_output import finished, item_id, logprobs
from samebits.server.responses_protocol import (
    OutputFunctionCall,
    OutputItem,
    OutputMessage,
    OutputText,
    ResponseObject,
    ResponsesRequest,
    StreamEvent,
)
from samebits.server.serving import ServingContext, deltas, hash_outputs
from samebits.server.tools import ToolPlan, ToolStream


def stream_response(ctx: ServingContext, req: ResponsesRequest, plan: ToolPlan,
                    group: RequestGroup, head: ResponseObject) -> StreamingResponse:
    """The events as server-sent events; the request is aborted when the client leaves."""

    async def body() -> AsyncIterator[str]:
        events = _Numbered()
        try:
            async for event in _events(ctx, req, plan, group, head, events):
                yield f"event: {event.type}\ndata: {event.model_dump_json()}\n\n"
        except APIError as e:
            error = events("error", code=e.code or e.type, message=e.message, param=e.param)
            yield f"event: error\ndata: {error.model_dump_json()}\n\n"
        finally:
            ctx.engine.abort(group.request_ids)

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"},
                             background=BackgroundTask(ctx.engine.abort, group.request_ids))


class _Numbered:
    """Events numbered in the order they are made."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, type: str, **fields) -> StreamEvent:
        self.count += 1
        return StreamEvent(type=type, sequence_number=self.count - 1, **fields)


async def _events(ctx: ServingContext, req: ResponsesRequest, plan: ToolPlan,
                  group: RequestGroup, head: ResponseObject, events: _Numbered
                  ) -> AsyncIterator[StreamEvent]:
    yield events("response.created", response=head)
    yield events("response.in_progress", response=head)
    items = _Items(events)
    tools = ToolStream(plan)
    pending: list[TokenLogprob] = []  # logprobs of tokens whose text is still held back
    out: CompletionOutput | None = None
    async for d in deltas(ctx, group):
        out = d.output
        content, calls = tools.push(d.text)  # the engine's text, streamed
        if out is not None:
            rest, more = tools.finish(cut=out.finish_reason == "length")
            content, calls = (content or "") + (rest or ""), calls + more
        pending += logprobs(ctx, req, d.token_ids, d.logprobs, d.top_logprobs)
        if content:
            for event in items.text(content, pending):
                yield event
            pending = []
        for call in calls:
            for event in items.call(call):
                yield event
    assert out is not None
    for event in items.close(out.finish_reason == "length", pending):
        yield event
    done = finished(head, items.done, out, len(group.prompts[0]), group.cached_tokens[0])
    yield events("response.completed",
                 response=done.model_copy(update={"output_hash": hash_outputs([out])}))


class _Items:
    """The output items being streamed: at most one open at a time (a message, or a function
    call), each at the next output index; ``done`` holds the finished ones in order."""

    def __init__(self, events: _Numbered) -> None:
        self.events = events
        self.done: list[OutputItem] = []
        self.message: OutputMessage | None = None
        self.text_so_far = ""
        self.logprobs: list[TokenLogprob] = []
        self.function: OutputFunctionCall | None = None

    def text(self, delta: str, lps: list[TokenLogprob]) -> Iterator[StreamEvent]:
        ev, index = self.events, len(self.done)
        if self.message is None:
            yield from self._close_function()
            self.message = OutputMessage(id=item_id("msg"), status="in_progress")
            yield ev("response.output_item.added", output_index=index, item=self.message)
            yield ev("response.content_part.added", item_id=self.message.id,
                     output_index=index, content_index=0, part=OutputText(text=""))
        self.text_so_far += delta
        self.logprobs += lps
        yield ev("response.output_text.delta", item_id=self.message.id, output_index=index,
                 content_index=0, delta=delta, logprobs=lps)

    def call(self, delta: DeltaToolCall) -> Iterator[StreamEvent]:
        ev = self.events
        if delta.id is not None:  # a new call
            yield from self._close_message("completed")
            yield from self._close_function()
            self.function = OutputFunctionCall(
                id=item_id("fc"), call_id=delta.id, name=delta.function.name or "",
                arguments="", status="in_progress")
            yield ev("response.output_item.added", output_index=len(self.done),
                     item=self.function)
        args = delta.function.arguments
        if args and self.function is not None:
            self.function.arguments += args
            yield ev("response.function_call_arguments.delta", item_id=self.function.id,
                     output_index=len(self.done), delta=args)

    def close(self, cut: bool, lps: list[TokenLogprob]) -> Iterator[StreamEvent]:
        """Finish the open item (an empty answer still gets its message)."""
        if lps or (not self.done and self.function is None and self.message is None):
            yield from self.text("", lps)
        yield from self._close_message("incomplete" if cut else "completed")
        yield from self._close_function("incomplete" if cut else "completed")

    def _close_message(self, status: str) -> Iterator[StreamEvent]:
        if self.message is None:
            return
        ev, index, message = self.events, len(self.done), self.message
        part = OutputText(text=self.text_so_far, logprobs=self.logprobs)
        yield ev("response.output_text.done", item_id=message.id, output_index=index,
                 content_index=0, text=part.text, logprobs=part.logprobs)
        yield ev("response.content_part.done", item_id=message.id, output_index=index,
                 content_index=0, part=part)
        item = message.model_copy(update={"status": status, "content": [part]})
        yield ev("response.output_item.done", output_index=index, item=item)
        self.done.append(item)
        self.message, self.text_so_far, self.logprobs = None, "", []

    def _close_function(self, status: str = "completed") -> Iterator[StreamEvent]:
        if self.function is None:
            return
        ev, index, call = self.events, len(self.done), self.function
        yield ev("response.function_call_arguments.done", item_id=call.id, output_index=index,
                 name=call.name, arguments=call.arguments)
        item = call.model_copy(update={"status": status})
        yield ev("response.output_item.done", output_index=index, item=item)
        self.done.append(item)
        self.function = None
