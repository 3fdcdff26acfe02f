"""The ``fkv`` command: ``demo``, ``info``, ``verify``, ``get``, ``append``, ``search`` and
``index``.

See ``docs/cli.md``. Exit status 0 on success, 1 when ``verify`` finds damage, 2 on bad usage,
bad input or an error opening or reading the archive (a one-line ``fkv: ...`` message on standard
error, no traceback).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

import fkvstore
from fkvstore import _remote, _validate
from fkvstore._progress import progress_bar
from fkvstore.codec import Codec
from fkvstore.errors import FkvError, StreamNotFoundError

__all__ = ["main"]


class CliError(Exception):
    """A user error the command reports as ``fkv: <message>`` with exit status 2."""


def _non_negative(text: str) -> int:
    """argparse type: an int >= 0, else an error naming the value."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative; give 0 or more")
    return value


def _stream(ar, file: str, name: str):
    """Stream ``name`` of an open archive, or a CliError that says how to create it."""
    try:
        return ar[name]
    except StreamNotFoundError:
        known = ", ".join(map(repr, ar)) or "none"
        raise CliError(
            f"no stream {name!r} in {file} (streams: {known}); create one with "
            f"'fkv append {file} {name} --text' or '--alphabet-size N'") from None


def _parse_range(text: str, length: int, name: str = "") -> tuple[int, int]:
    try:
        lo, _, hi = text.partition(":")
        if not _:
            row = int(lo)
            start = row + (length if row < 0 else 0)
            if not 0 <= start < length:
                raise CliError(
                    f"row {row} is outside stream {name!r}, which has {length} row(s) "
                    f"(valid rows: {-length}..{length - 1})" if length else
                    f"row {row} is outside stream {name!r}, which is empty"
                )
            return start, start + 1
        start = int(lo) if lo else 0
        stop = int(hi) if hi else length
    except ValueError:
        raise CliError(f"bad range {text!r}; use START:STOP (either may be empty)") from None
    return slice(start, stop).indices(length)[:2]


def cmd_info(args) -> int:
    with fkvstore.open(args.file) as ar:
        print(
            f"{args.file}: fkvstore archive, {len(ar)} stream(s), {len(ar.array_names())} "
            f"array(s), durability {ar.durability}"
        )
        for key, value in ar.attrs.items():
            print(f"  attr {key} = {value!r}")
        for name in ar:
            s = ar[name]
            c = s.codec
            print(
                f"  stream {name!r}: {s.kind}, {len(s)} rows x width {s.width}, "
                f"alphabet {c.alphabet_size}, {c.geometry}, ratio {c.ratio:.6g}, span {c.span}, "
                f"{c.bits_per_symbol:.2f} bits/symbol in full spans"
            )
            for key, value in s.attrs.items():
                print(f"    attr {key} = {value!r}")
        for name in ar.array_names():
            dtype, shape = ar.array_info(name)
            print(f"  array {name!r}: {dtype} {shape}")
    return 0


