"""The offline API, vLLM's ``LLM`` (same arguments, methods and output shapes), thin over the engine.

Fan-out and seeds come from ``samebits.engine.fanout``, outputs from the engine's
``OutputProcessor``, so ``LLM`` and the server answer a request with the same bits.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from collections.abc import Sequence as Seq
from pathlib import Path
from typing import Any

from tqdm import tqdm

from samebits.config import EngineConfig
from samebits.engine.engine import LLMEngine
from samebits.engine.fanout import best, candidates, request_seed
from samebits.engine.pooling import PoolingSequence, embedding_inputs
from samebits.engine.sequence import Sequence
from samebits.llm_options import (
    check_chunked_prefill,
    check_options,
    engine_options,
    loaded_with_tokenizer,
    local_model,
)
from samebits.outputs import (
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    RequestOutput,
)
from samebits.pooling_params import PoolingParams
from samebits.sampling_params import SamplingParams
from samebits.text.chat_template import render_chat
from samebits.text.hf_tokenizer import HFTokenizer

PromptInput = str | list[int] | dict[str, Any]  # {"prompt": str} or {"prompt_token_ids": [...]}


class LLM:
    """``LLM()`` loads the embedded default (SmolLM2-135M-Instruct, a Q4_1 GGUF dequantized to
    float32 on CPU); ``LLM("org/name")`` a Hugging Face model from the local cache (downloaded
    into it when the hub is reachable); ``LLM(path)`` an HF directory, a .gguf file, or a
    config.json with ``load_format="dummy"``.

    vLLM's arguments: ``tokenizer`` (another tokenizer's directory or hub id), ``revision`` and
    ``download_dir`` (for hub ids), ``quantization`` (None, or "gguf" for a .gguf file),
    ``trust_remote_code`` (accepted: samebits never runs code from a checkpoint),
    ``gpu_memory_utilization`` (CUDA: the share of GPU memory the engine may hold),
    ``enable_sleep_mode`` (``sleep`` / ``wake_up``); ``disable_log_stats``, ``swap_space``,
    ``enable_chunked_prefill``, ``disable_custom_all_reduce`` are accepted and change nothing
    (``llm_options.NO_EFFECT`` says why). Other keyword options are ``EngineConfig``
    fields: device, dtype, batch_invariant, max_num_seqs, max_num_batched_tokens, max_model_len,
    block_size, num_kv_blocks, enable_prefix_caching, seed, load_format, task...
    """

    def __init__(self, model: str | None = None, *, tokenizer: str | None = None,
                 revision: str | None = None, download_dir: str | None = None,
                 quantization: str | None = None, trust_remote_code: bool = False,
                 enable_sleep_mode: bool = False, **kwargs: Any) -> None:
        check_options(model, quantization, trust_remote_code, kwargs)
        model = local_model(model, revision, download_dir)
        self.config = EngineConfig(model=model, **engine_options(kwargs))
        check_chunked_prefill(kwargs, self.config)
        self.enable_sleep_mode = enable_sleep_mode
        self._ids = itertools.count()
        self._hf_tokenizer: HFTokenizer | None = None
        self._pooling_engine: LLMEngine | None = None  # a generation LLM's, built by embed()
        if self.config.task == "embed":  # an embedding model: only ``embed`` / ``encode``
            if tokenizer is not None:
                raise ValueError("tokenizer= is not supported with task='embed': an embedding "
                                 "model uses the tokenizer in its own directory")
            self.engine = LLMEngine(self.config)
            return
        self.engine = LLMEngine(self.config, loaded_with_tokenizer(self.config, tokenizer,
                                                                   revision, download_dir))

    # ---- properties --------------------------------------------------------------------------
    @property
    def tokenizer(self):
        """samebits' own tokenizer (``get_tokenizer()`` gives the transformers-style one)."""
        return self.engine.tokenizer

    @property
    def fingerprint(self) -> str:
        return self.engine.fingerprint

    def get_tokenizer(self) -> HFTokenizer:
        """A tokenizer with transformers' interface (``__call__``, ``encode``, ``decode``,
        ``batch_decode``, ``apply_chat_template``, ``eos_token_id``...), ids equal to the
        engine's."""
        if self._hf_tokenizer is None:
            self._hf_tokenizer = HFTokenizer(self._own_tokenizer(), str(self._model_dir()))
        return self._hf_tokenizer

    # ---- generation --------------------------------------------------------------------------
    def generate(self, prompts: PromptInput | Seq[PromptInput],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool | Callable[..., tqdm] = True, lora_request: Any = None
                 ) -> list[RequestOutput]:
        """Generate for each prompt; outputs in prompt order, each with ``n`` choices.

        A prompt is a string, a list of token ids, ``{"prompt": str}`` or
        ``{"prompt_token_ids": [...]}``. Choice i of a prompt is sampled with seed S + i (S its
        seed, drawn when none is given: samebits.engine.fanout), so each choice replays alone
        with its reported seed; with ``best_of``, the n most likely candidates are returned.
        """
        self._require_generate()
        _no_lora(lora_request)
        prompts = _as_list(prompts)
        params = _per_prompt(sampling_params, len(prompts))
        encoded = [self._encode(p) for p in prompts]
        groups = self._submit([ids for _, ids in encoded], params, score_only=False)
        self._drain([s for _, seqs in groups for s in seqs], use_tqdm)
        return [self._output(request_id, seqs, text)
                for (request_id, seqs), (text, _) in zip(groups, encoded, strict=True)]

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
             use_tqdm: bool | Callable[..., tqdm] = True, lora_request: Any = None,
             chat_template: str | None = None, chat_template_content_format: str = "auto",
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             tools: list[dict[str, Any]] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """Render each conversation with the chat template (the model's, or ``chat_template``;
        content as a string or a list of text parts; ``tools`` and extra template variables),
        then generate (samebits.text.chat_template)."""
        self._require_generate()
        if chat_template_content_format not in ("auto", "string"):
            raise ValueError(f"chat_template_content_format={chat_template_content_format!r} is "
                             "not supported: samebits renders content as a string ('auto', "
                             "'string')")
        if messages and isinstance(messages[0], dict):
            messages = [messages]
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer, so no chat template")
        prompts = [render_chat(self.tokenizer, list(c), tools, chat_template, chat_template_kwargs,
                               add_generation_prompt, continue_final_message) for c in messages]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    def score(self, token_id_lists: Seq[Seq[int]]) -> list[list[float]]:
        """logprob of t_i given t_<i, i = 1..n-1: bitwise the ``token_logprobs`` reported when
        those tokens were generated (teacher-forced prefill through the same kernels). Takes token
        id lists, not text: this is not vLLM's ``LLM.score`` (a text-pair similarity API)."""
        self._require_generate()
        if isinstance(token_id_lists, str) or any(isinstance(t, str) for t in token_id_lists):
            raise TypeError("samebits' LLM.score takes token id lists (list[list[int]]) and "
                            "returns each token's teacher-forced logprob; it is not vLLM's "
                            "score(text_1, text_2) similarity API. Encode text with "
                            "llm.get_tokenizer().encode(text) first.")
        ids = [list(t) for t in token_id_lists]
        groups = self._submit(ids, [SamplingParams(max_tokens=1)] * len(ids), score_only=True)
        self._drain([seqs[0] for _, seqs in groups], False)
        return [list(seqs[0].prompt_logprobs) for _, seqs in groups]

    # ---- embeddings --------------------------------------------------------------------------
    def embed(self, prompts: str | Seq[str] | Seq[Seq[int]], truncate: bool | int = False, *,
              use_tqdm: bool = True, truncate_prompt_tokens: int | None = None,
              pooling_params: Any = None) -> list[EmbeddingRequestOutput]:
        """One ``EmbeddingRequestOutput`` per input (``.outputs.embedding``), each vector bitwise
        independent of the batch. An input over the model's token limit raises, unless
        ``truncate`` (True: the limit, k: k tokens) or vLLM's ``truncate_prompt_tokens`` (-1:
        the limit, k: k tokens) cuts it."""
        outputs = self._embed_outputs(prompts, truncate, truncate_prompt_tokens, pooling_params,
                                      use_tqdm)
        return [EmbeddingRequestOutput(f"embed-{next(self._ids)}", EmbeddingOutput(o.embedding),
                                       list(o.prompt_token_ids), True, self.fingerprint)
                for o in outputs]

    def encode(self, prompts: str | Seq[str] | Seq[Seq[int]], pooling_params: Any = None, *,
               use_tqdm: bool = True, truncate_prompt_tokens: int | None = None
               ) -> list[PoolingRequestOutput]:
        """vLLM's ``encode``: one ``PoolingRequestOutput`` per input, ``.outputs.data`` the
        pooled vector as a float32 tensor (the same values as ``embed``)."""
        import torch
        outputs = self._embed_outputs(prompts, False, truncate_prompt_tokens, pooling_params,
                                      use_tqdm)
        return [PoolingRequestOutput(f"encode-{next(self._ids)}",
                                     PoolingOutput(torch.tensor(o.embedding, dtype=torch.float32)),
                                     list(o.prompt_token_ids), True, self.fingerprint)
                for o in outputs]

    # ---- weights and memory ------------------------------------------------------------------
    def update_weights(self, named_tensors: Any) -> str:
        """Replace weights in place between generate calls (also while asleep): (Hugging Face
        name, tensor) pairs or a dict, any subset of the weights, each of the weight's exact
        shape and dtype, finite. All or nothing: a bad tensor raises ``ValueError`` naming it
        and changes nothing. Returns the new fingerprint; prefix-cache blocks of the old weights
        are never reused."""
        self._require_generate()
        self._pooling_engine = None  # rebuilt over the new weights (and fingerprint) when needed
        return self.engine.update_weights(named_tensors)

    def named_weights(self):
        """(Hugging Face name, tensor view) of every weight, q/k/v and gate/up unfused."""
        self._require_generate()
        return self.engine.runner.named_weights()

    def sleep(self, level: int = 1) -> None:
        """Free device memory between rollouts (needs ``enable_sleep_mode=True``): level 1 the
        KV cache, level 2 also the weights (kept in host memory). ``wake_up`` restores them."""
        self._require_generate()
        if not self.enable_sleep_mode:
            raise ValueError("sleep mode is off: build the LLM with enable_sleep_mode=True")
        self.engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore what ``sleep`` freed (``tags``: "weights", "kv_cache"; None: both); outputs
        are then bitwise those of before sleeping, or of the weights updated meanwhile."""
        self._require_generate()
        self.engine.wake_up(tags)

    def is_sleeping(self) -> bool:
        return bool(self.engine.asleep)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block (vLLM's; ``update_weights`` already does)."""
        self._require_generate()
        self.engine.kv.set_fingerprint(self.engine.fingerprint)
        return True

    # ---- internals ---------------------------------------------------------------------------
    def _require_generate(self) -> None:
        if self.config.task == "embed":
            raise ValueError("this LLM was built with task='embed': use embed() or encode(), "
                             "not generation")

    def _own_tokenizer(self):
        """samebits' ``Tokenizer`` (an embedding model's is read from its directory)."""
        if self.engine.tokenizer is None:
            raise ValueError("this model has no tokenizer (no tokenizer.json)")
        return self.engine.tokenizer

    def _model_dir(self) -> Path:
        return self.engine.loaded.model_dir

    def _embed_outputs(self, prompts: Any, truncate: bool | int, truncate_prompt_tokens: int | None,
                       pooling_params: Any, use_tqdm: bool | Callable[..., tqdm]
                       ) -> list[PoolingSequence]:
        """Each input as a pooling request of the embedding engine, all of them run together;
        the finished sequences (``embedding``, ``prompt_token_ids``) in input order. All or
        nothing: a bad input leaves the engine as it was."""
        if pooling_params is not None and not isinstance(pooling_params, PoolingParams):
            raise ValueError("pooling_params must be None or a PoolingParams: samebits pools as "
                             "the model's sentence-transformers config says")
        if truncate_prompt_tokens is not None:
            truncate = True if truncate_prompt_tokens == -1 else truncate_prompt_tokens
        engine = self._pooler()
        ids = embedding_inputs(engine.loaded).tokenize(prompts, truncate)
        seqs: list[PoolingSequence] = []
        try:
            for prompt_ids in ids:
                seqs.append(engine.add_request(f"embed-{next(self._ids)}", prompt_ids,
                                               pooling_params or PoolingParams()))
        except ValueError:
            for seq in seqs:
                engine.abort(seq.request_id)
            raise
        self._drain(seqs, use_tqdm, engine)
        return seqs

    def _pooler(self) -> LLMEngine:
        """The embedding engine: this LLM's own (task='embed'), or, for a generation LLM built
        with a decoder embedding model (sentence-transformers modules.json), one over the same
        loaded weights."""
        if self.config.task == "embed":
            return self.engine
        if self._pooling_engine is None:
            from samebits.loader.pooling import decoder_pooling_model
            if not (self.engine.loaded.model_dir / "modules.json").is_file():
                raise ValueError(
                    f"embed() needs an embedding model; this LLM was built with the generation "
                    f"model {self.engine.loaded.model_dir} (no sentence-transformers "
                    "modules.json). Use LLM(task='embed') for all-MiniLM-L6-v2, or LLM('path/or/"
                    "org-name-of-an-embedding-model', task='embed') (a BERT-style encoder, or a "
                    "decoder such as Qwen3-Embedding)")
            config = dataclasses.replace(self.config, task="embed")
            self._pooling_engine = LLMEngine(config,
                                             decoder_pooling_model(config, self.engine.loaded))
        return self._pooling_engine

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
        """(request id, its sequences) per prompt: one engine request per candidate (one when
        scoring), seeded by samebits.engine.fanout. All or nothing: a bad prompt leaves the
        engine as it was."""
        groups: list[tuple[str, list[Sequence]]] = []
        try:
            for prompt_ids, p in zip(ids, params, strict=True):
                request_id = str(next(self._ids))
                seed = request_seed(p, self.engine.draw_seed)
                groups.append((request_id, []))
                for i, cp in enumerate(candidates(p, seed, 1 if score_only else None)):
                    groups[-1][1].append(self.engine.add_request(
                        f"{request_id}-{i}", prompt_ids, cp, score_only, index=i))
        except ValueError:
            for _, seqs in groups:
                for s in seqs:
                    self.engine.abort(s.request_id)
            raise
        return groups

    def _output(self, request_id: str, seqs: list[Sequence], prompt: str | None
                ) -> RequestOutput:
        """A prompt's result: its n choices, or the n best of its best_of candidates."""
        first, output = seqs[0], self.engine.output
        chosen = best([output.completion(s) for s in seqs], first.params.n)
        return RequestOutput(
            request_id=request_id, prompt=prompt, prompt_token_ids=list(first.prompt_token_ids),
            prompt_logprobs=output.prompt_logprobs(first), outputs=chosen,
            finished=all(o.finished() for o in chosen), num_cached_tokens=first.num_cached_tokens,
            system_fingerprint=self.fingerprint, metrics=first.metrics)

    def _drain(self, seqs: list[Any], use_tqdm: bool | Callable[..., tqdm],
               engine: LLMEngine | None = None) -> None:
        """Run the engine until ``seqs`` (this call's requests) are done. On any exception, an
        interrupt too, this call's requests are aborted first: a caller that goes on finds the
        engine as it was before the call, not still holding them."""
        engine = engine or self.engine
        bar = use_tqdm if callable(use_tqdm) else tqdm
        try:
            with bar(total=len(seqs), disable=not use_tqdm, desc="Processed prompts") as progress:
                for _ in engine.run_to_completion():
                    progress.update(1)
        except BaseException:
            for seq in seqs:
                engine.abort(seq.request_id)
            raise


def _no_lora(lora_request: Any) -> None:
    if lora_request is not None:
        raise ValueError("lora_request is not supported: samebits serves one set of weights "
                         "(update_weights replaces them)")


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
