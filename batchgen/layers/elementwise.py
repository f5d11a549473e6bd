"""Elementwise functions whose result for an element does not depend on the tensor around it.

torch's CPU kernels for functions such as exp, tanh, silu and gelu compute most elements in vector registers and
the last few of each thread's share through a scalar path, which can round differently by an ulp. Which elements
take that path depends on the tensor's size and on how its elements are split among threads (a parallel loop of
n elements over t threads cuts at every ceil(n / t)-th element; how many threads a loop takes depends on n and,
for GELU, on a rule of its own). So a token's activations changed with the number of tokens in its step where the
thread count does not divide the sizes evenly (3, 6, 12, 24 threads: Gemma 2 and the transformers backend in
float32 with 3 threads), which breaks batch invariance (docs/reproducibility.md).

`invariant(fn, x)` runs fn on a copy of x padded so that every thread's share is a whole number of vector steps:
every element then takes the vector path. It relies on ATen's OpenMP loops (ParallelOpenMP.h: shares of ceil(n / t)
for t = min(threads, ceil(n / grain)); `thread_counts` has the grains), which tests/test_elementwise.py checks.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

GRAIN = 32768  # at::internal::GRAIN_SIZE: elementwise loops of fewer elements run on one thread
GELU_GRAIN = 16384  # above this many elements GELU's kernel gives each thread an equal share (GeluKernel.cpp)
VECTOR_STEP = 64  # two AVX-512 vectors of bf16 (and four of float32): ATen's vectorized loops step by 2 vectors


def thread_counts(n: int, threads: int) -> set[int]:
    """The numbers of threads ATen's elementwise loops may split n elements among: the default loops
    min(threads, ceil(n / GRAIN)) from GRAIN elements on, GELU all of them above GELU_GRAIN."""
    counts = {1}
    if n > GELU_GRAIN:
        counts.add(threads)
    if n >= GRAIN:
        counts.add(min(threads, -(-n // GRAIN)))
    return counts


def padded_size(n: int, threads: int) -> int:
    """The size at least n at which every thread's share of an elementwise loop is a multiple of VECTOR_STEP,
    however many of `threads` the loop takes (thread_counts)."""
    size = -(-n // VECTOR_STEP) * VECTOR_STEP
    while True:
        step = VECTOR_STEP * math.lcm(*thread_counts(size, threads))
        aligned = -(-size // step) * step
        if aligned == size:
            return size
        size = aligned  # more elements may change the thread counts: align again


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def invariant(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """fn(x) for an elementwise fn, each element's result independent of x's size and of the thread count's split
    (see the module's docstring); on a GPU, fn(x). x as it is where its size already splits into whole vector
    steps and its rows are whole vector steps too (a [tokens, width] view of a wider tensor, as a gate's half
    of a fused projection, iterates row by row); else a padded copy."""
    if x.device.type != "cpu":
        return fn(x)
    n = x.numel()
    size = padded_size(n, torch.get_num_threads())
    if size == n and (x.is_contiguous() or (x.dim() == 2 and x.stride(1) == 1 and x.shape[1] % VECTOR_STEP == 0)):
        return fn(x)
    padded = x.new_empty(size)
    padded[n:].zero_()
    padded[:n].view(x.shape).copy_(x)
    return fn(padded)[:n].view(x.shape)
