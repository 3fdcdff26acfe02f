"""Search across many archives (fkvstore.Collection): in-process, and on Dask with 1 and 2 workers.

1. Creates ``--archives`` archives of ``--tokens`` token ids each (one width-1 stream "tokens",
   vocabulary 32000): a shared 200-token system prompt, then tokens with Zipf-like frequencies
   (p ~ 1/(rank+10)^1.1) and, every ~2000 tokens, a copy of an earlier span of the same archive
   (a session quoting itself). Cached under ``--dir`` (a manifest records the parameters);
   generation time is reported.
2. Draws ``--queries`` queries of 4-32 tokens from random positions of random archives.
3. For each mode (in-process, Dask LocalCluster with 1 worker, with 2 worker processes of one
   thread each): warm-up (open + index build, per-archive cost, RSS and index bytes per worker),
   warm single-query latency p50/p90, throughput of all queries through ``search_many``
   (batches of ``--batch``, all in flight) and through 2 client threads issuing single
   ``search`` calls (2 in flight). Every mode's results are checked against the in-process one.
   Then ``--rounds`` interleaved batched runs of 1 and 2 workers (both clusters warm), with the
   CPU time each worker got: on a shared machine, the fair comparison.
4. Extrapolates to a 10-machine cluster from the measured per-archive costs.

``--remote``: the same archives published (``fkvstore.copy``) to moto's S3 server, started here
on 127.0.0.1 with IAM authentication on (tests/support/s3_server.py, the ``remote`` and ``test``
extras); steps 3 on their URLs, with the requests the server answered during warm-up and during
the timed queries; results checked against the local in-process run.

Prints tables, writes bench/results/collection.json (collection-remote.json with --remote).
python bench/collection.py [--dir DIR] [--quick] [--remote]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))  # S3 server

import numpy as np  # noqa: E402
from _common import add_out_option, machine, markdown_table, out_name, write_json  # noqa: E402

import fkvstore  # noqa: E402

VOCAB = 32000
PROMPT = 200
STREAM = "tokens"


# ------------------------------------------------------------------------------------ archives
def _tokens(i: int, n: int, seed: int) -> np.ndarray:
    prompt = np.random.default_rng(seed).integers(0, VOCAB, PROMPT)
    rng = np.random.default_rng([seed, i])
    p = 1.0 / (np.arange(VOCAB) + 10.0) ** 1.1
    toks = rng.choice(VOCAB, n, p=p / p.sum())
    toks[:PROMPT] = prompt[: min(PROMPT, n)]
    for start in range(2000, n - 600, 2000):  # a session quoting its own past
        L = int(rng.integers(50, 500))
        src = int(rng.integers(0, start - L))
        toks[start:start + L] = toks[src:src + L]
    return toks


def _write(path: str, i: int, n: int, seed: int) -> float:
    t = time.perf_counter()
    tmp = path + ".part"
    with fkvstore.open(tmp, "w") as ar:
        ar.create_stream(STREAM, alphabet_size=VOCAB).extend(_tokens(i, n, seed)[:, None])
    os.replace(tmp, path)
    return time.perf_counter() - t


def archives(root: Path, count: int, n: int, seed: int, procs: int) -> tuple[list[str], dict]:
    """The archive paths (created if the cache under ``root`` does not match) and what it took."""
    root.mkdir(parents=True, exist_ok=True)
    manifest = root / "manifest.json"
    want = {"archives": count, "tokens": n, "seed": seed, "vocab": VOCAB, "format": 1}
    paths = [str(root / f"session-{i:04d}.h5") for i in range(count)]
    if (manifest.exists() and json.loads(manifest.read_text()) == want
            and all(os.path.exists(p) for p in paths)):
        return paths, {"cached": True, "seconds": 0.0}
    manifest.unlink(missing_ok=True)
    t = time.perf_counter()
    with ProcessPoolExecutor(procs) as pool:
        per = list(pool.map(_write, paths, range(count), [n] * count, [seed] * count))
    manifest.write_text(json.dumps(want))
    return paths, {"cached": False, "seconds": time.perf_counter() - t,
                   "per_archive_s": statistics.mean(per), "processes": procs,
                   "bytes_per_archive": statistics.mean(os.path.getsize(p) for p in paths)}


def draw_queries(paths: list[str], count: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng([seed, 1])
    out = []
    for _ in range(count):
        L = int(rng.integers(4, 33))
        with fkvstore.open(paths[int(rng.integers(len(paths)))]) as ar:
            s = ar[STREAM]
            end = int(rng.integers(L, len(s) + 1))
            out.append(s.read(end - L, end)[:, 0].astype(np.int64))
    return out


def persisted_restore(paths: list[str]) -> dict:
    """Per-archive warm-up when the index was stored with build_index(persist=True), against
    building it, on copies of ``paths`` (the cached archives stay as generated)."""
    import shutil

    build, restore, growth = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for k, src in enumerate(paths):
            dst = os.path.join(tmp, f"copy-{k}.h5")
            shutil.copyfile(src, dst)
            size = os.path.getsize(dst)
            t = time.perf_counter()
            with fkvstore.open(dst) as ar:
                ar[STREAM].build_index()
            build.append(time.perf_counter() - t)
            with fkvstore.open(dst, "r+") as ar:
                ar[STREAM].build_index(persist=True)
            growth.append(os.path.getsize(dst) - size)
            t = time.perf_counter()
            with fkvstore.open(dst) as ar:
                ar[STREAM].build_index()
            restore.append(time.perf_counter() - t)
    return {"archives": len(paths), "build_s": statistics.median(build),
            "restore_s": statistics.median(restore),
            "file_growth_bytes": statistics.median(growth)}


# -------------------------------------------------------------------------------- measurements
def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        x.archive == y.archive and x.stream == y.stream and np.array_equal(x.positions, y.positions)
        for x, y in zip(a, b, strict=True))


def measure(coll, queries: list, latency_n: int, batch: int, reference=None,
            server=None) -> dict:
    """Warm-up, latency, batched and 2-thread throughput of ``coll``; with ``server`` (an
    S3Server), the requests it answered during warm-up and during the timed queries."""
    counting = server.counting if server is not None else contextlib.nullcontext
    t = time.perf_counter()
    with counting() as warm_requests:
        warm = coll.warm(STREAM)
    warm_s = time.perf_counter() - t
    coll.search(queries[0], STREAM)  # first task after warm-up: connections, caches
    with counting() as query_requests:
        timed = _timed(coll, queries, latency_n, batch)
    lat, results, batched_s, cpu, load0, singles, threads_s = timed
    ref = results if reference is None else reference
    per_archive = [a for w in warm for a in w["per_archive"]]
    out = {
        "workers": len(warm),
        "warm_s": warm_s,
        "build_s_per_archive": statistics.mean(a["seconds"] for a in per_archive),
        "index_bytes_per_worker": [w["index_bytes"] for w in warm],
        "index_bytes_per_archive": statistics.mean(a["index_bytes"] for a in per_archive),
        "rss_before_per_worker": [w["rss_before"] for w in warm],
        "rss_after_per_worker": [w["rss_after"] for w in warm],
        "latency_p50_ms": 1e3 * float(np.percentile(lat, 50)),
        "latency_p90_ms": 1e3 * float(np.percentile(lat, 90)),
        "latency_queries": len(lat),
        "qps_batched": len(queries) / batched_s,
        # CPU time the workers got during the batched run, per worker, over its wall time: below
        # 1 when other processes take the cores
        "worker_cpu_share": [c / batched_s for c in cpu],
        "load_avg_1min": [load0, os.getloadavg()[0]],
        "qps_2_threads": len(queries) / threads_s,
        "hits_mean": statistics.mean(sum(len(h.positions) for h in r) for r in results),
        "archives_hit_mean": statistics.mean(len(r) for r in results),
        "equal_to_in_process": all(_same(a, b) for a, b in zip(results, ref, strict=True))
        and all(_same(a, b) for a, b in zip(singles, ref, strict=True)),
        "_results": results,
    }
    if server is not None:
        out["warm_requests"] = warm_requests.n
        out["warm_mb_fetched"] = warm_requests.bytes_out / 1e6
        out["query_requests"] = query_requests.n
        out["requests_per_query"] = query_requests.n / (len(lat) + 2 * len(queries))
    return out


def _timed(coll, queries: list, latency_n: int, batch: int):
    lat = []
    for q in queries[:latency_n]:
        t = time.perf_counter()
        coll.search(q, STREAM)
        lat.append(time.perf_counter() - t)
    cpu0, load0 = _cpu_seconds(coll), os.getloadavg()[0]
    t = time.perf_counter()
    results = coll.search_many(queries, STREAM, batch=batch)
    batched_s = time.perf_counter() - t
    cpu = [b - a for a, b in zip(cpu0, _cpu_seconds(coll), strict=True)]
    # two client threads, each issuing single queries: two in flight
    singles: list = [None] * len(queries)

    def issue(k0: int) -> None:
        for k in range(k0, len(queries), 2):
            singles[k] = coll.search(queries[k], STREAM)

    threads = [threading.Thread(target=issue, args=(k,)) for k in (0, 1)]
    t = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    threads_s = time.perf_counter() - t
    return lat, results, batched_s, cpu, load0, singles, threads_s


def interleaved_throughput(paths, queries, batch: int, rounds: int, reference,
                           storage_options=None) -> list[dict]:
    """Batched throughput of 1 and 2 Dask workers, both clusters warm, runs alternated so that
    the load other processes put on the machine falls on both alike."""
    from fkvstore import Collection

    out = []
    kw = {"storage_options": storage_options}
    with Collection(paths, workers=1, **kw) as one, Collection(paths, workers=2, **kw) as two:
        for coll in (one, two):
            coll.warm(STREAM)
            coll.search(queries[0], STREAM)
        for r in range(rounds):
            for workers, coll in ((1, one), (2, two)):
                cpu0, load0 = _cpu_seconds(coll), os.getloadavg()[0]
                t = time.perf_counter()
                results = coll.search_many(queries, STREAM, batch=batch)
                wall = time.perf_counter() - t
                cpu = [b - a for a, b in zip(cpu0, _cpu_seconds(coll), strict=True)]
                out.append({"round": r, "workers": workers, "qps": len(queries) / wall,
                            "worker_cpu_share": [c / wall for c in cpu],
                            "qps_per_cpu": len(queries) / sum(cpu), "load_avg_1min": load0,
                            "equal_to_in_process": all(
                                _same(a, b) for a, b in zip(results, reference, strict=True))})
    return out


def _cpu_seconds(coll) -> list[float]:
    """CPU seconds used so far by each worker process (this process when in-process)."""
    if coll.client is None:
        return [time.process_time()]
    done = coll.client.run(time.process_time)
    return [done[w] for w in sorted(done)]


def extrapolate(per_archive: dict, machines: int, cores: int, archives_total: int,
                overhead_ms: float) -> dict:
    """A cluster of ``machines`` x ``cores`` single-threaded workers, from per-archive costs."""
    workers = machines * cores
    per_worker = -(-archives_total // workers)
    return {
        "machines": machines, "cores_per_machine": cores, "archives": archives_total,
        "tokens": archives_total * per_archive["tokens"],
        "archives_per_worker": per_worker,
        "index_gb_per_machine": per_archive["index_bytes"] * per_worker * cores / 1e9,
        "rss_gb_per_machine": per_archive["rss_bytes"] * per_worker * cores / 1e9,
        "warm_up_s": per_worker * per_archive["build_s"],
        "query_ms": per_worker * per_archive["query_us"] / 1e3 + overhead_ms,
        "qps": 1e6 / (per_worker * per_archive["query_us"]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default=None,
                    help="where the archives are cached (default: a folder in the temp dir)")
    ap.add_argument("--archives", type=int, default=200)
    ap.add_argument("--tokens", type=int, default=100_000)
    ap.add_argument("--queries", type=int, default=1000)
    ap.add_argument("--latency", type=int, default=200, help="single queries timed per mode")
    ap.add_argument("--batch", type=int, default=25)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved 1/2-worker rounds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="20 archives x 10^4 tokens, 200 queries")
    ap.add_argument("--remote", action="store_true",
                    help="search the archives published to a local moto S3 server")
    add_out_option(ap, "collection")
    args = ap.parse_args()
    if args.remote and not args.out:
        args.out = "collection-remote" + ("-quick" if args.quick else "")
    if args.quick:
        args.archives, args.tokens, args.queries, args.latency = 20, 10_000, 200, 50
    root = Path(args.dir or Path(tempfile.gettempdir()) / "fkv-bench-collection")
    root = root / f"{args.archives}x{args.tokens}-seed{args.seed}"


    paths, gen = archives(root, args.archives, args.tokens, args.seed, procs=os.cpu_count() or 1)
    print(f"{args.archives} archives x {args.tokens} tokens under {root}: "
          + ("cached" if gen["cached"] else f"generated in {gen['seconds']:.1f} s"))
    queries = draw_queries(paths, args.queries, args.seed)
    load = os.getloadavg()
    if args.remote:
        return remote_main(args, paths, queries, load)
    persisted = persisted_restore(paths[:10])
    print("open + index, per archive: built {build_s:.3f} s, restored from a persisted index "
          "{restore_s:.3f} s (file +{file_growth_bytes:.0f} B)".format(**persisted))

    rows, seq_results = run_modes(paths, queries, args)
    by = {r["mode"]: r for r in rows}
    seq = by["in-process"]
    speedup, rounds = compare_workers(by, paths, queries, args, seq_results)

    # per-archive costs: the in-process run is the least disturbed measure of the work itself
    n_arch = args.archives
    per_archive = {
        "tokens": args.tokens,
        "build_s": seq["build_s_per_archive"],
        "index_bytes": seq["index_bytes_per_archive"],
        # what a process really grows by per archive: the index plus HDF5 and decode caches
        "rss_bytes": (seq["rss_after_per_worker"][0] - seq["rss_before_per_worker"][0]) / n_arch,
        "query_us": 1e6 / (seq["qps_batched"] * n_arch),
    }
    one = by["dask 1 worker"]
    overhead_ms = max(0.0, one["latency_p50_ms"] - per_archive["query_us"] * n_arch / 1e3)
    cluster = [extrapolate(per_archive, 10, cores, total, overhead_ms)
               for cores in (2, 16) for total in (2000, 20000)]
    print("per archive:", {k: round(v, 6) for k, v in per_archive.items()},
          f"Dask overhead per query ~{overhead_ms:.1f} ms")
    print(markdown_table(cluster, [
        ("machines", "machines"), ("cores_per_machine", "cores each"), ("archives", "archives"),
        ("archives_per_worker", "archives/worker"), ("index_gb_per_machine", "index GB/machine"),
        ("rss_gb_per_machine", "RSS GB/machine"),
        ("warm_up_s", "warm-up s"), ("query_ms", "query ms"), ("qps", "q/s")]))
    path = write_json(out_name(args, "collection"), {
        "machine": machine(), "load_avg_at_start": load, "load_avg_at_end": os.getloadavg(),
        "args": vars(args), "generation": gen, "modes": rows, "speedup_2_over_1": speedup,
        "per_archive": per_archive, "persisted_index": persisted,
        "interleaved": rounds,
        "dask_overhead_ms": overhead_ms, "cluster": cluster,
        "dask": _dask_version()})
    print(f"wrote {path}")


MODE_COLUMNS = [
    ("mode", "mode"), ("warm_s", "warm-up s"), ("index_mb_per_worker", "index MB/worker"),
    ("rss_growth_mb_per_worker", "RSS growth MB/worker"),
    ("latency_p50_ms", "p50 ms"), ("latency_p90_ms", "p90 ms"),
    ("qps_batched", "q/s batched"), ("cpu_share", "worker CPU share"),
    ("qps_2_threads", "q/s 2 threads"), ("equal_to_in_process", "= in-process")]


def run_modes(paths, queries, args, reference=None, storage_options=None, server=None):
    """``measure`` in process and on 1 and 2 Dask workers; the rows (printed) and the
    in-process results (``reference`` when given: every mode is checked against it)."""
    from fkvstore import Collection

    rows = []
    for workers in (None, 1, 2):
        mode = "in-process" if workers is None else f"dask {workers} worker" + "s" * (workers > 1)
        with Collection(paths, workers=workers, storage_options=storage_options) as coll:
            rows.append({"mode": mode, **measure(coll, queries, args.latency, args.batch,
                                                 reference, server)})
        if reference is None:
            reference = rows[0]["_results"]
    for r in rows:
        r.pop("_results")
        r["cpu_share"] = " / ".join(f"{c:.2f}" for c in r["worker_cpu_share"])
        r["index_mb_per_worker"] = max(r["index_bytes_per_worker"]) / 1e6
        r["rss_growth_mb_per_worker"] = max(
            (b - a) / 1e6 for a, b in zip(r["rss_before_per_worker"], r["rss_after_per_worker"],
                                          strict=True))
    extra = [("warm_requests", "warm-up requests"), ("requests_per_query", "requests/query")]
    print(markdown_table(rows, MODE_COLUMNS + (extra if server is not None else [])))
    return rows, reference


def compare_workers(by, paths, queries, args, reference, storage_options=None):
    """2- over 1-worker speed-ups of the mode runs, then of the interleaved rounds (printed)."""
    speedup = {k: by["dask 2 workers"][k] / by["dask 1 worker"][k]
               for k in ("qps_batched", "qps_2_threads")}
    print(f"2 workers / 1 worker throughput: batched {speedup['qps_batched']:.2f}x, "
          f"2 threads {speedup['qps_2_threads']:.2f}x")
    rounds = interleaved_throughput(paths, queries, args.batch, args.rounds, reference,
                                    storage_options)
    for r in rounds:
        r["cpu_share"] = " / ".join(f"{c:.2f}" for c in r["worker_cpu_share"])
    print(markdown_table(rounds, [
        ("round", "round"), ("workers", "workers"), ("qps", "q/s batched"),
        ("cpu_share", "worker CPU share"), ("qps_per_cpu", "q per worker CPU s"),
        ("load_avg_1min", "load (1 min)"), ("equal_to_in_process", "= in-process")]))
    best = {w: max(r["qps"] for r in rounds if r["workers"] == w) for w in (1, 2)}
    speedup["interleaved_best"] = best[2] / best[1]
    print(f"interleaved, best round each: 2 workers / 1 = {speedup['interleaved_best']:.2f}x")
    return speedup, rounds


def remote_main(args, paths: list[str], queries: list, load) -> None:
    """The archives published to moto's S3 server on 127.0.0.1, searched by URL."""
    from s3_server import S3Server

    from fkvstore import Collection

    with Collection(paths) as coll:  # the local sequential scan every remote result must equal
        coll.warm(STREAM)
        local = coll.search_many(queries, STREAM, batch=args.batch)
    server = S3Server(auth=True).start()
    try:
        opts = server.storage_options
        urls = [server.url("sessions/" + os.path.basename(p)) for p in paths]
        t = time.perf_counter()
        for path, url in zip(paths, urls, strict=True):
            fkvstore.copy(path, url, storage_options=opts)
        publish_s = time.perf_counter() - t
        print(f"published {len(urls)} archives in {publish_s:.1f} s")
        where = dict(zip(paths, urls, strict=True))
        reference = [[h._replace(archive=where[h.archive]) for h in r] for r in local]
        with server.counting() as check:
            Collection(urls, storage_options=opts).close()
        print(f"existence check of {len(urls)} URLs: {check.n} request(s)")
        rows, _ = run_modes(urls, queries, args, reference, opts, server)
        by = {r["mode"]: r for r in rows}
        speedup, rounds = compare_workers(by, urls, queries, args, reference, opts)
    finally:
        server.stop()
    path = write_json(out_name(args, "collection-remote"), {
        "machine": machine(), "load_avg_at_start": load, "load_avg_at_end": os.getloadavg(),
        "args": vars(args), "publish_s": publish_s, "existence_check_requests": check.n,
        "modes": rows, "speedup_2_over_1": speedup, "interleaved": rounds,
        "dask": _dask_version()})
    print(f"wrote {path}")


def _dask_version() -> str | None:
    try:
        import distributed
    except ImportError:
        return None
    return distributed.__version__


if __name__ == "__main__":
    main()
