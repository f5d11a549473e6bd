"""The CUDA sources compile stand-alone with nvcc for sm_80 and sm_90, and stay torch-free; the
torch-facing glue at least type-checks against the installed torch's headers.

No GPU is needed: this only builds object files. Skipped when nvcc is not on PATH. The flags
mirror what torch.utils.cpp_extension and setup.py pass to nvcc for batchgen._C.
"""

import os
import re
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest
from test_bench_smoke import load_script

CUDA_DIR = Path(__file__).resolve().parents[1] / "engine_src" / "cuda"
sass_report = load_script("sass_report")  # the build's nvcc flags, ptxas's report read
CU_FILES = sorted(CUDA_DIR.glob("*.cu"))
TORCH_FREE_FILES = [CUDA_DIR / "kernels.h", *sorted(CUDA_DIR.glob("*.cuh")), *CU_FILES]

NVCC_FLAGS = [*sass_report.COMMON_NVCC_FLAGS, *sass_report.gencode(80), *sass_report.gencode(90)]


def cuda_include() -> Path | None:
    """The CUDA toolkit's include dir (nvcc may be a wrapper script outside the toolkit)."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.insert(0, str(Path(nvcc).resolve().parents[1]))
    for root in filter(None, candidates):
        if (Path(root) / "include" / "cuda_runtime.h").is_file():
            return Path(root) / "include"
    return None


TORCH_INCLUDE = re.compile(r'^\s*#\s*include\s*[<"](torch|ATen|c10)/', re.MULTILINE)


def test_cuda_sources_exist():
    assert CU_FILES, f"no .cu files under {CUDA_DIR}"
    assert (CUDA_DIR / "kernels.h").is_file()


@pytest.mark.parametrize("path", TORCH_FREE_FILES, ids=lambda p: p.name)
def test_kernels_include_no_torch_header(path):
    found = TORCH_INCLUDE.findall(path.read_text())
    assert not found, f"{path.name} includes a torch/ATen/c10 header; kernels must stay torch-free"


_BUILDS: dict[Path, tuple[list[str], subprocess.CompletedProcess]] = {}


def nvcc_build(path: Path, out_dir: Path) -> tuple[list[str], subprocess.CompletedProcess]:
    """Compiles a .cu file for sm_80 and sm_90 once per session, ptxas reporting each kernel's registers."""
    if path not in _BUILDS:
        cmd = ["nvcc", *NVCC_FLAGS, "-Xptxas", "-v", f"-I{CUDA_DIR}", "-c", str(path), "-o",
               str(out_dir / (path.stem + ".o"))]
        _BUILDS[path] = (cmd, subprocess.run(cmd, capture_output=True, text=True, timeout=900))
    return _BUILDS[path]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
@pytest.mark.parametrize("path", CU_FILES, ids=lambda p: p.name)
def test_cu_file_compiles_for_sm80_and_sm90(path, tmp_path):
    cmd, result = nvcc_build(path, tmp_path)
    assert result.returncode == 0, f"{' '.join(cmd)}\n{result.stdout}\n{result.stderr}"
    warnings = [line for line in result.stderr.splitlines() if "warning" in line.lower()]
    assert not warnings, "nvcc warnings:\n" + "\n".join(warnings)


needs_nvcc_and_cxxfilt = pytest.mark.skipif(shutil.which("nvcc") is None or shutil.which("c++filt") is None,
                                            reason="needs nvcc and c++filt")


@needs_nvcc_and_cxxfilt
def test_decode_kernels_fit_four_blocks_an_sm_and_never_spill(tmp_path):
    """Decode is read-bound: its loads stay in flight across many warps. No decode kernel spills registers to
    local memory, and on sm_80 and sm_90 those over fp8 caches and over 16-bit caches at head_dim 64 and 128
    (SmolLM2's, Llama's) take at most 128 registers, so that 4 blocks of 128 threads (16 warps) fit an SM; 129
    would leave 3."""
    cmd, result = nvcc_build(CUDA_DIR / "attention_decode.cu", tmp_path)
    assert result.returncode == 0, f"{' '.join(cmd)}\n{result.stderr}"
    resources = sass_report.ptxas_resources(result.stderr)
    decode = {k: v for k, v in resources.items() if k[0].startswith("paged_attention_decode_kernel<")}
    assert len(decode) == 3 * 3 * 5 * 2  # activations x caches (T, e4m3, e5m2) x head dims x archs
    assert {k: v for k, v in decode.items() if v[1]} == {}, "decode kernels spill"
    activations = ("float", "__half", "__nv_bfloat16")
    four_blocks = {(f"paged_attention_decode_kernel<{t}, {t}, {d}>", arch) for t in activations[1:]
                   for d in (64, 128) for arch in ("sm_80", "sm_90")}
    four_blocks |= {(f"paged_attention_decode_kernel<{t}, {fp8}, {d}>", arch) for t in activations
                    for fp8 in ("e4m3", "e5m2") for d in (64, 80, 96, 128, 256) for arch in ("sm_80", "sm_90")}
    assert four_blocks <= decode.keys()
    assert {k: decode[k][0] for k in four_blocks if decode[k][0] > 128} == {}


