"""Rate–distortion figure: perplexity cost against code bytes per token (the paper's Figure 2)."""

from __future__ import annotations

__all__ = ["rate_distortion"]

_COLOURS = {"pooled": "tab:red", "perhead": "tab:blue", "hybrid": "tab:green", "fsq": "tab:purple"}


def _rate(row):
    """Measured code bytes/token, or the bit-packing size when no archive was written."""
    if row.get("code_bytes_per_token"):
        return row["code_bytes_per_token"], False
    return row.get("packed_code_bytes_per_token"), True


def rate_distortion(results: list[dict], path) -> None:
    """Plot ΔPPL (%) vs code bytes/token for each run in ``results`` (one panel per model).

    Keys-only / values-only ablations are left out: they store half the codes by design and
    are reported in the table instead.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 4.2), squeeze=False)
    for ax, res in zip(axes[0], results, strict=True):
        estimated = False
        for row in res["configs"]:
            fsq = row.get("family") == "fsq"
            if not fsq and (row["key_stages"] == 0 or row["value_stages"] == 0):
                continue
            rate, est = _rate(row)
            estimated |= est
            kind = "fsq" if fsq else (
                "hybrid"
                if row["key_stages"] != row["value_stages"]
                else ("pooled" if row["pooled"] else "perhead")
            )
            ax.scatter(rate, row["delta_ppl_pct"], color=_COLOURS[kind], s=40, zorder=3)
            ax.annotate(
                row["config"],
                (rate, row["delta_ppl_pct"]),
                fontsize=7,
                xytext=(4, 4),
                textcoords="offset points",
            )
        for kind, colour in _COLOURS.items():
            ax.scatter([], [], color=colour, label=kind)
        xlabel = "code bytes / token" + (" (bit-packed size)" if estimated else "")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("ΔPPL vs exact cache (%)")
        ax.set_title(
            f"{res['model']} ({res['model_type']}), {res['tokens']} tokens, "
            f"{res['sinks']}+{res['recent']} exact",
            fontsize=9,
        )
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    """``python -m model_adapters.experiments.plot RESULT.json [...] --out FIG.png``: one panel
    per run."""
    import argparse
    import json
    from pathlib import Path

    p = argparse.ArgumentParser(
        prog="python -m model_adapters.experiments.plot", description=main.__doc__
    )
    p.add_argument("results", nargs="+", help="JSON files written by model_adapters.eval --json")
    p.add_argument("--out", required=True, help="figure path (.png, .svg, .pdf)")
    args = p.parse_args(argv)
    rate_distortion([json.loads(Path(r).read_text()) for r in args.results], args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
