"""Requests for the server determinism tests: short prompts, few tokens, mixed parameters, and a
way to send them (all at once or one by one) that keeps what must not change with the batch."""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import openai

WORDS = ("the quick brown fox jumps over a lazy dog while seven curious owls watch from an old "
         "oak tree near the river at dawn").split()

Request = tuple[str, dict[str, Any]]  # ("completions" | "chat", create() keyword arguments)


def mixed_requests(count: int, seed: int = 1234) -> list[Request]:
    """Completions and chats of 1-30 words, 2-8 tokens, greedy and sampled, with logprobs;
    every seventh asks for two choices."""
    rng = random.Random(seed)
    out: list[Request] = []
    for i in range(count):
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 30)))
        kw: dict[str, Any] = dict(model="SmolLM2-135M-Instruct", max_tokens=rng.randint(2, 8),
                                  temperature=rng.choice([0.0, 0.7, 1.0]),
                                  top_p=rng.choice([1.0, 0.9]), seed=rng.randrange(1 << 31))
        if i % 7 == 3:
            kw["n"] = 2
        if i % 3 == 2:
            kw.update(messages=[{"role": "user", "content": text}], logprobs=True,
                      top_logprobs=rng.randint(0, 3))
            out.append(("chat", kw))
        else:
            kw.update(prompt=text, logprobs=rng.randint(0, 3))
            out.append(("completions", kw))
    return out


def fingerprint_of(response: Any) -> str:
    """Everything in a response that must not depend on the batch: choices (text, logprobs,
    seeds, finish reasons) and the system fingerprint -- as exact JSON (floats round-trip)."""
    choices = [c.model_dump() for c in response.choices]
    return json.dumps({"choices": choices, "fp": response.system_fingerprint}, sort_keys=True)


def send(client: openai.OpenAI, req: Request) -> str:
    kind, kw = req
    api = client.chat.completions if kind == "chat" else client.completions
    return fingerprint_of(api.create(**kw))


async def send_async(client: openai.AsyncOpenAI, req: Request) -> str:
    kind, kw = req
    api = client.chat.completions if kind == "chat" else client.completions
    return fingerprint_of(await api.create(**kw))


def send_all_at_once(client: openai.AsyncOpenAI, reqs: list[Request],
                     timeout: float) -> list[str]:
    async def run() -> list[str]:
        async with client:
            return await asyncio.wait_for(
                asyncio.gather(*(send_async(client, r) for r in reqs)), timeout)
    return asyncio.run(run())


def send_one_by_one(client: openai.OpenAI, reqs: list[Request]) -> list[str]:
    return [send(client, r) for r in reqs]
