"""The fused ops on CPU: ``rms_norm(..., residual)``, ``qkv_rope_store`` and the decoder that
carries its residual stream through them give the unfused path's bits, on every CPU backend.

What they prove: the residual form is the separate add then the norm; the prologue op is the
composition it replaced (q/k norm, RoPE, the cache write, the returned q); and the whole decoder
(Llama with GQA, Qwen2 with a qkv bias, Qwen3 with q/k norms; fp32 and bf16) returns the hidden
states and fills the KV cache exactly as ``tests.unfused`` does, for the invariant and the standard
backend and for ``DifferentiableOps`` with gradients on (the trainer's forward). The kernels
themselves are checked under the Triton interpreter (test_triton_interpret.py) and on the GPU
(tests/gpu/test_fused_gpu.py).
"""

from __future__ import annotations

import pytest
import torch

from samebits.config import ModelConfig
from samebits.loader import build_model
from samebits.loader.dummy import init_dummy_weights
from samebits.ops import get_backend
from samebits.ops.autograd import DifferentiableOps
from samebits.ops.backend import AttentionMetadata
from samebits.ops.rope import apply_rope
from tests.unfused import unfused_forward

BLOCK = 16
BASE = {"vocab_size": 300, "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "max_position_embeddings": 256, "tie_word_embeddings": False}
ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def _backends() -> dict:
    ref, std = get_backend("cpu", True), get_backend("cpu", False)
    return {"reference": ref, "standard": std, "differentiable": DifferentiableOps(ref)}


def _model(arch: str, ops, dtype: torch.dtype):
    cfg = ModelConfig.from_dict({**BASE, "architectures": [ARCHS[arch]]})
    model = build_model(cfg, ops, 256, "cpu", dtype)
    init_dummy_weights(model, seed=3, std=0.3)  # big enough that sums and norms round
    return model


def _batch(lens: list[int], num_blocks: int = 24, seed: int = 0):
    """Prefills of ``lens`` tokens, each sequence's blocks scattered over the cache."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(num_blocks, generator=g)
    per = [-(-n // BLOCK) for n in lens]
    tables = torch.zeros(len(lens), max(per), dtype=torch.int32)
    first, slots = 0, []
    for b, n in enumerate(lens):
        tables[b, :per[b]] = perm[first:first + per[b]]
        first += per[b]
        slots += [int(tables[b, p // BLOCK]) * BLOCK + p % BLOCK for p in range(n)]
    qsl = [0]
    for n in lens:
        qsl.append(qsl[-1] + n)
    meta = AttentionMetadata(tables, torch.tensor(lens, dtype=torch.int32),
                             torch.tensor(qsl, dtype=torch.int32), torch.tensor(slots),
                             tuple(lens), tuple(qsl), BLOCK, 128)
    ids = torch.randint(0, 300, (sum(lens),), generator=g)
    pos = torch.cat([torch.arange(n) for n in lens])
    return ids, pos, meta


def _caches(model, dtype: torch.dtype, num_blocks: int = 24):
    cfg = model.cfg
    shape = (num_blocks, BLOCK, cfg.num_key_value_heads, cfg.head_dim)
    return [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
            for _ in range(cfg.num_hidden_layers)]


@pytest.mark.parametrize("backend", ["reference", "standard", "differentiable"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_residual_norm_is_the_add_then_the_norm(backend: str, dtype: torch.dtype) -> None:
    ops = _backends()[backend]
    g = torch.Generator().manual_seed(1)
    x, r = (torch.randn(37, 64, generator=g) * 3).to(dtype), torch.randn(37, 64, generator=g).to(dtype)
    w = (torch.rand(64, generator=g) + 0.5).to(dtype)
    normed, summed = ops.rms_norm(x, w, 1e-6, r)
    assert torch.equal(summed, r + x) and summed.dtype == dtype
    assert torch.equal(normed, ops.rms_norm(r + x, w, 1e-6))


@pytest.mark.parametrize("backend", ["reference", "standard", "differentiable"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_prologue_op_is_the_composition(backend: str, arch: str) -> None:
    ops = _backends()[backend]
    g = torch.Generator().manual_seed(2)
    t, hq, hkv, d = 19, 4, 2, 16
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g) * 2
    pos = torch.randint(0, 200, (t,), generator=g)
    freqs = pos[:, None].float() * torch.rand(d // 2, generator=g)
    cos, sin = torch.cat((freqs, freqs), -1).cos(), torch.cat((freqs, freqs), -1).sin()
    qn, kn = (torch.rand(d, generator=g) + 0.5, torch.rand(d, generator=g) + 0.5) \
        if arch == "qwen3" else (None, None)
    slots = torch.randperm(8 * BLOCK, generator=g)[:t]
    kc, vc = torch.randn(8, BLOCK, hkv, d, generator=g), torch.randn(8, BLOCK, hkv, d, generator=g)
    k_want, v_want = kc.clone(), vc.clone()
    q = ops.qkv_rope_store(qkv, cos, sin, qn, kn, 1e-6, kc, vc, slots, hq, hkv, d)
    qv, kv, vv = qkv.split([hq * d, hkv * d, hkv * d], -1)
    qv, kv, vv = qv.view(t, hq, d), kv.view(t, hkv, d), vv.view(t, hkv, d)
    if qn is not None:
        qv, kv = ops.rms_norm(qv, qn, 1e-6), ops.rms_norm(kv, kn, 1e-6)
    k_want.view(-1, hkv, d)[slots] = apply_rope(kv, cos, sin)
    v_want.view(-1, hkv, d)[slots] = vv
    assert q.is_contiguous() and torch.equal(q, apply_rope(qv, cos, sin))
    assert torch.equal(kc, k_want) and torch.equal(vc, v_want)


@pytest.mark.parametrize("backend", ["reference", "standard", "differentiable"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decoder_equals_the_unfused_forward(backend: str, arch: str, dtype: torch.dtype) -> None:
    ops = _backends()[backend]
    model = _model(arch, ops, dtype)
    ids, pos, meta = _batch([21, 5, 37])
    meta = ops.plan_attention(meta)
    grad = backend == "differentiable"  # the trainer: parameters require gradients
    for p in model.parameters():
        p.requires_grad_(grad)
    with torch.set_grad_enabled(grad):
        fused_caches, old_caches = _caches(model, dtype), _caches(model, dtype)
        hidden = model(ids, pos, fused_caches, meta)
        want = unfused_forward(model, ids, pos, old_caches, meta)
    assert torch.equal(hidden, want)
    for (k, v), (k_old, v_old) in zip(fused_caches, old_caches, strict=True):
        assert torch.equal(k, k_old) and torch.equal(v, v_old)
    if grad:
        hidden.float().square().sum().backward()
        assert model.layers[0].self_attn.qkv_proj.weight.grad is not None
        assert model.layers[0].input_layernorm.grad is not None
        if arch == "qwen3":
            assert model.layers[1].self_attn.k_norm.grad is not None
