"""One retrieval run: items x lengths x tasks x methods, scored; workers and their merge.

Results are per method, task and length: the 0/1 outcome of every item (by item index, so the
parts of several worker processes merge), accuracy, 95% bootstrap interval, and the bytes per
token per layer the method held after the prefill of the first item of each task.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["REPRO_LENGTHS", "merge_parts", "reproduce", "run_items", "summarise"]

REPRO_LENGTHS = (1024, 2048, 4096, 8192)
MODEL_CARD = {1024: 0.82, 2048: 0.90, 4096: 0.82, 8192: 0.94}


def reproduce(model, tokenizer, val, words, lengths, count, log=print) -> dict:
    """The model card's evaluation: one ``random.Random(123)`` stream of single-needle items,
    ``count`` per length in order 1K, 2K, 4K, 8K, scored teacher-forced; the same items are
    also scored by greedy decoding through an exact cache."""
    import random

    from model_adapters.retrieval.methods import MethodContext, resolve_method
    from model_adapters.retrieval.scoring import (
        answer_correct,
        bootstrap_ci,
        greedy_answer,
        teacher_forced,
    )
    from model_adapters.retrieval.tasks import make_item

    exact = resolve_method("exact", MethodContext(model, None))
    r = random.Random(123)
    out = {}
    for length in REPRO_LENGTHS:
        items = [make_item("single", length, val, words, tokenizer, r) for _ in range(count)]
        if length not in lengths:
            continue
        tf = [teacher_forced(model, it) for it in items]
        gen = [answer_correct(greedy_answer(model, exact, it, tokenizer)[0], it.answers)
               for it in items]
        out[str(length)] = {
            "teacher_forced": sum(tf) / count, "teacher_forced_ci": bootstrap_ci(tf),
            "greedy_exact": sum(gen) / count, "greedy_exact_ci": bootstrap_ci(gen),
            "model_card": MODEL_CARD[length], "items": count,
        }
        log(f"reproduce {length}: teacher-forced {sum(tf) / count:.2f} "
            f"(model card {MODEL_CARD[length]:.2f}), greedy exact {sum(gen) / count:.2f}")
    return out


def run_items(model, tokenizer, methods, val, words, lengths, tasks, count, shard=(0, 1),
              max_seconds=None, seed=0, log=print, share: bool = True) -> dict:
    """Score item indices ``i`` with ``i % shard[1] == shard[0]`` (all lengths, tasks and
    methods for one index before the next); stops starting new work after ``max_seconds``.
    With ``share``, one exact prefill per item serves every method that compresses only after
    its prefill (``Method.from_exact``).
    Returns the raw part: ``{"outcomes": {method: {task: {length: {index: 0/1}}}}, "bytes":
    {method: {task: {length: bytes}}}, "depths": {task: {length: {index: depth}}}}``."""
    from model_adapters.retrieval.scoring import answer_correct, exact_prefill, greedy_answer
    from model_adapters.retrieval.tasks import task_items

    items = {(t, n): task_items(t, n, count, val, words, tokenizer, seed=seed)
             for t in tasks for n in lengths}
    outcomes = {m.name: {t: {str(n): {} for n in lengths} for t in tasks} for m in methods}
    stored = {m.name: {t: {} for t in tasks} for m in methods}
    depths = {t: {str(n): {} for n in lengths} for t in tasks}
    errors: dict[str, str] = {}
    t0 = time.perf_counter()

    def over() -> bool:
        return max_seconds is not None and time.perf_counter() - t0 > max_seconds

    def score(i, n, t):
        item = items[(t, n)][i]
        depths[t][str(n)][str(i)] = item.depth
        shared = (exact_prefill(model, item.context) if share and
                  sum(m.from_exact is not None for m in methods) > 1 else None)
        for m in methods:
            if m.name in errors:
                continue
            try:
                text, b = greedy_answer(model, m, item, tokenizer, measure=(i == 0),
                                        shared=shared)
            except Exception as exc:  # one failing peer must not sink the whole grid
                errors[m.name] = f"{type(exc).__name__}: {exc}"
                log(f"method {m.name} failed, dropped: {errors[m.name]}")
                continue
            outcomes[m.name][t][str(n)][str(i)] = int(answer_correct(text, item.answers))
            if b is not None:
                stored[m.name][t][str(n)] = {"bytes": b, "tokens": len(item.context)}

    done = 0
    for i in range(shard[0], count, shard[1]):
        units = [(n, t) for n in lengths for t in tasks]
        for n, t in units:
            if over():  # an index left partial is left out of the summary
                break
            score(i, n, t)
        else:
            done += 1
            log(f"item index {i} done ({time.perf_counter() - t0:.0f} s)")
            continue
        log(f"time budget reached after {done} complete item indices")
        break
    return {"outcomes": outcomes, "bytes": stored, "depths": depths, "errors": errors}


def merge_parts(parts: list[dict]) -> dict:
    """One raw result from several workers' parts (disjoint item indices)."""
    out = {"outcomes": {}, "bytes": {}, "depths": {}, "errors": {}}
    for part in parts:
        for key in out:
            _deep_update(out[key], part[key])
    return out


