"""A single-writer, multi-reader broadcast queue in shared memory (vLLM's ``MessageQueue``):
rank 0 announces each model call to ranks 1..N-1 through it instead of two gloo broadcasts.

Layout of the segment (``multiprocessing.shared_memory``), in int64 words, each counter on a
cache line of its own: ``written`` (messages the writer has published), then ``done[r]`` for
each reader r (messages reader r has consumed), then one length per slot; then the ring of
``slots`` payloads of ``slot_bytes`` each. Message n lives in slot ``n % slots``.

Invariants: the writer fills slot n % slots only once every reader's ``done`` exceeds
n - slots (the message it replaces was read by all), writes the payload and its length, then
publishes ``written = n + 1``; reader r reads message n only once ``written > n``, unpickles it,
then sets ``done[r] = n + 1``. Each counter has exactly one process that writes it. A message
whose pickle does not fit a slot is published with length ``LARGE`` and then sent through the
``fallback`` both sides pass (the group's gloo broadcast), in the same order.

Waiting spins (yielding the core) for ``SPIN_S``, then sleeps in steps growing to ``SLEEP_S``:
a reader waiting between decode steps answers at once (and spins through every gap shorter than
``SPIN_S``); once an engine idles, a reader costs about 2% of a core (``benchmarks/announce.py``).
A waiting writer calls ``check`` on every poll (the executor's: raises once a rank died), so a
dead reader that never frees its slot ends in that error, never in a wait.

The writer creates the segment and unlinks it in ``close``; Python's resource tracker unlinks it
if the writer's process dies first (the readers, spawned, share that tracker).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing import shared_memory

SLOTS = 8
SLOT_BYTES = 1 << 20  # a batch-64 decode step at 32k tokens of context fits
SPIN_S = 0.05  # spin this long before sleeping (longer than a decode step's host gap)
SLEEP_S = 0.001  # the longest sleep between polls once spinning stopped
LARGE = -1  # a slot's length for a message sent through the fallback
LINE = 8  # int64 words per cache line

_FENCE = threading.Lock()


def _fence() -> None:
    """A compiler and interpreter barrier (a lock's acquire and release). With x86-TSO's store
    order (the GPU hosts) payload stores are then visible before the counter that publishes
    them; a weakly ordered CPU (aarch64) would need a hardware fence here."""
    with _FENCE:
        pass


@dataclass(frozen=True)
class QueueHandle:
    """What a reader's process needs to attach: the segment's name and its geometry."""

    name: str
    readers: int
    slots: int = SLOTS
    slot_bytes: int = SLOT_BYTES

    def __post_init__(self) -> None:
        if self.readers < 1 or self.slots < 1 or self.slot_bytes < 1:
            raise ValueError(f"a message queue needs readers, slots and slot_bytes >= 1: {self}")

    @property
    def header_words(self) -> int:
        return LINE * (1 + self.readers) + -(-self.slots // LINE) * LINE

    @property
    def size(self) -> int:
        return 8 * self.header_words + self.slots * self.slot_bytes


class MessageQueue:
    """One end of the queue: the writer (``create``) or reader ``reader`` (``attach``)."""

    def __init__(self, handle: QueueHandle, shm: shared_memory.SharedMemory,
                 reader: int | None) -> None:
        self.handle, self.shm, self.reader = handle, shm, reader
        self.header = shm.buf[:8 * handle.header_words].cast("q")
        self.payload = shm.buf[8 * handle.header_words:handle.size]
        self.count = 0  # messages this end has written, or read
        self.check: Callable[[], None] | None = None  # the writer's: raises to stop a wait
        self.closed = False

    @classmethod
    def create(cls, readers: int, slots: int | None = None, slot_bytes: int | None = None
               ) -> MessageQueue:
        """A new segment for ``readers`` readers (``SLOTS`` slots of ``SLOT_BYTES`` unless
        given)."""
        handle = QueueHandle(f"samebits-mq-{os.getpid()}-{uuid.uuid4().hex[:12]}", readers,
                             slots or SLOTS, slot_bytes or SLOT_BYTES)
        shm = shared_memory.SharedMemory(handle.name, create=True, size=handle.size)
        shm.buf[:8 * handle.header_words] = bytes(8 * handle.header_words)
        return cls(handle, shm, None)

    @classmethod
    def attach(cls, handle: QueueHandle, reader: int) -> MessageQueue:
        if not 0 <= reader < handle.readers:
            raise ValueError(f"reader {reader} is outside [0, {handle.readers})")
        return cls(handle, shared_memory.SharedMemory(handle.name), reader)

    def enqueue(self, obj: object, fallback: Callable[[object], object],
                timeout: float | None = None) -> bool:
        """Publish ``obj`` to every reader (through ``fallback(obj)`` too when it does not fit a
        slot); False when no slot was free within ``timeout`` seconds (then nothing was sent)."""
        if self.reader is not None:
            raise RuntimeError("only the queue's writer enqueues")
        data = pickle.dumps(obj, protocol=5)
        n, h = self.count, self.handle
        if not self._wait(lambda: self._oldest_done() > n - h.slots, self.check, timeout):
            return False
        slot = n % h.slots
        inline = len(data) <= h.slot_bytes
        with self._open():
            if inline:
                self.payload[slot * h.slot_bytes:slot * h.slot_bytes + len(data)] = data
            self.header[self._length_word(slot)] = len(data) if inline else LARGE
            _fence()
            self.header[0] = self.count = n + 1
        if not inline:
            fallback(obj)
        return True

    def dequeue(self, fallback: Callable[[], object], timeout: float | None = None) -> object:
        """The next message (from ``fallback()`` when it did not fit a slot); ``TimeoutError``
        when none came within ``timeout`` seconds."""
        if self.reader is None:
            raise RuntimeError("only the queue's readers dequeue")
        n, h = self.count, self.handle
        if not self._wait(lambda: self.header[0] > n, None, timeout):
            raise TimeoutError(f"no message within {timeout} s")
        _fence()
        slot = n % h.slots
        with self._open():
            length = self.header[self._length_word(slot)]
            obj = None if length == LARGE else pickle.loads(
                self.payload[slot * h.slot_bytes:slot * h.slot_bytes + length])
            _fence()  # the slot is read before it is handed back
            self.header[LINE * (1 + self.reader)] = self.count = n + 1
        return fallback() if length == LARGE else obj

    @contextlib.contextmanager
    def _open(self) -> Iterator[None]:
        """Around reads and writes of the segment: ``close`` in another thread (released views
        raise ValueError) becomes the queue's closed error."""
        try:
            yield
        except ValueError:
            if self.closed:
                raise RuntimeError("the message queue was closed") from None
            raise

    def _oldest_done(self) -> int:
        return min(self.header[LINE * (1 + r)] for r in range(self.handle.readers))

    def _length_word(self, slot: int) -> int:
        return LINE * (1 + self.handle.readers) + slot

    def _wait(self, ready: Callable[[], bool], check: Callable[[], None] | None,
              timeout: float | None) -> bool:
        """Poll ``ready`` (spinning, then sleeping) until it holds: False after ``timeout``;
        ``check``'s error, or ``RuntimeError`` once the queue is closed, instead."""
        start = time.monotonic()
        pause = 1e-5
        while True:
            if self.closed:
                raise RuntimeError("the message queue was closed")
            with self._open():
                if ready():
                    return True
            if check is not None:
                check()
            waited = time.monotonic() - start
            if timeout is not None and waited > timeout:
                return False
            if waited < SPIN_S:
                os.sched_yield()
            else:
                time.sleep(pause)
                pause = min(2 * pause, SLEEP_S)

    def close(self) -> None:
        """Drop this end's mapping; the writer also unlinks the segment (idempotent). A wait
        still running in another thread then raises; a view it holds keeps the mapping alive
        until it is dropped."""
        if self.closed:
            return
        self.closed = True  # first: a wait in another thread stops before the views go
        if self.reader is None:
            with contextlib.suppress(FileNotFoundError):
                self.shm.unlink()
        self.header.release()
        self.payload.release()
        with contextlib.suppress(BufferError):
            self.shm.close()
