"""The push exchange of row-parallel sums (``SAMEBITS_TP_PUSH``; ``samebits.distributed.symmetric``)
on CPU: ``linear_sum(..., out=)``, the choice of path and ring, and ranks run as threads.

What the tests prove, bit for bit where bits are compared:
- ``linear_sum(x, w, k_bounds, out=slot)`` writes into ``slot`` (a view at an offset of a larger
  buffer, as a rank's slot is) exactly the bits it returns without ``out``, and nothing outside it,
  on the CPU reference backend and on the Triton kernels under ``TRITON_INTERPRET=1`` (one
  segment; the split schedule with the sum kernel and with torch's tree, the fused tree and the
  segmented-TMA schedule), and on the standard backend (copies, as the reference's); with
  ``peer_out`` too (a slot of another buffer, standing in for the peer's) both receive those
  bits and nothing else in either buffer changes. An ``out`` or
  ``peer_out`` of another shape or dtype, or a non-contiguous one, is refused by name.
- The choice: a group pushes only where an exchange was opened (CUDA, several ranks, a pushing
  layer, ``SAMEBITS_TP_PUSH`` 1 or 2), fused (the GEMM stores into the peer's slot; no copy)
  only at 2 with two ranks, the rows fit a ring, and the previous push since the last NCCL
  gather or all-reduce used the other ring; a Llama's row-parallel layers take rings 0, 1, 0, 1
  in their forward order (o_proj, down_proj, layer by layer). Every CUDA rank of several takes
  part in the agreement on the level, its own ``SAMEBITS_TP_PUSH`` off or not (on CPU or one rank
  none issues any collective), the exchange fuses only where every rank asked for 2, and around
  the rendezvous the ranks agree before each step, so no rank enters the rendezvous or the probe
  alone. A torch older than ``MIN_TORCH`` asks for no push; a probe that raises (Triton refusing
  the barrier's launch) on any rank makes every rank gather. The opened exchange's barrier
  watches a clear abort word, which ``TPGroup.abort`` sets before it aborts NCCL; the engine's
  guard raises the dead rank's error for a call that returns after the rank was named.
- Two and four ranks run as threads (a ``threading.Barrier`` standing in for the device barrier,
  plain tensors for the symmetric buffers, the gather through the same meeting): a sequence of
  row-parallel layers gives one device's segmented ``linear`` bits, pushed up to the ring's rows
  and gathered above (the trace records which), and the pushed [N, T, H] is the gather's -- with
  copies, and for two ranks fused (each layer's ``linear_sum`` writes the peer's slot itself).
  Negative control: an exchange whose writes never reach the peers (no copy; fused, a peer slot
  no peer reads) returns other bits.
- The ring of two: rank 1 reads each pushed stack only once rank 0 has issued its next push and
  entered that push's barrier (the threads' barrier holds rank 1 back until then: the writer's
  copy, or fused its GEMM's peer store, runs in the writer's thread before its barrier, so a
  late reader can be overtaken); with two rings both ranks keep one device's bits, copying and
  fused. Negative control: one ring (every layer on ring 0, the ring guard bypassed) -- rank 1's
  bits break.
"""

from __future__ import annotations

import io
import itertools
import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from samebits.config import EngineConfig
from samebits.distributed import group as group_module
from samebits.distributed import symmetric
from samebits.distributed.group import TPGroup
from samebits.distributed.symmetric import RINGS, PushExchange, takes_push, wanted
from samebits.loader import load
from samebits.models.parallel import RowParallelLinear
from samebits.ops.backend import row_parallel_bounds
from samebits.ops.reference import ReferenceBackend
from samebits.ops.standard import StandardBackend
from tests.tiny_models import TP_LLAMA_CONFIG, write_config

interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="the Triton kernels run compiled here (tests/gpu)")
REF = ReferenceBackend()
STANDARD = StandardBackend()
K, H, S = 64, 24, 4  # 4 segments: two ranks own 2 each, four ranks 1 each (subtrees)
ROWS = 8  # the fake exchange's ring rows


@pytest.fixture(autouse=True)
def _fresh_process(monkeypatch):
    """Each test a process that has not rendezvoused yet (``symmetric._RENDEZVOUSED``)."""
    monkeypatch.setattr(symmetric, "_RENDEZVOUSED", threading.Event())


def _data(rows: tuple[int, ...], k: int, n: int, seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*rows, k, generator=g) * torch.logspace(0, 3, k)
    return x.to(dtype), (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype)


