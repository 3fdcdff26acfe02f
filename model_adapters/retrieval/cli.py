"""Long-context retrieval through compressed KV caches, peer methods side by side.

    python -m model_adapters.retrieval --model DIR --books DIR --lengths 1024 2048 4096 8192
        --items 100 --config exact --config perhead-k256-s2 --config snapkv-0.9 ... --json OUT

Items come from the held-out books (``DIR/books-gpt2-val.u16.xz``) with held-out keys; RVQ
codebooks are fitted on the training books (``DIR/books-gpt2-train.u16.xz``, four runs of the
longest length). First the model card's teacher-forced figures are reproduced (``--repro-items``
single-needle items per length, ``random.Random(123)``); then every method answers every item by
greedy decoding: haystack prefilled alone through the method's cache, question as one forward,
answer decoded; exact match of the number. Bad input fails before any work with exit status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from model_adapters._checks import require_models_extra

__all__ = ["build_parser", "main", "run"]

DEFAULT_CONFIGS = (
    "exact", "perhead-k256-s2", "perhead-k256-s1", "pooled-k256-s1",
    "quanto-4", "quanto-2", "hqq-4", "hqq-2",
    "streamingllm-0.75", "streamingllm-0.95", "snapkv-0.75", "snapkv-0.95",
    "knorm-0.75", "knorm-0.95", "pyramidkv-0.75", "pyramidkv-0.95",
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m model_adapters.retrieval", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="checkpoint directory with its tokenizer")
    p.add_argument("--books", required=True,
                   help="directory with books-gpt2-val.u16.xz (items) and, for RVQ configs, "
                   "books-gpt2-train.u16.xz (codebooks)")
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    p.add_argument("--items", type=int, default=100, help="items per task and length")
    p.add_argument("--tasks", nargs="+", default=None,
                   help="single multikey multivalue depth (default: all)")
    p.add_argument("--config", action="append", default=None,
                   help="a method (repeat); default: " + " ".join(DEFAULT_CONFIGS))
    p.add_argument("--repro-items", type=int, default=50,
                   help="teacher-forced reproduction items per length (0: skip)")
    p.add_argument("--sinks", type=int, default=4, help="RVQ: leading positions kept exact")
    p.add_argument("--recent", type=int, default=32, help="RVQ: recent positions kept exact")
    p.add_argument("--bottleneck", action="append", default=[], metavar="NAME=DIR",
                   help="FSQ: the trained bottleneck (bench/fsq_finetune.py --save) of config NAME")
    p.add_argument("--codebook-dir", default=None,
                   help="fitted codebooks are cached here and reused (default: a temporary one)")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available)")
    p.add_argument("--workers", type=int, default=1,
                   help="score in this many processes (item indices split between them)")
    p.add_argument("--max-seconds", type=float, default=None,
                   help="start no new item index after this long (fewer items, all methods)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads per process")
    p.add_argument("--seed", type=int, default=0, help="item generator seed")
    p.add_argument("--json", default=None, help="write results here")
    p.add_argument("--plot", default=None, help="write the figure here (default: beside --json)")
    p.add_argument("--shard", default=None, help=argparse.SUPPRESS)
    p.add_argument("--part", default=None, help=argparse.SUPPRESS)
    return p


def _validate(args):
    from model_adapters.experiments.fsq_eval import parse_bottlenecks
    from model_adapters.retrieval.methods import method_family
    from model_adapters.retrieval.tasks import TASKS

    args.config = args.config or list(DEFAULT_CONFIGS)
    args.tasks = args.tasks or list(TASKS)
    for t in args.tasks:
        if t not in TASKS:
            raise ValueError(f"--tasks {t!r} is not one of {', '.join(TASKS)}")
    for name in args.config:
        method_family(name)
    if len(set(args.config)) != len(args.config):
        raise ValueError(f"--config repeats a method: {args.config}")
    for name in ("items", "workers", "threads"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} {getattr(args, name)} must be at least 1")
    if args.repro_items < 0:
        raise ValueError(f"--repro-items {args.repro_items} must be at least 0")
    if args.max_seconds is not None and not args.max_seconds > 0:
        raise ValueError(f"--max-seconds {args.max_seconds} must be > 0")
    for n in args.lengths:
        if n < 128:
            raise ValueError(f"--lengths {n} is too short for an item (at least 128)")
    if not Path(args.model).is_dir():
        raise ValueError(f"--model {args.model!r} is not a directory")
    rvq = any(method_family(name) == "rvq" for name in args.config)
    for split in ("train", "val") if rvq else ("val",):  # training books fit RVQ codebooks
        f = Path(args.books) / f"books-gpt2-{split}.u16.xz"
        if not f.is_file():
            raise ValueError(f"--books {args.books!r} lacks {f.name}")
    args.bottlenecks = parse_bottlenecks(args.bottleneck)


def _codebook_source(model, train, args, longest):
    """``QuantConfig -> KVQuantizer`` on the model's device, fitted once per family for every
    RVQ config of the run (with the evaluation harness's k-means settings)."""
    from model_adapters.experiments.eval import train_codebook_sets
    from model_adapters.quant.configs import expand_configs, parse_config
    from model_adapters.retrieval.methods import method_family
    from model_adapters.retrieval.tasks import training_segments

    rvq = [c for c in args.config if method_family(c) == "rvq"]
    if not rvq:
        return None, {}
    segments = training_segments(train, length=longest)
    sets, collect_s, train_s = train_codebook_sets(
        expand_configs(rvq), model, segments, codebook_dir=args.codebook_dir, kmeans_iters=10,
        seed=0, kmeans_points=32768, context=longest, progress=False,
    )
    device = next(model.parameters()).device

    def codebooks(cfg):
        q = sets[(cfg.pooled, cfg.codebook_size)]
        return q.prefix(cfg.key_stages, cfg.value_stages).to(device)

    info = {"codebook_train_tokens": sum(map(len, segments)), "collect_seconds": collect_s,
            "train_seconds": train_s, "kmeans_iters": 10, "kmeans_points": 32768}
    assert all(parse_config(c) for c in rvq)
    return codebooks, info


def _worker_argv(args) -> list[str]:
    argv = ["--model", args.model, "--books", args.books, "--lengths", *map(str, args.lengths),
            "--items", str(args.items), "--tasks", *args.tasks, "--repro-items", "0",
            "--sinks", str(args.sinks), "--recent", str(args.recent), "--codebook-dir",
            args.codebook_dir, "--threads", str(args.threads), "--seed", str(args.seed)]
    for c in args.config:
        argv += ["--config", c]
    if args.device:
        argv += ["--device", args.device]
    if args.max_seconds is not None:
        argv += ["--max-seconds", str(args.max_seconds)]
    return argv


def run(args, log=print) -> dict:
    """The run described by parsed ``args``: the result dict (or, for a worker, its part)."""
    _validate(args)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from model_adapters.experiments.needles import load_token_array, retrieval_keys
    from model_adapters.models import config_fingerprint, kv_shape, max_positions
    from model_adapters.retrieval import runner
    from model_adapters.retrieval.methods import MethodContext, resolve_method

    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).to(device).eval()
    shape = kv_shape(model)
    if max(args.lengths) > max_positions(model.config):
        raise ValueError(f"--lengths {max(args.lengths)} exceeds the model's "
                         f"{max_positions(model.config)} positions")
    val = load_token_array(Path(args.books) / "books-gpt2-val.u16.xz")
    train_file = Path(args.books) / "books-gpt2-train.u16.xz"
    train = load_token_array(train_file) if train_file.is_file() else None
    _, words = retrieval_keys(tokenizer)
    tmp = None
    if args.codebook_dir is None:
        tmp = args.codebook_dir = tempfile.mkdtemp(prefix="fkv-codebooks-")
    workdir = tempfile.mkdtemp(prefix="fkv-retrieval-archives-")
    with torch.no_grad():
        codebooks, cb_info = _codebook_source(model, train, args, max(args.lengths))
    ctx = MethodContext(model, shape, codebooks, sinks=args.sinks, recent=args.recent,
                        workdir=workdir, bottlenecks=args.bottlenecks)
    methods = [resolve_method(name, ctx) for name in args.config]
    if args.shard is not None:
        k, n = (int(x) for x in args.shard.split("/"))
        part = runner.run_items(model, tokenizer, methods, val, words, args.lengths, args.tasks,
                                args.items, shard=(k, n), max_seconds=args.max_seconds,
                                seed=args.seed, log=log)
        Path(args.part).write_text(json.dumps(part))
        return part
    if args.workers > 1:
        spawned = None
        import threading

        def work():
            nonlocal spawned
            try:
                spawned = runner.spawn_workers(_worker_argv(args), args.workers, log)
            except RuntimeError as exc:
                spawned = exc

        th = threading.Thread(target=work)
        th.start()
    repro = runner.reproduce(model, tokenizer, val, words, args.lengths, args.repro_items,
                             log) if args.repro_items else {}
    if args.workers > 1:
        th.join()
        if isinstance(spawned, Exception):
            raise spawned
        raw = runner.merge_parts(spawned)
    else:
        raw = runner.run_items(model, tokenizer, methods, val, words, args.lengths, args.tasks,
                               args.items, max_seconds=args.max_seconds, seed=args.seed, log=log)
    rows = runner.summarise(raw, methods, shape, args.lengths, args.tasks)
    import transformers

    return {
        "model": Path(args.model).name, "config_fingerprint": config_fingerprint(model),
        "kv_shape": {"num_layers": shape.num_layers, "kv_heads": shape.kv_heads,
                     "head_dim": shape.head_dim},
        "fp16_bytes_per_token_layer": shape.fp16_bytes_per_token / shape.num_layers,
        "lengths": args.lengths, "tasks": args.tasks, "items_requested": args.items,
        "seed": args.seed, "sinks": args.sinks, "recent": args.recent, "device": str(device),
        "dtype": "float32", "transformers": transformers.__version__,
        "torch": torch.__version__, "workers": args.workers, "codebooks": cb_info,
        "seconds": time.perf_counter() - t0, "reproduction": repro, "methods": rows,
        "_tmp": tmp,
    }


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        require_models_extra("the retrieval benchmark")
    except ImportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        result = run(args, log=lambda s: print(s, file=sys.stderr, flush=True))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.shard is not None:
        return 0
    result.pop("_tmp", None)
    from model_adapters.retrieval.report import format_tables, plot

    print(format_tables(result))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    target = args.plot or (str(Path(args.json).with_suffix(".png")) if args.json else None)
    if target:
        plot([result], target)
    return 0
