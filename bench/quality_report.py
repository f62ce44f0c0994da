#!/usr/bin/env python3
"""docs/QUALITY.md's tables (and its plot) from `dmattn eval --csv` files.

Usage: python3 bench/quality_report.py OUT.png EVAL.csv[:title] ... [--speed SPEED.txt]
Prints one markdown table per eval file: perplexity, its change against exact attention, and the
mean per-layer attention error, rows in the file's order. SPEED.txt (optional) holds lines
"config ms" (the H200 prefill time of the config's policy, B=1 Hq=32 Hkv=8 d=128 N=16384, from the
same run); with it the plot is perplexity change against that time, else against the layer error.
Needs matplotlib (pinned in python/requirements-bench.txt).
"""
import csv
import sys


def rows_of(path):
    out = []
    for r in csv.DictReader(open(path)):
        layers = [float(v) for k, v in r.items() if k.startswith("layer")]
        out.append((r["config"], float(r["ppl"]), 100 * float(r["ppl_vs_exact"]), sum(layers) / len(layers)))
    return out


def main(argv):
    png, rest = argv[0], argv[1:]
    speed = {}
    if "--speed" in rest:
        i = rest.index("--speed")
        for line in open(rest[i + 1]):
            name, ms = line.split()
            speed[name] = float(ms)
        rest = rest[:i] + rest[i + 2:]
    tables = []
    for spec in rest:
        path, _, title = spec.partition(":")
        rows = rows_of(path)
        tables.append((title or path, rows))
        print(f"### {title or path}\n")
        print("| config | perplexity | vs exact | mean layer error |" + (" H200 ms |" if speed else ""))
        print("|---|---|---|---|" + ("---|" if speed else ""))
        for name, ppl, dppl, err in rows:
            ms = f" {speed[name]:.3f} |" if name in speed else (" — |" if speed else "")
            print(f"| {name} | {ppl:.3f} | {dppl:+.2f}% | {err:.4f} |{ms}")
        print()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 5))
    for title, rows in tables:
        pts = [(speed[n] if speed else e, d, n) for n, _, d, e in rows if n != "exact" and (not speed or n in speed)]
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], label=title)
        for x, y, n in pts:
            ax.annotate(n, (x, y), fontsize=6, xytext=(3, 2), textcoords="offset points")
    ax.set_yscale("symlog", linthresh=1)
    ax.axhline(1, color="gray", lw=0.5, ls="--")
    ax.set_xlabel("H200 prefill ms (N=16384, Hq 32, Hkv 8, d 128)" if speed else "mean per-layer attention error (rel. L2)")
    ax.set_ylabel("perplexity vs exact attention (%)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=120)


if __name__ == "__main__":
    main(sys.argv[1:])
