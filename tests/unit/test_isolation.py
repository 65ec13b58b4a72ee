"""A request whose own work fails in a step fails alone, in that step, with an error naming the
cause, and its neighbours' tokens and logprobs are bitwise those they get alone: a logits
processor that raises, a grammar whose mask raises or allows nothing, a grammar that refuses the
sampled token, a detokenizer that raises, and a row of non-finite logits (a NaN or an infinity in
the request's own hidden state, through the real model). Without the isolation, the same poison
fails the whole step (the negative control). Also: a temperature below GREEDY_BELOW is greedy."""

from __future__ import annotations

import json

import pytest
import torch

from samebits.config import EngineConfig
from samebits.engine import isolation
from samebits.engine.engine import LLMEngine
from samebits.engine.logits_processor import LogitBias
from samebits.sampling_params import SamplingParams

CONFIG = {"architectures": ["LlamaForCausalLM"], "vocab_size": 512, "hidden_size": 64,
          "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-5,
          "max_position_embeddings": 256, "eos_token_id": 0, "tie_word_embeddings": False}
NAN_TOKEN, INF_TOKEN = 500, 501  # their embedding rows are poisoned
PLAIN = [([1 + i, 20 + 3 * i, 300 + i, 7], SamplingParams(max_tokens=5, temperature=0.9,
                                                          seed=10 + i, ignore_eos=True))
         for i in range(6)]


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> LLMEngine:
    """A small random model (no tokenizer: a poisoned request gets its broken grammar or
    detokenizer put in by hand)."""
    path = tmp_path_factory.mktemp("isolation")
    (path / "config.json").write_text(json.dumps(CONFIG))
    eng = LLMEngine(EngineConfig(str(path / "config.json"), load_format="dummy",
                                 num_kv_blocks=64))
    with torch.no_grad():
        eng.loaded.model.embed_tokens.weight[NAN_TOKEN] = float("nan")
        eng.loaded.model.embed_tokens.weight[INF_TOKEN] = float("inf")
    return eng


def _run(engine: LLMEngine, requests, poison=None) -> dict:
    """Run ``requests`` (and the poisoned one, added by ``poison(engine)``) together; the
    finished sequences by request id."""
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(f"plain-{i}", prompt, params)
    if poison is not None:
        poison(engine)
    done = {s.request_id: s for s in engine.run_to_completion()}
    assert not engine.has_unfinished() and engine.stats().kv_blocks_used == 0
    return done


@pytest.fixture(scope="module")
def solo(engine) -> list[tuple[list[int], list[float]]]:
    out = []
    for request in PLAIN:
        seq = _run(engine, [request])["plain-0"]
        out.append((seq.output_token_ids, seq.logprobs))
    return out


def _raising_bias(original):
    def apply(logits, seqs, rows):
        if any(seqs[i].request_id == "poison" for i in rows):
            raise RuntimeError("a logits processor broke")
        return original(logits, seqs, rows)
    return staticmethod(apply)


class _Grammar:
    """A request's grammar that breaks in one of the ways a real one could."""

    def __init__(self, how: str) -> None:
        self.how, self.terminated = how, False

    def fill(self, bitmask, row) -> None:
        if self.how == "fill":
            raise RuntimeError("the matcher broke")
        bitmask[row] = 0 if self.how == "empty" else -1

    def accept(self, token) -> None:
        raise RuntimeError(f"token {token} was sampled outside the grammar's mask")


def _with_grammar(how: str):
    def poison(engine):
        engine.add_request("poison", [5, 6, 7], SamplingParams(max_tokens=5, seed=3)).grammar = \
            _Grammar(how)
    return poison


class _Detokenizer:
    def push(self, token):
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")


def _with_broken_detokenizer(engine):
    engine.add_request("poison", [5, 6, 7], SamplingParams(max_tokens=5, seed=3)).detokenizer = \
        _Detokenizer()


def _with_prompt(token: int):
    def poison(engine):
        engine.add_request("poison", [5, token, 7], SamplingParams(max_tokens=5, seed=3))
    return poison


def _with_bias(engine):
    engine.add_request("poison", [5, 6, 7], SamplingParams(max_tokens=5, seed=3,
                                                           logit_bias={9: 5.0}))


POISONS = {  # kind: (poison, message, the request's own fault)
    "logits processor": (_with_bias, "logits processors failed: a logits processor broke", False),
    "grammar mask raises": (_with_grammar("fill"), "structured output failed: the matcher", False),
    "grammar mask empty": (_with_grammar("empty"), "allows no next token", True),
    "grammar refuses the token": (_with_grammar("accept"), "its output failed: token", False),
    "detokenizer": (_with_broken_detokenizer, "its output failed: 'utf-8' codec", False),
    "NaN logits": (_with_prompt(NAN_TOKEN), "not finite", False),
    "infinite logits": (_with_prompt(INF_TOKEN), "not finite", False),
}


@pytest.mark.parametrize("kind", list(POISONS))
def test_a_failing_request_fails_alone_and_neighbours_keep_their_solo_bits(engine, solo, kind,
                                                                           monkeypatch):
    poison, message, invalid_request = POISONS[kind]
    monkeypatch.setattr(LogitBias, "apply", _raising_bias(LogitBias.apply))
    done = _run(engine, PLAIN, poison)
    bad = done["poison"]
    assert bad.finish_reason == "error" and message in bad.error.message, bad.error
    assert bad.error.invalid_request is invalid_request
    for i, (tokens, logprobs) in enumerate(solo):
        seq = done[f"plain-{i}"]
        assert seq.finish_reason == "length" and seq.error is None
        assert seq.output_token_ids == tokens
        assert torch.equal(torch.tensor(seq.logprobs), torch.tensor(logprobs))


def test_without_isolation_the_same_poison_fails_the_whole_step(engine, monkeypatch):
    monkeypatch.setattr(LogitBias, "apply", _raising_bias(LogitBias.apply))
    monkeypatch.setattr(isolation, "processed_logits",
                        lambda logits, seqs, failed: isolation._process(logits, seqs))
    monkeypatch.setattr("samebits.engine.runner.processed_logits", isolation.processed_logits)
    with pytest.raises(isolation._StageError, match="a logits processor broke"):
        _run(engine, PLAIN, _with_bias)
    for rid in list(engine.requests):
        engine.abort(rid)


def test_temperature_below_greedy_below_is_greedy(engine):
    greedy = _run(engine, [([3, 4, 5], SamplingParams(max_tokens=5, temperature=0.0))])
    for t in (1e-45, 1e-30, 9e-6):
        tiny = _run(engine, [([3, 4, 5], SamplingParams(max_tokens=5, temperature=t, seed=1))])
        assert tiny["plain-0"].output_token_ids == greedy["plain-0"].output_token_ids
    assert SamplingParams(temperature=1e-5).greedy is False
