"""Sampling controls on CUDA with CUDA graphs: logit_bias, presence / frequency / repetition
penalties, min_tokens + stop_token_ids and xgrammar grammar masks. Each controlled request gets the
same bits (token ids and logprobs) alone -- run eagerly, batch of one -- as among mixed plain and
controlled neighbours in one batch whose decode steps replay CUDA graphs; its logprobs stay the raw
distribution's (== score). Negative control: the standard mode (cuBLAS + SDPA) differs alone vs
batched on the same requests.

The model is the dummy Qwen3-tiny (bf16) with a 256-token byte-level tokenizer written beside its
config (token id == byte value, EOS = 256), so grammars can be compiled against it."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from samebits import LLM, SamplingParams  # noqa: E402
from samebits.structured_outputs import StructuredOutputsParams  # noqa: E402
from tests.gpu.findings import record  # noqa: E402

CONFIG = Path(__file__).parents[2] / "benchmarks" / "configs" / "qwen3-tiny.json"
EOS = 256
REGEX = r"[0-9]{3}-[a-z]{2,6}"
rng = random.Random(0)
PROMPTS = [[rng.randrange(2, 256) for _ in range(n)] for n in (7, 40, 129, 300)]
GREEDY = dict(max_tokens=24, temperature=0.0, ignore_eos=True)
SAMPLED = dict(max_tokens=24, temperature=0.9, top_p=0.95, seed=5, ignore_eos=True)


def _requests(first_plain_token: int) -> dict[str, SamplingParams]:
    return {
        "plain": SamplingParams(**GREEDY),
        "presence": SamplingParams(**GREEDY, presence_penalty=2.0),
        "frequency": SamplingParams(**GREEDY, frequency_penalty=2.0),
        "repetition": SamplingParams(**GREEDY, repetition_penalty=2.0),
        "bias": SamplingParams(**GREEDY, logit_bias={65: 5.0, 66: 3.0}),
        "sampled": SamplingParams(**SAMPLED),
        "sampled_all": SamplingParams(**SAMPLED, logit_bias={first_plain_token: -100.0, 70: 8.0},
                                      repetition_penalty=1.2, presence_penalty=1.0,
                                      frequency_penalty=-0.5),
        "stop_id": SamplingParams(max_tokens=24, temperature=0.0,
                                  stop_token_ids=[first_plain_token]),
        "stop_id_min": SamplingParams(max_tokens=24, temperature=0.0, min_tokens=12,
                                      stop_token_ids=[first_plain_token]),
    }


GRAMMARS = {
    "regex": SamplingParams(max_tokens=24, temperature=0.0,
                            structured_outputs=StructuredOutputsParams(regex=REGEX)),
    "choice": SamplingParams(max_tokens=24, temperature=0.7, seed=3,
                             structured_outputs=StructuredOutputsParams(choice=["alpha", "beta"])),
    "json": SamplingParams(max_tokens=40, temperature=1.0, seed=9, structured_outputs=(
        StructuredOutputsParams(json={"type": "object", "properties": {"n": {"type": "integer"}},
                                      "required": ["n"]}))),
}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the ByteLevel alphabet)."""
    bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    cs, n = list(bs), 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    tokenizers = pytest.importorskip("tokenizers")
    out = tmp_path_factory.mktemp("qwen3_tiny_bytes")
    cfg = json.loads(CONFIG.read_text())
    cfg["eos_token_id"] = EOS
    (out / "config.json").write_text(json.dumps(cfg))
    vocab = {c: b for b, c in _bytes_to_unicode().items()}
    vocab["<eos>"] = EOS
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                            use_regex=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.add_special_tokens(["<eos>"])
    tok.save(str(out / "tokenizer.json"))
    return out


def _llm(model_dir: Path, **kwargs) -> LLM:
    kwargs.setdefault("kv_cache_memory_bytes", 1 << 28)  # leave the GPU to parallel test workers
    return LLM(str(model_dir), load_format="dummy", device="cuda", dtype="bfloat16", seed=0,
               max_model_len=1024, **kwargs)


Run = dict[tuple[int, str], tuple[list[int], list[float]]]


def _run(llm: LLM, keys: list[tuple[int, str]], params: dict[str, SamplingParams]) -> Run:
    outs = llm.generate([PROMPTS[p] for p, _ in keys], [params[n] for _, n in keys])
    return {k: (o.outputs[0].token_ids, o.outputs[0].token_logprobs)
            for k, o in zip(keys, outs, strict=True)}


