"""``POST /v1/embeddings`` through real ``samebits serve`` processes and the official client.

32 texts of 3 to ~256 tokens: each vector is bitwise the same sent alone, sent beside the 31
others as concurrent requests (which the engine embeds together), inside one request in shuffled
order (in fewer engine steps than texts), and from the offline ``LLM(task="embed")`` -- exact
float equality through JSON and base64. The negative control runs the alone-vs-one-request check
on a ``--standard`` server (stock ops on padded batches), where some bits must change. Plus bad
input, the generation endpoints of an embedding server, metrics, an embedding model served beside
a generation model, and the embedding engine loop in process (slicing, abandon, a failed step).
"""

from __future__ import annotations

import asyncio
import base64
import json
import random
import time

import httpx
import numpy as np
import openai
import pytest

from samebits import LLM
from samebits.config import EngineConfig
from samebits.engine.engine import LLMEngine
from samebits.engine.pooling import embedding_inputs
from samebits.pooling_params import PoolingParams
from samebits.server.embeddings import EmbeddingContext, embed_ids
from samebits.server.errors import APIError
from samebits.server.metrics import Metrics
from tests.server.conftest import API_KEY, start_server
from tests.tiny_models import TINY_BERT_CONFIG, write_config

EMBED = "all-MiniLM-L6-v2"
GEN = "SmolLM2-135M-Instruct"
WORDS = ("alpha river stone quickly seven blue market engine whisper under the of a to and "
         "reproducible inference batch vector cannot 2025 naïve café über ++ -- (x) {y}").split()
WORD_COUNTS = [1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 170, 190, 4, 60, 1, 2, 7, 17, 40, 99, 180,
               11, 6, 3, 120, 160, 9, 25, 70, 2, 150]


def _text(i: int) -> str:
    rng = random.Random(1000 + i)
    return " ".join(rng.choice(WORDS) for _ in range(WORD_COUNTS[i]))


TEXTS = [_text(i) for i in range(32)]


@pytest.fixture(scope="module")
def embed_server():
    yield from start_server("--task", "embed", api_key=API_KEY, max_model_len=None)


@pytest.fixture(scope="module")
def standard_embed_server():
    yield from start_server("--task", "embed", "--standard", max_model_len=None)


@pytest.fixture(scope="module")
def both_server():
    yield from start_server("--embed-model", "DEFAULT")


@pytest.fixture(scope="module")
def offline() -> LLM:
    return LLM(task="embed")


def _alone(client: openai.OpenAI, texts: list[str]) -> list[list[float]]:
    return [client.embeddings.create(model=EMBED, input=t, encoding_format="float"
                                     ).data[0].embedding for t in texts]


def _one_request_shuffled(client: openai.OpenAI, texts: list[str]) -> list[list[float]]:
    order = list(range(len(texts)))
    random.Random(7).shuffle(order)
    out = client.embeddings.create(model=EMBED, input=[texts[i] for i in order],
                                   encoding_format="float")
    assert [d.index for d in out.data] == list(range(len(texts)))
    vectors: list[list[float]] = [[]] * len(texts)
    for d, i in zip(out.data, order, strict=True):
        vectors[i] = d.embedding
    return vectors


def _concurrent(client: openai.AsyncOpenAI, texts: list[str], limit: int = 16
                ) -> list[list[float]]:
    async def run() -> list[list[float]]:
        gate = asyncio.Semaphore(limit)

        async def one(text: str) -> list[float]:
            async with gate:
                out = await client.embeddings.create(model=EMBED, input=text,
                                                     encoding_format="float")
                return out.data[0].embedding

        async with client:
            return await asyncio.wait_for(asyncio.gather(*(one(t) for t in texts)), 300)
    return asyncio.run(run())


