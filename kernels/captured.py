"""One decode call captured in a CUDA graph and replayed: the eager per-step path's launches.

A decode step calls the same kernels on the same buffers every time (a static cache updates its
codes, windows and lengths in place), so their launches from Python, the larger part of an
eager call's cost at batch 1, can be paid once: :class:`CapturedCall` records ``fn(query)``
in a CUDA graph and each later call copies the new query in, replays the graph and returns a
copy of its output. Three launches (copy, replay, copy) whatever ``fn`` launches.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["CapturedCall"]


class CapturedCall:
    """``fn(query)`` captured in a CUDA graph (see the module).

    Args:
        fn: a function of one ``query`` tensor that never waits for the GPU (for example
            :func:`kernels.static_decode_attention` on a trusted cache with device lengths)
            and reads every other input from tensors whose address stays fixed; their contents
            may change between calls (the graph reads them where they are).
        query: an example query: a CUDA tensor of the shape, dtype and device every later
            call passes.

    The first call of ``fn`` (compiling its kernels) runs on a side stream before the capture,
    both on the query's device. Calls replay on that device's current stream. Re-create the
    object when ``fn``'s buffers move. Each object holds its own graph memory pool (what ``fn``
    allocates: the kernels' scratch and the output).

    Raises:
        ValueError: ``query`` is not a CUDA tensor; at a call, a query of another shape, dtype
            or device than the example's (named).
    """

    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor], query: torch.Tensor):
        if not (isinstance(query, torch.Tensor) and query.is_cuda):
            raise ValueError(f"CapturedCall needs a CUDA query, got "
                             f"{getattr(query, 'device', type(query).__name__)}")
        self.query = query.clone()
        with torch.cuda.device(query.device):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fn(self.query)  # compile and warm up outside the capture
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, stream=side):
                self.out = fn(self.query)

    def __call__(self, query: torch.Tensor) -> torch.Tensor:
        """``fn(query)`` for ``query`` of the example's shape, dtype and device: a new tensor
        (the graph's own output is overwritten by the next call)."""
        q = self.query
        if not isinstance(query, torch.Tensor) or (query.shape, query.dtype, query.device) != (
                q.shape, q.dtype, q.device):
            got = ((query.shape, query.dtype, query.device) if isinstance(query, torch.Tensor)
                   else type(query).__name__)
            raise ValueError(f"this call was captured for a query {tuple(q.shape)} {q.dtype} on "
                             f"{q.device}, got {got}")
        with torch.cuda.device(q.device):
            q.copy_(query)
            self.graph.replay()
            return self.out.clone()
