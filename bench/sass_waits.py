#!/usr/bin/env python3
"""Where ptxas put the prefill kernel's wgmma waits, per instance: compiles src/cuda/prefill/kernel.cu for
sm_90a (no GPU needed) and prints, for each prefill_kernel instance, its main loop's sequence of wgmma
issues, waits (WARPGROUP.DEPBAR), barriers and runs of MUFU (the softmax's exponentials).

A wait names no registers, so ptxas's scheduler may move it within its basic block: it has been seen to
hoist the default kernel's wait for P.V above the softmax it was meant to overlap (bench/RESULTS.md). Run this after any change to the loop.

Usage: python3 bench/sass_waits.py [instance-substring ...]   (default: the d=128 bf16-out instances)
Needs nvcc and cuobjdump (the CUDA toolkit's, or pip's nvidia-cuda-cuobjdump: set CUOBJDUMP=path).
"""
import itertools
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EVENT = re.compile(r"(WARPGROUP\.DEPBAR\S*[^;]*|WARPGROUP\.ARRIVE|[HQ]GMMA\.\S+|BAR\.(SYNC|ARV)\S*[^;]*|MUFU\.EX2)")


def tool(name, env):
    path = os.environ.get(env) or shutil.which(name) or os.path.join("/usr/local/cuda/bin", name)
    if not os.path.exists(path):
        sys.exit(f"{name} not found: set {env}=path")
    return path


def main():
    wanted = sys.argv[1:] or ["ILi128ENS_4bf16ELb0ELb0", "ILi128ENS_4bf16ELb0ELb1", "ILi128ENS_4bf16ELb1ELb0"]
    nvcc, cuobjdump = tool("nvcc", "NVCC"), tool("cuobjdump", "CUOBJDUMP")
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "prefill.cubin")
        subprocess.run([nvcc, "-DDMATTN_HAVE_CUDA=1", "-I" + os.path.join(ROOT, "include"), "-I" + os.path.join(ROOT, "src"),
                        "-O3", "-DNDEBUG", "-arch=sm_90a", "--expt-relaxed-constexpr", "-std=c++17", "-cubin",
                        os.path.join(ROOT, "src/cuda/prefill/kernel.cu"), "-o", cubin], check=True)
        sass = subprocess.run([cuobjdump, "-sass", cubin], check=True, capture_output=True, text=True).stdout
    for func in re.split(r"\n\s*Function : ", sass)[1:]:
        name = func.split("\n", 1)[0].strip()
        if "prefill_kernel" not in name or not any(w in name for w in wanted):
            continue
        print("==", name)
        events = [m.group(0).strip() for m in map(EVENT.search, func.split("\n")) if m]
        # Runs of wgmmas of one shape, and of MUFUs, as counts; waits and barriers one a line.
        out = []
        for key, run in itertools.groupby(e.split(" ")[0] if "GMMA" in e else e for e in events):
            n = len(list(run))
            out += [f"{n} x {key}" if n > 1 else key] if "GMMA" in key or key == "MUFU.EX2" else [key] * n
        print("   " + "\n   ".join(out))


if __name__ == "__main__":
    main()
