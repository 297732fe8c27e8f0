"""`tandem bench compare`'s outputs: the table of medians with ratios (and per-turn rows of
multi-turn points), results.json, and PNG plots (redrawn by ``--replot``)."""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

SERVERS = ("tandem", "mlx_lm")
METRICS = (
    ("output_throughput", "output tok/s"),
    ("ttft_ms", "TTFT median (ms)"),
    ("tpot_ms", "TPOT median (ms)"),
)


def _present(results: dict[str, dict[str, Any]]) -> list[str]:
    return [s for s in SERVERS if s in results] + [s for s in results if s not in SERVERS]


def _keys(results: dict[str, dict[str, Any]]) -> list[str]:
    """Points every server has (in sweep order)."""
    servers = _present(results)
    if not servers:
        return []
    return [k for k in results[servers[0]] if all(k in results[s] for s in servers)]


def ratios(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Tandem / mlx_lm output throughput per point: of the medians, and the median of the
    per-repeat ratios (each repeat's pair ran back to back)."""
    if not all(s in results for s in SERVERS):
        return {}
    out = {}
    for key in _keys(results):
        a, b = results["tandem"][key], results["mlx_lm"][key]
        pairs = {
            r["repeat"]: r["output_throughput"] / m["output_throughput"]
            for r in a.get("runs", [])
            for m in b.get("runs", [])
            if r["repeat"] == m["repeat"] and m["output_throughput"]
        }
        out[key] = {
            "of_medians": a["output_throughput"] / b["output_throughput"]
            if b["output_throughput"]
            else math.nan,
            "median_paired": statistics.median(pairs.values()) if pairs else math.nan,
        }
    return out


def _table(results: dict[str, dict[str, Any]]) -> str:
    servers = _present(results)
    if servers == list(SERVERS):
        t, m = results["tandem"], results["mlx_lm"]
        rows = [
            "| dataset / concurrency | out tok/s Tandem | mlx-lm | ratio | TTFT ms Tandem | "
            "mlx-lm | TPOT ms Tandem | mlx-lm |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for key in _keys(results):
            a, b = t[key], m[key]
            ratio = a["output_throughput"] / b["output_throughput"] if b["output_throughput"] else 0
            rows.append(
                f"| {key} | {a['output_throughput']:.1f} | {b['output_throughput']:.1f} | "
                f"**{ratio:.2f}** | {a['ttft_ms']:.1f} | {b['ttft_ms']:.1f} | "
                f"{a['tpot_ms']:.2f} | {b['tpot_ms']:.2f} |"
            )
        return "\n".join(rows) + "\n"
    rows = ["| dataset / concurrency | server | out tok/s | TTFT ms | TPOT ms |"]
    rows.append("|---|---|---:|---:|---:|")
    for key in _keys(results):
        for s in servers:
            a = results[s][key]
            rows.append(
                f"| {key} | {s} | {a['output_throughput']:.1f} | {a['ttft_ms']:.1f} | "
                f"{a['tpot_ms']:.2f} |"
            )
    return "\n".join(rows) + "\n"


def markdown(results: dict[str, dict[str, Any]]) -> str:
    """The table of medians, then a line per point whose runs lost requests or got outputs of
    the wrong length (summed over its repeats), since a median hides them."""
    notes = [
        f"- {s} {key}: {p['failed']} failed, {p['short_outputs']} of the wrong length"
        for s in _present(results)
        for key, p in results[s].items()
        if p.get("failed") or p.get("short_outputs")
    ]
    text = _table(results) + _turn_table(results)
    if not notes:
        return text
    return text + "\nRequests lost or cut short (all repeats):\n" + "\n".join(notes) + "\n"


def _turn_table(results: dict[str, dict[str, Any]]) -> str:
    """Multi-turn points, by turn: each server's median TTFT and reported cached share."""
    servers = _present(results)
    rows = []
    for key in _keys(results):
        per = {s: results[s][key].get("per_turn") or [] for s in servers}
        for i in range(max((len(p) for p in per.values()), default=0)):
            cells = []
            for s in servers:
                t = per[s][i] if i < len(per[s]) else None
                share = t and t["cached_share"]
                cells.append(f"{t['ttft_ms']:.1f}" if t else "-")
                cells.append(f"{100 * share:.0f}%" if share is not None and t else "-")
            prompt = next((per[s][i]["prompt_tokens"] for s in servers if i < len(per[s])), 0)
            rows.append(f"| {key} | {i + 1} | {prompt:.0f} | " + " | ".join(cells) + " |")
    if not rows:
        return ""
    head = " | ".join(f"TTFT ms {s} | cached {s}" for s in servers)
    sep = "|---:" * (2 * len(servers))
    return (
        f"\n| multi-turn point | turn | prompt tokens | {head} |\n|---|---:|---:{sep}|\n"
        + "\n".join(rows)
        + "\n"
    )


def plot(results: dict[str, dict[str, Any]], out: Path) -> list[Path]:
    """One PNG per metric; none (with a warning) when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        print(
            "compare: matplotlib is not installed, no PNGs; redraw them later with "
            f"`tandem bench compare --replot {out}`",
            file=sys.stderr,
        )
        return []
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    keys = _keys(results)
    datasets = sorted({k.split("/")[0] for k in keys})
    if not datasets:
        return []
    for metric, label in METRICS:
        fig, axes = plt.subplots(1, len(datasets), figsize=(5 * len(datasets), 3.6), squeeze=False)
        for ax, ds in zip(axes[0], datasets, strict=True):
            for server in _present(results):
                pts = [
                    (int(k.split("/c")[1]), results[server][k][metric])
                    for k in keys
                    if k.startswith(ds + "/")
                ]
                ax.plot(*zip(*pts, strict=True), marker="o", label=server)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrency")
            ax.set_ylabel(label)
            ax.set_title(ds)
            ax.legend()
        fig.tight_layout()
        path = out / f"{metric}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        files.append(path)
    return files


def write_results(out: Path, doc: dict[str, Any]) -> None:
    doc["ratios"] = ratios(doc["results"])
    tmp = out / "results.json.tmp"
    tmp.write_text(json.dumps(doc, indent=2, default=str))
    tmp.replace(out / "results.json")
    (out / "table.md").write_text(markdown(doc["results"]))


def replot(folder: Path) -> int:
    """Rewrite table.md and the PNGs of a finished (or partial) run from its results.json."""
    doc = json.loads((folder / "results.json").read_text())
    table = markdown(doc["results"])
    (folder / "table.md").write_text(table)
    plot(doc["results"], folder)
    print(table)
    return 0
