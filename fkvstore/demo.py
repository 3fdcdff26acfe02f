"""``fkv demo`` / ``python -m fkvstore.demo``: archive a book and use the archive.

The text is H. G. Wells, *The Time Machine*, from Project Gutenberg (eBook #35, public domain in
the USA), bundled as ``fkvstore/data/the_time_machine.txt``; the Gutenberg header and licence
footer are stripped before use. The demo is a list of steps (:data:`STEPS`) that share one
:class:`DemoState`; each step prints its own part of the report.
"""

from __future__ import annotations

import argparse
import sys
import time
import zlib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import numpy as np

import fkvstore
from fkvstore._progress import progress_bar

__all__ = ["STEPS", "DemoState", "load_book", "main"]

SOURCE = "H. G. Wells, The Time Machine (Project Gutenberg eBook #35, public domain)"
STREAM = "book"


def load_book(path: str | None = None) -> bytes:
    """UTF-8 bytes of the bundled book (or of ``path``) without the Gutenberg header/footer."""
    if path is None:
        raw = resources.files("fkvstore").joinpath("data/the_time_machine.txt").read_bytes()
    else:
        raw = Path(path).read_bytes()
    text = raw.decode("utf-8-sig")
    start, end = text.find("*** START OF"), text.find("*** END OF")
    if start >= 0 and end > start:
        text = text[text.index("\n", start) + 1 : end]
    return text.strip().encode("utf-8")


@dataclass
class DemoState:
    out: Path
    book: bytes
    quiet: bool = False
    source: str = SOURCE
    results: dict = field(default_factory=dict)

    def bar(self, total: int, desc: str, unit: str = "B"):
        return progress_bar(total, desc, not self.quiet, unit=unit)


def step_archive(st: DemoState) -> None:
    """Append the book to a text stream in pieces, as a growing source would, then close."""
    piece = 16_384
    t0 = time.perf_counter()
    with fkvstore.open(st.out, "w") as ar:
        ar.attrs["source"] = st.source
        s = ar.create_text_stream(STREAM)
        with st.bar(len(st.book), "archive") as bar:
            for a in range(0, len(st.book), piece):
                s.extend(st.book[a : a + piece])
                bar.update(min(piece, len(st.book) - a))
        ar.flush()
        stored = s.codec.num_spans(s.committed_length) * 16 * s.width  # points of 2 float64
        st.results.update(span=s.span, stored=stored)
    st.results["archive_s"] = time.perf_counter() - t0
    print(f"archived {len(st.book):,} bytes of {st.source}")
    print(
        f"  into {st.out} in {st.results['archive_s']:.2f} s (stream {STREAM!r}, grid, "
        f"{st.results['span']} bytes per stored point)"
    )


