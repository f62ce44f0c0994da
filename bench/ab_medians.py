"""Medians of the A/B timing lines bench/device.sh writes: one line per (key, dir).
usage: ab_medians.py FILE VALUE_COLUMN UNIT KEY_COLUMN... (columns 0-based; column 0 is the dir)"""
import collections
import statistics
import sys

path, col, unit, keys = sys.argv[1], int(sys.argv[2]), sys.argv[3], [int(k) for k in sys.argv[4:]]
t = collections.defaultdict(list)
for line in open(path):
    f = line.split()
    if len(f) > max([col, *keys]):
        t[(tuple(f[k] for k in keys), f[0])].append(float(f[col]))
for (key, d), v in sorted(t.items(), key=lambda kv: ([int(x) if x.isdigit() else x for x in kv[0][0]], kv[0][1])):
    print(f"{' '.join(key):24s} {d:28s} median {statistics.median(v):.4f} {unit}  all {' '.join(f'{x:.4f}' for x in v)}")