def _alone(llm: LLM, keys, params) -> Run:
    return {k: _run(llm, [k], params)[k] for k in keys}


@pytest.fixture(scope="module")
def eager(model_dir) -> LLM:
    """The reference: one request at a time, no CUDA graphs."""
    return _llm(model_dir, max_num_seqs=1, enforce_eager=True)


@pytest.fixture(scope="module")
def params(eager) -> dict[str, SamplingParams]:
    first = eager.generate([PROMPTS[0]], SamplingParams(**GREEDY))[0].outputs[0].token_ids[0]
    return _requests(first)


def _keys(names) -> list[tuple[int, str]]:
    return [(p, n) for p in range(len(PROMPTS)) for n in names]


@pytest.fixture(scope="module")
def batched(model_dir, params) -> tuple[LLM, Run]:
    llm = _llm(model_dir, max_num_seqs=64)
    keys = _keys(params)[::-1]  # neither the order nor the neighbours may matter
    got = _run(llm, keys, params)
    assert len(llm.engine.runner.graphs.graphs) > 0
    return llm, got


def test_gpu_each_control_changes_the_answer(batched, params):
    _, got = batched
    for p in range(len(PROMPTS)):
        for name in ("repetition", "bias"):
            assert got[p, name][0] != got[p, "plain"][0], (p, name)
        assert got[p, "sampled_all"][0] != got[p, "sampled"][0]
    for name in ("presence", "frequency"):  # these act once the answer repeats a token
        assert any(got[p, name][0] != got[p, "plain"][0] for p in range(len(PROMPTS))), name
    first = params["stop_id"].stop_token_ids[0]
    assert got[0, "stop_id"][0] == [first]  # stops on its first token
    held = got[0, "stop_id_min"][0]
    assert len(held) >= 12 and first not in held[:12]  # held back for min_tokens


def test_gpu_controlled_requests_bitwise_equal_alone_eager_and_in_mixed_graph_batch(
        eager, batched, params):
    _, got = batched
    alone = _alone(eager, list(got), params)
    assert [k for k in got if alone[k] != got[k]] == []


def test_gpu_controlled_logprobs_stay_those_of_the_raw_distribution(batched):
    llm, got = batched
    keys = [(p, n) for p, n in got if n in ("presence", "repetition", "bias", "sampled_all")]
    scored = llm.score([PROMPTS[p] + got[p, n][0] for p, n in keys])
    for (p, n), s in zip(keys, scored, strict=True):
        assert s[len(PROMPTS[p]) - 1:] == got[p, n][1], (p, n)


def test_gpu_negative_control_standard_mode_differs_alone_vs_batched(model_dir, params):
    names = ["plain", "bias", "sampled_all"]
    keys = _keys(params)[::-1]
    batched = _run(_llm(model_dir, max_num_seqs=64, batch_invariant=False), keys, params)
    alone = _alone(_llm(model_dir, max_num_seqs=1, batch_invariant=False, enforce_eager=True),
                   [k for k in keys if k[1] in names], params)
    differing = [k for k in alone if alone[k] != batched[k]]
    record("features_standard_alone_vs_batch", differing=len(differing), of=len(alone))
    assert differing != []


def test_gpu_grammar_masked_requests_bitwise_equal_alone_and_among_neighbours(model_dir, eager,
                                                                             params):
    pytest.importorskip("xgrammar", reason="xgrammar is not installed on this machine")
    every = {**params, **GRAMMARS}
    keys = _keys(every)[::-1]
    llm = _llm(model_dir, max_num_seqs=64)
    got = _run(llm, keys, every)
    for p in range(len(PROMPTS)):
        text = bytes(got[p, "regex"][0][:-1] if got[p, "regex"][0][-1] == EOS
                     else got[p, "regex"][0]).decode()
        assert re.fullmatch(REGEX, text), text
        choice = bytes(t for t in got[p, "choice"][0] if t != EOS).decode()
        assert choice in ("alpha", "beta")
        body = bytes(t for t in got[p, "json"][0] if t != EOS).decode()
        assert body.startswith('{"n": ')
    grammar_keys = [k for k in keys if k[1] in GRAMMARS]
    alone = _alone(eager, grammar_keys, every)
    assert [k for k in grammar_keys if alone[k] != got[k]] == []
    scored = llm.score([PROMPTS[p] + got[p, n][0] for p, n in grammar_keys])
    for (p, n), s in zip(grammar_keys, scored, strict=True):
        assert s[len(PROMPTS[p]) - 1:] == got[p, n][1], (p, n)
