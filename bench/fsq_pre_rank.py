"""FSQ-pre against post-projection FSQ at equal code width: what a linear bottleneck of width
``w`` keeps of a trained model's keys and values when it codes them before or after RoPE.

The FSQ decode kernel is compute-bound at 32x because each cached key is reconstructed
(decoder, k_norm, RoPE) at every step. FSQ-pre (the seed's Figure 18) would code the keys
*after* k_norm and RoPE, so the query could be projected into code space once per step and the
kernel would only read codes. The price is that the codes must carry the rotation: a key
direction that is fixed in the unrotated space sweeps a plane per RoPE frequency across
positions. This script measures that price on real activations, before any kernel is built:

- per layer, the attention inputs of ``--fit`` sequences of training books (position ``t`` of
  a sequence is RoPE position ``t``) give a rank-``w`` principal subspace (the best linear
  encoder/decoder pair of that width, mean-centred, K and V each scaled to unit RMS as
  ``convert_to_fsq`` does) of either
  ``post``: ``[K_raw, V]`` (keys before k_norm and RoPE; the decoded keys are then normed and
  rotated, as the model attends them), or ``pre``: ``[RoPE(k_norm(K_raw)), V]``;
- on ``--eval`` held-out sequences: the relative error of the attended keys and of the values,
  and of each layer's attention output (causal softmax attention of the model's own queries
  over the reconstructed keys and values, against the exact ones).

No FSQ rounding: this is the rank limit alone (rounding adds to both the same way). Float32 on
the CPU. Prints a table, writes ``bench/results/fsq-pre-rank.json`` (``--out``).

    python bench/fsq_pre_rank.py --model ../shared/models/standin-qwen3-8k \\
        --books ../shared/data --widths 16 32 64 128 --seq 2048
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb  # noqa: E402

from bench._common import (  # noqa: E402
    add_out_option,
    machine,
    markdown_table,
    out_name,
    write_json,
)
from model_adapters.experiments.needles import load_tokens  # noqa: E402


@torch.no_grad()
def layer_inputs(model, ids: torch.Tensor) -> list[torch.Tensor]:
    """Per layer ``(sequences, seq, hidden)``: each attention layer's input on ``ids``."""
    layers = [layer.self_attn for layer in model.model.layers]
    found: list[list[torch.Tensor]] = [[] for _ in layers]

    def hook(i):
        def grab(module, args, kwargs):
            found[i].append(kwargs.get("hidden_states", args[0] if args else None).float())
        return grab

    handles = [m.register_forward_pre_hook(hook(i), with_kwargs=True)
               for i, m in enumerate(layers)]
    try:
        for row in ids:
            model(row[None], use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return [torch.cat(rows) for rows in found]


def project(attn, x: torch.Tensor, cos_sin) -> dict:
    """The layer's raw keys, attended keys (k_norm, RoPE), values and attended queries,
    ``(sequences, heads, seq, head_dim)``."""
    b, n, _ = x.shape
    d = attn.head_dim
    k_raw = attn.k_proj(x).view(b, n, -1, d).transpose(1, 2)
    v = attn.v_proj(x).view(b, n, -1, d).transpose(1, 2)
    q = attn.q_norm(attn.q_proj(x).view(b, n, -1, d)).transpose(1, 2)
    cos, sin = cos_sin
    q, _ = apply_rotary_pos_emb(q, q, cos, sin)
    return {"k_raw": k_raw, "k": rotate(attn, k_raw, cos_sin), "v": v, "q": q}


def rotate(attn, k_raw: torch.Tensor, cos_sin) -> torch.Tensor:
    """What the model attends: k_norm, then RoPE."""
    k = attn.k_norm(k_raw.transpose(1, 2)).transpose(1, 2)
    _, k = apply_rotary_pos_emb(k, k, *cos_sin)
    return k


def rows(t: torch.Tensor) -> torch.Tensor:
    """``(sequences, heads, seq, d)`` as ``(sequences * seq, heads * d)``."""
    b, h, n, d = t.shape
    return t.permute(0, 2, 1, 3).reshape(b * n, h * d)


def unrows(r: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    b, h, n, d = like.shape
    return r.reshape(b, n, h, d).permute(0, 2, 1, 3)


class Subspace:
    """The rank-``w`` principal subspace of ``[s_k K, s_v V]`` rows (mean-centred)."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, width: int):
        self.sk, self.sv = k.pow(2).mean().rsqrt(), v.pow(2).mean().rsqrt()
        y = torch.cat([k * self.sk, v * self.sv], 1).double()
        self.mu = y.mean(0)
        _, vecs = torch.linalg.eigh((y - self.mu).T @ (y - self.mu) / y.shape[0])
        self.u = vecs[:, -width:]
        self.dk = k.shape[1]

    def __call__(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.cat([k * self.sk, v * self.sv], 1).double() - self.mu
        y = (y @ self.u) @ self.u.T + self.mu
        return (y[:, :self.dk] / self.sk).float(), (y[:, self.dk:] / self.sv).float()


def attention(q, k, v, group: int) -> torch.Tensor:
    """Causal softmax attention, ``(sequences, q_heads, seq, d)``."""
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).pow(2).sum() / b.pow(2).sum())


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a Qwen3 model directory")
    parser.add_argument("--books", required=True,
                        help="directory with books-gpt2-train.u16.xz and books-gpt2-val.u16.xz")
    parser.add_argument("--widths", type=int, nargs="+", default=[16, 32, 64, 128])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--fit", type=int, default=4, help="training sequences (the subspace)")
    parser.add_argument("--eval", type=int, default=2, help="held-out sequences (the errors)")
    add_out_option(parser, "fsq-pre-rank")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    if model.config.model_type != "qwen3":
        raise SystemExit(f"FSQ-pre is about RoPE'd keys: needs a Qwen3 model, got "
                         f"{model.config.model_type!r}")
    books = Path(args.books)
    ids = {}
    for split, count in (("train", args.fit), ("val", args.eval)):
        tokens = load_tokens(books / f"books-gpt2-{split}.u16.xz")
        starts = torch.linspace(0, len(tokens) - args.seq - 1, count).long()
        ids[split] = torch.stack([tokens[s:s + args.seq] for s in starts])
    inputs = {split: layer_inputs(model, t) for split, t in ids.items()}
    positions = torch.arange(args.seq)[None]
    cos_sin = model.model.rotary_emb(inputs["val"][0], positions)
    group = model.config.num_attention_heads // model.config.num_key_value_heads
    kv_bytes = 2 * model.config.num_key_value_heads * model.config.head_dim * 2
    results = []
    with torch.no_grad():
        for li, attn in enumerate(layer.self_attn for layer in model.model.layers):
            fit = project(attn, inputs["train"][li], cos_sin)
            held = project(attn, inputs["val"][li], cos_sin)
            exact = attention(held["q"], held["k"], held["v"], group)
            for width in args.widths:
                for form, key in (("post", "k_raw"), ("pre", "k")):
                    space = Subspace(rows(fit[key]), rows(fit["v"]), width)
                    k_hat, v_hat = space(rows(held[key]), rows(held["v"]))
                    k_hat, v_hat = unrows(k_hat, held[key]), unrows(v_hat, held["v"])
                    if form == "post":
                        k_hat = rotate(attn, k_hat, cos_sin)
                    out = attention(held["q"], k_hat, v_hat, group)
                    results.append({
                        "layer": li, "width": width, "form": form,
                        "compression": kv_bytes / (width * 0.5),  # 16 levels: 4 bits each
                        "key_error": relative(k_hat, held["k"]),
                        "value_error": relative(v_hat, held["v"]),
                        "attention_error": relative(out, exact)})
            print(f"layer {li} done ({time.perf_counter() - start:.0f} s)", flush=True)
    summary = []
    for width in args.widths:
        for form in ("post", "pre"):
            mine = [r for r in results if r["width"] == width and r["form"] == form]
            summary.append({"width": width, "form": form,
                            "compression": mine[0]["compression"],
                            **{m: sum(r[m] for r in mine) / len(mine)
                               for m in ("key_error", "value_error", "attention_error")},
                            "attention_error_max": max(r["attention_error"] for r in mine)})
    columns = [("width", "w"), ("compression", "x (4-bit codes)"), ("form", "form"),
               ("key_error", "key rel. error (mean over layers)"),
               ("value_error", "value rel. error"),
               ("attention_error", "attention-output rel. error"),
               ("attention_error_max", "worst layer")]
    print(markdown_table(summary, columns))
    path = write_json(out_name(args, "fsq-pre-rank"), {
        "machine": machine(), "torch": torch.__version__, "model": Path(args.model).name,
        "args": vars(args), "summary": summary, "layers": results,
        "seconds": time.perf_counter() - start})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
