"""The offline API (design.md section 4), thin over the engine."""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq
from dataclasses import replace
from typing import Any

from tqdm import tqdm

from samebits.config import EngineConfig
from samebits.engine.engine import LLMEngine
from samebits.engine.pooling import embedding_inputs
from samebits.engine.sequence import RequestOutput, Sequence
from samebits.pooling_params import PoolingParams
from samebits.sampling_params import SamplingParams, choice_seed
from samebits.text.chat_template import render_chat

PromptInput = str | list[int] | dict[str, Any]  # {"prompt": str} or {"prompt_token_ids": [...]}


class LLM:
    """``LLM()`` loads the embedded default (SmolLM2-135M-Instruct on CPU, float32).

    Keyword options are ``EngineConfig`` fields: device, dtype, batch_invariant, max_num_seqs,
    max_num_batched_tokens, block_size, num_kv_blocks, enable_prefix_caching, seed, load_format...
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self.config = EngineConfig(model=model, **kwargs)
        self.engine = LLMEngine(self.config)
        self.embedding_inputs = (embedding_inputs(self.engine.loaded) if self.config.task == "embed"
                                 else None)  # an embedding model: only ``embed``
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def fingerprint(self) -> str:
        return self.engine.fingerprint

    def embed(self, texts: str | Seq[str] | Seq[Seq[int]], truncate: bool | int = False
              ) -> list[list[float]]:
        """One vector per text (or token id list), each bitwise independent of the batch: every
        input is a pooling request, and the engine runs them together. ``truncate=True`` cuts
        inputs over the model's token limit instead of raising (an int k: to k tokens)."""
        if self.embedding_inputs is None:
            raise ValueError("embed() needs an embedding model: LLM(model, task='embed')")
        ids = self.embedding_inputs.tokenize(texts, truncate)
        seqs = []
        try:
            for prompt_ids in ids:
                seqs.append(self.engine.add_request(f"embed-{next(self._ids)}", prompt_ids,
                                                    PoolingParams()))
        except ValueError:  # all or nothing
            for seq in seqs:
                self.engine.abort(seq.request_id)
            raise
        self._drain(len(seqs), False)
        return [seq.embedding for seq in seqs]

    def _require_generate(self) -> None:
        if self.config.task == "embed":
            raise ValueError("this LLM was built with task='embed': use embed(), not generation")

    def get_tokenizer(self):
        """The model's tokenizer (``encode``, ``decode``, ``apply_chat_template``)."""
        return self.tokenizer

    def generate(self, prompts: PromptInput | Seq[PromptInput],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate for each prompt; outputs in prompt order, each with ``n`` choices.

        A prompt is a string, a list of token ids, ``{"prompt": str}`` or
        ``{"prompt_token_ids": [...]}``. Choice i of a prompt is sampled with seed
        ``choice_seed(seed, i)`` (one seed is drawn when none is given), so each choice replays
        alone with its reported seed. With ``best_of``, that many candidates are generated and
        the n with the highest cumulative logprob are returned (ties: the lower candidate first).
        """
        self._require_generate()
        prompts = _as_list(prompts)
        params = _per_prompt(sampling_params, len(prompts))
        encoded = [self._encode(p) for p in prompts]
        groups = self._submit([ids for _, ids in encoded], params, score_only=False)
        self._drain(sum(len(seqs) for _, seqs in groups), use_tqdm)
        return [self._output(request_id, seqs, text)
                for (request_id, seqs), (text, _) in zip(groups, encoded, strict=True)]

    def chat(self, conversations: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
             use_tqdm: bool = False, *, chat_template: str | None = None,
             chat_template_kwargs: dict[str, Any] | None = None,
             tools: list[dict[str, Any]] | None = None) -> list[RequestOutput]:
        """Apply the chat template (the model's, or ``chat_template``) to each conversation, with
        ``tools`` and extra template variables, then generate (samebits.text.chat_template)."""
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
        were generated (teacher-forced prefill through the same kernels). Takes token id lists,
        not text: this is not vLLM's ``LLM.score`` (a text-pair similarity API)."""
        self._require_generate()
        if isinstance(token_id_lists, str) or any(isinstance(t, str) for t in token_id_lists):
            raise TypeError("samebits' LLM.score takes token id lists (list[list[int]]) and "
                            "returns each token's teacher-forced logprob; it is not vLLM's "
                            "score(text_1, text_2) similarity API. Encode text with "
                            "llm.get_tokenizer().encode(text) first.")
        ids = [list(t) for t in token_id_lists]
        groups = self._submit(ids, [SamplingParams(max_tokens=1)] * len(ids), score_only=True)
        self._drain(len(groups), False)
        return [list(seqs[0].prompt_logprobs) for _, seqs in groups]

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
        return self.engine.runner.named_weights()

    def _encode(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        """(the prompt text or None, its token ids)."""
        if isinstance(prompt, dict):
            unknown = set(prompt) - {"prompt", "prompt_token_ids"}
            if unknown or len(prompt) != 1:
                raise ValueError("a prompt dict has exactly one key, 'prompt' or "
                                 f"'prompt_token_ids'; got {sorted(prompt)}")
            if "prompt" in prompt:
                if not isinstance(prompt["prompt"], str):
                    raise ValueError("'prompt' in a prompt dict must be a string")
                return self._encode(prompt["prompt"])
            return None, self._token_ids(prompt["prompt_token_ids"])
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompts as token id lists")
            return prompt, self.tokenizer.encode(prompt)
        return None, self._token_ids(prompt)

    @staticmethod
    def _token_ids(ids: Any) -> list[int]:
        if isinstance(ids, str) or not all(isinstance(t, int) for t in ids):
            raise ValueError("prompt_token_ids must be a list of integers")
        return list(ids)

    def _submit(self, ids: list[list[int]], params: list[SamplingParams], score_only: bool
                ) -> list[tuple[str, list[Sequence]]]:
        """(request id, its sequences) per prompt: one engine request per candidate
        (``params.num_candidates``; one when scoring), candidate i seeded ``choice_seed(seed, i)``.
        All or nothing: a bad prompt leaves the engine as it was."""
        groups: list[tuple[str, list[Sequence]]] = []
        try:
            for prompt_ids, p in zip(ids, params, strict=True):
                request_id = f"offline-{next(self._ids)}"
                base = p.seed if p.seed is not None else self.engine.draw_seed()
                groups.append((request_id, []))
                for i in range(1 if score_only else p.num_candidates):
                    groups[-1][1].append(self.engine.add_request(
                        f"{request_id}-{i}", prompt_ids, replace(p, seed=choice_seed(base, i)),
                        score_only, index=i))
        except ValueError:
            for _, seqs in groups:
                for s in seqs:
                    self.engine.abort(s.request_id)
            raise
        return groups

    def _output(self, request_id: str, seqs: list[Sequence], prompt: str | None
                ) -> RequestOutput:
        """A prompt's result: its n choices, or the n best of its best_of candidates (by
        cumulative logprob; the sort is stable, so ties keep the lower candidate first)."""
        first, n = seqs[0], seqs[0].params.n
        chosen = sorted(seqs, key=lambda s: -sum(s.logprobs))[:n] if len(seqs) > n else seqs
        return RequestOutput(
            request_id=request_id, prompt=prompt, prompt_token_ids=list(first.prompt_token_ids),
            prompt_logprobs=self.engine.prompt_logprobs(first),
            outputs=[self.engine.completion(s, i) for i, s in enumerate(chosen)],
            finished=all(s.is_finished for s in chosen),
            num_cached_tokens=first.num_cached_tokens, system_fingerprint=self.fingerprint)

    def _drain(self, total: int, use_tqdm: bool) -> None:
        with tqdm(total=total, disable=not use_tqdm, desc="requests") as bar:
            for _ in self.engine.run_to_completion():
                bar.update(1)


def _as_list(prompts: PromptInput | Seq[PromptInput]) -> list[PromptInput]:
    if isinstance(prompts, str | dict):
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
