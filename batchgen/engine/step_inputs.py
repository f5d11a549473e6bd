"""A step's input arrays onto the device in one copy.

A GPU step's inputs (token ids, positions, slot mapping, block tables, lengths) are numpy arrays built on the host
(engine/flat_batch.py, engine/decode_batch.py). Copied one by one from pageable memory, each is a blocking copy
that first waits for the stream to drain: five to nine of them a step, some tens of microseconds each, while the
GPU has nothing to do. Here they are packed into one pinned buffer and sent in one asynchronous copy; the tensors
handed out are views of one device buffer. The host buffer is rewritten only once the last copy from it is done
(an event), and the device buffer only by a copy queued after every kernel that read the last step's views, on
the same stream. On a CPU the arrays are used where they lie, as before (`torch.from_numpy`).
"""

from __future__ import annotations

import functools

import numpy as np
import torch

ALIGN = 256  # bytes: each array starts where a kernel's widest loads of it stay aligned


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class StepInputs:
    def __init__(self, device: torch.device, pack: bool | None = None):
        self.device = device
        self.pack = device.type != "cpu" if pack is None else pack  # a test may pack on a CPU (unpinned)
        self._host = torch.empty(0, dtype=torch.uint8)
        self._device = torch.empty(0, dtype=torch.uint8, device=device)
        self._copied = torch.cuda.Event() if device.type == "cuda" else None  # the last copy out of _host

    def to_device(self, arrays: list[np.ndarray | None]) -> list[torch.Tensor | None]:
        """Each array as a tensor on the device (None stays None), all sent in one copy. The tensors are valid
        until the next call: they share one buffer. Unpacked (a CPU), each tensor is its array, copied only where
        it is not contiguous: an array may change once the step has run, not before."""
        if not self.pack:
            return [None if a is None else torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]
        present = [a for a in arrays if a is not None]
        offsets, total = [], 0
        for a in present:
            offsets.append(total)
            total += _aligned(a.nbytes)
        self._reserve(total)
        if self._copied is not None:
            self._copied.synchronize()  # the last step's copy has left the host buffer
        host = self._host.numpy()
        for a, offset in zip(present, offsets, strict=True):  # one copy each, whatever the array's layout
            host[offset:offset + a.nbytes].view(a.dtype).reshape(a.shape)[...] = a
        self._device[:total].copy_(self._host[:total], non_blocking=True)
        if self._copied is not None:
            self._copied.record(torch.cuda.current_stream(self.device))  # the copy's stream, on cuda:N too
        views = iter([self._device[o:o + a.nbytes].view(_torch_dtype(a.dtype)).view(a.shape)
                      for a, o in zip(present, offsets, strict=True)])
        return [None if a is None else next(views) for a in arrays]

    def _reserve(self, nbytes: int) -> None:
        if nbytes <= self._host.numel():
            return
        size = max(nbytes, 2 * self._host.numel(), 1 << 16)
        self._host = torch.empty(size, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
        self._device = torch.empty(size, dtype=torch.uint8, device=self.device)


@functools.cache
def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype=dtype)).dtype
