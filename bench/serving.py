"""Codes-only serving cache: live memory against DynamicCache, resume from disk against prefill.

For each model directory (GPT-2 or Qwen3, loaded with ``from_pretrained``):

1. codebooks are trained on a span of the book disjoint from the measured text (the paper's
   protocol; ``--config`` names the quantizer);
2. memory: the bytes of the tensors each cache holds after N tokens (``live_bytes`` for the
   codes-only cache, keys + values for ``DynamicCache``). Up to the model's position limit the
   model itself runs (prefill in chunks of ``--chunk``); beyond it (GPT-2's 1024 learned
   positions) both caches are driven through ``Cache.update`` with the model's own K/V from the
   longest run, tiled: the bytes depend only on shapes and dtypes, and the method is recorded;
3. resume (needs ``fkvstore.open``): an archive of N tokens is written and closed, then the
   time to reopen it and rebuild the cache is compared with re-running the prefill (codes-only
   cache and DynamicCache); the next token is timed apart, and its logits from the resumed cache
   are checked against the live cache's.

Writes ``bench/results/serving.json`` (or ``--out``) and prints the tables.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import machine, markdown_table, write_json  # noqa: E402
from model_adapters.caches.codes_only import (  # noqa: E402
    CodesOnlyCache,
    dense_cache_bytes,
    use_codes_attention,
)
from model_adapters.experiments.text import clean_text, split_tokens  # noqa: E402
from model_adapters.models import (  # noqa: E402
    cache_kwarg,  # noqa: E402
    kv_shape,
    max_positions,
)
from model_adapters.quant.collect import collect_kv  # noqa: E402
from model_adapters.quant.configs import parse_config  # noqa: E402
from model_adapters.quant.quantizer import train_kv_quantizer  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def load(model_dir: str, dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    return use_codes_attention(model), AutoTokenizer.from_pretrained(model_dir)


def token_ids(text: str, tokenizer, need: int, train_tokens: int, limit: int):
    """The measured ids (the book from chapter I, repeated if shorter) and training segments."""
    split = split_tokens(text, tokenizer, tokens=min(1024, limit), train_tokens=train_tokens)
    book = tokenizer.encode(text, add_special_tokens=False)
    ids = (book * (need // len(book) + 1))[:need]
    return ids, [s[:limit] for s in split.train_segments], need > len(book)


@torch.no_grad()
def prefill(model, cache, ids: list[int], chunk: int):
    kw = cache_kwarg(model)
    out = None
    for a in range(0, len(ids), chunk):
        out = model(torch.tensor([ids[a : a + chunk]]), **{kw: cache})
    return out


def drive(cache, keys, values, n: int, chunk: int):
    """Feed ``n`` positions of tiled K/V (per layer ``(1, kv_heads, m, d)``) through update."""
    codes_only = isinstance(cache, CodesOnlyCache)
    for a in range(0, n, chunk):
        b = min(n, a + chunk)
        idx = torch.arange(a, b) % keys[0].shape[2]
        for li in range(len(keys)):
            cache.update(keys[li][:, :, idx], values[li][:, :, idx], li)
            if codes_only:
                cache.layers[li].coded_cache()  # what the attention function does


def measure_memory(model, q, ids, sizes, window, chunk):
    from transformers import DynamicCache

    limit = max_positions(model)
    rows, kv = [], None
    for n in sorted(sizes):
        codes, dyn = CodesOnlyCache(model, q, **window), DynamicCache(config=model.config)
        if n <= limit:
            t0 = time.perf_counter()
            prefill(model, codes, ids[:n], chunk)
            seconds = time.perf_counter() - t0
            prefill(model, dyn, ids[:n], chunk)
            kv = ([layer.keys for layer in dyn.layers], [layer.values for layer in dyn.layers])
            method = "model prefill"
        else:
            seconds = None
            drive(codes, *kv, n, chunk)
            drive(dyn, *kv, n, chunk)
            method = f"update with the model's K/V of {kv[0][0].shape[2]} tokens, tiled"
        live = codes.live_bytes()
        dense = dense_cache_bytes(dyn)
        rows.append({
            "tokens": n, "method": method, "dynamic_bytes": dense,
            "codes_only_bytes": live["total"], "window_bytes": live["window"],
            "codes_bytes": live["codes"], "codebook_bytes": live["codebooks"],
            "ratio": dense / live["total"], "ratio_without_codebooks":
                dense / (live["total"] - live["codebooks"]),
            "archived_tokens": codes.archived_tokens, "prefill_s": seconds,
        })
        print(f"  {n:>6} tokens: DynamicCache {dense / 2**20:8.2f} MiB, codes-only "
              f"{live['total'] / 2**20:7.2f} MiB ({method})", flush=True)
    return rows


def measure_resume(model, q, ids, n, window, chunk, repeats):
    from transformers import DynamicCache

    from model_adapters.store import serving_archive

    kw = cache_kwarg(model)
    nxt = torch.tensor([[ids[n]]])
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "run.fkv"
        t0 = time.perf_counter()
        with serving_archive.create(path, model, q, **window) as sa:
            for a in range(0, n, chunk):
                sa.forward(model, torch.tensor([ids[a : min(n, a + chunk)]]))
        write_s = time.perf_counter() - t0
        file_bytes = path.stat().st_size

        def next_logits(cache):
            with torch.no_grad():
                return model(nxt, **{kw: cache}).logits[0, -1]

        timings = {k: [] for k in ("resume", "resume_next", "prefill_codes_only",
                                   "prefill_dynamic", "dynamic_next")}
        for _ in range(repeats):
            t0 = time.perf_counter()
            sa = serving_archive.resume(path, model, mode="r")
            t1 = time.perf_counter()
            resumed = next_logits(sa.cache)
            timings["resume"].append(t1 - t0)
            timings["resume_next"].append(time.perf_counter() - t1)
            sa.close()
            live_cache = CodesOnlyCache(model, q, **window)
            t0 = time.perf_counter()
            prefill(model, live_cache, ids[:n], chunk)
            timings["prefill_codes_only"].append(time.perf_counter() - t0)
            live = next_logits(live_cache)
            dyn = DynamicCache(config=model.config)
            t0 = time.perf_counter()
            prefill(model, dyn, ids[:n], chunk)
            t1 = time.perf_counter()
            next_logits(dyn)
            timings["prefill_dynamic"].append(t1 - t0)
            timings["dynamic_next"].append(time.perf_counter() - t1)
    med = {k: float(np.median(v)) for k, v in timings.items()}
    return {
        "tokens": n, "archive_file_bytes": file_bytes, "write_s": write_s,
        "resume_s": med["resume"], "prefill_codes_only_s": med["prefill_codes_only"],
        "prefill_dynamic_s": med["prefill_dynamic"],
        "next_token_codes_only_s": med["resume_next"],
        "next_token_dynamic_s": med["dynamic_next"],
        "speedup_vs_dynamic_prefill": med["prefill_dynamic"] / med["resume"],
        "max_abs_logit_diff_resume_vs_live": float((resumed - live).abs().max()),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-dir", action="append", required=True,
                        help="a GPT-2 or Qwen3 checkpoint directory (repeatable)")
    parser.add_argument("--text", required=True, help="a Project Gutenberg book (txt)")
    parser.add_argument("--config", default="perhead-k256-s2", help="quantizer (configs.py)")
    parser.add_argument("--tokens", type=int, nargs="*", default=[1024, 8192, 32768])
    parser.add_argument("--resume-tokens", type=int, nargs="*", default=[1024])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--recent", type=int, default=32)
    parser.add_argument("--chunk", type=int, default=1024)
    parser.add_argument("--train-tokens", type=int, default=4096)
    parser.add_argument("--iters", type=int, default=10, help="k-means iterations")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="serving", help="name of the JSON under bench/results")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    text = clean_text(Path(args.text).read_text(encoding="utf-8"))
    window = {"sinks": args.sinks, "recent": args.recent}
    recorded = dict(vars(args), model_dir=[Path(d).name for d in args.model_dir],
                    text=Path(args.text).name)  # names only: no paths of this machine
    results = {"machine": machine(), "args": recorded, "models": []}
    for model_dir in args.model_dir:
        model, tok = load(model_dir, DTYPES[args.dtype])
        shape = kv_shape(model)
        limit = max_positions(model)
        print(f"{model_dir}: {shape}", flush=True)
        need = max(args.tokens + [r + 1 for r in args.resume_tokens])
        ids, train, repeated = token_ids(text, tok, need, args.train_tokens, limit)
        keys, values = collect_kv(model, train, context=min(1024, limit), progress=False)
        t0 = time.perf_counter()
        q = train_kv_quantizer(keys, values, shape, parse_config(args.config), iters=args.iters)
        train_s = time.perf_counter() - t0
        entry = {"model_dir": Path(model_dir).name, "shape": str(shape), "train_s": train_s,
                 "text_repeated": repeated, "memory": measure_memory(
                     model, q, ids, args.tokens, window, args.chunk), "resume": []}
        for n in args.resume_tokens:
            if n + 1 > limit:
                print(f"  resume at {n} tokens skipped: beyond {limit} positions")
                continue
            entry["resume"].append(
                measure_resume(model, q, ids, n, window, args.chunk, args.repeats))
        results["models"].append(entry)
        print(markdown_table(entry["memory"], [
            ("tokens", "tokens"), ("dynamic_bytes", "DynamicCache B"),
            ("codes_only_bytes", "codes-only B"), ("window_bytes", "window B"),
            ("codes_bytes", "codes B"), ("codebook_bytes", "codebooks B"),
            ("ratio", "ratio"), ("method", "method")]))
        if entry["resume"]:
            print(markdown_table(entry["resume"], [
                ("tokens", "tokens"), ("resume_s", "resume s"),
                ("prefill_codes_only_s", "prefill codes-only s"),
                ("prefill_dynamic_s", "prefill DynamicCache s"),
                ("speedup_vs_dynamic_prefill", "speed-up"),
                ("next_token_codes_only_s", "next token s, codes-only"),
                ("next_token_dynamic_s", "next token s, DynamicCache"),
                ("max_abs_logit_diff_resume_vs_live", "max |Δlogit|")]))
    print(f"wrote {write_json(args.out, results)}")


if __name__ == "__main__":
    main()
