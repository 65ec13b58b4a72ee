"""One request's failure stays that request's: the per-request work of a step, guarded.

A step does work on behalf of each request that can fail for that request alone: its logits
processors and its grammar mask (in the runner, batched), its grammar advancing, its stop-string
search and detokenization (in the engine's postprocess), and the model itself can give one
request's row non-finite logits. Each of these failures finishes that request with
``finish_reason="error"`` and ``Sequence.error`` naming the cause, in the same step; every other
request in the step goes on with its bits unchanged.

``processed_logits`` runs the processors and masks on the whole batch, as before; only when that
raises does it redo them one row at a time, to find the rows that fail. Every processor and mask
is elementwise within its own row (``samebits.engine.logits_processor``,
``samebits.engine.grammar``), so a row processed alone has the same bits as in the batch.
"""

from __future__ import annotations

import logging
import math

import torch

from samebits.engine.grammar import apply_grammar_masks
from samebits.engine.logits_processor import apply_logits_processors
from samebits.engine.sequence import Sequence

log = logging.getLogger("samebits.engine")
MAX_CAUSE_CHARS = 200  # an error message keeps at most this much of an exception's text
NON_FINITE = "the model's logits for this request are not finite (NaN or infinity)"
_STAGES = (("logits processors", apply_logits_processors),
           ("structured output", apply_grammar_masks))


def processed_logits(logits: torch.Tensor, seqs: list[Sequence], failed: dict[str, str]
                     ) -> torch.Tensor:
    """Raw logits [B, V] -> the logits to sample from (processors, then grammar masks). A request
    whose processing raises gets its cause in ``failed`` (request id -> message) and keeps its
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
            failed[seq.request_id] = str(e)
            rows.append(logits[i:i + 1])
    return torch.cat(rows)


class _StageError(Exception):
    pass


def _process(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    for name, stage in _STAGES:
        try:
            logits = stage(logits, seqs)
        except Exception as e:
            raise _StageError(cause(name, e)) from e
    return logits


def token_cause(logprob: float) -> str | None:
    """Why a sampled token cannot be kept, from its reported logprob: NaN exactly when the row's
    raw logits hold a NaN or an infinity (log_softmax spreads either over the whole row)."""
    return NON_FINITE if math.isnan(logprob) else None


def cause(stage: str, e: BaseException) -> str:
    """``"<stage> failed: <exception text, shortened>"``, the message a failed request carries."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if len(text) > MAX_CAUSE_CHARS:
        text = text[:MAX_CAUSE_CHARS] + "..."
    return f"{stage} failed: {text}"
