"""Config grammar, text preparation and the evaluation CLI end to end on a tiny saved model."""

from __future__ import annotations

import json

import pytest
from adapters_fixtures import TOKENIZER_DIR, make_book, tiny_eval_args, transformers

import fkvstore
from model_adapters.experiments import eval as adapters_eval
from model_adapters.experiments.text import (
    chapter_one_offset,
    clean_text,
    split_tokens,
    strip_gutenberg,
)
from model_adapters.quant.configs import ALL_CONFIGS, expand_configs, parse_config

needs_tokenizer = pytest.mark.skipif(
    not TOKENIZER_DIR.is_dir(), reason="GPT-2 tokenizer files not present"
)


@pytest.mark.parametrize(
    "name, pooled, k, ks, vs",
    [
        ("pooled-k256-s1", True, 256, 1, 1),
        ("perhead-k1024-s2", False, 1024, 2, 2),
        ("perhead-k256-s2-keysonly", False, 256, 2, 0),
        ("perhead-k256-s2-valuesonly", False, 256, 0, 2),
        ("pooled-k64-K3V1", True, 64, 3, 1),
        ("hybrid-k256-K4V2", False, 256, 4, 2),
    ],
)
def test_config_grammar(name, pooled, k, ks, vs):
    c = parse_config(name)
    assert (c.pooled, c.codebook_size, c.key_stages, c.value_stages) == (pooled, k, ks, vs)
    assert c.name == name and not c.is_exact


def test_hybrid_is_an_alias_and_all_expands():
    assert parse_config("hybrid-k256-K4V2").canonical == parse_config("perhead-k256-K4V2").canonical
    assert parse_config("exact").is_exact
    names = [c.name for c in expand_configs(["exact", "all", "perhead-k16-s1"])]
    assert names == list(ALL_CONFIGS) + ["perhead-k16-s1"]
    with pytest.raises(ValueError, match="'all', the paper's rows, is a list of names"):
        parse_config("all")  # one config: 'all' is expand_configs' word


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "perhead",
        "pooled-k256",
        "perhead-k1-s1",
        "pooled-k256-s0",
        "perhead-k256-K0V0",
        "perhead-k256-s2-both",
        "hybrid-k256-s2",
        "Exact",
    ],
)
def test_config_grammar_rejects(bad):
    with pytest.raises(ValueError, match="config"):
        parse_config(bad)


def test_clean_text_strips_boilerplate_and_quotes():
    raw = make_book(50)
    text = clean_text(raw)
    assert "Licence" not in text and "Release date" not in text and "START OF" not in text
    assert "\u201c" not in text and "\u2019" not in text and '"quick"' in text and "it's" in text
    kept = clean_text(raw, keep_quotes=True)
    assert "\u201cquick\u201d" in kept
    assert strip_gutenberg("no markers here") == "no markers here"
    off = chapter_one_offset(text)
    assert text[off:].startswith("I.\n Arrival")


def test_bundled_book_has_chapter_one():
    raw, name = adapters_eval._read_text(None)
    text = clean_text(raw)
    assert name == "the_time_machine.txt"
    assert text[chapter_one_offset(text) :].startswith("I.\n Introduction")


@needs_tokenizer
def test_split_passage_and_training_span_are_disjoint():
    tok = transformers.GPT2Tokenizer(
        vocab=str(TOKENIZER_DIR / "vocab.json"), merges=str(TOKENIZER_DIR / "merges.txt")
    )
    text = clean_text(make_book(400))
    split = split_tokens(text, tok, 50, 10_000)
    off = chapter_one_offset(text)
    assert split.chapter_found and len(split.passage) == 50
    # byte-level BPE decodes exactly: passage + training run rebuild the text from chapter I on
    assert tok.decode(split.passage) + tok.decode(split.train_segments[0]) == text[off:]
    assert tok.decode(split.train_segments[1]) == text[:off]
    capped = split_tokens(text, tok, 50, 30)
    assert capped.train_tokens == 30 and capped.train_segments[0] == split.train_segments[0][:30]
    with pytest.raises(ValueError, match="fewer than --tokens 100000"):
        split_tokens(text, tok, 100_000, 10)