def _slot(rows: tuple[int, ...], n: int, index: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(a NaN-filled buffer of two slots, its slot ``index`` viewed [*rows, n]): by default
    rank 1's slot."""
    size = n * torch.Size(rows).numel()
    buffer = torch.full((2 * size,), float("nan"))
    return buffer, buffer[index * size:(index + 1) * size].view(*rows, n)


def _into_slot(linear_sum, x, w, kb) -> None:
    """``out`` alone, then ``out`` and ``peer_out`` (rank 0's slot of another buffer, as rank 1
    writes it into its peer's ring): each receives ``linear_sum``'s bits, nothing else changes."""
    want = linear_sum(x, w, kb)
    buffer, out = _slot(tuple(x.shape[:-1]), w.shape[0])
    got = linear_sum(x, w, kb, out=out)
    assert got.data_ptr() == out.data_ptr() and torch.equal(out, want)
    assert buffer[:out.numel()].isnan().all()  # the other slot untouched
    buffer, out = _slot(tuple(x.shape[:-1]), w.shape[0])
    peer_buffer, peer = _slot(tuple(x.shape[:-1]), w.shape[0], index=0)
    got = linear_sum(x, w, kb, out=out, peer_out=peer)
    assert got.data_ptr() == out.data_ptr() and torch.equal(out, want) and torch.equal(peer, want)
    assert buffer[:out.numel()].isnan().all() and peer_buffer[peer.numel():].isnan().all()


@pytest.mark.parametrize("backend", [REF, STANDARD], ids=["reference", "standard"])
@pytest.mark.parametrize("s", [1, 2, 3, 4])
@pytest.mark.parametrize("rows", [(1,), (5,), (2, 3)])
def test_cpu_linear_sum_writes_its_bits_into_out_and_peer_out(backend, s, rows):
    """The reference backend, and the standard one (its ``linear_sum`` takes the protocol's
    ``out`` and ``peer_out`` too, as copies)."""
    x, w = _data(rows, 37 * s + 5, H, seed=s)
    _into_slot(backend.linear_sum, x, w, row_parallel_bounds(x.shape[-1], s))


def _triton():
    from samebits.ops.triton.backend import TritonBackend
    return TritonBackend()


@interpreted
@pytest.mark.parametrize("s,m,dtype,schedule", [
    (1, 5, torch.float32, "split"), (2, 1, torch.float16, "split"),
    (3, 1, torch.float32, "split"), (2, 33, torch.float32, "fused tree"),
    (2, 70, torch.float16, "segmented tma"), (3, 70, torch.float16, "segmented tma")])
def test_triton_linear_sum_writes_its_bits_into_out_and_peer_out(s, m, dtype, schedule):
    """One segment (``_linear_kernel``'s one chain), the split
    schedule (1 row; summed by ``_sum_partials_kernel``, or for 3 segments by torch's tree), the
    fused tree (17-64 rows) and the segmented TMA kernel (65+ rows, 16-bit; 2 and 3 segments)
    each store into ``out`` and ``peer_out``. fp16 stands for 16-bit inputs (the interpreter's
    bf16 ``tl.dot`` is wrong)."""
    from samebits.ops.triton import linear as L
    x, w = _data((m,), 64 * s, 40, seed=m, dtype=dtype)
    kb = row_parallel_bounds(64 * s, s)
    layout = L.SegmentLayout.from_bounds(kb, 64 * s)
    cfg = L.segmented_config(m, 40, 64 * s, dtype, layout)
    assert L.plan_of(x, w, cfg, layout).schedule == schedule or s == 1
    _into_slot(_triton().linear_sum, x, w, kb)


@pytest.mark.parametrize("backend", ["reference", "standard",
                                     pytest.param("triton", marks=interpreted)])
def test_linear_sum_refuses_an_out_it_cannot_fill_as_written(backend):
    ops = {"reference": REF, "standard": STANDARD}.get(backend) or _triton()
    x, w = _data((4,), K, H, seed=0)
    kb = row_parallel_bounds(K, 2)
    cases = {"contiguous": torch.empty(H, 4).t(), r"expected \(4, 24\)": torch.empty(4, H + 1),
             "float32": torch.empty(4, H, dtype=torch.float64)}
    for message, bad in cases.items():
        with pytest.raises(ValueError, match=f"out .*{message}"):
            ops.linear_sum(x, w, kb, out=bad)
        with pytest.raises(ValueError, match=f"peer_out .*{message}"):
            ops.linear_sum(x, w, kb, out=torch.empty(4, H), peer_out=bad)


def _exchange(rank: int, world: int, width: int = H, rows: int = ROWS, fused: bool = False
              ) -> PushExchange:
    local = torch.zeros(RINGS, world * rows * width)
    peers = {r: torch.zeros_like(local) for r in range(world) if r != rank}
    return PushExchange(local, peers, lambda: None, rank, width, rows, fused=fused)


def test_a_fused_exchange_offers_the_peers_slot_and_copies_nothing():
    """Fused: ``peer_slot`` is this rank's slot's place in the peer's ring (a view of the peer's
    buffer), and ``exchange`` leaves the peer's buffer as the GEMM left it; unfused it offers
    none and copies. A fused exchange has exactly one peer."""
    for fused in (True, False):
        ex = _exchange(1, 2, fused=fused)
        ex.slot(1, 3, H).fill_(7.0)
        peer = ex.peers[0]
        if fused:
            got = ex.peer_slot(1, 3, H)
            assert got.data_ptr() == peer[1, 3 * H:].data_ptr() and got.numel() == 3 * H
        else:
            assert ex.peer_slot(1, 3, H) is None
        ex.exchange(1, 3, H)
        assert torch.equal(peer[1, 3 * H:6 * H], torch.full((3 * H,), 0.0 if fused else 7.0))
    with pytest.raises(ValueError, match="one peer"):
        _exchange(0, 4, fused=True)


@pytest.mark.parametrize("level,world,want", [(2, 2, True), (2, 4, False), (1, 2, False),
                                              (0, 2, False)])
def test_only_agreed_push_level_2_with_two_ranks_fuses(level, world, want):
    assert symmetric.fuses(level, world) is want


def test_takes_push_where_an_exchange_fits_and_the_ring_alternates():
    ex = _exchange(0, 2)
    assert all(takes_push(ex, ring, None, t, H) for ring in (0, 1) for t in (1, 3, ROWS))
    assert takes_push(ex, 0, 1, ROWS, H - 8)  # narrower rows: the ring's leading values
    assert not takes_push(ex, 0, None, ROWS + 1, H)  # more rows than a ring holds
    assert not takes_push(ex, 0, None, 0, H)  # an empty step gathers (nothing to push)
    assert not takes_push(ex, 0, None, 1, H + 1)  # wider than the buffers
    assert not takes_push(ex, 1, 1, 1, H)  # the previous push's ring, no barrier since
    assert not takes_push(None, 0, None, 1, H)  # no exchange


@pytest.mark.parametrize("width,on,want", [(H, "1", 1), (H, "2", 2), (H, "0", 0), (H, "", 2),
                                           (H, "true", 1), (0, "1", 0), (0, "2", 0), (0, "", 0)])
def test_a_rank_asks_for_its_push_level_only_where_a_layer_pushes(width, on, want,
                                                                  monkeypatch):
    """Unset, two ranks ask for the fused push and more ranks for none."""
    monkeypatch.setenv("SAMEBITS_TP_PUSH", on)
    assert wanted(width, 2) == want
    assert wanted(width, 4) == (0 if on == "" else want)


def test_on_cpu_or_one_rank_no_rank_opens_anything_or_issues_a_collective(monkeypatch):
    monkeypatch.setenv("SAMEBITS_TP_PUSH", "1")
    for group in (TPGroup(0, 2, "cpu"), TPGroup(1, 2, "cpu"), TPGroup(0, 1, "cuda")):
        monkeypatch.setattr(group, "min_int", lambda v: pytest.fail("a collective was issued"))
        assert symmetric.open_exchange(group, H) is None


@pytest.mark.parametrize("mine,peer,width", [("0", 1, H), ("1", 0, H), ("", 0, H), ("1", 1, 0)])
def test_every_cuda_rank_agrees_on_the_level_even_where_its_own_is_off(mine, peer, width,
                                                                       monkeypatch):
    """A rank whose ``SAMEBITS_TP_PUSH`` is off (or whose model pushes nothing) still takes part
    in the agreement its peer waits in, and both then gather: one ``min_int`` each, nothing
    allocated."""
    monkeypatch.setenv("SAMEBITS_TP_PUSH", mine)
    monkeypatch.setattr(symmetric, "_symmetric_empty", lambda *a: pytest.fail("allocated"))
    group, agreed = TPGroup(0, 2, "cuda"), []
    monkeypatch.setattr(group, "min_int", lambda v: agreed.append(v) or min(v, peer))
    assert symmetric.open_exchange(group, width) is None
    assert agreed == [wanted(width, 2)]


class _Handle:
    """Stands in for torch's symmetric-memory handle of rank 0 of two: ``own`` is what it maps
    for rank 0 (the tensor itself, or elsewhere)."""

    def __init__(self, local: torch.Tensor, own_is_local: bool) -> None:
        self.local, self.own_is_local = local, own_is_local

    def get_remote_tensor(self, rank, shape, dtype):
        return self.local if rank == 0 and self.own_is_local else torch.zeros(shape, dtype=dtype)


def _cuda_pair(monkeypatch, peer_ok: int | list[int], own_is_local: bool = True,
               rendezvous=None, barrier=lambda: None):
    """Rank 0 of two on "cuda" (CPU tensors standing in), push on; the peer reports ``peer_ok``
    to every agreement (``min_int``; a list: its reports in order), and the list returned
    collects this rank's reports. The device barrier is ``barrier`` (the stand-in peer never
    signals one), its abort word a CPU int32."""
    from torch.distributed import _symmetric_memory as symm_mem
    monkeypatch.setenv("SAMEBITS_TP_PUSH", "1")
    group, agreed = TPGroup(0, 2, "cuda"), []
    monkeypatch.setattr(symmetric, "_symmetric_empty",
                        lambda shape, device, dtype=torch.float32: torch.zeros(shape, dtype=dtype))
    monkeypatch.setattr(symmetric, "_device_barrier", lambda flags, buffers, rank: (
        barrier, torch.zeros(1, dtype=torch.int32)))
    monkeypatch.setattr(symm_mem, "rendezvous",
                        rendezvous or (lambda local, name: _Handle(local, own_is_local)))
    monkeypatch.setattr(symmetric.dist, "group",
                        type("Groups", (), {"WORLD": type("World", (), {"group_name": "0"})}))
    replies = iter(peer_ok) if isinstance(peer_ok, list) else itertools.repeat(peer_ok)
    monkeypatch.setattr(group, "min_int", lambda v: agreed.append(v) or min(v, next(replies)))
    return group, agreed


def test_a_process_that_rendezvoused_before_asks_for_no_push_and_its_group_gathers(
        monkeypatch, caplog):
    """After one exchange opened in this process (an earlier engine's rank 0), a new group's
    rank 0 asks for level 0 and nothing is allocated or rendezvoused: torch's rendezvous counts
    its store exchanges per process, so a newly spawned peer would wait for other keys. Control:
    the same rank in a fresh process opens the exchange."""
    monkeypatch.setattr(PushExchange, "probe", lambda self: True)
    group, agreed = _cuda_pair(monkeypatch, [2, 1, 1, symmetric.PROBE_OK])
    monkeypatch.setenv("SAMEBITS_TP_PUSH", "2")
    assert symmetric.open_exchange(group, H) is not None  # the control: a fresh process
    group, agreed = _cuda_pair(monkeypatch, 2, rendezvous=lambda *a: pytest.fail("rendezvous"))
    monkeypatch.setenv("SAMEBITS_TP_PUSH", "2")
    monkeypatch.setattr(symmetric, "_symmetric_empty", lambda *a, **k: pytest.fail("allocated"))
    assert symmetric.open_exchange(group, H) is None and agreed == [0]
    assert "an earlier engine of this process entered torch's" in caplog.text


def test_no_rendezvous_where_the_peer_could_not_allocate(monkeypatch):
    group, agreed = _cuda_pair(monkeypatch, [1, 0],
                               rendezvous=lambda *a: pytest.fail("rendezvous"))
    assert symmetric.open_exchange(group, H) is None and agreed == [1, 1]


def test_a_failed_rendezvous_or_a_misplaced_mapping_is_agreed_on_and_both_ranks_gather(
        monkeypatch, caplog):
    def fails(local, name):
        raise RuntimeError("no peer access")
    for kwargs in (dict(rendezvous=fails), dict(own_is_local=False)):
        monkeypatch.setattr(symmetric, "_RENDEZVOUSED", threading.Event())  # a fresh process
        group, agreed = _cuda_pair(monkeypatch, 1, **kwargs)
        assert symmetric.open_exchange(group, H) is None and agreed == [1, 1, 0]
    assert "rendezvous failed" in caplog.text


@pytest.mark.parametrize("mine,peer,fused", [("1", 1, False), ("2", 2, True), ("2", 1, False),
                                             ("1", 2, False)])
def test_the_exchange_fuses_only_where_every_rank_asked_for_level_2(mine, peer, fused,
                                                                    monkeypatch):
    group, agreed = _cuda_pair(monkeypatch, [peer, 1, 1, symmetric.PROBE_OK])
    monkeypatch.setenv("SAMEBITS_TP_PUSH", mine)
    monkeypatch.setattr(PushExchange, "probe", lambda self: True)  # the stand-in peer writes none
    exchange = symmetric.open_exchange(group, H)
    assert exchange.fused is fused and agreed == [int(mine), 1, 1, symmetric.PROBE_OK]


@pytest.mark.parametrize("level", ["1", "2"])
def test_a_probe_that_loses_the_peers_value_raises_on_every_rank(level, monkeypatch):
    """The stand-in peer never writes its slot: rank 0 reports the probe wrong, and the
    agreement makes every rank raise (the peer reports its probe fine)."""
    group, agreed = _cuda_pair(monkeypatch, [int(level), 1, 1, symmetric.PROBE_OK])
    monkeypatch.setenv("SAMEBITS_TP_PUSH", level)
    with pytest.raises(RuntimeError, match="probe"):
        symmetric.open_exchange(group, H)
    assert agreed == [int(level), 1, 1, symmetric.PROBE_WRONG]


def _refused() -> None:
    """A barrier whose launch Triton refuses (the abort word's address not mapped here)."""
    raise ValueError("Pointer argument (at 2) cannot be accessed from Triton (cpu tensor?)")


@pytest.mark.parametrize("raised_here", [True, False])
def test_a_probe_that_raises_on_any_rank_makes_every_rank_gather(raised_here, monkeypatch,
                                                                 caplog):
    """The barrier's launch raises (Triton refuses the abort word's host address): the probe
    raises inside the fallback path, this rank reports it, and both ranks gather -- where it
    raised here, and where the peer reports it raised."""
    monkeypatch.setattr(PushExchange, "probe", PushExchange.probe if raised_here else
                        (lambda self: True))
    group, agreed = _cuda_pair(monkeypatch, [1, 1, 1, symmetric.PROBE_OK if raised_here else
                                             symmetric.PROBE_RAISED],
                               barrier=_refused if raised_here else lambda: None)
    assert symmetric.open_exchange(group, H) is None
    here = symmetric.PROBE_RAISED if raised_here else symmetric.PROBE_OK
    assert agreed == [1, 1, 1, here]
    assert ("probe raised (ValueError" in caplog.text) is raised_here


@pytest.mark.parametrize("given,level", [("2", "WARNING"), ("", "INFO")])
def test_a_push_not_taken_is_a_warning_only_where_it_was_asked_for(given, level, monkeypatch,
                                                                  caplog):
    """Below ``MIN_TORCH`` no push: a warning where ``SAMEBITS_TP_PUSH`` asked for it, an info
    line where it was the two ranks' default."""
    monkeypatch.setenv("SAMEBITS_TP_PUSH", given)
    monkeypatch.setattr(symmetric, "torch_supports", lambda: False)
    caplog.set_level("INFO", logger="samebits")
    assert wanted(H, 2) == 0
    said = [r for r in caplog.records if "needs torch" in r.getMessage()]
    assert [r.levelname for r in said] == [level]


@pytest.mark.parametrize("version,ok", [("2.5.1", False), ("2.6.0a0+git1", False),
                                        ("2.6.0", True), ("2.11.0+cu128", True),
                                        ("2.13.0+cpu", True)])
def test_push_needs_torch_2_6_or_later(version, ok, monkeypatch):
    """Below ``MIN_TORCH`` a rank asks for no push (it still reports 0 to the agreement)."""
    monkeypatch.setenv("SAMEBITS_TP_PUSH", "2")
    assert symmetric.torch_supports(version) is ok
    monkeypatch.setattr(symmetric, "torch_supports", lambda: ok)
    assert wanted(H, 2) == (2 if ok else 0)


def test_the_barrier_maps_every_ranks_flags_and_watches_a_clear_abort_word():
    """``_device_barrier``: the kernel gets this rank's flags, every rank's flag address in rank
    order and a clear int32 abort word; ``PushExchange.abort`` sets the word."""
    pytest.importorskip("triton")
    buffers = [torch.zeros(2, dtype=torch.int32) for _ in range(2)]
    barrier, word = symmetric._device_barrier(buffers[1], buffers, 1)
    flags, addresses, abort, rank = barrier.args
    assert flags is buffers[1] and abort is word and rank == 1
    assert addresses.tolist() == [b.data_ptr() for b in buffers]
    assert word.dtype == torch.int32 and word.tolist() == [0]
    exchange = _exchange(1, 2)
    exchange.abort_word = word
    exchange.abort()
    assert word.tolist() == [1]


def test_group_abort_sets_the_abort_word_before_it_aborts_nccl(monkeypatch):
    """The watcher's ``TPGroup.abort``: the barrier spinning on the dead rank must return before
    NCCL's abort, which waits until the caller's error has released the graphs."""
    group, word, seen = TPGroup(0, 2, "cuda"), torch.zeros(1, dtype=torch.int32), []
    group.connected, group.exchange = True, _exchange(0, 2)
    group.exchange.abort_word = word
    backend = type("Backend", (), {"abort": lambda self: seen.append(word.item())})()
    default = type("Default", (), {"_get_backend": lambda self, device: backend})()
    monkeypatch.setattr(group_module.dist.distributed_c10d, "_get_default_group", lambda: default)
    group.abort()
    assert seen == [1] and word.tolist() == [1]


def test_a_guarded_call_that_returns_after_a_rank_was_named_dead_raises_it():
    """``Ranks.guard``: a body that returns once the watcher has named a dead rank (its results
    computed after the abort word freed the barriers) raises that rank's error and releases the
    graphs; one that returns with no rank named returns."""
    from samebits.engine.executor import RankFailedError, Ranks
    ranks = object.__new__(Ranks)  # no processes: only what ``guard`` reads
    ranks.failure, ranks.closing, ranks.calls, released = None, False, 0, []
    ranks._release_graphs = lambda: released.append(True)
    with ranks.guard():
        pass
    assert not released
    with pytest.raises(RankFailedError, match="rank 1"), ranks.guard():
        ranks.failure = "tensor-parallel rank 1 (pid 7) was killed by signal 9"
    assert released == [True]


def test_a_llamas_row_parallel_layers_take_alternating_rings_in_forward_order(tmp_path):
    path = write_config(tmp_path, TP_LLAMA_CONFIG)
    group = TPGroup(0, 2)
    model = load(EngineConfig(str(path), tensor_parallel_size=2, load_format="dummy"),
                 group).model
    layers = [(name, m.ring) for name, m in model.named_modules()
              if isinstance(m, RowParallelLinear)]
    assert [name.rsplit(".", 2)[-2:] for name, _ in layers] == \
        [["self_attn", "o_proj"], ["mlp", "down_proj"]] * TP_LLAMA_CONFIG["num_hidden_layers"]
    assert [ring for _, ring in layers] == [0, 1] * TP_LLAMA_CONFIG["num_hidden_layers"]
    assert group.push_width == TP_LLAMA_CONFIG["hidden_size"]
    one_device = load(EngineConfig(str(path), load_format="dummy")).model
    assert one_device.group.push_width == 0 and one_device.group.push_layers == 0


def test_an_nccl_gather_or_all_reduce_is_a_barrier_for_the_ring_choice(monkeypatch):
    group = TPGroup(0, 2)
    monkeypatch.setattr(group_module, "_ALL_GATHER", lambda out, x: out.zero_())
    monkeypatch.setattr(group_module.dist, "all_reduce", lambda x: x)
    for collective in (lambda: group.all_gather(torch.zeros(1, 2)),
                       lambda: group.all_reduce_sum(torch.zeros(2))):
        group.last_ring = 1
        collective()
        assert group.last_ring is None


# ---- ranks as threads ------------------------------------------------------------------------

class _Threads:
    """``world`` ranks run as threads: their exchanges share plain tensors as the symmetric
    buffers and meet at ``meet`` for the barrier; NCCL's gather meets there too. ``late``: rank
    1 reads each pushed stack as late as a rank can -- its barrier returns only once rank 0 has
    entered its next push barrier (so has issued that push's writes) or finished."""

    def __init__(self, world: int, copy: bool = True, fused: bool = False,
                 late: bool = False) -> None:
        self.world, self.meet = world, threading.Barrier(world, timeout=20)
        self.buffers = [torch.zeros(RINGS, world * ROWS * H) for _ in range(world)]
        self.shelf: list[torch.Tensor | None] = [None] * world
        self.rank = threading.local()
        self.copy, self.fused, self.late = copy, fused, late
        self.arrived = [0] * world  # push barriers each rank has entered
        self.finished = [False] * world
        self.moved = threading.Condition()

    def barrier(self, rank: int):
        """Rank ``rank``'s device barrier: every rank meets; with ``late``, rank 1 then waits
        for rank 0's next arrival."""
        def wait() -> None:
            with self.moved:
                self.arrived[rank] += 1
                self.moved.notify_all()
            self.meet.wait()
            if self.late and rank == 1:
                mine = self.arrived[1]
                with self.moved:
                    assert self.moved.wait_for(
                        lambda: self.arrived[0] > mine or self.finished[0], timeout=20)
        return wait

    def group(self, rank: int) -> TPGroup:
        """Rank ``rank``'s group; with ``copy`` False its peers' buffers are tensors no peer
        reads (its copies, or fused its GEMM's peer stores, are lost)."""
        group = TPGroup(rank, self.world)
        peers = {r: b for r, b in enumerate(self.buffers) if r != rank} if self.copy else \
            {r: torch.zeros_like(b) for r, b in enumerate(self.buffers) if r != rank}
        group.exchange = PushExchange(self.buffers[rank], peers, self.barrier(rank), rank, H,
                                      ROWS, fused=self.fused)
        group.trace = io.StringIO()
        return group

    def all_gather(self, out: torch.Tensor, x: torch.Tensor) -> None:
        self.shelf[self.rank.value] = x.clone()
        self.meet.wait()
        out.copy_(torch.cat(self.shelf))
        self.meet.wait()

    def run(self, fn) -> list:
        def one(rank: int):
            self.rank.value = rank
            try:
                return fn(rank)
            finally:
                with self.moved:
                    self.finished[rank] = True
                    self.moved.notify_all()
        with ThreadPoolExecutor(self.world) as pool:
            return [f.result() for f in [pool.submit(one, r) for r in range(self.world)]]


def _layers_and_inputs(group: TPGroup, steps: list[tuple[int, ...]]):
    """Two row-parallel layers (o_proj's and down_proj's rings) with this rank's slices of the
    same full weights, and each step's input slice; the full ones for one device."""
    full, layers, inputs = [], [], []
    for i in range(2):
        layer = RowParallelLinear(K, H, S, group, S)
        _, w = _data((1,), K, H, seed=100 + i)
        lo, hi = layer.weight.spec.span(0)
        layer.weight.data = w[:, lo:hi].contiguous()
        layers.append(layer)
        full.append(w)
    for j, rows in enumerate(steps):
        x, _ = _data(rows, K, H, seed=j)
        inputs.append((x, x[..., lo:hi].contiguous()))
    return layers, full, inputs


def _forward(threads: _Threads, rank: int, steps: list[tuple[int, ...]]):
    group = threads.group(rank)
    layers, _, inputs = _layers_and_inputs(group, steps)
    outs = [layer.gathered(REF, mine) for _, mine in inputs for layer in layers]
    return outs, [json.loads(line)["op"] for line in group.trace.getvalue().splitlines()]


STEPS = [(1,), (5,), (2, 3), (ROWS,), (ROWS + 1,), (3,)]


@pytest.mark.parametrize("world,fused", [(2, False), (4, False), (2, True)])
def test_ranks_pushing_get_one_devices_bits_and_gather_above_the_rings_rows(world, fused,
                                                                             monkeypatch):
    threads = _Threads(world, fused=fused)
    monkeypatch.setattr(group_module, "_ALL_GATHER", threads.all_gather)
    results = threads.run(lambda rank: _forward(threads, rank, STEPS))
    _, full, inputs = _layers_and_inputs(TPGroup(0, world), STEPS)
    kb = row_parallel_bounds(K, S)
    want = [REF.linear(x, w, k_bounds=kb) for x, _ in inputs for w in full]
    for outs, ops in results:
        assert all(torch.equal(o, w) for o, w in zip(outs, want, strict=True))
        assert ops == ["push"] * 8 + ["all_gather"] * 2 + ["push"] * 2


@pytest.mark.parametrize("fused", [False, True])
def test_the_pushed_stack_is_the_gathers(fused, monkeypatch):
    threads = _Threads(2, fused=fused)
    monkeypatch.setattr(group_module, "_ALL_GATHER", threads.all_gather)

    def both(rank: int):
        group = threads.group(rank)
        mine = _data((1, 5), H, H, seed=rank)[0]  # [1, T, H]
        group.push_slot(0, 5, H).copy_(mine.reshape(-1))
        if fused:  # as the GEMM stores it
            group.push_peer_slot(0, 5, H).copy_(mine.reshape(-1))
        else:
            assert group.push_peer_slot(0, 5, H) is None
        pushed = group.push(0, 5, H).clone()
        return pushed, group.all_gather(mine)
    for pushed, gathered in threads.run(both):
        assert pushed.shape == (2, 5, H) and torch.equal(pushed, gathered)


@pytest.mark.parametrize("fused", [False, True])
def test_negative_control_writes_that_never_reach_the_peer_return_other_bits(fused,
                                                                            monkeypatch):
    threads = _Threads(2, copy=False, fused=fused)  # each rank writes into tensors no peer reads
    monkeypatch.setattr(group_module, "_ALL_GATHER", threads.all_gather)
    results = threads.run(lambda rank: _forward(threads, rank, [(3,)]))
    _, full, inputs = _layers_and_inputs(TPGroup(0, 2), [(3,)])
    want = REF.linear(inputs[0][0], full[0], k_bounds=row_parallel_bounds(K, S))
    assert not any(torch.equal(outs[0], want) for outs, _ in results)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("rings", [2, 1])
def test_a_late_reader_keeps_its_bits_with_two_rings_and_is_overtaken_with_one(
        rings, fused, monkeypatch):
    """Rank 1 reads each pushed stack only after rank 0 has issued its next push (copied, or
    fused stored by its GEMM, into rank 1's buffer) and reached that push's barrier: with the
    ring of two, that push lands in the other ring and both ranks keep one device's bits.
    Negative control: every layer on ring 0 with the ring guard bypassed -- rank 0's next push
    overwrites its slot in the ring rank 1 has not read yet, and rank 1's bits break."""
    threads = _Threads(2, fused=fused, late=True)
    monkeypatch.setattr(group_module, "_ALL_GATHER", threads.all_gather)
    if rings == 1:
        monkeypatch.setattr(group_module, "takes_push",
                            lambda ex, ring, last, rows, width: ex.fits(rows, width))
    steps = [(3,), (5,), (2, 3)]

    def forward(rank: int):
        group = threads.group(rank)
        layers, _, inputs = _layers_and_inputs(group, steps)
        for layer in layers:
            layer.ring %= rings
        return [layer.gathered(REF, mine) for _, mine in inputs for layer in layers]
    results = threads.run(forward)
    _, full, inputs = _layers_and_inputs(TPGroup(0, 2), steps)
    kb = row_parallel_bounds(K, S)
    want = [REF.linear(x, w, k_bounds=kb) for x, _ in inputs for w in full]
    same = [[torch.equal(o, w) for o, w in zip(outs, want, strict=True)] for outs in results]
    assert all(same[0])  # rank 0 reads in time
    assert all(same[1]) if rings == 2 else not any(same[1][:-1])  # the last push is not overtaken


@pytest.mark.parametrize("tokens,rows", [(None, symmetric.PUSH_MAX_ROWS), (512, 512),
                                         (symmetric.PUSH_MAX_ROWS * 4, symmetric.PUSH_MAX_ROWS)])
def test_the_rings_hold_the_engines_batched_tokens_up_to_push_max_rows(tokens, rows,
                                                                       monkeypatch, caplog):
    """``connect``'s ``max_num_batched_tokens`` sizes the buffers: RINGS x N x rows x width fp32
    per rank, logged once; the exchange holds exactly those rows."""
    caplog.set_level("INFO", logger="samebits.engine")
    group, _ = _cuda_pair(monkeypatch, [1, 1, 1, symmetric.PROBE_OK])
    monkeypatch.setattr(PushExchange, "probe", lambda self: True)
    assert symmetric.push_rows(tokens) == rows
    exchange = symmetric.open_exchange(group, H, symmetric.push_rows(tokens))
    assert exchange.local.shape == (RINGS, 2 * rows * H) and exchange.max_rows == rows
    assert exchange.fits(rows, H) and not exchange.fits(rows + 1, H)
    assert f"push buffers: {RINGS * 2 * rows * H * 4} bytes" in caplog.text
