"""Crafted archives (made with plain h5py): values that decide a size, shape or offset that
disagree with each other, persisted KD-trees that would steer scipy into memory, and links,
virtual datasets and external storage that would read outside the file."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import zlib
from contextlib import contextmanager

import h5py
import numpy as np
import pytest

import fkvstore
import naive
from fkvstore.errors import ArchiveFormatError, ArchiveLinkError
from fkvstore.index import TREE_FORMAT, SuffixIndex
from fkvstore.index._tree_state import NODE_DTYPE, stored_trees_valid

ROWS = np.random.default_rng(3).integers(0, 200, (700, 3))
BOOK = b"the time traveller returned to the time machine " * 300


@pytest.fixture
def archive(tmp_path):
    """An archive with a width-3 stream "s" (1 KiB chunks), a text stream "t" and an array "a"."""
    path = tmp_path / "crafted.h5"
    with fkvstore.open(path, "w") as ar:
        ar.create_stream("s", 200, width=3, chunk_bytes=1024).extend(ROWS)
        ar.create_text_stream("t").extend(b"some text")
        ar.put_array("a", np.arange(10))
    return path


@contextmanager
def _edit(path):
    """The file open in h5py for a crafted change; afterwards the attribute CRC-32s of every
    group are made to match again, as a hostile writer would (they catch accidents only)."""
    with h5py.File(path, "r+", locking=False) as f:
        yield f
        groups = [f] + [f[n] for n in _group_names(f)]
        for g in groups:
            if fkvstore.layout.CONFIG_CRC_ATTR in g.attrs:
                fkvstore.layout.seal_attrs(g)


def _group_names(f):
    """Group names of ``f`` reached through hard links only (never an external file)."""
    names = []
    f.visititems_links(lambda name, link: names.append(name)
                  if isinstance(link, h5py.HardLink) and isinstance(f.get(name), h5py.Group)
                  else None)
    return names


def _open_stream(path, name="s"):
    with fkvstore.open(path) as ar:
        return ar[name][:5]


def _recreate(g, name, **kwargs):
    """Replace dataset ``name`` of ``g`` by one made with ``kwargs``, keeping its attributes."""
    attrs = dict(g[name].attrs)
    del g[name]
    ds = g.create_dataset(name, **kwargs)
    for k, v in attrs.items():
        ds.attrs[k] = v


def _set_commit(g, **fields):
    record = g["points"].attrs["fkv_commit"].copy()
    for name, value in fields.items():
        record[fkvstore.layout.COMMIT_FIELDS.index(name)] = value
    g["points"].attrs.modify("fkv_commit", record)


def _codec(g, **changes):
    g.attrs["fkv_codec"] = json.dumps(dict(json.loads(g.attrs["fkv_codec"]), **changes))


# -- 1. values that decide sizes ----------------------------------------------------------------
CRAFTED = {
    # the decoder lays out chunk bytes by fkv_width: smaller writes past its row buffer, larger
    # hands back memory nobody wrote
    "narrower": (lambda g: g.attrs.modify("fkv_width", 2), "fkv_width=2 disagrees"),
    "wider": (lambda g: g.attrs.modify("fkv_width", 5), "fkv_width=5 disagrees"),
    "block spans": (lambda g: g.attrs.modify("fkv_block_spans", 64), "fkv_block_spans=64"),
    "block spans not a power of two": (lambda g: g.attrs.modify("fkv_block_spans", 3),
                                       "fkv_block_spans=3 is not a power of two"),
    "float32 points": (lambda g: _recreate(g, "points", shape=(30, 3, 2), maxshape=(None, 3, 2),
                                           chunks=(16, 3, 2), dtype="<f4"), "float32"),
    "compressed points": (lambda g: _recreate(g, "points", data=g["points"][()],
                                              maxshape=(None, 3, 2), chunks=(16, 3, 2),
                                              compression="gzip"), "no filters"),
    "tail shape": (lambda g: _recreate(g, "tail", shape=(2, 2, 2), chunks=(1, 2, 2),
                                       dtype="<f8"), "tail of shape"),
    "block_crc dtype": (lambda g: _recreate(g, "block_crc", data=np.zeros(3, "<f8")),
                        "block_crc"),
    "span beyond the alphabet's": (lambda g: _codec(g, span=40), "fkv_codec="),
    "unknown geometry": (lambda g: _codec(g, geometry="hexagon"), "fkv_codec="),
    "unknown kind": (lambda g: g.attrs.modify("fkv_kind", "pictures"), "fkv_kind='pictures'"),
    "tail slot": (lambda g: _set_commit(g, tail_slot=5), "tail_slot=5"),
    "length": (lambda g: _set_commit(g, length=1 << 62), r"length=4611686018427387904 is beyond"),
    "full spans": (lambda g: _set_commit(g, length=13 * 10_000, full_spans=10_000, tail_count=0),
                   "full_spans=10000 exceeds"),
    "float commit record": (lambda g: g["points"].attrs.__setitem__(
        "fkv_commit", np.zeros(8, dtype="<f8")), "dtype float64"),
}


@pytest.mark.parametrize("case", CRAFTED)
def test_values_deciding_sizes_are_checked_when_a_stream_opens(archive, case):
    craft, message = CRAFTED[case]
    with _edit(archive) as f:
        craft(f["streams/s"])
    with pytest.raises(ArchiveFormatError, match=message):
        _open_stream(archive)


def test_a_text_stream_must_be_bytes(archive):
    with _edit(archive) as f:
        _codec(f["streams/t"], alphabet_size=16, ratio=0.25)  # a valid codec, but not bytes
    with pytest.raises(ArchiveFormatError, match="a text stream has alphabet 256"):
        _open_stream(archive, "t")


def test_the_unchanged_archive_still_opens(archive):
    with fkvstore.open(archive) as ar:
        assert np.array_equal(ar["s"][:], ROWS) and ar["t"].bytes() == b"some text"
        assert not any(ar.verify().values())


# -- 2. persisted search indexes ---------------------------------------------------------------
def _persisted_book(path):
    with fkvstore.open(path, "w") as ar:
        s = ar.create_text_stream("book")
        s.extend(BOOK)
        s.build_index(persist=True)


def _rewrite_aux(path, name, fn):
    """Replace the bytes of aux array ``search_0_<name>`` by ``fn(old)`` with a valid CRC-32,
    keeping its build tag: only a hostile writer does this."""
    with _edit(path) as f:
        ds = f[f"streams/book/aux/search_0_{name}"]
        new = np.ascontiguousarray(fn(ds[()]), dtype=ds.dtype)
        assert new.shape == ds.shape
        ds[...] = new
        ds.attrs["fkv_crc32"] = np.uint32(zlib.crc32(new.tobytes()))


def _search_in_child(path, trust):
    """Search the book in a fresh process (a crash there must not take the tests down)."""
    code = textwrap.dedent(f"""
        import fkvstore
        with fkvstore.open({str(path)!r}) as ar:
            s = ar["book"]
            s.trust_index = {trust!r}
            print(s.search("time").tolist() == {_expected(b"time")!r})
    """)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)


def _expected(query):
    return [i + len(query) - 1 for i in naive.find_bytes(BOOK, query)]


def _garbage_nodes(nodes):
    return np.random.default_rng(0).integers(0, 256, nodes.shape, dtype=np.uint8)


HOSTILE_INDEX = {
    "garbage node bytes": ("nodes", _garbage_nodes),
    "shifted point indices": ("indices", lambda idx: idx + 1_000_000),
    "point indices not a permutation": ("indices", lambda idx: np.zeros_like(idx)),
}


@pytest.mark.parametrize("trust", [False, True])
@pytest.mark.parametrize("case", HOSTILE_INDEX)
def test_hostile_persisted_trees_are_rebuilt_not_followed(tmp_path, case, trust):
    path = tmp_path / "index.h5"
    _persisted_book(path)
    _rewrite_aux(path, *HOSTILE_INDEX[case])
    done = _search_in_child(path, trust)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "True"


def test_a_forged_walk_hides_no_match_unless_trusted(tmp_path):
    # points moved away from every query's ball: a trusting search would find nothing
    path = tmp_path / "index.h5"
    _persisted_book(path)
    _rewrite_aux(path, "walk", lambda walk: walk + 7.0)
    with fkvstore.open(path) as ar:
        assert ar["book"].search("time").tolist() == _expected(b"time")
        assert not any(ar.verify().values())  # the CRC-32 matches: only a key could tell
    with fkvstore.open(path) as ar:
        s = ar["book"]
        s.trust_index = True  # the caller vouches for the file: its walk is used as stored
        assert s.search("time").tolist() != _expected(b"time")


def test_stored_trees_are_rebuilt_unless_trusted(tmp_path, monkeypatch):
    path = tmp_path / "index.h5"
    _persisted_book(path)
    built = []
    tree = SuffixIndex._tree
    monkeypatch.setattr(SuffixIndex, "_tree",
                        lambda self, a, b: built.append(b) or tree(self, a, b))
    with fkvstore.open(path) as ar:
        assert ar["book"].search("time").tolist() == _expected(b"time")
    assert built == [len(BOOK)]  # the walk points became one tree
    built.clear()
    with fkvstore.open(path) as ar:
        s = ar["book"]
        s.trust_index = True
        assert s.search("time").tolist() == _expected(b"time")
    assert built == []  # the stored trees were restored


def _state(monkeypatch, n=20_000):
    import fkvstore.index.suffix as ix  # the module that reads _BUFFER

    monkeypatch.setattr(ix, "_BUFFER", 256)  # several trees
    codec = fkvstore.Codec(16)
    index = SuffixIndex(codec)
    rng = np.random.default_rng(1)
    for a in range(0, n, 700):
        index.extend(rng.integers(0, 16, min(700, n - a)))
    return index.state(), n


def test_stored_tree_checks_accept_what_scipy_wrote(monkeypatch):
    state, n = _state(monkeypatch)
    assert len(state["trees"]) > 1
    assert stored_trees_valid(state["trees"], state["nodes"], state["indices"], state["boxes"], n)
    assert TREE_FORMAT.startswith("scipy-")


def _with_root(state, change):
    """``state`` with ``change(record)`` applied to the root node record of its first tree."""
    nodes = state["nodes"].copy()
    change(nodes[:NODE_DTYPE.itemsize].view(NODE_DTYPE))
    return dict(state, nodes=nodes)


def _set(**fields):
    def change(record):
        for k, v in fields.items():
            record[k] = v(record) if callable(v) else v
    return change


BAD_STATES = {
    "child out of the buffer": _set(_less=10**9),
    "child before its parent (a cycle)": _set(_greater=0),
    "both children the same node": _set(_greater=lambda r: r["_less"]),
    "range past the points": _set(end_idx=lambda r: r["end_idx"] + 1),
    "split dimension": _set(split_dim=7),
    "node bytes cut": lambda s: dict(s, nodes=s["nodes"][:-8]),
    "indices shifted": lambda s: dict(s, indices=s["indices"] + 1),
    "indices repeated": lambda s: dict(s, indices=np.zeros_like(s["indices"])),
    "boxes not finite": lambda s: dict(s, boxes=np.full_like(s["boxes"], np.nan)),
}


@pytest.mark.parametrize("case", BAD_STATES)
def test_stored_tree_checks_refuse_bad_links_and_ranges(case, monkeypatch):
    state, n = _state(monkeypatch)
    change = BAD_STATES[case]
    bad = change(state) if change.__name__ == "<lambda>" else _with_root(state, change)
    assert not stored_trees_valid(bad["trees"], bad["nodes"], bad["indices"], bad["boxes"], n)
    # from_state falls back to building trees from the walk
    symbols = np.random.default_rng(1).integers(0, 16, n)
    rebuilt = SuffixIndex.from_state(fkvstore.Codec(16), symbols, bad, TREE_FORMAT)
    assert rebuilt.tree_sizes == [n]


# -- 3. links, virtual datasets, external storage ------------------------------------------------
@pytest.fixture
def outside(tmp_path):
    """A file outside the archive: an HDF5 file with a dataset and a group, and raw bytes."""
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"root:x:0:0:root:/root:/bin/bash\n" * 4)
    other = tmp_path / "other.h5"
    with fkvstore.open(other, "w") as ar:  # a whole archive: its stream group reads as one
        ar.create_stream("s", 200, width=3, chunk_bytes=1024).extend(ROWS)
        ar.put_array("x", np.arange(5))
    return secret, other


def _virtual(other):
    layout = h5py.VirtualLayout(shape=(5,), dtype="<i8")
    layout[:] = h5py.VirtualSource(str(other), "arrays/x", shape=(5,))
    return layout


ARRAY_LINKS = {
    "external link": lambda g, secret, other: g.__setitem__(
        "x", h5py.ExternalLink(str(other), "arrays/x")),
    "soft link": lambda g, secret, other: g.__setitem__("x", h5py.SoftLink("/arrays/a")),
    "external raw storage": lambda g, secret, other: g.create_dataset(
        "x", shape=(32,), dtype="u1", external=[(str(secret), 0, 32)]),
    "virtual dataset": lambda g, secret, other: g.create_virtual_dataset("x", _virtual(other)),
}


@pytest.mark.parametrize("case", ARRAY_LINKS)
def test_arrays_outside_the_file_are_refused(archive, outside, case):
    with _edit(archive) as f:
        ARRAY_LINKS[case](f["arrays"], *outside)
    with fkvstore.open(archive) as ar:
        with pytest.raises(ArchiveLinkError, match="'/arrays/x'"):
            ar.get_array("x")
        with pytest.raises(ArchiveLinkError):
            ar.array_info("x")
        assert ar.get_array("a").tolist() == list(range(10))


STREAM_LINKS = {
    "stream group": lambda f, other: f["streams"].__setitem__(
        "s", h5py.ExternalLink(str(other), "streams/s")),
    "points": lambda f, other: f["streams/s"].__setitem__(
        "points", h5py.ExternalLink(str(other), "streams/s/points")),
    "tail": lambda f, other: f["streams/s"].__setitem__("tail", h5py.SoftLink("/streams/t/tail")),
}


@pytest.mark.parametrize("case", STREAM_LINKS)
def test_streams_outside_the_file_are_refused(archive, outside, case):
    with _edit(archive) as f:
        if case != "stream group":
            del f["streams/s"][case]
        else:
            del f["streams/s"]
        STREAM_LINKS[case](f, outside[1])
    with pytest.raises(ArchiveLinkError, match="Link"):
        _open_stream(archive)


def test_aux_arrays_outside_the_file_are_refused(tmp_path, outside):
    path = tmp_path / "index.h5"
    _persisted_book(path)
    with _edit(path) as f:
        aux = f["streams/book/aux"]
        del aux["search_0_walk"]
        aux["search_0_walk"] = h5py.ExternalLink(str(outside[1]), "arrays/x")
    with fkvstore.open(path) as ar:
        with pytest.raises(ArchiveLinkError, match="search_0_walk"):
            ar["book"].get_aux_array("search_0_walk")
    with _edit(path) as f:
        del f["streams/book/aux"]
        f["streams/book"]["aux"] = h5py.ExternalLink(str(outside[1]), "arrays")
    with fkvstore.open(path) as ar:
        with pytest.raises(ArchiveLinkError, match="aux"):
            ar["book"].aux_array_names()


def test_a_linked_streams_group_is_refused_at_open(archive, outside):
    with _edit(archive) as f:
        del f["streams"]
        f["streams"] = h5py.ExternalLink(str(outside[1]), "streams")
    with pytest.raises(ArchiveLinkError, match="'/streams'"):
        fkvstore.open(archive)


# -- 4. damaged metadata under an SWMR reader ------------------------------------------
def test_a_flipped_metadata_bit_fails_fast_for_a_reader(archive):
    # HDF5 retries a metadata block with a bad checksum for an SWMR reader (a writer may be
    # rewriting it): 100 times with growing pauses by default, which took minutes here
    with h5py.File(archive, "r", locking=False) as f:
        header = h5py.h5o.get_info(f["streams/s/points"].id).addr
    data = bytearray(archive.read_bytes())
    data[header + 40] ^= 0x10
    archive.write_bytes(bytes(data))
    code = textwrap.dedent(f"""
        import fkvstore
        try:
            with fkvstore.open({str(archive)!r}) as ar:
                ar["s"][:5]
        except fkvstore.errors.ArchiveFormatError as exc:
            print("refused:", exc)
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert "refused:" in done.stdout and "checksum" in done.stdout, done.stderr[-2000:]


