#!/usr/bin/env python3
"""docs/PERFORMANCE.md from measurements: one command measures, one renders, one checks.

  python3 bench/performance.py measure [SECTION ...] --build DIR [--python PYDIR]   (a GPU machine;
      DIR holds the C++ benches and the CLI, PYDIR (default DIR/python) the module) runs each
      section's benchmark, keeps the tables it prints in bench/perf/SECTION.md with the date, the GPU
      and the command, then renders the page
  python3 bench/performance.py render   writes docs/PERFORMANCE.md from bench/perf/page.md, the kept
      tables and the quality CSVs (bench/eval_*.csv); no GPU needed
  python3 bench/performance.py check    exits 1 when docs/PERFORMANCE.md is not what render writes

A section not measured keeps its last tables and their own date and GPU: the page says which card and
day every table comes from. The full record of each run (and of every earlier one) is bench/RESULTS.md.
"""
import argparse
import csv
import datetime
import functools
import os
import re
import shlex
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PERF = os.path.join(ROOT, "bench", "perf")
PAGE = os.path.join(ROOT, "docs", "PERFORMANCE.md")

# Section: (environment, command; {build} is the build folder). Each prints markdown tables.
SECTIONS = {
    "python_prefill": ({"POLICY_SHAPES": ""}, "python3 bench/bench_python.py"),
    "policy_cost": ({"ROUNDS": "3", "SHAPES": "0", "VARLEN": "0", "POLICY_SHAPES": "1x16384 1x4096 4x4096 8x2048"},
                    "python3 bench/bench_python.py sq=smooth_q:1 sqh=smooth_q:high plain=diag_tiles:1,sink_tiles:0,smooth_k:0,rotate:0"),
    "kernel_prefill": ({}, "python3 bench/compare_sdpa.py {build} {out} 4096 16384"),
    "kernel_decode": ({}, "python3 bench/compare_decode.py {build} {out}"),
    "decode_step": ({}, "python3 bench/bench_decode_step.py 1:8192 1:131072 16:8192 16:32768 64:32768"),
    "generate": ({}, "python3 bench/bench_generate.py 16 4096 256"),
}

# The quality table: (row, {model: (csv under bench/, config)}); perplexity against exact attention
# in the same file, and the mean of the per-layer attention errors.
MODELS = ("SmolLM2-135M", "Gemma-3-270M")
EXACT = {"SmolLM2-135M": "eval_smollm2_ctx2048_diag8.csv", "Gemma-3-270M": "eval_gemma3_ctx2048_diag8.csv"}  # its row
QUALITY = [
    ("bf16 everywhere", {"SmolLM2-135M": ("eval_smollm2_ctx2048.csv", "all-bf16"),
                         "Gemma-3-270M": ("eval_gemma3_ctx2048_diag8.csv", "bf16")}),
    ("MXFP8 E4M3 everywhere, OCP scales", {"SmolLM2-135M": ("eval_smollm2_ctx2048_transforms.csv", "mxfp8")}),
    ("MXFP8 E4M3 everywhere, ceil scales", {"Gemma-3-270M": ("eval_gemma3_ctx2048.csv", "mxfp8+ceil")}),
    ("MXFP8 E4M3 everywhere, smooth_k, rotate, ceil", {
        "Gemma-3-270M": ("eval_gemma3_ctx2048_diag8.csv", "mxfp8+sk+rot+ceil")}),
    ("MXFP4 everywhere, OCP scales", {"SmolLM2-135M": ("eval_smollm2_ctx2048_transforms.csv", "mxfp4")}),
    ("MXFP4 everywhere, ceil scales", {"Gemma-3-270M": ("eval_gemma3_ctx2048.csv", "mxfp4+ceil")}),
    ("MXFP8 on the diagonal tile, MXFP4 elsewhere, OCP scales", {
        "SmolLM2-135M": ("eval_smollm2_ctx2048_transforms.csv", "diag1"),
        "Gemma-3-270M": ("eval_gemma3_ctx2048.csv", "diag1")}),
    # (that Gemma file's "default" is the default of its day: the diagonal tile with ceil scales)
    ("the same with ceil scales (`Policy.plain()`)", {"SmolLM2-135M": ("eval_smollm2_ctx2048_ceil.csv", "diag1+ceil"),
                                                      "Gemma-3-270M": ("eval_gemma3_ctx2048.csv", "default")}),
    ("diag 4 + sink tile, smooth_k, rotate, ceil", {
        "SmolLM2-135M": ("eval_smollm2_ctx2048_rotate.csv", "diag4-sink1+sk+rot+ceil"),
        "Gemma-3-270M": ("eval_gemma3_ctx2048.csv", "diag4-sink1+sk+rot+ceil")}),
    ("**the default**: diag 8 + sink tile, smooth_k, rotate, ceil", {
        "SmolLM2-135M": ("eval_smollm2_ctx2048_diag8.csv", "diag8-sink1+sk+rot+ceil"),
        "Gemma-3-270M": ("eval_gemma3_ctx2048_diag8.csv", "diag8-sink1+sk+rot+ceil")}),
    ("the default + smooth_q", {"SmolLM2-135M": ("eval_smollm2_ctx2048_sq.csv", "custom"),
                                "Gemma-3-270M": ("eval_gemma3_ctx2048_sq.csv", "custom")}),
    ("the default + smooth_q=high", {"SmolLM2-135M": ("eval_smollm2_ctx2048_sqh.csv", "default+sqh"),
                                     "Gemma-3-270M": ("eval_gemma3_ctx2048_sqh.csv", "default+sqh")}),
]


