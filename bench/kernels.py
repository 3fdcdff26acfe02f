"""Benchmark decode attention on RVQ codes against SDPA on the dense fp16 cache.

One query token per sequence, one layer's attention op. For every (model shape, stages,
context, batch) the script times, in the same process with CUDA events
(``triton.testing.do_bench``, median):

* ``rvq``: a Triton kernel variant (``--variant``, default the one-hot kernel) on the coded cache
  (4 exact sinks + archived codes + 32 exact recent), and beside it the variants of
  ``--compare`` (default the atomic kernel; keys ``atomic_ms`` ...);
* ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` on the dense fp16 K/V with the
  backend torch picks, and ``sdpa_flash`` with the flash backend forced (``None`` where it refuses);
* the same three under CUDA-graph replay (``do_bench_cudagraph``), which removes the host's
  launch overhead and leaves the GPU time.

It also measures the device's copy bandwidth, models the bytes each op must move, checks the
kernel against the float32 reference on the GPU, and records the extra peak memory of each op.

    python bench/kernels.py                     # full grid, writes bench/results/kernels.json
    python bench/kernels.py --quick             # a small grid
    python bench/kernels.py --profile bench/results/kernels_profile.json   # per launch
    python bench/kernels.py --plot bench/results/kernels.json   # table + docs/kernels*.png
    python bench/kernels.py --sweep ...          # also split counts and one-hot settings
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = {
    "gpt2": {"q_heads": 12, "kv_heads": 12, "head_dim": 64},
    "qwen3-8b": {"q_heads": 32, "kv_heads": 8, "head_dim": 128},
}
STAGES = [(2, 2), (4, 2)]  # (key stages, value stages)
CODEBOOK_SIZE = 256
SINKS, RECENT = 4, 32


def make_coded_case(shape, stages, context, batch, device, dtype, seed=0, lengths=None):
    """Random coded cache: sinks + archived codes + recent, with the given total context."""
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    hq, hkv, d = shape["q_heads"], shape["kv_heads"], shape["head_dim"]
    key_stages, value_stages = stages
    archived = context - SINKS - RECENT

    def randn(*size, std=1.0):
        return (torch.randn(*size, generator=g, device=device) * std).to(dtype)

    def codes(n_stages):
        return torch.randint(0, CODEBOOK_SIZE, (batch, hkv, archived, n_stages), generator=g,
                             device=device, dtype=torch.int32).to(torch.uint8)

    case = {
        "query": randn(batch, hq, d),
        "key_codes": codes(key_stages),
        "value_codes": codes(value_stages),
        # residual stages shrink, as trained RVQ codebooks do
        "key_codebooks": torch.cat([randn(hkv, 1, CODEBOOK_SIZE, d, std=0.5 ** s)
                                    for s in range(key_stages)], dim=1),
        "value_codebooks": torch.cat([randn(hkv, 1, CODEBOOK_SIZE, d, std=0.5 ** s)
                                      for s in range(value_stages)], dim=1),
        "sink_keys": randn(batch, hkv, SINKS, d),
        "sink_values": randn(batch, hkv, SINKS, d),
        "recent_keys": randn(batch, hkv, RECENT, d),
        "recent_values": randn(batch, hkv, RECENT, d),
    }
    if lengths is not None:
        case["archived_lengths"] = torch.tensor(lengths, device=device)
    return case


def coded_bytes(shape, stages, context, batch):
    """Bytes the kernel must read or write per call (codes, exact tokens, codebooks, scratch)."""
    hq, hkv, d = shape["q_heads"], shape["kv_heads"], shape["head_dim"]
    ks, vs = stages
    archived = context - SINKS - RECENT
    codes = batch * hkv * archived * (ks + vs)
    exact = batch * hkv * (SINKS + RECENT) * d * 2 * 2
    books = hkv * (ks + vs) * CODEBOOK_SIZE * d * 2
    table = batch * hq * ks * CODEBOOK_SIZE * 4 * 2  # written once, read back (L2 mostly)
    return codes + exact + books + table + batch * hq * d * 2 * 2


def dense_bytes(shape, context, batch):
    hq, hkv, d = shape["q_heads"], shape["kv_heads"], shape["head_dim"]
    return batch * hkv * context * d * 2 * 2 + batch * hq * d * 2 * 2


def copy_bandwidth(device):
    """Device-to-device copy of 4 GiB: bytes read plus bytes written per second."""
    import torch
    import triton.testing

    n = 1 << 31
    src = torch.empty(n, dtype=torch.float16, device=device)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=10, rep=200,
                                 return_mode="median")
    src = dst = None
    torch.cuda.empty_cache()
    return 2 * n * 2 / (ms * 1e-3)


def extra_peak_bytes(fn):
    import torch

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def time_ms(fn, graph: bool):
    import triton.testing

    try:
        if graph:
            return triton.testing.do_bench_cudagraph(fn, rep=60, return_mode="median")
        return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")
    except Exception as exc:  # a backend that refuses these shapes
        print(f"  timing failed: {type(exc).__name__}: {str(exc)[:200]}", file=sys.stderr)
        return None


def sdpa_callable(q, k, v, flash: bool):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    gqa = q.shape[1] != k.shape[1]

    def run():
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)

    if not flash:
        return run

    def run_flash():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return run()

    return run_flash


def check_correctness(device):
    """Relative error of each kernel variant against the float32 reference, per shape, stages,
    dtype (batch 4, 8K context, ragged lengths)."""
    import torch

    from kernels import _plan
    from kernels._validate import validate_decode_args
    from kernels.reference import reference_decode_attention
    from kernels.rvq_decode import triton_decode

    rows = []
    for name, shape in SHAPES.items():
        for stages in STAGES:
            for dtype in (torch.float16, torch.bfloat16):
                context, batch = 8192, 4
                lengths = [context - SINKS - RECENT, 5000, 1, 0]
                case = make_coded_case(shape, stages, context, batch, device, dtype, seed=1,
                                       lengths=lengths)
                case["recent_lengths"] = torch.tensor([RECENT, 3, 0, RECENT], device=device)
                ref = reference_decode_attention(**case, out_dtype=torch.float32)
                problem = validate_decode_args(**case)
                for variant in _plan.VARIANTS:
                    try:
                        out = triton_decode(problem, variant=variant)
                    except Exception as exc:  # report, keep measuring the other variant
                        print(f"correctness {variant} failed: {exc!r}"[:2000], file=sys.stderr)
                        rows.append({"shape": name, "variant": variant, "error": repr(exc)[:500]})
                        continue
                    err = ((out.float() - ref).norm() / ref.norm()).item()
                    rows.append({"shape": name, "key_stages": stages[0],
                                 "value_stages": stages[1], "variant": variant,
                                 "dtype": str(dtype).replace("torch.", ""), "rel_error": err,
                                 "nan": bool(out.isnan().any())})
                    print(f"correctness {variant} {name} {stages} {dtype}: rel error {err:.2e}")
    return rows


def run_grid(contexts, batches, device, graphs: bool, variant_under_test: str = "onehot",
             compare=("atomic",), on_row=None):
    """Rows of timings; ``compare``: further kernel variants timed beside the one under test
    (keys ``<variant>_ms``...); ``on_row(results)`` after each row (partial saves)."""
    import torch
    from tqdm import tqdm

    from kernels._validate import validate_decode_args

    results = []
    grid = [(n, c, b) for n in SHAPES for c in contexts for b in batches]
    for name, context, batch in tqdm(grid, desc="configs"):
        shape = SHAPES[name]
        hq, hkv, d = shape["q_heads"], shape["kv_heads"], shape["head_dim"]
        dense_gb = 2 * batch * hkv * context * d * 2 / 1e9
        if dense_gb > 40:
            continue
        row_base = {"shape": name, "context": context, "batch": batch}
        q = torch.randn(batch, hq, 1, d, device=device, dtype=torch.float16)
        k = torch.randn(batch, hkv, context, d, device=device, dtype=torch.float16)
        v = torch.randn_like(k)
        dense = {}
        for label, flash in (("sdpa", False), ("sdpa_flash", True)):
            fn = sdpa_callable(q, k, v, flash)
            try:
                fn()
            except Exception as exc:
                print(f"  {label} refused {name} ctx={context} b={batch}: {exc}"[:300],
                      file=sys.stderr)
                dense[label] = {"ms": None, "graph_ms": None, "extra_peak_bytes": None}
                continue
            dense[label] = {"ms": time_ms(fn, False),
                            "graph_ms": time_ms(fn, True) if graphs else None,
                            "extra_peak_bytes": extra_peak_bytes(fn)}
        del k, v
        torch.cuda.empty_cache()
        for stages in STAGES:
            case = make_coded_case(shape, stages, context, batch, device, torch.float16)
            problem = validate_decode_args(**case, check_codes=False)
            row = dict(row_base, key_stages=stages[0], value_stages=stages[1],
                       rvq_bytes=coded_bytes(shape, stages, context, batch),
                       dense_bytes=dense_bytes(shape, context, batch),
                       coded_cache_bytes=sum(t.numel() * t.element_size()
                                             for t in case.values()),
                       dense_cache_bytes=2 * batch * hkv * context * d * 2)
            # "rvq": the variant under test; "atomic": the histogram-by-atomics baseline
            for prefix, variant in (("rvq", variant_under_test),
                                    *((v, v) for v in compare if v != variant_under_test)):
                row[f"{prefix}_variant"] = variant
                row.update(time_variant(problem, variant, prefix, graphs))
            for label, rec in dense.items():
                row[f"{label}_ms"] = rec["ms"]
                row[f"{label}_graph_ms"] = rec["graph_ms"]
                row[f"{label}_extra_peak_bytes"] = rec["extra_peak_bytes"]
            results.append(row)
            if on_row is not None:
                on_row(results)
            del case, problem
            torch.cuda.empty_cache()
    return results


def time_variant(problem, variant, prefix, graphs):
    """Timings and extra peak memory of one kernel variant (``None`` where it fails)."""
    from kernels.rvq_decode import triton_decode

    def rvq():
        return triton_decode(problem, variant=variant)

    try:
        rvq()
    except Exception as exc:  # report, keep measuring the rest
        print(f"  {variant} failed: {exc!r}"[:2000], file=sys.stderr)
        return {f"{prefix}_ms": None, f"{prefix}_graph_ms": None,
                f"{prefix}_error": repr(exc)[:500]}
    return {f"{prefix}_ms": time_ms(rvq, False),
            f"{prefix}_graph_ms": time_ms(rvq, True) if graphs else None,
            f"{prefix}_extra_peak_bytes": extra_peak_bytes(rvq)}


SWEPT = [("qwen3-8b", (2, 2), 32768, 1), ("qwen3-8b", (2, 2), 131072, 1),
         ("qwen3-8b", (4, 2), 65536, 8), ("qwen3-8b", (2, 2), 131072, 32),
         ("gpt2", (2, 2), 131072, 8)]
TUNINGS = ("default", "no prefetch", "half block", "other table layout", "other centroid block")


def tunings(problem, plan):
    """One-hot kernel settings beside the defaults: no L2 requests ahead (the previous
    kernel), half the positions per step, the score-table layout the plan does not pick, and
    the centroids per program (32 or 64) the kernel does not pick."""
    from kernels import _onehot_plan

    return {"default": {}, "no prefetch": {"prefetch": 0}, "half block": {"block_n": 64},
            "other table layout": {"centroid_major": not plan.centroid_major},
            "other centroid block": {"block_c": 96 - _onehot_plan.default_block_c(problem, plan)}}


def sweep_splits(device, split_factors=(0.5, 1, 2)):
    """CUDA-graph time of the one-hot kernel over split counts (multiples of the chosen one)
    and a few settings, on a few configs."""
    import torch

    from kernels import _onehot, _onehot_plan
    from kernels._plan import split_layout
    from kernels._validate import validate_decode_args

    rows = []
    for name, stages, context, batch in SWEPT:
        case = make_coded_case(SHAPES[name], stages, context, batch, device, torch.float16)
        problem = validate_decode_args(**case, check_codes=False)
        chosen = _onehot_plan.choose_num_splits(problem)
        plan = _onehot_plan.plan_for(problem)
        block_n = plan.block_n
        for factor in split_factors:
            # the count the kernel runs (split lengths are whole blocks)
            splits = split_layout(problem.key_codes.shape[2], max(1, round(chosen * factor)),
                                  block_n)[1]
            for label, tuning in tunings(problem, plan).items():

                def fn(splits=splits, tuning=tuning, problem=problem):
                    return _onehot.decode(problem, num_splits=splits, **tuning)

                try:
                    fn()
                    ms = time_ms(fn, True)
                except Exception as exc:
                    print(f"  sweep failed: {exc!r}"[:1000], file=sys.stderr)
                    ms = None
                rows.append({"shape": name, "key_stages": stages[0], "value_stages": stages[1],
                             "context": context, "batch": batch, "split_factor": factor,
                             "num_splits": splits, "setting": label, **tuning,
                             "graph_ms": ms})
                print(f"sweep {name} {stages} ctx={context} b={batch} splits={splits} "
                      f"(x{factor}) {label}: {fmt(ms)} ms", flush=True)
        del case, problem
        torch.cuda.empty_cache()
    return rows


def speedup(row, base="sdpa", graph=False):
    suffix = "_graph_ms" if graph else "_ms"
    ours, theirs = row[f"rvq{suffix}"], row[f"{base}{suffix}"]
    if not ours or not theirs:
        return None
    return theirs / ours


def print_sweep_table(data):
    """The sweep as a markdown table: one row per config, one column per split multiple and
    setting (CUDA-graph ms; the chosen split count in the config cell)."""
    sweep = [r for r in data.get("sweep") or () if "split_factor" in r]
    if not sweep:  # none, or an older sweep format
        return
    columns = sorted({(r["split_factor"], r["setting"]) for r in sweep},
                     key=lambda c: (c[0], TUNINGS.index(c[1])))
    print("| config | " + " | ".join(f"x{f:g} splits, {label}" for f, label in columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    configs = sorted({(r["shape"], r["key_stages"], r["value_stages"], r["context"], r["batch"])
                      for r in sweep}, key=lambda c: (c[0], c[4], c[3], c[1]))
    for shape, ks, vs, context, batch in configs:
        rows = [r for r in sweep if (r["shape"], r["key_stages"], r["value_stages"],
                                     r["context"], r["batch"]) == (shape, ks, vs, context, batch)]
        ms = {(r["split_factor"], r["setting"]): r["graph_ms"] for r in rows}
        chosen = next((r["num_splits"] for r in rows if r["split_factor"] == 1), "?")
        cells = [fmt(ms.get(c)) for c in columns]
        print(f"| {shape} {ks}+{vs}, {context // 1024}K, batch {batch} ({chosen} splits) | "
              + " | ".join(cells) + " |")


def default_variant(row):
    """The kernel ``choose_variant`` runs for a result row's shape and batch."""
    from kernels._plan import variant_for

    shape = SHAPES[row["shape"]]
    return variant_for(shape["q_heads"] // shape["kv_heads"], row["batch"])


def default_graph_ms(row):
    """CUDA-graph ms of the default kernel in a result row (None if it was not timed)."""
    default = default_variant(row)
    return row["rvq_graph_ms"] if row["rvq_variant"] == default else row.get(
        f"{default}_graph_ms")


def print_table(data, min_context=0):
    """A markdown table of the results (speed-ups are SDPA time / kernel time)."""
    bw = data["copy_bandwidth_bytes_per_s"]
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s (read + write)\n")
    head = ("shape", "K+V stages", "context", "batch", "RVQ ms", "SDPA ms", "flash ms",
            "x SDPA", "x flash", "RVQ graph ms", "SDPA graph ms", "x SDPA graph",
            "atomic graph ms", "x atomic graph", "B/token RVQ", "B/token dense",
            "RVQ roofline ms", "default", "x SDPA graph, default")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in data["results"]:
        if r["context"] < min_context:
            continue
        tokens = r["context"] * r["batch"]
        atomic = r.get("atomic_graph_ms")
        cells = [r["shape"], f"{r['key_stages']}+{r['value_stages']}", r["context"], r["batch"],
                 fmt(r["rvq_ms"]), fmt(r["sdpa_ms"]), fmt(r["sdpa_flash_ms"]),
                 fmt(speedup(r), 2), fmt(speedup(r, "sdpa_flash"), 2),
                 fmt(r["rvq_graph_ms"]), fmt(r["sdpa_graph_ms"]),
                 fmt(speedup(r, graph=True), 2), fmt(atomic),
                 fmt(atomic / r["rvq_graph_ms"] if atomic and r["rvq_graph_ms"] else None, 2),
                 fmt(r["rvq_bytes"] / tokens, 1), fmt(r["dense_bytes"] / tokens, 0),
                 fmt(r["rvq_bytes"] / bw * 1e3, 4)]
        default, ms = default_variant(r), default_graph_ms(r)
        cells += [default, fmt(r["sdpa_graph_ms"] / ms if ms and r["sdpa_graph_ms"] else None, 2)]
        print("| " + " | ".join(str(c) for c in cells) + " |")


def print_memory_table(data, min_context=0):
    """Device memory each op needs: its cache plus the extra peak of one call, in MB."""
    head = ("shape", "K+V stages", "context", "batch", "coded cache MB", "one-hot extra MB",
            "atomic extra MB", "dense cache MB", "SDPA extra MB", "dense / coded, default")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in data["results"]:
        if r["context"] < min_context:
            continue
        default = default_variant(r)
        extra = {"onehot": r.get("rvq_extra_peak_bytes"),
                 "atomic": r.get("atomic_extra_peak_bytes")}
        coded = r["coded_cache_bytes"] + (extra[default] or 0)
        dense = r["dense_cache_bytes"] + (r.get("sdpa_extra_peak_bytes") or 0)
        cells = [r["shape"], f"{r['key_stages']}+{r['value_stages']}", r["context"], r["batch"],
                 fmt(r["coded_cache_bytes"] / 1e6, 1), fmt(_mb(extra["onehot"]), 1),
                 fmt(_mb(extra["atomic"]), 1), fmt(r["dense_cache_bytes"] / 1e6, 0),
                 fmt(_mb(r.get("sdpa_extra_peak_bytes")), 2), fmt(dense / coded, 0)]
        print("| " + " | ".join(str(c) for c in cells) + " |")


def _mb(x):
    return None if x is None else x / 1e6


def fmt(x, digits=3):
    return "-" if x is None else f"{x:.{digits}f}"


def plot(data, figure, graph=False):
    """Throughput against context, one panel per (shape, batch); ``graph``: CUDA-graph timings."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    suffix = "_graph_ms" if graph else "_ms"
    batches = sorted({r["batch"] for r in data["results"]})
    fig, axes = plt.subplots(len(SHAPES), len(batches), figsize=(4 * len(batches), 7),
                             squeeze=False, sharex=True)
    for i, name in enumerate(SHAPES):
        for j, batch in enumerate(batches):
            ax = axes[i][j]
            rows = [r for r in data["results"] if r["shape"] == name and r["batch"] == batch]
            for stages in STAGES:
                sel = [r for r in rows if (r["key_stages"], r["value_stages"]) == stages]
                for prefix, style, what in (("rvq", "o-", "one-hot"), ("atomic", "x:", "atomic")):
                    pts = [(r["context"], batch / (r[f"{prefix}{suffix}"] * 1e-3)) for r in sel
                           if r.get(f"{prefix}{suffix}")]
                    if pts:
                        ax.plot([x for x, _ in pts], [y for _, y in pts], style,
                                label=f"RVQ {what} {stages[0]}+{stages[1]}")
            sel = [r for r in rows if (r["key_stages"], r["value_stages"]) == STAGES[0]]
            for key, label in ((f"sdpa{suffix}", "SDPA dense fp16"),
                               (f"sdpa_flash{suffix}", "SDPA flash dense fp16")):
                pts = [(r["context"], batch / (r[key] * 1e-3)) for r in sel if r[key]]
                if pts:
                    ax.plot([x for x, _ in pts], [y for _, y in pts], "s--", label=label)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{name}, batch {batch}")
            ax.grid(True, which="both", alpha=0.3)
            if i == len(SHAPES) - 1:
                ax.set_xlabel("context (tokens)")
            if j == 0:
                ax.set_ylabel("sequences / s (one layer)")
    axes[0][0].legend(fontsize=7)
    timing = "CUDA-graph replay" if graph else "do_bench, launches from Python"
    fig.suptitle(f"Decode attention ({timing}), {data['device']}, {data['date']}")
    fig.tight_layout()
    fig.savefig(figure, dpi=110)
    print(f"wrote {figure}")


def plot_speedup(data, figure, min_context=0):
    """CUDA-graph speed-up of the default kernel over SDPA per configuration, against 2x."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in data["results"] if r["context"] >= min_context]
    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(1, len(SHAPES), figsize=(6 * len(SHAPES), 4), squeeze=False,
                             sharey=True)
    for ax, name in zip(axes[0], SHAPES, strict=True):
        labels, groups = [], []
        for stages in STAGES:
            for context in sorted({r["context"] for r in rows}):
                labels.append(f"{stages[0]}+{stages[1]}\n{context // 1024}K")
                sel = {r["batch"]: r for r in rows if r["shape"] == name
                       and r["context"] == context
                       and (r["key_stages"], r["value_stages"]) == stages}
                groups.append(sel)
        width = 0.8 / len(batches)
        for k, batch in enumerate(batches):
            ys = []
            for sel in groups:
                r = sel.get(batch)
                ms = default_graph_ms(r) if r is not None else None
                ys.append(r["sdpa_graph_ms"] / ms if r is not None and ms else 0.0)
            ax.bar([i + (k - (len(batches) - 1) / 2) * width for i in range(len(groups))], ys,
                   width, label=f"batch {batch}")
        ax.axhline(2.0, color="k", linestyle="--", linewidth=1, label="target 2x")
        ax.axhline(1.0, color="grey", linestyle=":", linewidth=1)
        ax.set_xticks(range(len(groups)), labels, fontsize=8)
        ax.set_title(f"{name} (the default kernel per batch)")
        ax.grid(True, axis="y", alpha=0.3)
    axes[0][0].set_ylabel("SDPA time / kernel time (CUDA graphs)")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"Decode attention on codes against dense SDPA, {data['device']}, {data['date']}")
    fig.tight_layout()
    fig.savefig(figure, dpi=110)
    print(f"wrote {figure}")


