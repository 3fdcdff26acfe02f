"""Write tests/golden/v1.h5 and v2.h5, the archives every later fkvstore must read exactly.

Run once when the format version changes (``python tests/golden/make_golden.py``); the content
comes from tests/fkvstore/test_archive_integrity.py::golden_content, so the test and the file agree.
v1.h5 is written at durability "process" (format version 1), v2.h5 at durability "fsync"
(format version 2: the same content, written through the rollback journal, which a clean close
leaves empty and which is not kept).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).parent
sys.path[:0] = [str(HERE.parent / "fkvstore"), str(HERE.parent / "support")]

import fkvstore  # noqa: E402


def write(path, version: int = 1) -> None:
    from test_archive_integrity import GOLDEN_TEXT, golden_content

    durability = {1: "process", 2: "fsync"}[version]
    with fkvstore.open(path, "w", durability=durability) as ar:
        ar.attrs["purpose"] = f"golden archive, format version {version}"
        for name, (geometry, alphabet, width, data) in golden_content().items():
            s = ar.create_stream(name, alphabet, geometry=geometry, width=width, chunk_bytes=256)
            s.extend(data[: len(data) // 2])
            ar.flush()
            s.extend(data[len(data) // 2 :])
        ar.create_text_stream("text", chunk_bytes=256).extend(GOLDEN_TEXT)
        ar.put_array("codebook", np.linspace(-1, 1, 24).reshape(2, 3, 4))


    journal = Path(f"{path}-journal")
    if journal.exists():  # emptied by the clean close
        journal.unlink()


if __name__ == "__main__":
    write(HERE / "v1.h5")
    write(HERE / "v2.h5", version=2)