def test_cli_end_to_end(tiny_checkpoint, tmp_path, capsys):
    model_dir, book = tiny_checkpoint
    out = tmp_path / "res.json"
    configs = ["perhead-k16-s2", "pooled-k16-s1", "perhead-k16-s2-keysonly"]
    rc = adapters_eval.main(tiny_eval_args(model_dir, book, out, configs))
    assert rc == 0
    table = capsys.readouterr().out
    assert "| perhead-k16-s2 |" in table and "| exact |" in table
    res = json.loads(out.read_text())
    assert res["model_type"] == "gpt2" and res["tokens"] == 64 and res["chapter_found"]
    assert res["train_tokens"] == 600 and res["fp16_bytes_per_token"] == 2 * 4 * 16 * 4
    rows = {r["config"]: r for r in res["configs"]}
    assert list(rows) == ["exact", "perhead-k16-s2", "pooled-k16-s1", "perhead-k16-s2-keysonly"]
    assert rows["exact"]["delta_ppl_pct"] == 0.0 and rows["exact"]["ppl"] == res["exact_ppl"]
    for name in ("perhead-k16-s2", "pooled-k16-s1", "perhead-k16-s2-keysonly"):
        r = rows[name]
        for field in (
            "ppl",
            "delta_ppl_pct",
            "delta_ppl_pct_second_half",
            "code_bytes_per_token",
            "window_bytes",
            "codebook_bytes",
            "bytes_per_token",
            "compression_vs_fp16",
            "compression_vs_fp16_total",
        ):
            assert field in r
        assert r["archived_tokens"] == 63 - 2 - 8  # 63 cached positions, 2 + 8 kept exact
        assert r["ppl"] > 1 and r["ppl"] != rows["exact"]["ppl"]
        # window: 10 exact positions x (2 layers x 4 heads x 16 x K,V) in fp16
        assert r["window_bytes"] == 10 * 2 * 4 * 16 * 2 * 2
    # 2 layers x 4 heads x (2+2) stages x 4 bits
    assert rows["perhead-k16-s2"]["packed_code_bytes_per_token"] == 2 * 4 * 4 * 4 / 8
    assert rows["perhead-k16-s2"]["codebook_bytes"] == 2 * (2 * 4 * 2 * 16 * 16 * 4)
    assert rows["perhead-k16-s2-keysonly"]["codebook_bytes"] == 2 * 4 * 2 * 16 * 16 * 4
    assert rows["pooled-k16-s1"]["codebook_bytes"] == 2 * (
        2 * 1 * 1 * 16 * 16 * 4
    )  # once per layer
    assert out.with_suffix(".png").stat().st_size > 1000


@pytest.mark.parametrize(
    "args, message",
    [
        (["--tokens", "40", "--sinks", "4", "--recent", "36"], "window too large for the passage"),
        (["--config", "perhead-k99"], "does not follow the grammar"),
        (["--config", "perhead-k1024-s1", "--train-tokens", "500"], "below the largest codebook"),
        (["--text", "no-such-file.txt"], "is not a file"),
        (["--sinks", "-1"], "--sinks -1 is out of range (at least 0)"),
    ],
)
def test_cli_rejects_bad_input_before_work(tmp_path, capsys, args, message):
    # an empty model directory: any model loading would fail differently
    out = tmp_path / "res.json"
    rc = adapters_eval.main(["--model", str(tmp_path), "--json", str(out), *args])
    assert rc == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_cli_reuses_saved_codebooks(tiny_checkpoint, tmp_path):
    model_dir, book = tiny_checkpoint
    common = ["--model", str(model_dir), "--text", str(book), "--tokens", "40"]
    common += ["--train-tokens", "300", "--config", "perhead-k8-K2V1", "--sinks", "1"]
    common += ["--recent", "4", "--kmeans-iters", "2", "--no-progress", "--threads", "1"]
    common += ["--codebook-dir", str(tmp_path / "books")]
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    assert (
        adapters_eval.main([*common, "--json", str(first), "--plot", str(tmp_path / "a.png")]) == 0
    )
    assert len(list((tmp_path / "books").glob("perhead-k8-K2V1-*.npz"))) == 1
    assert (
        adapters_eval.main([*common, "--json", str(second), "--plot", str(tmp_path / "b.png")]) == 0
    )
    a, b = json.loads(first.read_text()), json.loads(second.read_text())
    assert a["train_seconds"] is not None and b["train_seconds"] is None
    assert [r["ppl"] for r in a["configs"]] == [r["ppl"] for r in b["configs"]]


def test_cli_refuses_a_model_folder_without_a_tokenizer(tmp_path, capsys):
    from adapters_fixtures import tiny_gpt2

    tiny_gpt2().save_pretrained(tmp_path)  # config and weights, no tokenizer files
    out = tmp_path / "res.json"
    rc = adapters_eval.main(["--model", str(tmp_path), "--json", str(out), "--tokens", "40",
                             "--no-progress"])
    assert rc == 2
    assert "has no usable tokenizer" in capsys.readouterr().err
    assert not out.exists()


def test_cli_refuses_a_training_span_shorter_than_a_codebook(tiny_checkpoint, tmp_path,
                                                              capsys):
    model_dir, _ = tiny_checkpoint
    book = tmp_path / "short.txt"
    book.write_text(make_book(words=120), encoding="utf-8")
    out = tmp_path / "res.json"
    rc = adapters_eval.main(tiny_eval_args(model_dir, book, out, ["perhead-k256-s1"]))
    assert rc == 2
    assert "training tokens beside the passage, below the largest codebook size 256" in \
        capsys.readouterr().err
    assert not out.exists()


