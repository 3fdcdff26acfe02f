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
