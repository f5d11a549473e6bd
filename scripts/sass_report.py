#!/usr/bin/env python
"""A static view of the CUDA kernels' machine code, for work on them without a GPU.

Compiles a .cu file of engine_src/cuda for one architecture with the build's nvcc flags and prints, for each kernel
whose name holds --kernel: its registers and spill bytes (ptxas's report), and the SASS instructions of its hot
loop (the largest loop holding a tensor-core MMA or a 64/128-bit global load) with the most frequent opcodes.
`--against REF` compiles the file as it is at git REF too (the other engine_src/cuda files as they are now) and
prints the two side by side. Static counts: a branch skipped at run time still counts, so compare like with like.

    python scripts/sass_report.py engine_src/cuda/attention_decode.cu --kernel "decode_kernel<__nv_bfloat16"
    python scripts/sass_report.py engine_src/cuda/attention_prefill.cu --kernel tc_kernel --against HEAD~1

Needs nvcc, c++filt, and cuobjdump with nvdisasm: the CUDA toolkit's, or the PyPI wheels nvidia-cuda-cuobjdump
and nvidia-cuda-nvdisasm (in batchgen's test extras), found in this Python's environment.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CUDA_DIR = ROOT / "engine_src" / "cuda"
# setup.py's nvcc flags, with those torch's cpp_extension adds (no implicit half/bfloat16 conversions or operators).
COMMON_NVCC_FLAGS = ["-std=c++17", "-O3", "--use_fast_math", "-D__CUDA_NO_HALF_OPERATORS__",
                     "-D__CUDA_NO_HALF_CONVERSIONS__", "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
                     "-D__CUDA_NO_HALF2_OPERATORS__", "--expt-relaxed-constexpr"]
SHORT_NAMES = {"batchgen::kernels::": "", "(anonymous namespace)::": "", "Fp8<(batchgen::KVFormat)1>": "e4m3",
               "Fp8<(batchgen::KVFormat)2>": "e5m2"}


def gencode(arch: int) -> list[str]:
    return ["-gencode", f"arch=compute_{arch},code=sm_{arch}"]


def demangle(names: list[str]) -> list[str]:
    """Kernel names as their templates, shortened: "paged_attention_decode_kernel<__nv_bfloat16, e4m3, 128>"."""
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True, check=True).stdout
    result = []
    for name in out.splitlines():
        name = name[: name.rfind(">(") + 1] or name  # the template, without the parameter list
        for long, short in SHORT_NAMES.items():
            name = name.replace(long, short)
        result.append(name.removeprefix("void "))
    return result


def ptxas_resources(report: str) -> dict[tuple[str, str], tuple[int, int]]:
    """(kernel, arch) -> (registers, bytes of spill stores), read from ptxas -v's report (nvcc -Xptxas -v)."""
    found: dict[tuple[str, str], list[int]] = {}
    kernel = None
    for line in report.splitlines():
        if m := re.search(r"Compiling entry function '(\w+)' for '(sm_\d+)'", line):
            kernel = (m.group(1), m.group(2))
            found[kernel] = [0, 0]
        elif kernel and (m := re.search(r"(\d+) bytes spill stores", line)):
            found[kernel][1] = int(m.group(1))
        elif kernel and (m := re.search(r"Used (\d+) registers", line)):
            found[kernel][0] = int(m.group(1))
    keys = list(found)
    names = demangle([mangled for mangled, _ in keys])
    return {(name, key[1]): tuple(found[key]) for name, key in zip(names, keys, strict=True)}


def find_tool(name: str) -> str | None:
    """A CUDA binary tool on PATH, or from the nvidia-cuda-* wheels in this environment."""
    if tool := shutil.which(name):
        return tool
    for base in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}:
        for candidate in sorted(Path(base).glob(f"nvidia/*/bin/{name}")):
            return str(candidate)
    return None


@dataclass
class Kernel:
    name: str
    registers: int = 0
    spill_bytes: int = 0
    loop: Counter = field(default_factory=Counter)  # opcodes of the hot loop

    @property
    def loop_size(self) -> int:
        return sum(self.loop.values())


