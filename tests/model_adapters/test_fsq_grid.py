"""bench/fsq_grid.py on a tiny GPT-2: book text only (``--task-fraction 0``), no needles
(``--items 0``), calibration within a short context, and its argument checks."""

import importlib
import json
import lzma
import re
from argparse import Namespace
from pathlib import Path

import numpy as np
import pytest
from adapters_fixtures import TOKENIZER_DIR

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

BENCH = Path(__file__).resolve().parents[2] / "bench"
POSITIONS = 1024  # book_perplexity scores 1,024-token windows


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny GPT-2 (1,024 positions) with the GPT-2 tokenizer, and token files: the held-out
    one long enough for the 8 perplexity windows 50,000 apart."""
    if not TOKENIZER_DIR.is_dir():
        pytest.skip("GPT-2 tokenizer files not present")
    d = tmp_path_factory.mktemp("fsq-grid")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=POSITIONS,
                                  vocab_size=50257, bos_token_id=0, eos_token_id=1)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(d / "model")
    tok = transformers.GPT2Tokenizer(vocab=str(TOKENIZER_DIR / "vocab.json"),
                                     merges=str(TOKENIZER_DIR / "merges.txt"))
    tok.save_pretrained(d / "model")
    rng = np.random.default_rng(0)
    for name, n in (("train", 20_000), ("val", 351_100)):
        with lzma.open(d / f"{name}.u16.xz", "wb") as f:
            f.write(rng.integers(2, 50_000, n).astype("<u2").tobytes())
    return d


def bench_module(name: str):
    """A script of bench/ imported as a module (its siblings importable while it loads)."""
    import sys

    sys.path.insert(0, str(BENCH))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCH))


@pytest.fixture(scope="module")
def grid():
    return bench_module("fsq_grid")


def args_for(d, *extra):
    return ["--model", str(d / "model"), "--train", str(d / "train.u16.xz"),
            "--val", str(d / "val.u16.xz"), "--device", "cpu", *map(str, extra)]


def test_book_text_only_run_without_needles(setup, grid, tmp_path):
    save = tmp_path / "out"
    # tau 1e-4 of ~1.7M parameters at 2 x 64 tokens per step: 2 steps
    rc = grid.main(args_for(setup, "--save", save, "--seq", 64, "--batch", 2,
                            "--task-fraction", 0, "--items", 0, "--point", "fsq-w8-L16-tau0.0001"))
    assert rc == 0
    result = json.loads((save / "fsq-grid.json").read_text())
    assert [r["config"] for r in result["rows"]] == ["exact", "fsq-w8-L16-tau0.0001"]
    assert all(r["niah1"] == {} for r in result["rows"])
    row = result["rows"][1]
    assert row["steps"] == 2 and row["tokens"] == 2 * 2 * 64 and row["packed_bytes"] == 4
    assert result["args"]["task_fraction"] == 0.0 and result["skipped"] == []
    assert (save / "fsq-w8-L16-tau0.0001" / "fsq_bottleneck.safetensors").is_file()


def test_calibration_fits_a_short_context(setup):
    finetune = bench_module("fsq_finetune")
    from model_adapters.experiments.needles import load_tokens

    base = transformers.AutoModelForCausalLM.from_pretrained(setup / "model").eval()
    train, val = load_tokens(setup / "train.u16.xz"), load_tokens(setup / "val.u16.xz")
    for seq, shape in ((64, (64, 64)), (1024, (4, 1024)), (8192, (2, 2048))):
        args = Namespace(seq=seq, calibration=2, items=0, lengths=[], device="cpu")
        result = {"rows": []}
        calib = finetune.exact_row_and_calibration(base, train, val, [], None, args, result)
        assert tuple(calib.shape) == shape and calib.dtype == torch.int64
        # every row is a run of consecutive training tokens
        flat = train.numpy()
        for row in calib.numpy():
            starts = np.flatnonzero(flat[: len(flat) - len(row) + 1] == row[0])
            assert any(np.array_equal(flat[s:s + len(row)], row) for s in starts)


@pytest.mark.parametrize("extra, message", [
    (("--seq", 2048), "--seq 2048 exceeds the model's 1024 positions"),
    (("--seq", 64, "--items", 1, "--lengths", "512,2048"),
     "--lengths 2048 exceeds the model's 1024"),
    (("--task-fraction", 1.5), "--task-fraction 1.5 is not in [0, 1]"),
    (("--items", -1), "--items -1 is out of range"),
    (("--batch", 0), "--batch 0 is out of range"),
])
def test_refuses_sizes_before_any_work(setup, grid, tmp_path, extra, message):
    save = tmp_path / "out"
    with pytest.raises(SystemExit, match=re.escape(message)):
        grid.main(args_for(setup, "--save", save, "--point", "fsq-w8-L16-tau0.0001", *extra))
    assert not save.exists()


def test_book_text_batches_are_plain_spans():
    from model_adapters.experiments.needles import training_batches

    tokens = torch.arange(5_000)
    batches = training_batches(tokens, ["alpha"], None, batch=3, seq=50, task_fraction=0.0)
    for _ in range(4):
        ids, mask = next(batches)
        assert ids.shape == (3, 50) and not mask.any()
        assert torch.equal(ids - ids[:, :1], torch.arange(50).expand(3, 50))
