"""The push exchange of row-parallel sums (``SAMEBITS_TP_PUSH=1``: a copy to the peer; ``=2``: the
GEMM's kernel stores into the peer's slot itself) on two GPUs: the bits of NCCL's gather. Skipped
without 2 CUDA devices. Every bits test runs at both levels.

What the tests prove:
- Layer level, two ranks connected as the engine connects them (``_rank``): every rank opens the
  exchange, fused exactly at level 2; for T = 1, 7, 64 and PUSH_MAX_ROWS rows (the split, split,
  fused-tree and segmented-TMA schedules) a row-parallel layer pushes and the pushed
  [2, T, H] is bitwise NCCL's gather of the same ``linear_sum``s, the layer's output one GPU's
  segmented ``linear``; at PUSH_MAX_ROWS + 1 it gathers; two layers (rings 0 and 1) captured in
  a CUDA graph on both ranks (the engine's ``as_captured`` variants) and replayed over new inputs
  return the eager bits. Negative control: a barrier without the copy (level 2: without the
  peer store) leaves the peer's slot holding an earlier step's sum, which differs from the
  gather.
- Engine level: TP 2 with push on (each level) returns bitwise the tokens and logprobs of TP 2 with push off,
  on a tiny Qwen3 and on Qwen3-8B's shapes (dummy weights, 16 prompts), with CUDA graphs and
  eager; both ranks issue the same collectives, the row-parallel layers push at T <= PUSH_MAX_ROWS
  (prefill and decode steps, captured graphs included) and gather above it (a 3000-token prefill
  step), and no fp32 row-parallel gather is left at T <= PUSH_MAX_ROWS. Negative control: the
  standard mode's all-reduce gives other logprobs than the invariant push.
- Ranks whose ``SAMEBITS_TP_PUSH`` differ both take the agreement on the level and connect
  (within 120 s): both gather where one is off, both copy (unfused) at 1 and 2.
- A rank killed mid-generate (each level): ``generate`` raises ``RankFailedError`` naming it
  within 30 s (the watcher's abort word ends rank 0's push barrier), and a new TP 2 engine then
  starts in the same process, gathers (torch's rendezvous runs once per process) and gives the
  bits of push off.
Every engine that must push runs in a process of its own (``_in_fresh_process``).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import socket
import threading
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")

from samebits import LLM, SamplingParams, env  # noqa: E402
from samebits.distributed.group import TPGroup  # noqa: E402
from samebits.distributed.symmetric import PUSH_MAX_ROWS  # noqa: E402
from samebits.engine.executor import RankFailedError  # noqa: E402
from samebits.models.parallel import RowParallelLinear  # noqa: E402
from samebits.ops.backend import row_parallel_bounds  # noqa: E402
from samebits.ops.triton import launcher  # noqa: E402
from samebits.ops.triton.backend import TritonBackend  # noqa: E402

CONFIGS = Path(__file__).parents[2] / "benchmarks" / "configs"
TINY, QWEN3_8B = str(CONFIGS / "qwen3-tiny.json"), str(CONFIGS / "qwen3-8b.json")
K, H, S = 4096, 1024, 8  # o_proj-like: 8 KV groups' columns, 4 a rank
TOKENS = [1, 7, 64, PUSH_MAX_ROWS, PUSH_MAX_ROWS + 1]
GRAPH_TOKENS = [1, 64, 256]


def _data(t: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    scale = torch.logspace(0, 2, K, device="cuda")
    return (torch.randn(t, K, device="cuda", generator=g) * scale).bfloat16()


def _barrier(group: TPGroup) -> None:
    """An NCCL gather, as every engine forward begins (the embedding's) and every graph replay
    is followed by (the LM head's): the ranks' earlier reads are done."""
    group.all_gather(torch.zeros(1, 1, device=group.device))


def _rank(rank: int, port: int, out: str) -> None:
    """One rank: its checks, as booleans, written to ``out``/rank-R.json."""
    torch.cuda.set_device(rank)
    ops = TritonBackend()
    group = TPGroup(rank, 2, torch.device("cuda", rank))
    layers = [RowParallelLinear(K, H, S, group, S).cuda() for _ in range(2)]  # rings 0 and 1
    group.connect(f"tcp://127.0.0.1:{port}")
    g = torch.Generator(device="cuda").manual_seed(0)  # the same full weights on both ranks
    w = (torch.randn(H, K, device="cuda", generator=g) / K ** 0.5).bfloat16()
    lo, hi = layers[0].weight.spec.span(0)
    for layer in layers:
        layer.weight.data = w[:, lo:hi].contiguous()
    full = row_parallel_bounds(K, S)
    checks: dict[str, bool] = {"exchange": group.exchange is not None,
                               "rings": [m.ring for m in layers] == [0, 1],
                               "fused": group.exchange is not None and group.exchange.fused,
                               "level": env.tp_push()}
    for t in TOKENS:
        x = _data(t, seed=t)
        mine = x[:, lo:hi].contiguous()
        gathered = group.all_gather(ops.linear_sum(mine, layers[0].weight, layers[0].k_bounds)
                                    .unsqueeze(0))
        checks[f"takes_push_{t}"] = group.push_slot(0, t, H) is not None
        checks[f"push_{t}"] = torch.equal(layers[0].rank_sums(ops, mine), gathered)
        checks[f"one_gpu_{t}"] = torch.equal(layers[1].gathered(ops, mine),
                                             ops.linear(x, w, k_bounds=full))
    checks |= _stale_slot(ops, group, layers[0], lo, hi)
    for t in GRAPH_TOKENS:
        checks |= _replayed(ops, group, layers, t, lo, hi, w, full)
    (Path(out) / f"rank-{rank}.json").write_text(json.dumps(checks))
    torch.distributed.barrier()
    torch.cuda.synchronize()
    os._exit(0)  # no teardown: the graphs captured the group's collectives


def _stale_slot(ops, group: TPGroup, layer, lo: int, hi: int) -> dict[str, bool]:
    """Negative control: this step's sum written into this rank's slot and the barrier met, but
    no copy to the peer (nor, fused, a peer store): the peer's slot here still holds the
    previous step's sum."""
    t, checks = 64, {}
    for seed in (1, 2):  # the first step pushes; the second skips the copy
        _barrier(group)
        mine = _data(t, seed=3000 + seed)[:, lo:hi].contiguous()
        gathered = group.all_gather(ops.linear_sum(mine, layer.weight, layer.k_bounds)
                                    .unsqueeze(0))
        if seed == 1:
            layer.rank_sums(ops, mine)
            continue
        slot = group.exchange.slot(layer.ring, t, H)
        ops.linear_sum(mine, layer.weight, layer.k_bounds, out=slot.view(t, H))
        group.exchange.barrier()
        stale = group.exchange.local[layer.ring, :2 * t * H].view(2, t, H)
        checks["negative_stale_slot"] = not torch.equal(stale, gathered)
    return checks


def _replayed(ops, group: TPGroup, layers, t: int, lo: int, hi: int, w, full
              ) -> dict[str, bool]:
    """Both layers (rings 0 and 1) on one input, captured in one graph and replayed."""
    static = _data(t, seed=1000 + t)[:, lo:hi].contiguous()

    def step() -> list[torch.Tensor]:
        return [layer.gathered(ops, static) for layer in layers]

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), launcher.as_captured():
        _barrier(group)
        step()  # the warm-up compiles the captured variants
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    _barrier(group)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), launcher.as_captured():
        outs = step()
    checks = {f"graph_pushes_{t}": group.last_ring == 1}
    for seed in range(3):
        x = _data(t, seed=2000 + 10 * t + seed)
        static.copy_(x[:, lo:hi])
        _barrier(group)
        graph.replay()
        _barrier(group)
        eager = [layer.gathered(ops, x[:, lo:hi].contiguous()) for layer in layers]
        want = ops.linear(x, w, k_bounds=full)
        checks[f"graph_{t}_{seed}"] = all(torch.equal(o, e) and torch.equal(o, want)
                                          for o, e in zip(outs, eager, strict=True))
    return checks


