"""The ranks' device barrier (``samebits.ops.triton.rank_barrier``) under ``TRITON_INTERPRET=1``:
ranks are threads, each launching the interpreted kernel on CPU tensors that stand in for the
ranks' symmetric flag buffers (the address table holds their CPU addresses) and the abort word.

What the tests prove:
- The protocol's state: a rank whose peer has signalled it returns at once, having consumed
  that signal (its flag 1 -> 0) and signalled the peer (the peer's flag 0 -> 1).
- Two ranks meet 100 times in a row (the flags reset themselves, 0 -> 1 -> 0, and are all zero
  afterwards); four ranks meet 10 times.
- A rank alone waits (negative control: still waiting after 0.5 s), and returns promptly once
  the test's host thread sets the abort word (0.2 s after the launch; a watchdog bounds the
  wait); with the word set, later barriers return too (within ``POLL`` spins each). A rank
  whose previous signal the peer has not consumed waits in its signal phase, and the abort word
  ends that wait too.

The interpreter patches ``triton.language`` for the duration of each launch and restores it when
the launch returns, so two launches overlapping in two threads would restore it under each other
(the later one then fails: "Did you forget to add @triton.jit?"): the tests hold the patch for
their whole duration (``_language_patched``). The interpreter holds the GIL between statements,
so the threads interleave spin by spin, as two devices would.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator

import pytest
import torch

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="the barrier's CPU tests run under TRITON_INTERPRET=1")

from samebits.ops.triton import rank_barrier as module  # noqa: E402

WATCHDOG_S = 20.0  # the longest a test waits for a thread it expects to return


@contextlib.contextmanager
def _language_patched() -> Iterator[None]:
    """``triton.language`` patched for the interpreter until the block ends (module docstring)."""
    interpreter = pytest.importorskip("triton.runtime.interpreter")
    scope = interpreter._patch_lang(module._rank_barrier_kernel.fn)
    try:
        yield
    finally:
        scope.restore()


class _Ranks:
    """``world`` ranks' flag buffers, the table of their addresses and one abort word."""

    def __init__(self, world: int) -> None:
        self.flags = [torch.zeros(world, dtype=torch.int32) for _ in range(world)]
        self.peers = torch.tensor([f.data_ptr() for f in self.flags], dtype=torch.int64)
        self.abort = torch.zeros(1, dtype=torch.int32)
        self.errors: list[BaseException] = []

    def barrier(self, rank: int) -> None:
        module.rank_barrier(self.flags[rank], self.peers, self.abort, rank)

    def start(self, rank: int, times: int = 1) -> threading.Thread:
        """Rank ``rank`` running ``times`` barriers in a thread of its own."""
        def run() -> None:
            try:
                for _ in range(times):
                    self.barrier(rank)
            except BaseException as e:  # noqa: BLE001 -- reported by the test
                self.errors.append(e)
        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread

    def flat(self) -> list[list[int]]:
        return [f.tolist() for f in self.flags]


def _joined(*threads: threading.Thread, seconds: float = WATCHDOG_S) -> bool:
    """Whether every thread returned within ``seconds`` in all."""
    deadline = time.monotonic() + seconds
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    return not any(t.is_alive() for t in threads)


def test_a_rank_whose_peer_signalled_consumes_the_signal_and_signals_back():
    ranks = _Ranks(2)
    ranks.flags[0][1] = 1  # rank 1 has entered its barrier
    with _language_patched():
        ranks.barrier(0)
    assert ranks.flat() == [[0, 0], [1, 0]]  # rank 0's flag from 1 consumed; rank 1's set


@pytest.mark.parametrize("world,times", [(2, 100), (4, 10)])
def test_ranks_meet_repeatedly_and_leave_every_flag_clear(world, times):
    ranks = _Ranks(world)
    with _language_patched():
        threads = [ranks.start(r, times) for r in range(world)]
        done = _joined(*threads)
        ranks.abort.fill_(1)  # frees any thread left behind before the patch is restored
        _joined(*threads)
    assert done and not ranks.errors
    assert ranks.flat() == [[0] * world for _ in range(world)]


def test_a_lone_rank_waits_and_returns_promptly_once_the_host_sets_the_abort_word():
    ranks = _Ranks(2)
    with _language_patched():
        lone = ranks.start(0)
        lone.join(0.5)
        waiting = lone.is_alive()  # negative control: no peer, no abort -- still waiting
        ranks.abort.fill_(1)
        freed = _joined(lone)
    assert waiting and freed and not ranks.errors


def test_an_abort_set_while_spinning_ends_the_wait_and_every_later_barrier():
    ranks = _Ranks(2)
    with _language_patched():
        lone = ranks.start(0)
        threading.Timer(0.2, ranks.abort.fill_, args=(1,)).start()
        start = time.monotonic()
        freed = _joined(lone)
        waited = time.monotonic() - start
        later = ranks.start(0, times=20)
        later_freed = _joined(later, seconds=5.0)
    assert freed and later_freed and not ranks.errors
    assert 0.2 <= waited < 5.0


def test_a_signal_the_peer_has_not_consumed_holds_the_next_signal_until_abort():
    """Rank 0's previous signal still sits in rank 1's flags (rank 1 has not reached its wait):
    rank 0 retries its signal, and does not overwrite or pass it, until the abort word is set."""
    ranks = _Ranks(2)
    ranks.flags[1][0] = 1
    ranks.flags[0][1] = 1  # rank 1's signal is there: only the signal phase can hold rank 0
    with _language_patched():
        signalling = ranks.start(0)
        signalling.join(0.5)
        held = signalling.is_alive()
        ranks.abort.fill_(1)
        freed = _joined(signalling)
    assert held and freed and not ranks.errors
    assert ranks.flat()[1] == [1, 0]  # the earlier signal, untouched


@pytest.mark.parametrize("change", [
    dict(flags=torch.zeros(2, dtype=torch.int64)), dict(peers=torch.zeros(1, dtype=torch.int64)),
    dict(abort=torch.zeros(2, dtype=torch.int32)), dict(rank=2)],
    ids=["flags int64", "peers of one rank", "abort of two words", "rank 2 of 2"])
def test_rank_barrier_refuses_buffers_of_another_kind(change):
    ranks = _Ranks(2)
    args = dict(flags=ranks.flags[0], peers=ranks.peers, abort=ranks.abort, rank=0) | change
    with pytest.raises(ValueError, match="rank_barrier"):
        module.rank_barrier(**args)
