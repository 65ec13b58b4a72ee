"""The shared-memory broadcast queue that carries rank 0's announcements to the other ranks.

What they prove: readers get every message in order across many wrap-arounds of a small ring,
each of several reader processes gets all of them, and a message larger than a slot arrives
through the fallback in its place in the order; the writer never overwrites a slot a reader has
not read (a full ring times out, and frees when read); a reader that dies makes a waiting writer
raise its ``check``'s error, not wait; a writer that is closed, or whose process is killed, leaves
nothing in /dev/shm. Through the engine (CPU, gloo, TP 2) with slots too small for most
messages: the tokens equal TP 1's after a weight update sent through the gloo fallback, the
segment is gone after shutdown, and a killed rank makes the announcing rank 0 raise
``RankFailedError`` naming it within 30 s.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from samebits import LLM, SamplingParams
from samebits.distributed import message_queue
from samebits.distributed.message_queue import MessageQueue, QueueHandle
from samebits.engine.executor import RankFailedError
from tests.tiny_models import MICRO_LLAMA_CONFIG, write_config

SHM = Path("/dev/shm")
CTX = mp.get_context("fork")  # the queue only: fast to start


def _no_fallback(*args: object) -> object:
    raise AssertionError("the fallback was used for a message that fits a slot")


def test_one_reader_gets_every_message_in_order_across_wrap_arounds():
    writer = MessageQueue.create(readers=1, slots=3, slot_bytes=128)
    reader = MessageQueue.attach(writer.handle, 0)
    try:
        got = []
        for n in range(40):  # the writer runs up to 3 messages ahead of the reader
            assert writer.enqueue(("op", n), _no_fallback, timeout=0)
            if n % 3 == 2:
                got += [reader.dequeue(_no_fallback, timeout=1) for _ in range(3)]
        got.append(reader.dequeue(_no_fallback, timeout=1))
        assert got == [("op", n) for n in range(40)]
    finally:
        reader.close()
        writer.close()


def test_a_message_of_exactly_a_slot_goes_inline_one_byte_more_through_the_fallback():
    writer = MessageQueue.create(readers=1, slots=2, slot_bytes=256)
    reader = MessageQueue.attach(writer.handle, 0)
    sent = []
    try:
        for size in (256, 257):
            payload = b"x" * size
            while len(pickle.dumps(payload, protocol=5)) > size:  # the pickle is `size` bytes
                payload = payload[:-1]
            assert len(pickle.dumps(payload, protocol=5)) == size
            assert writer.enqueue(payload, sent.append, timeout=0)
            got = reader.dequeue(lambda p=payload: p, timeout=1)
            assert got == payload
        assert sent == [payload]  # only the 257-byte message took the fallback
    finally:
        reader.close()
        writer.close()


def test_a_full_ring_is_never_overwritten():
    writer = MessageQueue.create(readers=2, slots=2, slot_bytes=64)
    readers = [MessageQueue.attach(writer.handle, r) for r in range(2)]
    try:
        assert writer.enqueue(0, _no_fallback, timeout=0)
        assert writer.enqueue(1, _no_fallback, timeout=0)
        assert not writer.enqueue(2, _no_fallback, timeout=0.01)  # nobody read message 0
        assert readers[0].dequeue(_no_fallback, timeout=1) == 0
        assert not writer.enqueue(2, _no_fallback, timeout=0.01)  # reader 1 has not
        assert readers[1].dequeue(_no_fallback, timeout=1) == 0
        assert writer.enqueue(2, _no_fallback, timeout=0)
        assert [r.dequeue(_no_fallback, timeout=1) for r in readers] == [1, 1]
        assert [r.dequeue(_no_fallback, timeout=1) for r in readers] == [2, 2]
        with pytest.raises(TimeoutError):
            readers[0].dequeue(_no_fallback, timeout=0.01)
    finally:
        for r in readers:
            r.close()
        writer.close()


def _read_all(handle: QueueHandle, reader: int, count: int, pipe, results) -> None:
    queue = MessageQueue.attach(handle, reader)
    results.send([queue.dequeue(pipe.recv, timeout=30) for _ in range(count)])


def _message(n: int) -> object:
    """Every 7th message is larger than the 256-byte slots."""
    return ("large", n, bytes(1000)) if n % 7 == 3 else ("small", n, list(range(n % 5)))


def test_several_reader_processes_get_every_message_large_ones_through_the_fallback():
    writer = MessageQueue.create(readers=3, slots=4, slot_bytes=256)
    pipes = [CTX.Pipe(duplex=False) for _ in range(3)]  # the fallback: one pipe per reader
    results = [CTX.Pipe(duplex=False) for _ in range(3)]
    procs = [CTX.Process(target=_read_all, args=(writer.handle, r, 50, pipes[r][0],
                                                 results[r][1])) for r in range(3)]
    try:
        for p in procs:
            p.start()
        fallback_sent = []

        def fallback(obj):
            fallback_sent.append(obj[1])
            for _, end in pipes:
                end.send(obj)

        for n in range(50):
            assert writer.enqueue(_message(n), fallback, timeout=30)
        expected = [_message(n) for n in range(50)]
        assert [end.recv() for end, _ in results] == [expected] * 3
        assert fallback_sent == [n for n in range(50) if n % 7 == 3]
    finally:
        for p in procs:
            p.join(10)
        writer.close()


def _read_one_then_sleep(handle: QueueHandle) -> None:
    MessageQueue.attach(handle, 1).dequeue(_no_fallback, timeout=30)
    time.sleep(600)


def test_a_writer_waiting_on_a_dead_reader_raises_its_check():
    writer = MessageQueue.create(readers=2, slots=2, slot_bytes=64)
    alive = MessageQueue.attach(writer.handle, 0)
    proc = CTX.Process(target=_read_one_then_sleep, args=(writer.handle,))
    proc.start()
    try:
        for n in range(3):  # the reader in ``proc`` takes message 0 only
            assert writer.enqueue(n, _no_fallback, timeout=30)
            assert alive.dequeue(_no_fallback, timeout=1) == n
        os.kill(proc.pid, signal.SIGKILL)

        def check():
            if not proc.is_alive():
                raise RuntimeError("reader 1 died")
        writer.check = check
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="reader 1 died"):
            writer.enqueue(3, _no_fallback)  # slot 1 still holds message 1, never read
        assert time.monotonic() - start < 10
    finally:
        proc.kill()
        proc.join()
        alive.close()
        writer.close()


def test_close_unlinks_and_stops_a_waiting_writer():
    writer = MessageQueue.create(readers=1, slots=1, slot_bytes=64)
    name = writer.handle.name
    assert (SHM / name).exists()
    assert writer.enqueue(0, _no_fallback, timeout=0)
    errors = []
    waiting = threading.Thread(target=lambda: _catch(errors, writer.enqueue, 1, _no_fallback))
    waiting.start()
    time.sleep(0.05)
    writer.close()
    waiting.join(5)
    assert not waiting.is_alive() and "closed" in str(errors[0])
    assert not (SHM / name).exists()
    writer.close()  # idempotent


def _catch(errors: list, fn, *args) -> None:
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001 -- recorded for the test
        errors.append(e)


def test_a_killed_writer_process_leaves_nothing_in_dev_shm():
    code = ("import time\nfrom samebits.distributed.message_queue import MessageQueue\n"
            "q = MessageQueue.create(readers=1)\nprint(q.handle.name, flush=True)\n"
            "time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            stderr=subprocess.DEVNULL, env=_env())
    name = proc.stdout.readline().strip()
    assert (SHM / name).exists()
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 10  # Python's resource tracker unlinks what it held
    while (SHM / name).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not (SHM / name).exists()


def _env() -> dict[str, str]:
    root = str(Path(__file__).parents[2])
    return {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}


PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8]]


def _tokens(llm: LLM) -> list[list[int]]:
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]


def test_tp_engine_with_slots_smaller_than_its_messages(tmp_path, monkeypatch):
    path = write_config(tmp_path, MICRO_LLAMA_CONFIG)
    new = [("model.embed_tokens.weight", torch.randn(64, 32, generator=torch.Generator()
                                                     .manual_seed(0)))]  # 8 KiB: the fallback
    one = LLM(str(path), load_format="dummy", num_kv_blocks=8)
    one.update_weights(new)
    expected = _tokens(one)
    monkeypatch.setattr(message_queue, "SLOT_BYTES", 256)
    llm = LLM(str(path), load_format="dummy", num_kv_blocks=8, tensor_parallel_size=2)
    peers = llm.engine.runner.peers
    try:
        assert peers.queue.handle.slot_bytes == 256
        llm.update_weights(new)
        assert _tokens(llm) == expected
        os.kill(peers.procs[1].pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(RankFailedError, match=r"rank 1 \(pid \d+\) was killed by signal 9"):
            while True:  # announcements alone: a full ring must not wait for the dead rank
                peers.announce("weight_bytes")
        assert time.monotonic() - start < 30
    finally:
        llm.engine.runner.shutdown()
    assert not (SHM / peers.queue.handle.name).exists()
