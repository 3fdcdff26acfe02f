"""Train the FSQ evaluation grid: one bottleneck per (width, levels, tau), measured as trained.

Every point is converted from the same calibration sequences and finetuned with the same recipe
(next-token + answer cross-entropy plus KL to the original model, peak learning rate ``--lr``,
``steps = tau x base parameters / tokens per step``; tau = 0 is the conversion alone). Each is
measured at once on held-out book perplexity and the provisional teacher-forced one-needle
accuracy, and saved (``save_bottleneck``) under ``--save/NAME`` for the retrieval benchmark
(``python -m model_adapters.retrieval --bottleneck NAME=DIR``) and the perplexity harness
(``python -m model_adapters.eval --bottleneck NAME=DIR``).

    python bench/fsq_grid.py --model standin-qwen3-8k --train books-gpt2-train.u16.xz \\
        --val books-gpt2-val.u16.xz --save OUTDIR \\
        --point fsq-w64-L16-tau0.25 --point fsq-w32-L16-tau0.25 ...

Points run in the order given; ``--max-seconds`` starts no point after that long (the JSON says
which were skipped).

For a model with a short context or one never trained on the retrieval task (``standin-qwen3``,
``standin-gpt2``: 1,024-token training sequences), train on book text alone and skip the needle
measurement:

    python bench/fsq_grid.py --model standin-gpt2 --train ... --val ... --save OUTDIR \\
        --seq 1024 --batch 32 --task-fraction 0 --items 0 --point fsq-w128-L16-tau0.5 ...
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from _common import machine, markdown_table  # noqa: E402
from fsq_finetune import exact_row_and_calibration, load_setup, measure  # noqa: E402

import model_adapters  # noqa: E402,F401  (registers the converted models)
from model_adapters.experiments.needles import (  # noqa: E402
    training_batches,
)
from model_adapters.quant.fsq import FsqConfig  # noqa: E402
from model_adapters.quant.fsq_convert import convert_to_fsq, save_bottleneck  # noqa: E402
from model_adapters.quant.fsq_train import finetune_fsq, steps_for_tau  # noqa: E402


def check_sizes(args) -> None:
    """SystemExit naming the value when ``--seq``, a needle length, ``--items``, ``--batch`` or
    ``--task-fraction`` is out of range for the run or the model's positions (read from its
    config, before any weights load)."""
    from transformers import AutoConfig

    from model_adapters.models import max_positions

    if not 0.0 <= args.task_fraction <= 1.0:
        raise SystemExit(f"--task-fraction {args.task_fraction} is not in [0, 1]")
    for name in ("items", "batch", "seq"):
        if getattr(args, name) < (0 if name == "items" else 1):
            raise SystemExit(f"--{name} {getattr(args, name)} is out of range")
    limit = max_positions(AutoConfig.from_pretrained(args.model))
    for name, value in [("--seq", args.seq)] + [("--lengths", n) for n in args.lengths]:
        if value > limit:
            raise SystemExit(f"{name} {value} exceeds the model's {limit} positions "
                             f"({args.model})")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--train", required=True)
    p.add_argument("--val", required=True)
    p.add_argument("--point", action="append", required=True,
                   help="fsq-wW-LL-tauT (repeat); tau 0 = conversion only")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--kl-weight", type=float, default=1.0)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--task-fraction", type=float, default=0.8,
                   help="share of training rows that are retrieval items (0: book text only)")
    p.add_argument("--lengths", default="1024,2048,4096,8192")
    p.add_argument("--items", type=int, default=50,
                   help="needle items per length (0: no needle measurement)")
    p.add_argument("--calibration", type=int, default=8, help="sequences of 2,048 tokens")
    p.add_argument("--max-seconds", type=float, default=None)
    p.add_argument("--save", required=True, help="directory for the bottlenecks and the JSON")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    args.lengths = [int(v) for v in args.lengths.split(",")] if args.items else []
    check_sizes(args)
    points = []
    for name in args.point:
        cfg = FsqConfig.parse(name)  # ValueError names a malformed point before any work
        if cfg.tau is None:
            raise SystemExit(f"--point {name!r} needs its tau (fsq-wW-LL-tauT)")
        points.append((name, cfg))
    started = time.time()
    torch.manual_seed(0)
    save = Path(args.save)
    save.mkdir(parents=True, exist_ok=True)
    base, train, val, train_keys, held_keys, encode = load_setup(args)
    n_params = sum(prm.numel() for prm in base.parameters())
    import transformers
    result = {"machine": {**machine(), "torch": torch.__version__,
                          "transformers": transformers.__version__,
                          "gpu": torch.cuda.get_device_name() if torch.cuda.is_available()
                          else None},
              "model": Path(args.model).name, "base_parameters": n_params, "loss": "ce+answer+kl",
              "args": {k: v for k, v in vars(args).items()
                       if k not in ("model", "train", "val", "save")},
              "rows": [], "skipped": []}

    def emit():
        (save / "fsq-grid.json").write_text(json.dumps(result, indent=1))

    calib = exact_row_and_calibration(base, train, val, held_keys, encode, args, result)
    for name, cfg in points:
        if args.max_seconds is not None and time.time() - started > args.max_seconds:
            result["skipped"].append(name)
            continue
        t0 = time.time()
        model = convert_to_fsq(base, FsqConfig(cfg.width, cfg.levels), calib)
        convert_s = time.time() - t0
        steps = steps_for_tau(cfg.tau, n_params, args.batch * args.seq)
        log: list = []
        t0 = time.time()
        if steps:
            batches = training_batches(train, train_keys, encode, batch=args.batch,
                                       seq=args.seq, task_fraction=args.task_fraction)
            log = finetune_fsq(model, batches, steps=steps, lr=args.lr, tau=cfg.tau,
                               teacher=base, kl_weight=args.kl_weight,
                               autocast=torch.bfloat16 if args.device == "cuda" else None)
        row = {"config": name, "width": cfg.width, "levels": cfg.levels[0], "tau": cfg.tau,
               "packed_bytes": cfg.packed_bytes, "steps": steps,
               "tokens": steps * args.batch * args.seq, "convert_seconds": round(convert_s, 1),
               "train_seconds": round(time.time() - t0, 1), "log": log,
               **measure(model, val, held_keys, encode, args)}
        row["bottleneck_bytes"] = save_bottleneck(model, save / name).stat().st_size
        result["rows"].append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "log"}), flush=True)
        emit()
        del model
        if args.device == "cuda":
            torch.cuda.empty_cache()
    result["seconds"] = round(time.time() - started, 1)
    emit()
    cols = [("config", "config"), ("packed_bytes", "B/token/layer"), ("steps", "steps"),
            ("ppl", "book ppl")] + [(f"n{n}", f"niah@{n}") for n in args.lengths]
    table = [{**{k: r.get(k, "") for k in ("config", "packed_bytes", "steps", "ppl")},
              **{f"n{n}": r["niah1"][n] for n in args.lengths}} for r in result["rows"]]
    print(markdown_table(table, cols))
    if result["skipped"]:
        print("skipped (time):", ", ".join(result["skipped"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
