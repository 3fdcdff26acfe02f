"""Archive speed and size against plain h5py datasets of the same symbols, same run.

The baseline is what a user would write otherwise: a chunked, resizable uint8 (or uint16)
h5py dataset, appended by resize + slice assignment and read by ``ds[i]``. Single process;
medians over individual calls. Prints a markdown table and writes bench/results/archive.json.

    python bench/archive.py [--quick] [--dir DIR]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("NUMBA_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import h5py  # noqa: E402
import numpy as np  # noqa: E402
from _common import add_out_option, machine, markdown_table, out_name, write_json  # noqa: E402

import fkvstore  # noqa: E402


def timed_calls(fn, args) -> list[float]:
    out = []
    for a in args:
        t0 = time.perf_counter_ns()
        fn(a)
        out.append((time.perf_counter_ns() - t0) * 1e-9)
    return out


def med_us(xs) -> float:
    return 1e6 * statistics.median(xs)


def bench(tmp: Path, n: int, reads: int, wide_rows: int) -> list[dict]:
    rng = np.random.default_rng(0)
    symbols = rng.integers(0, 256, n).astype(np.uint8)
    piece = 1 << 20
    arc, base = tmp / "archive.h5", tmp / "baseline.h5"
    rows = []

    # compile and load the codec's kernels once, outside every measurement
    with fkvstore.open(tmp / "warm.h5", "w") as ar:
        for width in (1, 1152):
            w = ar.create_stream(f"w{width}", 256, width=width)
            w.extend(symbols[: 100 * width].reshape(-1, width))
            ar.flush()
            w.extend(symbols[: 7 * width].reshape(-1, width))
            w[3], w[:50]

    # -- extend throughput (includes the final flush / close) --
    t0 = time.perf_counter()
    with fkvstore.open(arc, "w") as ar:
        s = ar.create_stream("s", 256)
        for a in range(0, n, piece):
            s.extend(symbols[a : a + piece])
    t_arc = time.perf_counter() - t0
    t0 = time.perf_counter()
    with h5py.File(base, "w") as f:
        ds = f.create_dataset("s", shape=(0,), maxshape=(None,), chunks=(1 << 16,), dtype="u1")
        for a in range(0, n, piece):
            b = min(n, a + piece)
            ds.resize((b,))
            ds[a:b] = symbols[a:b]
    t_base = time.perf_counter() - t0
    rows.append(
        dict(
            op=f"extend {n:.0e} symbols (M symbols/s)",
            fkv=n / t_arc / 1e6,
            h5py=n / t_base / 1e6,
            target=">= 10",
        )
    )

    # -- single append (buffered; commit cost amortised and reported separately) --
    k = 100_000 if n >= 10**6 else 10_000
    vals = [int(v) for v in symbols[:k]]
    with fkvstore.open(tmp / "append.h5", "w") as ar:
        s = ar.create_stream("s", 256)
        t0 = time.perf_counter()
        for v in vals:
            s.append(v)
        t_app = time.perf_counter() - t0
        t0 = time.perf_counter()
        ar.flush()
        t_flush = time.perf_counter() - t0
    with h5py.File(tmp / "append_base.h5", "w") as f:
        ds = f.create_dataset("s", shape=(0,), maxshape=(None,), chunks=(1 << 16,), dtype="u1")
        kb = k // 10
        t0 = time.perf_counter()
        for i, v in enumerate(vals[:kb]):
            ds.resize((i + 1,))
            ds[i] = v
        t_app_base = (time.perf_counter() - t0) / kb
    rows.append(
        dict(op="append one symbol (µs)", fkv=1e6 * t_app / k, h5py=1e6 * t_app_base, target="<= 5")
    )
    rows.append(dict(op=f"flush after {k:,} appends (ms)", fkv=1e3 * t_flush, h5py="-", target=""))

    # -- open time --
    opens_a, opens_b = [], []
    for _ in range(20):
        t0 = time.perf_counter()
        ar = fkvstore.open(arc)
        ar["s"]
        opens_a.append(time.perf_counter() - t0)
        ar.close()
        t0 = time.perf_counter()
        f = h5py.File(base, "r")
        f["s"]
        opens_b.append(time.perf_counter() - t0)
        f.close()
    rows.append(
        dict(
            op="open archive + stream (ms)",
            fkv=1e3 * statistics.median(opens_a),
            h5py=1e3 * statistics.median(opens_b),
            target="<= 200",
        )
    )

    # -- cold reads: the first read of a chunk, one position per chunk, fresh file handles --
    with fkvstore.open(arc) as ar:
        s = ar["s"]
        per_chunk = s.span * s.block_spans
        cold_pos = [int(c * per_chunk + rng.integers(per_chunk)) for c in range(n // per_chunk)]
        s[0]  # compile/warm the decoder on chunk 0, then skip it
        cold_a = timed_calls(lambda i: s[i], cold_pos[1:])
        assert all(s[i] == symbols[i] for i in cold_pos[:50])
    with h5py.File(base, "r") as f:
        ds = f["s"]
        cold_b = timed_calls(lambda i: ds[i], [int(c * (1 << 16) + 7) for c in range(1, n >> 16)])
    rows.append(
        dict(
            op="cold read, first of a chunk (µs, median)",
            fkv=med_us(cold_a),
            h5py=med_us(cold_b),
            target="<= 50",
        )
    )

    # -- warm reads --
    pos = [int(i) for i in rng.integers(0, n, reads)]
    with fkvstore.open(arc) as ar:
        s = ar["s"]
        for i in pos:
            s[i]
        warm_a = timed_calls(lambda i: s[i], pos)
        assert all(s[i] == symbols[i] for i in pos[:1000])
    with h5py.File(base, "r") as f:
        ds = f["s"]
        for i in pos:
            ds[i]
        warm_b = timed_calls(lambda i: ds[i], pos)
    rows.append(
        dict(
            op=f"warm random read, {n:.0e} symbols (µs, median)",
            fkv=med_us(warm_a),
            h5py=med_us(warm_b),
            target="<= 5 and <= h5py",
        )
    )

    # -- one row of width 1152 (a KV-cache token) --
    width = 1152
    wide = rng.integers(0, 256, (wide_rows, width)).astype(np.uint8)
    with fkvstore.open(tmp / "wide.h5", "w") as ar:
        ar.create_stream("kv", 256, width=width).extend(wide)
    with h5py.File(tmp / "wide_base.h5", "w") as f:
        f.create_dataset("kv", data=wide, chunks=(16, width), maxshape=(None, width))
    wpos = [int(i) for i in rng.integers(0, wide_rows, min(reads, 2000))]
    with fkvstore.open(tmp / "wide.h5") as ar:
        s = ar["kv"]
        for i in wpos:
            s[i]
        warm_wa = timed_calls(lambda i: s[i], wpos)
        assert all((s[i] == wide[i]).all() for i in wpos[:20])
    with h5py.File(tmp / "wide_base.h5", "r") as f:
        ds = f["kv"]
        for i in wpos:
            ds[i]
        warm_wb = timed_calls(lambda i: ds[i], wpos)
    rows.append(
        dict(
            op=f"warm read of one row of width {width} (µs, median)",
            fkv=med_us(warm_wa),
            h5py=med_us(warm_wb),
            target="<= 100",
        )
    )

    rows.append(
        dict(
            op="file bytes per symbol",
            fkv=arc.stat().st_size / n,
            h5py=base.stat().st_size / n,
            target="(floor: 1.0 for 8 bits)",
        )
    )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="10^6 symbols instead of 10^7")
    p.add_argument("--dir", default=None, help="where to write the temporary files")
    add_out_option(p, "archive")
    args = p.parse_args()
    n = 10**6 if args.quick else 10**7
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        rows = bench(Path(tmp), n, reads=10_000, wide_rows=2_000 if args.quick else 10_000)
    cols = [
        ("op", "measurement"),
        ("fkv", "fkvstore"),
        ("h5py", "plain h5py"),
        ("target", "target"),
    ]
    print(markdown_table(rows, cols))
    path = write_json(
        out_name(args, "archive"),
        {"machine": machine(), "symbols": n, "rows": rows},
    )
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
