"""Cost of the archiving cache per decode step, against DynamicCache in the same run.

A randomly initialised model with GPT-2 small's shapes (12 layers, 12 heads, 768 wide) by
default; codebooks are trained on K/V the model caches over random tokens (training time is
reported too). Each round prefills every cache with the same tokens, then times the same decode
steps with each: DynamicCache, the archiving cache quantizing each position on the step it
leaves the exact window (``block`` 1), and the archiving cache quantizing in groups of
``--block`` positions (aligned on the sinks, so every chunking of a sequence still computes
what token-by-token decoding does); the order rotates between rounds. Prints a table and writes
JSON. ``--codebooks DIR`` keeps the trained codebooks in DIR and reuses them on the next run
(the model is the same: its weights come from a fixed seed).

    python bench/adapters.py [--steps 64] [--prefill 512] [--block 16] [--codebooks DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import DynamicCache, GPT2Config, GPT2LMHeadModel  # noqa: E402

from model_adapters.caches.archiving import ArchivingCache  # noqa: E402
from model_adapters.caches.code_rows import CodeRows  # noqa: E402
from model_adapters.caches.codes_attention import use_codes_attention  # noqa: E402
from model_adapters.models import cache_kwarg, kv_shape, model_identity  # noqa: E402
from model_adapters.quant.collect import collect_kv  # noqa: E402
from model_adapters.quant.configs import parse_config  # noqa: E402
from model_adapters.quant.quantizer import (  # noqa: E402
    CONFIG_FILE,
    KVQuantizer,
    train_kv_quantizer,
)
from model_adapters.store import archive_io  # noqa: E402


@torch.no_grad()
def _step_seconds(model, cache, prefill, steps) -> list[float]:
    """Wall time of each decode step after a prefill."""
    kw = cache_kwarg(model)
    model(prefill, use_cache=True, **{kw: cache})
    times = []
    for t in range(steps.shape[1]):
        start = time.perf_counter()
        model(steps[:, t : t + 1], use_cache=True, **{kw: cache})
        times.append(time.perf_counter() - start)
    return times


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--config", default="hybrid-k256-K4V2", help="quantizer config")
    p.add_argument("--train-tokens", type=int, default=4096)
    p.add_argument("--kmeans-iters", type=int, default=10)
    p.add_argument("--prefill", type=int, default=512)
    p.add_argument("--steps", type=int, default=64, help="decode steps timed per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--sinks", type=int, default=4)
    p.add_argument("--recent", type=int, default=32)
    p.add_argument("--block", type=int, default=16, help="group size of the third cache")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--codebooks", default=None,
                   help="folder to keep the trained codebooks in and reuse them from")
    p.add_argument("--json", default="bench/results/adapters.json")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    cfg = GPT2Config(
        n_layer=args.layers,
        n_head=args.heads,
        n_embd=args.hidden,
        n_positions=2048,
        bos_token_id=50256,
        eos_token_id=50256,
    )
    # the codes attention: the archiving cache's prefill shows its early queries exact positions
    model = use_codes_attention(GPT2LMHeadModel(cfg).eval())
    shape = kv_shape(model)
    qcfg = parse_config(args.config)
    gen = torch.Generator().manual_seed(1)
    train_ids = torch.randint(0, cfg.vocab_size, (args.train_tokens,), generator=gen).tolist()
    saved = Path(args.codebooks) if args.codebooks else None
    collect_s = train_s = None
    if saved is not None and (saved / CONFIG_FILE).exists():
        quantizer = KVQuantizer.from_pretrained(saved, model)
        if quantizer.config.canonical != qcfg.canonical:
            raise SystemExit(f"{saved} holds {quantizer.config.canonical}, not {qcfg.canonical}")
    else:
        t0 = time.perf_counter()
        keys, values = collect_kv(model, [train_ids], context=1024)
        collect_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        quantizer = train_kv_quantizer(keys, values, shape, qcfg, iters=args.kmeans_iters)
        train_s = time.perf_counter() - t0
        quantizer.identity = model_identity(model)
        if saved is not None:
            quantizer.save_pretrained(saved)

    prefill = torch.randint(0, cfg.vocab_size, (1, args.prefill), generator=gen)
    steps = torch.randint(0, cfg.vocab_size, (1, args.steps), generator=gen)
    names = ["dynamic", "archiving", f"archiving-block{args.block}"]
    blocks = {"archiving": 1, f"archiving-block{args.block}": args.block}
    per_step = {name: [] for name in names}  # per round: the list of step times
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for which in names[r % 3 :] + names[: r % 3]:
                if which == "dynamic":
                    cache, ar = DynamicCache(config=cfg), None
                else:
                    ar, stream = archive_io.open_for_writing(
                        Path(tmp) / f"round{r}-{which}.fkv",
                        model,
                        quantizer,
                        sinks=args.sinks,
                        recent=args.recent,
                    )
                    rows = CodeRows(shape.num_layers, stream.extend)
                    cache = ArchivingCache(
                        model,
                        quantizer,
                        sinks=args.sinks,
                        recent=args.recent,
                        rows=rows,
                        block=blocks[which],
                    )
                per_step[which].append(_step_seconds(model, cache, prefill, steps))
                if ar is not None:
                    ar.close()

    def summary(name):
        rounds = per_step[name]
        return {
            "ms_per_step": statistics.median(statistics.fmean(t) for t in rounds) * 1e3,
            "median_step_ms": statistics.median(statistics.median(t) for t in rounds) * 1e3,
            "max_step_ms": statistics.median(max(t) for t in rounds) * 1e3,
            "ms_per_step_all": [statistics.fmean(t) * 1e3 for t in rounds],
        }

    caches = {name: summary(name) for name in names}
    base = caches["dynamic"]["ms_per_step"]
    for rec in caches.values():
        rec["overhead_pct"] = 100.0 * (rec["ms_per_step"] / base - 1.0)
    result = {
        "model": f"random GPT-2 {args.layers} layers x {args.heads} heads x {args.hidden}",
        "config": args.config,
        "sinks": args.sinks,
        "recent": args.recent,
        "block": args.block,
        "prefill": args.prefill,
        "steps": args.steps,
        "rounds": args.rounds,
        "archive_written": True,
        "caches": caches,
        "train_tokens": args.train_tokens,
        "kmeans_iters": args.kmeans_iters,
        "collect_seconds": collect_s,
        "codebook_train_seconds": train_s,
        "codebooks_loaded": train_s is None,
        "torch_threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__,
    }
    what = "quantize + archive"
    labels = {
        "dynamic": "DynamicCache",
        "archiving": f"archiving ({what}), each position as it leaves",
        f"archiving-block{args.block}": f"archiving ({what}), groups of {args.block} "
        "aligned on the sinks",
    }
    print("| cache | ms / decode step (mean) | overhead | median step ms | slowest step ms |")
    print("|---|---|---|---|---|")
    for name in names:
        rec = caches[name]
        over = "–" if name == "dynamic" else f"{rec['overhead_pct']:+.1f}%"
        print(
            f"| {labels[name]} | {rec['ms_per_step']:.2f} | {over} | "
            f"{rec['median_step_ms']:.2f} | {rec['max_step_ms']:.2f} |"
        )
    if train_s is not None:
        print(
            f"codebook training ({args.config}, {args.train_tokens} tokens, "
            f"{args.kmeans_iters} iters): {train_s:.1f} s; K/V collection {collect_s:.1f} s"
        )
    else:
        print(f"codebooks loaded from {saved}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
