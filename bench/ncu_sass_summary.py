#!/usr/bin/env python3
"""Summarises an ncu per-SASS source CSV (bench/device.sh SOURCE=1 writes src_prefill.csv and
src_decode_mxfp4.csv: `ncu -i REP --page source --csv --print-source sass`): the kernel's stall reasons,
its hot loop's instruction classes (the instructions executed at least `--min-share` of the most
executed one's count), and the instructions with the most stall samples.

Usage: python3 bench/ncu_sass_summary.py CSV [--min-share 0.75] [--top 25]
"""
import argparse
import collections
import csv
import re


def load(path):
    rows = list(csv.reader(open(path, newline="")))
    header_at = next(i for i, r in enumerate(rows) if "Source" in r and "# Samples" in r)
    header = rows[header_at]
    col = {h: i for i, h in enumerate(header)}
    stalls = [h for h in header if h.startswith("stall_") and "(Not" not in h]
    out = []
    for r in rows[header_at + 1:]:
        if len(r) < len(header):
            continue
        num = lambda h: int(float(r[col[h]] or 0))  # noqa: E731
        out.append((r[col["Source"]].strip(), num("# Samples"), num("Instructions Executed"), {s: num(s) for s in stalls}))
    return out


def opcode(src):
    return re.sub(r"^@!?U?P\w+\s+", "", src).split(" ")[0].split(".")[0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--min-share", type=float, default=0.75)
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    ins = load(a.csv)
    total = sum(n for _, n, _, _ in ins)
    reasons = collections.Counter()
    for _, _, _, st in ins:
        reasons.update(st)
    print(f"{len(ins)} SASS instructions, {total} stall samples")
    print("stall reasons: " + ", ".join(f"{k[6:]} {100 * v / max(1, sum(reasons.values())):.1f}%"
                                        for k, v in reasons.most_common(10)))
    peak = max(e for _, _, e, _ in ins)
    loop = [x for x in ins if x[2] >= a.min_share * peak]
    loop_samples = sum(n for _, n, _, _ in loop)
    print(f"hot loop (executed >= {a.min_share:.0%} of {peak}): {len(loop)} instructions, "
          f"{100 * loop_samples / max(1, total):.1f}% of the samples")
    classes = collections.Counter(opcode(s) for s, _, _, _ in loop)
    print("  " + ", ".join(f"{k} {v}" for k, v in classes.most_common(24)))
    print(f"top {a.top} instructions by samples:")
    for src, n, e, st in sorted(ins, key=lambda x: -x[1])[:a.top]:
        why = ", ".join(f"{k[6:]} {v}" for k, v in sorted(st.items(), key=lambda x: -x[1])[:2] if v)
        print(f"  {n:6d} {100 * n / max(1, total):5.1f}%  x{e:<8d} {src[:60]:60s} {why}")


if __name__ == "__main__":
    main()