def _chunks(s) -> int:
    """Stored chunks of complete spans of stream ``s`` (what ``verify`` checks, besides the
    open span)."""
    return -(-(s.committed_length // s.span) // s.block_spans)


def cmd_verify(args) -> int:
    with fkvstore.open(args.file) as ar:
        total = sum(_chunks(ar[n]) + 1 for n in ar)
        with progress_bar(total, "verify", not args.quiet) as bar:
            report = ar.verify(bar.update)
    bad = {name: probs for name, probs in report.items() if probs}
    for name, probs in report.items():
        print(f"{name}: {'DAMAGED' if probs else 'ok'}")
        for p in probs:
            print(f"  {p}")
    return 1 if bad else 0


def cmd_get(args) -> int:
    with fkvstore.open(args.file) as ar:
        s = _stream(ar, args.file, args.stream)
        start, stop = _parse_range(args.range, len(s), args.stream)
        if s.kind == "text":
            sys.stdout.buffer.write(s.bytes(start, stop))
            sys.stdout.buffer.flush()
            return 0
        step = 1 << 16
        for a in range(start, stop, step):
            rows = s[a : min(stop, a + step)]
            np.savetxt(sys.stdout, rows, fmt="%d")
    return 0


def _read_rows(lines, width: int, alphabet_size: int, stream: str) -> np.ndarray:
    """Rows of ``width`` ints in ``[0, alphabet_size)``, one per non-blank line, or CliError."""
    rows = []
    for line_no, line in enumerate(lines, 1):
        fields = line.split()
        if not fields:
            continue
        try:
            row = [int(v) for v in fields]
        except ValueError:
            raise CliError(
                f"line {line_no}: not integers: {line.strip()!r}; nothing appended"
            ) from None
        if len(row) != width:
            raise CliError(
                f"line {line_no}: {len(row)} value(s), stream {stream!r} has width {width}; "
                "nothing appended"
            )
        for v in row:
            if not 0 <= v < alphabet_size:
                raise CliError(
                    f"line {line_no}: symbol {v} is outside 0..{alphabet_size - 1} (alphabet "
                    f"of stream {stream!r}); nothing appended"
                )
        rows.append(row)
    return np.array(rows, dtype=np.int64).reshape(-1, width)


def cmd_append(args) -> int:
    local = _remote.file_url_path(args.file)
    if local is not None:
        args.file = local
    elif _remote.is_url(args.file):
        raise CliError(f"{args.file!r} is a URL: remote archives are read-only; append to a "
                       "local archive and upload it (fkvstore.copy); nothing appended")
    # learn the stream's shape, then read and check all input, before creating anything
    existing = None
    if Path(args.file).exists():
        with fkvstore.open(args.file) as ar:
            if args.stream in ar:
                s = ar[args.stream]
                existing = (s.kind, s.width, s.codec.alphabet_size)
    creation = [flag for flag, given in (
        ("--text", args.text), ("--alphabet-size", args.alphabet_size is not None),
        ("--width", args.width is not None), ("--geometry", args.geometry is not None)) if given]
    if existing is not None:
        kind, width, alphabet_size = existing
        if creation:
            raise CliError(
                f"stream {args.stream!r} already exists ({kind}, width {width}, alphabet "
                f"{alphabet_size}); {', '.join(creation)} only create a stream: leave them out "
                "to append to it; nothing appended")
    elif args.text:
        if creation != ["--text"]:
            raise CliError(f"--text creates a byte stream; {', '.join(creation[1:])} do not "
                           "apply to it")
        kind, width, alphabet_size = "text", 1, 256
    elif args.alphabet_size is not None:
        width = 1 if args.width is None else args.width
        geometry = args.geometry or "grid"
        Codec(args.alphabet_size, geometry)  # raises naming a bad size
        _validate.integer(width, "--width", low=1)
        kind, alphabet_size = "symbols", args.alphabet_size
    else:
        raise CliError(
            f"no stream {args.stream!r} in {args.file}; pass --text or --alphabet-size N to "
            "create it"
        )
    if kind == "text":
        data = sys.stdin.buffer.read()
    else:
        data = _read_rows(sys.stdin, width, alphabet_size, args.stream)
    with fkvstore.open(args.file, "a") as ar:
        if args.stream not in ar:
            if kind == "text":
                ar.create_text_stream(args.stream)
            else:
                ar.create_stream(args.stream, alphabet_size, width=width, geometry=geometry)
        s = ar[args.stream]
        before = len(s)
        step = 1 << 20  # rows per extend: the bar moves on large inputs
        with progress_bar(len(data), "append", len(data) > step, unit="row") as bar:
            for a in range(0, len(data), step):
                s.extend(data[a:a + step])
                bar.update(min(step, len(data) - a))
        print(
            f"appended {len(s) - before} row(s) to {args.stream!r}; now {len(s)}", file=sys.stderr
        )
    return 0


def _query(args, s):
    """The search query: bytes for a text stream (``--hex``, or the argument's own bytes, so
    a query that is not UTF-8 still searches), else a list of ints."""
    if args.hex:
        if s.kind != "text":
            raise CliError("--hex gives raw bytes; it applies to text streams only")
        try:
            return bytes.fromhex(args.query)
        except ValueError:
            raise CliError(f"--hex query {args.query!r} is not hexadecimal byte pairs "
                           "(e.g. 'e2 80 9c')") from None
    if s.kind == "text":
        return os.fsencode(args.query)  # undecodable argument bytes come back unchanged
    try:
        return [int(v) for v in args.query.replace(",", " ").split()]
    except ValueError:
        raise CliError(
            f"the query of a symbol stream is integers separated by spaces or commas, "
            f"got {args.query!r}"
        ) from None


def cmd_search(args) -> int:
    with fkvstore.open(args.file) as ar:
        s = _stream(ar, args.file, args.stream)
        query = _query(args, s)
        if not len(query):
            raise CliError("empty query; give at least one symbol")
        if not args.column < s.width:
            raise CliError(
                f"--column {args.column}: stream {args.stream!r} has width {s.width} "
                f"(columns 0..{s.width - 1})"
            )
        s.trust_index = args.trust_index
        started = time.perf_counter()
        hits = s.search(query, column=args.column)
        took = time.perf_counter() - started
        shown = hits[: args.limit].tolist()
        print(f"{len(hits)} hit(s) of {args.query!r} in {args.stream!r} ({len(s):,} rows), "
              f"{len(shown)} shown", file=sys.stderr)
        if took > 1.0 and not args.trust_index:
            if s.has_saved_index(args.column):
                hint = "the file's stored index is used with --trust-index"
            else:
                hint = (f"'fkv index {args.file} {args.stream}' keeps it in the file, "
                        "--trust-index uses it")
            print(f"(the index took {took:.1f} s to build; {hint})", file=sys.stderr)
        label = query.decode("utf-8", "replace") if isinstance(query, bytes) else args.query
        for p in shown:
            start = p - len(query) + 1
            if s.kind == "text":
                before = s.bytes(max(0, start - args.context), start)
                after = s.bytes(p + 1, min(len(s), p + 1 + args.context))
                line = (before.decode("utf-8", "replace") + "[" + label + "]"
                        + after.decode("utf-8", "replace"))
                print(f"{start}:{p + 1}\t{line.replace(chr(10), ' ')}")
            else:
                ctx = s.context(p, len(query) - 1 + args.context, args.context,
                                column=args.column)
                print(f"{start}:{p + 1}\t{' '.join(str(v) for v in ctx.tolist())}")
        if len(hits) > len(shown):
            print(f"... {len(hits) - len(shown)} more (--limit)", file=sys.stderr)
    return 0


def cmd_index(args) -> int:
    with fkvstore.open(args.file, "r+") as ar:
        s = _stream(ar, args.file, args.stream)
        if not args.column < s.width:
            raise CliError(
                f"--column {args.column}: stream {args.stream!r} has width {s.width} "
                f"(columns 0..{s.width - 1})"
            )
        started = time.perf_counter()
        s.build_index(args.column, persist=True)
        print(f"index of {args.stream!r} column {args.column} ({len(s):,} rows) built and "
              f"stored in {args.file} in {time.perf_counter() - started:.1f} s; 'fkv search "
              "--trust-index' loads it", file=sys.stderr)
    return 0


def cmd_demo(args) -> int:
    from fkvstore import demo

    return demo.main(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fkv", description="fkvstore archives on the command line")
    p.add_argument("--version", action="version", version=f"fkv {fkvstore.__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="archive a book, compare sizes, read, append, reopen")
    d.add_argument(
        "--out", default="time_machine.h5", help="archive to write (default: %(default)s)"
    )
    d.add_argument("--text", default=None, help="UTF-8 text file (default: the bundled book)")
    d.add_argument("--quiet", action="store_true", help="no progress bars")
    i = sub.add_parser("info", help="streams, lengths, codec parameters, arrays")
    i.add_argument("file")
    v = sub.add_parser("verify", help="check every checksum and span; exit status 1 on damage")
    v.add_argument("file")
    v.add_argument("--quiet", action="store_true", help="no progress bar")
    g = sub.add_parser("get", help="print rows START:STOP (raw bytes for a text stream)")
    g.add_argument("file")
    g.add_argument("stream")
    g.add_argument(
        "range",
        help="START:STOP, START: or :STOP; negative values count from the end (put -- before "
        "a range that starts with '-')",
    )
    a = sub.add_parser("append", help="append rows from standard input (same formats as get)")
    a.add_argument("file")
    a.add_argument("stream")
    a.add_argument("--text", action="store_true", help="create a text stream if missing")
    a.add_argument("--alphabet-size", type=int, help="create a symbol stream if missing")
    a.add_argument("--width", type=int, help="with --alphabet-size (default 1)")
    a.add_argument("--geometry", choices=["grid", "ring"],
                   help="with --alphabet-size (default grid)")
    f = sub.add_parser("search", help="exact substring search, hits printed with context")
    f.add_argument("file")
    f.add_argument("stream")
    f.add_argument("query", help="text (text stream) or integers separated by spaces/commas")
    f.add_argument("--hex", action="store_true",
                   help="QUERY is hexadecimal bytes (a text stream's raw bytes)")
    f.add_argument("--column", type=_non_negative, default=0,
                   help="column of a wide stream (default 0)")
    f.add_argument("--context", type=_non_negative, default=30,
                   help="rows shown on each side (default 30)")
    f.add_argument("--limit", type=_non_negative, default=20,
                   help="hits printed at most (default 20)")
    f.add_argument("--trust-index", action="store_true",
                   help="load the index stored by 'fkv index' instead of building it (only "
                        "for files you wrote yourself: docs/search.md)")
    x = sub.add_parser("index", help="build a stream's search index and keep it in the file")
    x.add_argument("file")
    x.add_argument("stream")
    x.add_argument("--column", type=_non_negative, default=0,
                   help="column of a wide stream (default 0)")
    return p


COMMANDS = {
    "demo": cmd_demo,
    "info": cmd_info,
    "verify": cmd_verify,
    "get": cmd_get,
    "append": cmd_append,
    "search": cmd_search,
    "index": cmd_index,
}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except BrokenPipeError:
        return 0
    except (CliError, FkvError, ValueError, TypeError, OverflowError, KeyError, OSError) as exc:
        # user errors (bad input, a missing or damaged file): one line, no traceback
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        print(f"fkv: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
