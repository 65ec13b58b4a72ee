"""The one context-length check, for ``LLM``, the engine and the server.

A prompt longer than ``max_model_len`` is refused, and so is one exactly that long when it must
generate (nothing fits after it). Offline (vLLM's ``LLM``), ``max_tokens`` past the context is
allowed: generation stops at the context's end with ``finish_reason="length"``. The server asks
for OpenAI's rule (``fits_max_tokens``): prompt + ``max_tokens`` must fit the context.
"""

from __future__ import annotations


class ContextLengthError(ValueError):
    """The request does not fit the model's context; ``param`` names the field to change."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def check_context_length(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int,
                         param: str = "prompt", fits_max_tokens: bool = False,
                         max_tokens_field: str = "max_tokens") -> None:
    """Raise ``ContextLengthError`` unless the prompt fits (see the module docstring);
    ``max_tokens`` None means up to the context's end, 0 that nothing is generated. The error
    names ``param`` (the prompt's field) or ``max_tokens_field`` (the name max_tokens was given
    under, e.g. ``max_completion_tokens``)."""
    generates = max_tokens is None or max_tokens > 0
    if num_prompt_tokens > max_model_len or (num_prompt_tokens == max_model_len and generates):
        room = ", leaving no room to generate" if num_prompt_tokens == max_model_len else ""
        raise ContextLengthError(f"{param} has {num_prompt_tokens} tokens; this model's context "
                                 f"is {max_model_len} tokens (max_model_len){room}", param)
    if fits_max_tokens and max_tokens is not None and num_prompt_tokens + max_tokens > max_model_len:
        raise ContextLengthError(f"{max_tokens_field}={max_tokens} plus {num_prompt_tokens} prompt "
                                 f"tokens exceeds this model's context of {max_model_len} tokens",
                                 max_tokens_field)
