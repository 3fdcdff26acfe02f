"""The ``fkv`` command, run in-process through ``fkvstore.cli.main`` and once as a subprocess."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import fkvstore
from fkvstore import cli, demo


@pytest.fixture
def archive(tmp_path):
    path = tmp_path / "a.h5"
    with fkvstore.open(path, "w") as ar:
        ar.create_stream("kv", 50, width=3).extend(np.arange(60).reshape(20, 3) % 50)
        ar.create_text_stream("t").extend("héllo wörld")
        ar.put_array("codebook", np.ones(4))
    return path


def run(argv, stdin: bytes = b"", monkeypatch=None):
    out = io.BytesIO()
    wrapper = io.TextIOWrapper(out, encoding="utf-8", write_through=True)
    monkeypatch.setattr(sys, "stdout", wrapper)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin), encoding="utf-8"))
    code = cli.main(argv)
    wrapper.flush()
    return code, out.getvalue()


def test_info(archive, monkeypatch):
    code, out = run(["info", str(archive)], monkeypatch=monkeypatch)
    text = out.decode()
    assert code == 0
    assert "stream 'kv': symbols, 20 rows x width 3, alphabet 50, grid" in text
    assert "stream 't': text, 13 rows" in text and "array 'codebook'" in text


def test_get(archive, monkeypatch):
    code, out = run(["get", str(archive), "kv", "2:4"], monkeypatch=monkeypatch)
    assert code == 0 and out.decode().split("\n")[:2] == ["6 7 8", "9 10 11"]
    code, out = run(["get", str(archive), "t", "1:3"], monkeypatch=monkeypatch)
    assert out == "é".encode()
    code, out = run(["get", str(archive), "kv", "--", "-1:"], monkeypatch=monkeypatch)
    assert out.decode().strip() == "7 8 9"
    assert run(["get", str(archive), "kv", "a:b"], monkeypatch=monkeypatch)[0] == 2


def test_append_and_round_trip(archive, monkeypatch):
    code, _ = run(["append", str(archive), "kv"], b"1 2 3\n\n4 5 6\n", monkeypatch)
    assert code == 0
    code, _ = run(["append", str(archive), "t"], " ∞".encode(), monkeypatch)
    code, _ = run(["append", str(archive), "new", "--alphabet-size", "9"], b"8\n0\n", monkeypatch)
    with fkvstore.open(archive) as ar:
        assert ar["kv"][-2:].tolist() == [[1, 2, 3], [4, 5, 6]]
        assert ar["t"].text() == "héllo wörld ∞"
        assert ar["new"][:, 0].tolist() == [8, 0]
    code, out = run(["get", str(archive), "kv", ":"], monkeypatch=monkeypatch)
    rows = np.loadtxt(io.StringIO(out.decode()), dtype=np.int64)
    with fkvstore.open(archive) as ar:
        np.testing.assert_array_equal(rows, ar["kv"][:])


def fails(argv, match, monkeypatch, capsys, stdin: bytes = b""):
    """The command exits with status 2 and a one-line ``fkv: ...`` message, no traceback."""
    capsys.readouterr()
    code, out = run(argv, stdin, monkeypatch)
    err = capsys.readouterr().err
    assert code == 2 and out == b"", (code, out, err)
    assert err.startswith("fkv: ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert re.search(match, err), err


def test_append_errors(archive, monkeypatch, capsys):
    fails(["append", str(archive), "kv"], "line 2: symbol 99 is outside 0..49.*nothing appended",
          monkeypatch, capsys, b"1 2 3\n1 2 99\n")
    fails(["append", str(archive), "kv"], "line 1: 2 value", monkeypatch, capsys, b"1 2\n")
    fails(["append", str(archive), "kv"], "not integers", monkeypatch, capsys, b"1 x 3\n")
    fails(["append", str(archive), "kv"], f"symbol {10**24} is outside", monkeypatch, capsys,
          f"1 2 {10**24}\n".encode())
    fails(["append", str(archive), "nope"], "--alphabet-size", monkeypatch, capsys, b"1\n")
    with fkvstore.open(archive) as ar:
        assert len(ar["kv"]) == 20 and "nope" not in ar  # nothing appended or created


def test_append_to_a_url_says_remote_archives_are_read_only(archive, monkeypatch, capsys):
    fails(["append", "s3://bucket/run.h5", "kv"], "is a URL: remote archives are read-only",
          monkeypatch, capsys, b"1 2 3\n")
    # a file:// URL is the local file
    assert run(["append", "file://" + str(archive), "kv"], b"1 2 3\n", monkeypatch)[0] == 0
    with fkvstore.open(archive) as ar:
        assert len(ar["kv"]) == 21


def test_append_bad_input_creates_nothing(tmp_path, monkeypatch, capsys):
    new = tmp_path / "new.h5"
    fails(["append", str(new), "s", "--alphabet-size", "10"], "line 1: not integers",
          monkeypatch, capsys, b"x\n")
    fails(["append", str(new), "s", "--alphabet-size", "1"], "alphabet_size must be >= 2",
          monkeypatch, capsys, b"0\n")
    fails(["append", str(new), "s"], "no stream 's'", monkeypatch, capsys, b"0\n")
    assert not new.exists()
    assert run(["append", str(new), "s", "--alphabet-size", "10"], b"3\n", monkeypatch)[0] == 0
    fails(["append", str(new), "w", "--alphabet-size", "10", "--width", "2"], "symbol 10",
          monkeypatch, capsys, b"1 2\n1 10\n")
    with fkvstore.open(new) as ar:
        assert list(ar) == ["s"] and ar["s"][:, 0].tolist() == [3]


def test_errors_exit_2_with_a_message(archive, monkeypatch, capsys):
    a = str(archive)
    fails(["get", a, "kv", "a:b"], "bad range 'a:b'", monkeypatch, capsys)
    fails(["get", a, "kv", "100"], "row 100 is outside stream 'kv', which has 20 row", monkeypatch,
          capsys)
    fails(["get", a, "kv", "-21"], "row -21 is outside", monkeypatch, capsys)
    fails(["get", a, "t", "13"], "row 13 is outside stream 't'", monkeypatch, capsys)
    fails(["get", a, "nope", "1"], "no stream 'nope'", monkeypatch, capsys)
    fails(["search", a, "t", ""], "empty query", monkeypatch, capsys)
    fails(["search", a, "kv", ""], "empty query", monkeypatch, capsys)
    fails(["search", a, "kv", "1", "--column", "3"], "--column 3: stream 'kv' has width 3",
          monkeypatch, capsys)
    fails(["search", a, "kv", "1,50"], "got 50", monkeypatch, capsys)
    fails(["search", a, "kv", f"1 {10**24}"], f"got {10**24}", monkeypatch, capsys)
    fails(["search", a, "kv", "x"], "integers separated", monkeypatch, capsys)
    fails(["info", str(archive.parent / "missing.h5")], "missing.h5", monkeypatch, capsys)
    code, out = run(["get", a, "kv", "19"], monkeypatch=monkeypatch)
    assert code == 0 and out.decode() == "7 8 9\n"


def test_verify_ok_and_missing_file(archive, tmp_path, monkeypatch):
    code, out = run(["verify", "--quiet", str(archive)], monkeypatch=monkeypatch)
    assert code == 0 and "kv: ok" in out.decode() and "arrays/codebook: ok" in out.decode()
    code, _ = run(["info", str(tmp_path / "missing.h5")], monkeypatch=monkeypatch)
    assert code == 2


def test_demo_runs_end_to_end(tmp_path, capsys):
    assert demo.main(["--out", str(tmp_path / "tm.h5"), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "all correct" in out and "identical to the text: True" in out
    assert "zlib level 9" in out and "bit-packing" in out
    book = demo.load_book()
    assert book.startswith(b"The Time Machine") and b"*** START" not in book
    with fkvstore.open(tmp_path / "tm.h5") as ar:
        assert ar["book"].bytes(0, len(book)) == book


def test_demo_short_and_empty_texts(tmp_path, capsys):
    for text in ["a short text about Weena.", "x"]:  # shorter than the 120-byte sample window
        src = tmp_path / "small.txt"
        src.write_text(text)
        assert demo.main(["--out", str(tmp_path / "s.h5"), "--quiet", "--text", str(src)]) == 0
        out = capsys.readouterr().out
        assert "all correct" in out and f"bytes 0..{len(text)}: {text!r}" in out
        assert "identical to the text: True" in out and str(src) in out
    src.write_text("  \n")
    assert cli.main(["demo", "--out", str(tmp_path / "e.h5"), "--quiet", "--text", str(src)]) == 2
    assert "no text to archive" in capsys.readouterr().err


def test_console_script_entry(tmp_path, archive):
    env = dict(os.environ)
    env["PYTHONPATH"] = str(Path(__file__).parents[2]) + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run(
        [sys.executable, "-m", "fkvstore.cli", "get", str(archive), "t", ":"],
        capture_output=True,
        env=env,
    )
    assert res.returncode == 0 and res.stdout == "héllo wörld".encode()
    res = subprocess.run(
        [sys.executable, "-m", "fkvstore.cli", "search", str(archive), "t", ""],
        capture_output=True,
        env=env,
    )
    assert res.returncode == 2 and res.stderr == b"fkv: empty query; give at least one symbol\n"


def test_search_command_prints_hits_with_context(tmp_path, capsys):
    from fkvstore.cli import main

    path = tmp_path / "s.h5"
    with fkvstore.open(path, "w") as ar:
        ar.create_text_stream("t").extend("one fish two fish red fish")
        ar.create_stream("n", alphabet_size=10).extend([1, 2, 3, 1, 2, 9])
    assert main(["search", str(path), "t", "fish", "--context", "4"]) == 0
    out = capsys.readouterr()
    assert out.out.splitlines() == ["4:8\tone [fish] two", "13:17\ttwo [fish] red",
                                    "22:26\tred [fish]"]
    assert "3 hit(s)" in out.err
    assert main(["search", str(path), "n", "1,2", "--context", "1"]) == 0
    assert capsys.readouterr().out.splitlines() == ["0:2\t1 2 3", "3:5\t3 1 2 9"]
    assert main(["search", str(path), "n", "x"]) == 2
    assert "integers separated" in capsys.readouterr().err


def test_version(capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"fkv {fkvstore.__version__}"


@pytest.mark.parametrize("flag", ["--limit", "--context", "--column"])
def test_search_refuses_negative_counts(archive, monkeypatch, capsys, flag):
    with pytest.raises(SystemExit) as done:
        run(["search", str(archive), "t", "l", flag, "-1"], monkeypatch=monkeypatch)
    assert done.value.code == 2
    assert f"argument {flag}: -1 is negative" in capsys.readouterr().err


def test_search_limit_counts_what_it_shows(archive, monkeypatch, capsys):
    code, out = run(["search", str(archive), "t", "l", "--limit", "1"], monkeypatch=monkeypatch)
    err = capsys.readouterr().err
    assert code == 0 and len(out.decode().splitlines()) == 1
    assert "3 hit(s)" in err and "1 shown" in err and "... 2 more" in err
    code, out = run(["search", str(archive), "t", "l", "--limit", "0"], monkeypatch=monkeypatch)
    assert code == 0 and out == b"" and "0 shown" in capsys.readouterr().err


@pytest.mark.parametrize("flags", [["--text"], ["--alphabet-size", "50"], ["--width", "3"],
                                   ["--geometry", "ring"]])
def test_append_refuses_creation_flags_on_an_existing_stream(archive, monkeypatch, capsys,
                                                             flags):
    before = fkvstore.open(archive)["kv"].read()
    code, _ = run(["append", str(archive), "kv", *flags], b"1 2 3\n", monkeypatch)
    assert code == 2
    err = capsys.readouterr().err
    assert "already exists" in err and flags[0] in err and "nothing appended" in err
    with fkvstore.open(archive) as ar:
        assert np.array_equal(ar["kv"].read(), before)


def test_text_search_takes_raw_bytes(archive, monkeypatch, capsys):
    # "ö" is c3 b6 in UTF-8: --hex and an argument that is not valid UTF-8 both search bytes
    code, out = run(["search", str(archive), "t", "--hex", "c3b6"], monkeypatch=monkeypatch)
    assert code == 0 and "1 hit(s)" in capsys.readouterr().err
    undecodable = os.fsdecode(b"\xb6r")  # half a character, then "r"
    code, out = run(["search", str(archive), "t", undecodable], monkeypatch=monkeypatch)
    assert code == 0 and "1 hit(s)" in capsys.readouterr().err
    code, _ = run(["search", str(archive), "t", "--hex", "zz"], monkeypatch=monkeypatch)
    assert code == 2 and "not hexadecimal" in capsys.readouterr().err
    code, _ = run(["search", str(archive), "kv", "--hex", "01"], monkeypatch=monkeypatch)
    assert code == 2 and "text streams only" in capsys.readouterr().err


def test_missing_stream_hint_names_a_command(archive, monkeypatch, capsys):
    code, _ = run(["get", str(archive), "nope", "0:1"], monkeypatch=monkeypatch)
    err = capsys.readouterr().err
    assert code == 2 and f"fkv append {archive} nope --text" in err and "()" not in err


def test_index_is_kept_between_calls(archive, monkeypatch, capsys):
    with fkvstore.open(archive) as ar:
        assert not ar["t"].has_saved_index()
    code, _ = run(["index", str(archive), "t"], monkeypatch=monkeypatch)
    assert code == 0 and "built and stored" in capsys.readouterr().err
    with fkvstore.open(archive) as ar:
        assert ar["t"].has_saved_index()
        assert ar["t"].search("l").tolist() == [3, 4, 11]
    code, _ = run(["index", str(archive), "kv", "--column", "3"], monkeypatch=monkeypatch)
    assert code == 2 and "has width 3" in capsys.readouterr().err


def test_search_loads_the_stored_index_only_with_trust_index(archive, monkeypatch, capsys):
    from fkvstore import stream_search

    assert run(["index", str(archive), "t"], monkeypatch=monkeypatch)[0] == 0
    assert "'fkv search --trust-index' loads it" in capsys.readouterr().err
    real, used = stream_search.SuffixIndex, []

    class Spy:
        @staticmethod
        def build(*args, **kwargs):
            used.append("built")
            return real.build(*args, **kwargs)

        @staticmethod
        def from_state(*args, **kwargs):
            used.append("loaded")
            return real.from_state(*args, **kwargs)

    monkeypatch.setattr(stream_search, "SuffixIndex", Spy)
    for flags, want in (([], "built"), (["--trust-index"], "loaded")):
        used.clear()
        code, out = run(["search", str(archive), "t", "l", *flags], monkeypatch=monkeypatch)
        assert code == 0 and used == [want]
        assert [line.split(b"\t")[0] for line in out.splitlines()] == [b"3:4", b"4:5", b"11:12"]
