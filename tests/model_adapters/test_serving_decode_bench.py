"""``bench/serving_decode.py``'s capacity-at-a-budget section on the CPU: the positions it
gives each cache fit the budget, ``generate`` runs on both caches there, and the results are
written even when the deadline skips the measurements."""

import json

import pytest
from bench_scripts import bench_script

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")



@pytest.fixture(scope="module")
def bench():
    return bench_script("serving_decode")


SMALL = ["--device", "cpu", "--small", "--layers", "1", "--skip", "kernel", "grid",
         "generate", "--budget-gib", "0.003", "--budget-batch", "2", "--generate-tokens", "1",
         "3"]


def test_budget_points_fit_the_budget(bench):
    """The codes-only cache built at the budget's capacity, with its encoder tables, and the
    dense cache at its context stay within the budget; one position more per sequence would
    not fit the dense cache."""
    model = bench.qwen3_8b_shapes(1, "cpu", torch.bfloat16, hidden=256, heads=(4, 2),
                                  head_dim=64, vocab=1000)
    shape = bench.kv_shape(model)
    q = bench.random_quantizer(model, "cpu")
    budget = int(0.003 * 2**30)
    dense, codes = bench.budget_points(shape, q, 0.003, 2)
    per_token = 2 * shape.num_layers * 2 * shape.kv_heads * shape.head_dim * 2
    assert dense["context"] * per_token <= budget < (dense["context"] + 1) * per_token
    bench.use_codes_attention(model)
    cache = bench.CodesOnlyCache(model, q, sinks=bench.SINKS, recent=bench.RECENT,
                                 capacity=codes["context"])
    bench._synthetic_codes(cache, shape, 2, codes["context"] - 8, "cpu", torch.bfloat16)
    tables = sum(t.untyped_storage().nbytes() for layer in range(shape.num_layers)
                 for t in q.table_tensors(layer))
    assert tables > 0
    assert cache.live_bytes()["total"] + tables <= budget
    assert codes["tokens_held"] == 2 * codes["context"] > 10 * dense["tokens_held"]


def test_budget_section_runs_generate_on_both_caches(bench, tmp_path):
    out = tmp_path / "budget"
    bench.main([*SMALL, "--out", str(out)])
    rows = json.loads(out.with_suffix(".json").read_text())["budget"]
    assert [r["path"] for r in rows] == ["dynamic-flash", "codes-compiled"]
    for row in rows:
        assert "error" not in row, row
        assert row["generate_tok_s"] > 0 and row["filled_to"] < row["context"]
    assert rows[1]["vs_dense"] == rows[1]["context"] / rows[0]["context"] > 10


def test_budget_section_past_the_deadline_reports_skips(bench, tmp_path):
    out = tmp_path / "late"
    bench.main([*SMALL, "--deadline-s", "0", "--out", str(out)])
    rows = json.loads(out.with_suffix(".json").read_text())["budget"]
    assert [r["error"] for r in rows] == ["skipped (out of time)"] * 2
    assert rows[1]["tokens_held"] > 10 * rows[0]["tokens_held"]


def test_fsq_paths_run_in_the_grid(bench, tmp_path):
    """``--fsq``: the converted model's eager, launched, growing and compiled paths decode at a
    grid point (CPU: the compiled path traced, the kernel's torch path)."""
    out = tmp_path / "fsq"
    bench.main(["--device", "cpu", "--small", "--layers", "1", "--skip", "kernel", "budget",
                "generate", "--points", "64:1", "--compiled-points", "64:1", "--steps", "1",
                "--fsq", "fsq-w16-L16", "--out", str(out)])
    rows = {r["path"]: r for r in json.loads(out.with_suffix(".json").read_text())["rows"]}
    for path in (*bench.FSQ_EAGER, *bench.FSQ_COMPILED):
        assert "error" not in rows[path], rows[path]
        assert rows[path]["tok_s"] > 0 and rows[path]["cache_GiB"] > 0
