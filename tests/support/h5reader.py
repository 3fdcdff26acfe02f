"""Reading an archive with plain h5py, numpy and zlib, following docs/format.md only.

An independent reader (no fkvstore import): it proves the format page is complete, and it is
the oracle the archive's fast read paths are tested against.
"""

from __future__ import annotations

import json
import zlib

import h5py
import numpy as np

from naive import decode


def read_stream_with_h5py(path, name: str) -> np.ndarray:
    """Every committed row of stream ``name``: int64 (length, width). Raises ValueError on a
    checksum mismatch."""
    with h5py.File(path, "r", swmr=True, locking=False) as f:
        assert f.attrs["fkv_format"] == "fkvstore" and f.attrs["fkv_format_version"] in (1, 2)
        # version 2: read only with no journal to apply (the docs' "Reading a version 2 file")
        assert f.attrs["fkv_format_version"] == 1 or journal_is_empty(path)
        g = f["streams"][name]
        codec = json.loads(g.attrs["fkv_codec"])
        n_alpha, geometry = codec["alphabet_size"], codec["geometry"]
        span, ratio = codec["span"], codec["ratio"]
        width, block = int(g.attrs["fkv_width"]), int(g.attrs["fkv_block_spans"])
        (length, full, slot, tail_count, partial_crc, tail_crc, _gen, _rew) = (
            int(v) for v in g["points"].attrs["fkv_commit"]
        )
        points = g["points"][:full]  # rows past `full` are not part of the archive
        crcs = g["block_crc"][: full // block]
        for b in range(0, full, block):
            chunk = points[b : b + block].astype("<f8").tobytes()
            want = crcs[b // block] if b + block <= full else partial_crc
            if zlib.crc32(chunk) != want:
                raise ValueError(f"block {b // block} of {name!r} fails its CRC-32")
        if tail_count:
            tail = g["tail"][slot]
            if zlib.crc32(tail.astype("<f8").tobytes()) != tail_crc:
                raise ValueError(f"tail of {name!r} fails its CRC-32")
            points = np.concatenate([points, tail[None]])
    out = np.empty((length, width), dtype=np.int64)
    for col in range(width):
        pts = [tuple(p) for p in points[:, col, :]]
        out[:, col] = decode(pts, length, n_alpha, geometry, span, ratio)
    return out


def journal_is_empty(path) -> bool:
    """No journal beside ``path``, or one whose header is zeroed or fails its checksum."""
    try:
        with open(f"{path}-journal", "rb") as fh:
            head = fh.read(64)
    except FileNotFoundError:
        return True
    return head[:8] != b"fkvjrnl\x01" or zlib.crc32(head[:60]) != int.from_bytes(head[60:64],
                                                                               "little")