def _deep_update(dst: dict, src: dict) -> None:
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            _deep_update(dst[k], v)
        elif isinstance(v, dict):
            dst[k] = json.loads(json.dumps(v))
        else:
            dst[k] = v


def summarise(raw: dict, methods, shape, lengths, tasks) -> list[dict]:
    """Per method: accuracy, bootstrap interval and item count per task and length (only item
    indices every method finished), bytes per token per layer and compression per length."""
    from model_adapters.retrieval.scoring import bootstrap_ci

    fp16 = shape.fp16_bytes_per_token / shape.num_layers
    errors = raw.get("errors", {})
    common = None
    for m in methods:
        if m.name in errors:
            continue
        for t in tasks:
            for n in lengths:
                ids = set(raw["outcomes"][m.name][t][str(n)])
                common = ids if common is None else common & ids
    common = sorted(common or (), key=int)
    rows = []
    for m in methods:
        row = {"method": m.name, "family": m.family, **m.info, "tasks": {},
               "bytes_per_token_layer": {}, "compression": {}}
        if m.name in errors:
            rows.append({**row, "error": errors[m.name]})
            continue
        for n in lengths:
            measured = [raw["bytes"][m.name][t].get(str(n)) for t in tasks]
            measured = [x for x in measured if x]
            if measured:
                bpl = sum(x["bytes"] / (x["tokens"] * shape.num_layers) for x in measured)
                bpl /= len(measured)
                row["bytes_per_token_layer"][str(n)] = bpl
                row["compression"][str(n)] = fp16 / bpl
        for t in tasks:
            per = {}
            for n in lengths:
                got = raw["outcomes"][m.name][t][str(n)]
                xs = [got[i] for i in common]
                lo, hi = bootstrap_ci(xs)
                per[str(n)] = {"accuracy": sum(xs) / len(xs) if xs else None, "ci": [lo, hi],
                               "items": len(xs), "outcomes": xs}
                if t == "depth" and xs:
                    per[str(n)]["by_depth"] = _by_depth(raw["depths"][t][str(n)], got, common)
            row["tasks"][t] = per
        rows.append(row)
    return rows


def _by_depth(depths: dict, got: dict, common) -> dict:
    from model_adapters.retrieval.tasks import DEPTHS

    out = {}
    for k, d in enumerate(DEPTHS):
        xs = [got[i] for i in common if int(i) % len(DEPTHS) == k]
        out[f"{d:.2f}"] = sum(xs) / len(xs) if xs else None
    return out


def spawn_workers(argv: list[str], workers: int, log=print) -> list[dict]:
    """Run ``workers`` copies of the command line as shard processes (``--shard k/N``) and
    return their parts; a failing worker raises RuntimeError with its exit status."""
    tmp = tempfile.mkdtemp(prefix="fkv-retrieval-")
    procs = []
    for k in range(workers):
        part = os.path.join(tmp, f"part{k}.json")
        cmd = [sys.executable, "-m", "model_adapters.retrieval", *argv,
               "--shard", f"{k}/{workers}", "--part", part]
        procs.append((subprocess.Popen(cmd, stdout=subprocess.DEVNULL if k else None), part))
    parts = []
    for proc, part in procs:
        rc = proc.wait()
        if rc != 0:
            raise RuntimeError(f"worker {part} exited with status {rc}")
        parts.append(json.loads(Path(part).read_text()))
    log(f"{workers} workers done")
    return parts
