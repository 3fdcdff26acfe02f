"""Codec speed and density: the Numba codec against the pure-Python oracle, same run.

Single core (NUMBA_NUM_THREADS=1), compiled and warmed, medians over repeats. Prints a markdown
table and writes bench/results/codec.json.

    python bench/codec.py [--quick]
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
import time
from pathlib import Path

os.environ.setdefault("NUMBA_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
from _common import (  # noqa: E402
    add_out_option,
    machine,
    markdown_table,
    median_seconds,
    out_name,
    per_call_seconds,
    write_json,
)

import naive  # noqa: E402
from fkvstore.codec import Codec  # noqa: E402

ALPHABETS = [4, 27, 256, 1024, 50257, 151936]


def bench_one(alphabet_size: int, geometry: str, n: int, access_n: int, calls: int) -> dict:
    codec = Codec(alphabet_size, geometry)
    rng = np.random.default_rng(alphabet_size)
    symbols = rng.integers(0, alphabet_size, n).astype(np.int32)
    points = codec.encode(symbols)
    enc = median_seconds(lambda: codec.encode(symbols))
    dec = median_seconds(lambda: codec.decode(points, n))

    big = rng.integers(0, alphabet_size, access_n).astype(np.int32)
    big_points = codec.encode(big)
    idx = rng.integers(0, access_n, calls)
    for i in idx[:100]:
        codec.decode_range(big_points, access_n, int(i), int(i) + 1)
    access = per_call_seconds(codec.decode_range,
                              [(big_points, access_n, int(i), int(i) + 1) for i in idx])
    assert all(codec.decode_range(big_points, access_n, int(i), int(i) + 1)[0] == big[i]
               for i in idx[:50])

    # append one symbol at a time through the public incremental path
    tail_count = 0
    tail = None
    app = []
    for c in big[:calls]:
        t0 = time.perf_counter()
        new = codec.extend(tail, tail_count, [int(c)])
        app.append(time.perf_counter() - t0)
        tail_count = (tail_count + 1) % codec.span
        tail = new[-1] if tail_count else None

    # the pure-Python oracle on a small sample (it is orders of magnitude slower)
    small = [int(c) for c in symbols[: 4000 if geometry == "grid" or alphabet_size < 2000 else 40]]
    t0 = time.perf_counter()
    opts = naive.encode(small, alphabet_size, geometry, codec.span)
    oracle_enc = (time.perf_counter() - t0) / len(small)
    t0 = time.perf_counter()
    naive.decode(opts, len(small), alphabet_size, geometry, codec.span)
    oracle_dec = (time.perf_counter() - t0) / len(small)
    pos = random.Random(0).randrange(len(small))
    t0 = time.perf_counter()
    s = pos // codec.span
    naive.decode_span(opts[s], min(codec.span, len(small) - s * codec.span), alphabet_size,
                      geometry)
    oracle_access = time.perf_counter() - t0

    return {
        "alphabet_size": alphabet_size, "geometry": geometry, "span": codec.span,
        "encode_Msym_s": n / enc / 1e6, "decode_Msym_s": n / dec / 1e6,
        "access_us_p50": float(np.median(access)) * 1e6,
        "access_us_p99": float(np.percentile(access, 99)) * 1e6,
        "append_us_p50": float(np.median(app)) * 1e6,
        "bits_per_symbol": codec.bits_per_symbol,
        "log2_N": math.log2(alphabet_size),
        "bitpack_bits": math.ceil(math.log2(alphabet_size)),
        "oracle_encode_Msym_s": 1e-6 / oracle_enc, "oracle_decode_Msym_s": 1e-6 / oracle_dec,
        "oracle_access_us": oracle_access * 1e6,
        "decode_speedup_vs_oracle": (n / dec) / (1 / oracle_dec),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    add_out_option(ap, "codec")
    args = ap.parse_args()
    n = 200_000 if args.quick else 4_000_000
    access_n = 100_000 if args.quick else 1_000_000
    calls = 2000 if args.quick else 10_000
    rows = []
    for alphabet_size in ALPHABETS:
        for geometry in ("grid", "ring"):
            row = bench_one(alphabet_size, geometry, n, access_n, calls)
            rows.append(row)
            print(f"  N={alphabet_size:>6} {geometry}: encode {row['encode_Msym_s']:.0f} M/s, "
                  f"decode {row['decode_Msym_s']:.0f} M/s", file=sys.stderr)
    cols = [("alphabet_size", "N"), ("geometry", "geometry"), ("span", "span m"),
            ("encode_Msym_s", "encode M sym/s"), ("decode_Msym_s", "decode M sym/s"),
            ("access_us_p50", "1-position read µs (p50)"), ("access_us_p99", "p99 µs"),
            ("append_us_p50", "append 1 sym µs"),
            ("bits_per_symbol", "stored bits/sym"), ("log2_N", "log2 N"),
            ("bitpack_bits", "bit-packing bits/sym"),
            ("oracle_encode_Msym_s", "oracle encode M sym/s"),
            ("oracle_decode_Msym_s", "oracle decode M sym/s"),
            ("oracle_access_us", "oracle 1-position µs"),
            ("decode_speedup_vs_oracle", "decode × oracle")]
    print(markdown_table(rows, cols))
    info = machine()
    print(f"\n{info['cpu']}, {info['cores']} cores, Python {info['python']}, {info['date']}; "
          f"encode/decode over {n:,} symbols, reads on a {access_n:,}-symbol stream")
    path = write_json(out_name(args, "codec"),
                      {"machine": info, "symbols": n, "access_stream": access_n, "rows": rows})
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
