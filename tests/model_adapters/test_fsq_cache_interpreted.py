"""FSQCache's decode steps through the Triton kernel, run by Triton's CPU interpreter:
launched (growing and capacity caches) and compiled (the kernel as one operator in the graph),
against the float32 torch path.

Needs ``TRITON_INTERPRET=1`` from process start (see ``tests/kernels/test_kernels_interpreted.py``);
``test_fsq_models.py::test_fsq_cache_triton_path_under_the_interpreter`` starts such a process.
"""

from __future__ import annotations

import os

import pytest

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1 from process start", allow_module_level=True)

from adapters_fixtures import TINY_MODELS, torch  # noqa: E402

from model_adapters.caches.fsq_cache import FSQCache  # noqa: E402
from model_adapters.models import cache_kwarg  # noqa: E402
from model_adapters.quant.fsq_convert import convert_to_fsq  # noqa: E402

IDS = torch.randint(2, 100, (2, 18), generator=torch.Generator().manual_seed(7))
PREFILL = 14


def _logits(model, cache, step=None):
    """The prefill eagerly, then one token at a time (``step``: a compiled forward)."""
    kw = cache_kwarg(model)
    forward = step or (lambda ids: model(ids, use_cache=True, **{kw: cache}).logits)
    with torch.no_grad():
        outs = [model(IDS[:, :PREFILL], use_cache=True, **{kw: cache}).logits]
        outs += [forward(IDS[:, t:t + 1]) for t in range(PREFILL, IDS.shape[1])]
    return torch.cat(outs, 1).float()


@pytest.mark.parametrize("arch", ["qwen3", "gpt2"])
def test_triton_steps_launched_and_compiled_match_the_torch_path(arch, monkeypatch):
    from kernels import fsq_decode

    launched = []
    launch = fsq_decode._triton

    def spy(problem, num_splits):
        launched.append(problem.codes.shape[1])
        return launch(problem, num_splits)

    monkeypatch.setattr(fsq_decode, "_triton", spy)
    model = convert_to_fsq(TINY_MODELS[arch](), "fsq-w8-L16", IDS).to(torch.bfloat16)
    want = _logits(model, FSQCache(model, backend="torch"))
    steps = IDS.shape[1] - PREFILL
    for capacity in (None, 24):
        cache = FSQCache(model, backend="triton", capacity=capacity)
        got = _logits(model, cache)
        assert cache.kernel_calls == steps * model.config.num_hidden_layers
        assert (got - want).abs().max() <= 0.02 * want.abs().max(), capacity
    cache = FSQCache(model, backend="triton", capacity=24)
    kw = cache_kwarg(model)
    torch._dynamo.reset()
    step = torch.compile(lambda ids: model(ids, use_cache=True, **{kw: cache}).logits,
                         fullgraph=True, backend="eager")
    launched.clear()
    with torch._dynamo.config.patch(error_on_recompile=True):
        got = _logits(model, cache, step)
    # the kernel ran every compiled step of every layer, over the whole buffer
    assert launched == [24 + 1] * (steps * model.config.num_hidden_layers)
    assert cache.kernel_calls == 0  # (compiled steps count nothing: the host does not follow)
    assert cache.get_seq_length() == IDS.shape[1]
    assert (got - want).abs().max() <= 0.02 * want.abs().max()
    # compiled steps straight after load() (no eager forward: load prepares the kernel's rope)
    held = FSQCache(model, backend="torch")
    with torch.no_grad():
        model(IDS[:, :PREFILL], use_cache=True, **{kw: held})
    loaded = FSQCache(model, backend="triton", capacity=24)
    loaded.load([held.layer_codes(i) for i in range(len(held.layers))],
                held.layers[0].positions())
    torch._dynamo.reset()
    step = torch.compile(lambda ids: model(ids, use_cache=True, **{kw: loaded}).logits,
                         fullgraph=True, backend="eager")
    with torch.no_grad():
        got = torch.cat([step(IDS[:, t:t + 1]) for t in range(PREFILL, IDS.shape[1])], 1)
    tail = want[:, PREFILL:]
    assert (got.float() - tail).abs().max() <= 0.02 * tail.abs().max()