@pytest.fixture(scope="module", params=[1, 2], ids=["push1", "push2"])
def ranks(request, tmp_path_factory) -> tuple[list[dict], list[list[dict]]]:
    """Both ranks' checks and traces (``SAMEBITS_TP_TRACE``), push at level 1 or 2."""
    out = tmp_path_factory.mktemp("push")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    variables = {"SAMEBITS_TP_TRACE": str(out / "trace"), "SAMEBITS_TP_PUSH": str(request.param)}
    os.environ.update(variables)  # read by both ranks at connect
    try:
        torch.multiprocessing.spawn(_rank, args=(port, str(out)), nprocs=2, join=True)
    finally:
        for name in variables:
            del os.environ[name]
    checks = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(2)]
    traces = [_trace(out / "trace", r) for r in range(2)]
    return checks, traces


def _trace(directory: Path, rank: int) -> list[dict]:
    return [json.loads(line) for line in (directory / f"rank-{rank}.jsonl").read_text()
            .splitlines()]


def test_every_rank_opens_the_exchange_and_layers_alternate_rings(ranks):
    assert all(c["exchange"] and c["rings"] for c in ranks[0])
    assert all(c["fused"] == (c["level"] == 2) for c in ranks[0])


def test_layers_push_up_to_the_rings_rows_then_gather(ranks):
    for checks in ranks[0]:
        assert [checks[f"takes_push_{t}"] for t in TOKENS] == [True] * 4 + [False]
    trace = ranks[1][0]
    assert trace == ranks[1][1]  # the same collectives in the same order
    pushes = {e["shape"][0] for e in trace if e["op"] == "push"}
    assert set(TOKENS[:4]) <= pushes and max(pushes) == PUSH_MAX_ROWS
    assert {"op": "all_gather", "shape": [1, PUSH_MAX_ROWS + 1, H], "dtype": "float32"} in trace


