"""The output processor: from the engine's token ids and logprobs to what callers read, shared by
``LLM`` and the server.

- A sequence's text (``samebits.text.output_text.OutputText``) is detokenized once, incrementally:
  the engine searches it for stop strings, a stream sends it (``stream_text``: never a character
  the final text will not hold), and the completion returns it.
- ``OutputProcessor.completion`` is a sequence's ``CompletionOutput`` (vLLM's logprobs shape and
  samebits' exact ``token_logprobs``); ``prompt_logprobs`` its vLLM prompt logprobs.

The engine itself keeps ids and fp32 logprobs only; nothing here can change a bit of them.
"""

from __future__ import annotations

from functools import lru_cache

from samebits.engine.sequence import Sequence
from samebits.outputs import CompletionOutput, Logprob, PromptLogprobs, SampleLogprobs
from samebits.sampling_params import SamplingParams
from samebits.text.output_text import OutputText
from samebits.text.tokenizer import Tokenizer


class OutputProcessor:
    """Turns finished (or streaming) sequences into outputs; one per engine (its tokenizer)."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self.token_text = lru_cache(maxsize=1 << 16)(self._token_text)

    def text_for(self, params: SamplingParams) -> OutputText | None:
        """A new sequence's text state; None when there is no text (no tokenizer, or
        ``detokenize=False``)."""
        if self.tokenizer is None or not params.detokenize:
            return None
        return OutputText(self.tokenizer, params)

    def stream_text(self, seq: Sequence) -> str:
        """The output text a stream may send now (see ``OutputText.stream``)."""
        return "" if seq.detokenizer is None else seq.detokenizer.stream(seq.is_finished)

    def completion(self, seq: Sequence, index: int | None = None) -> CompletionOutput:
        """One sequence's result: choice ``seq.index``, or ``index`` when given."""
        text = "" if seq.detokenizer is None else seq.detokenizer.finish()
        logprobs = self.sample_logprobs(seq) if seq.params.logprobs is not None else None
        return CompletionOutput(
            index=seq.index if index is None else index, text=text,
            token_ids=list(seq.output_token_ids), cumulative_logprob=float(sum(seq.logprobs)),
            logprobs=logprobs, finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
            seed=seq.seed, token_logprobs=list(seq.logprobs),
            top_logprobs=list(seq.top_logprobs))

    def sample_logprobs(self, seq: Sequence) -> SampleLogprobs:
        """vLLM's shape: per generated token {token id: Logprob}, the token itself first (its rank
        in the raw distribution), then the top k (ranks 1..k; a top-k entry for the token itself
        replaces its own entry, keeping its place first)."""
        return [self._entry(token, lp, rank, top) for token, lp, rank, top in zip(
            seq.output_token_ids, seq.logprobs, seq.ranks, seq.top_logprobs, strict=True)]

    def prompt_logprobs(self, seq: Sequence) -> PromptLogprobs | None:
        """vLLM's shape: None, then per prompt token {token id: Logprob} as ``sample_logprobs``;
        None unless the request asked for prompt logprobs."""
        if seq.params.prompt_logprobs is None:
            return None
        out: PromptLogprobs = [None]
        for i, (lp, rank) in enumerate(zip(seq.prompt_logprobs, seq.prompt_ranks, strict=True)):
            out.append(self._entry(seq.prompt_token_ids[i + 1], lp, rank, seq.prompt_top[i]))
        return out

    def _entry(self, token: int, logprob: float, rank: int | None, top: dict[int, float]
               ) -> dict[int, Logprob]:
        entry = {token: Logprob(logprob, rank, self.token_text(token))}
        for r, (tid, value) in enumerate(top.items(), start=1):
            entry[tid] = Logprob(value, r, self.token_text(tid))
        return entry

    def _token_text(self, token_id: int) -> str | None:
        tok = self.tokenizer
        return tok.decode([token_id], skip_special_tokens=False) if tok is not None else None
