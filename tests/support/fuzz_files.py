"""Bit flips and truncations over a real archive, each case read in a watched worker process.

:func:`build` writes a small archive of every kind of content (a width-3 symbol stream over
several chunks, a text stream with a persisted search index, an array, user attributes);
:func:`regions` labels its bytes by the HDF5 structure they belong to (superblock, each object's
header, each dataset's raw data, other metadata: B-trees, heaps, free space); :func:`cases`
chooses flips stratified over those regions (every region is hit, then the rest spread over the
file) and truncations; :func:`run` hands each damaged copy to a pool of worker processes
(:func:`worker_main`) that open, read, search, verify and append, with a timeout per case, and
classifies the outcome of each:

- ``ok``: every value read equals the original and a writer appends (the damaged bytes were
  never read, or were redundant); ``ok, verify reports damage``: the same, and ``verify()``
  lists the damage (a derived aux array is rebuilt, not trusted);
- an error class name (``ChecksumError``, ...): the first error raised, an ``FkvError``;
- ``raw:<class>``: an error that is not an ``FkvError``;
- ``wrong:<what>``: a value read back differs from the original and nothing was raised;
- ``crash:<signal>`` (the worker died) and ``hang`` (no answer within the timeout).

Run as a script for the coverage table: ``python tests/support/fuzz_files.py [--deep]``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROWS = np.random.default_rng(5).integers(0, 200, (400, 3))
TEXT = b"the time traveller returned to the time machine at dawn. " * 40
ARRAY = np.arange(64, dtype="<i8") * 3
ATTRS = {"model": "stand-in", "layers": 12}
QUERY = b"time"
TIMEOUT_S = 20.0  # per case, generous for a loaded 2-core machine: a hang was minutes


def build(path: Path) -> None:
    """The archive every case damages: about 40 KB."""
    import fkvstore

    with fkvstore.open(path, "w") as ar:
        ar.create_stream("s", 200, width=3, chunk_bytes=1024).extend(ROWS)
        t = ar.create_text_stream("t", chunk_bytes=1024)
        t.extend(TEXT)
        t.build_index(persist=True)
        ar.put_array("a", ARRAY)
        for k, v in ATTRS.items():
            ar.attrs[k] = v


def expected() -> dict:
    """What a reader of the undamaged archive sees (JSON-able)."""
    hits = [i + len(QUERY) - 1 for i in range(len(TEXT)) if TEXT.startswith(QUERY, i)]
    return {"s": ROWS.tolist(), "t": TEXT.decode(), "a": ARRAY.tolist(), "attrs": ATTRS,
            "search": hits}


def regions(path: Path) -> list[tuple[int, int, str]]:
    """``(start, stop, label)`` byte ranges of ``path``: the superblock, object headers
    (``header:<object>``) and raw data (``data:<dataset>``); the rest is ``other metadata``."""
    import h5py

    found = [(0, 48, "superblock")]
    with h5py.File(path, "r", locking=False) as f:
        def visit(name, obj):
            info = h5py.h5o.get_info(obj.id)
            found.append((info.addr, info.addr + info.hdr.space.total, f"header:/{name}"))
            if isinstance(obj, h5py.Dataset):
                dsid = obj.id
                if obj.chunks is None:
                    off = dsid.get_offset()
                    if off is not None:
                        found.append((off, off + dsid.get_storage_size(), f"data:/{name}"))
                else:
                    for i in range(dsid.get_num_chunks()):
                        c = dsid.get_chunk_info(i)
                        found.append((c.byte_offset, c.byte_offset + c.size, f"data:/{name}"))

        root = h5py.h5o.get_info(f.id)
        found.append((root.addr, root.addr + root.hdr.space.total, "header:/"))
        f.visititems(visit)
        strings = {f"value:attribute {k}": v for k, v in ATTRS.items() if isinstance(v, str)}
        strings.update({f"value:fkv_codec of {n}": f[f"streams/{n}"].attrs["fkv_codec"]
                        for n in ("s", "t")})
    # variable-length strings live in the global heap: found by their bytes
    data = path.read_bytes()
    for label, text in strings.items():
        at = data.find(text.encode())
        if at >= 0:
            found.append((at, at + len(text), label))
    return sorted(found, key=lambda r: (r[0], -r[1]))


def label_of(offset: int, spans: list[tuple[int, int, str]]) -> str:
    inside = [(stop - start, label) for start, stop, label in spans if start <= offset < stop]
    return min(inside)[1] if inside else "other metadata"  # the innermost


def kind_of(label: str) -> str:
    """The coverage table's row: the structure type, without the object's name."""
    if label.startswith("header:/streams/") and label.count("/") > 3:
        return "object header (dataset)"
    if label.startswith("header:"):
        return "object header (group)" if label.count("/") <= 3 else "object header (dataset)"
    if label.startswith("value:"):
        return "string " + label.split(":", 1)[1].split(" of ")[0]
    if label.startswith("data:"):
        name = label.split("/")[-1]
        return "raw data: " + ("aux arrays" if "/aux/" in label else name)
    return label


def cases(path: Path, flips: int, truncations: int, seed: int = 0) -> list[dict]:
    """Deterministic cases: one flip in every labelled region first (four in each string
    value), then
    flips spread evenly over the whole file (random bit, offset jittered), then truncations:
    ``truncations`` lengths evenly spread, or every 4 KiB boundary when ``truncations`` < 0."""
    size = path.stat().st_size
    rng = np.random.default_rng(seed)
    spans = regions(path)
    offsets = [start + int(rng.integers(0, max(1, stop - start))) for start, stop, label in spans
               for _ in range(4 if label.startswith("value:") else 1) if start < size]
    rest = max(0, flips - len(offsets))
    grid = np.linspace(0, size, rest, endpoint=False)
    offsets += [min(size - 1, int(g + rng.integers(0, max(1, size // max(rest, 1)))))
                for g in grid]
    out = [{"flip": o, "bit": int(rng.integers(0, 8)), "where": label_of(o, spans)}
           for o in offsets[:max(flips, len(spans))]]
    lengths = (list(range(0, size, 4096)) if truncations < 0 else
               sorted({int(x) for x in np.linspace(0, size, truncations, endpoint=False)}))
    out += [{"truncate": n, "where": f"truncated to {n} B"} for n in lengths]
    return out


def damage(src: Path, dst: Path, case: dict) -> None:
    data = bytearray(src.read_bytes())
    if "flip" in case:
        data[case["flip"]] ^= 1 << case["bit"]
    else:
        del data[case["truncate"]:]
    dst.write_bytes(bytes(data))


# -- the worker --------------------------------------------------------------------------------
def check(path: str, want: dict) -> str:
    """Open, read everything, search, verify, then append as a writer: the outcome string."""
    import fkvstore
    from fkvstore.errors import FkvError

    try:
        with fkvstore.open(path) as ar:
            got = {"s": ar["s"][:].tolist(), "t": ar["t"].bytes().decode("utf-8", "replace"),
                   "a": ar.get_array("a").tolist(),
                   "attrs": {k: _plain(ar.attrs[k]) for k in ar.attrs}}
            got["search"] = ar["t"].search(QUERY).tolist()
            report = ar.verify()
        wrong = [k for k in want if got[k] != want[k]]
        if wrong:
            return "wrong:" + ",".join(wrong)
        with fkvstore.open(path, "a") as ar:  # a writer on the same file
            ar["s"].append([1, 2, 3])
        with fkvstore.open(path) as ar:
            if ar["s"][:-1].tolist() != want["s"] or ar["s"][-1].tolist() != [1, 2, 3]:
                return "wrong:after append"
        return "ok, verify reports damage" if any(report.values()) else "ok"
    except FkvError as exc:
        return type(exc).__name__
    except Exception as exc:  # noqa: BLE001 - the point is to name it
        return f"raw:{type(exc).__name__}: {str(exc)[:200]}"


def _plain(value):
    return value.item() if isinstance(value, np.generic) else value


def worker_main() -> None:
    """Read paths from stdin, one per line; write one JSON outcome line per path."""
    want = expected()
    for line in sys.stdin:
        outcome = check(line.strip(), want)
        sys.stdout.write(json.dumps(outcome) + "\n")
        sys.stdout.flush()


class _Worker:
    def __init__(self):
        code = "import fuzz_files; fuzz_files.worker_main()"
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [str(Path(__file__).parent), str(Path(__file__).parents[2]),
             os.environ.get("PYTHONPATH", "")]))
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True, env=env)

    def ask(self, path: str, timeout: float) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(path + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            self.kill()
            return "hang"
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            return f"crash:{signal.Signals(-code).name}" if code < 0 else f"crash:exit {code}"
        return json.loads(line)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            self.proc.wait()


def run(workdir: Path, flips: int, truncations: int, timeout: float = TIMEOUT_S,
        first_timeout: float = 300.0) -> list[dict]:
    """Every case of :func:`cases` over a fresh archive in ``workdir``: the cases with their
    ``outcome``. One worker process; a crashed or hung one is replaced. ``first_timeout``
    covers a fresh worker's imports and kernel compilation."""
    src = workdir / "original.h5"
    build(src)
    out = []
    worker, fresh = _Worker(), True
    try:
        for i, case in enumerate(cases(src, flips, truncations)):
            path = workdir / f"case-{i}.h5"
            damage(src, path, case)
            started = time.perf_counter()
            outcome = worker.ask(str(path), first_timeout if fresh else timeout)
            seconds = time.perf_counter() - started
            fresh = False
            if outcome == "hang" or outcome.startswith("crash:"):
                worker, fresh = _Worker(), True
            out.append(dict(case, outcome=outcome, seconds=round(seconds, 4)))
            path.unlink()
            for leftover in workdir.glob(f"case-{i}.h5*"):  # the writer's lock file
                leftover.unlink()
    finally:
        worker.close()
    return out