@pytest.mark.parametrize("t", TOKENS)
def test_pushed_sums_are_the_gathers_and_one_gpus_segmented_linear(ranks, t):
    for checks in ranks[0]:
        assert checks[f"push_{t}"] and checks[f"one_gpu_{t}"]


@pytest.mark.parametrize("t", GRAPH_TOKENS)
def test_pushes_replayed_from_a_cuda_graph_equal_eager(ranks, t):
    for checks in ranks[0]:
        assert checks[f"graph_pushes_{t}"]
        assert all(checks[f"graph_{t}_{seed}"] for seed in range(3))


def test_negative_control_a_barrier_without_the_copy_or_peer_store_leaves_a_stale_slot(ranks):
    assert all(c["negative_stale_slot"] for c in ranks[0])


# ---- the engine ------------------------------------------------------------------------------

PROMPTS = [[3 + i] * (5 + 37 * i) for i in range(16)]
PARAMS = [SamplingParams(max_tokens=16, temperature=0.8 * (i % 2), seed=i, ignore_eos=True)
          for i in range(16)]
OPTIONS = dict(load_format="dummy", device="cuda", dtype="bfloat16", seed=0, max_num_seqs=16,
               max_model_len=4096)
KV = {TINY: 1 << 28, QWEN3_8B: 1 << 30}


def _engine(config: str, push: int, trace: Path | None = None, **options) -> LLM:
    """A TP 2 engine with push at level ``push`` (0: off) (and each rank's collectives in
    ``trace``); the variables are read by both ranks when they connect."""
    variables = {"SAMEBITS_TP_PUSH": str(push)} | (
        {"SAMEBITS_TP_TRACE": str(trace)} if trace else {})
    os.environ.update(variables)
    try:
        return LLM(config, tensor_parallel_size=2, kv_cache_memory_bytes=KV[config],
                   **OPTIONS | options)
    finally:
        for name in variables:
            del os.environ[name]


def _in_fresh_process(fn, *args, timeout: float = 300, **kwargs):
    """``fn(*args, **kwargs)`` in a newly spawned process, its result or its exception here (or
    a ``TimeoutError`` after ``timeout`` s, the child killed): torch's symmetric-memory
    rendezvous runs once per process (a later engine of the process gathers:
    ``symmetric._RENDEZVOUSED``), so an engine that must push is the first of its process."""
    context = mp.get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=_send_result, args=(send, fn, args, kwargs))
    child.start()
    send.close()
    try:
        if not receive.poll(timeout):
            raise TimeoutError(f"{fn.__name__} gave no result within {timeout} s")
        ok, value = receive.recv()
    finally:
        if child.is_alive():
            child.kill()
        child.join()
    if not ok:
        raise value
    return value


