"""The model runner: owns the KV cache tensors, turns a scheduled batch into device tensors in one
``prepare`` step, runs the forward, and samples.

Under tensor parallel every rank has a runner of its own over its shard of the model: it sizes
its KV cache from what is left on its own device (the ranks then keep the smallest block count,
so one block table serves every rank) and captures its own CUDA graphs. Rank 0's runner
schedules and samples; each call that runs the model (a forward, a graph replay, the logits of
hidden states, a weight update) is first announced to ranks 1..N-1 (``peers``:
``samebits.engine.executor``), whose runners make the same call (``follow``), so the ranks'
collectives meet in order."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch

from samebits.config import EngineConfig
from samebits.engine import sampler
from samebits.engine.cuda_graph import DecodeBatch, DecodeGraphs, batch_buckets
from samebits.engine.isolation import processed_logits
from samebits.engine.memory import KVBudget
from samebits.engine.piecewise_graph import PiecewiseGraphs, piecewise_tokens
from samebits.engine.readback import ranks_of, read_tokens, row_top, start_read, top_of
from samebits.engine.scheduler import ScheduledBatch
from samebits.engine.sequence import Sequence
from samebits.engine.step import AheadStep, ForwardInputs, Peers, ScoredSpan, StepInputs, StepResult
from samebits.engine.transfer import to_device
from samebits.loader import LoadedModel
from samebits.models.weights import WeightMap
from samebits.ops.backend import AttentionMetadata
from samebits.sampling_params import SamplingParams


class ModelRunner:
    def __init__(self, loaded: LoadedModel, config: EngineConfig, peers: Peers | None = None
                 ) -> None:
        """``peers``: on rank 0 under tensor parallel, the other ranks (each runs a runner of its
        own, constructed at the same time: this constructor's collectives meet theirs)."""
        self.model, self.config, self.loaded, self.peers = loaded.model, config, loaded, peers
        self.group = self.model.group
        self.max_model_len = loaded.max_model_len
        self.device = next(self.model.parameters()).device
        self.dtype = next(self.model.parameters()).dtype
        self.block_size = config.block_size
        per_block = (2 * len(self.model.layers) * self.dtype.itemsize
                     * math.prod(self.model.kv_cache_shape(1, config.block_size)))
        own = config.num_kv_blocks or max(
            1, KVBudget(self.model, config, self.max_model_len).bytes() // per_block - 1)
        self.num_blocks = self.group.min_int(own)  # every rank holds the same block ids
        self.kv_caches = self._new_kv_caches()
        self.hidden: dict[str, torch.Tensor] = {}  # the last hidden states of each slot
        self.ahead: AheadStep | None = None  # async scheduling: the next decode step, in flight
        self.ahead_steps_used = 0  # steps served by a step launched ahead, since start
        self.graphs = self._new_graphs()
        self.piecewise = self._new_piecewise()

    def prepare(self, batch: ScheduledBatch) -> StepInputs:
        ids, pos, slots, seq_lens, qsl = [], [], [], [], [0]
        sample_rows, sample_seqs, score_rows, score_spans = [], [], [], []
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            start = seq.num_computed_tokens
            ids.extend(seq.all_token_ids[start:start + n])
            pos.extend(range(start, start + n))
            slots.extend(self._slot(seq, p) for p in range(start, start + n))
            seq_lens.append(start + n)
            if seq.wants_prompt_logprobs:  # positions whose next token is a prompt token
                count = max(0, min(n, len(seq.prompt_token_ids) - 1 - start))
                score_spans.append((seq, start, count))
                score_rows.extend(range(qsl[-1], qsl[-1] + count))
            if not seq.score_only and start + n == seq.num_tokens:
                sample_seqs.append(seq)
                sample_rows.append(qsl[-1] + n - 1)
            qsl.append(qsl[-1] + n)
        width = max(len(s.block_table) for s in batch.seqs)
        tables = [s.block_table + [0] * (width - len(s.block_table)) for s in batch.seqs]
        return StepInputs(ForwardInputs(ids, pos, slots, seq_lens, qsl, tables), sample_rows,
                          sample_seqs, score_rows, score_spans)

    def _graph_batch(self, batch: ScheduledBatch) -> DecodeBatch | None:
        """The batch as a CUDA-graph decode step, or None if it is not one (prefill, scoring)."""
        seqs = batch.seqs
        if (self.graphs is None or not self.graphs.fits(len(seqs))
                or any(n != 1 for n in batch.num_new_tokens)
                or any(s.score_only or s.num_computed_tokens + 1 != s.num_tokens for s in seqs)):
            return None
        pos = [s.num_computed_tokens for s in seqs]
        return DecodeBatch(input_ids=[s.token_id(p) for s, p in zip(seqs, pos, strict=True)],
                           positions=pos,
                           slots=[self._slot(s, p) for s, p in zip(seqs, pos, strict=True)],
                           block_tables=[s.block_table for s in seqs])

    def _slot(self, seq: Sequence, pos: int) -> int:
        """The flat KV-cache slot of ``seq``'s token at ``pos``."""
        return seq.block_table[pos // self.block_size] * self.block_size + pos % self.block_size

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> StepResult:
        with self._guard():
            return self._run(batch)

    def _run(self, batch: ScheduledBatch) -> StepResult:
        result = StepResult([], [], [], [], [])
        decode = self._graph_batch(batch)
        ahead, self.ahead = self.ahead, None
        if decode is not None:
            served = ahead is not None and ahead.serves(batch.seqs, decode)
            self.ahead_steps_used += served
            if not served:
                self._replay(decode, "main")
            self._sample(None, "ahead" if served else "main", batch.seqs, result, decode)
            # one span per sequence keeping prompt logprobs, as ``prepare``'s: a decode step's
            # are empty (no prompt position)
            result.scored = [ScoredSpan([], [], []) for s in batch.seqs if s.wants_prompt_logprobs]
            return result
        inputs = self.prepare(batch)
        self._forward(inputs.forward)
        if inputs.sample_rows:
            self._sample(inputs.sample_rows, "main", inputs.sample_seqs, result)
        if inputs.score_spans:
            self._score(inputs, result)
        return result

    @torch.inference_mode()
    def all_hidden(self, batch: ScheduledBatch) -> torch.Tensor:
        """Final-norm hidden states [T, H] of every scheduled token (embeddings, reference checks):
        a tensor of the caller's (a piecewise forward's, the graphs' buffer, is copied)."""
        with self._guard():
            inputs = self.prepare(batch).forward
            hidden = self._forward(inputs)
            return hidden.clone() if self._piecewise_serves(inputs) else hidden

    def discard_ahead(self) -> None:
        """Drop the step launched ahead (the weights or a sequence's state changed)."""
        self.ahead = None

    def check_health(self) -> None:
        """Raise ``RankFailedError`` naming a tensor-parallel rank whose process died."""
        if self.peers is not None:
            self.peers.check()

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks (also done when the runner is collected and at
        exit), then free the KV cache; idempotent. The runner runs nothing afterwards."""
        self.release_graphs()
        if self.peers is not None:
            self.peers.close()
        self.kv_caches = []
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def release_graphs(self) -> None:
        """Destroy the CUDA graphs now (and drop the step launched ahead and the kept hidden
        states, which live in the graphs' memory pool): under tensor parallel a graph holds the
        NCCL communicator whose collectives it captured, which cannot be released before it."""
        self.discard_ahead()
        self.hidden.clear()
        for graphs in (self.graphs, self.piecewise):
            if graphs is not None:
                graphs.release()
        self.graphs = self.piecewise = None

    # ---- the calls every rank makes: rank 0 announces each first (``follow``) ---------------
    def _guard(self) -> contextlib.AbstractContextManager[None]:
        """A failed rank's error, named, instead of a collective's (``Peers.guard``)."""
        return self.peers.guard() if self.peers is not None else contextlib.nullcontext()

    def _call(self, op: str, *args: Any) -> contextlib.AbstractContextManager[None]:
        """Rank 0: announce ``op`` to the other ranks around its own part (``Peers.call``); the
        other ranks (and one rank alone) just run it."""
        return self.peers.call(op, *args) if self.peers is not None else contextlib.nullcontext()

    def follow(self, op: str, args: tuple) -> None:
        """Ranks 1..N-1: make the call rank 0 announced, on this rank's shard."""
        calls = {"forward": self._forward, "replay": self._follow_replay, "logits": self._logits,
                 "logits_of": self.compute_logits, "update": self._follow_update,
                 "gather": self.named_weights, "weight_bytes": self.weight_bytes,
                 "memory_allocated": self.memory_allocated}
        with torch.inference_mode():
            calls[op](*args)

    def _forward(self, inputs: ForwardInputs) -> torch.Tensor:
        """The forward of ``inputs`` (piecewise graphs where they cover it, else eager): hidden
        states [T, H], kept as slot "main" (valid until the next forward)."""
        with self._call("forward", inputs):
            hidden = self._forward_here(inputs)
        self.hidden["main"] = hidden
        return hidden

    def _forward_here(self, inputs: ForwardInputs) -> torch.Tensor:
        """This rank's part of ``_forward``."""
        dev = self.device
        piecewise = self._piecewise_serves(inputs)
        # the chains stage the step's slots with its ids and positions (``PiecewiseGraphs.run``)
        slots = (self.piecewise.slots[:len(inputs.slots)] if piecewise
                 else torch.tensor(inputs.slots, dtype=torch.int64, device=dev))
        meta = self.model.ops.plan_attention(AttentionMetadata(
            block_tables=torch.tensor(inputs.block_tables, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(inputs.seq_lens, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor(inputs.query_start_loc, dtype=torch.int32, device=dev),
            slot_mapping=slots, seq_lens_list=tuple(inputs.seq_lens),
            query_start_loc_list=tuple(inputs.query_start_loc),
            block_size=self.block_size, split_size=self.config.attention_split_size))
        if piecewise:
            hidden = self.piecewise.run(inputs.input_ids, inputs.positions, inputs.slots, meta)
        else:
            hidden = self.model(torch.tensor(inputs.input_ids, device=dev),
                                torch.tensor(inputs.positions, device=dev), self.kv_caches, meta)
        return hidden

    def _piecewise_serves(self, inputs: ForwardInputs) -> bool:
        return self.piecewise is not None and self.piecewise.covers(len(inputs.input_ids))

    def _replay(self, decode: DecodeBatch, slot: str, tokens: torch.Tensor | None = None
                ) -> torch.Tensor:
        """``decode`` through the CUDA graphs (input ids from the device tensor ``tokens`` when
        given: rank 0's sampled tokens, sent to every rank), kept as ``slot``."""
        with self._call("replay", decode, slot, tokens is not None):
            if tokens is not None and self.group.world_size > 1:
                tokens = self.group.broadcast_tensor(tokens.to(torch.int64).contiguous())
            hidden = self.hidden[slot] = self.graphs.run(decode, tokens)
        return hidden

    def _follow_replay(self, decode: DecodeBatch, slot: str, from_tokens: bool) -> None:
        tokens = None
        if from_tokens:
            tokens = torch.empty(len(decode.positions), dtype=torch.int64, device=self.device)
        self._replay(decode, slot, tokens)

    def _logits(self, slot: str, rows: list[int] | None) -> torch.Tensor:
        """fp32 logits [len(rows), V] of rows ``rows`` (None: all) of slot ``slot``'s hidden."""
        with self._call("logits", slot, rows):
            hidden = self.hidden[slot]
            if rows is not None:
                hidden = hidden[to_device(rows, torch.int64, self.device)]
            return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [M, V] of any hidden states [M, H] (sent whole to the other ranks: for
        warm-up and reference checks, not steps)."""
        with self._guard(), self._call("logits_of", hidden.cpu()):
            return self.model.compute_logits(hidden.to(self.device))

    def weights_updated(self, items: list[tuple[str, torch.Tensor]]) -> None:
        """After ``update_weights`` on rank 0's model (checked there, all or nothing): every other
        rank loads its part of the same items, which rank 0 broadcasts on the device one tensor
        at a time (the announcement carries names, shapes and dtypes only)."""
        if self.peers is None:
            return
        specs = [(name, tuple(t.shape), t.dtype) for name, t in items]
        with self._guard(), self._call("update", specs):
            for _, t in items:
                self.group.broadcast_tensor(t.detach().to(self.device).contiguous())

    def _follow_update(self, specs: list[tuple[str, tuple[int, ...], torch.dtype]]) -> None:
        """Ranks 1..N-1: each (name, shape, dtype) rank 0 announced, received whole and written
        into this rank's part as it arrives; then the backend drops what it derived from the old
        weights."""
        wmap = WeightMap(self.model)
        with torch.no_grad():
            for name, shape, dtype in specs:
                whole = torch.empty(shape, dtype=dtype, device=self.device)
                wmap.write(name, self.group.broadcast_tensor(whole))
        hook = getattr(self.model.ops, "weights_updated", None)
        if hook is not None:
            hook(self.model)

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, tensor) of every weight, unfused: views of the one device's weights, or,
        under tensor parallel, every rank's parts gathered (copies)."""
        wmap = WeightMap(self.model)
        if self.group.world_size == 1:
            return wmap.named_weights()
        with self._guard(), self._call("gather"):
            return iter([(name, wmap.gather(name, self.group)) for name in wmap.slots])

    def weight_bytes(self) -> list[int]:
        """Bytes of the model's parameters on each rank, in rank order."""
        with self._guard(), self._call("weight_bytes"):
            mine = sum(p.numel() * p.element_size() for p in self.model.parameters())
            every = self.group.all_gather(torch.tensor([mine], device=self.device))
            return [int(b) for b in every.tolist()]

    def memory_allocated(self) -> list[int]:
        """``torch.cuda.memory_allocated`` of each rank's device (0 on the CPU), in rank order."""
        with self._guard(), self._call("memory_allocated"):
            mine = torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0
            every = self.group.all_gather(torch.tensor([mine], device=self.device))
            return [int(b) for b in every.tolist()]

    def _launch_ahead(self, seqs: list[Sequence], decode: DecodeBatch, tokens: torch.Tensor
                      ) -> None:
        """Launch the decode step that follows ``decode`` if every sequence goes on: input ids
        ``tokens`` (on the device, not yet read), positions one further, in blocks already held.
        Not when every sequence ends now (token or context limit): a running sequence's next
        position is always below the context limit."""
        positions = [p + 1 for p in decode.positions]
        bs = self.block_size
        pairs = list(zip(seqs, positions, strict=True))
        if (not self.config.async_scheduling
                or any(p // bs >= len(s.block_table) for s, p in pairs)
                or all(len(s.output_token_ids) + 1 >= s.params.max_tokens
                       or p + 1 >= self.max_model_len for s, p in pairs)):
            return
        nxt = DecodeBatch(input_ids=[0] * len(seqs), positions=positions,
                          slots=[self._slot(s, p) for s, p in pairs],
                          block_tables=list(decode.block_tables))
        if self.graphs.covers(nxt):
            self.ahead = AheadStep(list(seqs), nxt, self._replay(nxt, "ahead", tokens))

    def _sample(self, sample_rows: list[int] | None, slot: str, seqs: list[Sequence],
                result: StepResult, decode: DecodeBatch | None = None) -> None:
        """Logits, logprobs and tokens of the sampled rows (None: every row) of ``slot``'s hidden
        states, queued behind the forward; the host waits once, for tokens and chosen logprobs
        together (again only for rows a rejection chain left undecided). A graph decode step
        (``decode``) launches its successor before that wait (``_launch_ahead``)."""
        rows = sample_rows
        if rows is not None and rows == list(range(self.hidden[slot].shape[0])):
            rows = None
        logits = self._logits(slot, rows)  # [B, V] fp32, raw
        logprobs = self.model.ops.log_softmax(logits)  # reported: the raw distribution's
        logits = processed_logits(logits, seqs, result.failed)  # a failing row fails alone
        pending = sampler.start_sample(logits, [s.params for s in seqs], [s.seed for s in seqs],
                                       [len(s.output_token_ids) for s in seqs])
        ks = [s.params.logprobs or 0 for s in seqs]
        tops = [logprobs[i].topk(k) for i, k in enumerate(ks) if k]  # per row: a row's own bits
        read = start_read(pending.tokens, logprobs, [t for top in tops for t in top])
        if decode is not None:
            self._launch_ahead(seqs, decode, pending.tokens)
        tokens, values, extra = read()
        if min(tokens, default=0) < 0:  # rows the sampler completes on the host (rare)
            if self.ahead is not None:
                self.ahead.valid = False  # it read those rows as token 0
            tokens = pending.complete(tokens)
            values = read_tokens(to_device(tokens, torch.int64, self.device), logprobs)[1]
        result.sampled, result.tokens, result.logprobs = seqs, tokens, values
        pairs = iter(zip(extra[0::2], extra[1::2], strict=True))  # (values, ids) of each top
        result.top_logprobs = [top_of(*next(pairs)) if k else {} for k in ks]
        result.ranks = ranks_of(logprobs, values, [s.params.logprobs is not None for s in seqs])

    @torch.inference_mode()
    def warm_up_sampling(self) -> None:
        """Logits, logprobs and greedy tokens of every decode batch bucket from scratch hidden
        states, and each kind of draw (temperature, top-k, top-p, min-p) at the smallest and
        largest bucket on peaked random logits (as a model's: the chain decides in its first
        round): every kernel of the step's tail outside the graphs is compiled and loaded before
        the first request. No state is touched."""
        sizes = batch_buckets(self.config.max_num_seqs)
        kinds = [SamplingParams(), SamplingParams(top_k=20), SamplingParams(top_p=0.9),
                 SamplingParams(min_p=0.1)]
        gen = torch.Generator(device=self.device).manual_seed(0)
        for size in sizes:
            hidden = torch.zeros(size, self.model.cfg.hidden_size, dtype=self.dtype,
                                 device=self.device)
            logits = self.compute_logits(hidden)
            logprobs = self.model.ops.log_softmax(logits)
            draws = [SamplingParams(temperature=0.0)]
            if size in (sizes[0], sizes[-1]):
                shape = logits.shape
                del logits  # the peak stays at two [B, V] fp32 tensors
                logits = torch.randn(shape, generator=gen, device=self.device).mul_(4)
                draws += kinds
            for params in draws:
                pending = sampler.start_sample(logits, [params] * size, [0] * size, [0] * size)
                pending.complete(read_tokens(pending.tokens, logprobs)[0])

    def _score(self, inputs: StepInputs, result: StepResult) -> None:
        """Logprob of token p+1 given tokens [0, p], for each scored position p: log_softmax of the
        raw fp32 logits through the invariant backend, as the sampler reports them."""
        logprobs = None
        if inputs.score_rows:
            logprobs = self.model.ops.log_softmax(self._logits("main", inputs.score_rows))
        row = 0
        for seq, start, count in inputs.score_spans:
            span = ScoredSpan([], [], [])
            if count:
                nxt = torch.tensor(seq.prompt_token_ids[start + 1:start + 1 + count],
                                   device=self.device)
                block = logprobs[row:row + count]
                picked = block.gather(1, nxt[:, None])
                span.logprobs = picked[:, 0].tolist()
                k = seq.params.prompt_logprobs
                if k is not None:
                    span.ranks = (block >= picked).sum(dim=1).tolist()
                    span.top = [row_top(r, k) for r in block]
            result.scored.append(span)
            row += count


    # ---- sleep mode (LLMEngine.sleep / wake_up) ------------------------------------------
    def _new_kv_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Zeroed K and V caches per layer: ``num_blocks`` + 1 blocks (the last one the scratch
        block CUDA-graph padding rows write)."""
        shape = self.model.kv_cache_shape(self.num_blocks + 1, self.block_size)
        return [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                 torch.zeros(shape, dtype=self.dtype, device=self.device))
                for _ in range(len(self.model.layers))]

    def _new_graphs(self) -> DecodeGraphs | None:
        """The decode CUDA graphs over the current caches and weights (None: eager or CPU)."""
        config = self.config
        if self.device.type != "cuda" or config.enforce_eager:
            return None
        max_len = min(self.max_model_len, self.num_blocks * config.block_size)
        graphs = DecodeGraphs(self.model, self.kv_caches, config.max_num_seqs, max_len,
                              config.block_size, config.attention_split_size,
                              scratch_block=self.num_blocks)
        if self.peers is not None:  # released before the process group, however rank 0 ends
            self.peers.hold_graphs(graphs)
        return graphs

    def _new_piecewise(self) -> PiecewiseGraphs | None:
        """The piecewise CUDA graphs of prefill and mixed steps (None: eager, CPU, a model without
        ``run_layers``, or ``max_piecewise_tokens`` 0)."""
        config, tokens = self.config, piecewise_tokens(self.config, self.model)
        if self.device.type != "cuda" or tokens == 0:
            return None
        graphs = PiecewiseGraphs(self.model, self.kv_caches, tokens, config.block_size,
                                 config.attention_split_size, scratch_block=self.num_blocks)
        if self.peers is not None:
            self.peers.hold_graphs(graphs)
        return graphs

    def sleep(self, offload_weights: bool) -> None:
        """Free the KV cache and the CUDA graphs that read it; with ``offload_weights``, move the
        weights to host memory too (on CUDA; on CPU they already are). Nothing runs until
        ``wake_up``."""
        self.release_graphs()
        self.kv_caches = []
        if offload_weights and self.device.type == "cuda":
            for p in self.model.parameters():
                host = torch.empty(p.shape, dtype=p.dtype, device="cpu", pin_memory=True)
                p.data = host.copy_(p.data)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def wake_up(self, weights: bool, kv_cache: bool) -> None:
        """Bring back what ``sleep`` freed: the weights (the same values, on the device), and the
        KV cache (the same shape, zeroed) with its CUDA graphs captured anew (the weights must
        be back by then: the graphs read them)."""
        if weights:
            for p in self.model.parameters():
                p.data = p.data.to(self.device)
        if kv_cache:
            self.kv_caches = self._new_kv_caches()
            self.graphs = self._new_graphs()
            self.piecewise = self._new_piecewise()
