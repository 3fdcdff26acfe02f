"""Argument checks shared by the Triton path and the torch reference.

Every check raises ``ValueError`` (or ``TypeError`` for a non-tensor) that names the argument,
what was expected and what arrived; nothing here uses ``assert``.
"""

from __future__ import annotations

import math
import numbers
import operator

import torch

from kernels._plan import MAX_SPLITS
from kernels.coded_cache import CodedCache, DecodeProblem

ACTIVATION_DTYPES = (torch.float16, torch.bfloat16)
CODEBOOK_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# The largest codebook each code dtype can address (codes are non-negative).
CODE_DTYPE_LIMITS = {torch.uint8: 256, torch.int16: 32768}
FLOAT32_MAX = 3.4028234663852886e38


def _tensor(name: str, value, ndim: int, dtypes: tuple[torch.dtype, ...]) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(value.shape)}")
    if value.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise ValueError(f"{name} must have dtype in ({names}), got {value.dtype}")
    return value


def _expect_dim(name: str, t: torch.Tensor, axis: int, expected: int, what: str) -> None:
    if t.shape[axis] != expected:
        raise ValueError(
            f"{name} has shape {tuple(t.shape)}: dimension {axis} ({what}) must be {expected}"
        )


def _lengths(name: str, value, batch: int, full: int, device: torch.device,
             check: bool) -> tuple[torch.Tensor, int | torch.Tensor | None]:
    """Per-sequence lengths as int32 on ``device``, and their values on the host where they are
    known without a device sync: an int for the default (every sequence full), a CPU tensor,
    or ``None`` for device lengths left unchecked.

    Defaults, lists and CPU tensors are checked on the host; lengths already on a GPU are read
    back to be checked, unless ``check`` is false (then nothing waits for the GPU)."""
    if value is None:
        return torch.full((batch,), full, dtype=torch.int32, device=device), full
    if isinstance(value, (list, tuple)):
        try:  # ints only: a float would be truncated silently, a bool taken as 0 or 1
            if any(isinstance(v, bool) for v in value):
                raise TypeError("booleans are not lengths")
            value = torch.tensor([operator.index(v) for v in value], dtype=torch.int64)
        except (TypeError, ValueError, RuntimeError, OverflowError) as exc:
            raise ValueError(
                f"{name} must hold integers, got {list(value)[:8]!r} ({exc})") from None
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a tensor or a list of ints, got {type(value).__name__}")
    if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
        raise ValueError(f"{name} must hold integers, got dtype {value.dtype}")
    if tuple(value.shape) != (batch,):
        raise ValueError(f"{name} must have shape ({batch},) (one per sequence), got "
                         f"{tuple(value.shape)}")
    host = None
    if value.device.type == "cpu" or check:
        host = value.to("cpu", torch.int64)  # one read-back for lengths on a GPU
        low, high = int(host.min()), int(host.max())
        if low < 0 or high > full:
            raise ValueError(f"{name} must lie in [0, {full}] (the cache's capacity), got "
                             f"values from {low} to {high}")
    return value.to(device=device, dtype=torch.int32).contiguous(), host


def _exact_pair(kind: str, keys, values, query: torch.Tensor, kv_heads: int):
    """Sink or recent K/V: both absent (an empty segment) or both ``(batch, kv_heads, n, d)``."""
    batch, _, head_dim = query.shape
    if keys is None and values is None:
        empty = query.new_zeros((batch, kv_heads, 0, head_dim))
        return empty, empty
    if keys is None or values is None:
        raise ValueError(f"{kind}_keys and {kind}_values must be given together")
    for name, t in ((f"{kind}_keys", keys), (f"{kind}_values", values)):
        _tensor(name, t, 4, (query.dtype,))
        _expect_dim(name, t, 0, batch, "batch")
        _expect_dim(name, t, 1, kv_heads, "kv_heads")
        _expect_dim(name, t, 3, head_dim, "head_dim")
        if t.device != query.device:
            raise ValueError(f"{name} is on {t.device}, the query on {query.device}")
    if keys.shape != values.shape:
        raise ValueError(f"{kind}_keys {tuple(keys.shape)} and {kind}_values "
                         f"{tuple(values.shape)} must have the same shape")
    return keys, values