def _send_result(send, fn, args: tuple, kwargs: dict) -> None:
    """A fresh process's body: (True, result) or (False, the exception) into ``send``."""
    try:
        send.send((True, fn(*args, **kwargs)))
    except BaseException as e:  # noqa: BLE001 -- handed to the parent
        send.send((False, e))


def _generate(config: str, push: int, trace: Path | None = None, prompts=PROMPTS,
              params=PARAMS, **options) -> list[tuple[list[int], list[float]]]:
    """TP 2's tokens and logprobs with push at level ``push`` (0: off) (and each rank's
    collectives in ``trace``), from an engine that is the first of its process."""
    return _in_fresh_process(_generate_here, config, push, trace, prompts, params, **options)


def _generate_here(config: str, push: int, trace: Path | None = None, prompts=PROMPTS,
                   params=PARAMS, **options) -> list[tuple[list[int], list[float]]]:
    """``_generate`` in this process."""
    llm = _engine(config, push, trace, **options)
    try:
        return [(o.outputs[0].token_ids, o.outputs[0].token_logprobs)
                for o in llm.generate(prompts, params)]
    finally:
        llm.engine.runner.shutdown()


@pytest.fixture(scope="module", params=[TINY, QWEN3_8B], ids=["tiny", "qwen3-8b"])
def gathered(request) -> tuple[str, list]:
    """TP 2 with CUDA graphs, push off: the bits to match."""
    return request.param, _generate(request.param, push=0)


LEVELS = pytest.mark.parametrize("level", [1, 2], ids=["push1", "push2"])


@LEVELS
def test_push_with_cuda_graphs_equals_the_gather(gathered, level, tmp_path):
    config, want = gathered
    assert _generate(config, push=level, trace=tmp_path) == want
    rank_0 = _trace(tmp_path, 0)
    assert rank_0 == _trace(tmp_path, 1)
    assert sum(e["op"] == "push" for e in rank_0) > 0


@LEVELS
def test_push_eager_equals_the_gather(gathered, level):
    config, want = gathered
    assert _generate(config, push=level, enforce_eager=True) == want


@LEVELS
def test_the_engine_pushes_up_to_the_rings_rows_and_gathers_above(level, tmp_path):
    """A 3000-token prompt prefilled in one step (T > PUSH_MAX_ROWS: the gather) among short
    ones (prefill and decode steps that push); the bits are push off's."""
    prompts = [[5] * 3000] + PROMPTS[:3]
    params = PARAMS[:4]
    options = dict(max_num_batched_tokens=4096, prompts=prompts, params=params)
    assert _generate(TINY, push=level, trace=tmp_path, **options) == \
        _generate(TINY, push=0, **options)
    trace = _trace(tmp_path, 0)
    assert trace == _trace(tmp_path, 1)
    hidden = json.loads(Path(TINY).read_text())["hidden_size"]
    pushes = [e["shape"][0] for e in trace if e["op"] == "push"]
    row_gathers = [e["shape"][1] for e in trace if e["op"] == "all_gather"
                   and e["dtype"] == "float32" and e["shape"][-1] == hidden]
    assert pushes and max(pushes) <= PUSH_MAX_ROWS and 1 in pushes  # decode steps push
    assert row_gathers and min(row_gathers) > PUSH_MAX_ROWS  # only the long steps gather


def test_negative_control_the_standard_modes_all_reduce_differs_from_the_push():
    push = _generate(TINY, push=2)
    standard = _generate(TINY, push=2, batch_invariant=False)
    assert [lp for _, lp in push] != [lp for _, lp in standard]


