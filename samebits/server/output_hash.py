"""The output hash: one hex digest of what a generation returned, comparable across replicas, time
and servers (``X-Samebits-Output-Hash``, the determinism canary, ``samebits verify``).

Definition (stable; clients may recompute it): sha256 over the choices in index order; for each
choice, its token count as a little-endian uint64, then its token ids as little-endian int64, then
the fp32 bit pattern of each token's logprob, little-endian. Two outputs hash alike exactly when
every choice has the same tokens and bitwise the same logprobs.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Sequence

HEADER = "X-Samebits-Output-Hash"


def output_hash(choices: Iterable[tuple[Sequence[int], Sequence[float]]]) -> str:
    """The hash of ``(token_ids, logprobs)`` per choice, in choice order."""
    h = hashlib.sha256()
    for token_ids, logprobs in choices:
        n = len(token_ids)
        if len(logprobs) != n:
            raise ValueError(f"{n} token ids but {len(logprobs)} logprobs")
        h.update(struct.pack(f"<Q{n}q{n}f", n, *token_ids, *logprobs))
    return h.hexdigest()
