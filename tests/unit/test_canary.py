"""The canary's replay, in-process: a replay interrupted by new work is parked (out of the
scheduler, KV kept) and resumed alone later, and still matches what was served; a corrupted served
hash is counted as a mismatch."""

from __future__ import annotations

import pytest

from samebits.config import EngineConfig
from samebits.engine.engine import LLMEngine
from samebits.sampling_params import SamplingParams
from samebits.server.canary import Canary
from samebits.server.metrics import Metrics
from samebits.server.output_hash import output_hash
from tests.tiny_models import TINY_LLAMA_CONFIG, write_config

PARAMS = SamplingParams(max_tokens=6, temperature=0.9, seed=4, ignore_eos=True)


@pytest.fixture()
def engine(tmp_path) -> LLMEngine:
    path = write_config(tmp_path, TINY_LLAMA_CONFIG)
    return LLMEngine(EngineConfig(str(path), load_format="dummy", num_kv_blocks=32))


def _served(engine: LLMEngine, rid: str, prompt: list[int]):
    """Serve ``prompt`` beside two other requests; the finished sequence."""
    seq = engine.add_request(rid, prompt, PARAMS)
    for i, other in enumerate(([5, 6, 7, 8], [9] * 12)):
        engine.add_request(f"{rid}-n{i}", other, PARAMS)
    done = {s.request_id: s for s in engine.run_to_completion()}
    assert done[rid] is seq
    return seq


def test_parked_replay_resumes_alone_and_matches(engine):
    canary = Canary(1.0, Metrics("m", "fp", True))
    canary.offer(_served(engine, "r1", [1, 2, 3]))
    calls = iter([False, False, True])
    canary.replay(engine, busy=lambda: next(calls, True))  # two steps, then work arrives
    assert canary.parked and not engine.has_unfinished()
    other = engine.add_request("late", [4, 4, 4], PARAMS)  # served while the replay is parked
    assert other.request_id in {s.request_id for s in engine.run_to_completion()}
    canary.replay(engine, busy=lambda: False)
    assert not canary.pending
    assert canary.metrics.canary_checks._value.get() == 1
    assert canary.metrics.canary_mismatches._value.get() == 0


def test_a_served_hash_that_differs_is_a_mismatch(engine):
    canary = Canary(1.0, Metrics("m", "fp", True))
    seq = _served(engine, "r2", [1, 2, 3])
    seq.logprobs[-1] = seq.logprobs[-1] / 2  # what a batch-dependent kernel could have served
    canary.offer(seq)
    assert canary._pending[0].expected == output_hash([(seq.output_token_ids, seq.logprobs)])
    canary.replay(engine, busy=lambda: False)
    assert canary.metrics.canary_mismatches._value.get() == 1


def test_engine_park_keeps_blocks_and_progress_abort_frees_them(engine):
    """The engine API the canary uses: a parked request is not scheduled nor counted, keeps its
    KV blocks, resumes to the bits it would have had, and abort of a parked one frees them."""
    want = _served(engine, "r0", [1, 2, 3])
    seq = engine.add_request("r1", [1, 2, 3], PARAMS)
    engine.step()
    engine.step()
    engine.park("r1")
    used = engine.stats().kv_blocks_used
    assert not engine.has_unfinished() and used > 0 and engine.step() == []
    engine.add_request("r2", [4, 5], PARAMS)
    assert engine.parked_blocks_needed()  # nothing runs, r2 waits: the parked blocks may block
    engine.step()
    assert not engine.parked_blocks_needed()  # r2 runs beside the parked r1
    list(engine.run_to_completion())
    engine.unpark("r1")
    list(engine.run_to_completion())
    assert (seq.output_token_ids, seq.logprobs) == (want.output_token_ids, want.logprobs)
    engine.add_request("r3", [1, 2, 3], PARAMS)
    engine.step()
    engine.park("r3")
    engine.abort("r3")
    assert engine.stats().kv_blocks_used == 0 and not engine.has_unfinished()


def test_bypass_prefix_cache_neither_reads_nor_fills_the_cache(engine):
    """A replay's request skips cached blocks another request filled, and fills none itself;
    a plain request of the same prompt then hits what the first one cached."""
    prompt = list(range(1, 41))  # several full blocks
    _served(engine, "a", prompt)
    replay = engine.add_request("b", prompt, PARAMS, bypass_prefix_cache=True)
    list(engine.run_to_completion())
    assert replay.num_cached_tokens == 0
    fresh = engine.add_request("c", list(range(50, 90)), PARAMS, bypass_prefix_cache=True)
    list(engine.run_to_completion())
    again = engine.add_request("d", list(range(50, 90)), PARAMS)
    list(engine.run_to_completion())
    assert fresh.num_cached_tokens == 0 and again.num_cached_tokens == 0
    hit = engine.add_request("e", prompt, PARAMS)
    list(engine.run_to_completion())
    assert hit.num_cached_tokens > 0
    assert (replay.output_token_ids, replay.logprobs) == (hit.output_token_ids, hit.logprobs)
