#!/usr/bin/env python3
"""Prints one line per CUDA kernel instance: a hash of its sm_90a machine code and its name.

Two source trees that print the same lines run the same SASS, so a change meant to move nothing in
the kernels is checked by diffing this output before and after. Needs nvcc only (no GPU, no
cuobjdump): each source under src/cuda (and its folders) is compiled to a cubin and every .text.<kernel> section of
that ELF file is hashed.

usage: kernel_digest.py [--nvcc NVCC] [--source DIR]
"""
import argparse
import concurrent.futures
import hashlib
import os
import pathlib
import re
import struct
import subprocess
import sys
import tempfile


def text_sections(cubin: bytes):
    """Yields (name, bytes) for each .text.* section of a 64-bit little-endian ELF file."""
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)

    def header(i):
        name, _type, _flags, _addr, offset, size = struct.unpack_from("<IIQQQQ", cubin, shoff + i * shentsize)
        return name, offset, size

    _, strtab, _ = header(shstrndx)
    for i in range(shnum):
        name_at, offset, size = header(i)
        name = cubin[strtab + name_at:cubin.index(b"\0", strtab + name_at)].decode()
        if name.startswith(".text."):
            yield name[len(".text."):], cubin[offset:offset + size]


# An anonymous namespace's mangled name carries a hash, the source's name and its length: dropped so
# that a kernel keeps its name when its file moves.
ANONYMOUS = re.compile(r"\d+_GLOBAL__N__[0-9a-f]+_\d+_\w+?_cu_[0-9a-f]+")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nvcc", default="nvcc")
    ap.add_argument("--source", default=str(pathlib.Path(__file__).resolve().parent.parent))
    ap.add_argument("--jobs", type=int, default=os.cpu_count())
    args = ap.parse_args()
    src = pathlib.Path(args.source)
    lines = []
    with tempfile.TemporaryDirectory() as tmp:
        def compile_one(cu):
            cubin = pathlib.Path(tmp) / (str(cu.relative_to(src)).replace("/", "_") + ".cubin")
            subprocess.run([args.nvcc, "-std=c++17", "--expt-relaxed-constexpr", "-DDMATTN_HAVE_CUDA=1",
                            f"-I{src / 'include'}", f"-I{src / 'src'}", "-O3", "-DNDEBUG",
                            "-gencode=arch=compute_90a,code=sm_90a", "-cubin", str(cu), "-o", str(cubin)],
                           check=True)
            return cubin

        sources = sorted((src / "src" / "cuda").rglob("*.cu"))
        with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
            for cubin in pool.map(compile_one, sources):
                for name, code in text_sections(cubin.read_bytes()):
                    lines.append(f"{hashlib.sha256(code).hexdigest()[:16]}  {ANONYMOUS.sub('(anonymous)', name)}")
    for line in sorted(lines, key=lambda l: l.split()[1]):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
