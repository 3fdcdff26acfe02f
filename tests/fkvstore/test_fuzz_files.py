"""Single-bit flips and truncations over a real archive (tests/support/fuzz_files.py): no crash,
no hang, no value silently wrong, every error an FkvError. The default run flips 150 bits and
cuts 30 lengths; ``FKV_DEEP=1`` flips 600 and cuts at every 4 KiB boundary."""

from __future__ import annotations

import os

import fuzz_files
import pytest

DEEP = os.environ.get("FKV_DEEP") == "1"


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    flips, truncations = ((600, -1) if DEEP else
                          (fuzz_files.DEFAULT_FLIPS, fuzz_files.DEFAULT_TRUNCATIONS))
    return fuzz_files.run(tmp_path_factory.mktemp("fuzz"), flips, truncations)


def _with(results, prefix):
    return [r for r in results if r["outcome"].startswith(prefix)]


def test_no_case_crashes_or_hangs(results):
    assert not _with(results, "crash") and not _with(results, "hang")


def test_every_error_is_an_fkv_error(results):
    assert not _with(results, "raw:")


def test_no_value_is_silently_wrong(results):
    # symbols, text, arrays, user attributes and search hits: equal to the original, or raised
    assert not _with(results, "wrong")


def test_the_cases_reach_every_structure(results):
    kinds = {fuzz_files.kind_of(r["where"]) for r in results if "flip" in r}
    assert {"superblock", "object header (group)", "object header (dataset)",
            "raw data: points", "raw data: tail", "raw data: block_crc",
            "raw data: aux arrays", "raw data: a", "string attribute model",
            "string fkv_codec"} <= kinds
    assert sum("truncate" in r for r in results) >= 30
    assert len(results) >= (600 if DEEP else fuzz_files.DEFAULT_FLIPS)
    # and the damage is noticed: most flips of stored data raise or are reported by verify
    assert len(_with(results, "ChecksumError")) + len(_with(results, "ArchiveFormatError")) > 20


def test_the_undamaged_archive_reads_back(tmp_path):
    path = tmp_path / "a.h5"
    fuzz_files.build(path)
    assert fuzz_files.check(str(path), fuzz_files.expected()) == "ok"


def test_a_worker_that_does_not_answer_in_time_is_a_hang(tmp_path):
    path = tmp_path / "a.h5"
    fuzz_files.build(path)
    worker = fuzz_files._Worker()  # noqa: SLF001 - the watchdog itself is under test
    assert worker.ask(str(path), timeout=0.0) == "hang"  # a fresh worker is still importing
    assert worker.proc.poll() is not None  # and was killed
