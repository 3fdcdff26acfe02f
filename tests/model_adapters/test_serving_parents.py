"""A fork's ``parent`` attribute is input from a file: it is followed only inside the folder the
caller allows (no absolute path, no ``..`` or symbolic link out of it), never in a cycle, and
along a chain of bounded depth; each refusal is an ``ArchiveParentError`` naming the value."""

from __future__ import annotations

import os

import pytest
from serving_fixtures import IDS, written

import fkvstore
from fkvstore.errors import ArchiveFormatError, ArchiveParentError
from model_adapters.store import serving_archive, serving_streams


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """``(model, folder)``: ``base.fkv`` and its fork ``child.fkv`` (two more tokens)."""
    tmp = tmp_path_factory.mktemp("family")
    model, _, base = written(tmp, "gpt2", 20)
    base.rename(tmp / "base.fkv")
    with serving_archive.fork(tmp / "base.fkv", tmp / "child.fkv", model) as sa:
        sa.forward(model, IDS[:, 20:22])
    return model, tmp


def _set_attr(path, name, value):
    with fkvstore.open(path, "r+") as ar:
        ar.attrs[name] = value


def _resume(path, model, **kwargs):
    with serving_archive.resume(path, model, mode="r", **kwargs) as sa:
        return sa.token_ids().tolist()


def test_an_honest_fork_resumes(family):
    model, tmp = family
    assert _resume(tmp / "child.fkv", model) == IDS[0, :22].tolist()


@pytest.fixture
def child(family, tmp_path):
    """A copy of the family in a fresh folder ``tmp_path/home`` (each test edits its own)."""
    model, tmp = family
    home = tmp_path / "home"
    home.mkdir()
    for name in ("base.fkv", "child.fkv"):
        (home / name).write_bytes((tmp / name).read_bytes())
    return model, home


def _moved_base(home, place):
    """Move ``base.fkv`` to ``place`` (relative to ``home``); returns its new path."""
    target = home / place
    target.parent.mkdir(parents=True, exist_ok=True)
    (home / "base.fkv").rename(target)
    return target


def test_a_parent_outside_the_folder_is_refused_unless_allowed(child):
    model, home = child
    _moved_base(home, "../shared/base.fkv")
    _set_attr(home / "child.fkv", "parent", "../shared/base.fkv")
    with pytest.raises(ArchiveParentError, match=r"parent '\.\./shared/base\.fkv' resolves to"):
        _resume(home / "child.fkv", model)
    assert _resume(home / "child.fkv", model, root=home.parent) == IDS[0, :22].tolist()


def test_an_absolute_parent_is_refused(child):
    model, home = child
    _set_attr(home / "child.fkv", "parent", str(home / "base.fkv"))
    with pytest.raises(ArchiveParentError, match="is an absolute path"):
        _resume(home / "child.fkv", model, root="/")


def test_a_symbolic_link_out_of_the_folder_is_refused(child):
    model, home = child
    outside = _moved_base(home, "../elsewhere/base.fkv")
    os.symlink(outside, home / "base.fkv")  # the attribute still says "base.fkv"
    with pytest.raises(ArchiveParentError, match="'base.fkv' resolves to .*elsewhere"):
        _resume(home / "child.fkv", model)


@pytest.mark.parametrize("how", ["itself", "hard link", "two files"])
def test_cycles_are_refused(child, how):
    model, home = child
    if how == "itself":
        _set_attr(home / "child.fkv", "parent", "child.fkv")
    elif how == "hard link":
        os.link(home / "child.fkv", home / "alias.fkv")
        _set_attr(home / "child.fkv", "parent", "alias.fkv")
    else:  # base names child as its parent
        for name, value in (("parent", "child.fkv"), ("parent_tokens", 0),
                            ("parent_archived", 0)):
            _set_attr(home / "base.fkv", name, value)
    with pytest.raises(ArchiveParentError, match="already in the chain"):
        _resume(home / "child.fkv", model)


def test_a_chain_deeper_than_the_limit_is_refused(child, monkeypatch):
    model, home = child
    monkeypatch.setattr(serving_streams, "MAX_PARENTS", 1)
    with serving_archive.fork(home / "child.fkv", home / "grandchild.fkv", model):
        pass  # the check counts parents before the fork is written: two files
    with pytest.raises(ArchiveParentError, match="more than 1 forks"):
        _resume(home / "grandchild.fkv", model)
    monkeypatch.setattr(serving_streams, "MAX_PARENTS", 2)
    assert _resume(home / "grandchild.fkv", model) == IDS[0, :22].tolist()


@pytest.mark.parametrize("value", [[1, 2], "", 7])
def test_a_parent_that_is_not_a_name_is_refused(child, value):
    model, home = child
    _set_attr(home / "child.fkv", "parent", value)
    with pytest.raises(ArchiveParentError, match="is not a file name"):
        _resume(home / "child.fkv", model)


@pytest.mark.parametrize("value", [-1, 2.5, "3"])
def test_fork_points_must_be_row_counts(child, value):
    model, home = child
    _set_attr(home / "child.fkv", "parent_tokens", value)
    with pytest.raises(ArchiveFormatError, match=f"parent_tokens={value!r}"):
        _resume(home / "child.fkv", model)


def test_fork_refuses_a_parent_its_fork_could_not_reopen(child, tmp_path):
    model, home = child
    target = tmp_path / "forks" / "f.fkv"
    target.parent.mkdir()
    with pytest.raises(ArchiveParentError, match="outside"):
        serving_archive.fork(home / "child.fkv", target, model)
    assert not target.exists()
    with serving_archive.fork(home / "child.fkv", target, model, root=tmp_path):
        pass
    assert _resume(target, model, root=tmp_path) == IDS[0, :22].tolist()