def _mixed_rank(rank: int, port: int, out: str, levels: tuple[str, str]) -> None:
    """One rank connecting with its own ``SAMEBITS_TP_PUSH`` (``levels[rank]``): whether it
    opened an exchange, fused or not, and whether a row-parallel layer's [2, T, H] is the
    gather's."""
    os.environ["SAMEBITS_TP_PUSH"] = levels[rank]
    torch.cuda.set_device(rank)
    ops, group = TritonBackend(), TPGroup(rank, 2, torch.device("cuda", rank))
    layer = RowParallelLinear(K, H, S, group, S).cuda()
    group.connect(f"tcp://127.0.0.1:{port}")
    lo, hi = layer.weight.spec.span(0)
    g = torch.Generator(device="cuda").manual_seed(0)  # the same full weights on both ranks
    layer.weight.data = (torch.randn(H, K, device="cuda", generator=g) / K ** 0.5).bfloat16()[
        :, lo:hi].contiguous()
    mine = _data(7, seed=7)[:, lo:hi].contiguous()
    gathered = group.all_gather(ops.linear_sum(mine, layer.weight, layer.k_bounds).unsqueeze(0))
    checks = {"exchange": group.exchange is not None,
              "fused": group.exchange is not None and group.exchange.fused,
              "bits": torch.equal(layer.rank_sums(ops, mine), gathered)}
    (Path(out) / f"rank-{rank}.json").write_text(json.dumps(checks))
    torch.distributed.barrier()
    torch.cuda.synchronize()
    os._exit(0)


@pytest.mark.parametrize("levels,exchange,fused", [(("2", "0"), False, False),
                                                   (("0", "1"), False, False),
                                                   (("2", "1"), True, False),
                                                   (("1", "2"), True, False)])
def test_ranks_whose_push_variables_differ_agree_and_connect_without_waiting(
        levels, exchange, fused, tmp_path):
    """Each rank reads its own ``SAMEBITS_TP_PUSH``: both take the agreement and then the
    smallest level (off: both gather; 1 and 2: both copy, unfused), within 120 s (a rank that
    skipped the agreement would leave its peer in it for the group's 30-minute timeout)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = torch.multiprocessing.spawn(_mixed_rank, args=(port, str(tmp_path), levels),
                                          nprocs=2, join=False)
    deadline = time.monotonic() + 120
    try:
        while not context.join(timeout=max(0.0, deadline - time.monotonic())):
            assert time.monotonic() < deadline, "the ranks did not connect within 120 s"
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    for rank in range(2):
        checks = json.loads((tmp_path / f"rank-{rank}.json").read_text())
        assert checks == {"exchange": exchange, "fused": fused, "bits": True}


@LEVELS
def test_a_rank_killed_mid_generate_raises_naming_it_within_30s_then_a_new_engine_gathers(level):
    """Rank 1 killed (SIGKILL) while rank 0 generates on a thread: rank 0's push barrier, which
    waits for rank 1's signal, returns once the watcher sets the abort word (``TPGroup.abort``),
    and ``generate`` raises ``RankFailedError`` naming rank 1 within 30 s (torch's symmetric-
    memory barrier would spin until its 30-minute timeout). The CUDA context survives (no trap),
    so a new TP 2 engine then starts in the same process; it gathers (torch's rendezvous runs
    once per process) and its bits are those of push off in another process. In a fresh
    process."""
    got = _in_fresh_process(_killed_then_new_engine, level)
    assert got == _generate(TINY, push=0, prompts=PROMPTS[:4], params=PARAMS[:4])


def _killed_then_new_engine(level: int) -> list:
    llm = _engine(TINY, push=level)
    assert llm.engine.runner.group.exchange is not None
    failed: list[tuple[BaseException, float]] = []

    def run() -> None:
        try:
            llm.generate(PROMPTS[:8], SamplingParams(max_tokens=3000, ignore_eos=True))
        except BaseException as e:  # noqa: BLE001 -- the test reads it
            failed.append((e, time.monotonic()))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        time.sleep(2.0)
        assert thread.is_alive(), "generate ended before rank 1 was killed"
        killed = time.monotonic()
        os.kill(llm.engine.runner.peers.procs[1].pid, signal.SIGKILL)
        thread.join(30)
        assert not thread.is_alive(), "generate still runs 30 s after rank 1 was killed"
    finally:
        llm.engine.runner.shutdown()
    assert failed, "generate returned without raising"
    (error, when), = failed
    assert isinstance(error, RankFailedError) and "rank 1" in str(error)
    assert when - killed < 30
    again = _engine(TINY, push=level)
    try:
        assert again.engine.runner.group.exchange is None
        got = [(o.outputs[0].token_ids, o.outputs[0].token_logprobs)
               for o in again.generate(PROMPTS[:4], PARAMS[:4])]
    finally:
        again.engine.runner.shutdown()
    return got
