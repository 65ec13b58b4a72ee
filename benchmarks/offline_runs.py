"""The offline side of benchmarks/server_vs_offline.py: the same engine as the server's, driven
by ``LLM.generate`` in this process; a run's tokens/s, output hashes, engine steps and CPU
seconds, and the time to a first token with its share in engine steps.

samebits is imported inside the functions: spawned client processes import the benchmark's
modules, and must stay light.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Load:
    prompts: list[list[int]]
    max_tokens: int
    concurrency: int


@dataclass(frozen=True)
class TTFTPair:
    """Seconds of one offline and one served first token, measured back to back."""

    offline: float  # LLM.generate of one token
    offline_in_steps: float  # of it, in engine steps
    served: float  # sending the request to reading its first chunk
    served_in_engine: float  # of it, from arrival (RequestGroup.arrival) to the step's end

    @property
    def outside_diff(self) -> float:
        """What serving adds outside the engine step: HTTP in, parsing, the hand-over and the
        first chunk out, less what ``LLM.generate`` spends outside its step."""
        return (self.served - self.served_in_engine) - (self.offline - self.offline_in_steps)


def offline_engine(opts: dict, invariant: bool, threads: int | None):
    import torch  # here, not at the top: see the module docstring

    from samebits import LLM

    if threads:
        torch.set_num_threads(threads)
    return LLM(**opts, batch_invariant=invariant)


def offline_run(llm, load: Load) -> tuple[float, list[str], dict]:
    """(generated tok/s, output hash per request, diagnostics) of one ``LLM.generate`` call."""
    from samebits import SamplingParams
    from samebits.server.output_hash import output_hash

    params = SamplingParams(max_tokens=load.max_tokens, temperature=0.0, ignore_eos=True)
    steps, step = [0], llm.engine.step

    def counted():
        progressed = step()
        steps[0] += bool(progressed)
        return progressed
    llm.engine.step = counted
    cpu, t0 = _cpu_s(), time.perf_counter()
    try:
        outs = llm.generate(load.prompts, params, use_tqdm=False)
    finally:
        del llm.engine.step
    wall = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    hashes = [output_hash([(o.outputs[0].token_ids, o.outputs[0].token_logprobs)]) for o in outs]
    return tokens / wall, hashes, run_diag(wall, steps[0], cpu_s=_cpu_s() - cpu)


def offline_ttft_s(llm, prompt: list[int]) -> tuple[float, float]:
    """(seconds of an ``LLM.generate`` of one token, seconds of it spent in engine steps)."""
    from samebits import SamplingParams

    in_steps, step = [0.0], llm.engine.step

    def timed():
        t = time.perf_counter()
        try:
            return step()
        finally:
            in_steps[0] += time.perf_counter() - t
    llm.engine.step = timed
    t0 = time.perf_counter()
    try:
        llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
                     use_tqdm=False)
    finally:
        del llm.engine.step
    return time.perf_counter() - t0, in_steps[0]


def _cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def run_diag(wall: float, steps: float, **cpu: float) -> dict:
    return {"wall_s": round(wall, 2), "steps": int(steps),
            "ms_per_step": round(1e3 * wall / max(steps, 1), 2),
            **{k: round(v, 2) for k, v in cpu.items()}}