def table(results: list[dict]) -> str:
    """Markdown: rows are structure types (and truncations), columns the outcomes, with counts
    (``raw:`` and ``wrong:`` outcomes by class or value only)."""
    rows: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for r in results:
        kind = "truncation" if "truncate" in r else kind_of(r["where"])
        rows[kind][":".join(r["outcome"].split(":")[:2])] += 1
    columns = sorted({c for counter in rows.values() for c in counter},
                     key=lambda c: (not c.startswith("ok"), c))
    lines = ["| bytes hit | cases | " + " | ".join(columns) + " |",
             "|---|---|" + "---|" * len(columns)]
    for kind in sorted(rows):
        counter = rows[kind]
        lines.append(f"| {kind} | {sum(counter.values())} | "
                     + " | ".join(str(counter.get(c, "")) for c in columns) + " |")
    lines.append(f"| **all** | {len(results)} | " + " | ".join(
        str(sum(counter.get(c, 0) for counter in rows.values())) for c in columns) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--deep", action="store_true",
                        help="600 flips and a truncation at every 4 KiB boundary")
    parser.add_argument("--json", help="write every case and outcome here")
    args = parser.parse_args()
    flips, truncations = (600, -1) if args.deep else (DEFAULT_FLIPS, DEFAULT_TRUNCATIONS)
    work = Path(tempfile.mkdtemp(prefix="fkv-fuzz-"))
    started = time.perf_counter()
    try:
        results = run(work, flips, truncations)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(table(results))
    slowest = max(r["seconds"] for r in results[1:])  # the first case includes the imports
    print(f"\n{len(results)} cases in {time.perf_counter() - started:.0f} s; the slowest "
          f"(after the first) answered in {slowest:.2f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


DEFAULT_FLIPS = 150
DEFAULT_TRUNCATIONS = 30

if __name__ == "__main__":
    main()
