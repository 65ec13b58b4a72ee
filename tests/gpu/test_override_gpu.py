"""``batch_invariant()`` on CUDA (bf16): the overrides route to the Triton backend.

Same checks as tests/unit/test_override.py, at shapes where cuBLAS changes kernels with M
(docs/DESIGN.md section 2), each with its negative control. Skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from samebits.ops.override import batch_invariant

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _rows_differing(op, x: torch.Tensor, sizes=(1, 2, 7, 16, 64, 129, 512)) -> list[int]:
    full = op(x)
    return [b for b in sizes if not torch.equal(op(x[:b]), full[:b])]


def test_linear_and_softmax_are_row_invariant_on_cuda() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(512, 4096, device="cuda", generator=g).bfloat16()
    w = torch.randn(4096, 4096, device="cuda", generator=g).bfloat16() / 64
    lin = lambda t: F.linear(t, w)  # noqa: E731
    assert _rows_differing(lin, x) != []  # negative control: cuBLAS picks kernels by M
    with batch_invariant():
        assert _rows_differing(lin, x) == []
        assert _rows_differing(lambda t: torch.softmax(t.float(), -1), x) == []
        assert _rows_differing(lambda t: t.float().pow(2).mean(-1), x) == []
        q = x[:64].reshape(8, 64, 8, 64).transpose(1, 2)  # [B, H, S, D]: q @ k^T is a bmm of B*H items
        scores = q @ q.transpose(-1, -2)
        assert torch.equal((q[:1] @ q[:1].transpose(-1, -2))[0], scores[0])


def _qwen3_cuda() -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen3Config(
        vocab_size=16384, hidden_size=4096, intermediate_size=12288, num_hidden_layers=2,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        attn_implementation="eager", dtype=torch.bfloat16)
    torch.manual_seed(0)
    with torch.device("cuda"):
        return transformers.Qwen3ForCausalLM(cfg).to(torch.bfloat16).eval()


def _alone_vs_batched(model: torch.nn.Module, seq_len: int = 33) -> list[int]:
    g = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(0, 16384, (32, seq_len), device="cuda", generator=g)
    with torch.no_grad():
        batched = model(ids, attention_mask=torch.ones_like(ids)).logits
        return [i for i in (0, 13, 31)
                if not torch.equal(model(ids[i:i + 1]).logits[0], batched[i])]


def test_hf_model_logits_are_batch_invariant_on_cuda() -> None:
    model = _qwen3_cuda()
    assert _alone_vs_batched(model) != []  # negative control: stock cuBLAS / softmax differ
    with batch_invariant():
        assert _alone_vs_batched(model) == []
