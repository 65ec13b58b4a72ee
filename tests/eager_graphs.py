"""A CPU stand-in for the CUDA decode graphs (tests of the runner's graph branch on CPU)."""

from __future__ import annotations


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
    T tokens runs over its bucket's rows (padding: token 0 at position 0, written to
    ``pad_slot``, the scratch block's first slot unless a test says otherwise), the model under
    the graphs' splitter, and each layer's attention runs at its cut over the T real rows."""

    def __init__(self, runner, max_tokens: int, pad_slot: int | None = None) -> None:
        import torch

        from samebits.engine.piecewise_graph import token_buckets
        self.runner, self.max_tokens = runner, max_tokens
        self.largest = token_buckets(max_tokens)[-1]
        attn = runner.model.layers[0].self_attn
        self.q = torch.zeros(self.largest, attn.hq, attn.d, dtype=runner.dtype)
        self.o = torch.zeros_like(self.q)
        self.pad_slot = runner.num_blocks * runner.block_size if pad_slot is None else pad_slot
        self.steps = 0

    def covers(self, num_tokens: int) -> bool:
        return 0 < num_tokens <= self.max_tokens

    def run(self, input_ids, positions, slots, meta):
        import dataclasses

        import torch

        from samebits.engine.piecewise_graph import _Splitter, token_bucket
        t, model = len(input_ids), self.runner.model
        pad = min(token_bucket(t), self.largest) - t
        ids = torch.tensor(list(input_ids) + [0] * pad)
        pos = torch.tensor(list(positions) + [0] * pad)
        padded = dataclasses.replace(meta, slot_mapping=torch.tensor(
            list(slots) + [self.pad_slot] * pad))
        ops = model.ops

        def cut() -> None:
            k_cache, v_cache, scale = splitter.calls[-1]
            ops.attention(self.q[:t], k_cache, v_cache, meta, scale, out=self.o[:t])

        model.ops = splitter = _Splitter(ops, self.q, self.o, cut)
        try:
            hidden = model(ids, pos, self.runner.kv_caches, padded)
        finally:
            model.ops = ops
        self.steps += 1
        return hidden[:t]
