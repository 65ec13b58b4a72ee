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
