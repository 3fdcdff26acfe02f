"""Convert a stand-in to FSQ, finetune the bottleneck, and measure it beside the exact model.

For one FSQ setting (default ``fsq-w32-L16``: 16 B per token per layer): the exact model, the
conversion at tau = 0, and one finetune per loss (``ce``: next-token cross-entropy plus the
answer tokens' cross-entropy; ``kl``: the same plus KL to the original model's logits), each on
held-out book perplexity (8 windows of 1,024 tokens of the validation books) and the provisional
one-needle accuracy (teacher-forced, held-out keys and books) at 1K-8K. Then the best finetune
generates through ``FSQCache`` (the Triton kernel on CUDA): its logits against the model's own
forward, and needle answers generated greedily. Prints a table, writes JSON, saves each trained
bottleneck under ``--save``.

    python bench/fsq_finetune.py --model standin-qwen3-8k --train books-gpt2-train.u16.xz \\
        --val books-gpt2-val.u16.xz --tau 0.25 --save OUTDIR
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from _common import add_out_option, machine, markdown_table, out_name, write_json  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

import model_adapters  # noqa: E402,F401  (registers the converted models)
from model_adapters.caches.fsq_cache import FSQCache  # noqa: E402
from model_adapters.experiments.needles import (  # noqa: E402
    book_perplexity,
    load_tokens,
    needle_accuracy,
    needle_item,
    retrieval_keys,
    training_batches,
)
from model_adapters.models import cache_kwarg  # noqa: E402
from model_adapters.quant.fsq_convert import (  # noqa: E402
    convert_to_fsq,
    load_bottleneck,
    save_bottleneck,
)
from model_adapters.quant.fsq_train import finetune_fsq, steps_for_tau  # noqa: E402


def load_setup(args):
    """The frozen base model (float32, on ``args.device``), the training and held-out token
    arrays, the training and held-out needle keys, and the tokenizer's ``encode``."""
    tok = AutoTokenizer.from_pretrained(args.model)
    base = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).to(args.device)
    base.eval()
    for prm in base.parameters():
        prm.requires_grad_(False)
    train_keys, held_keys = retrieval_keys(tok)

    def encode(s):
        return tok(s, add_special_tokens=False)["input_ids"]

    return (base, load_tokens(args.train), load_tokens(args.val), train_keys, held_keys,
            encode)


def exact_row_and_calibration(base, train, val, held_keys, encode, args, result):
    """Measure the exact model into ``result["rows"]``; return the conversion's calibration
    ids: ``args.calibration x 2,048`` training tokens at seeded offsets, in sequences of
    ``min(2048, args.seq)`` tokens (so a model trained on short sequences, e.g. GPT-2's 1,024
    positions, is calibrated within its context), int64 ``(sequences, length)``."""
    row = {"config": "exact", **measure(base, val, held_keys, encode, args)}
    result["rows"].append(row)
    print(json.dumps(row), flush=True)
    length = min(2048, args.seq)
    count = args.calibration * 2048 // length
    g = torch.Generator().manual_seed(1)
    starts = torch.randint(0, len(train) - length - 1, (count,), generator=g)
    return torch.stack([train[s:s + length] for s in starts.tolist()])


def measure(model, val, keys, encode, args) -> dict:
    t0 = time.time()
    ppl = book_perplexity(model, val, autocast=torch.bfloat16 if args.device == "cuda" else None)
    niah = needle_accuracy(model, val, keys, encode, lengths=args.lengths, items=args.items,
                           autocast=torch.bfloat16 if args.device == "cuda" else None)
    return {"ppl": round(ppl, 3), "niah1": niah, "eval_seconds": round(time.time() - t0, 1)}


