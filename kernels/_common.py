"""Triton pieces both kernel variants use: program-to-heads mapping, 64-bit bases, the online
softmax over the exact sink and recent tokens, and launch helpers."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

LOG2E = 1.4426950408889634
NEG_BIG = tl.constexpr(-1.0e30)  # finite "minus infinity": exp2(NEG_BIG - NEG_BIG) stays 1


@triton.jit
def program_heads(pid_bhg, KV_HEADS, GROUP, GROUP_CHUNKS, BLOCK_G: tl.constexpr,
                   BLOCK_M: tl.constexpr):
    """What a program over (batch, kv head, chunk of the group) serves: ``(b, kvh, chunk, g,
    g_ok, heads)``, with ``g`` the chunk's query heads within the group in ``BLOCK_M >=
    BLOCK_G`` rows (rows past ``BLOCK_G`` or past the group masked) and ``heads`` their
    query-head indices."""
    chunk = pid_bhg % GROUP_CHUNKS
    kvh = (pid_bhg // GROUP_CHUNKS) % KV_HEADS
    b = pid_bhg // (GROUP_CHUNKS * KV_HEADS)
    row = tl.arange(0, BLOCK_M)
    g = chunk * BLOCK_G + row
    g_ok = (row < BLOCK_G) & (g < GROUP)
    return b, kvh, chunk, g, g_ok, kvh * GROUP + g


@triton.jit
def head_base(ptr, b, kvh, sb, sh):
    """``ptr`` advanced to sequence ``b``, kv head ``kvh``, in 64-bit arithmetic (a code tensor
    can pass 2^31 elements: 4 key stages at 128K positions, batch 512, Qwen3-8B shapes)."""
    return ptr + b.to(tl.int64) * sb + kvh.to(tl.int64) * sh


@triton.jit
def exact_tokens(q_ptr, sk_ptr, sv_ptr, rk_ptr, rv_ptr, slen_ptr, rlen_ptr, b, kvh, heads,
                  ok, d, d_ok, qk_scale, q_sb, q_sh, sk_sb, sk_sh, sk_sn, sv_sb, sv_sh, sv_sn,
                  rk_sb, rk_sh, rk_sn, rv_sb, rv_sh, rv_sn, BLOCK_M: tl.constexpr,
                  BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr):
    """Online softmax of query heads ``heads`` (rows where ``ok``) of sequence ``b`` over the
    exact sink and recent tokens of kv head ``kvh``: ``(m, l, acc)`` as in
    :func:`exact_segment`, ``BLOCK_M`` rows."""
    q = tl.load(q_ptr + b * q_sb + heads[:, None] * q_sh + d[None, :],
                mask=ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    m = tl.full([BLOCK_M], NEG_BIG, tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    m, l, acc = exact_segment(q, sk_ptr + b * sk_sb + kvh * sk_sh,
                               sv_ptr + b * sv_sb + kvh * sv_sh, tl.load(slen_ptr + b),
                               m, l, acc, sk_sn, sv_sn, d, d_ok, qk_scale, BLOCK_E)
    return exact_segment(q, rk_ptr + b * rk_sb + kvh * rk_sh,
                          rv_ptr + b * rv_sb + kvh * rv_sh, tl.load(rlen_ptr + b),
                          m, l, acc, rk_sn, rv_sn, d, d_ok, qk_scale, BLOCK_E)


@triton.jit
def exact_segment(q, k_base, v_base, n_tokens, m, l, acc, k_sn, v_sn, d, d_ok, qk_scale,
                   BLOCK_E: tl.constexpr):
    """Online softmax of ``q`` (float32, rows of heads) over ``n_tokens`` exact keys and values,
    merged into ``(m, l, acc)``; scores are ``q . k * qk_scale`` (log2 units). ``q`` holds
    float16 / bfloat16 values, exact in tf32, as are the keys and values; the weights are
    rounded to tf32 (relative 2^-11) for the product with the values."""
    for n0 in range(0, n_tokens, BLOCK_E):
        n = n0 + tl.arange(0, BLOCK_E)
        n_ok = n < n_tokens
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + n[:, None] * k_sn + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + n[:, None] * v_sn + d[None, :], mask=kv_mask, other=0.0)
        score = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="tf32") * qk_scale
        score = tl.where(n_ok[None, :], score, float("-inf"))
        m_new = tl.maximum(m, tl.max(score, axis=1))
        alpha = tl.math.exp2(m - m_new)
        p = tl.math.exp2(score - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="tf32")
        m = m_new
    return m, l, acc


def interpreted() -> bool:
    """Whether Triton's CPU interpreter runs these kernels (``TRITON_INTERPRET`` at import)."""
    return isinstance(program_heads, InterpretedFunction)


def patch_interpreter_index() -> None:
    """Make the interpreter's ``tensor.__index__`` accept a one-element array of any shape.

    Triton 3.6's interpreter holds every scalar as a 1-d array of one element and converts a
    loop bound (``range(start, end)`` with tensor bounds) by ``int(array)``, which NumPy 2
    refuses ("only 0-dimensional arrays can be converted to Python scalars"); later Triton
    squeezes the array first. This wraps the interpreter's per-launch patch to do the same.
    Idempotent; a no-op on interpreters without that hook."""
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "index_fixed", False):
        return

    def index(self):
        return int(self.handle.data.reshape(-1)[0])

    def patched(tensor, *scope):  # Triton 3.6 passes a patch scope, 3.5 none
        original(tensor, *scope)
        if scope:
            scope[0].set_attr(tensor, "__index__", index)
        else:
            tensor.__index__ = index

    patched.index_fixed = True
    interpreter._patch_lang_tensor = patched


if interpreted():
    patch_interpreter_index()


def launchable(exact: torch.Tensor) -> torch.Tensor:
    """An exact K/V segment with unit stride over head_dim and at least one (unread) slot."""
    if exact.shape[2] == 0:
        return exact.new_zeros(exact.shape[0], exact.shape[1], 1, exact.shape[3])
    return exact if exact.stride(3) == 1 else exact.contiguous()