def test_vectors_are_bitwise_independent_of_the_batch_and_equal_offline(embed_server, offline):
    lens = [len(ids) for ids in embedding_inputs(offline.engine.loaded).tokenize(TEXTS)]
    assert min(lens) <= 4 and 200 <= max(lens) <= 256  # very different lengths, all in the limit
    tokens_before = embed_server.metric("samebits_embedding_tokens_total")
    calls_before = embed_server.metric("samebits_embedding_batch_size_count")
    client = embed_server.client()
    together = _concurrent(embed_server.async_client(), TEXTS)
    calls = embed_server.metric("samebits_embedding_batch_size_count") - calls_before
    assert calls < 32, "concurrent requests should have been embedded together"
    alone = _alone(client, TEXTS)
    steps_before = embed_server.metric("samebits_embedding_batch_size_count")
    one_request = _one_request_shuffled(client, TEXTS)
    steps = embed_server.metric("samebits_embedding_batch_size_count") - steps_before
    assert steps <= 3, f"32 texts of one request took {steps} engine steps"  # ~2600 tokens
    reference = [offline.embed([t])[0].outputs.embedding for t in TEXTS]
    assert len(reference[0]) == 384
    for name, got in [("concurrent", together), ("one request", one_request),
                      ("offline", reference)]:
        bad = [i for i in range(32) if got[i] != alone[i]]
        assert not bad, f"{name}: texts {bad} differ from the same text sent alone"
    assert (embed_server.metric("samebits_embedding_tokens_total") - tokens_before
            == 3 * sum(lens))


def test_negative_control_standard_server_changes_bits(standard_embed_server):
    client = standard_embed_server.client()
    alone, one_request = _alone(client, TEXTS), _one_request_shuffled(client, TEXTS)
    changed = [i for i in range(32) if one_request[i] != alone[i]]
    assert changed, "stock ops on padded batches never changed a bit: the test proves nothing"
    assert np.abs(np.array(one_request) - np.array(alone)).max() < 1e-5  # close, not equal


def _decode(b64: str) -> list[float]:
    return np.frombuffer(base64.b64decode(b64), dtype="<f4").astype(np.float64).tolist()


def test_base64_and_float_encodings_give_the_same_floats(embed_server, offline):
    client, texts = embed_server.client(), TEXTS[:3]
    floats = [d.embedding for d in client.embeddings.create(
        model=EMBED, input=texts, encoding_format="float").data]
    # without encoding_format the client asks for base64 and decodes it to floats itself
    default = client.embeddings.create(model=EMBED, input=texts)
    assert [d.embedding for d in default.data] == floats
    # asked for explicitly, the client hands back the base64 string
    raw = client.embeddings.create(model=EMBED, input=texts, encoding_format="base64")
    assert all(isinstance(d.embedding, str) for d in raw.data)
    want = [o.outputs.embedding for o in offline.embed(texts)]
    assert [_decode(d.embedding) for d in raw.data] == floats == want
    assert raw.system_fingerprint == offline.fingerprint == default.system_fingerprint


def test_response_shape_usage_and_token_id_inputs(embed_server, offline):
    ids = embedding_inputs(offline.engine.loaded).tokenize(["hello world", "a second text"])
    body = dict(model=EMBED, input=ids, user="someone", dimensions=384)
    r = httpx.post(f"{embed_server.url}/v1/embeddings", json=body, headers=embed_server.headers,
                   timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    assert set(out) == {"object", "data", "model", "usage", "system_fingerprint"}
    assert (out["object"], out["model"]) == ("list", EMBED)
    n = len(ids[0]) + len(ids[1])
    assert out["usage"] == {"prompt_tokens": n, "total_tokens": n}
    assert [(d["object"], d["index"]) for d in out["data"]] == [("embedding", 0), ("embedding", 1)]
    want = [o.outputs.embedding for o in offline.embed(["hello world", "a second text"])]
    assert [d["embedding"] for d in out["data"]] == want
    one = embed_server.client().embeddings.create(model=EMBED, input=ids[0],
                                                  encoding_format="float")
    assert one.data[0].embedding == out["data"][0]["embedding"]  # a flat id list is one input


def test_truncate_extension(embed_server, offline):
    long = " ".join(["word"] * 600)
    client = embed_server.client()
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=EMBED, input=long)
    assert "256" in e.value.body["message"] and e.value.body["param"] == "input"
    assert e.value.body["code"] == "context_length_exceeded"
    out = client.embeddings.create(model=EMBED, input=long, encoding_format="float",
                                   extra_body={"truncate": True})
    assert out.usage.prompt_tokens == 256  # sentence_bert_config.json's max_seq_length
    assert out.data[0].embedding == offline.embed([long], truncate=True)[0].outputs.embedding
    vllm = client.embeddings.create(model=EMBED, input=long, encoding_format="float",
                                    extra_body={"truncate_prompt_tokens": -1})
    assert vllm.data[0].embedding == out.data[0].embedding
    short = client.embeddings.create(model=EMBED, input=long, encoding_format="float",
                                     extra_body={"truncate_prompt_tokens": 100})
    assert short.usage.prompt_tokens == 100
    assert short.data[0].embedding == offline.embed([long], truncate=100)[0].outputs.embedding


