"""kernels.CapturedCall: a call captured in a CUDA graph reads its buffers where they are."""

from __future__ import annotations

import pytest
import torch

from kernels import CapturedCall


def test_a_cpu_query_is_refused_naming_its_device():
    with pytest.raises(ValueError, match="CUDA query, got cpu"):
        CapturedCall(lambda q: q * 2, torch.ones(3))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_replay_sees_new_queries_and_buffers_changed_in_place():
    buffer = torch.arange(6.0, device="cuda")
    call = CapturedCall(lambda q: q @ buffer.reshape(3, 2), torch.zeros(4, 3, device="cuda"))
    for step in range(3):
        query = torch.randn(4, 3, device="cuda")
        buffer.add_(step)  # in place: the graph reads the new contents
        out = call(query)
        torch.testing.assert_close(out, query @ buffer.reshape(3, 2))
    kept = call(torch.ones(4, 3, device="cuda"))
    call(torch.zeros(4, 3, device="cuda"))
    assert kept.abs().sum() > 0  # each call returns its own tensor, not the graph's output
    for bad in (torch.zeros(1, 3, device="cuda"), torch.zeros(4, 3, device="cuda").double(),
                torch.zeros(4, 3)):  # copy_ would broadcast / cast these silently
        with pytest.raises(ValueError, match=r"captured for a query \(4, 3\) torch.float32"):
            call(bad)
