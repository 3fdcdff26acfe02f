"""Suffix search on the archive's walk: the paper's Figure 3, precision/recall, and latency.

1. Decay law on The Time Machine: distance between two positions' walk points against the length
   of their common suffix (with the r**l bound), both geometries -> docs/figures/search_decay.png
2. Precision and recall of the raw ball query (float64 and float32 points) per query length, and
   after verification (fkvstore's search) -> docs/figures/search_precision.png
3. Query latency at 1e5, 1e6, 1e7 positions for queries of length 8-12 drawn from the text,
   against a Python `bytes.find` loop and a suffix array (pydivsufsort), same run; index build
   time and memory per position. The stream is the book followed by i.i.d. bytes drawn from the
   book's own byte frequencies, so hit counts stay bounded as the stream grows.

Prints tables, writes bench/results/search.json.  python bench/search.py [--quick]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
from _common import add_out_option, machine, markdown_table, out_name, write_json  # noqa: E402
from scipy.spatial import cKDTree  # noqa: E402

from fkvstore.codec import Codec  # noqa: E402
from fkvstore.index import SuffixIndex  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TEXT = ROOT / "fkvstore" / "data" / "the_time_machine.txt"
FIGURES = ROOT / "docs" / "figures"


def book() -> bytes:
    raw = TEXT.read_bytes()
    start = raw.index(b"*** START OF")
    start = raw.index(b"\n", start) + 1
    return raw[start:raw.index(b"*** END OF")]


def common_suffix(a: np.ndarray, p: int, q: int, cap: int = 60) -> int:
    n = 0
    while n < cap and p - n >= 0 and q - n >= 0 and a[p - n] == a[q - n]:
        n += 1
    return n


def decay(text: np.ndarray, rng) -> dict:
    """Pairs of positions: common suffix length vs walk distance."""
    out = {}
    for geometry in ("grid", "ring"):
        codec = Codec(256, geometry)
        walk = codec.walk(text)
        index = SuffixIndex.build(codec, text)
        pairs = []
        # random pairs are mostly length 0-1; add pairs that share long suffixes (repeats)
        for p, q in rng.integers(0, len(text), (20000, 2)):
            pairs.append((int(p), int(q)))
        for end in rng.integers(20, len(text), 600):
            for ell in (2, 4, 8, 12):
                hits = index.search(text[end - ell:end])
                if len(hits) > 1:
                    pairs.append((int(hits[0]), int(hits[-1])))
        lengths = np.array([common_suffix(text, p, q) for p, q in pairs])
        dist = np.array([np.hypot(*(walk[p] - walk[q])) for p, q in pairs])
        keep = dist > 0
        per_len = {}
        for ell in range(0, 16):
            sel = keep & (lengths == ell)
            if sel.sum():
                per_len[ell] = {"pairs": int(sel.sum()),
                                "max_distance": float(dist[sel].max()),
                                "median_distance": float(np.median(dist[sel])),
                                "bound": codec.ratio**ell * codec.walk_radius * 2}
        out[geometry] = {"ratio": codec.ratio, "lengths": lengths[keep].tolist(),
                         "distances": dist[keep].tolist(), "per_length": per_len}
    return out


def precision_recall(text: np.ndarray, rng, lengths) -> list[dict]:
    rows = []
    truth_cache = {}
    for geometry in ("grid", "ring"):
        codec = Codec(256, geometry)
        walk = codec.walk(text)
        index = SuffixIndex.build(codec, text)
        trees = {"float64": cKDTree(walk), "float32": cKDTree(walk.astype(np.float32))}
        for ell in lengths:
            stats = {k: [0, 0, 0] for k in ("float64", "float32", "verified")}  # tp, cand, true
            for end in rng.integers(ell, len(text), 40):
                q = text[end - ell:end]
                key = q.tobytes()
                if key not in truth_cache:
                    truth_cache[key] = set(_find_all(text.tobytes(), key, ell))
                truth = truth_cache[key]
                qp = codec.walk(q)[-1]
                radius = codec.ratio**ell * codec.walk_radius
                for name, tree in trees.items():
                    point = qp.astype(np.float32) if name == "float32" else qp
                    got = set(tree.query_ball_point(point, radius))
                    stats[name][0] += len(got & truth)
                    stats[name][1] += len(got)
                    stats[name][2] += len(truth)
                got = set(index.search(q).tolist())
                stats["verified"][0] += len(got & truth)
                stats["verified"][1] += len(got)
                stats["verified"][2] += len(truth)
            row = {"geometry": geometry, "length": ell}
            for name, (tp, cand, true) in stats.items():
                row[f"{name}_precision"] = tp / cand if cand else 1.0
                row[f"{name}_recall"] = tp / true if true else 1.0
            rows.append(row)
    return rows


def _find_all(data: bytes, query: bytes, ell: int) -> list[int]:
    out, i = [], data.find(query)
    while i >= 0:
        out.append(i + ell - 1)
        i = data.find(query, i + 1)
    return out


def latency(text: np.ndarray, sizes, rng, n_queries: int) -> list[dict]:
    from pydivsufsort import divsufsort, sa_search

    freq = np.bincount(text, minlength=256) / len(text)
    for geometry in ("grid", "ring"):  # compile every kernel before timing anything
        SuffixIndex.build(Codec(256, geometry), text[:5000]).search(text[100:110])
    rows = []
    for size in sizes:
        body = text[:size]
        if size > len(text):
            filler = rng.choice(256, size - len(text), p=freq).astype(np.uint8)
            body = np.concatenate([text, filler])
        body = body.copy()  # writable: pydivsufsort needs it
        data = body.tobytes()
        queries = []
        for _ in range(n_queries):
            ell = int(rng.integers(8, 13))
            end = int(rng.integers(ell, min(len(text), size)))
            queries.append(body[end - ell:end].copy())
        for geometry in ("grid", "ring"):
            codec = Codec(256, geometry)
            t0 = time.perf_counter()
            index = SuffixIndex.build(codec, body)
            build = time.perf_counter() - t0
            for q in queries[:20]:
                index.search(q)
            times, hits = [], []
            for q in queries:
                t0 = time.perf_counter()
                h = index.search(q)
                times.append(time.perf_counter() - t0)
                hits.append(len(h))
            rows.append(_row(size, f"fkvstore {geometry}", times, hits, build,
                             index.nbytes() / size))
            del index
        # baselines on the same bytes and queries
        times, hits = [], []
        for q in queries:
            qb = q.tobytes()
            t0 = time.perf_counter()
            h = _find_all(data, qb, len(qb))
            times.append(time.perf_counter() - t0)
            hits.append(len(h))
        rows.append(_row(size, "bytes.find loop", times, hits, 0.0, 1.0))
        t0 = time.perf_counter()
        sa = divsufsort(body)
        build = time.perf_counter() - t0
        times, hits = [], []
        for q in queries:
            t0 = time.perf_counter()
            count, left = sa_search(body, sa, q)
            h = np.sort(sa[left:left + count]) + (len(q) - 1) if count else np.empty(0)
            times.append(time.perf_counter() - t0)
            hits.append(len(h))
        rows.append(_row(size, "suffix array (divsufsort)", times, hits, build,
                         (sa.nbytes + body.nbytes) / size))
        print(f"  {size:,} positions done", file=sys.stderr)
    return rows


def _row(size, method, times, hits, build, bytes_per_pos) -> dict:
    return {"positions": size, "method": method,
            "p50_us": float(np.median(times)) * 1e6,
            "p99_us": float(np.percentile(times, 99)) * 1e6,
            "hits_median": float(np.median(hits)), "hits_max": int(np.max(hits)),
            "build_s": build, "build_s_per_1e6": build / size * 1e6,
            "bytes_per_position": bytes_per_pos}


def reopen(text: np.ndarray, size: int) -> dict:
    """First query after opening an archive: index built from the archive vs restored."""
    import tempfile

    import fkvstore

    data = np.resize(text, size)
    out = {"positions": size}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "reopen.h5"
        with fkvstore.open(path, "w") as ar:
            ar.create_text_stream("t").extend(data)
        out["file_bytes"] = path.stat().st_size
        for label in ("built", "restored"):
            if label == "restored":
                with fkvstore.open(path, "a") as ar:
                    ar["t"].build_index(persist=True)
                out["file_bytes_with_index"] = path.stat().st_size
            with fkvstore.open(path) as ar:
                t0 = time.perf_counter()
                ar["t"].search(b"Weena")
                out[f"first_query_s_{label}"] = time.perf_counter() - t0
    return out


def plots(dec: dict, pr: list[dict], lat: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    FIGURES.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, (geometry, d) in zip(axes, dec.items(), strict=True):
        lengths = np.array(d["lengths"])
        dist = np.array(d["distances"])
        jitter = np.random.default_rng(0).uniform(-0.2, 0.2, len(lengths))
        ax.scatter(lengths + jitter, dist, s=2, alpha=0.3, label="pairs of positions")
        ell = np.arange(0, lengths.max() + 1)
        radius = np.sqrt(2) if geometry == "grid" else 1.0
        ax.plot(ell, 2 * radius * d["ratio"] ** ell, "r-", label="bound 2R·r^ℓ")
        ax.set_yscale("log")
        ax.set_xlabel("common suffix length ℓ")
        ax.set_ylabel("walk distance")
        ax.set_title(f"{geometry} (r = {d['ratio']:.4g})")
        ax.legend(loc="lower left")
    fig.suptitle("The Time Machine: distance between walk points decays as r^ℓ")
    fig.tight_layout()
    fig.savefig(FIGURES / "search_decay.png", dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, geometry in zip(axes, ("grid", "ring"), strict=True):
        rows = [r for r in pr if r["geometry"] == geometry]
        x = [r["length"] for r in rows]
        for name, style in (("float64", "-"), ("float32", "--"), ("verified", ":")):
            ax.plot(x, [r[f"{name}_precision"] for r in rows], style, marker="o", ms=3,
                    label=f"{name} precision")
            ax.plot(x, [r[f"{name}_recall"] for r in rows], style, marker="x", ms=3,
                    label=f"{name} recall")
        ax.set_xscale("log")
        ax.set_xlabel("query length")
        ax.set_title(geometry)
        ax.set_ylim(-0.02, 1.05)
    axes[0].set_ylabel("precision / recall")
    axes[1].legend(fontsize=8, loc="lower left")
    fig.suptitle("Raw ball query vs verified search")
    fig.tight_layout()
    fig.savefig(FIGURES / "search_precision.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for method in dict.fromkeys(r["method"] for r in lat):
        rows = [r for r in lat if r["method"] == method]
        ax.plot([r["positions"] for r in rows], [r["p50_us"] for r in rows], marker="o",
                label=method)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("positions")
    ax.set_ylabel("median query latency (µs)")
    ax.set_title("Queries of length 8-12 from the text")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(FIGURES / "search_latency.png", dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true",
                    help="small sizes (a smoke run; the docs' figures are left alone)")
    add_out_option(ap, "search")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    text = np.frombuffer(book(), dtype=np.uint8)
    sizes = [10**5, 10**6] if args.quick else [10**5, 10**6, 10**7]
    lengths = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64]
    dec = decay(text, rng)
    pr = precision_recall(text, rng, lengths)
    lat = latency(text, sizes, rng, 300 if args.quick else 2000)
    reo = reopen(text, 10**5 if args.quick else 10**6)
    print("\n## Precision / recall per query length")
    print(markdown_table(pr, [("geometry", "geometry"), ("length", "ℓ"),
                              ("float64_precision", "raw f64 P"), ("float64_recall", "raw f64 R"),
                              ("float32_precision", "raw f32 P"), ("float32_recall", "raw f32 R"),
                              ("verified_precision", "verified P"),
                              ("verified_recall", "verified R")]))
    print("\n## Latency (queries of length 8-12)")
    print(markdown_table(lat, [("positions", "positions"), ("method", "method"),
                               ("p50_us", "p50 µs"), ("p99_us", "p99 µs"),
                               ("hits_median", "hits p50"), ("hits_max", "hits max"),
                               ("build_s", "build s"), ("bytes_per_position", "B/position")]))
    for size in sizes:
        by = {r["method"]: r for r in lat if r["positions"] == size}
        for geometry in ("grid", "ring"):
            ours = by[f"fkvstore {geometry}"]["p50_us"]
            print(f"{size:>10,} {geometry}: {by['bytes.find loop']['p50_us'] / ours:.1f}x the "
                  f"bytes.find loop, {ours / by['suffix array (divsufsort)']['p50_us']:.2f}x the "
                  "suffix array's latency")
    print(f"\nfirst query after open, {reo['positions']:,} positions: "
          f"{reo['first_query_s_built']:.3f} s building the index, "
          f"{reo['first_query_s_restored']:.3f} s restoring it; file "
          f"{reo['file_bytes'] / 1e6:.1f} MB -> {reo['file_bytes_with_index'] / 1e6:.1f} MB")
    info = machine()
    print(f"\n{info['cpu']}, {info['cores']} cores, Python {info['python']}, {info['date']}")
    summary = {g: d["per_length"] for g, d in dec.items()}
    write_json(out_name(args, "search"),
               {"machine": info, "decay": summary, "precision_recall": pr, "latency": lat,
                "reopen": reo})
    if not args.quick:  # the figures in docs/ come from full runs
        plots(dec, pr, lat)


if __name__ == "__main__":
    main()