@torch.no_grad()
def cache_check(model, val, keys, encode, args) -> dict:
    """FSQCache against the model's own forward, then greedy needle answers through it."""
    import random

    kw = cache_kwarg(model)
    out = {}
    x = val[:args.check_tokens][None].to(args.device)
    split = args.check_tokens - args.check_steps
    for dtype in (torch.float32, torch.bfloat16):
        m = model.to(dtype)
        full = m(input_ids=x, use_cache=False).logits.float()
        cache = FSQCache(m)
        got = [m(input_ids=x[:, :split], use_cache=True, **{kw: cache}).logits.float()]
        for t in range(split, x.shape[1]):
            got.append(m(input_ids=x[:, t:t + 1], use_cache=True, **{kw: cache}).logits.float())
        got = torch.cat(got, 1)
        diff = (got - full).abs()
        out[str(dtype).removeprefix("torch.")] = {
            "max_abs_logit_diff": float(diff.max()), "max_abs_logit": float(full.abs().max()),
            "decode_steps_max_abs_diff": float(diff[:, split:].max()),
            "argmax_agreement": float((got.argmax(-1) == full.argmax(-1)).float().mean()),
            "cache_bytes": cache.nbytes(), "bytes_per_token_per_layer": cache.packed_bytes,
            "kernel_calls": cache.kernel_calls}
    m = model.to(torch.bfloat16)
    backends = ("torch", "auto") if args.device == "cuda" else ("torch",)
    hits, same = dict.fromkeys(backends, 0), dict.fromkeys(backends, 0)
    rng, dense_hits = random.Random(321), 0
    for _ in range(args.generate_items):
        ids, mask = needle_item(args.lengths[-1], val, keys, encode, rng)
        answer_len = sum(mask)
        prompt = torch.tensor([ids[:-answer_len]], device=args.device)
        plain = dict(max_new_tokens=answer_len, do_sample=False, pad_token_id=0,
                     attention_mask=torch.ones_like(prompt))  # no token is padding
        ref = m.generate(prompt, **plain)[0, prompt.shape[1]:].tolist()
        dense_hits += int(ref == ids[-answer_len:])
        for backend in backends:
            gen = m.generate(prompt, **plain, **{kw: FSQCache(m, backend=backend)})
            gen = gen[0, prompt.shape[1]:].tolist()
            hits[backend] += int(gen == ids[-answer_len:])
            same[backend] += int(gen == ref)
    n = args.generate_items
    out["generate"] = {"length": args.lengths[-1], "items": n, "dtype": "bfloat16",
                       "dynamic_cache_correct": dense_hits / n,
                       **{f"fsqcache_{b}_correct": hits[b] / n for b in backends},
                       **{f"fsqcache_{b}_same_as_dynamic_cache": same[b] / n for b in backends}}
    model.to(torch.float32)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--train", required=True)
    p.add_argument("--val", required=True)
    p.add_argument("--spec", default="fsq-w32-L16")
    p.add_argument("--tau", type=float, default=0.25)
    p.add_argument("--losses", default="ce,kl")
    p.add_argument("--kl-weight", type=float, default=1.0)
    p.add_argument("--lrs", default="1e-3", help="peak learning rates, each run per loss")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--lengths", default="1024,2048,4096,8192")
    p.add_argument("--items", type=int, default=50)
    p.add_argument("--calibration", type=int, default=8,
                   help="calibration tokens in units of 2,048 (sequences of min(2,048, --seq))")
    p.add_argument("--check-tokens", type=int, default=2048)
    p.add_argument("--check-steps", type=int, default=16)
    p.add_argument("--generate-items", type=int, default=10)
    p.add_argument("--save", default=None, help="directory for the trained bottlenecks")
    p.add_argument("--check-only", default=None, metavar="BOTTLENECK",
                   help="skip conversion and training: measure the saved bottleneck (a "
                        "save_bottleneck directory) and run the cache check on it")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    add_out_option(p, "fsq-finetune")
    args = p.parse_args(argv)
    if not args.tau > 0 and args.check_only is None:
        p.error(f"--tau must be > 0 (the conversion alone is the run's first row), got "
                f"{args.tau}")
    args.lengths = [int(v) for v in args.lengths.split(",")]
    torch.manual_seed(0)
    started = time.time()
    base, train, val, train_keys, held_keys, encode = load_setup(args)
    n_params = sum(prm.numel() for prm in base.parameters())
    result = {"machine": machine(), "model": Path(args.model).name, "spec": args.spec,
              "tau": args.tau, "base_parameters": n_params, "args": {
                  k: v for k, v in vars(args).items() if k not in ("model", "train", "val")},
              "rows": []}
    if torch.cuda.is_available():
        result["machine"]["gpu"] = torch.cuda.get_device_name()
    result["machine"]["torch"] = torch.__version__
    import transformers
    result["machine"]["transformers"] = transformers.__version__

    def emit():
        name = out_name(args, "fsq-finetune")
        if args.save:
            Path(args.save).mkdir(parents=True, exist_ok=True)
            (Path(args.save) / "fsq-finetune.json").write_text(json.dumps(result, indent=1))
        return name

    if args.check_only:
        model = load_bottleneck(args.check_only, base).to(args.device)
        row = {"config": Path(args.check_only).name, **measure(model, val, held_keys, encode, args)}
        result["rows"].append(row)
        result["cache_check"] = {"config": row["config"],
                                 **cache_check(model, val, held_keys, encode, args)}
        print(json.dumps(row), json.dumps(result["cache_check"]), flush=True)
        name = emit()
        if not args.save:
            print("wrote", write_json(name, result))
        return 0
    calib = exact_row_and_calibration(base, train, val, held_keys, encode, args, result)
    t0 = time.time()
    converted = convert_to_fsq(base, args.spec, calib)
    row = {"config": f"{args.spec}-tau0", "convert_seconds": round(time.time() - t0, 1),
           **measure(converted, val, held_keys, encode, args)}
    result["rows"].append(row)
    print(json.dumps(row), flush=True)
    emit()
    steps = steps_for_tau(args.tau, n_params, args.batch * args.seq)
    best = None
    runs = [(loss, float(lr)) for lr in args.lrs.split(",") for loss in args.losses.split(",")]
    for loss, lr in runs:
        model = copy.deepcopy(converted)
        batches = training_batches(train, train_keys, encode, batch=args.batch, seq=args.seq)
        t0 = time.time()
        log = finetune_fsq(model, batches, steps=steps, lr=lr, tau=args.tau,
                           teacher=base if loss == "kl" else None,
                           kl_weight=args.kl_weight if loss == "kl" else 0.0,
                           autocast=torch.bfloat16 if args.device == "cuda" else None)
        row = {"config": f"{args.spec}-tau{args.tau:g}-{loss}-lr{lr:g}", "steps": steps,
               "tokens": steps * args.batch * args.seq,
               "train_seconds": round(time.time() - t0, 1), "log": log,
               **measure(model, val, held_keys, encode, args)}
        if args.save:
            file = save_bottleneck(model, Path(args.save) / row["config"])
            row["bottleneck_bytes"] = file.stat().st_size
        result["rows"].append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "log"}), flush=True)
        emit()
        if best is None or row["niah1"][args.lengths[-1]] + 1e-9 * -row["ppl"] > \
                best[0]["niah1"][args.lengths[-1]] + 1e-9 * -best[0]["ppl"]:
            best = (row, model)
    if best is not None:
        result["cache_check"] = {"config": best[0]["config"],
                                 **cache_check(best[1], val, held_keys, encode, args)}
        print(json.dumps(result["cache_check"]), flush=True)
    result["seconds"] = round(time.time() - started, 1)
    cols = [("config", "config"), ("ppl", "book ppl")] + [
        (f"n{L}", f"niah@{L}") for L in args.lengths]
    table = [{"config": r["config"], "ppl": r["ppl"],
              **{f"n{L}": r["niah1"][L] for L in args.lengths}} for r in result["rows"]]
    print(markdown_table(table, cols))
    name = emit()
    if not args.save:
        print("wrote", write_json(name, result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
