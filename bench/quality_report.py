#!/usr/bin/env python3
"""docs/QUALITY.md's table and plot from `dmattn eval --csv` files and a speed file.

Usage: python3 bench/quality_report.py OUT.png SPEED.txt EVAL.csv ...
Merges the CSVs (a config in several keeps its last row; every file has the same exact baseline) and
prints one markdown table sorted by perplexity change: perplexity, change against exact attention,
mean per-layer attention error, and the H200 prefill time. SPEED.txt holds lines "config ms source"
(B=1 Hq=32 Hkv=8 d=128 N=16384, from bench/RESULTS.md; source names the policy timed, which may be
another config with the same work, e.g. the scale rule changes no instruction). The plot is the
perplexity change against that time for the configs that have one. Needs python/requirements-bench.txt.
"""
import csv
import sys


def main(png, speed_path, *evals):
    rows = {}
    for path in evals:
        for r in csv.DictReader(open(path)):
            layers = [float(v) for k, v in r.items() if k.startswith("layer")]
            rows[r["config"]] = (float(r["ppl"]), 100 * float(r["ppl_vs_exact"]), sum(layers) / len(layers))
    speed = {}
    for line in open(speed_path):
        if line.strip() and not line.startswith("#"):
            name, ms, *src = line.split()
            speed[name] = (float(ms), " ".join(src))
    print("| config | perplexity | vs exact | mean layer error | H200 prefill ms (16k) |")
    print("|---|---|---|---|---|")
    for name, (ppl, d, e) in sorted(rows.items(), key=lambda kv: kv[1][1]):
        ms = f"{speed[name][0]:.3f}" + (f" ({speed[name][1]})" if speed[name][1] else "") if name in speed else "—"
        print(f"| {name} | {ppl:.3f} | {d:+.2f}% | {e:.4f} | {ms} |")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(9, 5.5))
    pts = [(speed[n][0], rows[n][1], n) for n in rows if n in speed and n != "exact"]
    ax.scatter([p[0] for p in pts], [p[1] for p in pts])
    for x, y, n in pts:
        ax.annotate(n, (x, y), fontsize=7, xytext=(4, 2), textcoords="offset points")
    ax.set_yscale("log")
    ax.set_xlabel("H200 prefill, ms (B=1, N=16384, Hq 32, Hkv 8, d 128, causal; C++ API)")
    ax.set_ylabel("SmolLM2-135M perplexity vs exact attention (%)")
    ax.grid(True, which="both", lw=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=120)


if __name__ == "__main__":
    main(*sys.argv[1:])