def hot_loop(sass: str) -> Counter:
    """Opcodes (without modifiers or predicates) of the largest loop that holds an HMMA or a 64/128-bit LDG."""
    code = [(int(a, 16), ins.strip()) for a, ins in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    best: list[str] = []
    for address, ins in code:
        jump = re.search(r"BRA\s+(?:\S+\s+)?0x([0-9a-f]+)", ins)
        if jump and int(jump.group(1), 16) < address:  # a backward branch closes a loop
            body = [i for a, i in code if int(jump.group(1), 16) <= a <= address]
            hot = any("HMMA" in i or re.search(r"LDG\S*\.(64|128)\b", i) for i in body)
            if hot and len(body) > len(best):
                best = body
    return Counter(i.split()[1 if i.startswith("@") else 0].split(".")[0] for i in best)


def report(source: Path, arch: int, pattern: str, include: Path) -> dict[str, Kernel]:
    """Compiles `source` for sm_<arch> and reads back each matching kernel's resources and hot loop."""
    cuobjdump = find_tool("cuobjdump")
    nvdisasm = find_tool("nvdisasm")
    if cuobjdump is None or nvdisasm is None:
        sys.exit("sass_report: needs cuobjdump and nvdisasm (the CUDA toolkit's, or pip install "
                 "nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernels.cubin"
        build = subprocess.run(["nvcc", *COMMON_NVCC_FLAGS, *gencode(arch), "-Xptxas", "-v", f"-I{include}",
                                "-cubin", "-o", str(cubin), str(source)], capture_output=True, text=True)
        if build.returncode != 0:
            sys.exit(f"sass_report: nvcc failed on {source}:\n{build.stderr}")
        env = {**os.environ, "PATH": f"{Path(nvdisasm).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
        sass = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, text=True, env=env,
                              check=True).stdout
    kernels = {name: Kernel(name, regs, spill) for (name, _), (regs, spill) in ptxas_resources(build.stderr).items()
               if pattern in name}
    functions = re.split(r"\n\s*Function : ", sass)[1:]
    names = demangle([f.split("\n", 1)[0].strip() for f in functions])
    for name, function in zip(names, functions, strict=True):
        if name in kernels:
            kernels[name].loop = hot_loop(function)
    return kernels


def source_at(ref: str, source: Path, folder: Path) -> Path:
    """`source` as it is at git `ref`, written into `folder` beside today's headers (for the includes)."""
    text = subprocess.run(["git", "show", f"{ref}:{source.resolve().relative_to(ROOT)}"], cwd=ROOT,
                          capture_output=True, text=True, check=True).stdout
    (folder / source.name).write_text(text)
    return folder / source.name


def main(argv: list[str] | None = None) -> dict[str, list[Kernel]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", type=Path, help="a .cu file under engine_src/cuda")
    parser.add_argument("--kernel", default="", help="only kernels whose demangled name holds this")
    parser.add_argument("--arch", type=int, default=90, help="compute capability (default 90)")
    parser.add_argument("--against", help="a git ref: the same report for the file as it is there, side by side")
    args = parser.parse_args(argv)
    columns = {"now": report(args.source, args.arch, args.kernel, CUDA_DIR)}
    if args.against:
        with tempfile.TemporaryDirectory() as tmp:
            old = source_at(args.against, args.source, Path(tmp))
            columns = {args.against: report(old, args.arch, args.kernel, CUDA_DIR), **columns}
    tags = list(columns)
    width = max((len(name) for name in columns["now"]), default=10)
    print(f"sm_{args.arch}: registers, spill bytes, SASS instructions of the hot loop")
    print(f"{'kernel':{width}}" + "".join(f" | {tag:>20}" for tag in tags))
    for name in columns["now"]:
        cells = []
        for tag in tags:
            k = columns[tag].get(name)
            cells.append(f"{k.registers:4d}r {k.spill_bytes:4d}s {k.loop_size:6d}i" if k else f"{'-':>20}")
        print(f"{name:{width}}" + "".join(f" | {c:>20}" for c in cells))
        print(f"{'':{width}}   {', '.join(f'{op} {n}' for op, n in columns['now'][name].loop.most_common(8))}")
    return {tag: list(kernels.values()) for tag, kernels in columns.items()}


if __name__ == "__main__":
    main()
