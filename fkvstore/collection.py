"""Search many archives as one: :class:`Collection`, sequential or on a Dask distributed cluster.

A serving fleet keeps one archive per session; a :class:`Collection` searches all of them. The
archives are dealt to the cluster's workers round-robin by their place in the collection, so
each worker opens its share once (read only) and keeps it, with every searched stream's suffix
index, in a process-wide registry keyed by the collection's id: the indexes stay warm between
queries. A query (or a batch of them) is one task per worker, never one per archive; the
workers' hits are merged and sorted by (archive's place in the collection, stream name), so the
result does not depend on the number of workers. Without a Dask client the same code runs in
this process, one archive after another.

Dask is imported only when a client or a worker count is given (``pip install
fkvstore[dask]``). Archives are local paths (``file://`` URLs too) that every worker can open,
or any fsspec URL (``s3://bucket/key.h5``), opened read-only on the workers through the remote
block cache with the collection's ``storage_options`` (which travel with each task, hidden from
reprs and logs). See docs/collection.md.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from typing import Any, NamedTuple

import numpy as np

from fkvstore import _remote, archive
from fkvstore.errors import ArchiveClosedError, ArchiveNotFoundError, FkvError

__all__ = ["Collection", "Hit"]

_RECHECK_S = 1.0  # how long a fetched list of workers is trusted
_PATIENCE_S = 2.0  # a task that takes longer makes the client check that its worker is alive
_ATTEMPTS = 3


class _WorkerLost(Exception):
    """Internal: a worker holding pinned tasks left the cluster."""


class _Hidden:
    """fsspec storage options on their way to the workers: they may hold credentials, and Dask
    logs a failed task's arguments by their repr, so the repr shows none of them."""

    __slots__ = ("value",)

    def __init__(self, value: dict | None):
        self.value = value

    def __repr__(self) -> str:
        return "<storage options hidden>" if self.value else "<no storage options>"


class Hit(NamedTuple):
    """The occurrences of a query in one stream of one archive.

    ``archive``: the archive as the collection was given it (str); ``stream``: the stream name;
    ``positions``: sorted int64 positions of each occurrence's last symbol, as
    :meth:`fkvstore.Stream.search` returns them (never empty in a result).
    """

    archive: str
    stream: str
    positions: np.ndarray


# ---------------------------------------------------------------------------------- worker side
class _Shard:
    """The archives one process holds for one collection: opened read-only on first use and
    kept, so each searched stream keeps its index between queries. ``spec``: a tuple of
    ``(place in the collection, local path or URL)``; ``options``: the fsspec storage options
    URLs are opened with (ignored for local paths). One lock per shard: an Archive must not be
    used by two threads at once (a worker with several threads, or concurrent sequential
    callers)."""

    def __init__(self, options: _Hidden | None = None) -> None:
        self.lock = threading.Lock()
        self.options = options or _Hidden(None)
        self.archives: dict[int, archive.Archive] = {}
        self.names: dict[int, list[str]] = {}

    def _archive(self, i: int, path: str):
        ar = self.archives.get(i)
        if ar is None:
            ar = archive.open(path, "r", storage_options=self.options.value)
            self.archives[i] = ar
            self.names[i] = sorted(ar)
        return ar

    def _streams(self, spec, stream):
        """``[(place, path, name, Stream)]`` of the searched streams, in collection order."""
        out = []
        for i, path in spec:
            ar = self._archive(i, path)
            for name in (self.names[i] if stream is None else stream):
                out.append((i, path, name, ar[name]))  # StreamNotFoundError names the archive
        return out

    def search(self, spec, queries, stream, column):
        """Per query, ``[(place, stream name, positions)]`` of the streams with a hit."""
        streams = self._streams(spec, stream)
        out = []
        for q in queries:
            hits = []
            for i, path, name, s in streams:
                try:
                    positions = s.search(q, column)
                except (FkvError, ValueError, TypeError, IndexError) as exc:
                    raise _naming(exc, path, name) from exc
                if len(positions):
                    hits.append((i, name, positions))
            out.append(hits)
        return out

    def warm(self, spec, stream, column):
        """Open the archives and build the indexes of the searched streams; what it cost."""
        rss0 = _rss()
        t0 = time.perf_counter()
        per_archive = []
        for i, path in spec:
            t = time.perf_counter()
            nbytes = 0
            for _, _, name, s in self._streams(((i, path),), stream):
                try:
                    nbytes += s.build_index(column).nbytes()
                except (FkvError, ValueError, TypeError, IndexError) as exc:
                    raise _naming(exc, path, name) from exc
            per_archive.append({"archive": i, "seconds": time.perf_counter() - t,
                                "index_bytes": int(nbytes)})
        return {"pid": os.getpid(), "archives": len(spec), "seconds": time.perf_counter() - t0,
                "index_bytes": sum(a["index_bytes"] for a in per_archive),
                "rss_before": rss0, "rss_after": _rss(), "per_archive": per_archive}

    def context(self, spec, i, stream, pos, before, after, column):
        (path,) = [p for j, p in spec if j == i]
        s = self._archive(i, path)[stream]
        try:
            return s.context(pos, before, after, column)
        except (FkvError, ValueError, TypeError, IndexError) as exc:
            raise _naming(exc, path, stream) from exc

    def refresh(self, spec):
        for i, _ in spec:
            if i in self.archives:
                self.archives[i].refresh()
                self.names[i] = sorted(self.archives[i])

    def close(self) -> None:
        errors = []
        for ar in self.archives.values():
            try:
                ar.close()
            except Exception as exc:  # close the others all the same
                errors.append(exc)
        self.archives.clear()
        self.names.clear()
        if errors:
            raise errors[0]


