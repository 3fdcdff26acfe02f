import torch
from transformers import Qwen3Config, Qwen3ForCausalLM, GPT2Config, GPT2LMHeadModel
from model_adapters.quant.fsq_convert import convert_to_fsq
from model_adapters.caches.fsq_cache import FSQCache
torch.manual_seed(0)
qc = Qwen3Config(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256, bos_token_id=0, eos_token_id=1)
gc = GPT2Config(vocab_size=101, n_embd=64, n_layer=2, n_head=4, n_positions=128, bos_token_id=0, eos_token_id=1)
ids = torch.randint(0, 101, (2, 24))
for base in (Qwen3ForCausalLM(qc).eval(), GPT2LMHeadModel(gc).eval()):
  for spec in ("fsq-w8-L16", "fsq-w12-L5"):
    c = convert_to_fsq(base, spec, ids)
    with torch.no_grad():
        full = c(ids).logits
        cache = FSQCache(c)
        a = c(ids[:, :10], cache=cache, use_cache=True).logits
        b = c(ids[:, 10:17], cache=cache, use_cache=True).logits
        steps = [c(ids[:, t:t+1], cache=cache, use_cache=True).logits for t in range(17, 24)]
        got = torch.cat([a, b, *steps], 1)
    print(spec, (got - full).abs().max().item(), cache.nbytes(), cache.get_seq_length())
    out = c.generate(ids[:1, :5], max_new_tokens=6, do_sample=False, cache=FSQCache(c))
    ref = c.generate(ids[:1, :5], max_new_tokens=6, do_sample=False)
    print(out.tolist(), ref.tolist())
