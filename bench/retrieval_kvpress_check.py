"""Cross-check the presses of model_adapters.retrieval against kvpress on a tiny random Qwen3.

kvpress 0.5.5 needs transformers < 5.3, so this runs in an environment of its own (kvpress,
transformers 5.2, torch), with this checkout on PYTHONPATH:

    python bench/retrieval_kvpress_check.py [--json bench/results/retrieval-kvpress-check.json]

For each press and ratio, both prune the cache of one prefill of random tokens; the table gives
the fraction of kept (layer, head, position) triples they share and whether the kept keys are
identical. Only torch-level code of the project is used (presses.py imports nothing else).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import transformers
from transformers import DynamicCache, Qwen3Config, Qwen3ForCausalLM

from model_adapters.retrieval.presses import Press, pressing


def kept_positions(cache, keys_full):
    """Per layer and head, the positions of the full keys each pruned key came from."""
    out = []
    for layer, full in zip(cache.layers, keys_full, strict=True):
        k = layer.keys[0]  # (heads, kept, d)
        match = (k[:, :, None, :] == full[0][:, None, :, :]).all(-1)  # (heads, kept, n)
        out.append([set(match[h].nonzero()[:, 1].tolist()) for h in range(k.shape[0])])
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--json", default=None)
    p.add_argument("--tokens", type=int, default=300)
    args = p.parse_args()
    try:
        import kvpress
    except ImportError:
        raise SystemExit("bench/retrieval_kvpress_check.py needs kvpress") from None
    torch.manual_seed(0)
    cfg = Qwen3Config(num_hidden_layers=3, hidden_size=64, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, intermediate_size=128,
                      vocab_size=1000, max_position_embeddings=1024)
    model = Qwen3ForCausalLM(cfg).eval()
    ids = torch.randint(0, 1000, (1, args.tokens))
    with torch.no_grad():
        full = DynamicCache()
        model(input_ids=ids, past_key_values=full)
        full_keys = [layer.keys for layer in full.layers]
        ours_by = {
            "streamingllm": lambda r: kvpress.StreamingLLMPress(compression_ratio=r, n_sink=4),
            "knorm": lambda r: kvpress.KnormPress(compression_ratio=r),
            "snapkv": lambda r: kvpress.SnapKVPress(compression_ratio=r, window_size=64,
                                                    kernel_size=5),
            "pyramidkv": lambda r: kvpress.PyramidKVPress(compression_ratio=r, window_size=64,
                                                          kernel_size=5),
        }
        rows = []
        for kind, make in ours_by.items():
            for ratio in (0.5, 0.75, 0.92):
                theirs = DynamicCache()
                with make(ratio)(model):
                    model(input_ids=ids, past_key_values=theirs)
                ours = DynamicCache()
                with pressing(model, Press(kind, ratio), ours):
                    model(input_ids=ids, past_key_values=ours)
                a, b = kept_positions(ours, full_keys), kept_positions(theirs, full_keys)
                shared = sum(len(x & y) for la, lb in zip(a, b, strict=True)
                             for x, y in zip(la, lb, strict=True))
                total = sum(len(y) for lb in b for y in lb)
                same = all(torch.equal(x.keys, y.keys) or torch.equal(
                    x.keys.sort(-2).values, y.keys.sort(-2).values)
                    for x, y in zip(ours.layers, theirs.layers, strict=True))
                rows.append({"press": kind, "ratio": ratio, "kept_kvpress": total,
                             "kept_ours": sum(len(x) for la in a for x in la),
                             "shared_fraction": shared / total, "identical_keys": same})
    print(f"kvpress {kvpress.__version__ if hasattr(kvpress, '__version__') else '0.5.x'}, "
          f"transformers {transformers.__version__}, {args.tokens} tokens, 3 layers x 2 KV heads")
    print("| press | ratio | kept (kvpress) | kept (ours) | shared | identical |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['press']} | {r['ratio']} | {r['kept_kvpress']} | {r['kept_ours']} | "
              f"{100 * r['shared_fraction']:.1f}% | {r['identical_keys']} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"transformers": transformers.__version__,
                                               "tokens": args.tokens, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
