#!/usr/bin/env python3
"""Plots `dmattn eval --csv` output: perplexity change vs diag_tiles (sinks 0/1, with the
all-MXFP8 and all-MXFP4 levels), and per-layer attention error of the main configs.
Usage: python3 bench/plot_eval.py eval.csv out.png   (needs python/requirements-bench.txt)"""
import csv, sys
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt

rows = list(csv.DictReader(open(sys.argv[1])))
by = {r["config"]: r for r in rows}
layers = sorted((k for k in rows[0] if k.startswith("layer")), key=lambda k: int(k[5:].split("_")[0]))
fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
for sinks, style in ((0, "o-"), (1, "s--")):
    xs, ys = [], []
    for d in (1, 2, 4):
        r = by.get(f"DMA diag={d} sinks={sinks}")
        if r:
            xs.append(d); ys.append(100 * float(r["ppl_vs_exact"]))
    a.plot(xs, ys, style, label=f"DMA, sinks={sinks}")
for name, color in (("all-MXFP8 E4M3", "green"), ("all-MXFP4", "red")):
    if name in by:
        a.axhline(100 * float(by[name]["ppl_vs_exact"]), color=color, ls=":", label=name)
a.set_xlabel("diag_tiles"); a.set_ylabel("perplexity vs exact (%)"); a.set_xticks([1, 2, 4]); a.legend(); a.grid(alpha=.3)
a.set_title("Perplexity change")
for name in ("all-MXFP8 E4M3", "all-MXFP4", "DMA diag=1 sinks=0", "DMA diag=1 sinks=1", "DMA diag=4 sinks=1"):
    if name in by:
        b.semilogy(range(len(layers)), [float(by[name][k]) for k in layers], label=name)
b.set_xlabel("layer"); b.set_ylabel("attention output rel. L2 vs fp64"); b.legend(fontsize=8); b.grid(alpha=.3)
b.set_title("Per-layer attention error (first window)")
fig.tight_layout(); fig.savefig(sys.argv[2], dpi=110)
print(sys.argv[2])
