"""Logprobs in OpenAI's two shapes. The values are the engine's exact fp32 logprobs of the raw
distribution; JSON carries them as the shortest decimal that reads back to the same float."""

from __future__ import annotations

from samebits.server.protocol import ChatLogprobs, CompletionLogprobs, TokenLogprob, TopLogprob
from samebits.server.tokens import TokenText


def completion_logprobs(tt: TokenText, token_ids: list[int], logprobs: list[float],
                        top: list[dict[int, float]], offset: int = 0) -> CompletionLogprobs:
    """``/v1/completions``: tokens, token_logprobs, top_logprobs (the top k and the sampled
    token, as OpenAI: up to k + 1 entries) and text_offset (from ``offset``, in characters)."""
    out = CompletionLogprobs()
    for i, (tid, lp) in enumerate(zip(token_ids, logprobs, strict=True)):
        text = tt.get(tid)[0]
        out.tokens.append(text)
        out.token_logprobs.append(lp)
        out.text_offset.append(offset)
        offset += len(text)
        ranked = {tt.get(t)[0]: v for t, v in (top[i] if i < len(top) else {}).items()}
        ranked.setdefault(text, lp)
        out.top_logprobs.append(ranked)
    return out


def chat_logprobs(tt: TokenText, token_ids: list[int], logprobs: list[float],
                  top: list[dict[int, float]], k: int) -> ChatLogprobs:
    """``/v1/chat/completions``: content [{token, logprob, bytes, top_logprobs[k]}]."""
    content = []
    for i, (tid, lp) in enumerate(zip(token_ids, logprobs, strict=True)):
        ranked = list((top[i] if i < len(top) else {}).items())[:k]
        content.append(TokenLogprob(**_entry(tt, tid, lp).model_dump(),
                                    top_logprobs=[_entry(tt, t, v) for t, v in ranked]))
    return ChatLogprobs(content=content)


def _entry(tt: TokenText, token_id: int, logprob: float) -> TopLogprob:
    text, raw = tt.get(token_id)
    return TopLogprob(token=text, logprob=logprob, bytes=list(raw))


def text_length(tt: TokenText, token_ids: list[int]) -> int:
    """Characters the tokens' texts add up to (where the next text_offset starts)."""
    return sum(len(tt.get(t)[0]) for t in token_ids)
