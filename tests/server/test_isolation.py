"""One client's poisoned request never touches another's: against a live server (uvicorn on a
loopback port, in this process so that faults can be planted), 32 concurrent plain requests run
beside each kind of poisoned request, and each of the 32 comes back 200 with the bits it gets
alone (output hash, tokens and logprobs), while the poisoned request alone fails with a 4xx/5xx
naming its cause.

The poisons: a constraint that dead-ends mid-output and a row of NaN logits (real: a poisoned
weight row, through the model) fail in the step; a logits processor, a grammar mask, a
detokenizer and tool parsing that raise (planted faults) fail in the step or in the request's
own handler; a self-referential schema, a schema nested 1,000 deep, a regex that cannot compile,
a schema over a limit and a reserved chat_template_kwargs key are refused at admission. The
step-time poisons are checked to fail in a step the plain requests share. The negative control:
without the isolation, a raising logits processor fails its neighbours too."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable

import httpx
import openai
import pytest
import torch

from samebits.engine import isolation
from samebits.engine.logits_processor import LogitBias
from samebits.server.app import build_app
from samebits.server.output_hash import HEADER
from samebits.server.tools import ToolStream
from samebits.structured_outputs import StructuredOutputsParams
from samebits.text.detokenizer import IncrementalDetokenizer
from tests.server.inprocess import MODEL, LiveServer, tiny_engine

NAN_TOKEN = 49000  # its embedding row is NaN: a prompt holding it has NaN logits
MARK = "POISON"  # the planted faults fire only for requests carrying this
PLAIN = [dict(prompt=f"Request {i} asks for a few words about topic {i % 8}.", max_tokens=16,
              temperature=0.8, seed=100 + i % 8, logprobs=1) for i in range(32)]
LONG = [7] * 300  # a prompt prefilled over several steps beside the plain decodes


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    engine = tiny_engine(tmp_path_factory.mktemp("isolation"), max_model_len=512)
    engine.grammars.compile(StructuredOutputsParams(choice=["warm"]))  # xgrammar set up once
    with torch.no_grad():
        engine.loaded.model.embed_tokens.weight[NAN_TOKEN] = float("nan")
    steps: list[tuple[set[str], set[str]]] = []  # per step: (request ids, those that failed)
    postprocess = engine.postprocess

    def recording(batch, result):
        progressed = postprocess(batch, result)
        failed = {s.request_id for s in progressed if s.error is not None}
        steps.append(({s.request_id for s in batch.seqs}, failed))
        return progressed
    engine.postprocess = recording
    server = LiveServer(build_app(engine, MODEL))
    server.engine, server.steps = engine, steps
    yield server
    server.close()


async def _plain(client: openai.AsyncOpenAI, body: dict):
    raw = await client.completions.with_raw_response.create(model=MODEL, **body)
    choice = raw.parse().choices[0]
    return raw.headers[HEADER], choice.text, choice.logprobs.token_logprobs


@pytest.fixture(scope="module")
def solo(live) -> list:
    async def run():
        async with openai.AsyncOpenAI(base_url=f"{live.url}/v1", api_key="x",
                                      max_retries=0) as client:
            alone = {}
            for body in PLAIN:
                key = json.dumps(body, sort_keys=True)
                if key not in alone:
                    alone[key] = await _plain(client, body)
            return [alone[json.dumps(b, sort_keys=True)] for b in PLAIN]
    return asyncio.run(run())


def _cmpl(**body) -> tuple[str, dict]:
    return "/v1/completions", {"model": MODEL, "max_tokens": 4, "seed": 3, **body}


def _chat(**body) -> tuple[str, dict]:
    return "/v1/chat/completions", {"model": MODEL, "max_tokens": 4, "seed": 3, "messages": [
        {"role": "user", "content": "Call a tool"}], **body}


DEAD_END = {"type": "string", "pattern": "[^\\s\\S]"}  # '"' is allowed first, then nothing
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
STEP_POISONS = {  # kind: (request, status, message); each fails inside a step
    "constraint dead-ends": (_cmpl(prompt=LONG, guided_json=DEAD_END), 400,
                             "allows no next token"),
    "NaN logits": (_cmpl(prompt=[*LONG, NAN_TOKEN]), 500, "not finite"),
    "logits processor raises": (_cmpl(prompt=LONG, logit_bias={"4242": 1.0}), 500,
                                "logits processors failed: planted"),
    "grammar mask raises": (_cmpl(prompt=LONG, guided_choice=[MARK]), 500,
                            "structured output failed: planted"),
    "detokenizer raises": (_cmpl(prompt=LONG, stop=[MARK]), 500, "its output failed: planted"),
}
OTHER_POISONS = {  # refused at admission, or failing in the request's own handler
    "tool parsing raises": (_chat(tools=TOOLS), 500, "internal error: RuntimeError"),
    "self-referential schema": (_cmpl(prompt="hi", guided_json={"$ref": "#"}), 400,
                                "allows no first token"),
    "schema nested 1000 deep": (_cmpl(prompt="hi", guided_json='{"a":' * 1000 + "1" + "}" * 1000),
                                400, "nested deeper"),
    "regex that cannot compile": (_cmpl(prompt="hi", guided_regex="(("), 400, "invalid regex"),
    "schema over a limit": (_cmpl(prompt="hi", guided_json={"enum": list(range(300))}), 400,
                            "300 enum values"),
    "reserved template kwarg": (_chat(chat_template_kwargs={"template": "x"}), 400,
                                "chat_template_kwargs"),
}


@pytest.fixture()
def planted(live, monkeypatch):
    """Faults that fire only for requests carrying MARK (or logit_bias on token 4242)."""
    def bias(logits, seqs, rows):
        if any(4242 in seqs[i].params.logit_bias for i in rows):
            raise RuntimeError("planted logit_bias fault")
        return original_bias(logits, seqs, rows)
    original_bias = LogitBias.apply
    monkeypatch.setattr(LogitBias, "apply", staticmethod(bias))

    grammars = live.engine.grammars
    original_state = grammars.state

    def state(spec):
        st = original_state(spec)
        if spec.kind == "choice" and list(spec.choice) == [MARK]:
            st.fill = _raise("planted matcher fault")
        return st
    monkeypatch.setattr(grammars, "state", state)

    original_push = IncrementalDetokenizer.push

    def push(self, token_id):
        if MARK in self.stops:
            raise RuntimeError("planted detokenizer fault")
        return original_push(self, token_id)
    monkeypatch.setattr(IncrementalDetokenizer, "push", push)

    original_finish, original_parse = ToolStream.finish, ToolStream.parse

    def finish(self, cut=False):
        if self.plan.mode == "auto":
            raise RuntimeError("planted tool parser fault")
        return original_finish(self, cut)

    def parse(self, text, cut=False):  # a whole answer, cut by max_tokens or not
        if self.plan.mode == "auto":
            raise RuntimeError("planted tool parser fault")
        return original_parse(self, text, cut)
    monkeypatch.setattr(ToolStream, "finish", finish)
    monkeypatch.setattr(ToolStream, "parse", parse)


def _raise(message: str) -> Callable:
    def fail(*_):
        raise RuntimeError(message)
    return fail


async def _beside(live, poisons: list[tuple[str, dict]], plain: list[dict] = PLAIN
                  ) -> tuple[list, list[httpx.Response]]:
    """The plain requests, and once they all run, the poisoned ones (concurrently)."""
    async with openai.AsyncOpenAI(base_url=f"{live.url}/v1", api_key="x", max_retries=0,
                                  timeout=300) as client, httpx.AsyncClient(timeout=300) as http:
        tasks = [asyncio.create_task(_plain(client, b)) for b in plain]
        deadline = time.monotonic() + 60
        while live.engine.stats().num_running < len(plain):
            assert time.monotonic() < deadline, "the plain requests never ran together"
            await asyncio.sleep(0.005)
        poisoned = await asyncio.gather(*(http.post(live.url + path, json=body)
                                          for path, body in poisons))
        return await asyncio.gather(*tasks), poisoned


def _check(live, solo, kinds: list[str]) -> None:
    """Each kind's poison beside the 32 (all kinds at once): the poison fails with its status
    and message, a step-time one in a step it shared with more than 16 plain requests; each
    plain request gets its solo bits; no KV block stays in use."""
    poisons = {**STEP_POISONS, **OTHER_POISONS}
    live.steps.clear()
    got, responses = asyncio.run(_beside(live, [poisons[k][0] for k in kinds]))
    for kind, response in zip(kinds, responses, strict=True):
        _, status, message = poisons[kind]
        assert response.status_code == status, (kind, response.text)
        assert message in response.json()["error"]["message"], (kind, response.text)
    for plain, alone in zip(got, solo, strict=True):
        assert plain == alone  # output hash (token ids and logprob bits), text, logprobs
    shared = [len(ids - failed) for ids, failed in live.steps for _ in failed]
    assert len(shared) == sum(k in STEP_POISONS for k in kinds), live.steps
    assert all(n > 16 for n in shared), shared
    assert _idle_soon(live)


def _idle_soon(live) -> bool:
    deadline = time.monotonic() + 10
    while live.engine.stats().kv_blocks_used and time.monotonic() < deadline:
        time.sleep(0.05)
    return live.engine.stats().kv_blocks_used == 0


def test_every_kind_of_poison_fails_alone_and_32_neighbours_keep_their_bits(live, solo,
                                                                           planted):
    _check(live, solo, [*STEP_POISONS, *OTHER_POISONS])


@pytest.mark.slow
@pytest.mark.parametrize("kind", [*STEP_POISONS, *OTHER_POISONS])
def test_each_kind_of_poison_alone_beside_32_neighbours(live, solo, planted, kind):
    _check(live, solo, [kind])


def test_without_isolation_a_raising_processor_fails_its_neighbours(live, planted, monkeypatch):
    monkeypatch.setattr("samebits.engine.runner.processed_logits",
                        lambda logits, seqs, failed: isolation._process(logits, seqs))
    with pytest.raises(openai.InternalServerError, match="internal error in the engine step"):
        asyncio.run(_beside(live, [STEP_POISONS["logits processor raises"][0]], PLAIN[:8]))
