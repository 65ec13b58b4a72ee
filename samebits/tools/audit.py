"""The remote audit behind ``samebits verify --url``: the four checks of samebits.tools.verify against
an OpenAI-compatible server, through the ``openai`` SDK (chat completions with logprobs)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import openai

from samebits.tools.verify import CheckResult, Output, compare, prompts


@dataclass(frozen=True)
class AuditConfig:
    url: str  # the server's base URL, with or without /v1
    api_key: str | None = None
    model: str | None = None  # None: the first model the server lists
    concurrency: int = 16  # identical requests sent at once
    num_prompts: int = 8  # requests in the mixed batch (and halves of it for the other checks)
    max_tokens: int = 16
    timeout: float = 600.0

    def __post_init__(self) -> None:
        for name in ("concurrency", "num_prompts", "max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")

    @property
    def base_url(self) -> str:
        url = self.url.rstrip("/")
        return url if url.endswith("/v1") else f"{url}/v1"


class Auditor:
    def __init__(self, config: AuditConfig) -> None:
        self.config = config
        self.client = openai.AsyncOpenAI(base_url=config.base_url,
                                         api_key=config.api_key or "none", max_retries=0,
                                         timeout=config.timeout)
        self.model = config.model

    async def run(self) -> list[CheckResult]:
        async with self.client:
            if self.model is None:
                self.model = (await self.client.models.list()).data[0].id
            return [await self.identical_concurrent(), await self.batch_vs_alone(),
                    await self.stream_vs_non_stream(), await self.seeded_sampling()]

    def request(self, prompt: str, i: int) -> dict[str, Any]:
        """Request i: greedy when i is even, sampled with seed 1000 + i when odd."""
        sampled = i % 2 == 1
        return dict(model=self.model, messages=[{"role": "user", "content": prompt}],
                    max_tokens=self.config.max_tokens, logprobs=True,
                    temperature=0.8 if sampled else 0.0, seed=1000 + i if sampled else None)

    async def create(self, kw: dict[str, Any]) -> Output:
        r = await self.client.chat.completions.create(**{k: v for k, v in kw.items()
                                                         if v is not None})
        return _tokens(r.choices[0].logprobs)

    async def create_stream(self, kw: dict[str, Any]) -> Output:
        out: list[tuple[str, float]] = []
        stream = await self.client.chat.completions.create(
            **{k: v for k, v in kw.items() if v is not None}, stream=True)
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].logprobs is not None:
                out.extend(_tokens(chunk.choices[0].logprobs))
        return tuple(out)

    async def identical_concurrent(self) -> CheckResult:
        kw = self.request("Write one sentence about the sea.", 1)
        outs = await asyncio.gather(*(self.create(kw) for _ in range(self.config.concurrency)))
        return compare("identical concurrent", list(outs[1:]), [outs[0]] * (len(outs) - 1))

    async def batch_vs_alone(self) -> CheckResult:
        reqs = [self.request(p, i) for i, p in enumerate(prompts(self.config.num_prompts))]
        together = await asyncio.gather(*(self.create(kw) for kw in reqs))
        alone = [await self.create(kw) for kw in reqs]
        return compare("batch vs alone", list(together), alone)

    async def stream_vs_non_stream(self) -> CheckResult:
        reqs = [self.request(p, i) for i, p in enumerate(prompts(self.config.num_prompts // 2
                                                                 or 1, seed=5))]
        streamed = [await self.create_stream(kw) for kw in reqs]
        whole = [await self.create(kw) for kw in reqs]
        return compare("stream vs non-stream", streamed, whole)

    async def seeded_sampling(self) -> CheckResult:
        reqs = [dict(self.request(p, 2 * i + 1), temperature=1.0)
                for i, p in enumerate(prompts(self.config.num_prompts // 2 or 1, seed=9))]
        first = [await self.create(kw) for kw in reqs]
        again = [await self.create(kw) for kw in reqs]
        return compare("seeded sampling repeated", again, first)


def _tokens(logprobs: Any) -> Output:
    if logprobs is None or logprobs.content is None:
        raise RuntimeError("the server returned no logprobs: the audit compares token logprobs")
    return tuple((t.token, t.logprob) for t in logprobs.content)


def audit(config: AuditConfig) -> tuple[str, list[CheckResult]]:
    """Run every check; returns the audited model's name and the results."""
    auditor = Auditor(config)
    results = asyncio.run(auditor.run())
    return auditor.model or "", results