PROFILED = [("qwen3-8b", (2, 2), 32768, 1), ("qwen3-8b", (2, 2), 131072, 1),
            ("qwen3-8b", (2, 2), 32768, 8), ("qwen3-8b", (2, 2), 32768, 32),
            ("qwen3-8b", (4, 2), 32768, 32), ("qwen3-8b", (2, 2), 131072, 32),
            ("gpt2", (2, 2), 32768, 8)]


def profile_launches(out_path):
    """GPU time of each launch of both kernels: torch.profiler over 20 replays of a CUDA graph
    of one call (us per call), beside the call's CUDA-graph median (``time_ms``)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from kernels import _plan
    from kernels._validate import validate_decode_args
    from kernels.rvq_decode import triton_decode

    device = torch.device("cuda")
    rows = []
    for name, stages, context, batch in PROFILED:
        case = make_coded_case(SHAPES[name], stages, context, batch, device, torch.float16)
        problem = validate_decode_args(**case, check_codes=False)
        for variant in _plan.VARIANTS:
            def call(problem=problem, variant=variant):
                return triton_decode(problem, variant=variant)

            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):  # compile and warm up outside the capture
                    call()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                call()
            for _ in range(5):
                graph.replay()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(20):
                    graph.replay()
                torch.cuda.synchronize()
            launches = {e.key: e.device_time_total / 20 for e in prof.key_averages()
                        if e.key.endswith("_kernel") and e.count}
            graph_us = time_ms(call, True) * 1000
            rows.append({"shape": name, "context": context, "batch": batch,
                         "key_stages": stages[0], "value_stages": stages[1],
                         "variant": variant, "kernels_us": launches, "graph_us": graph_us})
            print(variant, name, stages, context, batch,
                  {k: round(v, 1) for k, v in launches.items()}, f"graph {graph_us:.1f} us")
    data = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "device": torch.cuda.get_device_name(device),
            "method": "torch.profiler CUDA time per call over 20 replays of a CUDA graph of one "
                      "call; graph_us: do_bench_cudagraph median of the call",
            "results": rows}
    Path(out_path).write_text(json.dumps(data, indent=1))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="bench/results/kernels.json")
    parser.add_argument("--quick", action="store_true", help="a small grid")
    parser.add_argument("--contexts", type=int, nargs="*")
    parser.add_argument("--batches", type=int, nargs="*")
    parser.add_argument("--no-graphs", action="store_true", help="skip CUDA-graph timings")
    parser.add_argument("--plot", metavar="JSON", help="only draw the figure from a results file")
    parser.add_argument("--figure", default="docs/kernels.png")
    parser.add_argument("--min-context", type=int, default=0, help="table rows from this context")
    parser.add_argument("--graph-figure", default="docs/kernels_graph.png")
    parser.add_argument("--speedup-figure", default="docs/kernels_speedup.png")
    parser.add_argument("--variant", default="onehot", help="kernel variant under test")
    parser.add_argument("--compare", nargs="*", default=["atomic"],
                        help="variants timed beside it")
    parser.add_argument("--sweep", action="store_true",
                        help="also time the one-hot kernel over split counts and settings")
    parser.add_argument("--skip-correctness", action="store_true")
    parser.add_argument("--profile", metavar="JSON",
                        help="only time each of the kernel's launches on a few configurations")
    args = parser.parse_args(argv)

    if args.plot:
        data = json.loads(Path(args.plot).read_text())
        print_table(data, args.min_context)
        print()
        print_memory_table(data, args.min_context)
        print()
        print_sweep_table(data)
        plot(data, args.figure)
        plot(data, args.graph_figure, graph=True)
        plot_speedup(data, args.speedup_figure, args.min_context)
        return
    if args.profile:
        profile_launches(args.profile)
        return

    import torch
    import triton

    if not torch.cuda.is_available():
        raise SystemExit("bench/kernels.py needs a CUDA GPU")
    device = torch.device("cuda")
    contexts = args.contexts or ([4096, 32768] if args.quick else
                                 [4096, 16384, 32768, 65536, 131072])
    batches = args.batches or ([1, 8] if args.quick else [1, 8, 32])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    data = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "codebook_size": CODEBOOK_SIZE,
        "sinks": SINKS,
        "recent": RECENT,
        "variant": args.variant,
        "copy_bandwidth_bytes_per_s": copy_bandwidth(device),
        "results": [],
    }

    def save(results=None):
        if results is not None:
            data["results"] = results
        out.write_text(json.dumps(data, indent=1))

    data["correctness"] = [] if args.skip_correctness else check_correctness(device)
    save()
    run_grid(contexts, batches, device, graphs=not args.no_graphs,
             variant_under_test=args.variant, compare=args.compare, on_row=save)
    if args.sweep:
        data["sweep"] = sweep_splits(device)
        save()
    print_table(data)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
