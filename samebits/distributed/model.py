"""The decoder sharded over a ``TPGroup``: this rank's segments of every weight (contiguous
copies, so each product has the same memory layout on any N) and the forward that combines them.

Per layer: RMSNorm (replicated) -> per owned KV group: qkv product, q/k norm + RoPE + KV store
(``qkv_rope_store``), attention, the group's o_proj partial -> ordered sum -> residual add fused
into the next RMSNorm; then per owned MLP segment: the gate/up product, SiLU, the down_proj partial
-> ordered sum -> residual add fused into the next RMSNorm (the next layer's, or the final one).
The same ops, casts and order as ``samebits.models.llama``, whose o_proj and down_proj compute the
same partials over the same K segments (``segments.k_bounds``) and add them in the same order on
one device. Embedding and LM head are vocab-parallel: a rank looks up / scores only its vocab
rows; rows are gathered, never summed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from samebits.config import ModelConfig
from samebits.distributed.group import TPGroup
from samebits.distributed.segments import Segments
from samebits.models.llama import LlamaForCausalLM, add_norm
from samebits.ops.backend import AttentionMetadata

GroupCache = list[tuple[torch.Tensor, torch.Tensor]]  # per owned KV group: (k, v) [B, bs, 1, D]


def _take(w: torch.Tensor | None, rows=None, cols=None) -> torch.Tensor | None:
    """A contiguous copy of ``w[rows][:, cols]`` (None stays None)."""
    if w is None:
        return None
    if rows is not None:
        w = w[rows]
    if cols is not None:
        w = w[:, cols]
    return w.detach().clone().contiguous()


def _partial(ops, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """One K segment's partial product (w holds exactly that segment's columns), unrounded: the
    value the single-device ``linear(..., k_bounds)`` adds for this segment."""
    return ops.linear_partials(x, w, ((0, w.shape[1]),))[0]


class TPLayer:
    """One decoder layer's shards: per owned segment, its slices of the four projections."""

    def __init__(self, layer, cfg: ModelConfig, seg: Segments) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.input_norm, self.post_norm = layer.input_layernorm, layer.post_attention_layernorm
        self.q_norm, self.k_norm = attn.q_norm, attn.k_norm
        self.qkv = [(_take(attn.qkv_proj, seg.qkv_rows(cfg, g)),
                     _take(attn.qkv_bias, seg.qkv_rows(cfg, g))) for g in seg.owned()]
        self.o = [_take(attn.o_proj, cols=seg.o_cols(cfg, g)) for g in seg.owned()]
        inter = cfg.intermediate_size
        self.gate_up, self.down = [], []
        for c in seg.owned():
            s = seg.mlp_slice(cfg, c)
            rows = torch.cat([torch.arange(s.start, s.stop), inter + torch.arange(s.start, s.stop)])
            self.gate_up.append((_take(mlp.gate_up_proj, rows), _take(mlp.gate_up_bias, rows)))
            self.down.append(_take(mlp.down_proj, cols=s))
        self.down_bias = mlp.down_bias


