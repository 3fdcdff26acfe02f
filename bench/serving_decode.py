"""Decode speed and cache memory of the codes-only cache against DynamicCache (GPU).

For each model (the Qwen3 stand-in from ``--model-dir``, and a random-initialised Qwen3 with
Qwen3-8B's attention shapes: hidden 4096, 32 query / 8 KV heads of 128, ``--big-layers`` layers)
and each context length N, both caches are filled to N positions through ``Cache.update`` with
random K/V (decode speed and bytes depend on shapes, not on values; codebooks are random too),
then the model decodes ``--steps`` tokens on top of each, in the same process. The codes-only
cache runs twice: quantizing each position as it leaves the recent window (``codes``), and in
groups of ``--block`` (``grouped``). Reported: tokens/s, the bytes the cache holds, and the peak
extra CUDA memory of one decode step.

Writes ``bench/results/serving-decode.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import machine, markdown_table, write_json  # noqa: E402
from model_adapters.caches.codes_only import (  # noqa: E402
    CodesOnlyCache,
    dense_cache_bytes,
    use_codes_attention,
)
from model_adapters.models import (
    cache_kwarg,  # noqa: E402
    kv_shape,  # noqa: E402
)
from model_adapters.quant.quantizer import KVQuantizer  # noqa: E402


def big_qwen3(layers: int, device, dtype):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                      head_dim=128, intermediate_size=12288, num_hidden_layers=layers,
                      vocab_size=151936, max_position_embeddings=262144, bos_token_id=0,
                      eos_token_id=1)
    with torch.device(device):
        model = Qwen3ForCausalLM(cfg).to(dtype).eval()
    return model


def random_quantizer(model, device, stages=2, k=256):
    s = kv_shape(model)
    g = torch.Generator().manual_seed(0)
    books = [0.3 * torch.randn(s.num_layers, s.kv_heads, stages, k, s.head_dim, generator=g)
             for _ in range(2)]
    return KVQuantizer(s, *books).to(device)


def fill(cache, shape, n, device, dtype, chunk=8192):
    """Fill a cache to ``n`` positions with random K/V through ``update``."""
    g = torch.Generator(device=device).manual_seed(1)
    codes_only = isinstance(cache, CodesOnlyCache)
    for a in range(0, n, chunk):
        m = min(chunk, n - a)
        for li in range(shape.num_layers):
            k = torch.randn(1, shape.kv_heads, m, shape.head_dim, generator=g, device=device)
            v = torch.randn(1, shape.kv_heads, m, shape.head_dim, generator=g, device=device)
            cache.update(k.to(dtype), v.to(dtype), li)
            if codes_only:
                cache.layers[li].coded_cache()


@torch.no_grad()
def decode(model, cache, steps, device, warmup=3):
    kw = cache_kwarg(model)
    cuda = torch.device(device).type == "cuda"
    tok = torch.tensor([[5]], device=device)
    for _ in range(warmup):  # the first call compiles the Triton kernel
        tok = model(tok, **{kw: cache}).logits[:, -1:].argmax(-1)
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(steps):
        tok = model(tok, **{kw: cache}).logits[:, -1:].argmax(-1)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    return steps / seconds, (torch.cuda.max_memory_allocated() - base) if cuda else float("nan")


def run(name, model, contexts, steps, dtype, device, block):
    from transformers import DynamicCache

    shape = kv_shape(model)
    q = random_quantizer(model, device)
    rows = []
    for n in contexts:
        row = {"model": name, "context": n}
        for label, make in (("dynamic", lambda: DynamicCache(config=model.config)),
                            ("codes", lambda: CodesOnlyCache(model, q)),
                            ("grouped", lambda: CodesOnlyCache(model, q, block=block))):
            if torch.device(device).type == "cuda":
                torch.cuda.empty_cache()
            cache = make()
            fill(cache, shape, n, device, dtype)
            held = (dense_cache_bytes(cache) if label == "dynamic"
                    else cache.live_bytes()["total"])
            tps, peak = decode(model, cache, steps, device)
            row |= {f"{label}_tok_s": tps, f"{label}_cache_MiB": held / 2**20,
                    f"{label}_step_peak_MiB": peak / 2**20}
            del cache
        row["memory_ratio"] = row["dynamic_cache_MiB"] / row["codes_cache_MiB"]
        row["speed_ratio"] = row["codes_tok_s"] / row["dynamic_tok_s"]
        row["grouped_speed_ratio"] = row["grouped_tok_s"] / row["dynamic_tok_s"]
        print(row, flush=True)
        rows.append(row)
    return rows


def profile(args, device, dtype):
    """Where a decode step spends its time, both caches (torch.profiler, CPU and CUDA)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile
    from transformers import AutoModelForCausalLM, DynamicCache

    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=dtype).to(device).eval()
    model = use_codes_attention(model)
    q = random_quantizer(model, device)
    for label, cache in (("dynamic", DynamicCache(config=model.config)),
                         ("codes", CodesOnlyCache(model, q))):
        fill(cache, kv_shape(model), args.contexts[0], device, dtype)
        decode(model, cache, 4, device)
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
        with torch_profile(activities=acts) as prof:
            tps, _ = decode(model, cache, args.steps, device, warmup=0)
        print(f"== {label}: {tps:.1f} tok/s")
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=18))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-dir", help="the Qwen3 stand-in (skipped if absent)")
    parser.add_argument("--contexts", type=int, nargs="*", default=[8192, 32768, 131072])
    parser.add_argument("--big-layers", type=int, default=8,
                        help="layers of the Qwen3-8B-shaped model (0: skip it)")
    parser.add_argument("--steps", type=int, default=32,
                        help="decode steps timed (a multiple of --block counts its groups fairly)")
    parser.add_argument("--block", type=int, default=16,
                        help="the 'grouped' codes-only cache quantizes this many positions at once")
    parser.add_argument("--device", default="cuda", help="cuda (the measurement) or cpu (a check)")
    parser.add_argument("--out", default="serving-decode")
    parser.add_argument("--profile", action="store_true",
                        help="profile decode steps of both caches at the first context only")
    args = parser.parse_args(argv)
    device = args.device
    dtype = torch.bfloat16
    rows = []
    if args.profile:
        profile(args, device, dtype)
        return
    if args.model_dir:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=dtype).to(device)
        rows += run("standin-qwen3", use_codes_attention(model.eval()), args.contexts, args.steps,
                    dtype, device, args.block)
        del model
    if args.big_layers:
        model = use_codes_attention(big_qwen3(args.big_layers, device, dtype))
        rows += run(f"qwen3-8b-shapes-{args.big_layers}L", model, args.contexts, args.steps,
                    dtype, device, args.block)
    print(markdown_table(rows, [
        ("model", "model"), ("context", "context"), ("dynamic_tok_s", "DynamicCache tok/s"),
        ("codes_tok_s", "codes-only tok/s"), ("grouped_tok_s", f"block={args.block} tok/s"),
        ("speed_ratio", "codes / dynamic"),
        ("grouped_speed_ratio", f"block={args.block} / dynamic"),
        ("dynamic_cache_MiB", "DynamicCache MiB"),
        ("codes_cache_MiB", "codes-only MiB"), ("memory_ratio", "memory ratio"),
        ("codes_step_peak_MiB", "codes step peak MiB")]))
    gpu = torch.cuda.get_device_name() if device.startswith("cuda") else None
    path = write_json(args.out, {"machine": machine(), "gpu": gpu,
                                 "args": vars(args), "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
