"""Measure what archiving a model's KV cache as residual-VQ codes costs in perplexity and bytes.

    python -m model_adapters.eval --model DIR [--text FILE] [--tokens 1024] --config NAME ...
        [--json OUT.json] [--plot OUT.png]

Protocol (defaults): the book's Project Gutenberg header/footer is stripped and curly quotes made
straight (``--keep-quotes`` keeps them); the evaluation passage is the first ``--tokens`` tokens
from the start of chapter I; codebooks train on up to ``--train-tokens`` tokens of the rest of the
book (never overlapping the passage); perplexity is computed token by token through the cache,
which keeps ``--sinks`` 4 + ``--recent`` 32 positions exact and replaces every older position by
its reconstruction, appending its codes to an fkvstore archive. Storage is measured from what
was written.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from model_adapters._checks import INSTALL_HINT, missing_models_extra, require_models_extra
from model_adapters.experiments.fsq_eval import (
    calibration_ids,
    convert_or_load,
    evaluate_fsq,
    is_fsq,
    parse_bottlenecks,
    summarise_fsq,
)
from model_adapters.quant.configs import ALL_CONFIGS, QuantConfig, expand_configs

__all__ = ["build_parser", "main", "run", "train_codebook_sets"]

_DEFAULT_TEXT = "the_time_machine.txt (bundled with fkvstore)"


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Keeps the description's layout; adds a default only where the help names none."""

    def _get_help_string(self, action):
        text = action.help or ""
        if ("default" in text or action.default is None or action.default is False
                or action.default == argparse.SUPPRESS):
            return text
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    missing = missing_models_extra()
    needs = (f"\n\nThis environment lacks the 'models' extra ({', '.join(missing)} missing): "
             f"{INSTALL_HINT}." if missing else "")
    p = argparse.ArgumentParser(
        prog="python -m model_adapters.eval",
        description=__doc__,
        epilog="Configs: exact | {pooled|perhead}-k{K}-s{S}[-keysonly|-valuesonly] | "
        "{pooled|perhead}-k{K}-K{a}V{b} | hybrid-k256-K4V2 (= perhead-k256-K4V2) | all "
        f"({', '.join(ALL_CONFIGS)}) | fsq-w{{W}}-L{{L}}[-tau{{T}}][@bf16|@e4m3|@e4m3-head] "
        "(an FSQ-converted model, see --bottleneck; @: its key decoder as a kernel of that "
        f"precision computes it).{needs}",
        formatter_class=_HelpFormatter,
    )
    p.add_argument("--model", required=True, help="local checkpoint directory with its tokenizer")
    p.add_argument(
        "--text", default=None, help=f"plain-text book to evaluate on (default: {_DEFAULT_TEXT})"
    )
    p.add_argument("--tokens", type=int, default=1024, help="evaluation passage length in tokens")
    p.add_argument(
        "--train-tokens",
        type=int,
        default=32768,
        help="at most this many tokens (disjoint from the passage) train the codebooks",
    )
    p.add_argument(
        "--config",
        action="append",
        default=None,
        help="quantizer configuration; repeat for several; 'all' = the paper's rows (default: all)",
    )
    p.add_argument("--bottleneck", action="append", default=[], metavar="NAME=DIR",
                   help="FSQ config NAME uses the trained bottleneck saved in DIR (repeat); "
                   "without one an fsq config is converted from the training text, unfinetuned")
    p.add_argument("--sinks", type=int, default=4, help="leading positions kept exact")
    p.add_argument("--recent", type=int, default=32, help="most recent positions kept exact")
    p.add_argument(
        "--keep-quotes", action="store_true", help="keep curly quotes (default: made straight)"
    )
    p.add_argument(
        "--kmeans-iters",
        type=int,
        default=10,
        help="at most this many Lloyd iterations per stage (stops early on convergence)",
    )
    p.add_argument(
        "--kmeans-points",
        type=int,
        default=32768,
        help="train each codebook on at most this many vectors (seeded subset), so "
        "pooled and per-head codebooks see equally many; 0 = all",
    )
    p.add_argument("--seed", type=int, default=0, help="k-means seed")
    p.add_argument(
        "--context",
        type=int,
        default=1024,
        help="tokens per forward pass when collecting training K/V",
    )
    p.add_argument("--device", default=None, help="torch device (default: cuda if available)")
    p.add_argument(
        "--dtype", default="float32", choices=["float32", "float16", "bfloat16"], help="model dtype"
    )
    p.add_argument("--json", default=None, help="write results here")
    p.add_argument(
        "--plot",
        default=None,
        help="write the rate-distortion figure here (default: beside --json, .png)",
    )
    p.add_argument(
        "--archive-dir",
        default=None,
        help="keep one archive per config here (default: a temporary directory)",
    )
    p.add_argument(
        "--codebook-dir",
        default=None,
        help="reuse codebooks trained earlier with the same model, text split and k-means "
        "settings from this directory (trained ones are saved there)",
    )
    p.add_argument(
        "--codebooks-from",
        default=None,
        help="use the codebooks stored in this archive (written by an earlier run for the same "
        "model configuration) instead of training",
    )
    p.add_argument("--threads", type=int, default=default_threads(),
                   help="torch CPU threads (0: torch's own default, every core; the default "
                   "leaves half the cores to the rest of the machine: with every core, one run "
                   "on a busy 2-core machine took 8x longer)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


def _validate(args) -> list[QuantConfig]:
    names = args.config or ["all"]
    args.fsq_configs = [n for n in names if is_fsq(n)]
    args.bottlenecks = parse_bottlenecks(args.bottleneck)
    rvq = [n for n in names if not is_fsq(n)]
    configs = expand_configs(rvq) if rvq else []
    for name in (
        "tokens",
        "sinks",
        "recent",
        "train_tokens",
        "kmeans_iters",
        "kmeans_points",
        "context",
        "threads",
    ):
        v = getattr(args, name)
        low = 2 if name in ("tokens", "context") else 0
        if v < low:
            raise ValueError(f"--{name.replace('_', '-')} {v} is out of range (at least {low})")
    if args.sinks + args.recent >= args.tokens - 1:
        raise ValueError(
            f"window too large for the passage: --sinks {args.sinks} + --recent {args.recent} "
            f"covers all {args.tokens - 1} cached positions of a --tokens {args.tokens} passage, "
            "so nothing would be archived; lower the window or raise --tokens"
        )
    biggest = _largest_codebook(configs)
    if biggest and args.train_tokens < biggest:
        raise ValueError(
            f"--train-tokens {args.train_tokens} is below the largest codebook size {biggest}; "
            "k-means needs at least one training vector per centroid"
        )
    if args.codebooks_from is not None and not Path(args.codebooks_from).is_file():
        raise ValueError(f"--codebooks-from {args.codebooks_from!r} is not a file")
    if not Path(args.model).is_dir():
        raise ValueError(f"--model {args.model!r} is not a directory")
    if args.text is not None and not Path(args.text).is_file():
        raise ValueError(f"--text {args.text!r} is not a file")
    return configs


def _largest_codebook(configs) -> int:
    """The largest codebook any quantized config trains (0: all exact)."""
    return max((c.codebook_size for c in configs if not c.is_exact), default=0)


def _check_training_span(split, configs, text_name: str) -> None:
    """k-means needs at least one training vector per centroid: refuse a text whose training
    span (after the passage, then before chapter I) is shorter than the largest codebook."""
    biggest, have = _largest_codebook(configs), split.train_tokens
    if have < biggest:
        raise ValueError(
            f"{text_name} leaves {have} training tokens beside the passage, below the largest "
            f"codebook size {biggest}; use a longer --text, fewer --tokens, or --codebooks-from"
        )


def _read_text(path) -> tuple[str, str]:
    if path is None:
        # find_spec locates the package without importing it (and its codec)
        spec = importlib.util.find_spec("fkvstore")
        if spec is None or not spec.submodule_search_locations:
            raise ValueError(
                "fkvstore is not installed, so its bundled book is missing; pass --text"
            )
        book = Path(list(spec.submodule_search_locations)[0]) / "data" / "the_time_machine.txt"
        return book.read_text(encoding="utf-8"), book.name
    return Path(path).read_text(encoding="utf-8"), Path(path).name


def _train_sets(configs, model, split, args, context, progress):
    """The run's codebooks (:func:`train_codebook_sets` on the split's training segments)."""
    return train_codebook_sets(
        configs,
        model,
        split.train_segments,
        codebook_dir=args.codebook_dir,
        kmeans_iters=args.kmeans_iters,
        seed=args.seed,
        kmeans_points=args.kmeans_points,
        context=context,
        progress=progress,
    )


def train_codebook_sets(
    configs, model, segments, *, codebook_dir, kmeans_iters, seed, kmeans_points, context,
    progress,
):
    """Codebooks per (pooled, codebook_size), deep enough for every config that uses them.

    ``segments``: runs of token ids (lists of int) the K/V are collected over, ``context``
    tokens per forward. With ``codebook_dir`` each family is cached there as an ``.npz`` keyed
    by the model's config fingerprint, the segments and the k-means settings, and reused.
    Returns ``({(pooled, k): KVQuantizer on the CPU}, collect_seconds, train_seconds)`` (the
    seconds are None when everything came from ``codebook_dir``, 0.0 when nothing is quantized).
    """
    import numpy as np
    import torch
    from tqdm.auto import tqdm

    from model_adapters.models import config_fingerprint, kv_shape
    from model_adapters.quant.collect import collect_kv
    from model_adapters.quant.configs import QuantConfig
    from model_adapters.quant.quantizer import KVQuantizer, train_kv_quantizer

    need: dict[tuple[bool, int], list[int]] = {}
    for c in configs:
        if not c.is_exact:
            ks, vs = need.get((c.pooled, c.codebook_size), [0, 0])
            need[(c.pooled, c.codebook_size)] = [max(ks, c.key_stages), max(vs, c.value_stages)]
    if not need:
        return {}, 0.0, 0.0
    shape = kv_shape(model)
    sets, paths = {}, {}
    if codebook_dir:
        key = hashlib.sha256(
            json.dumps(
                [
                    config_fingerprint(model),
                    segments,
                    kmeans_iters,
                    seed,
                    kmeans_points,
                    context,
                ]
            ).encode()
        ).hexdigest()[:16]
        for (pooled, k), (ks, vs) in need.items():
            kind = "pooled" if pooled else "perhead"
            path = Path(codebook_dir) / f"{kind}-k{k}-K{ks}V{vs}-{key}.npz"
            paths[(pooled, k)] = path
            # the family fitted with at least as many stages serves too (stages are a prefix)
            found = [path] if path.is_file() else [
                p for p in sorted(Path(codebook_dir).glob(f"{kind}-k{k}-K*V*-{key}.npz"))
                if _stages_cover(p.name, ks, vs)]
            if found:
                with np.load(found[0]) as f:
                    sets[(pooled, k)] = KVQuantizer.from_arrays(shape, dict(f), pooled=pooled)
    missing = {pk: st for pk, st in need.items() if pk not in sets}
    if not missing:
        return sets, None, None
    t0 = time.perf_counter()
    keys, values = collect_kv(model, segments, context=context, progress=progress)
    collect_s = time.perf_counter() - t0
    device = next(model.parameters()).device
    keys = [k.to(device) for k in keys]
    values = [v.to(device) for v in values]
    t0 = time.perf_counter()
    total = sum(
        shape.num_layers * (ks > 0) + shape.num_layers * (vs > 0) for ks, vs in missing.values()
    )
    with tqdm(total=total, desc="train codebooks", unit="layer", disable=not progress) as bar:
        for (pooled, k), (ks, vs) in missing.items():
            cfg = QuantConfig(
                "train", pooled=pooled, codebook_size=k, key_stages=ks, value_stages=vs
            )
            sets[(pooled, k)] = train_kv_quantizer(
                keys,
                values,
                shape,
                cfg,
                iters=kmeans_iters,
                seed=seed,
                max_points=kmeans_points or None,
                progress=lambda _i: bar.update(1),
            ).to("cpu")
            if (pooled, k) in paths:
                paths[(pooled, k)].parent.mkdir(parents=True, exist_ok=True)
                np.savez(paths[(pooled, k)], **sets[(pooled, k)].to_arrays())
    del keys, values
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return sets, collect_s, time.perf_counter() - t0


def _stages_cover(name: str, ks: int, vs: int) -> bool:
    """Whether a cached family file ``{kind}-k{K}-K{a}V{b}-{key}.npz`` has a >= ks, b >= vs."""
    import re

    m = re.search(r"-K(\d+)V(\d+)-[0-9a-f]+\.npz$", name)
    return m is not None and int(m.group(1)) >= ks and int(m.group(2)) >= vs


def _codebooks_from_archive(path, config, configs):
    """Codebooks of an archive written earlier, checked against the model and every config."""
    if path is None:
        return None
    from model_adapters.store import archive_io

    fkv = archive_io.require_fkvstore()
    with fkv.open(path, "r") as ar:
        q = archive_io.read_quantizer(ar, config)
    for c in configs:
        if c.is_exact:
            continue
        if (c.pooled, c.codebook_size) != (q.pooled, q.codebook_size) or (
            c.key_stages > q.key_stages or c.value_stages > q.value_stages
        ):
            kind = "pooled" if q.pooled else "perhead"
            raise ValueError(
                f"config {c.name!r} cannot use the codebooks of {path!r} ({kind}, "
                f"k={q.codebook_size}, K{q.key_stages}V{q.value_stages})"
            )
    return {(q.pooled, q.codebook_size): q}


def _evaluate_config(cfg, quantizer, model, split, args, archive_dir, progress):
    """One config: token-by-token NLLs and the storage written."""
    from model_adapters.caches.archiving import ArchivingCache
    from model_adapters.caches.code_rows import CodeRows
    from model_adapters.experiments.perplexity import token_nlls
    from model_adapters.store import archive_io

    ar = stream = path = None
    rows = None
    if quantizer is not None:
        path = Path(archive_dir) / f"{cfg.name}.fkv"
        ar, stream = archive_io.open_for_writing(
            path, model, quantizer, sinks=args.sinks, recent=args.recent
        )
        rows = CodeRows(quantizer.shape.num_layers, stream.extend)
    cache = ArchivingCache(
        model,
        quantizer.to(next(model.parameters()).device) if quantizer is not None else None,
        sinks=args.sinks,
        recent=args.recent,
        rows=rows,
        track_error=True,
    )
    t0 = time.perf_counter()
    nlls = token_nlls(model, split.passage, cache, progress=progress, desc=cfg.name)
    seconds = time.perf_counter() - t0
    storage = {
        "nmse": cache.reconstruction_nmse() if quantizer is not None else None,
        "archived_tokens": cache.archived_tokens if quantizer is not None else 0,
        "archive": None,
        "code_stream_bytes": None,
        "window_bytes": None,
        "codebook_bytes": 0,
    }
    if quantizer is not None:
        storage["codebook_bytes"] = int(sum(a.nbytes for a in quantizer.to_arrays().values()))
        bits = math.ceil(math.log2(quantizer.codebook_size))
        storage["packed_code_bytes_per_token"] = quantizer.row_width * bits / 8
        storage["window_bytes"] = archive_io.write_window(ar, cache)
        ar.flush()
        storage["code_stream_bytes"] = archive_io.stream_data_bytes(stream)
        ar.close()
        storage["archive"] = path.name
        storage["archive_file_bytes"] = path.stat().st_size
    return nlls, seconds, storage


def _summarise(cfg, nlls, base, storage, shape, tokens, seconds):
    from model_adapters.experiments.perplexity import perplexity

    half = tokens // 2 - 1  # nlls[t] scores token t+1; the second half is tokens >= tokens // 2
    ppl, ppl2 = perplexity(nlls), perplexity(nlls[half:])
    fp16 = shape.fp16_bytes_per_token
    row = {
        "config": cfg.name,
        "canonical": cfg.canonical,
        "pooled": cfg.pooled,
        "codebook_size": cfg.codebook_size,
        "key_stages": cfg.key_stages,
        "value_stages": cfg.value_stages,
        "ppl": ppl,
        "ppl_second_half": ppl2,
        "delta_ppl_pct": 100.0 * (ppl / base[0] - 1.0),
        "delta_ppl_pct_second_half": 100.0 * (ppl2 / base[1] - 1.0),
        "eval_seconds": seconds,
    }
    if cfg.is_exact:
        row.update(
            archived_tokens=0,
            code_bytes_per_token=0.0,
            window_bytes=tokens * fp16,
            codebook_bytes=0,
            bytes_per_token=float(fp16),
            compression_vs_fp16=None,
            compression_vs_fp16_total=1.0,
        )
        return row
    archived = storage["archived_tokens"]
    code = storage["code_stream_bytes"]
    code_pt = code / archived if code is not None and archived else None
    total = None if code is None else code + storage["window_bytes"] + storage["codebook_bytes"]
    row.update(
        archived_tokens=archived,
        key_nmse=storage["nmse"]["keys"],
        value_nmse=storage["nmse"]["values"],
        code_bytes_per_token=code_pt,
        packed_code_bytes_per_token=storage["packed_code_bytes_per_token"],
        window_bytes=storage["window_bytes"],
        codebook_bytes=storage["codebook_bytes"],
        bytes_per_token=None if total is None else total / tokens,
        compression_vs_fp16=None if not code_pt else fp16 / code_pt,
        compression_vs_fp16_total=None if total is None else fp16 / (total / tokens),
        archive=storage["archive"],
    )
    if "archive_file_bytes" in storage:
        row["archive_file_bytes"] = storage["archive_file_bytes"]
    return row


def _fmt(v, spec):
    return "–" if v is None else format(v, spec)


def format_table(result: dict) -> str:
    """Markdown table of one run."""
    lines = [
        "| config | PPL | ΔPPL | ΔPPL 2nd half | code B/token | bit-packed B/token | vs fp16 | "
        "all B/token | vs fp16 (all) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["configs"]:
        lines.append(
            f"| {r['config']} | {r['ppl']:.2f} | {r['delta_ppl_pct']:+.1f}% | "
            f"{r['delta_ppl_pct_second_half']:+.1f}% | {_fmt(r['code_bytes_per_token'], '.1f')} | "
            f"{_fmt(r.get('packed_code_bytes_per_token'), '.0f')} | "
            f"{_fmt(r['compression_vs_fp16'], '.1f')}{'×' if r['compression_vs_fp16'] else ''} | "
            f"{_fmt(r['bytes_per_token'], '.0f')} | "
            f"{_fmt(r['compression_vs_fp16_total'], '.2f')}"
            f"{'×' if r['compression_vs_fp16_total'] else ''} |"
        )
    return "\n".join(lines)


def run(args) -> dict:
    """Run the evaluation described by parsed ``args``; returns the result dict."""
    configs = _validate(args)
    raw, text_name = _read_text(args.text)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from model_adapters.experiments.text import clean_text, split_tokens
    from model_adapters.models import config_fingerprint, kv_shape, max_positions

    progress = not args.no_progress
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    config = AutoConfig.from_pretrained(args.model)
    shape = kv_shape(config)  # refuses unsupported architectures before loading weights
    if args.tokens > max_positions(config):
        raise ValueError(
            f"--tokens {args.tokens} exceeds the model's {max_positions(config)} positions"
        )
    context = min(args.context, max_positions(config))
    preset = _codebooks_from_archive(args.codebooks_from, config, configs)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    if len(tokenizer) < 2:  # a folder without tokenizer files loads an empty vocabulary
        raise ValueError(f"--model {args.model!r} has no usable tokenizer "
                         f"({len(tokenizer)} tokens in its vocabulary)")
    # the text's checks before the weights load
    split = split_tokens(
        clean_text(raw, keep_quotes=args.keep_quotes), tokenizer, args.tokens, args.train_tokens
    )
    if preset is None:
        _check_training_span(split, configs, text_name)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype))
    model.to(device).eval()
    if preset is not None:
        sets, collect_s, train_s = preset, None, None
    else:
        sets, collect_s, train_s = _train_sets(configs, model, split, args, context, progress)

    tmp = None
    archive_dir = args.archive_dir
    if archive_dir is None:
        tmp = archive_dir = tempfile.mkdtemp(prefix="fkv-eval-")
    else:
        Path(archive_dir).mkdir(parents=True, exist_ok=True)
    try:
        order = [c for c in configs if c.is_exact] or [expand_configs(["exact"])[0]]
        order += [c for c in configs if not c.is_exact]
        rows, base = [], None
        for cfg in order:
            q = (
                None
                if cfg.is_exact
                else sets[(cfg.pooled, cfg.codebook_size)].prefix(cfg.key_stages, cfg.value_stages)
            )
            nlls, seconds, storage = _evaluate_config(
                cfg, q, model, split, args, archive_dir, progress
            )
            if base is None:
                from model_adapters.experiments.perplexity import perplexity

                base = (perplexity(nlls), perplexity(nlls[args.tokens // 2 - 1 :]))
            rows.append(_summarise(cfg, nlls, base, storage, shape, args.tokens, seconds))
        calibration = (calibration_ids(split.train_segments, min(context, 1024))
                       if args.fsq_configs else None)
        for name in args.fsq_configs:
            converted = convert_or_load(name, model, bottlenecks=args.bottlenecks,
                                        calibration=calibration.to(device),
                                        cache_dir=args.codebook_dir)
            nlls, seconds, storage = evaluate_fsq(name, converted, split.passage, archive_dir,
                                                  progress)
            rows.append(summarise_fsq(name, converted, nlls, base, storage, shape, args.tokens,
                                      seconds))
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return {
        "model": Path(args.model).name,
        "model_type": shape.model_type,
        "config_fingerprint": config_fingerprint(model),
        "kv_shape": {
            "num_layers": shape.num_layers,
            "kv_heads": shape.kv_heads,
            "head_dim": shape.head_dim,
            "rope": shape.rope,
        },
        "fp16_bytes_per_token": shape.fp16_bytes_per_token,
        "text": text_name,
        "keep_quotes": args.keep_quotes,
        "chapter_found": split.chapter_found,
        "tokens": args.tokens,
        "train_tokens": split.train_tokens,
        "sinks": args.sinks,
        "recent": args.recent,
        "kmeans_iters": args.kmeans_iters,
        "kmeans_points": args.kmeans_points,
        "seed": args.seed,
        "device": str(device),
        "dtype": args.dtype,
        "collect_seconds": collect_s,
        "train_seconds": train_s,
        "exact_ppl": base[0],
        "exact_ppl_second_half": base[1],
        "configs": rows,
    }


def default_threads() -> int:
    """Half the cores, at least one."""
    return max(1, (os.cpu_count() or 2) // 2)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        require_models_extra("the evaluation")
    except ImportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from model_adapters.store.archive_io import ArchiveUnavailableError

    try:
        result = run(args)
    except (ValueError, ArchiveUnavailableError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(format_table(result))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    plot = args.plot or (str(Path(args.json).with_suffix(".png")) if args.json else None)
    if plot:
        from model_adapters.experiments.plot import rate_distortion

        rate_distortion([result], plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