def _codes(name: str, codes, codebooks: torch.Tensor, query: torch.Tensor, check_range: bool):
    _tensor(name, codes, 4, tuple(CODE_DTYPE_LIMITS))
    batch = query.shape[0]
    _expect_dim(name, codes, 0, batch, "batch")
    _expect_dim(name, codes, 1, codebooks.shape[0], "kv_heads")
    _expect_dim(name, codes, 3, codebooks.shape[1], "stages, as in the codebooks")
    limit = CODE_DTYPE_LIMITS[codes.dtype]
    if codebooks.shape[2] > limit:
        raise ValueError(f"{name} has dtype {codes.dtype}, which addresses at most {limit} "
                         f"centroids, but the codebook has {codebooks.shape[2]}")
    if codes.device != query.device:
        raise ValueError(f"{name} is on {codes.device}, the query on {query.device}")
    if check_range:
        check_code_range(name, codes, codebooks.shape[2])


def check_code_range(name: str, codes: torch.Tensor, codebook_size: int) -> None:
    """Raise ValueError unless every code lies in ``[0, codebook_size)`` (one reduction)."""
    if codes.numel():
        low, high = torch.stack(torch.aminmax(codes)).tolist()  # one read-back
        if low < 0 or high >= codebook_size:
            raise ValueError(f"{name} holds codes from {low} to {high}; they must lie in "
                             f"[0, {codebook_size}) (the codebook size)")


def check_num_splits(num_splits) -> None:
    """``None`` (automatic) or an int in ``[1, MAX_SPLITS]``; else ValueError."""
    if num_splits is None:
        return
    if isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral) \
            or not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be None or an int in [1, {MAX_SPLITS}], "
                         f"got {num_splits!r}")


def _scale(scale, head_dim: int) -> float:
    """The softmax scale as a float: positive, and finite once folded into float32 scores."""
    if scale is None:
        return head_dim ** -0.5
    if isinstance(scale, torch.Tensor) and scale.numel() == 1 and scale.dim() == 0:
        scale = scale.item()
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise ValueError(f"scale must be a positive number, got {scale!r}")
    value = float(scale)
    # the kernels fold scale * log2(e) into float32
    if not (value > 0 and math.isfinite(value * 1.4426950408889634)
            and value * 1.4426950408889634 < FLOAT32_MAX):
        raise ValueError(f"scale must be a positive number whose product with log2(e) is a "
                         f"finite float32, got {scale!r}")
    return value


def exact_segments(query, kv_heads: int, archived: int, sink_keys, sink_values, recent_keys,
                   recent_values, sink_lengths, archived_lengths, recent_lengths,
                   check_lengths: bool):
    """The exact sink and recent segments and the three lengths of a decode call, checked
    (shared by the RVQ and FSQ calls): ``(sink_keys, sink_values, recent_keys, recent_values,
    sink_lengths, archived_lengths, recent_lengths, host_lengths)``, where ``host_lengths`` is
    ``(sink, archived)`` on the host when known without a GPU read-back, else None. ValueError
    when a sequence has nothing cached at all."""
    batch = query.shape[0]
    sink_keys, sink_values = _exact_pair("sink", sink_keys, sink_values, query, kv_heads)
    recent_keys, recent_values = _exact_pair("recent", recent_keys, recent_values, query,
                                             kv_heads)
    device = query.device
    sink_lengths, sink_host = _lengths("sink_lengths", sink_lengths, batch, sink_keys.shape[2],
                                       device, check_lengths)
    archived_lengths, archived_host = _lengths("archived_lengths", archived_lengths, batch,
                                               archived, device, check_lengths)
    recent_lengths, recent_host = _lengths("recent_lengths", recent_lengths, batch,
                                           recent_keys.shape[2], device, check_lengths)
    hosts = (sink_host, archived_host, recent_host)
    known = None
    if all(h is not None for h in hosts):
        total = sum(hosts)  # an int when every length is the default, else a CPU tensor
        total = [total] * batch if isinstance(total, int) else total.tolist()
        empty = [i for i, n in enumerate(total) if n < 1]
        if empty:
            raise ValueError(f"sequences {empty} have no cached position at all (sink, "
                             "archived and recent lengths are all 0); attention over nothing "
                             "is undefined")
        known = (sink_host, archived_host)
    return (sink_keys, sink_values, recent_keys, recent_values, sink_lengths, archived_lengths,
            recent_lengths, known)


