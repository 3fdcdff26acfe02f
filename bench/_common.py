"""Shared helpers of the benchmark scripts: timing, machine description, table and JSON output."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def median_seconds(fn, repeats: int = 5, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` over ``repeats`` runs after ``warmup`` runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def per_call_seconds(fn, args_list) -> list[float]:
    """Wall time of each call ``fn(*args)`` (for latency percentiles)."""
    out = []
    for args in args_list:
        t0 = time.perf_counter()
        fn(*args)
        out.append(time.perf_counter() - t0)
    return out


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d")}


def markdown_table(rows: list[dict], columns: list[tuple[str, str]]) -> str:
    """``columns``: (key, header). Floats get 3 significant digits."""
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1e4 else f"{v:,.0f}"
        return str(v)
    head = "| " + " | ".join(h for _, h in columns) + " |"
    sep = "|" + "|".join("---" for _ in columns) + "|"
    body = ["| " + " | ".join(fmt(r.get(k, "")) for k, _ in columns) + " |" for r in rows]
    return "\n".join([head, sep, *body])


def add_out_option(parser, name: str) -> None:
    """``--out``: where the JSON goes (see :func:`out_name`)."""
    quick = any("--quick" in action.option_strings for action in parser._actions)
    default = f"{name}, or {name}-quick with --quick" if quick else name
    parser.add_argument("--out", default=None,
                        help=f"results name under bench/results/, or a path without .json "
                             f"(default {default})")


def out_name(args, name: str) -> str:
    """The ``--out`` value, else ``name`` (``name-quick`` for a ``--quick`` run)."""
    return args.out or (name + ("-quick" if getattr(args, "quick", False) else ""))


def write_json(name: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path
