"""Fan-out: one request's prompt becomes ``num_candidates`` engine sequences, seeded, and the
chosen ``n`` come back. The one owner of the seed policy, for ``LLM`` and the server alike.

- A request's seed ``S`` is the one it gave, or one drawn once (``LLMEngine.draw_seed``, from the
  engine's ``seed``) and reported, so an unseeded answer can be replayed.
- Candidate ``i`` is sampled with ``choice_seed(S, i)`` = ``S + i`` modulo 2**63, so each choice
  replays alone with ``SamplingParams(seed=its seed)``.
- With ``best_of`` > ``n``, the ``n`` candidates with the highest cumulative logprob are returned
  (a stable sort: ties keep the lower candidate first), renumbered ``0 .. n - 1``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from samebits.outputs import CompletionOutput
from samebits.sampling_params import SEED_MODULUS, SamplingParams


def choice_seed(seed: int, index: int) -> int:
    """The seed of candidate ``index`` of a request seeded ``seed``: ``seed + index``, wrapped so
    it stays in [0, 2**63 - 1]."""
    return (seed + index) % SEED_MODULUS


def request_seed(params: SamplingParams, draw: Callable[[], int]) -> int:
    """The request's seed: its own, or one drawn (``draw`` is called only then)."""
    return params.seed if params.seed is not None else draw()


def candidates(params: SamplingParams, seed: int, count: int | None = None
               ) -> list[SamplingParams]:
    """The params of each candidate of one prompt (``count``, default ``num_candidates``):
    candidate i carries ``choice_seed(seed, i)``."""
    count = params.num_candidates if count is None else count
    return [replace(params, seed=choice_seed(seed, i)) for i in range(count)]


def seed_requests(params: list[SamplingParams], offsets: list[int], draw: Callable[[], int]
                  ) -> tuple[int, list[SamplingParams]]:
    """Seed a group of engine requests that share one request seed (several prompts of one HTTP
    request): request j is candidate ``offsets[j]`` of its prompt. Returns (the request seed,
    each request's seeded params); the seed is taken from the first request, or drawn once."""
    seed = request_seed(params[0], draw)
    return seed, [replace(p, seed=choice_seed(seed, i)) for p, i in zip(params, offsets,
                                                                         strict=True)]


def best(outputs: list[CompletionOutput], n: int) -> list[CompletionOutput]:
    """One prompt's returned choices: all of them when there are ``n``, else the ``n`` with the
    highest cumulative logprob (stable), numbered ``0 .. n - 1`` in that order."""
    chosen = outputs if len(outputs) <= n else sorted(
        outputs, key=lambda o: -o.cumulative_logprob)[:n]
    return [o if o.index == i else replace(o, index=i) for i, o in enumerate(chosen)]
