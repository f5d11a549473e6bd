"""Builds batchgen._C from engine_src/.

The CPU kernels are always built. The CUDA kernels (engine_src/cuda/*.cu) are added when the
installed torch is a CUDA build and nvcc is found, unless BATCHGEN_NO_CUDA=1. The CPU build uses
no -march=native: kernels that want AVX-512 pick it at run time (see engine_src/README.md).
"""

import glob
import os
import platform

import torch
from setuptools import setup
from setuptools.command.build_py import build_py
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

ROOT = os.path.dirname(os.path.abspath(__file__))


def _sources(pattern: str) -> list[str]:
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern), recursive=True))


def _with_cuda() -> bool:
    if os.environ.get("BATCHGEN_NO_CUDA") == "1":
        return False
    return torch.version.cuda is not None and CUDA_HOME is not None


# -ffp-contract=off: GCC's default for C++ fuses a * b + c into one FMA wherever it sees fit after
# inlining, so one kernel could round the same row differently in two call sites; the kernels'
# results must depend on the data alone (batch invariance, engine_src/README.md). Intrinsic FMAs
# are unaffected. -fno-trapping-math: the kernels never read the floating-point exception flags, and
# without it GCC will not evaluate both sides of a floating-point select where AVX2 has no masked
# operations, so branch-free loops such as the fp8 cache write stay scalar on the AVX2 table; every
# result is the same IEEE operation either way.
cxx_flags = ["-O3", "-std=c++17", "-fopenmp", "-ffp-contract=off", "-fno-trapping-math"]
if platform.machine() in ("x86_64", "AMD64"):
    cxx_flags += ["-mavx2", "-mfma", "-mf16c"]
link_flags = ["-fopenmp"]
sources = _sources("engine_src/csrc/**/*.cpp")
include_dirs = [os.path.join(ROOT, "engine_src", "csrc"), os.path.join(ROOT, "engine_src", "cuda")]

if _with_cuda():
    sources += _sources("engine_src/cuda/*.cu") + _sources("engine_src/cuda/*.cpp")
    archs = os.environ.get("BATCHGEN_CUDA_ARCHS", "80;90").split(";")
    arch_flags = []
    for arch in archs:
        arch_flags += ["-gencode", f"arch=compute_{arch},code=sm_{arch}"]
    # The last architecture's PTX too (the step nvcc takes anyway): a newer GPU (Blackwell's sm_100, ...) compiles
    # the kernels from it when first loaded, where machine code alone would have no kernel for it.
    arch_flags += ["-gencode", f"arch=compute_{archs[-1]},code=compute_{archs[-1]}"]
    extension = CUDAExtension(
        "batchgen._C",
        sources,
        include_dirs=include_dirs,
        define_macros=[("WITH_CUDA", "1")],
        extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3", "-std=c++17", "--use_fast_math", *arch_flags]},
        extra_link_args=link_flags,
    )
else:
    extension = CppExtension(
        "batchgen._C",
        sources,
        include_dirs=include_dirs,
        extra_compile_args={"cxx": cxx_flags},
        extra_link_args=link_flags,
    )



class BuildPyWithGuides(build_py):
    """Ships README.md and docs/*.md in the package (batchgen/docs/), so `batchgen docs TOPIC` prints
    them where batchgen is installed without its clone."""

    def run(self) -> None:
        super().run()
        target = os.path.join(self.build_lib, "batchgen", "docs")
        self.mkpath(target)
        for path in [os.path.join(ROOT, "README.md"), *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]:
            self.copy_file(path, os.path.join(target, os.path.basename(path)))


setup(ext_modules=[extension],
      cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True), "build_py": BuildPyWithGuides})
