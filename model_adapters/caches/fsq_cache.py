"""The cache of an FSQ-converted model: one bit-packed integer code row per token per layer.

:class:`FSQCache` is a transformers ``Cache`` whose layers (:class:`FsqLayer`) hold only the
packed codes, ``(batch, seq, packed_bytes)`` uint8 per layer (``w = 32, L = 16``: 16 bytes per
token per layer), shared by every KV head; nothing else grows with the context. A converted
attention layer (:mod:`model_adapters.quant.fsq_model`) recognises it by :meth:`FSQCache.
fsq_attention` and hands it the query and the new tokens' integer codes:

- one query token, CUDA, float16/bfloat16, nothing masked, and a problem the kernel takes:
  :func:`kernels.fsq_decode_attention` (Triton; no dense K/V in memory);
- everything else (prefill, chunks, masks, CPU): :func:`fsq_torch_attention`, which reconstructs
  the keys (decoder, k_norm, RoPE at each position) and applies the value decoder once to the
  attention-pooled codes: ``sum_t p_t (W c_t + b) = W (sum_t p_t c_t) + b`` since the weights sum
  to one, so this equals attending over decoded values (tested).

Codes are computed per token from the layer input, so appending in any chunking gives the same
rows (chunk invariant). No exact sink/recent window: in a converted model the decoded K/V *are*
the model's keys and values (the base model's projections are gone), so there is nothing more
exact to keep.

Positions: the model's ``position_ids`` of each token are kept once for the whole cache (8
bytes per token, in the first layer), so left-padded batches rotate keys where the model's own
forward does.

RoPE: keys rotate with the model's own rotary embedding's ``inv_freq``, the frequencies that
rotated its queries, with angles computed as transformers computes them (``position *
inv_freq`` in float32), not with frequencies recomputed from theta. ``model.to(torch.bfloat16)``
rounds that buffer to bfloat16 (relative error up to 2^-9); keys rotated at theta's exact
frequencies then drift from the queries by ``position * error`` radians (several radians at 8K
positions), which broke long-context retrieval. The Triton kernel gets theta when the model's
frequencies are theta's (float32), else those frequencies (``kernels.RopeFrequencies``, read
back once); it computes ``position * inv_freq`` exactly (float64 tables, angle sums in
float32), which differs from transformers' float32 product by that product's rounding (up to
``2^-24`` of the angle: ~5e-4 rad at 8K positions, ~8e-3 at 128K), far below the drift of the
rounded frequencies above.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from transformers.cache_utils import Cache

import kernels
from kernels import fsq_decode_attention
from model_adapters.caches.fsq_layers import FsqLayer, StaticFsqLayer
from model_adapters.caches.static_codes import CapacityError
from model_adapters.quant.fsq import FSQ
from model_adapters.quant.fsq_config import fsq_spec
from model_adapters.quant.fsq_model import attention_layers, rope_theta

__all__ = ["CapacityError", "FSQCache", "FsqLayer", "StaticFsqLayer", "decode_keys",
           "decode_values", "fsq_torch_attention", "rope_angles", "rotary_embedding"]

_BACKENDS = ("auto", "torch", "triton")


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], -1)


def rope_angles(rope, positions: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, ...]:
    """``(cos, sin)`` ``(n, head_dim)`` float32 at ``positions`` ``(n,)`` for ``rope``: a float
    theta (``inv_freq_i = theta^(-2i / head_dim)``) or the model's inverse frequencies
    ``(head_dim / 2,)`` (any float dtype). Computed as transformers' rotary embedding computes
    its queries' angles (``position * inv_freq`` in float32), so keys rotate exactly as the
    model's queries do, whatever the inverse frequencies' dtype."""
    if isinstance(rope, torch.Tensor):
        inv = rope.to(positions.device, torch.float32)
    else:
        inv = 1.0 / (float(rope) ** (torch.arange(0, head_dim, 2, dtype=torch.int64,
                                                  device=positions.device).float() / head_dim))
    angles = positions.float()[:, None] * inv[None, :]
    angles = torch.cat([angles, angles], dim=1)
    return angles.cos(), angles.sin()


def decode_keys(codes: torch.Tensor, folded, *, k_norm: torch.Tensor | None = None,
                norm_eps: float = 1e-6, rope: float | torch.Tensor | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
    """The keys integer codes stand for, as the model attends to them.

    Args:
        codes: ``(batch, seq, w)`` integer codes.
        folded, k_norm, norm_eps, rope: as in :func:`fsq_torch_attention`.
        positions: ``(batch, seq)`` RoPE positions (None: ``0 .. seq - 1``).

    Returns:
        ``(batch, kv_heads, seq, head_dim)`` float32: decoder, k_norm, then RoPE.
    """
    wk, bk = (t.float() for t in folded[:2])
    batch, seq = codes.shape[:2]
    dim = wk.shape[1]
    keys = torch.einsum("hdw,btw->bhtd", wk, codes.float()) + bk[None, :, None]
    if k_norm is not None:
        keys = keys * torch.rsqrt(keys.pow(2).mean(-1, keepdim=True) + norm_eps) * k_norm.float()
    if rope is not None:
        if positions is None:
            positions = torch.arange(seq, device=codes.device).expand(batch, seq)
        cos, sin = rope_angles(rope, positions.reshape(-1), dim)
        cos, sin = cos.view(batch, 1, seq, dim), sin.view(batch, 1, seq, dim)
        keys = keys * cos + _rotate_half(keys) * sin
    return keys


def decode_values(codes: torch.Tensor, folded) -> torch.Tensor:
    """``(batch, kv_heads, seq, head_dim)`` float32 values of ``(batch, seq, w)`` codes."""
    wv, bv = (t.float() for t in folded[2:])
    return torch.einsum("hdw,btw->bhtd", wv, codes.float()) + bv[None, :, None]


def fsq_torch_attention(query: torch.Tensor, codes: torch.Tensor, folded, *, scale: float,
                        k_norm: torch.Tensor | None = None, norm_eps: float = 1e-6,
                        rope: float | torch.Tensor | None = None,
                        positions: torch.Tensor | None = None,
                        mask: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of ``n`` new queries over ``seq`` cached codes, in float32.

    Args:
        query: ``(batch, q_heads, n, head_dim)``, normed and rotated; the new tokens are the
            last ``n`` of the ``seq`` cached ones.
        codes: ``(batch, seq, w)`` integer codes.
        folded: ``(key_weight, key_bias, value_weight, value_bias)``, weights ``(kv_heads,
            head_dim, w)`` and biases ``(kv_heads, head_dim)`` reading integer codes
            (:meth:`~model_adapters.quant.fsq.FsqBottleneck.folded`).
        scale: softmax scale. k_norm / norm_eps: Qwen3's key RMSNorm weight ``(head_dim,)``.
        rope: RoPE base (float) or the model's inverse frequencies ``(head_dim / 2,)``
            (:func:`rope_angles`), or None (no rotation).
        positions: ``(batch, seq)`` RoPE positions of the cached tokens (None: their indices).
        mask: broadcastable to ``(batch, q_heads, n, seq)``, boolean (True attends) or additive;
            None means causal.

    Returns:
        ``(batch, n, q_heads, head_dim)`` in the query's dtype.
    """
    wv, bv = (t.float() for t in folded[2:])
    batch, q_heads, n, dim = query.shape
    kv_heads, seq = wv.shape[0], codes.shape[1]
    z = codes.float()
    keys = decode_keys(codes, folded, k_norm=k_norm, norm_eps=norm_eps, rope=rope,
                       positions=positions)
    group = q_heads // kv_heads
    q = query.float().reshape(batch, kv_heads, group, n, dim)
    scores = torch.einsum("bhgnd,bhtd->bhgnt", q, keys).reshape(batch, q_heads, n, seq) * scale
    if mask is None:
        rows = torch.arange(n, device=codes.device)[:, None] + (seq - n)
        scores = scores.masked_fill(torch.arange(seq, device=codes.device) > rows, float("-inf"))
    elif mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask[..., -seq:], float("-inf"))
    else:
        scores = scores + mask[..., -seq:].float()
    # a query that sees nothing (a pad row of a left-padded batch) gets zeros, not NaN
    weights = torch.softmax(scores, -1).nan_to_num(0.0).reshape(batch, kv_heads, group, n, seq)
    pooled = torch.einsum("bhgnt,btw->bhgnw", weights, z)
    out = torch.einsum("bhgnw,hdw->bhgnd", pooled, wv) + bv[None, :, None, None]
    return out.reshape(batch, q_heads, n, dim).transpose(1, 2).to(query.dtype)