# -- 5. one object under two names ---------------------------------------------------------
ALIASES = {  # (object, second name, how each name is read, the names verify reports)
    "stream group": ("streams/s", "streams/s2", {"s": "stream", "s2": "stream"}),
    "points of another stream": ("streams/s/points", "streams/t/points",
                                 {"s": "stream", "t": "stream"}),
    "array": ("arrays/a", "arrays/b", {"a": "array", "b": "array"}),
}


def _read(ar, name, kind):
    return ar.get_array(name) if kind == "array" else ar[name][:1]


@pytest.mark.parametrize("case", ALIASES)
def test_hard_link_aliases_are_refused(archive, case):
    # a writer appending through one name would silently overwrite the rows of the other
    target, alias, names = ALIASES[case]
    with _edit(archive) as f:
        if alias in f:
            del f[alias]
        f[alias] = f[target]  # a second hard link to the same object
    for mode in ("r", "a"):
        with fkvstore.open(archive, mode) as ar:
            for name, kind in names.items():
                with pytest.raises(ArchiveLinkError, match="under 2 names"):
                    _read(ar, name, kind)
            report = ar.verify()
        for name, kind in names.items():
            key = f"arrays/{name}" if kind == "array" else name
            assert any("under 2 names" in p for p in report[key]), report


