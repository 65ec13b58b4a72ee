"""One generated output's text, detokenized once (samebits.engine.output_processor uses it for
every sequence): pushed token by token, searched for stop strings, streamed without ever sending
what the final text will not hold, and cut where vLLM cuts it."""

from __future__ import annotations

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
