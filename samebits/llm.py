"""The offline API (design.md section 4), thin over the engine."""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq
from typing import Any

from tqdm import tqdm

from samebits.chat_template import render_chat
from samebits.config import EngineConfig
from samebits.engine.engine import LLMEngine
from samebits.engine.sequence import RequestOutput
from samebits.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    """``LLM()`` loads the embedded default (SmolLM2-135M-Instruct on CPU, float32).

    Keyword options are ``EngineConfig`` fields: device, dtype, batch_invariant, max_num_seqs,
    max_num_batched_tokens, block_size, num_kv_blocks, enable_prefix_caching, seed, load_format...
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self.config = EngineConfig(model=model, **kwargs)
        self.embedder = self.engine = None
        if self.config.task == "embed":  # an encoder: only ``embed``
            from samebits.decoder_embedder import DecoderEmbedder, is_decoder_model
            from samebits.embedder import Embedder
            cls = DecoderEmbedder if is_decoder_model(self.config) else Embedder
            self.embedder = cls(self.config)
            return
        self.engine = LLMEngine(self.config)
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer if self.engine is not None else self.embedder.tokenizer

    @property
    def fingerprint(self) -> str:
        return self.engine.fingerprint if self.engine is not None else self.embedder.fingerprint

    def embed(self, texts: str | Seq[str] | Seq[Seq[int]], truncate: bool = False
              ) -> list[list[float]]:
        """One vector per text (or token id list), each bitwise independent of the batch;
        ``truncate=True`` cuts inputs over the model's token limit instead of raising."""
        if self.embedder is None:
            raise ValueError("embed() needs an embedding model: LLM(model, task='embed')")
        return self.embedder.embed(texts, truncate)

    def _require_generate(self) -> None:
        if self.engine is None:
            raise ValueError("this LLM was built with task='embed': use embed(), not generation")

    def generate(self, prompts: Prompt | Seq[Prompt],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate for each prompt; outputs in prompt order."""
        self._require_generate()
        prompts = _as_list(prompts)
        params = _per_prompt(sampling_params, len(prompts))
        texts = [p if isinstance(p, str) else None for p in prompts]
        ids = [self._encode(p) for p in prompts]
        seqs = self._submit(ids, params, score_only=False)
        self._drain(len(seqs), use_tqdm)
        return [self.engine.output(s, t) for s, t in zip(seqs, texts, strict=True)]

    def chat(self, conversations: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
             use_tqdm: bool = False, *, chat_template: str | None = None,
             chat_template_kwargs: dict[str, Any] | None = None,
             tools: list[dict[str, Any]] | None = None) -> list[RequestOutput]:
        """Apply the chat template (the model's, or ``chat_template``) to each conversation, with
        ``tools`` and extra template variables, then generate (samebits.chat_template)."""
        self._require_generate()
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer, so no chat template")
        prompts = [render_chat(self.tokenizer, c, tools, chat_template, chat_template_kwargs)
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def score(self, token_id_lists: Seq[Seq[int]]) -> list[list[float]]:
        """logprob of t_i given t_<i, i = 1..n-1: bitwise the logprobs reported when those tokens
        were generated (teacher-forced prefill through the same kernels)."""
        self._require_generate()
        ids = [list(t) for t in token_id_lists]
        seqs = self._submit(ids, [SamplingParams(max_tokens=1)] * len(ids), score_only=True)
        self._drain(len(seqs), False)
        return [list(s.prompt_logprobs) for s in seqs]

    def update_weights(self, named_tensors: Any) -> str:
        """Replace weights in place between generate calls: (Hugging Face name, tensor) pairs or
        a dict, any subset of the weights, each of the weight's exact shape and dtype, finite.
        All or nothing: a bad tensor raises ``ValueError`` naming it and changes nothing. Returns
        the new fingerprint; prefix-cache blocks of the old weights are never reused."""
        self._require_generate()
        return self.engine.update_weights(named_tensors)

    def named_weights(self):
        """(Hugging Face name, tensor view) of every weight, q/k/v and gate/up unfused."""
        self._require_generate()
        from samebits.models.weights import WeightMap
        return WeightMap(self.engine.runner.model).named_weights()

    def _encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompts as token id lists")
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def _submit(self, ids: list[list[int]], params: list[SamplingParams], score_only: bool):
        seqs = []
        try:
            for prompt_ids, p in zip(ids, params, strict=True):
                request_id = f"offline-{next(self._ids)}"
                seqs.append(self.engine.add_request(request_id, prompt_ids, p, score_only))
        except ValueError:
            for s in seqs:  # all or nothing: a bad prompt leaves the engine as it was
                self.engine.abort(s.request_id)
            raise
        return seqs

    def _drain(self, total: int, use_tqdm: bool) -> None:
        with tqdm(total=total, disable=not use_tqdm, desc="requests") as bar:
            for _ in self.engine.run_to_completion():
                bar.update(1)


def _as_list(prompts: Prompt | Seq[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    return prompts


def _per_prompt(params: SamplingParams | Seq[SamplingParams] | None, n: int
                ) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} sampling params for {n} prompts")
    return params
