"""FSQCache on a GPU: the Triton decode path, growing and with a capacity (captured calls),
against the torch path (skips without CUDA)."""

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Qwen3Config, Qwen3ForCausalLM

from model_adapters.caches.fsq_cache import FSQCache
from model_adapters.models import cache_kwarg
from model_adapters.quant.fsq_convert import convert_to_fsq
from model_adapters.quant.fsq_model import attention_layers

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_triton_decode_steps_match_the_torch_path():
    pytest.importorskip("triton")
    torch.manual_seed(0)
    base = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=101, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
        bos_token_id=0, eos_token_id=1)).eval()
    ids = torch.randint(0, 101, (2, 400))
    model = convert_to_fsq(base, "fsq-w32-L16", ids[:, :200]).cuda().to(torch.bfloat16)
    ids = ids.cuda()
    kw = cache_kwarg(model)
    logits = {}
    for backend in ("torch", "triton"):
        cache = FSQCache(model, backend=backend)
        with torch.no_grad():
            model(ids[:, :384], use_cache=True, **{kw: cache})
            steps = [model(ids[:, t:t + 1], use_cache=True, **{kw: cache}).logits.float()
                     for t in range(384, 400)]
        logits[backend] = torch.cat(steps, 1)
        assert (cache.kernel_calls > 0) == (backend == "triton")
    diff = (logits["triton"] - logits["torch"]).abs().max()
    assert diff < 0.05 * logits["torch"].abs().max(), float(diff)


def _base(kind: str):
    """A random-initialised Qwen3 (GQA, RoPE, k_norm) or GPT-2 of head_dim 64, float32."""
    torch.manual_seed(0)
    if kind == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(
            vocab_size=101, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=64,
            max_position_embeddings=4096, bos_token_id=0, eos_token_id=1)).eval()
    return GPT2LMHeadModel(GPT2Config(vocab_size=101, n_embd=128, n_layer=2, n_head=2,
                                      n_positions=1024, bos_token_id=0, eos_token_id=1)).eval()


@pytest.mark.parametrize("kind", ["qwen3", "gpt2"])
def test_capacity_cache_replays_captured_kernel_calls_that_match_the_torch_path(kind,
                                                                              monkeypatch):
    """FSQCache(capacity=...): each layer's decode step is captured once and replayed; its
    logits match the torch path and the growing cache's kernel path, a decode step reads
    nothing back from the GPU, and on Hopper the captured call is the warp-specialized
    kernel's."""
    pytest.importorskip("triton")
    from kernels import fsq_decode
    from kernels._fsq_plan import uses_ws, ws_limit

    problems = []
    decode = fsq_decode.decode_fsq_problem
    monkeypatch.setattr(fsq_decode, "decode_fsq_problem",
                        lambda p, **k: (problems.append(p), decode(p, **k))[1])
    base = _base(kind)
    ids = torch.randint(0, 101, (2, 400))
    model = convert_to_fsq(base, "fsq-w32-L16", ids[:, :200]).cuda().to(torch.bfloat16)
    ids = ids.cuda()
    kw = cache_kwarg(model)
    logits, caches = {}, {}
    for name, backend, capacity in (("torch", "torch", None), ("growing", "triton", None),
                                    ("capacity", "triton", 512)):
        cache = caches[name] = FSQCache(model, backend=backend, capacity=capacity)
        with torch.no_grad():
            model(ids[:, :384], use_cache=True, **{kw: cache})
            steps = [model(ids[:, t:t + 1], use_cache=True, **{kw: cache}).logits.float()
                     for t in range(384, 400)]
        logits[name] = torch.cat(steps, 1)
    cache = caches["capacity"]
    assert cache.kernel_calls == 2 * 16 and len(cache._captured) == 2
    captured = [p for p in problems if p.codes.shape[1] == 512 + 1]  # (the capacity's buffer)
    assert len(captured) == 2 * 2  # each layer's warm-up and capture, never again
    if torch.cuda.get_device_capability()[0] == 9:
        assert all(uses_ws(p) for p in captured), [ws_limit(p) for p in captured]
    scale = logits["torch"].abs().max()
    for name in ("growing", "capacity"):
        diff = (logits[name] - logits["torch"]).abs().max()
        assert diff < 0.05 * scale, (name, float(diff))
    # one more decode step straight into a layer, with the GPU's read-backs made errors
    layer = attention_layers(model)[1]
    held = cache._captured[1][1]
    query = torch.randn(2, model.config.num_attention_heads, 1, 64, device="cuda",
                        dtype=torch.bfloat16)
    codes = torch.randint(0, 16, (2, 1, 32), device="cuda")
    position = torch.full((2, 1), 400, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = cache.fsq_attention(layer, query, codes, None, position_ids=position)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert cache._captured[1][1] is held and out.shape == (2, 1, query.shape[1], 64)
    assert cache.get_seq_length(1) == 401


@pytest.mark.parametrize("kind", ["qwen3", "gpt2"])
def test_generate_compiles_the_capacity_cache_with_cuda_graphs_and_matches_eager(kind):
    """``generate`` compiles FSQCache(capacity=...)'s decode steps by itself (inductor, CUDA
    graphs; the kernel one operator in the graph): one compiled graph, logits equal to the
    eager (captured-call) run within bf16, and the length read back once afterwards."""
    pytest.importorskip("triton")
    from torch._dynamo.utils import counters

    ids = torch.randint(0, 101, (2, 200))
    model = convert_to_fsq(_base(kind), "fsq-w32-L16", ids).cuda().to(torch.bfloat16)
    kw = cache_kwarg(model)
    runs = {}
    for name, compile_off in (("eager", True), ("compiled", False)):
        cache = FSQCache(model, capacity=256)
        torch._dynamo.reset()
        counters.clear()
        with torch.no_grad():
            out = model.generate(ids[:, :160].cuda(), max_new_tokens=24, do_sample=False,
                                 disable_compile=compile_off, output_logits=True,
                                 return_dict_in_generate=True, **{kw: cache})
        runs[name] = (torch.stack(out.logits, 1).float(), counters["stats"]["unique_graphs"],
                      cache)
    (want, eager_graphs, eager), (got, graphs, compiled) = runs["eager"], runs["compiled"]
    assert eager_graphs == 0 and graphs >= 1  # generate compiled the decode step by itself
    assert eager.kernel_calls > 0 and len(eager._captured) == 2
    assert compiled.layers[1].length is None and compiled.get_seq_length() == 160 + 23
    assert (got - want).abs().max() <= 0.05 * want.abs().max()
