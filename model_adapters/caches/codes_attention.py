"""Attention over a layer whose archived positions are held only as residual-VQ codes.

A codes-only cache layer (:mod:`model_adapters.caches.codes_only`) cannot hand the model a dense
key tensor for its archived positions, so its ``update`` returns the exact recent keys with the
layer itself attached (attribute :data:`LAYER_ATTR`), and the attention function registered here
under :data:`CODES_ATTENTION` reads that layer's :class:`kernels.CodedCache` (sinks, codes,
codebooks, recents: the one representation of a decode step's cache the kernels share):

- one query token and no masked position (plain decoding), float16/bfloat16:
  :func:`kernels.decode_attention` (the trusted per-step path: the layer validated its cache
  once) when the layer's ``backend`` asks for it (``"triton"``; ``"auto"`` where
  :func:`kernels.kernel_takes`, the kernels' one "auto" decision, says a kernel runs the step;
  ``"torch"``, the dequantizing reference, for CUDA tensors); everything else, a CPU included,
  :func:`lookup_attention`, which works in float32 on any device and reads a few bytes per
  archived position instead of decoding the archive (``docs/serving.md``, "Decode on a CPU");
- one query token of a left-padded batch: the same two paths over a cache with per-sequence
  lengths (each sequence's own window, :mod:`model_adapters.caches.padded`), which say what each
  sequence attends; the model's mask (batch positions) is not used;
- several query tokens (prefill, chunked prefill, verification of draft tokens): the layer's codes
  are decoded into a dense K/V that lives only for this call (one layer's dense K/V for the
  duration of one attention call), and SDPA runs over it as below.

Chunk invariance. A query at position ``p`` must see the cache as token-by-token decoding would:
positions archived once ``p + 1`` positions are held (:func:`~model_adapters.caches.window.
archive_end`) coded, the others exact. In a multi-token forward the positions that leave the
window inside the chunk (a :class:`Transit`, handed over by either cache's ``update``) are coded
for the later queries and exact for the earlier ones: they are attended in both forms, their
exact copies appended after the cache's positions, and a per-query mask (:func:`transit_mask`)
picks one form for each query. The archiving cache hands its layer over the same way when a
chunk has a transit, so it too needs this attention function for multi-token forwards.

Tensors that carry no layer (another cache, or no cache) go to transformers' SDPA unchanged, so a
model switched to this implementation still works with any other cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import kernels
from kernels import CODE_DTYPE_LIMITS, CodedCache

__all__ = [
    "CODES_ATTENTION",
    "chunk_attention_forward",
    "LAYER_ATTR",
    "Transit",
    "codes_attention_forward",
    "left_pads",
    "lookup_attention",
    "register_codes_attention",
    "require_codes_attention",
    "segment_mask",
    "transit_mask",
    "use_codes_attention",
]

CODES_ATTENTION = "fkv_codes"
LAYER_ATTR = "_fkv_codes_layer"
_KERNEL_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Transit:
    """Positions ``[lo, lo + n)`` that a multi-token forward archived while some of its queries
    still see them exact, with their exact K/V ``(batch, kv_heads, n, head_dim)``; ``sinks``,
    ``recent`` and ``block`` are the cache's window (see :mod:`model_adapters.caches.window`);
    ``pads``, ``(batch,)`` int64 or None (no padding), the left padding of each sequence, whose
    window starts after its pads."""

    lo: int
    keys: torch.Tensor
    values: torch.Tensor
    sinks: int
    recent: int
    block: int
    pads: torch.Tensor | None = None

    @property
    def hi(self) -> int:
        return self.lo + self.keys.shape[2]


def left_pads(update_kwargs: dict, length: int, forward_position_ids=None) -> list[int] | None:
    """The left padding of each sequence, read from the ``position_ids`` a model hands
    ``cache.update`` (transformers 5.24 passes them in ``kwargs``; ``generate`` numbers each
    sequence's first real token 0), else from ``forward_position_ids``, those the model's
    forward was called with (transformers 5.17 does not hand them to ``update``; see
    :func:`use_codes_attention`): ``length - 1 - position_ids[:, -1]`` for a cache of
    ``length`` positions after the update, None when nothing is padded or no position ids came.
    Reads them back to the host (once per sequence: caches call this on their first update)."""
    inner = update_kwargs.get("kwargs")
    ids = (inner if isinstance(inner, dict) else update_kwargs).get("position_ids")
    if ids is None:
        ids = forward_position_ids
    if not isinstance(ids, torch.Tensor) or ids.ndim != 2:
        return None
    pads = [min(max(0, length - 1 - int(p)), length - 1) for p in ids[:, -1].tolist()]
    return pads if any(pads) else None


def transit_mask(
    mask: torch.Tensor | None, transit: Transit, q_len: int, kv_len: int, device
) -> torch.Tensor:
    """The attention mask over ``kv_len`` cache positions followed by the transit's exact
    copies, for the last ``q_len`` positions as queries.

    In sequence ``b`` (left padding ``P``, 0 without padding) position ``j`` is a pad below
    ``P``, a sink below ``P + sinks``, and otherwise coded in the cache's column when ``j <
    P + archive_end(kv_len - P)``. Query ``p`` sees it coded when ``j < P + archive_end(p + 1 -
    P)`` and exact otherwise (:mod:`model_adapters.caches.window`): the cache's column where
    that is its form, the appended exact copy where the column is coded but the query needs it
    exact; every column also keeps the model's ``mask``. Args: ``mask`` broadcastable to
    ``(batch, heads, q_len, kv_len)``, boolean (True attends) or additive float, or None
    (causal). Returns the same kind, ``(..., q_len, kv_len + n)``. Device arithmetic only (no
    host synchronisation).
    """
    t = transit
    pads = 0 if t.pads is None else t.pads.to(device)[:, None, None, None]
    p = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]

    def archive_end(n):  # window.archive_end in each sequence's own positions
        return pads + t.sinks + t.block * ((n - pads - t.recent - t.sinks).clamp(min=0) // t.block)

    def forms(j):  # (stored coded, seen coded, seen exact) for columns at positions j
        body = j >= pads + t.sinks
        bound = archive_end(p + 1)
        coded = body & (j < archive_end(torch.tensor(kv_len, device=device)))
        return coded, body & (j < bound), (j >= bound) & (j <= p)

    j = torch.arange(kv_len, device=device)
    coded, sees_coded, _ = forms(j)
    main = coded == sees_coded
    jt = j[t.lo : t.hi]
    coded_t, _, sees_exact_t = forms(jt)
    extra = coded_t & sees_exact_t & (jt >= pads + t.sinks)
    select = torch.cat([main.expand(*extra.shape[:-1], -1), extra], -1)
    if select.ndim == 2:
        select = select[None, None]
    if mask is None:
        return select & torch.cat([j <= p, jt <= p], -1)
    mask = mask[..., :kv_len]
    full = torch.cat([mask, mask[..., t.lo : t.hi]], -1)
    if full.dtype == torch.bool:
        return full & select
    return full.masked_fill(~select, torch.finfo(full.dtype).min)


def chunk_attention_forward(module, query, keys, values, attention_mask, transit, **kwargs):
    """SDPA over ``keys``/``values`` (every cache position in its stored form) plus, when
    ``transit`` is not None, its exact copies under :func:`transit_mask`."""
    if transit is None:
        return sdpa_attention_forward(module, query, keys, values, attention_mask, **kwargs)
    keys = torch.cat([keys, transit.keys.to(keys.dtype)], 2)
    values = torch.cat([values, transit.values.to(values.dtype)], 2)
    kv_len = keys.shape[2] - transit.keys.shape[2]
    mask = transit_mask(attention_mask, transit, query.shape[2], kv_len, query.device)
    return sdpa_attention_forward(module, query, keys, values, mask, **kwargs)


def lookup_attention(
    query: torch.Tensor, cache: CodedCache, *, mask: torch.Tensor | None = None, scale: float
) -> torch.Tensor:
    """Attention over sinks, coded archive and recents by codebook look-ups, in float32.

    Keys are never rebuilt: ``q · k = Σ_stage q · C[stage, code]`` is read from a
    ``(stages, codebook_size)`` table per query; values are summed per centroid first, then
    multiplied with the codebook once.

    Args:
        query: ``(batch, q_heads, q_len, head_dim)``, any float dtype.
        cache: sinks ``(batch, kv_heads, sinks, head_dim)`` (sinks may be 0), codes
            ``(batch, kv_heads, archived, stages)`` of any integer dtype, codebooks
            ``(kv_heads, stages, codebook_size, head_dim)``, recents ``(batch, kv_heads,
            recent, head_dim)``; where its lengths are given, sequence ``b`` attends to the first
            ``sink_lengths[b]`` sinks, ``archived_lengths[b]`` codes and ``recent_lengths[b]``
            recents only (as the kernels do).
        mask: broadcastable to ``(batch, 1 or q_heads, q_len, sinks + archived + recent)``,
            boolean (True attends) or additive float; None attends to everything.
        scale: softmax scale.

    Returns:
        ``(batch, q_heads, q_len, head_dim)`` in the query's dtype.
    """
    c = cache
    sink_keys, sink_values, recent_keys, recent_values = (
        c.sink_keys, c.sink_values, c.recent_keys, c.recent_values)
    key_codes, value_codes = c.key_codes, c.value_codes
    key_codebooks, value_codebooks = c.key_codebooks, c.value_codebooks
    batch, q_heads, q_len, dim = query.shape
    kv_heads = key_codebooks.shape[0]
    group = q_heads // kv_heads
    q = query.float().reshape(batch, kv_heads, group, q_len, dim) * scale
    pieces = [torch.einsum("bhgqd,bhnd->bhgqn", q, sink_keys.float())]
    archived = key_codes.shape[2]
    table = torch.einsum("bhgqd,hskd->bhgqsk", q, key_codebooks.float())
    coded = q.new_zeros(batch, kv_heads, group, q_len, archived)
    kidx = key_codes.long()[:, :, None, None]  # (b, h, 1, 1, n, stages)
    for stage in range(key_codebooks.shape[1]):
        idx = kidx[..., stage].expand(-1, -1, group, q_len, -1)
        coded += torch.gather(table[..., stage, :], -1, idx)
    pieces += [coded, torch.einsum("bhgqd,bhnd->bhgqn", q, recent_keys.float())]
    scores = torch.cat(pieces, -1).reshape(batch, q_heads, q_len, -1)
    if mask is not None:
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, float("-inf"))
        else:
            scores = scores + mask.float()
    within = segment_mask(cache)
    if within is not None:
        scores = scores.masked_fill(~within, float("-inf"))
    weights = torch.softmax(scores, -1).reshape(batch, kv_heads, group, q_len, -1)
    sinks = sink_keys.shape[2]
    w_sink, w_coded, w_recent = weights.split([sinks, archived, recent_keys.shape[2]], -1)
    out = torch.einsum("bhgqn,bhnd->bhgqd", w_sink, sink_values.float())
    out += torch.einsum("bhgqn,bhnd->bhgqd", w_recent, recent_values.float())
    vidx = value_codes.long()[:, :, None, None]
    size = value_codebooks.shape[2]
    for stage in range(value_codebooks.shape[1]):
        hist = w_coded.new_zeros(batch, kv_heads, group, q_len, size)
        hist.scatter_add_(-1, vidx[..., stage].expand(-1, -1, group, q_len, -1), w_coded)
        out += torch.einsum("bhgqk,hkd->bhgqd", hist, value_codebooks[:, stage].float())
    return out.reshape(batch, q_heads, q_len, dim).to(query.dtype)


def segment_mask(cache: CodedCache) -> torch.Tensor | None:
    """``(batch, 1, 1, sinks + archived + recent)`` bool: True on the entries within each
    segment's length (:class:`kernels.CodedCache`: valid entries first); None when no length
    is given. Device arithmetic only."""
    if cache.sink_lengths is None and cache.archived_lengths is None \
            and cache.recent_lengths is None:
        return None
    c = cache.with_lengths()
    device = c.key_codes.device
    parts = [torch.arange(size, device=device) < lengths.to(device)[:, None]
             for size, lengths in ((c.sink_keys.shape[2], c.sink_lengths),
                                   (c.archived, c.archived_lengths),
                                   (c.recent_keys.shape[2], c.recent_lengths))]
    return torch.cat(parts, 1)[:, None, None]


def _kernel_path(backend: str, query: torch.Tensor, cache: CodedCache) -> bool:
    """Whether a decode step with ``query`` ``(batch, q_heads, head_dim)`` goes to
    :func:`kernels.decode_attention` (see the module)."""
    if backend == "auto":  # a kernel if one takes the step, else the look-ups (never the
        return kernels.kernel_takes(query, cache)  # dequantizing reference)
    if query.dtype not in _KERNEL_DTYPES:
        return False
    if backend == "triton":  # on CPU tensors the layer's one validation explains what it needs
        return True
    # "torch": the kernel API's reference, for CUDA tensors and the codes it takes (codebooks
    # over 32,768 centroids get int32 codes, which only the look-ups read)
    codes = {cache.key_codes.dtype, cache.value_codes.dtype}
    return query.is_cuda and codes <= set(CODE_DTYPE_LIMITS)


def _all_visible(mask: torch.Tensor | None) -> bool:
    if mask is None:
        return True
    if mask.dtype == torch.bool:
        return bool(mask.all())
    return bool((mask == 0).all())


def codes_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
):
    """transformers attention function (the ``AttentionInterface`` signature).

    Returns ``(attn_output, None)`` with ``attn_output`` ``(batch, q_len, q_heads, head_dim)``.
    """
    layer = getattr(key, LAYER_ATTR, None)
    if layer is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    attend = getattr(layer, "attend", None)
    if attend is not None:  # a static-shape layer (static_codes.py) answers for itself
        return attend(module, query, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    # layers written before chunk invariance (no take_transit, no pads) keep working as before
    take_transit = getattr(layer, "take_transit", None)
    transit = take_transit() if take_transit is not None else None
    if not hasattr(layer, "coded_cache"):  # an archiving layer: its keys hold every position
        return chunk_attention_forward(module, query, key, value, attention_mask, transit,
                                       dropout=dropout, scaling=scaling, **kwargs)
    cache = layer.coded_cache()
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if query.shape[2] == 1 and cache.archived:
        step = query[:, :, 0]
        # a left-padded batch: per-sequence lengths say what each sequence attends, and the
        # model's mask (over the batch's positions) does not apply to this layout
        padded = cache.sink_lengths is not None
        attention_mask = None if padded else attention_mask
        if _kernel_path(layer.backend, step, cache) and _all_visible(attention_mask):
            cache = layer.checked_for_kernels(step, cache)
            backend = "triton" if layer.backend == "auto" else layer.backend  # decided above
            out = kernels.decode_attention(step, cache, scale=scale, backend=backend)
            return out[:, None], None
        out = lookup_attention(query, cache, mask=attention_mask, scale=scale)
        return out.transpose(1, 2).contiguous(), None
    dense_k, dense_v = layer.dense(query.dtype)
    return chunk_attention_forward(module, query, dense_k, dense_v, attention_mask, transit,
                                   dropout=dropout, scaling=scaling, **kwargs)


def register_codes_attention() -> str:
    """Register :func:`codes_attention_forward` (and SDPA-style masks) under
    :data:`CODES_ATTENTION`; returns that name. Idempotent."""
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(CODES_ATTENTION, codes_attention_forward)
    AttentionMaskInterface.register(CODES_ATTENTION, sdpa_mask)
    return CODES_ATTENTION


def require_codes_attention(model_or_config, cache_name: str) -> None:
    """ValueError unless ``model_or_config`` is a config (nothing to check: the cache notices at
    run time) or a model whose attention implementation is :data:`CODES_ATTENTION`."""
    impl = getattr(getattr(model_or_config, "config", None), "_attn_implementation", None)
    if hasattr(model_or_config, "config") and impl != CODES_ATTENTION:
        raise ValueError(
            f"the model's attention implementation is {impl!r}; the {cache_name} needs "
            f"{CODES_ATTENTION!r}: call model_adapters.use_codes_attention(model)"
        )


def check_kv_states(shape, key_states: torch.Tensor, layer_idx: int, cache_name: str) -> None:
    """ValueError, before the cache changes, when a forward's keys do not fit the model the
    cache was built for (``shape``: its :class:`~model_adapters.models.KVShape`)."""
    heads, dim = key_states.shape[1], key_states.shape[-1]
    if layer_idx >= shape.num_layers or (heads, dim) != (shape.kv_heads, shape.head_dim):
        raise ValueError(
            f"the {cache_name} was built for a model of {shape.num_layers} layers x "
            f"{shape.kv_heads} kv heads x {shape.head_dim}, but layer {layer_idx} hands it "
            f"{heads} kv heads x {dim}: build the cache for the model it runs with")


def unread_error(layer_idx: int, cache_name: str) -> RuntimeError:
    """The error a cache raises when the attention function never read a layer it handed over."""
    return RuntimeError(
        f"layer {layer_idx} of the {cache_name} was updated but attention did not read it: the "
        f"model's attention implementation must be {CODES_ATTENTION!r} (call "
        "model_adapters.use_codes_attention(model))"
    )


def use_codes_attention(model):
    """Switch ``model`` to the codes attention (registering it first); returns the model.

    Also hooks the model's forward so that a cache of this package sees the ``position_ids``
    the forward was called with (``generate`` passes them, counting each sequence from its
    first real token): the caches read a batch's left padding from them where transformers
    does not hand them to ``cache.update`` (5.17). Idempotent."""
    register_codes_attention()
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(CODES_ATTENTION)
    else:  # releases without set_attn_implementation read the config at call time
        model.config._attn_implementation = CODES_ATTENTION
    if isinstance(model, torch.nn.Module) and not getattr(model, _HOOKED, False):
        model.register_forward_pre_hook(_note_forward_positions, with_kwargs=True)
        model.register_forward_hook(_forget_forward_positions, with_kwargs=True,
                                    always_call=True)
        setattr(model, _HOOKED, True)
    return model


_HOOKED = "_fkv_positions_hooked"
NOTED_POSITIONS = "forward_position_ids"  # the attribute a cache declares to be told


def _forward_cache(kwargs: dict):
    for name in ("past_key_values", "cache"):  # the cache's keyword on 5.17 / 5.24
        cache = kwargs.get(name)
        if cache is not None and hasattr(cache, NOTED_POSITIONS):
            return cache
    return None


def _note_forward_positions(module, args, kwargs):
    """Forward pre-hook: tell the forward's cache its ``position_ids`` (None when not given)."""
    if torch.compiler.is_compiling():  # traced decode steps never start a sequence
        return None
    cache = _forward_cache(kwargs)
    if cache is not None:
        setattr(cache, NOTED_POSITIONS, kwargs.get("position_ids"))
    return None


def _forget_forward_positions(module, args, kwargs, output):
    """Forward hook (also after an exception): the positions belong to that forward only."""
    if torch.compiler.is_compiling():
        return None
    cache = _forward_cache(kwargs)
    if cache is not None:
        setattr(cache, NOTED_POSITIONS, None)
    return None
