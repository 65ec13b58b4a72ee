"""What announcing a model call to another rank costs: the shared-memory ``MessageQueue`` against
gloo's ``broadcast_object_list`` (what ``TPGroup.broadcast_object`` used alone), one spawned reader,
a batch-64 decode step's message (``("replay", (DecodeBatch, slot, from_tokens))``, block tables
of ``--context`` tokens). JSON lines:

- per variant: the round trip (rank 0 announces through ``TPGroup.broadcast_object``, the reader
  takes it and answers with a tiny message the same way back) and rank 0's own time inside the
  announcement (what a step's host path pays), median and p90 in microseconds;
- ``ratio``: queue / gloo for both, measured in the same run;
- ``idle``: the reader's CPU share (of one core) while it waits ``--idle`` seconds for a message
  that does not come, after the queue's spin phase, and gloo's blocked reader beside it.

    python benchmarks/announce.py
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import platform
import socket
import statistics
import time

import torch.distributed as dist
import torch.multiprocessing as mp

from samebits.distributed.group import TPGroup
from samebits.distributed.message_queue import SPIN_S, MessageQueue
from samebits.engine.cuda_graph import DecodeBatch

BATCH, BLOCK = 64, 16


def decode_message(context: int) -> tuple:
    """A batch-64 decode step's "replay" announcement at ``context`` tokens per sequence."""
    blocks = -(-context // BLOCK)
    tables = [list(range(s * blocks, (s + 1) * blocks)) for s in range(BATCH)]
    batch = DecodeBatch(input_ids=[1000 + s for s in range(BATCH)], positions=[context - 1] * BATCH,
                        slots=[t[-1] * BLOCK + (context - 1) % BLOCK for t in tables],
                        block_tables=tables)
    return ("replay", (batch, "main", True))


def _cpu_seconds(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _reader(init: str, handles, back, iters: int) -> None:
    """Rank 1: answer every announcement (``iters`` per variant), then wait for one more."""
    group = TPGroup(1, 2)
    group.connect(init)
    group.queue = reader = MessageQueue.attach(handles, 0)
    ack = MessageQueue.create(readers=1)
    back.send(ack.handle)
    for _ in range(iters):  # the queue
        group.broadcast_object()
        ack.enqueue(("ack", ()), _no_fallback)
    group.broadcast_object()  # idle: rank 0 measures this process's CPU while it waits here
    group.queue = None
    for _ in range(iters):  # gloo
        group.broadcast_object()
        dist.broadcast_object_list([("ack", ())], src=1)
    group.broadcast_object()  # idle, blocked in gloo
    ack.close()
    reader.close()


def _no_fallback(*args: object) -> object:
    raise RuntimeError("an ack never exceeds a slot")


def _gloo_ack() -> None:
    dist.broadcast_object_list([None], src=1)


def _timed(announce, answer, message, iters: int) -> dict:
    rounds, inside = [], []
    for _ in range(iters):
        t0 = time.perf_counter()
        announce(message)
        t1 = time.perf_counter()
        answer()
        rounds.append(time.perf_counter() - t1 + (t1 - t0))
        inside.append(t1 - t0)
    return {"round_trip_us": _us(rounds), "announce_us": _us(inside)}


def _us(samples: list[float]) -> dict:
    samples = sorted(samples[len(samples) // 10:])  # the first tenth warms up
    return {"median": round(1e6 * statistics.median(samples), 1),
            "p90": round(1e6 * samples[int(0.9 * len(samples))], 1)}


def _idle_share(pid: int, seconds: float) -> float:
    time.sleep(SPIN_S + 0.1)  # past the spin phase
    c0, t0 = _cpu_seconds(pid), time.monotonic()
    time.sleep(seconds)
    return round((_cpu_seconds(pid) - c0) / (time.monotonic() - t0), 4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--context", type=int, default=1280, help="tokens per sequence")
    parser.add_argument("--idle", type=float, default=3.0, help="seconds of idle measured")
    args = parser.parse_args()
    message = decode_message(args.context)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        init = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    queue = MessageQueue.create(readers=1)
    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_reader, args=(init, queue.handle, theirs, args.iters))
    proc.start()
    group = TPGroup(0, 2)
    group.connect(init)
    group.queue = queue
    ack = MessageQueue.attach(mine.recv(), 0)
    host = {"cpus": os.cpu_count(), "machine": platform.processor() or platform.machine(),
            "message_bytes": len(pickle.dumps(message, protocol=5)), "context": args.context}
    results = {"queue": _timed(group.broadcast_object, lambda: ack.dequeue(_no_fallback), message,
                               args.iters)}
    idle = {"queue": _idle_share(proc.pid, args.idle)}
    group.broadcast_object(("go", ()))
    group.queue = None
    results["gloo"] = _timed(group.broadcast_object, _gloo_ack, message, args.iters)
    idle["gloo"] = _idle_share(proc.pid, args.idle)
    group.broadcast_object(("go", ()))
    proc.join(30)
    for variant, figures in results.items():
        print(json.dumps({"bench": "announce", "variant": variant} | host | figures))
    print(json.dumps({"bench": "announce", "ratio": "queue/gloo"} | {
        key: round(results["queue"][key]["median"] / results["gloo"][key]["median"], 3)
        for key in ("round_trip_us", "announce_us")}))
    print(json.dumps({"bench": "announce", "idle_cpu_share": idle, "spin_s": SPIN_S,
                      "idle_s": args.idle}))
    ack.close()
    queue.close()
    group.leave()


if __name__ == "__main__":
    main()
