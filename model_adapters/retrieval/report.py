"""Tables and the accuracy-against-compression figure of a retrieval run's result dict."""

from __future__ import annotations

__all__ = ["format_tables", "plot"]


def _pct(x) -> str:
    return "–" if x is None else f"{100 * x:.0f}"


def format_tables(result: dict) -> str:
    """Markdown: the reproduction, then one table per task (accuracy % [95% interval] per
    length, achieved compression at the longest length), then needle depth at the longest."""
    lengths = [str(n) for n in result["lengths"]]
    longest = lengths[-1]
    out = []
    if result.get("reproduction"):
        out += ["| length | teacher-forced | model card | greedy, exact cache |",
                "|---|---|---|---|"]
        for n, r in result["reproduction"].items():
            out.append(f"| {n} | {r['teacher_forced']:.2f} | {r['model_card']:.2f} | "
                       f"{r['greedy_exact']:.2f} |")
        out.append("")
    for task in result["tasks"]:
        head = "| method | B/token/layer | compression | " + " | ".join(lengths) + " |"
        out += [f"**{task}** (accuracy %, 95% bootstrap interval; bytes at {longest})", "",
                head, "|---" * (3 + len(lengths)) + "|"]
        for m in result["methods"]:
            if "error" in m:
                out.append(f"| {m['method']} | failed: {m['error'][:80]} |")
                continue
            cells = []
            for n in lengths:
                r = m["tasks"][task][n]
                lo, hi = r["ci"]
                cells.append(f"{_pct(r['accuracy'])} [{_pct(lo)}–{_pct(hi)}]")
            bpl = m["bytes_per_token_layer"].get(longest)
            comp = m["compression"].get(longest)
            out.append(f"| {m['method']} | {'–' if bpl is None else f'{bpl:.1f}'} | "
                       f"{'–' if comp is None else f'{comp:.1f}×'} | " + " | ".join(cells) + " |")
        out.append("")
    if "depth" in result["tasks"]:
        depths = None
        rows = []
        for m in [m for m in result["methods"] if "error" not in m]:
            by = m["tasks"]["depth"][longest].get("by_depth") or {}
            depths = depths or list(by)
            rows.append(f"| {m['method']} | " + " | ".join(_pct(by[d]) for d in depths) + " |")
        if depths:
            out += [f"**needle depth at {longest}** (accuracy %)", "",
                    "| method | " + " | ".join(depths) + " |", "|---" * (1 + len(depths)) + "|",
                    *rows]
    return "\n".join(out)


def plot(results: list[dict], path, task: str = "single") -> None:
    """Accuracy at the longest length against achieved compression there, one line per
    method family (log x axis), for ``task`` and (when a run has several tasks) for the mean
    over its tasks. Several runs at the same longest length share the lines; a method measured
    in several runs is drawn from the run with the most items."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    best: dict[str, tuple] = {}
    longest = str(results[0]["lengths"][-1])
    for res in results:
        if str(res["lengths"][-1]) != longest:
            raise ValueError(f"runs end at different lengths: {longest} and {res['lengths'][-1]}")
        for m in res["methods"]:
            comp = m["compression"].get(longest) if "error" not in m else None
            if comp is None or task not in m["tasks"]:
                continue
            r = m["tasks"][task][longest]
            accs = [m["tasks"][t][longest]["accuracy"] for t in res["tasks"]]
            mean = sum(a for a in accs if a is not None) / len(accs)
            if m["method"] not in best or r["items"] > best[m["method"]][4]:
                best[m["method"]] = (m["family"], comp, r["accuracy"], mean, r["items"])
    families: dict[str, list] = {}
    for fam, comp, single, mean, _ in best.values():
        families.setdefault(fam, []).append((comp, single, mean))
    several = any(len(res["tasks"]) > 1 for res in results)
    fig, axes = plt.subplots(1, 2 if several else 1, figsize=(12 if several else 7, 4.8),
                             sharey=True, squeeze=False)
    axes = axes[0]
    for fam, pts in sorted(families.items()):
        pts.sort()
        style = "-o" if fam.startswith("rvq") or fam == "exact" else "--s"
        for k, ax in enumerate(axes, start=1):
            ax.plot([p[0] for p in pts], [p[k] for p in pts], style, label=fam)
    titles = (f"{task} needle", "mean over tasks")
    for ax, title in zip(axes, titles, strict=False):
        ax.set_xscale("log")
        ax.set_ylim(-0.05, 1.05)
        ax.axvline(12, color="grey", lw=0.8, ls=":")
        ax.set_xlabel("achieved compression vs fp16 (all bytes held, log)")
        ax.set_title(f"{title}, {longest} tokens")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("accuracy")
    axes[-1].legend(fontsize=8, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
