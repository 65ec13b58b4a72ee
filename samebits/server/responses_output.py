"""The Responses API's output: a finished answer as output items (a message with the text, one
``function_call`` item per tool call), and the response object's final status and usage."""

from __future__ import annotations

import uuid

from samebits.outputs import CompletionOutput
from samebits.server.logprobs import chat_logprobs
from samebits.server.protocol_chat import TokenLogprob
from samebits.server.responses_protocol import (
    LOGPROBS,
    IncompleteDetails,
    InputTokensDetails,
    OutputFunctionCall,
    OutputItem,
    OutputMessage,
    OutputText,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from samebits.server.serving import ServingContext
from samebits.server.tools import ToolPlan, ToolStream


def output_items(ctx: ServingContext, req: ResponsesRequest, plan: ToolPlan,
                 out: CompletionOutput) -> list[OutputItem]:
    """A whole answer as output items: its text (a message, left out when calls are all there
    is), then its tool calls (none when cut by max_output_tokens)."""
    cut = out.finish_reason == "length"
    content, calls = ToolStream(plan).parse(out.text, cut)
    items: list[OutputItem] = []
    if content or not calls:
        lps = logprobs(ctx, req, out.token_ids, out.token_logprobs, out.top_logprobs)
        items.append(OutputMessage(id=item_id("msg"), status="incomplete" if cut else "completed",
                                   content=[OutputText(text=content or "", logprobs=lps)]))
    items += [OutputFunctionCall(id=item_id("fc"), call_id=c.id, name=c.function.name,
                                 arguments=c.function.arguments, status="completed")
              for c in calls]
    return items


def logprobs(ctx: ServingContext, req: ResponsesRequest, token_ids: list[int],
             values: list[float], top: list[dict[int, float]]) -> list[TokenLogprob]:
    """The tokens' logprobs when ``include`` asks for them (else none)."""
    if LOGPROBS not in (req.include or ()):
        return []
    return chat_logprobs(ctx.token_text, token_ids, values, top, req.top_logprobs or 0).content


def finished(head: ResponseObject, items: list[OutputItem], out: CompletionOutput,
             input_tokens: int, cached: int) -> ResponseObject:
    """The response object once the answer is done: its items, status and usage."""
    cut = out.finish_reason == "length"
    n = len(out.token_ids)
    return head.model_copy(update=dict(
        status="incomplete" if cut else "completed", output=items,
        incomplete_details=IncompleteDetails(reason="max_output_tokens") if cut else None,
        usage=ResponseUsage(input_tokens=input_tokens, output_tokens=n,
                            input_tokens_details=InputTokensDetails(cached_tokens=cached),
                            total_tokens=input_tokens + n)))


def item_id(kind: str) -> str:
    return f"{kind}_{uuid.uuid4().hex}"
