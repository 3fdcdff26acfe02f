"""Codes written to a real fkvstore archive (HDF5) and read back."""

from __future__ import annotations

import json

import numpy as np
import pytest
from adapters_fixtures import TINY_MODELS, random_quantizer, tiny_eval_args, torch

from model_adapters import eval as adapters_eval
from model_adapters.caches.archiving import ArchivingCache
from model_adapters.caches.code_rows import CodeRows
from model_adapters.models import cache_kwarg, kv_shape, model_identity
from model_adapters.store import archive_io

h5py = pytest.importorskip("h5py")
fkvstore = pytest.importorskip("fkvstore")


def _archive_run(model, path, n=30, sinks=2, recent=5, block=1):
    q = random_quantizer(model, key_stages=2, value_stages=1, seed=7)
    ar, stream = archive_io.open_for_writing(path, model, q, sinks=sinks, recent=recent)
    rows = CodeRows(kv_shape(model).num_layers, stream.extend, keep=True)
    cache = ArchivingCache(model, q, sinks=sinks, recent=recent, rows=rows, block=block)
    ids = torch.randint(2, 100, (1, n), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        for t in range(n):
            model(ids[:, t : t + 1], **{cache_kwarg(model): cache})
    archive_io.write_window(ar, cache)
    ar.close()
    return q, rows.all_rows(), cache


@pytest.mark.parametrize("arch", ["gpt2", "qwen3"])
def test_codes_read_back_equal_codes_produced(arch, tmp_path):
    model = TINY_MODELS[arch]()
    path = tmp_path / "codes.fkv"
    q, produced, cache = _archive_run(model, path)
    assert h5py.is_hdf5(path)
    with fkvstore.open(path, "r") as ar:
        stored = archive_io.read_codes(ar)
        back = archive_io.read_quantizer(ar, model)
        window_k = ar.get_array("window_keys")
        stream = ar[archive_io.CODES_STREAM]
        assert archive_io.stream_data_bytes(stream) > 0
    assert produced.shape == (30 - 2 - 5, q.row_width)
    np.testing.assert_array_equal(stored, produced)
    assert torch.equal(back.key_codebooks, q.key_codebooks)
    assert torch.equal(back.value_codebooks, q.value_codebooks)
    # the archive alone rebuilds what the cache attends to at the archived positions
    kc, vc = back.rows_to_codes(stored)
    for li, layer in enumerate(cache.layers):
        k, v = back.decode(li, torch.from_numpy(kc[li])[None], torch.from_numpy(vc[li])[None])
        assert torch.equal(k[0], layer.keys[0, :, 2:25])
        assert torch.equal(v[0], layer.values[0, :, 2:25])
    shape = kv_shape(model)
    assert window_k.shape == (shape.num_layers, shape.kv_heads, 2 + 5, shape.head_dim)
    assert window_k.dtype == np.float16


@pytest.mark.parametrize("block", [1, 4])
def test_codes_and_window_hold_every_position(block, tmp_path):
    # with groups, the positions still waiting for theirs are stored with the exact window
    model = TINY_MODELS["gpt2"]()
    _, produced, cache = _archive_run(model, tmp_path / "all.fkv", block=block)
    with fkvstore.open(tmp_path / "all.fkv", "r") as ar:
        window_k = ar.get_array("window_keys")
        window_v = ar.get_array("window_values")
    assert len(produced) == 23 // block * block  # 30 positions - 2 sinks - 5 recent
    assert len(produced) + window_k.shape[2] == 30
    end = 2 + len(produced)
    for li, layer in enumerate(cache.layers):
        exact = torch.cat([layer.keys[0, :, :2], layer.keys[0, :, end:]], 1).half().numpy()
        np.testing.assert_array_equal(window_k[li], exact)
        exact = torch.cat([layer.values[0, :, :2], layer.values[0, :, end:]], 1).half().numpy()
        np.testing.assert_array_equal(window_v[li], exact)


def test_archive_from_another_model_config_is_refused(tmp_path):
    path = tmp_path / "gpt2.fkv"
    _archive_run(TINY_MODELS["gpt2"](), path, n=12)
    with fkvstore.open(path, "r") as ar:
        for other in (TINY_MODELS["qwen3"](), TINY_MODELS["gpt2"](vocab_size=102)):
            with pytest.raises(ValueError, match="another model configuration"):
                archive_io.read_quantizer(ar, other)
        # same config, other weights: refused naming both identities, unless allowed
        written, other = TINY_MODELS["gpt2"](), TINY_MODELS["gpt2"](seed=3)
        with pytest.raises(ValueError, match="other weights") as err:
            archive_io.check_identity(ar, other)
        for model in (written, other):
            assert str(model_identity(model)) in str(err.value)
        archive_io.check_identity(ar, other, allow_different_weights=True)
        archive_io.check_identity(ar, written)


def test_cli_writes_real_archives(tiny_checkpoint, tmp_path):
    model_dir, book = tiny_checkpoint
    out, adir = tmp_path / "res.json", tmp_path / "archives"
    configs = ["perhead-k16-s2", "perhead-k16-s1-valuesonly"]
    rc = adapters_eval.main(tiny_eval_args(model_dir, book, out, configs, "--archive-dir", adir))
    assert rc == 0
    rows = {r["config"]: r for r in json.loads(out.read_text())["configs"]}
    fp16 = 2 * 4 * 16 * 2 * 2
    for name, width in (("perhead-k16-s2", 2 * 4 * 4), ("perhead-k16-s1-valuesonly", 2 * 4)):
        r = rows[name]
        path = adir / r["archive"]
        assert h5py.is_hdf5(path) and path.stat().st_size == r["archive_file_bytes"]
        with fkvstore.open(path, "r") as ar:
            stream = ar[archive_io.CODES_STREAM]
            assert len(stream) == r["archived_tokens"] == 53 and stream.width == width
            code_bytes = archive_io.stream_data_bytes(stream)
        assert r["code_bytes_per_token"] == pytest.approx(code_bytes / 53)
        total = code_bytes + r["window_bytes"] + r["codebook_bytes"]
        assert r["bytes_per_token"] == pytest.approx(total / 64)
        assert r["compression_vs_fp16"] == pytest.approx(fp16 / r["code_bytes_per_token"])
        assert r["compression_vs_fp16_total"] == pytest.approx(fp16 / r["bytes_per_token"])


def test_cli_reuses_codebooks_from_an_archive_and_refuses_another_models(
    tiny_checkpoint,
    tmp_path,
    capsys,
):
    model_dir, book = tiny_checkpoint
    common = ["--text", str(book), "--tokens", "40", "--train-tokens", "300", "--sinks", "1"]
    common += ["--recent", "4", "--kmeans-iters", "2", "--no-progress"]
    adir = tmp_path / "archives"
    first = tmp_path / "a.json"
    assert (
        adapters_eval.main(
            [
                "--model",
                str(model_dir),
                *common,
                "--config",
                "perhead-k8-K2V1",
                "--archive-dir",
                str(adir),
                "--json",
                str(first),
            ]
        )
        == 0
    )
    archive = adir / "perhead-k8-K2V1.fkv"
    second = tmp_path / "b.json"
    assert (
        adapters_eval.main(
            [
                "--model",
                str(model_dir),
                *common,
                "--config",
                "perhead-k8-K1V1",
                "--config",
                "perhead-k8-K2V1",
                "--codebooks-from",
                str(archive),
                "--json",
                str(second),
            ]
        )
        == 0
    )
    a = {r["config"]: r for r in json.loads(first.read_text())["configs"]}
    b = json.loads(second.read_text())
    assert b["train_seconds"] is None
    assert {r["config"]: r for r in b["configs"]}["perhead-k8-K2V1"]["ppl"] == a["perhead-k8-K2V1"][
        "ppl"
    ]
    with pytest.raises(SystemExit):
        adapters_eval.main(["--model", str(model_dir), "--codebooks-from"])
    # a config deeper than the stored codebooks, and a different model configuration: both
    # refused from the archive's attributes, before weights are loaded
    assert (
        adapters_eval.main(
            [
                "--model",
                str(model_dir),
                *common,
                "--config",
                "perhead-k8-K3V1",
                "--codebooks-from",
                str(archive),
            ]
        )
        == 2
    )
    other = tmp_path / "qwen3"
    TINY_MODELS["qwen3"](vocab_size=50257).save_pretrained(other)
    assert (
        adapters_eval.main(
            [
                "--model",
                str(other),
                *common,
                "--config",
                "perhead-k8-K2V1",
                "--codebooks-from",
                str(archive),
            ]
        )
        == 2
    )
    assert "another model configuration" in capsys.readouterr().err
