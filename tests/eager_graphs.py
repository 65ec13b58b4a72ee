"""CPU stand-ins for the CUDA graphs, decode and piecewise (the runner's graph branches on CPU)."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from samebits.engine.piecewise_graph import bucket_of, fill_inputs, split_ops, token_buckets


class EagerGraphs:
    """Stands in for the CUDA decode graphs on CPU: the runner takes its graph branch for decode
    steps (one token a sequence) and each replay is the eager forward of the same tokens."""

    def __init__(self, runner) -> None:
        self.runner = runner

    def fits(self, batch: int) -> bool:
        return True

    def covers(self, decode) -> bool:
        return True

    def run(self, decode, tokens=None) -> object:
        from samebits.engine.step import ForwardInputs
        ids = decode.input_ids if tokens is None else tokens.tolist()
        n, width = len(ids), max(len(t) for t in decode.block_tables)
        return self.runner._forward(ForwardInputs(
            list(ids), list(decode.positions), list(decode.slots),
            [p + 1 for p in decode.positions], list(range(n + 1)),
            [t + [0] * (width - len(t)) for t in decode.block_tables]))


class EagerPiecewise:
    """Stands in for the piecewise CUDA graphs on CPU, in the order a replay runs: a forward of
    T tokens runs over its bucket's rows (``fill_inputs``' padding: token 0 at position 0,
    written to ``pad_slot``, the scratch block's first slot unless a test says otherwise), the
    model under the graphs' splitter, and each layer's attention runs at its cut over the T
    real rows. Like a chain, it returns a view of its bucket's own output buffer, which the
    bucket's next forward overwrites."""

    def __init__(self, runner, max_tokens: int, pad_slot: int | None = None) -> None:
        self.runner, self.max_tokens = runner, max_tokens
        self.buckets = token_buckets(max_tokens)
        attn = runner.model.layers[0].self_attn
        self.q = torch.zeros(self.buckets[-1], attn.hq, attn.d, dtype=runner.dtype)
        self.o = torch.zeros_like(self.q)
        self.slots = torch.zeros(self.buckets[-1], dtype=torch.int64)  # the staged slots
        slot = runner.num_blocks * runner.block_size if pad_slot is None else pad_slot
        self.pad = np.array([0, 0, slot], dtype=np.int64)[:, None]
        self.hidden: dict[int, torch.Tensor] = {}
        self.steps = 0

    def covers(self, num_tokens: int) -> bool:
        return 0 < num_tokens <= self.max_tokens

    def run(self, input_ids, positions, slots, meta) -> torch.Tensor:
        t, model, bucket = len(input_ids), self.runner.model, bucket_of(len(input_ids), self.buckets)
        host = np.empty((3, bucket), dtype=np.int64)
        fill_inputs(host, input_ids, positions, slots, self.pad)
        ids, pos, slots_t = torch.from_numpy(host)
        self.slots[:bucket] = slots_t
        ops = model.ops

        def cut() -> None:
            k_cache, v_cache, scale = splitter.calls[-1]
            ops.attention(self.q[:t], k_cache, v_cache, meta, scale, out=self.o[:t])

        with split_ops(model, self.q, self.o, cut) as splitter:
            hidden = model(ids, pos, self.runner.kv_caches,
                           dataclasses.replace(meta, slot_mapping=self.slots[:bucket]))
        self.steps += 1
        out = self.hidden.setdefault(bucket, torch.empty_like(hidden))
        return out.copy_(hidden)[:t]
