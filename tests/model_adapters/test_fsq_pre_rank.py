"""``bench/fsq_pre_rank.py`` on a tiny random Qwen3: the subspace at full width reconstructs
keys, values and attention exactly in both forms; narrower ones lose something; the table's
JSON is written."""

import json
import lzma

import numpy as np
import pytest
from adapters_fixtures import TINY_MODELS, torch
from bench_scripts import bench_script


@pytest.fixture(scope="module")
def study():
    return bench_script("fsq_pre_rank")


def test_full_width_is_exact_and_narrow_widths_lose(study, tmp_path):
    model = TINY_MODELS["qwen3"]()
    model.save_pretrained(tmp_path / "model")
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        ids = rng.integers(2, 100, 4000).astype("<u2")
        (tmp_path / f"books-gpt2-{split}.u16.xz").write_bytes(lzma.compress(ids.tobytes()))
    full = 2 * model.config.num_key_value_heads * model.config.head_dim  # the stacked K/V
    out = tmp_path / "rank"
    study.main(["--model", str(tmp_path / "model"), "--books", str(tmp_path), "--seq", "200",
                "--fit", "3", "--eval", "1", "--widths", "4", str(full), "--out", str(out)])
    summary = json.loads(out.with_suffix(".json").read_text())["summary"]
    by = {(r["width"], r["form"]): r for r in summary}
    for form in ("post", "pre"):
        assert by[(full, form)]["attention_error"] < 1e-8
        assert by[(full, form)]["key_error"] < 1e-8 and by[(full, form)]["value_error"] < 1e-8
        assert by[(4, form)]["attention_error"] > 1e-3
    assert by[(4, "post")]["compression"] == full * 2 / (4 * 0.5)  # fp16 K/V over 4 x 4 bits


def test_subspace_is_the_best_of_its_rank(study):
    """The principal subspace reconstructs its own rows with the smallest squared error of any
    subspace of that rank (here: against random ones)."""
    g = torch.Generator().manual_seed(1)
    k = torch.randn(500, 6, generator=g) @ torch.randn(6, 6, generator=g)
    v = torch.randn(500, 4, generator=g)
    space = study.Subspace(k, v, 3)
    k_hat, v_hat = space(k, v)
    best = ((k_hat - k) * space.sk).pow(2).sum() + ((v_hat - v) * space.sv).pow(2).sum()
    for _ in range(5):
        other = study.Subspace(k, v, 3)
        other.u = torch.linalg.qr(torch.randn(10, 3, generator=g, dtype=torch.float64))[0]
        ko, vo = other(k, v)
        worse = ((ko - k) * space.sk).pow(2).sum() + ((vo - v) * space.sv).pow(2).sum()
        assert best < worse
