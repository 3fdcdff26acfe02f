"""Reading an archive with plain h5py, numpy and zlib, following docs/format.md only.

An independent reader (no fkvstore import): it proves the format page is complete, and it is
the oracle the archive's fast read paths are tested against.
"""

from __future__ import annotations

import io
import json
import struct
import zlib

import h5py
import numpy as np

from naive import decode


def read_stream_with_h5py(path, name: str) -> np.ndarray:
    """Every committed row of stream ``name``: int64 (length, width). Raises ValueError on a
    checksum mismatch."""
    image = rolled_back_image(path)
    source = path if image is None else io.BytesIO(image)
    with h5py.File(source, "r", swmr=image is None, locking=False) as f:
        assert f.attrs["fkv_format"] == "fkvstore" and f.attrs["fkv_format_version"] in (1, 2)
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


def rolled_back_image(path) -> bytes | None:
    """The archive's bytes with its journal applied (docs/format.md, "Version 2"), or None when
    there is no valid, incomplete journal to apply."""
    try:
        with open(f"{path}-journal", "rb") as fh:
            journal = fh.read()
    except FileNotFoundError:
        return None
    if len(journal) < 64 or journal[:8] != b"fkvjrnl\x01":
        return None
    magic, version, page, _nonce, old_size, new_size, n_new, n_old, body_crc, head_crc = (
        struct.unpack_from("<8sIIQQQQQII", journal))
    body = journal[512 : 512 + 12 * n_new + (8 + page) * n_old]
    if (zlib.crc32(journal[:60]) != head_crc or version != 1 or page != 4096
            or len(body) != 12 * n_new + (8 + page) * n_old or zlib.crc32(body) != body_crc):
        return None
    with open(path, "rb") as fh:
        archive = fh.read()
    written = [struct.unpack_from("<QI", body, 12 * k) for k in range(n_new)]
    if len(archive) >= new_size and all(
            zlib.crc32(archive[i * page : min((i + 1) * page, new_size)]) == crc
            for i, crc in written):
        return None  # the sync completed
    image = bytearray(archive[:old_size].ljust(old_size, b"\0"))
    at = 12 * n_new
    for _ in range(n_old):
        (i,) = struct.unpack_from("<Q", body, at)
        old = body[at + 8 : at + 8 + page]
        image[i * page : min((i + 1) * page, old_size)] = old[: max(0, old_size - i * page)]
        at += 8 + page
    return bytes(image)
