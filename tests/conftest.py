"""Suite-wide set-up. Without a GPU, Triton kernels can only run in Triton's interpreter, and
TRITON_INTERPRET is read when a kernel module is imported: set it before any test module (the GPU
tests collect the kernel modules too) imports triton."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