def validate_decode_args(
    query,
    key_codes,
    value_codes,
    key_codebooks,
    value_codebooks,
    *,
    archived_lengths=None,
    sink_keys=None,
    sink_values=None,
    sink_lengths=None,
    recent_keys=None,
    recent_values=None,
    recent_lengths=None,
    scale=None,
    check_codes: bool = True,
    check_lengths: bool = True,
) -> DecodeProblem:
    """Check every argument of a decode-attention call and return them normalised.

    Nothing here waits for the GPU unless ``check_codes`` is true (the codes' range is read
    back), ``check_lengths`` is true and some lengths are GPU tensors (each is read back), or
    ``scale`` is a GPU tensor (read back); without those, a call can be captured in a CUDA
    graph."""
    _tensor("query", query, 3, ACTIVATION_DTYPES)
    batch, q_heads, head_dim = query.shape
    if batch < 1 or q_heads < 1 or head_dim < 1:
        raise ValueError(f"query has shape {tuple(query.shape)}; every dimension must be >= 1")
    for name, cb in (("key_codebooks", key_codebooks), ("value_codebooks", value_codebooks)):
        _tensor(name, cb, 4, CODEBOOK_DTYPES)
        _expect_dim(name, cb, 3, head_dim, "head_dim, as in the query")
        if min(cb.shape) < 1:
            raise ValueError(f"{name} has shape {tuple(cb.shape)}; every dimension must be >= 1")
        if cb.device != query.device:
            raise ValueError(f"{name} is on {cb.device}, the query on {query.device}")
    kv_heads = key_codebooks.shape[0]
    if q_heads % kv_heads:
        raise ValueError(f"query has {q_heads} heads, which is not a multiple of the "
                         f"{kv_heads} kv_heads of the codebooks")
    _expect_dim("value_codebooks", value_codebooks, 0, kv_heads, "kv_heads, as in key_codebooks")
    _codes("key_codes", key_codes, key_codebooks, query, check_codes)
    _codes("value_codes", value_codes, value_codebooks, query, check_codes)
    if key_codes.shape[2] != value_codes.shape[2]:
        raise ValueError(f"key_codes {tuple(key_codes.shape)} and value_codes "
                         f"{tuple(value_codes.shape)} must hold the same number of positions "
                         "(dimension 2)")
    (sink_keys, sink_values, recent_keys, recent_values, sink_lengths, archived_lengths,
     recent_lengths, _) = exact_segments(
        query, kv_heads, key_codes.shape[2], sink_keys, sink_values, recent_keys, recent_values,
        sink_lengths, archived_lengths, recent_lengths, check_lengths)
    scale = _scale(scale, head_dim)
    cache = CodedCache(
        key_codes=key_codes,
        value_codes=value_codes,
        key_codebooks=key_codebooks.contiguous(),
        value_codebooks=value_codebooks.contiguous(),
        sink_keys=sink_keys,
        sink_values=sink_values,
        recent_keys=recent_keys,
        recent_values=recent_values,
        sink_lengths=sink_lengths,
        archived_lengths=archived_lengths,
        recent_lengths=recent_lengths,
    )
    return DecodeProblem(query.contiguous(), cache, float(scale))


def validate_coded_cache(query, cache: CodedCache, *, check_codes: bool = True,
                         check_lengths: bool = True) -> CodedCache:
    """Check ``cache`` against ``query`` ``(batch, q_heads, head_dim)`` as
    :func:`kernels.rvq_decode_attention` checks its arguments (the same ``ValueError`` /
    ``TypeError``, naming the argument); returns it normalised: contiguous codebooks, every
    length an int32 tensor on the query's device."""
    if not isinstance(cache, CodedCache):
        raise TypeError(f"cache must be a kernels.CodedCache, got {type(cache).__name__}")
    c = cache
    return validate_decode_args(
        query, c.key_codes, c.value_codes, c.key_codebooks, c.value_codebooks,
        archived_lengths=c.archived_lengths, sink_keys=c.sink_keys, sink_values=c.sink_values,
        sink_lengths=c.sink_lengths, recent_keys=c.recent_keys, recent_values=c.recent_values,
        recent_lengths=c.recent_lengths, check_codes=check_codes,
        check_lengths=check_lengths).cache