@needs_nvcc_and_cxxfilt
def test_tensor_core_prefill_for_16_bit_caches_does_not_spill(tmp_path):
    """The tensor-core prefill kernels hold their rows' accumulators and scores in registers (up to 255); over
    16-bit caches none of it goes to local memory, at any head_dim, on sm_80 or sm_90."""
    cmd, result = nvcc_build(CUDA_DIR / "attention_prefill.cu", tmp_path)
    assert result.returncode == 0, f"{' '.join(cmd)}\n{result.stderr}"
    resources = sass_report.ptxas_resources(result.stderr)
    kernels = {(f"paged_attention_prefill_tc_kernel<{t}, {t}, {d}>", arch) for t in ("__half", "__nv_bfloat16")
               for d in (64, 80, 96, 128, 256) for arch in ("sm_80", "sm_90")}
    assert kernels <= resources.keys()
    assert {k: resources[k] for k in kernels if resources[k][1]} == {}


def _torch_cuda_headers():
    """Include dirs for compiling torch_glue.cpp against the installed torch, or None."""
    try:
        from torch.utils.cpp_extension import include_paths
    except ImportError:
        return None
    dirs = [Path(p) for p in include_paths()]
    if not any((d / "c10" / "cuda" / "CUDAGuard.h").is_file() for d in dirs):
        return None
    return [*dirs, Path(sysconfig.get_paths()["include"])]


@pytest.mark.skipif(
    shutil.which("g++") is None or cuda_include() is None, reason="needs g++ and the CUDA headers"
)
def test_torch_glue_compiles(tmp_path):
    """torch_glue.cpp is built only with a CUDA torch; here it is at least parsed and type-checked
    against the installed torch's headers and the CUDA runtime headers."""
    torch_dirs = _torch_cuda_headers()
    if torch_dirs is None:
        pytest.skip("the installed torch ships no c10/cuda headers")
    # A CPU build of torch lacks this generated header; an empty one does for a syntax check.
    stub = tmp_path / "c10" / "cuda" / "impl"
    stub.mkdir(parents=True)
    (stub / "cuda_cmake_macros.h").write_text("#pragma once\n")
    glue = CUDA_DIR / "torch_glue.cpp"
    includes = [*torch_dirs, tmp_path, cuda_include(), CUDA_DIR, CUDA_DIR.parent / "csrc"]
    flags = ["-std=c++17", "-fsyntax-only", "-Wall", "-DWITH_CUDA", *[f"-I{d}" for d in includes]]
    cmd = ["g++", *flags, str(glue)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{' '.join(cmd)}\n{result.stderr[-20000:]}"
    own = [line for line in result.stderr.splitlines() if line.startswith(str(glue)) and "warning" in line]
    assert not own, "warnings in torch_glue.cpp:\n" + "\n".join(own)


@pytest.mark.skipif(sass_report.find_tool("cuobjdump") is None or shutil.which("nvcc") is None,
                    reason="needs nvcc and cuobjdump (the test extras' nvidia-cuda-cuobjdump)")
def test_sass_report_reads_a_kernels_hot_loop(capsys):
    """scripts/sass_report.py, the view of the kernels' machine code that work on them without a card goes by: the
    16-bit decode kernel's loop holds its K/V loads (16 bytes a lane, 4 tokens, keys and values) and the dot products'
    fused multiply-adds, beside ptxas's registers."""
    (kernel,) = sass_report.main([str(CUDA_DIR / "attention_decode.cu"), "--kernel",
                                  "decode_kernel<__nv_bfloat16, __nv_bfloat16, 128>"])["now"]
    assert kernel.name == "paged_attention_decode_kernel<__nv_bfloat16, __nv_bfloat16, 128>"
    assert 0 < kernel.registers <= 255 and kernel.spill_bytes == 0
    assert kernel.loop["LDG"] >= 8 and kernel.loop["FFMA"] >= 4 * 4 * 8 * 2  # 4 heads x 4 tokens x 8 floats, K and V
    assert 0 < kernel.loop_size < 5000
    assert kernel.name in capsys.readouterr().out
