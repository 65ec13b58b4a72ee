"""The fused CUDA kernels against the torch compositions they replace, bit for bit.

- ``silu_mul`` (activation.py) == ``F.silu(gate) * up`` for bf16, fp16, fp32, on the two halves of
  a gate_up product at Qwen3-8B's intermediate size, extremes included (denormals, +-0, +-inf,
  NaN compared by their bit patterns);
- ``qkv_rope_store`` (rope.py) == the composition ``samebits.ops.rope.qkv_rope_store`` over the
  Triton ``rms_norm`` (Qwen3-8B heads: Hq 32, Hkv 8, D 128), q and both caches, with and without
  q/k norms: this is where the fused kernel's row sum must reproduce ``rms_norm``'s tree;
- ``rms_norm(x, w, eps, residual)`` == the add then the norm at H 4096;
- a Qwen3- and a Llama-shaped decoder with the fused ops == ``tests.unfused`` (the forward before
  fusion) over the same Triton backend: hidden states and KV caches.

T = 1, 7, 64, 2048 throughout; rows of T = 1 equal rows of T = 2048. The HF route (stock RoPE and
SiLU, tests/gpu/test_train_gpu.py, test_override_gpu.py) checks the same bits end to end.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from samebits.ops import rope as composed  # noqa: E402
from samebits.ops.backend import AttentionMetadata  # noqa: E402
from samebits.ops.triton import activation as ACT  # noqa: E402
from samebits.ops.triton import rms_norm as RN  # noqa: E402
from samebits.ops.triton import rope as ROPE  # noqa: E402
from samebits.ops.triton.backend import TritonBackend  # noqa: E402
from tests.gpu.findings import record  # noqa: E402

HQ, HKV, D, H, INTER = 32, 8, 128, 4096, 12288
TS = [1, 7, 64, 2048]
_INT = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(_INT[t.dtype])


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _gate_up(t: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(t)
    gate_up = torch.randn(t, 2 * INTER, device="cuda", generator=g) * 4
    specials = torch.tensor([0.0, -0.0, 1e-40, -1e-40, 1e-30, -1e-38, 88.0, -88.0, 100.0, -100.0,
                             1e4, -1e4, float("inf"), float("-inf"), float("nan")], device="cuda")
    gate_up[0, :specials.numel()] = specials
    gate_up[0, INTER:INTER + specials.numel()] = specials.flip(0)
    gate_up[-1, :INTER] = torch.linspace(-120, 120, INTER, device="cuda")
    return gate_up.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("t", TS)
def test_silu_mul_is_torchs_silu_then_mul(dtype: torch.dtype, t: int) -> None:
    gate, up = _gate_up(t, dtype).chunk(2, dim=-1)  # strided halves, as the MLP passes them
    want = F.silu(gate) * up
    assert ACT.supports(gate, up)  # the kernel, no fallback
    got = TritonBackend().silu_mul(gate, up)
    other = ACT.silu_mul(gate, up, fp_fusion=not ACT.FP_FUSION)
    bad = (_bits(got) != _bits(want)).nonzero()[:5].tolist()
    record("silu_mul_fp_fusion", dtype=str(dtype), t=t, chosen=ACT.FP_FUSION,
           chosen_matches=_same(got, want), other_matches=_same(other, want),
           chosen_differs=int((_bits(got) != _bits(want)).sum()),
           first_differing=[(i, j, float(gate[i, j]), float(up[i, j]), float(got[i, j]),
                             float(want[i, j])) for i, j in bad])
    assert _same(got, want)
    assert _same(ACT.silu_mul(gate[:1], up[:1]), got[:1])


def _prologue_inputs(t: int, norm: bool, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    qkv = (torch.randn(t, (HQ + 2 * HKV) * D, device="cuda", generator=g) * 3).bfloat16()
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, D, 2, device="cuda").float() / D))
    pos = torch.randint(0, 40000, (t,), device="cuda", generator=g).float()
    emb = torch.cat([torch.outer(pos, inv_freq)] * 2, dim=-1)
    cos, sin = emb.cos().bfloat16(), emb.sin().bfloat16()
    qn = (torch.rand(D, device="cuda", generator=g) + 0.5).bfloat16() if norm else None
    kn = (torch.rand(D, device="cuda", generator=g) + 0.5).bfloat16() if norm else None
    blocks = -(-t // 16) * 2 + 1
    slots = torch.randperm(blocks * 16, device="cuda", generator=g)[:t]
    caches = [torch.randn(blocks, 16, HKV, D, device="cuda", generator=g).bfloat16()
              for _ in range(2)]
    return qkv, cos, sin, qn, kn, caches, slots


def _prologue(fn, inputs, rows: slice = slice(None)):
    qkv, cos, sin, qn, kn, (kc, vc), slots = inputs
    kc, vc = kc.clone(), vc.clone()
    q = fn(qkv[rows], cos[rows], sin[rows], qn, kn, 1e-6, kc, vc, slots[rows], HQ, HKV, D)
    return q, kc, vc


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("t", TS)
def test_prologue_kernel_is_norm_rope_store(t: int, norm: bool) -> None:
    inputs = _prologue_inputs(t, norm)
    assert ROPE.supports(*inputs[:5], *inputs[5], HQ, HKV, D)  # the kernel, no fallback
    got = _prologue(TritonBackend().qkv_rope_store, inputs)
    want = _prologue(lambda *a: composed.qkv_rope_store(RN.rms_norm, *a), inputs)
    names = ("q", "k_cache", "v_cache")
    bad = {n: int((_bits(a) != _bits(b)).sum()) for n, a, b in zip(names, got, want, strict=True)}
    record("prologue_vs_composition", t=t, norm=norm, differing_elements=bad)
    assert bad == {"q": 0, "k_cache": 0, "v_cache": 0}
    one = _prologue(TritonBackend().qkv_rope_store, inputs, slice(t - 1, t))  # the last row alone
    assert _same(one[0], got[0][t - 1:])


@pytest.mark.parametrize("t", TS)
def test_residual_rms_norm_is_the_add_then_the_norm(t: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(t)
    x, r = (torch.randn(2, t, H, device="cuda", generator=g) * 2).bfloat16()
    w = (torch.rand(H, device="cuda", generator=g) + 0.5).bfloat16()
    normed, summed = TritonBackend().rms_norm(x, w, 1e-6, r)
    assert _same(summed, r + x) and _same(normed, RN.rms_norm(r + x, w, 1e-6))


def _model(arch: str):
    from samebits.config import ModelConfig
    from samebits.loader import build_model
    from samebits.loader.dummy import init_dummy_weights
    cfg = {"architectures": [arch], "vocab_size": 4096, "hidden_size": 2048,
           "intermediate_size": 6144, "num_hidden_layers": 2, "num_attention_heads": 16,
           "num_key_value_heads": 4, "head_dim": 128, "rms_norm_eps": 1e-6,
           "rope_theta": 1e6, "max_position_embeddings": 4096, "tie_word_embeddings": False}
    model = build_model(ModelConfig.from_dict(cfg), TritonBackend(), 4096, "cuda",
                        torch.bfloat16)
    init_dummy_weights(model, seed=1, std=0.05)
    return model


@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "LlamaForCausalLM"])
def test_decoder_with_fused_ops_equals_the_unfused_forward(arch: str) -> None:
    from tests.unfused import stock_silu_mul, unfused_forward
    model = _model(arch)
    lens = [1, 7, 64, 2048]
    per = [-(-n // 16) for n in lens]
    tables = torch.zeros(len(lens), max(per), dtype=torch.int32)
    first, slots, qsl = 0, [], [0]
    for b, n in enumerate(lens):
        # sequences laid out from the end of the cache backwards
        tables[b, :per[b]] = torch.arange(sum(per) - first - per[b], sum(per) - first)
        first += per[b]
        slots += [int(tables[b, p // 16]) * 16 + p % 16 for p in range(n)]
        qsl.append(qsl[-1] + n)
    dev = "cuda"
    meta = AttentionMetadata(tables.to(dev), torch.tensor(lens, dtype=torch.int32, device=dev),
                             torch.tensor(qsl, dtype=torch.int32, device=dev),
                             torch.tensor(slots, device=dev), tuple(lens), tuple(qsl), 16, 128)
    meta = model.ops.plan_attention(meta)
    ids = torch.randint(0, 4096, (sum(lens),), device=dev)
    pos = torch.cat([torch.arange(n, device=dev) for n in lens])

    def caches():
        shape = (sum(per), 16, 4, 128)
        return [(torch.zeros(shape, dtype=torch.bfloat16, device=dev),
                 torch.zeros(shape, dtype=torch.bfloat16, device=dev)) for _ in range(2)]

    with torch.inference_mode():
        fused_caches, old_caches = caches(), caches()
        hidden = model(ids, pos, fused_caches, meta)
        want = unfused_forward(model, ids, pos, old_caches, meta, stock_silu_mul)
    assert _same(hidden, want)
    for (k, v), (k_old, v_old) in zip(fused_caches, old_caches, strict=True):
        assert _same(k, k_old) and _same(v, v_old)
