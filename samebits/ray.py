"""Replicas on Ray Data: ``LLMPredictor``, a callable class for ``Dataset.map_batches``.

    import ray
    from samebits.ray import LLMPredictor
    ds = ray.data.from_items([{"prompt": p} for p in prompts])
    ds = ds.map_batches(LLMPredictor, concurrency=2, batch_size=16,
                        fn_constructor_kwargs={"sampling_params": {"max_tokens": 32,
                                                                   "temperature": 0.8, "seed": 7},
                                               "model": None, "max_num_seqs": 32})

Each replica (Ray actor) holds one ``LLM``; every batch reads the ``prompt`` column (text, or
token ids) and adds ``generated_text``, ``token_ids`` (int64), ``logprobs`` (float32: the exact
fp32 values) and ``seed``. Because a request's bits do not depend on its batch (the invariance
contract of ``samebits.ops.backend``), the rows equal one local ``LLM.generate`` whatever the
number of replicas and the batch size.

The seed of a row: its own ``seed`` column when the dataset has one, else ``sampling_params``'
seed, else one derived from the prompt (sha256), never a draw that depends on which replica or
batch the row landed in. The ``seed`` column reports it, so a row replays alone with
``SamplingParams(..., seed=row["seed"])``.
"""

from __future__ import annotations

import hashlib
from dataclasses import replace
from typing import Any

import numpy as np

from samebits.llm import LLM
from samebits.sampling_params import SamplingParams


class LLMPredictor:
    def __init__(self, sampling_params: dict[str, Any] | None = None, model: str | None = None,
                 **llm_options: Any) -> None:
        self.params = SamplingParams(**(sampling_params or {}))
        self.llm = LLM(model, **llm_options)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        prompts = [_prompt(p) for p in batch["prompt"]]
        seeds = batch.get("seed")
        params = [replace(self.params, seed=self._seed(p, None if seeds is None else seeds[i]))
                  for i, p in enumerate(prompts)]
        outs = [r.outputs[0] for r in self.llm.generate(prompts, params)]
        return {**batch,
                "generated_text": np.array([o.text for o in outs], dtype=object),
                "token_ids": _ragged([np.array(o.token_ids, dtype=np.int64) for o in outs]),
                "logprobs": _ragged([np.array(o.token_logprobs, dtype=np.float32) for o in outs]),
                "seed": np.array([o.seed for o in outs], dtype=np.int64)}

    def _seed(self, prompt: str | list[int], row_seed: Any) -> int:
        if row_seed is not None:
            return int(row_seed)
        if self.params.seed is not None:
            return self.params.seed
        return prompt_seed(prompt)


def prompt_seed(prompt: str | list[int]) -> int:
    """A 63-bit seed that depends only on the prompt (text, or token ids)."""
    data = prompt.encode() if isinstance(prompt, str) else np.asarray(prompt, "<i8").tobytes()
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "little") >> 1


def _prompt(p: Any) -> str | list[int]:
    return p if isinstance(p, str) else [int(t) for t in p]


def _ragged(rows: list[np.ndarray]) -> np.ndarray:
    """A 1-d object array of per-row arrays (numpy would stack equal lengths into 2-d)."""
    out = np.empty(len(rows), dtype=object)
    for i, r in enumerate(rows):
        out[i] = r
    return out