def rotary_embedding(model) -> torch.nn.Module | None:
    """The model's rotary embedding (the module whose ``inv_freq`` rotates its queries), or None
    (GPT-2). ValueError for one that scales its tables (``attention_scaling != 1``), which the
    codes path does not reproduce (conversion accepts plain RoPE only)."""
    found = [m for m in model.modules() if isinstance(getattr(m, "inv_freq", None), torch.Tensor)]
    if not found:
        return None
    scaling = float(getattr(found[0], "attention_scaling", 1.0))
    if scaling != 1.0:
        raise ValueError(f"FSQCache reproduces plain RoPE only; the model's rotary embedding "
                         f"scales by attention_scaling={scaling}")
    return found[0]


def _all_visible(mask) -> bool:
    if mask is None:
        return True
    return bool(mask.all()) if mask.dtype == torch.bool else bool((mask == 0).all())


class FSQCache(Cache):
    """The packed-code cache of an FSQ-converted model (see the module).

    Args:
        model: an FSQ-converted model (``FsqQwen3ForCausalLM`` / ``FsqGPT2LMHeadModel``) or its
            configuration's model.
        backend: ``"auto"`` (the Triton kernel for CUDA float16/bfloat16 decode steps it takes,
            else torch), ``"torch"``, or ``"triton"`` (the kernel for every decode step without
            masked positions; ValueError from the kernel where it cannot).
        capacity: the most positions the cache will hold, or None (grow as needed). With a
            capacity every layer's codes (and the positions) are allocated once at that size
            (:class:`StaticFsqLayer`) and the cache is compileable: ``torch.compile`` (and
            ``generate``, by itself on CUDA) traces a decode step into one graph for every
            length (an unpadded batch, after an eager prefill or :meth:`load`). Uncompiled on
            CUDA, each layer's decode-step kernel call is captured in a CUDA graph on its first
            step and replayed on the next ones (:class:`kernels.CapturedCall`: no argument
            checks, launches or read-backs per step; set ``capture_eager_steps = False`` to
            launch instead). Past the capacity: :class:`CapacityError` before anything is
            written (compiled steps: at the next eager call that learns the length). An eager
            step checks the mask once per prompt, at its first decode step (a padded batch runs
            torch); later steps' masks are trusted to be as visible, and decode steps'
            positions (below 2^22 for exact angles) are trusted to continue the prompt's.
    """

    def __init__(self, model, *, backend: str = "auto", capacity: int | None = None):
        if backend not in _BACKENDS:
            raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
        if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int)
                                     or capacity < 1):
            raise ValueError(f"capacity must be a positive int or None, got {capacity!r}")
        width, levels, _ = fsq_spec(model.config)
        n_layers = len(attention_layers(model))
        layers = [FsqLayer(keeps_positions=i == 0) if capacity is None
                  else StaticFsqLayer(capacity, keeps_positions=i == 0) for i in range(n_layers)]
        super().__init__(layers=layers)
        self.capacity = capacity
        self.capture_eager_steps = True
        self._captured: dict = {}  # layer index -> (key, kernels.CapturedCall)
        self.fsq = FSQ(levels)
        self.backend = backend
        self.rotary = rotary_embedding(model)
        self.rope_theta = None if self.rotary is None else rope_theta(model.config)
        self._kernel_rope: tuple = (None, None)  # (inverse-frequency key, the kernel's rope)
        self.kernel_calls = 0  # decode steps (per layer) sent to kernels.fsq_decode_attention

    def __getstate__(self) -> dict:
        """Copied and pickled without its captured calls (CUDA graphs, which neither copy nor
        pickle; the copy captures again at its first eager step)."""
        return {**self.__dict__, "_captured": {}}

    @property
    def packed_bytes(self) -> int:
        """Bytes of one token's code row in one layer."""
        return self.fsq.packed_bytes

    def nbytes(self) -> int:
        """Bytes the cache holds: every layer's packed codes, and the positions once (with a
        capacity: the buffers allocated at that size)."""
        return sum(layer.keys.nbytes + layer.values.nbytes for layer in self.layers
                   if layer.is_initialized and layer.keys is not None)

    def layer_codes(self, layer_idx: int) -> torch.Tensor | None:
        """Layer ``layer_idx``'s integer codes ``(batch, seq, w)`` int64 (None when empty)."""
        packed = self.layers[layer_idx].codes()
        return None if packed is None else self.fsq.unpack(packed)

    @torch.no_grad()
    def fsq_attention(self, module, query: torch.Tensor, codes: torch.Tensor,
                      attention_mask: torch.Tensor | None,
                      position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Called by a converted attention layer: append ``codes`` ``(batch, n, w)`` and attend.

        Args:
            module: the converted attention layer (bottleneck, k_norm, RoPE base, scale).
            query: ``(batch, q_heads, n, head_dim)``, normed and rotated.
            codes: ``(batch, n, w)`` integer codes of the new tokens.
            attention_mask: the model's mask for this layer.
            position_ids: ``(batch or 1, n)`` RoPE positions of the new tokens (None: their
                indices in the cache). Kept once for all layers: left-padded batches work.

        Returns:
            ``(batch, n, q_heads, head_dim)`` in the query's dtype.
        """
        layer = self.layers[module.layer_idx]
        batch, n = codes.shape[:2]
        static = isinstance(layer, StaticFsqLayer)
        if static and torch.compiler.is_compiling():
            return self._compiled_step(module, layer, query, codes, position_ids)
        if position_ids is None:
            start = layer.get_seq_length()
            position_ids = torch.arange(start, start + n, device=codes.device)
        position_ids = position_ids.to(codes.device, torch.long).expand(batch, n)
        # (FSQ.codes are in range by construction: packing them reads nothing back)
        packed = layer.append(self.fsq.pack(codes, check=False), position_ids)
        positions = self.layers[0].positions()
        if attention_mask is not None:  # (a capacity layer's decode-step mask spans its buffer)
            attention_mask = attention_mask[..., :packed.shape[1]]
        step = query.shape[2] == 1
        if static:
            self._rope_for_kernel(self._rope(module))  # (a compiled step reads it, cannot make it)
        if step and self._kernel_dtype(query) and self._visible(layer, attention_mask):
            self.kernel_calls += 1
            q = query[:, :, 0]
            if static and self._captures(q):
                captured = self._captured_step(module, layer, q)
                if captured is not None:
                    return captured(q)[:, None]
            folded, k_norm, eps, rope = self._decoding(module)
            out = fsq_decode_attention(
                q, packed, self.fsq.levels, folded[0], folded[2],
                key_bias=folded[1], value_bias=folded[3],
                rope=self._rope_for_kernel(rope),
                positions=positions if rope is not None else None, k_norm=k_norm, norm_eps=eps,
                scale=module.scaling, backend=self.backend)
            return out[:, None]
        folded, k_norm, eps, rope = self._decoding(module)
        return fsq_torch_attention(query, self.fsq.unpack(packed), folded, scale=module.scaling,
                                   k_norm=k_norm, norm_eps=eps, rope=rope, positions=positions,
                                   mask=attention_mask)

    def _kernel_dtype(self, query: torch.Tensor) -> bool:
        """Whether a decode step of this query may go to the kernel (then ``backend="auto"``
        still runs the reference for a problem the kernel does not take)."""
        return (self.backend != "torch" and query.dtype in (torch.float16, torch.bfloat16)
                and (query.is_cuda or self.backend == "triton"))

    def _compiled_step(self, module, layer: StaticFsqLayer, query: torch.Tensor,
                       codes: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
        """A decode step traced by ``torch.compile``: device operations only, on shapes that do
        not depend on the length (:meth:`StaticFsqLayer.step`, then attention over the whole
        buffer, the lengths saying what is attended), so one graph serves every later step.
        The mask is not read: compiled steps need an unpadded batch, every prompt position its
        index (``layers[0].consecutive``, checked eagerly once per prompt)."""
        if query.shape[2] != 1 or not layer.is_initialized:
            raise NotImplementedError(
                "a compiled forward of FSQCache(capacity=...) takes one token per sequence "
                "after an eager prefill; run multi-token forwards (prefills) eagerly")
        if not self.layers[0].consecutive:
            raise NotImplementedError(
                "compiled decode steps of FSQCache(capacity=...) need every prompt position "
                "to be its index (an unpadded batch); decode a padded batch eagerly "
                "(generate(..., disable_compile=True))")
        batch = codes.shape[0]
        if position_ids is None:
            position_ids = layer.lengths[:, None].long()
        layer.step(self.fsq.pack(codes, check=False),
                   position_ids.to(codes.device, torch.long).expand(batch, 1))
        q = query[:, :, 0]
        if self._kernel_dtype(query):
            problem = self._step_problem(module, layer, q, layer.attended())
            if self.backend == "triton" or kernels.fsq_kernel_takes(problem):
                return kernels.decode_fsq_problem(problem, backend="triton")[:, None]
        folded, k_norm, eps, rope = self._decoding(module)
        rows = layer.keys.shape[2]
        visible = torch.arange(rows, device=q.device) < layer.attended()[:, None]
        return fsq_torch_attention(query, self.fsq.unpack(layer.keys[:, 0]), folded,
                                   scale=module.scaling, k_norm=k_norm, norm_eps=eps, rope=rope,
                                   mask=visible[:, None, None, :])

    def _step_problem(self, module, layer: StaticFsqLayer, q: torch.Tensor,
                      lengths: torch.Tensor) -> kernels.FsqProblem:
        """The kernel problem of a capacity layer's decode step, built from the cache's own
        buffers without checks and without reading anything back (so ``torch.compile`` can
        trace it): the whole codes buffer, ``lengths`` ``(batch,)`` int32 attended, the key
        decoder in the query's dtype (as the warp-specialized kernel takes it; its products are
        16-bit either way, :mod:`model_adapters.quant.fsq_precision`'s ``bf16`` form), and the
        positions only unless every prompt's were their indices. :meth:`_captured_step`
        validates it once before capturing it."""
        folded, k_norm, eps, rope = self._decoding(module)
        positions = None
        rope = self._rope_for_kernel(rope)
        if rope is not None and not self.layers[0].consecutive:
            positions = self.layers[0].values[:, 0, :, 0]
        batch, _, dim = q.shape
        empty = q.new_zeros(batch, folded[0].shape[0], 0, dim)
        none = torch.zeros(batch, dtype=torch.int32, device=q.device)
        return kernels.FsqProblem(
            query=q.contiguous(), codes=layer.keys[:, 0], levels=tuple(self.fsq.levels),
            key_decoder=folded[0].to(q.dtype), value_decoder=folded[2], key_bias=folded[1],
            value_bias=folded[3], k_norm=k_norm, eps=eps, rope=rope, positions=positions,
            sink_keys=empty, sink_values=empty, recent_keys=empty, recent_values=empty,
            sink_lengths=none, archived_lengths=lengths, recent_lengths=none,
            scale=float(module.scaling))

    def _decoding(self, module) -> tuple:
        """``(folded decoders, k_norm weight or None, norm eps, rope)`` of a converted attention
        layer, ``rope`` being the model's own inverse frequencies where it has RoPE."""
        folded = module.fsq.folded()
        norm = module.fsq_k_norm
        k_norm = None if norm is None else norm.weight
        eps = 1e-6 if norm is None else float(getattr(norm, "variance_epsilon", 1e-6))
        return folded, k_norm, eps, self._rope(module)

    def _rope(self, module):
        """The layer's rotation: None (GPT-2), else the model's own inverse frequencies (what
        rotated the query: bf16 after ``model.to(bf16)``), or its theta without a rotary
        module."""
        rope = module.fsq_rope_theta
        if rope is not None and self.rotary is not None:
            rope = self.rotary.inv_freq
        return rope

    @staticmethod
    def _visible(layer, mask) -> bool:
        """Whether a decode step's mask hides nothing; a capacity layer asks once per prompt
        (one read-back), then trusts the answer for the prompt's decode steps."""
        if not isinstance(layer, StaticFsqLayer):
            return _all_visible(mask)
        if layer.visible is None:
            layer.visible = _all_visible(mask)
        return layer.visible

    def _captures(self, q: torch.Tensor) -> bool:
        """Whether a capacity layer's decode step replays a captured kernel call (CUDA, outside
        torch.compile and outside a capture of the caller's own)."""
        return (self.capture_eager_steps and q.is_cuda and not torch.compiler.is_compiling()
                and not torch.cuda.is_current_stream_capturing())

    def _captured_step(self, module, layer: StaticFsqLayer,
                       q: torch.Tensor) -> kernels.CapturedCall | None:
        """The layer's decode-step kernel call (:meth:`_step_problem`), validated once and
        captured once per query shape, scale, buffer addresses, bottleneck and k_norm weights
        (a buffer that moved or new weights get a new capture; the folded decoders are
        computed at the capture). It reads the codes, the positions where needed and the
        length from ``layer.lengths``, all on the GPU. None where ``backend="auto"`` finds a
        problem the kernel does not take (the reference reads the lengths back, which a
        capture cannot)."""
        weights = [*module.fsq.parameters()]  # (what the folded decoders come from)
        if module.fsq_k_norm is not None:
            weights += [*module.fsq_k_norm.parameters()]
        rotary = self.rotary.inv_freq if self.rotary is not None else None
        key = (tuple(q.shape), q.dtype, float(module.scaling), layer.keys.data_ptr(),
               self.layers[0].values.data_ptr(), layer.lengths.data_ptr(),
               self.layers[0].consecutive, *((w.data_ptr(), w._version) for w in weights),
               None if rotary is None else (rotary.data_ptr(), rotary._version))
        held = self._captured.get(module.layer_idx)
        if held is not None and held[0] == key:
            return held[1]
        p = self._step_problem(module, layer, q, layer.lengths)
        problem = kernels.validate_fsq_args(
            p.query, p.codes, p.levels, p.key_decoder, p.value_decoder, key_bias=p.key_bias,
            value_bias=p.value_bias, rope=p.rope, positions=p.positions, k_norm=p.k_norm,
            norm_eps=p.eps, archived_lengths=p.archived_lengths, scale=p.scale,
            check_codes=False, check_lengths=False, check_positions=False)
        captured = None
        if self.backend == "triton" or kernels.fsq_kernel_takes(problem):

            def step(query: torch.Tensor) -> torch.Tensor:
                return kernels.decode_fsq_problem(replace(problem, query=query),
                                                  backend="triton")

            captured = kernels.CapturedCall(step, q)
        self._captured[module.layer_idx] = (key, captured)
        return captured

    @torch.no_grad()
    def decode(self, module, codes: torch.Tensor,
               positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values ``(batch, n, w)`` integer codes stand for in ``module``'s layer
        (a converted attention layer of this cache's model), keys as attended: k_norm, then
        RoPE at ``positions`` ``(batch, n)`` (None: ``0 .. n - 1``). Each ``(batch, kv_heads,
        n, head_dim)`` float32."""
        folded, k_norm, eps, rope = self._decoding(module)
        keys = decode_keys(codes, folded, k_norm=k_norm, norm_eps=eps, rope=rope,
                           positions=positions)
        return keys, decode_values(codes, folded)

    def load(self, layer_codes: list[torch.Tensor], positions: torch.Tensor) -> None:
        """Fill an empty cache: ``layer_codes[i]`` ``(batch, seq, w)`` integer codes of layer
        ``i`` at ``(batch, seq)`` int64 ``positions`` (what :meth:`fsq_attention` would have
        appended for those tokens, e.g. read back from an archive)."""
        if self.get_seq_length() or len(layer_codes) != len(self.layers):
            raise ValueError(f"load needs an empty cache and {len(self.layers)} layers of codes, "
                             f"got {self.get_seq_length()} positions and {len(layer_codes)}")
        for layer, codes in zip(self.layers, layer_codes, strict=True):
            layer.append(self.fsq.pack(codes), positions.to(codes.device, torch.long))
        if self.rotary is not None:
            self._rope_for_kernel(self.rotary.inv_freq)  # (for compiled steps after this)

    def _rope_for_kernel(self, rope):
        """The kernel's ``rope``: the model's theta when its inverse frequencies are theta's
        (float32, as transformers computes them), else the model's own frequencies (e.g.
        rounded to bfloat16 by ``model.to(torch.bfloat16)``) as
        :class:`kernels.RopeFrequencies`; either way the kernel reduces the angles exactly in
        float64 tables. Read back once per frequency tensor, then cached (a compiled step
        reads the cached value: it cannot read back)."""
        if not isinstance(rope, torch.Tensor):
            return rope
        if torch.compiler.is_compiling():
            if self._kernel_rope[0] is None:
                raise NotImplementedError(
                    "a compiled decode step of FSQCache needs an eager forward or load() "
                    "first (the kernel's RoPE frequencies are read back once, eagerly)")
            return self._kernel_rope[1]
        theta, dim = self.rope_theta, 2 * rope.shape[0]
        key = (rope.data_ptr(), rope.dtype, rope.device, rope._version)
        if self._kernel_rope[0] != key:
            ref = 1.0 / (float(theta) ** (torch.arange(0, dim, 2, device=rope.device).float()
                                          / dim))
            exact = rope.dtype == torch.float32 and bool(
                torch.allclose(rope, ref, rtol=1e-6, atol=0.0))
            self._kernel_rope = (key, theta if exact else kernels.RopeFrequencies(
                tuple(rope.double().tolist())))
        return self._kernel_rope[1]
