"""``TrainableLM``: the engine's own decoder with autograd, for the trainer side of RL.

The module is the engine's model class (from the registry) over ``DifferentiableOps`` of the
engine's op backend: the forward runs the very kernels the engine runs, so with the invariant
backend ``logprobs`` is bitwise what the engine reported when it sampled those tokens -- whatever
the trainer's batch (its size, order, or lengths), because every kernel's row bits depend on the
row alone and the trainer's prefill follows the same attention arithmetic as the engine's decode.
The backward is the stock formulas' (deterministic, see ``samebits.ops.autograd``).

The weights are a copy: the engine changes only through ``LLM.update_weights(tl.named_weights())``,
which moves its fingerprint.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from samebits.config import EngineConfig, ModelConfig
from samebits.loader import build_model, load
from samebits.models.weights import WeightMap
from samebits.ops.autograd import DifferentiableOps
from samebits.ops.backend import AttentionMetadata

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json",
                    "special_tokens_map.json", "chat_template.jinja")


@dataclasses.dataclass(frozen=True)
class _Source:
    """What the trainer needs from the engine's configuration."""

    config: EngineConfig
    model_config: ModelConfig
    model_dir: Path
    max_model_len: int


class TrainableLM(nn.Module):
    """``TrainableLM(model=None, **LLM options)`` or ``TrainableLM.from_llm(llm)``."""

    def __init__(self, model: str | None = None, *, _from: tuple[nn.Module, _Source] | None = None,
                 **options: Any) -> None:
        super().__init__()
        if _from is None:
            config = EngineConfig(model=model, **options)
            loaded = load(config)
            _from = (loaded.model, _Source(config, loaded.model_config, loaded.model_dir,
                                           loaded.max_model_len))
        src_model, self.source = _from
        ops = DifferentiableOps(src_model.ops)
        dtype = next(src_model.parameters()).dtype
        device = next(src_model.parameters()).device
        self.model = build_model(self.source.model_config, ops, self.source.max_model_len,
                                 device, dtype)
        with torch.no_grad():
            for p, q in zip(self.model.parameters(), src_model.parameters(), strict=True):
                p.copy_(q)
                p.requires_grad_(True)

    @classmethod
    def from_llm(cls, llm: Any) -> TrainableLM:
        """A trainer over a copy of ``llm``'s current weights, on its device, in its dtype (one
        device: a tensor-parallel rank holds only its shard)."""
        engine = llm.engine
        if engine.config.tensor_parallel_size > 1:
            raise ValueError("TrainableLM.from_llm needs the whole model: build it from an LLM "
                             "with tensor_parallel_size=1, or TrainableLM(model, ...)")
        src = _Source(engine.config, engine.loaded.model_config, engine.loaded.model_dir,
                      engine.max_model_len)
        return cls(_from=(engine.loaded.model, src))

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    # ---- the forward ---------------------------------------------------------------------
    def logprobs(self, seqs: Sequence[Sequence[int]], starts: Sequence[int]) -> list[torch.Tensor]:
        """For each token list and start s >= 1: logprob of token i given tokens < i, for i in
        [s, len), as one 1-D tensor (with ``requires_grad``): the raw distribution's logprobs."""
        seqs = [list(s) for s in seqs]
        if len(starts) != len(seqs):
            raise ValueError(f"got {len(starts)} starts for {len(seqs)} sequences")
        for seq, s in zip(seqs, starts, strict=True):
            if not 1 <= s <= len(seq) or len(seq) > self.source.max_model_len:
                raise ValueError(f"start {s} is outside [1, {len(seq)}] (or the sequence is "
                                 f"over max_model_len={self.source.max_model_len})")
        hidden = self._hidden(seqs)  # [T, H], flat
        offsets = [0]
        for seq in seqs:
            offsets.append(offsets[-1] + len(seq))
        rows = [o + p for o, seq, s in zip(offsets[:-1], seqs, starts, strict=True)
                for p in range(s - 1, len(seq) - 1)]
        targets = [t for seq, s in zip(seqs, starts, strict=True) for t in seq[s:]]
        dev = self.device
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=dev)])
        picked = self.model.ops.log_softmax(logits).gather(
            1, torch.tensor(targets, device=dev)[:, None])[:, 0]
        return list(picked.split([len(seq) - s for seq, s in zip(seqs, starts, strict=True)]))

    forward = logprobs

    def _hidden(self, seqs: list[list[int]]) -> torch.Tensor:
        """One prefill of every sequence over a fresh paged cache (what the engine computes)."""
        bs, dev = self.source.config.block_size, self.device
        cfg = self.source.model_config
        blocks = [-(-len(s) // bs) for s in seqs]
        tables, first = [], 0
        for n in blocks:
            tables.append(list(range(first, first + n)) + [0] * (max(blocks) - n))
            first += n
        slots = [tables[i][p // bs] * bs + p % bs for i, s in enumerate(seqs) for p in range(len(s))]
        lens = [len(s) for s in seqs]
        qsl = [0]
        for n in lens:
            qsl.append(qsl[-1] + n)
        meta = AttentionMetadata(
            torch.tensor(tables, dtype=torch.int32, device=dev),
            torch.tensor(lens, dtype=torch.int32, device=dev),
            torch.tensor(qsl, dtype=torch.int32, device=dev),
            torch.tensor(slots, dtype=torch.int64, device=dev), tuple(lens), tuple(qsl), bs,
            self.source.config.attention_split_size)
        shape = (first + 1, bs, cfg.num_key_value_heads, cfg.head_dim)
        dtype = self.model.embed_tokens.weight.dtype
        caches = [(torch.zeros(shape, dtype=dtype, device=dev), torch.zeros(shape, dtype=dtype, device=dev))
                  for _ in range(cfg.num_hidden_layers)]
        ids = torch.tensor([t for s in seqs for t in s], device=dev)
        pos = torch.tensor([p for n in lens for p in range(n)], device=dev)
        return self.model(ids, pos, caches, self.model.ops.plan_attention(meta))

    # ---- weights out ---------------------------------------------------------------------
    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face name, detached tensor view) of every weight, q/k/v and gate/up unfused."""
        return WeightMap(self.model).named_weights()

    def named_grads(self) -> Iterator[tuple[str, torch.Tensor | None]]:
        """(Hugging Face name, gradient or None) of every weight, unfused like ``named_weights``."""
        return WeightMap(self.model).named_grads()

    def save_pretrained(self, directory: str | Path) -> Path:
        """config.json + model.safetensors (+ the tokenizer files): an HF model directory that
        ``LLM(dir)`` and transformers both load."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        src = self.source.model_dir
        cfg = json.loads((src / "config.json").read_text(encoding="utf-8"))
        cfg["torch_dtype"] = str(self.model.embed_tokens.weight.dtype).removeprefix("torch.")
        (out / "config.json").write_text(json.dumps(cfg, indent=2), encoding="utf-8")
        tensors = {n: t.detach().contiguous().cpu().clone() for n, t in self.named_weights()}
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        for name in _TOKENIZER_FILES:
            if (src / name).is_file():
                shutil.copyfile(src / name, out / name)
        return out