def step_sizes(st: DemoState) -> None:
    """Stored size against raw bytes, plain bit-packing and general-purpose compressors."""
    n = len(st.book)
    distinct = len(set(st.book))
    bits = max(1, int(np.ceil(np.log2(distinct))))
    rows: list[tuple[str, int | None]] = [  # size None: the compressor is not installed
        ("raw bytes", n),
        ("bit-packing, 8 bits (alphabet 256)", n),
        (
            f"bit-packing, {bits} bits ({distinct} distinct bytes)",
            -(-n * bits // 8),
        ),
        ("zlib level 9", len(zlib.compress(st.book, 9))),
    ]
    try:
        import zstandard

        rows.append(("zstd level 19", len(zstandard.ZstdCompressor(level=19).compress(st.book))))
    except ImportError:
        rows.append(("zstd (not installed)", None))
    rows.append(("fkvstore walk points (stored)", st.results["stored"]))
    rows.append(("fkvstore HDF5 file (points, checksums, metadata)", st.out.stat().st_size))
    print("\nsize of the book")
    print(f"  {'form':<52} {'bytes':>10} {'bits/byte':>10}")
    for name, size in rows:
        if size is None:
            print(f"  {name:<52} {'-':>10} {'-':>10}")
        else:
            print(f"  {name:<52} {size:>10,} {8 * size / n:>10.2f}")
    print(
        "  (the walk is not compression: it stores 128 bits per span of "
        f"{st.results['span']} bytes, in a form that is read at any position and searched by "
        "suffix without another copy of the text)"
    )


def _book_stream(ar: fkvstore.Archive) -> fkvstore.TextStream:
    """The demo's text stream in ``ar``; TypeError if the archive holds another kind there."""
    s = ar[STREAM]
    if not isinstance(s, fkvstore.TextStream):
        raise TypeError(f"stream {STREAM!r} of {ar.path!r} is not a text stream")
    return s


def step_random_reads(st: DemoState, reads: int = 10_000) -> None:
    """Random single-byte reads from the reopened archive, checked against the book."""
    rng = np.random.default_rng(0)
    pos = rng.integers(0, len(st.book), reads)
    with fkvstore.open(st.out) as ar:
        s = ar[STREAM]
        t0 = time.perf_counter()
        got = [s[int(i)] for i in pos]
        dt = time.perf_counter() - t0
    ok = all(g == st.book[int(i)] for g, i in zip(got, pos, strict=True))
    print(
        f"\n{reads:,} random single-byte reads: {1e6 * dt / reads:.1f} µs each, "
        f"{'all correct' if ok else 'MISMATCH'}"
    )
    if not ok:
        raise SystemExit("demo: random reads returned wrong bytes")
    window = min(120, len(st.book))  # a short text is shown whole
    a = int(rng.integers(0, len(st.book) - window + 1))
    with fkvstore.open(st.out) as ar:
        print(f"  bytes {a}..{a + window}: {_book_stream(ar).text(a, a + window)!r}")


def step_append(st: DemoState) -> None:
    """Reopen for writing, append a line, flush."""
    line = b"\n\n[appended by the fkvstore demo: the archive grows in place]\n"
    with fkvstore.open(st.out, "a") as ar:
        s = ar[STREAM]
        before = len(s)
        s.extend(line)
        ar.flush()
        st.results["appended"] = (before, len(s))
    print(f"\nappended {len(line)} bytes: {before:,} -> {before + len(line):,}")
    st.book = st.book + line


def step_reopen(st: DemoState) -> None:
    """Reopen read-only and compare the whole stream with the text."""
    t0 = time.perf_counter()
    with fkvstore.open(st.out) as ar:
        opened = time.perf_counter() - t0
        s = _book_stream(ar)
        same = s.bytes() == st.book
        n = len(s)
        tail = s.text(max(0, n - 60))
        report = ar.verify()
    print(
        f"\nreopened in {1e3 * opened:.1f} ms: {n:,} bytes, identical to the text: {same}; "
        f"checksums and spans: {'ok' if not any(report.values()) else report}"
    )
    print(f"  last 60 bytes: {tail!r}")
    if not same:
        raise SystemExit("demo: the reopened archive differs from the text")


def step_search(st: DemoState) -> None:
    """Search the archive itself: exact hits with context, and the longest shared suffix."""
    with fkvstore.open(st.out) as ar:
        s = _book_stream(ar)
        t0 = time.perf_counter()
        s.build_index()
        built = time.perf_counter() - t0
        query = "Time Traveller"
        s.search("Weena")  # the first query loads the compiled kernels
        t0 = time.perf_counter()
        hits = s.search(query)
        dt = time.perf_counter() - t0
        expect = st.book.count(query.encode())  # no overlaps possible for this query
        print(f"\nsearch index built from the archive in {1e3 * built:.0f} ms; "
              f"{query!r}: {len(hits)} hits in {1e6 * dt:.0f} µs "
              f"({'matches' if len(hits) == expect else 'DIFFERS FROM'} bytes.count: {expect})")
        for p in hits[:3].tolist():
            around = s.context(p, len(query) + 24, 24).decode("utf-8", "replace")
            print(f"  ...{around.replace(chr(10), ' ')}...")
        probe = "the Time Machine was"
        positions, lengths = s.longest_suffix(probe, k=3)
        for p, n in zip(positions.tolist(), lengths.tolist(), strict=True):
            print(f"  longest suffix of {probe!r} at byte {p}: {n} bytes "
                  f"({s.text(p - n + 1, p + 1)!r})")
    if len(hits) != expect:
        raise SystemExit("demo: search disagrees with a plain scan")


STEPS = [step_archive, step_sizes, step_random_reads, step_append, step_reopen, step_search]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m fkvstore.demo", description=__doc__.split("\n")[0])
    p.add_argument(
        "--out", default="time_machine.h5", help="archive to write (default: %(default)s)"
    )
    p.add_argument("--text", default=None, help="UTF-8 text file (default: the bundled book)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return p


def main(args=None) -> int:
    if args is None or isinstance(args, list):
        args = parser().parse_args(args)
    book = load_book(args.text)
    if not book:
        print(f"demo: {args.text}: no text to archive (empty once whitespace and any Gutenberg "
              "header are stripped)", file=sys.stderr)
        return 2
    source = SOURCE if args.text is None else str(args.text)
    st = DemoState(out=Path(args.out), book=book, quiet=args.quiet, source=source)
    for step in STEPS:
        step(st)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