class TPModel:
    """This rank's part of the decoder; ``forward``/``compute_logits`` are collective calls."""

    def __init__(self, full: LlamaForCausalLM, group: TPGroup) -> None:
        cfg = self.cfg = full.cfg
        self.ops, self.group = full.ops, group
        self.seg = seg = Segments.for_model(cfg, group.rank, group.world_size)
        self.g, self.d, self.eps = (cfg.num_attention_heads // cfg.num_key_value_heads,
                                    cfg.head_dim, cfg.rms_norm_eps)
        self.layers = [TPLayer(layer, cfg, seg) for layer in full.layers]
        self.norm, self.rope_cos, self.rope_sin = full.norm, full.rope_cos, full.rope_sin
        lo, hi = seg.vocab_range(cfg)
        self.vocab_lo = lo
        self.embed = _take(full.embed_tokens[lo:hi])
        head = full.embed_tokens if full.lm_head is None else full.lm_head
        self.head = [_take(head[seg.vocab_slice(cfg, v)]) for v in seg.owned()]
        self.vocab_bounds = torch.tensor([seg.vocab_range(cfg, r)[1]
                                          for r in range(group.world_size)])

    def _shards(self) -> list[torch.Tensor | None]:
        """Every tensor this rank copied out of the full model, in a fixed order."""
        out = [self.embed, *self.head]
        for layer in self.layers:
            out += [t for wb in layer.qkv + layer.gate_up for t in wb] + layer.o + layer.down
        return out

    def refresh(self, full: LlamaForCausalLM) -> None:
        """Copy this rank's segments of ``full``'s (updated) weights into the shards, in place;
        the norms are ``full``'s own parameters, already updated."""
        fresh = TPModel(full, self.group)
        with torch.no_grad():
            for mine, new in zip(self._shards(), fresh._shards(), strict=True):
                if mine is not None:
                    mine.copy_(new)

    def allocate_caches(self, num_blocks: int, block_size: int) -> list[GroupCache]:
        """Per layer, per owned KV group: zeroed (k, v) caches [num_blocks, block_size, 1, D]."""
        shape = (num_blocks, block_size, 1, self.d)
        dev, dt = self.embed.device, self.embed.dtype
        return [[(torch.zeros(shape, dtype=dt, device=dev), torch.zeros(shape, dtype=dt,
                                                                           device=dev))
                 for _ in self.seg.owned()] for _ in self.layers]

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel lookup: each rank fills the rows of its own tokens; rank r's rows are
        then picked for the tokens it owns (a selection: exact)."""
        hi = self.vocab_lo + self.embed.shape[0]
        mine = (ids >= self.vocab_lo) & (ids < hi)
        local = F.embedding(torch.where(mine, ids - self.vocab_lo, 0), self.embed)
        every = self.group.all_gather(local.unsqueeze(0))  # [N, T, H]
        owner = torch.searchsorted(self.vocab_bounds.to(ids.device), ids, right=True)
        return every[owner, torch.arange(ids.shape[0], device=ids.device)]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                caches: list[GroupCache], meta: AttentionMetadata) -> torch.Tensor:
        h = self.embedding(input_ids)
        cos, sin = self.rope_cos[positions].to(h.dtype), self.rope_sin[positions].to(h.dtype)
        residual = None  # the stream h is added to by the next norm (llama.DecoderLayer)
        for layer, cache in zip(self.layers, caches, strict=True):
            x, residual = add_norm(self.ops, h, layer.input_norm, self.eps, residual)
            a = self._attention(layer, x, cos, sin, cache, meta)
            x, residual = add_norm(self.ops, a, layer.post_norm, self.eps, residual)
            h = self._mlp(layer, x)
        return add_norm(self.ops, h, self.norm, self.eps, residual)[0]

    __call__ = forward

    def _attention(self, layer: TPLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   cache: GroupCache, meta: AttentionMetadata) -> torch.Tensor:
        t, g, d, ops = x.shape[0], self.g, self.d, self.ops
        partials = []
        for (w, b), w_o, (kc, vc) in zip(layer.qkv, layer.o, cache, strict=True):
            q = ops.qkv_rope_store(ops.linear(x, w, b), cos, sin, layer.q_norm, layer.k_norm,
                                   self.eps, kc, vc, meta.slot_mapping, g, 1, d)
            o = ops.attention(q, kc, vc, meta, d ** -0.5)
            partials.append(_partial(ops, o.reshape(t, g * d), w_o))
        return self.group.ordered_sum(partials).to(x.dtype)

    def _mlp(self, layer: TPLayer, x: torch.Tensor) -> torch.Tensor:
        partials = []
        for (w, b), w_down in zip(layer.gate_up, layer.down, strict=True):
            gate, up = self.ops.linear(x, w, b).chunk(2, dim=-1)
            partials.append(_partial(self.ops, self.ops.silu_mul(gate, up), w_down))
        out = self.group.ordered_sum(partials).to(x.dtype)
        return out if layer.down_bias is None else out + layer.down_bias

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [M, H] -> fp32 logits [M, V]: one product per vocab segment, gathered."""
        local = torch.cat([self.ops.linear(hidden, w).float() for w in self.head], dim=-1)
        sizes = [hi - lo for lo, hi in (self.seg.vocab_range(self.cfg, r)
                                         for r in range(self.group.world_size))]
        return self.group.gather_cat(local, sizes, dim=-1)
