"""What a commit costs at each durability level, against SQLite on the same disk, same run.

Each round appends a batch of rows (width 64, alphabet 256: one token's codes per row) to one
stream and commits it; the time of the commit alone (``flush``) is taken per round:

- ``process``: ``flush()`` at durability "process" (survives a killed process; no fsync);
- ``process+fsync``: ``flush(sync=True)`` at "process" (one fsync of the file; a later torn
  write may still damage HDF5 metadata);
- ``fsync``: ``flush()`` at durability "fsync" (rollback journal, two fsyncs: power-loss safe).

Baselines: SQLite (Python's sqlite3) committing one row holding the same bytes in a
transaction, ``synchronous=FULL``, in rollback-journal mode (``journal_mode=DELETE``, the
default) and in WAL mode; and the floor, ``pwrite`` of 4 KiB plus ``fdatasync`` of a plain file
(what the journal calls on Linux, as SQLite does).
Medians over rounds, ratios against the ``process`` flush. Prints a markdown table, writes
bench/results/durability.json. Run it on the disk you care about (``--dir``): fsync costs are
the disk's, and tmpfs makes them free.

    python bench/durability.py [--quick] [--dir DIR]
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
from _common import add_out_option, machine, markdown_table, out_name, write_json  # noqa: E402

import fkvstore  # noqa: E402

WIDTH = 64


def _median_ms(xs: list[float]) -> float:
    return 1e3 * statistics.median(xs)


def flush_times(path: Path, durability: str, sync: bool, batch: int, rounds: int,
                rng: np.random.Generator) -> list[float]:
    rows = rng.integers(0, 256, (batch * rounds, WIDTH))
    with fkvstore.open(path, "w", durability=durability) as ar:
        s = ar.create_stream("kv", 256, width=WIDTH)
        s.extend(rows[:batch])
        ar.flush(sync=sync)
        out = []
        for k in range(1, rounds):
            s.extend(rows[k * batch : (k + 1) * batch])
            t0 = time.perf_counter()
            ar.flush(sync=sync)
            out.append(time.perf_counter() - t0)
    with fkvstore.open(path) as ar:
        assert len(ar["kv"]) == batch * rounds
    return out


def sqlite_times(path: Path, mode: str, batch: int, rounds: int) -> list[float]:
    blob = bytes(batch * WIDTH)  # the same number of bytes of codes as the archive's batch
    db = sqlite3.connect(path, isolation_level=None)
    db.execute(f"PRAGMA journal_mode={mode}")
    db.execute("PRAGMA synchronous=FULL")
    db.execute("CREATE TABLE kv (id INTEGER PRIMARY KEY, codes BLOB)")
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        db.execute("BEGIN")
        db.execute("INSERT INTO kv (codes) VALUES (?)", (blob,))
        db.execute("COMMIT")
        out.append(time.perf_counter() - t0)
    db.close()
    return out


def fsync_floor(path: Path, rounds: int) -> list[float]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    out = []
    try:
        for k in range(rounds):
            t0 = time.perf_counter()
            os.pwrite(fd, bytes(4096), 4096 * k)
            getattr(os, "fdatasync", os.fsync)(fd)
            out.append(time.perf_counter() - t0)
    finally:
        os.close(fd)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument("--dir", default=None, help="where the files go (a real disk)")
    add_out_option(parser, "durability")
    args = parser.parse_args()
    rounds = 15 if args.quick else 60
    batches = (16, 16384)  # a few tokens per commit; 1M symbols per commit
    rng = np.random.default_rng(0)
    rows = []
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        tmp_path = Path(tmp)
        flush_times(tmp_path / "warm.h5", "process", False, 16, 3, rng)  # compile the codec
        for batch in batches:
            n = rounds if batch < 1000 else max(5, rounds // 4)
            res = {}
            for name, durability, sync in (("process", "process", False),
                                           ("process+fsync", "process", True),
                                           ("fsync", "fsync", False)):
                res[name] = flush_times(tmp_path / f"{name}-{batch}.h5", durability, sync,
                                        batch, n + 1, rng)
            for mode in ("DELETE", "WAL"):
                res[f"sqlite {mode.lower()}"] = sqlite_times(
                    tmp_path / f"sqlite-{mode}-{batch}.db", mode, batch, n)
            base = _median_ms(res["process"])
            for name, xs in res.items():
                rows.append({"rows_per_commit": batch, "symbols_per_commit": batch * WIDTH,
                             "what": name, "median_ms": _median_ms(xs),
                             "p90_ms": 1e3 * float(np.percentile(xs, 90)),
                             "vs_process": _median_ms(xs) / base, "rounds": len(xs)})
        floor = fsync_floor(tmp_path / "floor.bin", rounds)
        rows.append({"rows_per_commit": 0, "symbols_per_commit": 0,
                     "what": "pwrite 4 KiB + fdatasync", "median_ms": _median_ms(floor),
                     "p90_ms": 1e3 * float(np.percentile(floor, 90)), "vs_process": "",
                     "rounds": len(floor)})
    table = markdown_table(rows, [("rows_per_commit", "rows/commit"),
                                  ("symbols_per_commit", "symbols/commit"),
                                  ("what", "commit"), ("median_ms", "median ms"),
                                  ("p90_ms", "p90 ms"), ("vs_process", "x process")])
    print(table)
    path = write_json(out_name(args, "durability"), {"machine": machine(), "width": WIDTH,
                                                     "rows": rows})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
