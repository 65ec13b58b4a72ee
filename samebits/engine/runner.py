"""The model runner: owns the KV cache tensors, turns a scheduled batch into device tensors in one
``prepare`` step, runs the forward, and samples."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from samebits.config import EngineConfig
from samebits.engine import sampler
from samebits.engine.cuda_graph import DecodeBatch, DecodeGraphs, batch_bucket, batch_buckets
from samebits.engine.isolation import RequestError, processed_logits
from samebits.engine.scheduler import ScheduledBatch
from samebits.engine.sequence import Sequence
from samebits.engine.transfer import to_device, to_host_later
from samebits.loader import LoadedModel
from samebits.ops.backend import AttentionMetadata
from samebits.sampling_params import SamplingParams


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    sample_rows: list[int]  # flat token row of each sequence that gets a new token
    sample_seqs: list[Sequence]
    score_rows: list[int]  # flat token rows of prompt positions whose next token is scored
    score_spans: list[tuple[Sequence, int, int]]  # (seq, first position, count), score_rows order


@dataclass
class ScoredSpan:
    """Prompt logprobs of one span of positions: the next token's logprob at each, and for
    requests asking for prompt logprobs its rank and the top-k (empty lists otherwise)."""

    logprobs: list[float]
    ranks: list[int]
    top: list[dict[int, float]]


@dataclass
class StepResult:
    sampled: list[Sequence]  # the sequences that got a new token, in order
    tokens: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[int, float]]
    scored: list[ScoredSpan]  # one per score span, in StepInputs.score_spans order
    failed: dict[str, RequestError] = field(default_factory=dict)  # by request id: why it failed


@dataclass
class AheadStep:
    """A decode step launched before its predecessor's tokens were read (async scheduling): the
    predecessor's sequences at their next positions, input ids taken on the device from its
    sampled tokens. It stands for the next step only if that step is these sequences at these
    positions and slots and every token it read was final (``valid``); otherwise its work is
    dropped, and the KV it wrote at those slots is rewritten before anything reads it (the next
    step that computes those positions writes them again)."""

    seqs: list[Sequence]
    batch: DecodeBatch
    hidden: torch.Tensor
    valid: bool = True

    def serves(self, seqs: list[Sequence], batch: DecodeBatch) -> bool:
        return (self.valid and len(seqs) == len(self.seqs)
                and all(a is b for a, b in zip(seqs, self.seqs, strict=True))
                and batch.positions == self.batch.positions and batch.slots == self.batch.slots)


class ModelRunner:
    def __init__(self, loaded: LoadedModel, config: EngineConfig) -> None:
        self.model, self.config = loaded.model, config
        self.max_model_len = loaded.max_model_len
        self.reserved_bytes = 0  # CUDA: activation + graph-pool bytes kept out of the KV budget
        cfg = loaded.model_config
        self.device = next(self.model.parameters()).device
        self.dtype = next(self.model.parameters()).dtype
        self.block_size = config.block_size
        per_block = (2 * cfg.num_hidden_layers * config.block_size * cfg.num_key_value_heads
                     * cfg.head_dim * self.dtype.itemsize)
        self.num_blocks = config.num_kv_blocks or max(1, self._kv_budget() // per_block - 1)
        # one block more than the pool hands out: the scratch block CUDA-graph padding rows write
        shape = (self.num_blocks + 1, config.block_size, cfg.num_key_value_heads, cfg.head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                           torch.zeros(shape, dtype=self.dtype, device=self.device))
                          for _ in range(cfg.num_hidden_layers)]
        self.graphs = None
        self.ahead: AheadStep | None = None  # async scheduling: the next decode step, in flight
        self.ahead_steps_used = 0  # steps served by a step launched ahead, since start
        if self.device.type == "cuda" and not config.enforce_eager:
            max_len = min(loaded.max_model_len, self.num_blocks * config.block_size)
            self.graphs = DecodeGraphs(self.model, self.kv_caches, config.max_num_seqs, max_len,
                                       config.block_size, config.attention_split_size,
                                       scratch_block=self.num_blocks)

    def _kv_budget(self) -> int:
        """Bytes for the KV cache: as configured, else 1 GiB on CPU; on CUDA 90% of what is free
        once the activations of the largest step and the CUDA-graph pool are set aside
        (``_activation_reserve``, measured)."""
        if self.config.kv_cache_memory_bytes is not None:
            return self.config.kv_cache_memory_bytes
        if self.device.type != "cuda":
            return 1 << 30
        self.reserved_bytes = self._activation_reserve()
        free, _ = torch.cuda.mem_get_info(self.device)
        return max(0, int((free - self.reserved_bytes) * 0.9))

    @torch.inference_mode()
    def _activation_reserve(self) -> int:
        """Peak bytes of an eager prefill of ``max_num_batched_tokens`` tokens with its sampling
        rows, plus, when decode steps run in CUDA graphs, the graph pool: the peak of a decode step
        of ``max_num_seqs`` sequences planned for the longest context (the temporaries every
        captured graph shares) and each graph's output. Measured on a scratch cache just large
        enough, which is then freed."""
        cfg, model, bs = self.config, self.model, self.config.block_size
        t = cfg.max_num_batched_tokens
        nb = -(-t // bs) + 1
        shape = (nb, bs, model.cfg.num_key_value_heads, model.cfg.head_dim)
        caches = [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                   torch.zeros(shape, dtype=self.dtype, device=self.device))
                  for _ in range(model.cfg.num_hidden_layers)]
        prefill = self._peak(lambda: self._scratch_prefill(caches, t, nb))
        if cfg.enforce_eager:
            return prefill
        n = min(batch_bucket(cfg.max_num_seqs), t)
        decode = self._peak(lambda: self._scratch_decode(caches, n))
        outputs = DecodeGraphs.count(cfg.max_num_seqs, self.max_model_len, cfg.attention_split_size) \
            * cfg.max_num_seqs * model.cfg.hidden_size * self.dtype.itemsize
        return prefill + decode + outputs

    def _peak(self, fn) -> int:
        torch.cuda.synchronize(self.device)
        base = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        fn()
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device) - base

    def _scratch_prefill(self, caches: list, t: int, nb: int) -> None:
        dev, rows = self.device, min(t, self.config.max_num_seqs)
        meta = AttentionMetadata(
            block_tables=torch.arange(nb - 1, dtype=torch.int32, device=dev)[None],
            seq_lens=torch.tensor([t], dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor([0, t], dtype=torch.int32, device=dev),
            slot_mapping=torch.arange(t, device=dev), seq_lens_list=(t,),
            query_start_loc_list=(0, t), block_size=self.block_size,
            split_size=self.config.attention_split_size)
        hidden = self.model(torch.zeros(t, dtype=torch.int64, device=dev),
                            torch.arange(t, device=dev), caches, self.model.ops.plan_attention(meta))
        self.model.ops.log_softmax(self.model.compute_logits(hidden[-rows:]))

    def _scratch_decode(self, caches: list, n: int) -> None:
        """One eager decode step of ``n`` sequences planned as the widest graph is."""
        dev, max_len = self.device, self.max_model_len
        width = -(-max_len // self.block_size)
        meta = AttentionMetadata(
            block_tables=torch.zeros(n, width, dtype=torch.int32, device=dev),
            seq_lens=torch.ones(n, dtype=torch.int32, device=dev),
            query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=dev),
            slot_mapping=torch.arange(n, device=dev), seq_lens_list=(max_len,) * n,
            query_start_loc_list=tuple(range(n + 1)), block_size=self.block_size,
            split_size=self.config.attention_split_size)
        pos = torch.zeros(n, dtype=torch.int32, device=dev)
        meta = self.model.ops.plan_decode(meta, pos, max_len)
        hidden = self.model(torch.zeros(n, dtype=torch.int64, device=dev), pos.long(), caches, meta)
        self.model.ops.log_softmax(self.model.compute_logits(hidden))

    def prepare(self, batch: ScheduledBatch) -> StepInputs:
        ids, pos, slots, seq_lens, qsl = [], [], [], [], [0]
        sample_rows, sample_seqs, score_rows, score_spans = [], [], [], []
        bs = self.block_size
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
        dev = self.device
        meta = AttentionMetadata(
            block_tables=torch.tensor(tables, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            seq_lens_list=tuple(seq_lens), query_start_loc_list=tuple(qsl),
            block_size=bs, split_size=self.config.attention_split_size)
        return StepInputs(torch.tensor(ids, device=dev), torch.tensor(pos, device=dev),
                          self.model.ops.plan_attention(meta), sample_rows, sample_seqs,
                          score_rows, score_spans)

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
        result = StepResult([], [], [], [], [])
        decode = self._graph_batch(batch)
        ahead, self.ahead = self.ahead, None
        if decode is not None:
            served = ahead is not None and ahead.serves(batch.seqs, decode)
            self.ahead_steps_used += served
            hidden = ahead.hidden if served else self.graphs.run(decode)
            self._sample(list(range(len(batch.seqs))), batch.seqs, hidden, result, decode)
            return result
        inputs = self.prepare(batch)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
        if inputs.sample_rows:
            self._sample(inputs.sample_rows, inputs.sample_seqs, hidden, result)
        if inputs.score_spans:
            self._score(inputs, hidden, result)
        return result

    @torch.inference_mode()
    def all_hidden(self, batch: ScheduledBatch) -> torch.Tensor:
        """Final-norm hidden states [T, H] of every scheduled token (embeddings, reference checks)."""
        inputs = self.prepare(batch)
        return self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)

    def discard_ahead(self) -> None:
        """Drop the step launched ahead (the weights or a sequence's state changed)."""
        self.ahead = None

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
            self.ahead = AheadStep(list(seqs), nxt, self.graphs.run(nxt, tokens))

    def _sample(self, sample_rows: list[int], seqs: list[Sequence], hidden: torch.Tensor,
                result: StepResult, decode: DecodeBatch | None = None) -> None:
        """Logits, logprobs and tokens of the sampled rows, queued behind the forward; the host
        waits once, for tokens and chosen logprobs together (again only for rows a rejection
        chain left undecided). A graph decode step (``decode``) launches its successor before
        that wait (``_launch_ahead``)."""
        if sample_rows != list(range(hidden.shape[0])):
            hidden = hidden[to_device(sample_rows, torch.int64, self.device)]
        logits = self.model.compute_logits(hidden)  # [B, V] fp32, raw
        logprobs = self.model.ops.log_softmax(logits)  # reported: the raw distribution's
        logits = processed_logits(logits, seqs, result.failed)  # a failing row fails alone
        pending = sampler.start_sample(logits, [s.params for s in seqs], [s.seed for s in seqs],
                                       [len(s.output_token_ids) for s in seqs])
        ks = [s.params.logprobs or 0 for s in seqs]
        tops = [logprobs[i].topk(k) for i, k in enumerate(ks) if k]  # per row: a row's own bits
        read = _start_read(pending.tokens, logprobs, [t for top in tops for t in top])
        if decode is not None:
            self._launch_ahead(seqs, decode, pending.tokens)
        tokens, values, extra = read()
        if min(tokens, default=0) < 0:  # rows the sampler completes on the host (rare)
            if self.ahead is not None:
                self.ahead.valid = False  # it read those rows as token 0
            tokens = pending.complete(tokens)
            values = _read_tokens(to_device(tokens, torch.int64, self.device), logprobs)[1]
        result.sampled, result.tokens, result.logprobs = seqs, tokens, values
        pairs = iter(zip(extra[0::2], extra[1::2], strict=True))  # (values, ids) of each top
        result.top_logprobs = [_top(*next(pairs)) if k else {} for k in ks]

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
            logits = self.model.compute_logits(hidden)
            logprobs = self.model.ops.log_softmax(logits)
            draws = [SamplingParams(temperature=0.0)]
            if size in (sizes[0], sizes[-1]):
                shape = logits.shape
                del logits  # the peak stays at two [B, V] fp32 tensors
                logits = torch.randn(shape, generator=gen, device=self.device).mul_(4)
                draws += kinds
            for params in draws:
                pending = sampler.start_sample(logits, [params] * size, [0] * size, [0] * size)
                pending.complete(_read_tokens(pending.tokens, logprobs)[0])

    def _score(self, inputs: StepInputs, hidden: torch.Tensor, result: StepResult) -> None:
        """Logprob of token p+1 given tokens [0, p], for each scored position p: log_softmax of the
        raw fp32 logits through the invariant backend, as the sampler reports them."""
        logprobs = None
        if inputs.score_rows:
            rows = torch.tensor(inputs.score_rows, device=self.device)
            logprobs = self.model.ops.log_softmax(self.model.compute_logits(hidden[rows]))
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
                    span.top = [_row_top(r, k) for r in block]
            result.scored.append(span)
            row += count


def _start_read(tokens: torch.Tensor, logprobs: torch.Tensor, extra: list[torch.Tensor] = ()
                ) -> Callable[[], tuple[list[int], list[float], list[list[float]]]]:
    """Queue the copy to the host of token ids [B] (negative ids read as such), each row's
    logprob of its token and the 1-D ``extra`` tensors, in one transfer (ints < 2**53 and fp32
    values are exact in fp64); the returned function waits for it and gives (ids, logprobs,
    each extra as a list). Work queued after it (a step launched ahead) does not delay the read
    (``to_host_later``)."""
    chosen = logprobs.gather(1, tokens.clamp(min=0)[:, None])[:, 0]
    parts = [tokens, chosen, *extra]
    read = to_host_later(torch.cat([t.double() for t in parts]))
    sizes = [t.numel() for t in parts]
    return lambda: _split(read(), sizes)


def _read_tokens(tokens: torch.Tensor, logprobs: torch.Tensor) -> tuple[list[int], list[float]]:
    return _start_read(tokens, logprobs)()[:2]


def _split(values: list[float], sizes: list[int]) -> tuple[list[int], list[float],
                                                          list[list[float]]]:
    parts, start = [], 0
    for n in sizes:
        parts.append(values[start:start + n])
        start += n
    return [int(t) for t in parts[0]], parts[1], parts[2:]


def _top(values: list[float], ids: list[float]) -> dict[int, float]:
    """A row's ``topk`` as read: the k most likely tokens and their logprobs (OpenAI's
    top_logprobs)."""
    return dict(zip((int(i) for i in ids), values, strict=True))


def _row_top(row: torch.Tensor, k: int) -> dict[int, float]:
    if not k:
        return {}
    values, ids = row.topk(k)
    return _top(values.tolist(), ids.tolist())
