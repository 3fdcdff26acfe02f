"""Child of tests/fkvstore/test_crash.py: appends a known sequence to an archive until killed.

Usage: python crash_writer.py ARCHIVE STATUSFILE SEED

The status file is shared memory with the parent (see ``Status``): the writer records the phase it
is in, and for every stream the rows it has asked for (``intended``) and the length at the end of
the last flush that returned (``flushed``). The parent SIGKILLs this process at a random moment
and checks the archive against that record.
"""

from __future__ import annotations

import mmap
import sys

import numpy as np

import fkvstore

PHASES = ("idle", "open", "extend", "append", "flush", "truncate")
# name -> (alphabet_size, width, geometry)
STREAMS = {"grid1": (256, 1, "grid"), "grid5": (1000, 5, "grid"), "text": (256, 1, "text")}
STATUS_BYTES = 8 + 16 * len(STREAMS)


def expected_rows(name: str, start: int, stop: int) -> np.ndarray:
    """The symbols every writer appends to stream ``name``: rows [start, stop), (n, width)."""
    alphabet, width, _ = STREAMS[name]
    i = np.arange(start, stop, dtype=np.int64)[:, None]
    j = np.arange(width, dtype=np.int64)[None, :]
    seed = sum(map(ord, name))
    return (i * 2654435761 + j * 40503 + (i >> 5) * seed + (i * j) % 7) % alphabet


class Status:
    """Layout: byte 0 phase; per stream k, uint64 intended at 8+16k and flushed at 16+16k."""

    def __init__(self, path: str):
        self._fh = open(path, "r+b")  # noqa: SIM115
        self.mem = mmap.mmap(self._fh.fileno(), STATUS_BYTES)
        self.u64 = np.frombuffer(self.mem, dtype=np.uint64, count=(STATUS_BYTES - 8) // 8, offset=8)

    def set_phase(self, phase: str) -> None:
        self.mem[0] = PHASES.index(phase)

    def phase(self) -> str:
        return PHASES[self.mem[0]]

    def intended(self, k: int) -> int:
        return int(self.u64[2 * k])

    def flushed(self, k: int) -> int:
        return int(self.u64[2 * k + 1])


def create(path: str) -> None:
    with fkvstore.open(path, "w") as ar:
        for name, (alphabet, width, geometry) in STREAMS.items():
            if geometry == "text":
                ar.create_text_stream(name, chunk_bytes=4096)
            else:
                ar.create_stream(name, alphabet, geometry=geometry, width=width, chunk_bytes=4096)


def main(path: str, status_path: str, seed: int) -> None:
    st = Status(status_path)
    rng = np.random.default_rng(seed)
    st.set_phase("open")
    # a small spill threshold makes extend and append commit now and then, as in long runs
    ar = fkvstore.open(path, "a", spill_symbols=int(rng.integers(20_000, 200_000)))
    streams = [ar[name] for name in STREAMS]
    for k, s in enumerate(streams):
        st.u64[2 * k] = len(s)
        st.u64[2 * k + 1] = len(s)
    st.set_phase("idle")
    while True:
        k = int(rng.integers(len(streams)))
        s = streams[k]
        n = len(s)
        op = 1.0 if n > 100_000 else rng.random()
        if op < 0.45:
            count = int(rng.integers(1, 40_000))
            rows = expected_rows(s.name, n, n + count)
            st.u64[2 * k] = n + count
            st.set_phase("extend")
            if s.kind == "text":
                s.extend(rows[:, 0].astype(np.uint8).tobytes())
            else:
                s.extend(rows)
        elif op < 0.6:
            count = int(rng.integers(1, 300))
            rows = expected_rows(s.name, n, n + count)
            st.u64[2 * k] = n + count
            st.set_phase("append")
            for row in rows:
                s.append(int(row[0]) if s.width == 1 else row)
        elif op < 0.9:
            st.set_phase("flush")
            ar.flush()
            st.set_phase("idle")
            for j, t in enumerate(streams):
                st.u64[2 * j + 1] = len(t)
        else:
            # rewind, sometimes below the last flush (truncate commits at once then); long
            # streams are cut back so that each check stays quick
            low = 0 if n > 60_000 or rng.random() < 0.5 else st.flushed(k)
            cut = int(rng.integers(low, n + 1))
            st.u64[2 * k + 1] = min(st.flushed(k), cut)  # lower bound whether or not it lands
            st.set_phase("truncate")
            s.truncate(cut)
            st.u64[2 * k] = cut
        st.set_phase("idle")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
