// Tensor-core building blocks for sm_80 and later, each one PTX instruction behind a small device
// function: the m16n8k16 MMA with fp16/bf16 operands and fp32 accumulators, ldmatrix (x4, plain and
// transposed) and 16-byte cp.async copies into shared memory. Under the CPU emulation of
// tests/cuda_emu (BATCHGEN_CUDA_EMU) each becomes a warp-collective C++ version in emu.h.
//
// Fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type"), with
// g = lane / 4 and t = lane % 4, each 32-bit register holding two adjacent elements (the lower
// index in the low half):
//   A (16 x 16, row major) a[0]: row g,     columns 2t, 2t+1     a[1]: row g + 8, columns 2t, 2t+1
//                          a[2]: row g,     columns 2t+8, 2t+9   a[3]: row g + 8, columns 2t+8, 2t+9
//   B (16 x 8, "col")      b[0]: rows 2t, 2t+1 of column g       b[1]: rows 2t+8, 2t+9 of column g
//   C, D (16 x 8, fp32)    c[0], c[1]: row g, columns 2t, 2t+1   c[2], c[3]: row g + 8, same columns
// ldmatrix.x4 reads four 8 x 8 matrices of 16-bit elements, lane 8i + r giving the address of row r
// of matrix i (16 contiguous bytes, 16-byte aligned); register i of lane l receives row l / 4,
// elements 2(l % 4) and 2(l % 4) + 1 of matrix i, or with .trans column l / 4, rows 2(l % 4) and
// 2(l % 4) + 1. So a row-major 8 x 8 block read plainly is an A or C shaped piece, and read
// transposed it is a B piece of a matrix stored with k as its rows (V in P V).
#pragma once

#include <cstdint>
#include <type_traits>

#include "common.cuh"

namespace batchgen::kernels {

// Two floats rounded to T and packed into one 32-bit register, `lo` in the low half.
template <typename T>
__device__ __forceinline__ uint32_t pack_pair(float lo, float hi);
template <>
__device__ __forceinline__ uint32_t pack_pair<__half>(float lo, float hi) {
  const __half_raw l = __float2half_rn(lo), h = __float2half_rn(hi);
  return static_cast<uint32_t>(l.x) | (static_cast<uint32_t>(h.x) << 16);
}
template <>
__device__ __forceinline__ uint32_t pack_pair<__nv_bfloat16>(float lo, float hi) {
  const __nv_bfloat16_raw l = __float2bfloat16_rn(lo), h = __float2bfloat16_rn(hi);
  return static_cast<uint32_t>(l.x) | (static_cast<uint32_t>(h.x) << 16);
}

// c += a * b: a the A fragment (16 x 16), b the B fragment (16 x 8), c the fp32 accumulator (16 x 8).
template <typename T>
__device__ __forceinline__ void mma_m16n8k16(float c[4], const uint32_t a[4], const uint32_t b[2]) {
  static_assert(std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>, "fp16 or bf16 operands");
#if defined(BATCHGEN_CUDA_EMU)
  emu::mma_m16n8k16(std::is_same_v<T, __nv_bfloat16>, c, a, b);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (std::is_same_v<T, __half>) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
#elif defined(__CUDA_ARCH__)
  __trap();  // the launchers never run tensor-core kernels below sm_80
#endif
}

// Four 8 x 8 matrices from shared memory; `row` is this lane's row address (see above).
__device__ __forceinline__ void ldmatrix_x4(uint32_t r[4], const void* row) {
#if defined(BATCHGEN_CUDA_EMU)
  emu::ldmatrix_x4(r, row, false);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
#elif defined(__CUDA_ARCH__)
  __trap();
#endif
}

// The same four matrices, each transposed.
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t r[4], const void* row) {
#if defined(BATCHGEN_CUDA_EMU)
  emu::ldmatrix_x4(r, row, true);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
#elif defined(__CUDA_ARCH__)
  __trap();
#endif
}

// Starts copying 16 bytes from global `src` to shared `dst` (both 16-byte aligned), bypassing L1;
// with read false nothing is read and `dst` gets 16 zero bytes. Complete after cp_async_commit and a
// cp_async_wait that covers its group; other threads see the bytes after a __syncthreads too.
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, bool read) {
#if defined(BATCHGEN_CUDA_EMU)
  emu::cp_async(dst, src, read ? 16 : 0);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  const int src_bytes = read ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(addr), "l"(src), "r"(src_bytes) : "memory");
#elif defined(__CUDA_ARCH__)
  __trap();
#endif
}

// Closes the group of this thread's copies started since the last commit (an empty group is fine).
__device__ __forceinline__ void cp_async_commit() {
#if defined(BATCHGEN_CUDA_EMU)
  emu::cp_async_commit();
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

// Waits until at most `kPending` of this thread's committed groups (the newest) are still in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
#if defined(BATCHGEN_CUDA_EMU)
  emu::cp_async_wait(kPending);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
#endif
}

}  // namespace batchgen::kernels