def _j(**body) -> bytes:
    return json.dumps(body).encode()


BAD = [  # (id, raw body, status, param)
    ("empty-string", _j(model=EMBED, input=""), 400, "input"),
    ("empty-string-in-list", _j(model=EMBED, input=["ok", ""]), 400, "input"),
    ("empty-list", _j(model=EMBED, input=[]), 400, "input"),
    ("empty-id-list", _j(model=EMBED, input=[[101, 102], []]), 400, "input"),
    ("int", _j(model=EMBED, input=5), 400, "input"),
    ("dict", _j(model=EMBED, input={"text": "hi"}), 400, "input"),
    ("null", _j(model=EMBED, input=None), 400, "input"),
    ("nested-mixed", _j(model=EMBED, input=["hi", [101, 102]]), 400, "input"),
    ("ids-then-text", _j(model=EMBED, input=[101, "hi"]), 400, "input"),
    ("float-ids", _j(model=EMBED, input=[[101, 1.5]]), 400, "input"),
    ("too-deep", _j(model=EMBED, input=[[[101]]]), 400, "input"),
    ("id-negative", _j(model=EMBED, input=[101, -1, 102]), 400, "input"),
    ("id-out-of-vocab", _j(model=EMBED, input=[[101, 30522, 102]]), 400, "input"),
    ("over-256-tokens", _j(model=EMBED, input=["short", "word " * 300]), 400, "input"),
    ("over-256-ids", _j(model=EMBED, input=[1000] * 257), 400, "input"),
    ("truncate-prompt-tokens-over-limit", _j(model=EMBED, input="hi", truncate_prompt_tokens=257),
     400, "truncate_prompt_tokens"),
    ("too-many-inputs", _j(model=EMBED, input=["a"] * 2049), 400, "input"),
    ("missing-input", _j(model=EMBED), 400, "input"),
    ("unknown-model", _j(model="text-embedding-3-small", input="hi"), 404, "model"),
    ("bad-encoding-format", _j(model=EMBED, input="hi", encoding_format="hex"), 400,
     "encoding_format"),
    ("dimensions-unsupported", _j(model=EMBED, input="hi", dimensions=256), 400, "dimensions"),
    ("dimensions-zero", _j(model=EMBED, input="hi", dimensions=0), 400, "dimensions"),
    ("truncate-string", _j(model=EMBED, input="hi", truncate="yes"), 400, "truncate"),
    ("malformed-json", b'{"input": "hi", ', 400, None),
    ("invalid-utf8", b'{"input": "\xff\xfe hi"}', 400, None),
    ("lone-surrogate", b'{"input": ["ok", "\\ud800"]}', 400, None),  # refused by the parser
]


