"""FSQCache on a GPU: the Triton decode path against the torch path (skips without CUDA)."""

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from model_adapters.caches.fsq_cache import FSQCache
from model_adapters.models import cache_kwarg
from model_adapters.quant.fsq_convert import convert_to_fsq

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
