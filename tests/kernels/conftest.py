"""Fixtures of the kernel tests."""

from __future__ import annotations

import contextlib

import pytest


@pytest.fixture
def no_gpu_sync():
    """A context manager under which any wait for the GPU raises (CUDA sync debug mode)."""
    import torch

    @contextlib.contextmanager
    def guard():
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")

    return guard


@pytest.fixture
def assert_graph_replays():
    """``check(call, refill)``: capture ``call()`` in a CUDA graph (after one warm-up on a side
    stream, which compiles and fills caches), then twice ``refill()`` the inputs in place,
    replay, and require the graph's output to equal a fresh ``call()`` exactly."""
    import torch

    def check(call, refill):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            call()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = call()
        for step in range(2):
            refill()
            graph.replay()
            torch.testing.assert_close(out, call(), rtol=0, atol=0, msg=f"replay {step}")

    return check
