"""Residual vector quantization with one codebook set per KV head.

A codebook set is a float tensor ``(kv_heads, stages, codebook_size, head_dim)``. Stage ``s``
quantizes what stages ``0..s-1`` left over; a vector's reconstruction is the sum of its stage
centroids. Pooled codebooks (one per layer shared by all heads) are the same tensor with one
codebook repeated over ``kv_heads``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from model_adapters.quant.kmeans import assign, kmeans

__all__ = [
    "StageTables",
    "check_codes",
    "code_dtype",
    "JointTables",
    "decode",
    "encode",
    "encode_joint",
    "joint_tables",
    "stage_tables",
    "train_rvq",
]


def code_dtype(codebook_size: int) -> torch.dtype:
    """Smallest integer dtype holding indices ``0..codebook_size-1`` (uint8 up to 256)."""
    if codebook_size <= 256:
        return torch.uint8
    if codebook_size <= 32768:
        return torch.int16
    return torch.int32


def _check_codebooks(codebooks: torch.Tensor) -> None:
    if not isinstance(codebooks, torch.Tensor) or codebooks.dim() != 4:
        got = tuple(codebooks.shape) if isinstance(codebooks, torch.Tensor) else type(codebooks)
        raise ValueError(
            f"codebooks must be (kv_heads, stages, codebook_size, head_dim), got {got}"
        )


def train_rvq(
    vectors: torch.Tensor,
    *,
    num_quantizers: int,
    codebook_size: int,
    pooled: bool = False,
    iters: int = 20,
    seed: int = 0,
    init_sample: int | None = 16384,
    max_points: int | None = None,
    progress=None,
) -> torch.Tensor:
    """Train residual-VQ codebooks by k-means, stage after stage on the residuals.

    Stages are trained greedily, so the first ``s`` stages of a deeper codebook set are exactly
    the codebooks an ``s``-stage training with the same seed produces.

    Args:
        vectors: ``(n, kv_heads, head_dim)`` float training vectors of one layer and one of K/V.
        num_quantizers: residual stages (>= 1).
        codebook_size: centroids per stage.
        pooled: one codebook per stage shared by all heads (trained on all heads' vectors).
        iters, seed, init_sample: passed to :func:`model_adapters.quant.kmeans.kmeans`; stage ``s``
            uses ``seed + s``.
        max_points: train each codebook on at most this many vectors (a random subset drawn
            with ``seed``; None: all), so a pooled codebook can see as much data as a per-head one.
        progress: optional callable, called once per finished stage.

    Returns:
        ``(kv_heads, num_quantizers, codebook_size, head_dim)`` codebooks, float32.
    """
    if not isinstance(vectors, torch.Tensor) or vectors.dim() != 3:
        got = tuple(vectors.shape) if isinstance(vectors, torch.Tensor) else type(vectors)
        raise ValueError(f"vectors must be (n, kv_heads, head_dim), got {got}")
    if (
        isinstance(num_quantizers, bool)
        or not isinstance(num_quantizers, int)
        or num_quantizers < 1
    ):
        raise ValueError(f"num_quantizers must be a positive int, got {num_quantizers!r}")
    n, heads, dim = vectors.shape
    x = vectors.to(torch.float32)
    # groups: one per head, or a single pooled group of all heads' vectors
    points = x.reshape(1, n * heads, dim) if pooled else x.permute(1, 0, 2).contiguous()
    if max_points is not None and points.shape[1] > max_points:
        gen = torch.Generator(device=points.device).manual_seed(int(seed))
        pick = torch.stack(
            [
                torch.randperm(points.shape[1], generator=gen, device=points.device)[:max_points]
                for _ in range(points.shape[0])
            ]
        )
        points = torch.gather(points, 1, pick.unsqueeze(-1).expand(-1, -1, dim))
    stages = []
    residual = points
    for s in range(num_quantizers):
        cb = kmeans(residual, codebook_size, iters=iters, seed=seed + s, init_sample=init_sample)
        idx, _ = assign(residual, cb)
        residual = residual - torch.gather(cb, 1, idx.unsqueeze(-1).expand(-1, -1, dim))
        stages.append(cb)
        if progress is not None:
            progress(s)
    books = torch.stack(stages, 1)  # (groups, stages, k, dim)
    if pooled:
        books = books.expand(heads, -1, -1, -1).contiguous()
    return books


class StageTables(NamedTuple):
    """Per-stage views of one codebook set, prepared once for repeated encoding.

    Attributes:
        books: per stage ``(kv_heads, codebook_size, head_dim)`` float32, contiguous.
        norms: per stage ``(kv_heads, codebook_size, 1)`` squared centroid norms.
    """

    books: list[torch.Tensor]
    norms: list[torch.Tensor]


def stage_tables(codebooks: torch.Tensor) -> StageTables:
    """Prepare ``(kv_heads, stages, codebook_size, head_dim)`` codebooks for :func:`encode`."""
    _check_codebooks(codebooks)
    cb = codebooks.to(torch.float32)
    books = [cb[:, s].contiguous() for s in range(cb.shape[1])]
    return StageTables(books, [(b * b).sum(-1, keepdim=True) for b in books])


def encode(
    x: torch.Tensor, codebooks: torch.Tensor, tables: StageTables | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual-VQ codes and reconstruction of vectors.

    Args:
        x: ``(batch, kv_heads, seq, head_dim)`` float (any float dtype; computed in float32).
        codebooks: ``(kv_heads, stages, codebook_size, head_dim)`` float32.
        tables: :func:`stage_tables` of ``codebooks`` on ``x``'s device, if prepared already
            (saves work when encoding a few vectors at a time).

    Returns:
        ``(codes, reconstruction)``: ``(batch, kv_heads, seq, stages)`` in
        :func:`code_dtype` and ``(batch, kv_heads, seq, head_dim)`` in ``x``'s dtype.
        Memory: one ``(kv_heads, batch * seq, codebook_size)`` float32 score block per stage.
    """
    _check_codebooks(codebooks)
    heads, stages, k, dim = codebooks.shape
    if x.dim() != 4 or x.shape[1] != heads or x.shape[3] != dim:
        raise ValueError(
            f"x must be (batch, {heads}, seq, {dim}) to match codebooks {tuple(codebooks.shape)}, "
            f"got {tuple(x.shape)}"
        )
    if tables is None:
        tables = stage_tables(codebooks.to(x.device))
    batch, _, seq, _ = x.shape
    residual = x.to(torch.float32).permute(1, 0, 2, 3).reshape(heads, batch * seq, dim)
    recon = None
    codes = []
    for s in range(stages):
        # ||x||^2 is constant per vector, so the argmin only needs ||c||^2 - 2 c.x; codebook
        # rows times vectors (not vectors times a transposed codebook) reads the codebook once,
        # in order, which is what a decode step is bound by
        score = torch.baddbmm(
            tables.norms[s], tables.books[s], residual.transpose(1, 2), alpha=-2.0
        )
        idx = score.min(dim=1)[1]
        picked = torch.gather(tables.books[s], 1, idx.unsqueeze(-1).expand(-1, -1, dim))
        if s + 1 < stages:
            residual = residual - picked
        # 0 + c0 + c1 + ... in the same order as decode, so both give identical floats
        recon = picked if recon is None else recon + picked
        codes.append(idx)
    codes_t = torch.stack(codes, -1).view(heads, batch, seq, stages).permute(1, 0, 2, 3)
    recon = recon.view(heads, batch, seq, dim).permute(1, 0, 2, 3)
    return codes_t.to(code_dtype(k)).contiguous(), recon.to(x.dtype).contiguous()


class JointTables(NamedTuple):
    """Stage tables of several codebook sets of one layer (its keys' and values'), stacked on
    the head axis so that one matrix product per stage serves them all; prepared once for
    :func:`encode_joint`.

    Attributes:
        order: the sets' indices, most stages first: at stage ``s`` the sets with more than
            ``s`` stages are a prefix of this order, and their heads the first rows.
        stages: stage count of each set (in the sets' own order).
        books: per stage ``(rows, codebook_size, head_dim)`` float32, contiguous, ``rows`` =
            ``kv_heads`` times the sets with more than ``s`` stages.
        norms: per stage ``(rows, codebook_size, 1)`` squared centroid norms.
    """

    order: list[int]
    stages: list[int]
    books: list[torch.Tensor]
    norms: list[torch.Tensor]


def joint_tables(codebooks: list[torch.Tensor]) -> JointTables:
    """Prepare codebook sets, each ``(kv_heads, stages, codebook_size, head_dim)`` with the same
    heads, size and width (stages may differ, at least 1), for :func:`encode_joint`."""
    for books in codebooks:
        _check_codebooks(books)
    if len({(b.shape[0], b.shape[2], b.shape[3]) for b in codebooks}) > 1:
        raise ValueError(
            "joint codebook sets need equal (kv_heads, codebook_size, head_dim), got "
            f"{[tuple(b.shape) for b in codebooks]}")
    stages = [b.shape[1] for b in codebooks]
    order = sorted(range(len(codebooks)), key=lambda i: -stages[i])
    books = []
    for s in range(max(stages, default=0)):
        active = [codebooks[i][:, s].to(torch.float32) for i in order if stages[i] > s]
        books.append(torch.cat(active).contiguous())
    return JointTables(order, stages, books, [(b * b).sum(-1, keepdim=True) for b in books])


def encode_joint(
    xs: list[torch.Tensor], tables: JointTables
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """:func:`encode` of each ``xs[i]`` with codebook set ``i`` of ``tables``
    (:func:`joint_tables`), in one matrix product, one search and one gather per stage for all
    sets: ``[encode(x, books) for x, books in zip(xs, sets)]``, the same codes and floats.

    Args:
        xs: one per set, ``(batch, kv_heads, seq, head_dim)`` float, all the same shape.

    Returns:
        Per set ``(codes, reconstruction)`` as :func:`encode` returns them.
    """
    if len(xs) != len(tables.stages):
        raise ValueError(f"{len(tables.stages)} codebook sets, {len(xs)} inputs")
    rows0, k, dim = tables.books[0].shape
    heads = rows0 // len(xs)
    shape = tuple(xs[0].shape)
    if len(shape) != 4 or shape[1] != heads or shape[3] != dim or any(
            tuple(x.shape) != shape for x in xs):
        raise ValueError(
            f"inputs must all be (batch, {heads}, seq, {dim}), got {[tuple(x.shape) for x in xs]}")
    batch, _, seq, _ = shape
    n = batch * seq
    residual = torch.cat([
        xs[i].to(torch.float32).permute(1, 0, 2, 3).reshape(heads, n, dim) for i in tables.order])
    codes = torch.empty(rows0, n, len(tables.books), dtype=torch.int64, device=residual.device)
    recon = residual  # replaced at stage 0 (every set has a stage 0)
    for s, (books, norms) in enumerate(zip(tables.books, tables.norms, strict=True)):
        rows = books.shape[0]
        if rows < residual.shape[0]:
            residual = residual[:rows]
        # as in encode: codebook rows times vectors, ||x||^2 left out of the argmin
        score = torch.baddbmm(norms, books, residual.transpose(1, 2), alpha=-2.0)
        idx = score.min(dim=1)[1]
        picked = torch.gather(books, 1, idx.unsqueeze(-1).expand(-1, -1, dim))
        if s + 1 < len(tables.books):
            residual = residual - picked
        if s == 0:
            recon = picked
        else:
            recon[:rows] += picked  # 0 + c0 + c1 + ..., encode's (and decode's) order
        codes[:rows, :, s] = idx
    out: list = [None] * len(xs)
    dtype = code_dtype(k)
    for p, i in enumerate(tables.order):
        part = slice(p * heads, (p + 1) * heads)
        c = codes[part, :, : tables.stages[i]].view(heads, batch, seq, -1).permute(1, 0, 2, 3)
        r = recon[part].view(heads, batch, seq, dim).permute(1, 0, 2, 3)
        out[i] = (c.to(dtype).contiguous(), r.to(xs[i].dtype).contiguous())
    return out


def check_codes(codes: torch.Tensor, codebook_size: int) -> None:
    """ValueError unless every code lies in ``[0, codebook_size)``. Reads the range back to the
    host (a device sync, a graph break under ``torch.compile``): call it where codes enter from
    outside, not per decode."""
    if codes.numel():
        lo, hi = int(codes.min()), int(codes.max())
        if lo < 0 or hi >= codebook_size:
            raise ValueError(f"codes must lie in [0, {codebook_size}), got range [{lo}, {hi}]")


def decode(
    codes: torch.Tensor,
    codebooks: torch.Tensor,
    dtype: torch.dtype = torch.float32,
    *,
    trusted: bool = False,
):
    """Vectors from residual-VQ codes.

    Args:
        codes: ``(batch, kv_heads, seq, stages)`` integer, values below ``codebook_size``.
        codebooks: ``(kv_heads, stages, codebook_size, head_dim)`` float.
        dtype: dtype of the result.
        trusted: skip :func:`check_codes` (its host sync): for codes this package's encoder
            wrote or that were checked where they entered (the codes-only cache's).

    Returns:
        ``(batch, kv_heads, seq, head_dim)``: the sum over stages of the chosen centroids.
    """
    _check_codebooks(codebooks)
    heads, stages, k, dim = codebooks.shape
    if codes.dim() != 4 or codes.shape[1] != heads or codes.shape[3] != stages:
        raise ValueError(
            f"codes must be (batch, {heads}, seq, {stages}) to match codebooks "
            f"{tuple(codebooks.shape)}, got {tuple(codes.shape)}"
        )
    if not trusted:
        check_codes(codes, k)
    idx = codes.to(torch.int64)
    batch, _, seq, _ = codes.shape
    cb = codebooks.to(device=codes.device, dtype=torch.float32)
    out = torch.zeros(heads, batch * seq, dim, device=codes.device)
    flat = idx.permute(1, 0, 2, 3).reshape(heads, batch * seq, stages)
    for s in range(stages):
        out += torch.gather(cb[:, s], 1, flat[..., s].unsqueeze(-1).expand(-1, -1, dim))
    return out.reshape(heads, batch, seq, dim).permute(1, 0, 2, 3).to(dtype).contiguous()
