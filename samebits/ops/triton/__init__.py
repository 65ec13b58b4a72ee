"""Triton implementations of the batch-invariant ops for CUDA (registered by ``backend.py``).

Modules: ``linear`` (GEMM with a K order fixed by the weight shape), ``rms_norm``, ``softmax``,
``attention`` and ``attention_kernels`` (paged split attention: one arithmetic for prefill and
decode).
"""
