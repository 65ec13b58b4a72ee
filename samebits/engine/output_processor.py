"""The output processor: from the engine's token ids and logprobs to what callers read, shared by
``LLM`` and the server.

- ``OutputText`` is a sequence's text, detokenized once and incrementally as tokens arrive: the
  engine searches it for stop strings, a stream sends it (``stream_text``: never a character the
  final text will not hold), and the completion returns it.
- ``OutputProcessor.completion`` is a sequence's ``CompletionOutput`` (vLLM's logprobs shape and
  samebits' exact ``token_logprobs``); ``prompt_logprobs`` its vLLM prompt logprobs.

The engine itself keeps ids and fp32 logprobs only; nothing here can change a bit of them.
"""

from __future__ import annotations

from functools import lru_cache

from samebits.engine.sequence import Sequence
from samebits.outputs import CompletionOutput, Logprob, PromptLogprobs, SampleLogprobs
from samebits.sampling_params import SamplingParams
from samebits.text.detokenizer import IncrementalDetokenizer
from samebits.text.tokenizer import Tokenizer


class OutputText:
    """One sequence's output text. Generated tokens are pushed as they come (a stop token only
    with ``include_stop_str_in_output``) and detokenized when the text is needed: every token for
    a request with stop strings (the engine searches each token's new characters), else when a
    stream asks or at the end -- the same text either way. ``final`` is set when the sequence
    finishes, cut at a stop string (after it with ``include_stop_str_in_output``)."""

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams) -> None:
        self.detokenizer = IncrementalDetokenizer(tokenizer, params.stop_strings,
                                                  params.skip_special_tokens)
        self.include_stop = params.include_stop_str_in_output
        longest = max((len(s) for s in self.detokenizer.stops), default=0)
        # characters a stream holds back: where a stop string could still start (and be cut)
        self.hold = 0 if self.include_stop else max(longest - 1, 0)
        self.final: str | None = None
        self.sent = 0  # characters handed to a stream
        self._pending: list[int] = []  # pushed, not yet detokenized

    @property
    def has_stops(self) -> bool:
        return bool(self.detokenizer.stops)

    def push(self, token_id: int) -> None:
        self._pending.append(token_id)

    def drain(self) -> int:
        """Detokenize the pending tokens; how many characters they completed."""
        new = sum(len(self.detokenizer.push(t)) for t in self._pending)
        self._pending.clear()
        return new

    def find_stop(self, num_new: int) -> str | None:
        """The stop string that ends within the last ``num_new`` characters, if any; the text is
        then final, cut where vLLM cuts it."""
        cut = self.detokenizer.find_stop(num_new)
        if cut is None:
            return None
        stop = self.detokenizer.stop_at(cut)
        self.final = self.detokenizer.text[:cut + len(stop) if self.include_stop else cut]
        return stop

    def finish(self) -> str:
        """The final text (pending bytes of an incomplete character flushed, as a full decode)."""
        if self.final is None:
            self.drain()
            self.detokenizer.flush()
            self.final = self.detokenizer.text
        return self.final

    def stream(self, finished: bool) -> str:
        """The text not yet streamed that is certain to be in the final text: all of it once
        ``finished``, else all but the last ``hold`` characters."""
        if finished:
            text = self.finish()
        else:
            self.drain()
            text = self.detokenizer.text
        end = len(text) if finished else max(len(text) - self.hold, self.sent)
        delta, self.sent = text[self.sent:end], end
        return delta


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
