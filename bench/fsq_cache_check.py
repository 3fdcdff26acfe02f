"""FSQCache against the model's own forward and against DynamicCache generation, on any device.

For a saved FSQ bottleneck on its base model, in float32 and in bfloat16 (``model.to(dtype)``,
which also rounds the rotary embedding's ``inv_freq`` to bfloat16): logits of ``--tokens``
held-out book tokens through FSQCache (prefill, then ``--steps`` decode steps) against the full
forward (max difference, argmax agreement). Then, in bfloat16, greedy needle answers at
``--length`` generated with DynamicCache (the baseline) and with FSQCache. Prints a table,
writes JSON.

    python bench/fsq_cache_check.py --model standin-qwen3-8k --val books-gpt2-val.u16.xz \\
        --bottleneck bench/results/fsq-w32-L16-tau0.25-kl-lr0.003 --length 8192 --items 3
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from _common import add_out_option, machine, markdown_table, out_name, write_json  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

import model_adapters  # noqa: E402,F401  (registers the converted models)
from model_adapters.caches.fsq_cache import FSQCache, rotary_embedding  # noqa: E402
from model_adapters.experiments.needles import load_tokens, needle_item, retrieval_keys  # noqa: E402
from model_adapters.models import cache_kwarg  # noqa: E402
from model_adapters.quant.fsq_convert import load_bottleneck  # noqa: E402


def _inv_freq_dtype(model) -> str:
    rotary = rotary_embedding(model)
    return "none" if rotary is None else str(rotary.inv_freq.dtype).removeprefix("torch.")


@torch.no_grad()
def logits_check(model, tokens, steps, kw, backend) -> dict:
    n = tokens.shape[1]
    full = model(input_ids=tokens, use_cache=False).logits.float()
    cache = FSQCache(model, backend=backend)
    got = [model(input_ids=tokens[:, :n - steps], use_cache=True, **{kw: cache}).logits.float()]
    for t in range(n - steps, n):
        step = model(input_ids=tokens[:, t:t + 1], use_cache=True, **{kw: cache})
        got.append(step.logits.float())
    got = torch.cat(got, 1)
    agree = (got.argmax(-1) == full.argmax(-1)).float()[0]
    return {"max_abs_logit_diff": float((got - full).abs().max()),
            "argmax_agreement": float(agree.mean()),
            "argmax_agreement_second_half": float(agree[n // 2:].mean()),
            "kernel_calls": cache.kernel_calls}


@torch.no_grad()
def needles(model, val, keys, encode, length, items, kw, backend) -> dict:
    rng, dense, fsq, same = random.Random(321), 0, 0, 0
    for _ in range(items):
        ids, mask = needle_item(length, val, keys, encode, rng)
        answer = ids[-sum(mask):]
        prompt = torch.tensor([ids[:-len(answer)]], device=model.device)
        plain = dict(max_new_tokens=len(answer), do_sample=False, pad_token_id=0,
                     attention_mask=torch.ones_like(prompt))
        ref = model.generate(prompt, **plain)[0, prompt.shape[1]:].tolist()
        gen = model.generate(prompt, **plain, **{kw: FSQCache(model, backend=backend)})
        gen = gen[0, prompt.shape[1]:].tolist()
        dense, fsq, same = dense + (ref == answer), fsq + (gen == answer), same + (gen == ref)
    return {"length": length, "items": items, "dynamic_cache_correct": dense,
            "fsqcache_correct": fsq, "fsqcache_same_as_dynamic_cache": same}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--val", required=True)
    p.add_argument("--bottleneck", required=True)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--length", type=int, default=8192)
    p.add_argument("--items", type=int, default=3)
    p.add_argument("--backend", default="auto", choices=("auto", "torch", "triton"))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    add_out_option(p, "fsq-cache-check")
    args = p.parse_args(argv)
    started = time.time()
    tok = AutoTokenizer.from_pretrained(args.model)
    base = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    model = load_bottleneck(args.bottleneck, base).to(args.device).eval()
    val = load_tokens(args.val)
    _, keys = retrieval_keys(tok)
    kw = cache_kwarg(model)

    def encode(s):
        return tok(s, add_special_tokens=False)["input_ids"]

    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        model.to(dtype)
        tokens = val[:args.tokens][None].to(args.device)
        rows.append({"dtype": str(dtype).removeprefix("torch."),
                     "inv_freq_dtype": _inv_freq_dtype(model),
                     **logits_check(model, tokens, args.steps, kw, args.backend)})
    gen = needles(model, val, keys, encode, args.length, args.items, kw, args.backend)
    print(markdown_table(rows, [("dtype", "dtype"), ("inv_freq_dtype", "inv_freq"),
                                ("max_abs_logit_diff", "max logit diff"),
                                ("argmax_agreement", "argmax agreement"),
                                ("argmax_agreement_second_half", "second half"),
                                ("kernel_calls", "kernel calls")]))
    print(f"\nbf16 greedy needles at {gen['length']}: DynamicCache {gen['dynamic_cache_correct']}"
          f"/{gen['items']}, FSQCache {gen['fsqcache_correct']}/{gen['items']} (same answer as "
          f"DynamicCache: {gen['fsqcache_same_as_dynamic_cache']})")
    path = write_json(out_name(args, "fsq-cache-check"), {
        "machine": machine(), "torch": torch.__version__, "model": Path(args.model).name,
        "bottleneck": Path(args.bottleneck).name, "tokens": args.tokens, "steps": args.steps,
        "backend": args.backend, "logits": rows, "generate": gen,
        "seconds": round(time.time() - started, 1)})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