@pytest.mark.parametrize("body,status,param", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_gets_openai_error(embed_server, body, status, param):
    headers = {**embed_server.headers, "Content-Type": "application/json"}
    r = httpx.post(f"{embed_server.url}/v1/embeddings", content=body, headers=headers,
                   timeout=60)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param


def test_server_survives_bad_input_and_counts_it(embed_server):
    before = embed_server.metric("samebits_embedding_requests_total", status="400")
    for _, body, _, _ in BAD:
        httpx.post(f"{embed_server.url}/v1/embeddings", content=body, timeout=60,
                   headers={**embed_server.headers, "Content-Type": "application/json"})
    assert httpx.get(f"{embed_server.url}/health", timeout=30).status_code == 200
    out = embed_server.client().embeddings.create(model=EMBED, input="still here")
    assert len(out.data[0].embedding) == 384
    bad_requests = sum(status == 400 for _, _, status, _ in BAD)
    assert embed_server.metric("samebits_embedding_requests_total", status="400") >= (
        before + bad_requests)
    assert embed_server.metric("samebits_embedding_requests_total", status="200") > 0
    assert embed_server.metric("samebits_embedding_inputs_total") > 0
    assert embed_server.metric("samebits_embedding_batch_size_count") > 0
    r = httpx.post(f"{embed_server.url}/v1/embeddings", json={"input": "hi"}, timeout=30)
    assert r.status_code == 401  # behind the API key like the rest of /v1


def test_embedding_server_refuses_generation_and_lists_its_model(embed_server):
    client = embed_server.client()
    with pytest.raises(openai.BadRequestError, match="embedding model"):
        client.completions.create(model=EMBED, prompt="hi")
    with pytest.raises(openai.BadRequestError, match="embedding model"):
        client.chat.completions.create(model=EMBED, messages=[{"role": "user", "content": "hi"}])
    r = httpx.post(f"{embed_server.url}/v1/completions", json={"prompt": "hi"},
                   headers=embed_server.headers, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_supported"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model=GEN, prompt="hi")
    models = client.models.list().data
    assert [(m.id, m.model_extra["task"], m.model_extra["max_model_len"]) for m in models] == [
        (EMBED, "embed", 256)]
    health = httpx.get(f"{embed_server.url}/health", timeout=30).json()
    assert health["system_fingerprint"] == models[0].model_extra["system_fingerprint"]


def test_embeddings_beside_a_generation_model(both_server, offline):
    client = both_server.client()
    models = {m.id: m.model_extra for m in client.models.list().data}
    assert set(models) == {GEN, EMBED}
    assert (models[GEN]["task"], models[EMBED]["task"]) == ("generate", "embed")
    assert models[EMBED]["system_fingerprint"] == offline.fingerprint

    async def mixed() -> tuple[list, list]:
        aclient = both_server.async_client()
        async with aclient:
            gens = [aclient.completions.create(model=GEN, prompt=f"Count to {i}:", max_tokens=8,
                                               seed=i) for i in range(4)]
            embs = [aclient.embeddings.create(model=EMBED, input=t, encoding_format="float")
                    for t in TEXTS[:8]]
            done = await asyncio.gather(*gens, *embs)
        return done[:4], done[4:]

    gens, embs = asyncio.run(mixed())
    assert [e.data[0].embedding for e in embs] == [offline.embed([t])[0].outputs.embedding for t in TEXTS[:8]]
    assert {e.system_fingerprint for e in embs} == {offline.fingerprint}
    assert {g.system_fingerprint for g in gens} == {models[GEN]["system_fingerprint"]}
    assert all(g.choices[0].finish_reason in ("stop", "length") for g in gens)
    with pytest.raises(openai.BadRequestError, match="generation model"):
        client.embeddings.create(model=GEN, input="hi")
    with pytest.raises(openai.BadRequestError, match="embedding model"):
        client.chat.completions.create(model=EMBED, messages=[{"role": "user", "content": "hi"}])
    both_server.wait_idle()


@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory) -> LLMEngine:
    """A one-layer BERT of dummy weights whose steps take at least 20 ms, at most 4 inputs each."""
    path = write_config(tmp_path_factory.mktemp("tiny-bert"), TINY_BERT_CONFIG)
    engine = LLMEngine(EngineConfig(model=str(path), task="embed", load_format="dummy",
                                    max_num_seqs=4))
    run = engine.runner.run

    def slow_run(batch):
        time.sleep(0.02)
        return run(batch)
    engine.runner.run = slow_run
    return engine


class _Leaving:
    """A client that disconnects after ``after`` seconds (the ASGI ``receive`` of its request)."""

    def __init__(self, after: float) -> None:
        self.after = after

    async def receive(self) -> dict:
        await asyncio.sleep(self.after)
        return {"type": "http.disconnect"}


def _in_loop(engine: LLMEngine, body):
    """Run ``body(ctx)`` on an embedding context over ``engine`` with its engine loop running."""
    ctx = EmbeddingContext.serve(engine, "tiny", Metrics("tiny", engine.fingerprint, True))

    async def run():
        ctx.engine.start()
        try:
            return await body(ctx)
        finally:
            ctx.engine.stop()
    return asyncio.run(run()), ctx


def test_large_request_is_sliced_and_a_small_one_waits_about_a_step(tiny_engine):
    big_ids = [[1, 2 + i % 90, 3] for i in range(40)]

    async def body(ctx):
        big = asyncio.ensure_future(embed_ids(ctx, big_ids))
        await asyncio.sleep(0.1)  # the big request is running
        small = await embed_ids(ctx, [[5, 6, 7]])
        return big.done(), small, await big

    (big_done_first, small, big), ctx = _in_loop(tiny_engine, body)
    assert not big_done_first, "the small request waited for all of the big one"
    offline = [tiny_engine_alone(tiny_engine, ids) for ids in (big_ids[0], big_ids[39], [5, 6, 7])]
    assert [big[0], big[39], small[0]] == offline  # in order, each as alone
    assert ctx.metrics.embedding_inputs._value.get() == 41


def tiny_engine_alone(engine: LLMEngine, ids: list[int]) -> list[float]:
    seq = engine.add_request("alone", ids, PoolingParams())
    list(engine.run_to_completion())
    return seq.embedding


def test_abandoned_request_stops_within_a_step(tiny_engine):
    async def body(ctx):
        with pytest.raises(APIError) as left:
            await embed_ids(ctx, [[1, 2, 3]] * 400, _Leaving(0.3))
        at_cancel = ctx.metrics.embedding_inputs._value.get()
        await asyncio.sleep(0.5)
        return left.value, at_cancel

    (left, at_cancel), ctx = _in_loop(tiny_engine, body)
    later = ctx.metrics.embedding_inputs._value.get()
    assert left.status == 499
    assert later <= at_cancel + 4 and later < 400  # at most the step that was running
    assert not tiny_engine.has_unfinished()


def test_a_failed_step_fails_its_requests_and_the_embedding_engine_reports_it(tmp_path,
                                                                               monkeypatch):
    path = write_config(tmp_path, TINY_BERT_CONFIG)
    engine = LLMEngine(EngineConfig(model=str(path), task="embed", load_format="dummy"))

    def crash(batch):
        raise RuntimeError("kernel crashed")

    async def body(ctx):
        monkeypatch.setattr(engine.runner, "run", crash)
        with pytest.raises(APIError) as failed:
            await embed_ids(ctx, [[1, 2, 3], [4, 5]])
        return failed.value, ctx.engine.error

    (failed, error), _ = _in_loop(engine, body)
    assert failed.status == 500  # the caller is answered, never left waiting
    assert error is not None and "RuntimeError" in error  # /health and new work: 503


def test_disconnected_client_stops_the_embedding_and_is_not_a_success(embed_server):
    def inputs_done() -> float:
        return embed_server.metric("samebits_embedding_inputs_total")

    ok_before = embed_server.metric("samebits_embedding_requests_total", status="200")
    before = inputs_done()
    body = {"model": EMBED, "input": [TEXTS[12]] * 2048}  # ~2048 x 450 tokens: minutes of work
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{embed_server.url}/v1/embeddings", json=body, timeout=3,
                   headers={"Authorization": f"Bearer {API_KEY}"})
    time.sleep(3)  # the worker notices at its next call
    noticed = inputs_done()
    time.sleep(3)  # a batch already running when it noticed may still finish (on a loaded CI box)
    stopped_at = inputs_done()
    assert stopped_at - noticed <= EngineConfig().max_num_seqs, (
        "the abandoned request kept using the CPU")
    time.sleep(3)
    assert inputs_done() == stopped_at, "the abandoned request kept using the CPU"
    assert stopped_at - before < 2048
    assert embed_server.metric("samebits_embedding_requests_total", status="200") == ok_before
    vec = embed_server.client().embeddings.create(model=EMBED, input=TEXTS[0]).data[0].embedding
    assert len(vec) == 384  # still serving