@functools.lru_cache(maxsize=None)  # each file read once a render
def read_eval(name):
    with open(os.path.join(ROOT, "bench", name), newline="") as f:
        rows = list(csv.DictReader(f))
    out = {}
    for r in rows:
        layers = [float(v) for k, v in r.items() if k.startswith("layer") and v]
        out[r.get("config") or r.get("Config")] = (float(r["ppl"]), float(r["ppl_vs_exact"]),
                                                   sum(layers) / len(layers) if layers else float("nan"))
    return out


def quality_table():
    head = "| policy (8 windows of 2048 tokens) | " + " | ".join(f"{m} ppl | vs exact | layer error" for m in MODELS) + " |"
    lines = [head, "|---|" + "---|---|---|" * len(MODELS)]
    exact = {m: read_eval(f)["exact"][0] for m, f in EXACT.items()}
    lines.append("| exact (fp64) | " + " | ".join(f"{exact[m]:.3f} | — | 0" for m in MODELS) + " |")
    for label, srcs in QUALITY:
        cells = []
        for m in MODELS:
            f, config = srcs.get(m, (None, None))
            if f is None or config is None:
                cells.append("— | — | —")
                continue
            ppl, rel, err = read_eval(f)[config]
            cells.append(f"{ppl:.3f} | {100 * rel:+.2f}% | {err:.3f}")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    srcs = sorted({f for _, s in QUALITY for f, c in s.values() if c})
    note = ("\n_CPU backend, the project's own forward passes of the Q4 GGUF models, the licence texts in Debian's "
            "base-files (the second half of each window scored), perplexity against exact attention in the same "
            "file. Command: `./build/dmattn eval [--model MODEL] --windows 8 --only CONFIG,... --csv FILE`; "
            "sources: " + ", ".join(f"`bench/{f}`" for f in srcs) + "._")
    return "\n".join(lines) + "\n" + note


def tables(text):
    """The markdown tables in a benchmark's output, each as its lines, in order."""
    out, cur = [], []
    for line in text.splitlines():
        if line.startswith("|"):
            cur.append(line.rstrip())
        elif cur:
            out.append(cur)
            cur = []
    if cur:
        out.append(cur)
    return out


def gpu_name():
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, check=True).stdout.strip().splitlines()[0]
    except (OSError, subprocess.CalledProcessError):
        return "no GPU"


def measure(names, build, python, out, shown_build):
    for name in names:
        env, template = SECTIONS[name]
        cmd = template.format(build=build, out=out)
        full_env = dict(os.environ, **env, PYTHONUNBUFFERED="1")
        full_env["PYTHONPATH"] = python + os.pathsep + full_env.get("PYTHONPATH", "")
        shown = (" ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) + (" " if env else "") +
                 template.format(build=shown_build, out="$OUT"))  # as a reader would type it
        print(f"== {name}: {shown}", flush=True)
        r = subprocess.run(shlex.split(cmd), cwd=ROOT, env=full_env, capture_output=True, text=True)
        print(r.stdout[-4000:], r.stderr[-2000:], flush=True)
        found = tables(r.stdout)
        if r.returncode != 0 or not found:
            print(f"{name}: not kept (rc {r.returncode}, {len(found)} tables)", flush=True)
            continue
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
        with open(os.path.join(PERF, name + ".md"), "w") as f:
            f.write(f"<!-- {stamp} | {gpu_name()} | {shown} -->\n")
            f.write("\n\n".join("\n".join(t) for t in found) + "\n")


def section(name):
    with open(os.path.join(PERF, name + ".md")) as f:
        first, body = f.read().split("\n", 1)
    m = re.match(r"<!-- (.*?) \| (.*?) \| (.*) -->", first)
    date, gpu, cmd = m.groups()
    return body.strip() + f"\n\n_Measured {date} on {gpu}: `{cmd}`._"


def render():
    with open(os.path.join(PERF, "page.md")) as f:
        page = f.read()
    page = page.replace("{{quality}}", quality_table())
    page = re.sub(r"\{\{(\w+)\}\}", lambda m: section(m.group(1)), page)
    return page


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=("measure", "render", "check"))
    ap.add_argument("sections", nargs="*", metavar="SECTION",
                    help="measure: these sections (default all): " + ", ".join(SECTIONS))
    ap.add_argument("--build", default="build", help="measure: the folder of the C++ benchmarks and the CLI")
    ap.add_argument("--python", help="measure: the folder of the Python module (default BUILD/python)")
    args = ap.parse_args()
    unknown = [name for name in args.sections if name not in SECTIONS]
    if unknown:
        ap.error(f"unknown sections {unknown}; the sections: {', '.join(SECTIONS)}")
    if args.mode == "measure":
        build = os.path.abspath(args.build)
        python = os.path.abspath(args.python) if args.python else os.path.join(build, "python")
        measure(args.sections or list(SECTIONS), build, python, os.environ.get("OUT", "/tmp"), args.build)
    text = render()
    if args.mode == "check":
        with open(PAGE) as f:
            if f.read() != text:
                print("docs/PERFORMANCE.md is not what `python3 bench/performance.py render` writes", file=sys.stderr)
                return 1
        return 0
    with open(PAGE, "w") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