# -- 6. sizes chosen to exhaust memory or disk --------------------------------------------------
def _bomb(g, name):
    """A gzip array of 2**31 zero bytes (a few MB in the file) with the CRC of its content."""
    ds = g.create_dataset(name, shape=(1 << 31,), dtype="u1", chunks=(1 << 22,),
                          compression="gzip", fillvalue=0)
    ds.id.write_direct_chunk((0,), zlib.compress(bytes(1 << 22)))  # one chunk, for realism
    ds.attrs["fkv_crc32"] = np.uint32(0)


def _oversized(g, name):
    """An unfiltered array declaring 2**40 bytes, none of them stored (reads return zeros)."""
    g.create_dataset(name, shape=(1 << 37,), dtype="<i8", chunks=(1 << 16,))
    g[name].attrs["fkv_crc32"] = np.uint32(0)


@pytest.mark.parametrize("make, message", [(_bomb, "filter"), (_oversized, "more than the")])
def test_arrays_that_would_expand_beyond_the_file_are_refused_before_reading(
        archive, make, message):
    with _edit(archive) as f:
        make(f["arrays"], "x")
    with fkvstore.open(archive) as ar:
        assert ar.array_info("x")[1][0] > 1 << 30  # the declared shape is still reported
        with pytest.raises(ArchiveFormatError, match=message):
            ar.get_array("x")
        report = ar.verify()
    assert message in report["arrays/x"][0] and not report["arrays/a"]


