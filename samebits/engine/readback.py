"""Reading a step's results back to the host: the sampled tokens, their logprobs and the asked
top-k in one device-to-host copy queued behind the step (``start_read``), and the per-row views
of what came back. Nothing here computes a value: it only moves and splits them."""

from __future__ import annotations

from collections.abc import Callable

import torch

from samebits.engine.transfer import to_host_later


def start_read(tokens: torch.Tensor, logprobs: torch.Tensor, extra: list[torch.Tensor] = ()
                ) -> Callable[[], tuple[list[int], list[float], list[list[float]]]]:
    """Queue the copy to the host of token ids [B] (negative ids read as such), each row's
    logprob of its token and the 1-D ``extra`` tensors, in one transfer (ints < 2**53 and fp32
    values are exact in fp64); the returned function waits for it and gives (ids, logprobs,
    each extra as a list). Work queued after it (a step launched ahead) does not delay the read
    (``to_host_later``)."""
    chosen = logprobs.gather(1, tokens.clamp(min=0)[:, None])[:, 0]
    parts = [tokens, chosen, *extra]
    read = to_host_later(torch.cat([t.double() for t in parts]))
    sizes = [t.numel() for t in parts]
    return lambda: _split(read(), sizes)


def read_tokens(tokens: torch.Tensor, logprobs: torch.Tensor) -> tuple[list[int], list[float]]:
    return start_read(tokens, logprobs)()[:2]


def _split(values: list[float], sizes: list[int]) -> tuple[list[int], list[float],
                                                          list[list[float]]]:
    parts, start = [], 0
    for n in sizes:
        parts.append(values[start:start + n])
        start += n
    return [int(t) for t in parts[0]], parts[1], parts[2:]


def top_of(values: list[float], ids: list[float]) -> dict[int, float]:
    """A row's ``topk`` as read: the k most likely tokens and their logprobs (OpenAI's
    top_logprobs)."""
    return dict(zip((int(i) for i in ids), values, strict=True))


def row_top(row: torch.Tensor, k: int) -> dict[int, float]:
    if not k:
        return {}
    values, ids = row.topk(k)
    return top_of(values.tolist(), ids.tolist())


def ranks_of(logprobs: torch.Tensor, values: list[float], wanted: list[bool]) -> list[int | None]:
    """Each wanted row's rank of its sampled token: how many tokens have a logprob >= its own
    (exact: ``values`` are the row's fp32 values), read in one transfer; None elsewhere."""
    rows = [i for i, w in enumerate(wanted) if w]
    if not rows:
        return [None] * len(wanted)
    index = torch.tensor(rows, device=logprobs.device)
    chosen = torch.tensor([values[i] for i in rows], dtype=logprobs.dtype, device=logprobs.device)
    counts = iter((logprobs[index] >= chosen[:, None]).sum(dim=1).tolist())
    return [next(counts) if w else None for w in wanted]
