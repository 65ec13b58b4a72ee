"""One request's failure stays that request's: the per-request work of a step, guarded.

A step does work on behalf of each request that can fail for that request alone: its logits
processors and its grammar mask (in the runner, batched), its grammar advancing, its stop-string
search and detokenization (in the engine's postprocess), and the model itself can give one
request's row non-finite logits. Each of these failures finishes that request with
``finish_reason="error"`` and ``Sequence.error`` (a ``RequestError`` naming the cause), in the
same step; every other request in the step goes on with its bits unchanged. A ``GrammarError``
(the request's own output constraint can no longer be met) is the request's fault
(``invalid_request``: a 400 over HTTP); anything else is the server's (a 500).

``processed_logits`` runs the processors and masks on the whole batch, as before; only when that
raises does it redo them one row at a time, to find the rows that fail. Every processor and mask
is elementwise within its own row (``samebits.engine.logits_processor``,
``samebits.engine.grammar``), so a row processed alone has the same bits as in the batch.
"""

from __future__ import annotations

import math

import torch

from samebits.engine.grammar import GrammarError, apply_grammar_masks
from samebits.engine.logits_processor import apply_logits_processors
from samebits.engine.request_error import RequestError
from samebits.engine.sequence import Sequence

MAX_CAUSE_CHARS = 200  # an error message keeps at most this much of an exception's text
NON_FINITE = "the model's logits for this request are not finite (NaN or infinity)"
_STAGES = (("logits processors", apply_logits_processors),
           ("structured output", apply_grammar_masks))


def processed_logits(logits: torch.Tensor, seqs: list[Sequence],
                     failed: dict[str, RequestError]) -> torch.Tensor:
    """Raw logits [B, V] -> the logits to sample from (processors, then grammar masks). A request
    whose processing raises gets its cause in ``failed`` (by request id) and keeps its
    raw row (its token will be discarded); the other rows are processed as in the batch."""
    try:
        return _process(logits, seqs)
    except Exception:
        pass
    rows = []
    for i, seq in enumerate(seqs):
        try:
            rows.append(_process(logits[i:i + 1], [seq]))
        except _StageError as e:
            failed[seq.request_id] = e.error
            rows.append(logits[i:i + 1])
    return torch.cat(rows)


class _StageError(Exception):
    def __init__(self, error: RequestError) -> None:
        super().__init__(error.message)
        self.error = error


def _process(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    for name, stage in _STAGES:
        try:
            logits = stage(logits, seqs)
        except Exception as e:
            raise _StageError(cause(name, e)) from e
    return logits


def token_cause(logprob: float) -> RequestError | None:
    """Why a sampled token cannot be kept, from its reported logprob: NaN exactly when the row's
    raw logits hold a NaN or an infinity (log_softmax spreads either over the whole row)."""
    return RequestError(NON_FINITE) if math.isnan(logprob) else None


def cause(stage: str, e: BaseException) -> RequestError:
    """``"<stage> failed: <exception text, shortened>"``; the request's fault for a
    ``GrammarError``, the server's otherwise."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if len(text) > MAX_CAUSE_CHARS:
        text = text[:MAX_CAUSE_CHARS] + "..."
    return RequestError(f"{stage} failed: {text}", isinstance(e, GrammarError))
