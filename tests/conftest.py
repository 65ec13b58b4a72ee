"""Suite-wide set-up. Without a GPU, Triton kernels can only run in Triton's interpreter, and
TRITON_INTERPRET is read when a kernel module is imported: set it before any test module (the GPU
tests collect the kernel modules too) imports triton.

The interpreter's ``tl.dot`` is one ``np.matmul`` per tile, whose bits follow the CPU's BLAS
kernel: OpenBLAS computes some rows of a tile with another micro-kernel than others (seen: rows
6-11 of a 16-row fp32 tile differ from row 0 on this project's CPU machines), so a row's bits
would depend on where it sits in the tile -- a property of the BLAS, not of our kernels. Under the
interpreter, ``tl.dot`` is therefore replaced by a fixed-order model of the tensor cores: every
output element accumulates its K products one after the other, in ascending k, starting from the
accumulator -- the same sequence whatever the tile shape, the operand layout or the position.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _ordered_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
    """``d + a @ b`` with each element's products added in ascending k (see the docstring)."""
    from triton.runtime.interpreter import TensorHandle
    out_dtype = d.data.dtype
    x, y = a.data.astype(out_dtype), b.data.astype(out_dtype)
    acc = d.data.copy()
    for k in range(x.shape[-1]):
        acc = acc + x[..., :, k:k + 1] * y[..., k:k + 1, :]
    return TensorHandle(acc, d.dtype.scalar)


try:
    from triton.runtime.interpreter import InterpreterBuilder
except ImportError:  # no triton: the interpreter tests skip themselves
    InterpreterBuilder = None
if InterpreterBuilder is not None and os.environ.get("TRITON_INTERPRET") == "1":
    InterpreterBuilder.create_dot = _ordered_dot


TINY_LLAMA = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  tie_word_embeddings=True)


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory):
    """A small random Llama (GQA, tied head) saved by transformers: an HF directory LLM loads."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY_LLAMA)).eval()
    out = tmp_path_factory.mktemp("tiny")
    model.save_pretrained(out)
    return out
