"""Remote archives: requests and bytes per operation, counted at an S3 server, and latency with
and without the block cache, against the same archive read from the local disk.

The server is moto's S3 on 127.0.0.1 (tests/support/s3_server.py, IAM authentication on): every
request is counted where it is answered. Latency on loopback is no network latency: what
carries over to real object storage is the request count (each costs a round trip, tens of
milliseconds on S3) and the bytes. The archive: the bundled book as a text stream with its
search index persisted, and a stream of KV-cache codes (width 64), published with
``fkvstore.copy`` (laid out for remote reads); the same bytes uploaded as they are (no repack)
show what the layout saves. Needs the ``remote`` and ``test`` extras.

    python bench/remote.py [--quick]
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
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests" / "support"))  # the counting S3 server

import numpy as np  # noqa: E402
from _common import add_out_option, machine, markdown_table, out_name, write_json  # noqa: E402
from s3_server import S3Server  # noqa: E402

import fkvstore  # noqa: E402
from fkvstore.demo import load_book  # noqa: E402

QUERY = b"Time Traveller"


def build(path: Path, rows: int) -> np.ndarray:
    codes = np.random.default_rng(0).integers(0, 256, (rows, 64))
    with fkvstore.open(path, "w") as ar:
        ar.create_stream("kv", 256, width=64).extend(codes)
        book = ar.create_text_stream("book")
        book.extend(load_book())
        book.build_index(persist=True)
    return codes


def measure(server: S3Server | None, where: str, rows: np.ndarray, hits: int,
            **open_kw) -> dict[str, dict]:
    """Each operation on a freshly opened archive: requests, bytes, seconds."""
    out = {}

    def op(name, fn, repeat=1):
        samples = []
        for _ in range(repeat):
            if server is None:
                t0 = time.perf_counter()
                fn()
                samples.append((0, 0, time.perf_counter() - t0))
                continue
            with server.counting() as c:
                t0 = time.perf_counter()
                fn()
                dt = time.perf_counter() - t0
            samples.append((c.n, c.bytes_out, dt))
        n, b, t = zip(*samples, strict=True)
        misses = [dt for k, _, dt in samples if k]
        out[name] = {"requests_max": max(n), "requests_mean": statistics.mean(n),
                     "bytes_mean": statistics.mean(b), "ms_median": 1e3 * statistics.median(t),
                     "ms_median_requesting": 1e3 * statistics.median(misses) if misses else ""}

    opened = []
    op("open", lambda: opened.append(fkvstore.open(where, **open_kw)), repeat=3)
    for extra in opened[:-1]:
        extra.close()
    ar = opened[-1]
    op("open stream", lambda: (ar["kv"], ar["book"]))
    kv, book = ar["kv"], ar["book"]
    it = iter(rows.tolist())
    op("random row, cold", lambda: kv[next(it)], repeat=len(rows) // 2)
    warm = rows[: len(rows) // 2].tolist()
    it_warm = iter(warm)
    op("random row, warm", lambda: kv[next(it_warm)], repeat=len(warm))
    op("search, first (loads the index)", lambda: book.search(QUERY))
    op("search, again", lambda: book.search(QUERY), repeat=5)
    op("context of a hit", lambda: book.context(hits, 200, 200), repeat=3)
    ar.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a smaller archive and fewer reads")
    add_out_option(p, "remote")
    args = p.parse_args()
    n_rows, n_reads = (20_000, 20) if args.quick else (200_000, 100)

    server = S3Server(auth=True).start()
    opts = server.storage_options
    with tempfile.TemporaryDirectory() as tmp:
        local = Path(tmp) / "run.h5"
        codes = build(local, n_rows)
        with fkvstore.open(local) as ar:  # compile the codec kernels outside the measurements
            ar["kv"][0], ar["book"].search(QUERY)
            hit = int(ar["book"].search(QUERY)[0])
        url, raw_url = server.url("run.h5"), server.url("run-as-is.h5")
        with server.counting() as c:
            t0 = time.perf_counter()
            fkvstore.copy(local, url, storage_options=opts)
            publish_s = time.perf_counter() - t0
        import fsspec

        fsspec.filesystem("s3", **opts).put_file(str(local), raw_url.removeprefix("s3://"))
        rows = np.random.default_rng(1).integers(0, len(codes), 2 * n_reads)
        sizes = {"local": local.stat().st_size,
                 "published": fsspec.filesystem("s3", **opts).info(url)["size"]}
        runs = {
            "local file": measure(None, str(local), rows, hit),
            "S3, published, block cache": measure(server, url, rows, hit, storage_options=opts),
            "S3, published, no block cache": measure(server, url, rows, hit,
                                                     storage_options=opts, block_cache_bytes=0),
            "S3, uploaded as is, block cache": measure(server, raw_url, rows, hit,
                                                       storage_options=opts),
        }
    server.stop()

    table = []
    for run, ops in runs.items():
        for name, m in ops.items():
            table.append({"run": run, "operation": name, **m})
    cols = [("run", "run"), ("operation", "operation"), ("requests_max", "requests (max)"),
            ("requests_mean", "requests (mean)"), ("bytes_mean", "bytes (mean)"),
            ("ms_median", "ms (median)"),
            ("ms_median_requesting", "ms (median of calls that made a request)")]
    print(f"archive: {n_rows} rows x 64 codes + the book with its index; local "
          f"{sizes['local']:,} bytes, published {sizes['published']:,} bytes; publish "
          f"{publish_s:.2f} s, {c.n} requests ({', '.join(r.method for r in c.requests)})")
    print(markdown_table(table, cols))
    path = write_json(out_name(args, "remote"), {
        "machine": machine(), "rows": n_rows, "reads": n_reads, "sizes": sizes,
        "publish": {"seconds": publish_s, "requests": [r.method for r in c.requests]},
        "runs": runs})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
