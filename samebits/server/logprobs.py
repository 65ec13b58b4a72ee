"""Logprobs in OpenAI's two shapes. The values are the engine's exact fp32 logprobs of the raw
distribution; JSON carries them as the shortest decimal that reads back to the same float."""

from __future__ import annotations

from samebits.outputs import PromptLogprobs
from samebits.server.protocol import PromptLogprob
from samebits.server.protocol_chat import ChatLogprobs, TokenLogprob, TopLogprob
from samebits.server.protocol_completion import CompletionLogprobs
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


def echo_logprobs(tt: TokenText, prompt_ids: list[int], prompt: PromptLogprobs, k: int,
                  generated: CompletionLogprobs) -> CompletionLogprobs:
    """``echo`` with ``logprobs``: the prompt's tokens (the first with null logprobs, as vLLM),
    each with its top ``k`` and itself, followed by the generated tokens' ``generated``."""
    out, offset = CompletionLogprobs(), 0
    for i, tid in enumerate(prompt_ids):
        text = tt.get(tid)[0]
        out.tokens.append(text)
        out.text_offset.append(offset)
        offset += len(text)
        if i == 0:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        entry = prompt[i]
        ranked = {tt.get(t)[0]: lp.logprob for _, t, lp in
                  sorted((lp.rank, t, lp) for t, lp in entry.items() if lp.rank <= k)}
        ranked.setdefault(text, entry[tid].logprob)
        out.token_logprobs.append(entry[tid].logprob)
        out.top_logprobs.append(ranked)
    out.tokens += generated.tokens
    out.token_logprobs += generated.token_logprobs
    out.top_logprobs += generated.top_logprobs
    out.text_offset += [offset + o for o in generated.text_offset]
    return out


def vllm_prompt_logprobs(prompt: PromptLogprobs, k: int) -> list[dict[str, PromptLogprob] | None]:
    """vLLM's ``prompt_logprobs`` of a choice: null, then {"<id>": {logprob, rank,
    decoded_token}} per prompt token -- the token itself first, then its position's top ``k``."""
    return [None] + [
        {str(t): PromptLogprob(logprob=lp.logprob, rank=lp.rank, decoded_token=lp.decoded_token)
         for n, (t, lp) in enumerate(entry.items()) if n == 0 or lp.rank <= k}
        for entry in prompt[1:]]
