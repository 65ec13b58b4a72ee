"""The engine core in-process (a small random Llama, no HTTP): what it hands back is exactly what
the engine computed -- a streamed request a delta per step (its prompt logprobs on the first), any
other one delta at the end -- admission is all or nothing, an abort frees everything, and the
counts the metrics read add up."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest

from samebits import LLM
from samebits.config import EngineConfig
from samebits.engine.engine import LLMEngine
from samebits.sampling_params import SamplingParams
from samebits.server.core_messages import Abort, AddGroup, Admitted, CoreOutputs, Delta, Stop
from samebits.server.engine_core import EngineCore
from tests.tiny_models import TINY_LLAMA_CONFIG, write_config

SAMPLED = SamplingParams(max_tokens=6, temperature=0.9, seed=4, ignore_eos=True, logprobs=2)
GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> EngineConfig:
    path = write_config(tmp_path_factory.mktemp("core"), TINY_LLAMA_CONFIG)
    return EngineConfig(str(path), load_format="dummy", num_kv_blocks=32)


class ScriptedInbox:
    """The commands, in order; when the core would wait for more, it is told to stop."""

    def __init__(self, commands: list) -> None:
        self.commands = list(commands)

    def get(self, block: bool):
        if self.commands:
            return self.commands.pop(0)
        return Stop() if block else None

    def pending(self) -> bool:
        return bool(self.commands)


def _group(group_id: int, prompts: list[list[int]], params: SamplingParams, stream: bool,
           n: int = 1) -> AddGroup:
    ids = [f"g{group_id}-{p}-{i}" for p in range(len(prompts)) for i in range(n)]
    return AddGroup(group_id, ids, [q for q in prompts for _ in range(n)], [params] * len(ids),
                    [i for _ in prompts for i in range(n)], stream, None, False, 0.0)


def _run(engine: LLMEngine, commands: list) -> list[CoreOutputs]:
    outs: list[CoreOutputs] = []
    EngineCore(engine).run(ScriptedInbox(commands), outs.append)
    return outs


def _deltas(outs: list[CoreOutputs]) -> dict[str, list[Delta]]:
    """Each request's deltas in order (its progress rows as deltas, then its last one)."""
    by_id: dict[str, list[Delta]] = {}
    for out in outs:
        for request_id, token_ids, logprobs, top, text, prompt_lps in out.tokens:
            by_id.setdefault(request_id, []).append(Delta(-1, token_ids, logprobs, top, text=text,
                                                          prompt_logprobs=prompt_lps))
        for request_id, delta in out.last:
            by_id.setdefault(request_id, []).append(delta)
    return by_id


def test_core_hands_back_the_engines_bits_per_step_when_streamed_else_once(config):
    streamed = _group(0, [[5, 6, 7, 8]], SAMPLED, stream=True)
    whole = _group(1, [[9] * 12], GREEDY, stream=False, n=2)
    outs = _run(LLMEngine(config), [streamed, whole])
    replies = [r for o in outs for r in o.replies]
    assert [(r.group_id, r.error) for r in replies] == [(0, None), (1, None)]
    deltas = _deltas(outs)
    steps = deltas["g0-0-0"]
    assert [len(d.token_ids) for d in steps] == [1] * 6  # one token per step, none held back
    assert [d.output is None for d in steps] == [True] * 5 + [False]
    assert [len(deltas[r]) for r in ("g1-0-0", "g1-0-1")] == [1, 1]  # only the result
    offline = LLM(**vars(config)).generate(  # the same requests in the same batches
        [[5, 6, 7, 8], [9] * 12], [SAMPLED, replace(GREEDY, n=2, seed=replies[1].seeds[0])])
    expected = [offline[0].outputs[0], *offline[1].outputs]
    got = [steps[-1].output, deltas["g1-0-0"][0].output, deltas["g1-0-1"][0].output]
    for g, e in zip(got, expected, strict=True):
        assert (g.token_ids, g.token_logprobs, g.top_logprobs, g.seed) == \
            (e.token_ids, e.token_logprobs, e.top_logprobs, e.seed)
    assert [t for d in steps for t in d.token_ids] == got[0].token_ids
    assert [x for d in steps for x in d.logprobs] == got[0].token_logprobs
    stats = [o.stats for o in outs]
    assert sum(s.dequeued for s in stats) == 3
    assert sum(s.generation_tokens for s in stats) == 6 + 5 + 5
    assert sum(s.prompt_tokens for s in stats) == 4 + 12 + 12
    assert sum((s.finished for s in stats), Counter()) == Counter(length=3)
    assert len([x for s in stats for x in s.ttft]) == 3
    assert stats[-1].running == stats[-1].waiting == stats[-1].kv_blocks_used == 0


def test_core_sends_a_streamed_requests_prompt_logprobs_with_its_first_tokens(config):
    params = replace(GREEDY, prompt_logprobs=2)
    outs = _run(LLMEngine(config), [_group(0, [[5, 6, 7, 8, 9]], params, stream=True)])
    steps = _deltas(outs)["g0-0-0"]
    assert len(steps) == 5 and len(steps[0].token_ids) == 1  # before any other token
    assert steps[0].prompt_logprobs is not None and len(steps[0].prompt_logprobs) == 5
    assert all(d.prompt_logprobs is None for d in steps[1:-1])
    assert steps[0].prompt_logprobs == steps[-1].prompt_logprobs  # the result's, exactly
    offline = LLM(**vars(config)).generate([[5, 6, 7, 8, 9]], params)[0]
    assert steps[0].prompt_logprobs == offline.prompt_logprobs


def test_core_refuses_a_group_whole_and_goes_on_serving(config):
    engine = LLMEngine(config)
    bad = _group(0, [[5, 6, 7], [5, 300]], GREEDY, stream=False)  # 300 is outside the vocab
    good = _group(1, [[5, 6, 7]], GREEDY, stream=False)
    outs = _run(engine, [bad, good])
    refused, admitted = (r for o in outs for r in o.replies)
    assert isinstance(refused, Admitted) and isinstance(refused.error, ValueError)
    assert "vocab" in str(refused.error) or "[0, 300)" in str(refused.error)
    assert refused.seeds is None and admitted.error is None
    assert set(_deltas(outs)) == {"g1-0-0"}
    assert sum(o.stats.dequeued for o in outs) == 3
    assert not engine.has_unfinished() and engine.stats().kv_blocks_used == 0


def test_core_abort_frees_the_request_and_sends_nothing_for_it(config):
    engine = LLMEngine(config)
    gone = _group(0, [[5, 6, 7, 8] * 4], GREEDY, stream=True)
    kept = _group(1, [[7, 8]], GREEDY, stream=True)
    outs = _run(engine, [gone, kept, Abort(gone.request_ids + ["unknown-id"])])
    assert set(_deltas(outs)) == {"g1-0-0"}
    finished = sum((o.stats.finished for o in outs), Counter())
    assert finished == Counter(abort=1, length=1)
    assert sum(o.stats.dequeued for o in outs) == 2
    assert not engine.has_unfinished() and engine.stats().kv_blocks_used == 0