def test_documented_command_is_light():
    """``python -m model_adapters.eval`` runs the experiments' harness, and neither it (for
    --help) nor ``import model_adapters`` loads torch or transformers."""
    import subprocess
    import sys

    from model_adapters import eval as shim

    assert shim.main is adapters_eval.main
    probe = (
        "import runpy, sys\n"
        "import model_adapters\n"
        "sys.argv = ['x', '--help']\n"
        "try:\n"
        "    runpy.run_module('model_adapters.eval', run_name='__main__')\n"
        "except SystemExit:\n"
        "    pass\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert "python -m model_adapters.eval" in out
    assert out.strip().endswith("[]")


BLOCK_MODELS_EXTRA = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "transformers"):
            raise ModuleNotFoundError(f"No module named {name!r}")
        return None
sys.meta_path.insert(0, Block())
importlib.util = __import__("importlib.util").util
_find = importlib.util.find_spec
importlib.util.find_spec = lambda n, *a: None if n in ("torch", "transformers") else _find(n, *a)
"""


def run_without_models_extra(code: str):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-c", BLOCK_MODELS_EXTRA + code],
                          capture_output=True, text=True, timeout=120)


def test_without_the_models_extra_the_errors_name_it():
    done = run_without_models_extra(
        "from model_adapters.eval import main\n"
        "sys.exit(main(['--model', 'nowhere']))")
    assert done.returncode == 2, done.stderr
    assert "needs the 'models' extra (torch, transformers missing)" in done.stderr
    assert "Traceback" not in done.stderr
    done = run_without_models_extra(
        "from model_adapters.eval import build_parser\nbuild_parser().parse_args(['--help'])")
    assert done.returncode == 0 and "--model" in done.stdout, done.stderr
    assert "lacks the 'models' extra (torch, transformers missing)" in done.stdout
    done = run_without_models_extra(
        "import model_adapters\n"
        "try:\n    model_adapters.KVQuantizer\n"
        "except ImportError as exc:\n    print(exc)\n")
    assert "model_adapters.KVQuantizer needs the 'models' extra" in done.stdout, done.stderr


def test_default_threads_leave_half_the_cores():
    from model_adapters.experiments.eval import build_parser, default_threads

    assert build_parser().parse_args(["--model", "m"]).threads == default_threads() >= 1


def test_cli_fsq_configs_convert_cache_and_archive(tiny_checkpoint, tmp_path, capsys):
    """An fsq config is converted from the training text (cached by the model's identity),
    scored through FSQCache, and its codes archived: bytes from the archive, the decoders apart."""
    model_dir, book = tiny_checkpoint
    out, books = tmp_path / "res.json", tmp_path / "conv"
    args = tiny_eval_args(model_dir, book, out, ["fsq-w8-L16", "fsq-w4-L4-tau0"],
                          "--codebook-dir", books, "--archive-dir", tmp_path / "ar")
    assert adapters_eval.main(args) == 0
    assert "| fsq-w8-L16 |" in capsys.readouterr().out
    res = json.loads(out.read_text())
    rows = {r["config"]: r for r in res["configs"]}
    assert list(rows) == ["exact", "fsq-w8-L16", "fsq-w4-L4-tau0"]
    r = rows["fsq-w8-L16"]
    assert r["family"] == "fsq" and r["archived_tokens"] == 63 and r["window_bytes"] == 0
    assert r["packed_code_bytes_per_token"] == 2 * 8 * 4 / 8  # 2 layers x 8 codes x 4 bits
    with fkvstore.open(tmp_path / "ar" / r["archive"], "r") as ar:
        assert len(ar["codes"]) == 63 and ar["codes"].width == 2 * 8
        assert r["code_bytes_per_token"] == -(-63 // ar["codes"].span) * 16 * 16 / 63
    assert r["compression_vs_fp16"] == res["fp16_bytes_per_token"] / r["code_bytes_per_token"]
    assert r["ppl"] > 1 and r["ppl"] != rows["exact"]["ppl"]
    assert r["decoder_weight_bytes_fp16"] == 2 * 2 * (8 * 64 + 64) * 2
    assert len(list(books.glob("fsq-w8-L16-*"))) == 1  # the conversion is kept ...
    assert adapters_eval.main(args) == 0  # ... and reused: the same scores
    again = {r["config"]: r for r in json.loads(out.read_text())["configs"]}
    assert again["fsq-w8-L16"]["ppl"] == r["ppl"]


def test_cli_fsq_finetuned_config_needs_its_bottleneck(tiny_checkpoint, tmp_path, capsys):
    model_dir, book = tiny_checkpoint
    out = tmp_path / "res.json"
    rc = adapters_eval.main(tiny_eval_args(model_dir, book, out, ["fsq-w8-L16-tau0.25"]))
    assert rc == 2 and "--bottleneck fsq-w8-L16-tau0.25=DIR" in capsys.readouterr().err
    rc = adapters_eval.main(tiny_eval_args(model_dir, book, out, ["fsq-w8-L16"],
                                           "--bottleneck", "fsq-w8-L16=no-such-dir"))
    assert rc == 2 and "must be fsq-wW-LL" in capsys.readouterr().err
    assert not out.exists()