_SHARDS: dict[str, _Shard] = {}  # collection id -> this process's shard
_SHARDS_LOCK = threading.Lock()


def _run(collection_id: str, op: str, options: _Hidden, spec, *args):
    """The one task function: ``op`` on this process's shard of the collection."""
    with _SHARDS_LOCK:
        shard = _SHARDS.setdefault(collection_id, _Shard(options))
    with shard.lock:
        return getattr(shard, op)(spec, *args)


def _close_shard(collection_id: str) -> int:
    """Close and forget this process's shard of the collection; the number of archives closed."""
    with _SHARDS_LOCK:
        shard = _SHARDS.pop(collection_id, None)
    if shard is None:
        return 0
    with shard.lock:
        n = len(shard.archives)
        shard.close()
    return n


def _naming(exc: Exception, path: str, stream: str) -> Exception:
    """``exc`` again, same type, its message prefixed with the archive and stream."""
    try:
        return type(exc)(f"archive {path!r}, stream {stream!r}: {exc}")
    except Exception:  # an exception type with another constructor: keep it as it is
        return exc


def _rss() -> int | None:
    """Resident set size of this process in bytes (Linux), else None."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


# ---------------------------------------------------------------------------------- client side
def _locate(item) -> tuple[str, str, bool]:
    """``(name as given, absolute local path or the URL, whether remote)`` of one archive."""
    if _remote.is_url(item):
        local = _remote.file_url_path(item)
        if local is not None:
            return item, os.path.abspath(local), False
        return item, item, True
    if not isinstance(item, (str, os.PathLike)):
        raise TypeError(f"an archive must be a path or URL (str), got {type(item).__name__} "
                        f"{item!r}")
    return os.fspath(item), os.path.abspath(os.fspath(item)), False


def _check_query(query):
    if isinstance(query, (bytes, str)):
        if not query:
            raise ValueError("query is empty")
        return query
    q = np.asarray(query)
    if q.ndim != 1 or q.size == 0:
        raise ValueError(f"query must be a non-empty 1-D integer array, bytes or str; got shape "
                         f"{q.shape}")
    return q


def _check_stream(stream):
    """None (every stream of each archive) or a tuple of distinct stream names (a repeated
    name once: one Hit per archive and stream)."""
    if stream is None:
        return None
    if isinstance(stream, str):
        return (stream,)
    if isinstance(stream, (bytes, bytearray)) or not hasattr(stream, "__iter__"):
        raise TypeError(f"stream must be a name (str), a list of names or None, got "
                        f"{type(stream).__name__} {stream!r}")
    names = tuple(dict.fromkeys(stream))
    for name in names:
        if not isinstance(name, str):
            raise TypeError(f"stream names must be str, got {type(name).__name__} {name!r}")
    if not names:
        raise ValueError("stream: an empty list of stream names")
    return names


def _check_column(column) -> int:
    if isinstance(column, bool) or not isinstance(column, (int, np.integer)) or column < 0:
        raise ValueError(f"column must be a non-negative int, got {column!r}")
    return int(column)


class Collection:
    """Many archives searched as one.

    ``archives``: paths (str or os.PathLike) or URLs: ``file://`` as a local path, any other
    fsspec URL (``s3://bucket/key.h5``) opened read-only with ``storage_options`` (fsspec's:
    credentials, endpoint; sent to the workers with each task, never shown in a repr). Each must
    exist (:class:`~fkvstore.errors.ArchiveNotFoundError`, a ``FileNotFoundError``, naming the
    missing ones, before any work starts: local paths in the client's file system, URLs with
    one listing per folder and a HEAD per archive not listed; refused credentials raise
    :class:`~fkvstore.errors.RemoteAuthError` naming the URL) and appear once.
    ``client``: a ``distributed.Client`` to run on;
    ``workers``: start a private ``LocalCluster`` of that many single-threaded worker processes
    (closed with the collection) instead; neither: run in this process, one archive after
    another. Use as a context manager or call :meth:`close`, which closes every archive the
    workers hold.
    """

    def __init__(self, archives, *, storage_options: dict | None = None, client=None,
                 workers: int | None = None):
        if isinstance(archives, (str, os.PathLike)):
            raise TypeError("archives: pass a list of paths, not a single path")
        if storage_options is not None and not isinstance(storage_options, dict):
            raise TypeError(f"storage_options must be a dict or None, got "
                            f"{type(storage_options).__name__}")  # no repr: it may hold secrets
        located = [_locate(a) for a in archives]
        if not located:
            raise ValueError("a collection needs at least one archive")
        self.archives: tuple[str, ...] = tuple(name for name, _, _ in located)
        self._paths = tuple(path for _, path, _ in located)
        self._options = _Hidden(storage_options)
        seen: dict[str, str] = {}
        for name, path, _ in located:
            if path in seen:
                raise ValueError(f"archive {name!r} is given twice (as {seen[path]!r} too)")
            seen[path] = name
        urls = [path for _, path, remote in located if remote]
        gone = set(_remote.missing_objects(urls, storage_options) if urls else ())
        missing = [name for name, path, remote in located  # a folder is no archive either
                   if (path in gone if remote else not os.path.isfile(path))]
        if missing:
            more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
            raise ArchiveNotFoundError(
                f"no archive at {', '.join(map(repr, missing[:3]))}{more}")
        self._place: dict[str, int] = {}
        for i, (name, path, _) in enumerate(located):
            self._place.setdefault(name, i)
            self._place.setdefault(path, i)
        if client is not None and workers is not None:
            raise ValueError("pass either a Dask client or a number of workers, not both")
        self._id = uuid.uuid4().hex
        self._cluster: Any = None  # a LocalCluster this collection started
        self._owns_client = False
        self._closed = False
        self._plan_lock = threading.Lock()
        self._workers: list[str] = []
        self._checked = -np.inf  # when the worker list was last fetched (time.monotonic)
        self._specs: dict[str, tuple] = {}
        self._touched: set[str] = set()
        if workers is not None:
            client = self._start_cluster(workers)
        self._client = client
        self._local = _Shard(self._options) if client is None else None

    def _start_cluster(self, workers):
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"workers must be a positive int, got {workers!r}")
        import logging

        from distributed import Client, LocalCluster

        cluster = LocalCluster(n_workers=workers, threads_per_worker=1, processes=True,
                               dashboard_address=None, silence_logs=logging.CRITICAL)
        try:
            client = Client(cluster)
            client.wait_for_workers(workers)
        except BaseException:
            cluster.close()
            raise
        self._cluster, self._owns_client = cluster, True
        return client

    # -------------------------------------------------------------------------------- public
    @property
    def client(self):
        """The Dask client searches run on, or None when the collection runs in this process."""
        return self._client

    def __len__(self) -> int:
        return len(self.archives)

    def __repr__(self) -> str:
        where = "closed" if self._closed else (
            "in process" if self._client is None else f"on {len(self._workers) or '?'} workers")
        return f"<fkvstore.Collection of {len(self)} archives, {where}>"

    def __enter__(self) -> Collection:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def search(self, query, stream=None, column: int = 0) -> list[Hit]:
        """Every occurrence of ``query`` in ``stream`` (a name, a list of names, or None for
        every stream) of every archive: one :class:`Hit` per (archive, stream) with at least one
        occurrence, in collection order then by stream name. Equal to searching each archive's
        streams one by one with :meth:`fkvstore.Stream.search`. A stream missing from an archive
        raises :class:`~fkvstore.errors.StreamNotFoundError` naming both."""
        return self.search_many([query], stream, column)[0]

    def search_many(self, queries, stream=None, column: int = 0, batch: int = 32) -> list:
        """:meth:`search` for each query, as a list of hit lists. The queries go out in batches
        of ``batch``, one task per worker per batch, all in flight at once: the way to reach
        throughput (a task costs the scheduler about a millisecond whatever it holds)."""
        self._check_open()
        queries = [_check_query(q) for q in queries]
        stream = _check_stream(stream)
        column = _check_column(column)
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise ValueError(f"batch must be a positive int, got {batch!r}")
        merged: list[list] = [[] for _ in queries]
        for start, parts in self._each_batch("search", queries, batch, stream, column):
            for k, hits in enumerate(parts):
                merged[start + k].extend(hits)
        return [[Hit(self.archives[i], name, positions)
                 for i, name, positions in sorted(hits, key=lambda h: (h[0], h[1]))]
                for hits in merged]

    def context(self, archive, stream: str, pos: int, before: int = 32, after: int = 32,
                column: int | None = None):
        """Rows around a hit, as :meth:`fkvstore.Stream.context` returns them, read by the
        worker holding ``archive`` (a :class:`Hit`'s ``archive``, a path, or a place in the
        collection)."""
        self._check_open()
        i = self._index_of(archive)
        if not isinstance(stream, str):
            raise TypeError(f"stream must be a str, got {type(stream).__name__} {stream!r}")
        return self._on_owner(i, "context", i, stream, pos, before, after, column)

    def warm(self, stream=None, column: int = 0) -> list[dict]:
        """Open every archive and build the indexes of ``stream`` now (else the first query
        does). Per worker (one entry in process mode): ``pid``, ``archives``, ``seconds``,
        ``index_bytes`` (:attr:`SuffixIndex.nbytes` summed), ``rss_before``/``rss_after``
        (bytes) and ``per_archive`` (place, seconds, index_bytes)."""
        self._check_open()
        stream = _check_stream(stream)
        column = _check_column(column)
        return self._each("warm", stream, column)

    def refresh(self) -> None:
        """Let the open archives see what their writers committed since (HDF5 SWMR)."""
        self._check_open()
        self._each("refresh")

    def close(self) -> None:
        """Close every archive the workers (or this process) hold; stop a cluster the
        collection started. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._local is not None:
                self._local.close()
            elif self._touched and self._client.status == "running":
                # a task on each worker that opened archives, so it queues behind running ones
                live = set(self._live_workers())
                futures = [self._client.submit(_close_shard, self._id, workers=[w],
                                               allow_other_workers=False, pure=False)
                           for w in sorted(self._touched & live)]
                self._client.gather(futures)
        finally:
            if self._owns_client:
                self._client.close()
                self._cluster.close()

    # ----------------------------------------------------------------------------- internals
    def _check_open(self) -> None:
        if self._closed:
            raise ArchiveClosedError("the collection is closed")

    def _index_of(self, archive) -> int:
        if isinstance(archive, (int, np.integer)) and not isinstance(archive, bool):
            if not 0 <= archive < len(self):
                raise ValueError(f"archive {archive} is outside 0..{len(self) - 1}")
            return int(archive)
        if isinstance(archive, (str, os.PathLike)):
            key = os.fspath(archive)
            for k in (key, os.path.abspath(key)):
                if k in self._place:
                    return self._place[k]
        raise ValueError(f"archive {archive!r} is not in this collection")

    def _live_workers(self) -> list[str]:
        return sorted(self._client.scheduler_info()["workers"])

    def _plan(self) -> dict[str, tuple]:
        """Worker address -> its archives ``((place, path), ...)``: round-robin by place over
        the workers sorted by address. The worker list is fetched again at most every
        ``_RECHECK_S`` (it costs a scheduler round trip); the plan changes only when it does (a
        worker that gains archives opens them on its next task)."""
        with self._plan_lock:
            now = time.monotonic()
            if now - self._checked < _RECHECK_S:
                return self._specs
            workers = self._live_workers()
            if not workers:
                self._client.wait_for_workers(1)
                workers = self._live_workers()
            self._checked = now
            if workers != self._workers:
                self._workers = workers
                spread: dict[str, list[tuple[int, str]]] = {w: [] for w in workers}
                for i, path in enumerate(self._paths):
                    spread[workers[i % len(workers)]].append((i, path))
                self._specs = {w: tuple(s) for w, s in spread.items() if s}
            return self._specs

    def _dispatch(self, tasks) -> list:
        """``[(tag, result)]`` of ``tasks(plan)``, a list of ``(tag, worker, op, spec, args)``,
        one Dask task each, pinned to its worker. A pinned task would wait forever for a worker
        that left, so a long wait checks the workers; if one left, the tasks are cancelled and
        submitted again under a new plan (the others open the archives it held)."""
        for _ in range(_ATTEMPTS):
            calls = tasks(self._plan())
            futures = []
            for _tag, w, op, spec, args in calls:
                self._touched.add(w)
                futures.append(self._client.submit(_run, self._id, op, self._options, spec, *args,
                                                   workers=[w], allow_other_workers=False,
                                                   pure=False))
            try:
                results = self._results([c[1] for c in calls], futures)
            except _WorkerLost:
                self._client.cancel(futures)
                with self._plan_lock:
                    self._checked = -np.inf
                continue
            return [(c[0], r) for c, r in zip(calls, results, strict=True)]
        raise RuntimeError(f"workers kept leaving the cluster: {_ATTEMPTS} attempts failed")

    def _results(self, workers: list[str], futures: list) -> list:
        out = []
        for w, f in zip(workers, futures, strict=True):
            while True:
                try:
                    out.append(f.result(timeout=_PATIENCE_S))
                    break
                except TimeoutError:
                    if w not in self._live_workers():
                        raise _WorkerLost(w) from None
        return out

    def _each(self, op: str, *args) -> list:
        """``op`` on every worker's shard, one task each; results in worker order."""
        if self._client is None:
            return [_run_local(self, op, self._all_spec(), *args)]
        done = self._dispatch(lambda plan: [(w, w, op, spec, args) for w, spec in plan.items()])
        return [r for _, r in done]

    def _each_batch(self, op: str, items: list, batch: int, *args) -> list:
        """``[(start, result)]`` of ``op(items[start:start+batch], *args)`` on every shard."""
        starts = range(0, len(items), batch)
        if self._client is None:
            spec = self._all_spec()
            return [(s, _run_local(self, op, spec, items[s:s + batch], *args)) for s in starts]
        return self._dispatch(lambda plan: [(s, w, op, spec, (items[s:s + batch], *args))
                                            for s in starts for w, spec in plan.items()])

    def _on_owner(self, i: int, op: str, *args):
        if self._client is None:
            return _run_local(self, op, self._all_spec(), *args)
        ((_, result),) = self._dispatch(lambda plan: [
            (w, w, op, spec, args) for w, spec in plan.items() if any(j == i for j, _ in spec)])
        return result

    def _all_spec(self) -> tuple:
        return tuple(enumerate(self._paths))


def _run_local(collection: Collection, op: str, spec, *args):
    shard = collection._local
    if shard is None:
        raise RuntimeError("a collection on a Dask cluster has no in-process shard")
    with shard.lock:
        return getattr(shard, op)(spec, *args)