def test_a_commit_claiming_more_chunks_than_the_file_holds_is_refused(archive):
    spans = 1 << 30  # 16 GiB of points, and a 256 MiB list of chunk checksums
    with _edit(archive) as f:
        g = f["streams/s"]
        g["points"].resize((spans, 3, 2))
        g["block_crc"].resize((spans // g.attrs["fkv_block_spans"],))
        span = json.loads(g.attrs["fkv_codec"])["span"]
        _set_commit(g, length=spans * span, full_spans=spans, tail_count=0)
    with pytest.raises(ArchiveFormatError, match="more than the .* bytes of the whole file"):
        _open_stream(archive)


def _record_end(path, end):
    """Rewrite the superblock's end-of-file address as ``end`` (a valid checksum kept)."""
    from fkvstore._superblock import lookup3, read_superblock

    sb = read_superblock(path)
    raw = bytearray(path.read_bytes())
    o = raw[9]
    raw[12 + 2 * o : 12 + 3 * o] = (end - sb.base_address).to_bytes(o, "little")
    raw[sb.size - 4 : sb.size] = lookup3(bytes(raw[: sb.size - 4])).to_bytes(4, "little")
    path.write_bytes(raw)


def test_a_superblock_claiming_a_huge_end_of_file_is_not_grown_to_it(archive):
    size = archive.stat().st_size
    _record_end(archive, 1 << 40)
    with pytest.raises(ArchiveFormatError, match=r"records an end of file at 1099511627776"):
        fkvstore.open(archive, "a")
    assert archive.stat().st_size == size  # not extended, not written
    with fkvstore.open(archive) as ar:  # a reader still sees what there is
        assert np.array_equal(ar["s"][:], ROWS)


def test_verify_lists_every_linked_aux_array(tmp_path, outside):
    path = tmp_path / "index.h5"
    _persisted_book(path)
    with _edit(path) as f:
        aux = f["streams/book/aux"]
        for name in ("search_0_walk", "search_0_boxes"):
            del aux[name]
            aux[name] = h5py.ExternalLink(str(outside[1]), "arrays/x")
    with fkvstore.open(path) as ar:
        problems = ar.verify()["book"]
    assert [p for p in problems if "ExternalLink" in p] == [
        p for p in problems if "search_0_boxes" in p or "search_0_walk" in p]
    assert len(problems) == 2
