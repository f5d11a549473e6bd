// A small host emulation of the CUDA execution model, so that the kernels of engine_src/cuda run
// (slowly) on a CPU in tests/test_cuda_emulated.py. Each thread of a block is a ucontext fiber;
// __syncthreads, __syncwarp and warp shuffles are cooperative barriers, and the fibers run in a
// new random order after every barrier, so a missing barrier shows up as wrong results. A
// barrier that not every thread reaches aborts ("deadlock"). Blocks run one after another, so
// static __shared__ arrays become function statics; dynamic shared memory starts as NaN bytes.
// It includes the CUDA headers first and then redefines the CUDA keywords: include it first.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <tuple>
#include <vector>

using std::max;
using std::min;

namespace emu {

struct Thread {
  ucontext_t ctx;
  uint3 tid;
  bool done = false;
  int blocked = 0;  // 0 runnable, 1 block barrier, 2 warp barrier
  std::vector<char> stack;
};

struct State {
  std::vector<Thread> threads;
  ucontext_t main_ctx;
  Thread* cur = nullptr;
  uint3 block_idx;
  dim3 block_dim, grid_dim;
  std::vector<unsigned char> smem;
  std::vector<unsigned long long> warp_buf;
  std::function<void()> body;
  long long barriers = 0;
};

inline State& S() {
  static State s;
  return s;
}

inline int linear_tid() {
  auto& s = S();
  return s.cur->tid.x + s.block_dim.x * (s.cur->tid.y + s.block_dim.y * s.cur->tid.z);
}

inline void block_on(int kind) {
  auto& s = S();
  s.cur->blocked = kind;
  swapcontext(&s.cur->ctx, &s.main_ctx);
}

inline void syncthreads() { block_on(1); }
inline void syncwarp() { block_on(2); }

template <typename T>
T shfl_xor(T v, int mask) {
  static_assert(sizeof(T) <= 8);
  auto& s = S();
  const int t = linear_tid();
  unsigned long long bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  s.warp_buf[t] = bits;
  syncwarp();
  const int partner = (t & ~31) | ((t & 31) ^ mask);
  bits = s.warp_buf[partner];
  syncwarp();
  T r;
  std::memcpy(&r, &bits, sizeof(T));
  return r;
}

inline unsigned char* dynamic_smem() { return S().smem.data(); }

inline void trampoline() {
  auto& s = S();
  s.body();
  s.cur->done = true;
  swapcontext(&s.cur->ctx, &s.main_ctx);
}

inline void fail(const char* what) {
  auto& s = S();
  std::fprintf(stderr, "emu: %s in block (%u,%u,%u)\n", what, s.block_idx.x, s.block_idx.y, s.block_idx.z);
  std::abort();
}

inline void run_block() {
  auto& s = S();
  const int n = s.block_dim.x * s.block_dim.y * s.block_dim.z;
  if (n % 32 != 0) fail("block size not a multiple of 32");
  s.threads.clear();
  s.threads.resize(n);
  s.warp_buf.assign(n, 0);
  for (int i = 0; i < n; ++i) {
    Thread& t = s.threads[i];
    t.tid = make_uint3(i % s.block_dim.x, (i / s.block_dim.x) % s.block_dim.y, i / (s.block_dim.x * s.block_dim.y));
    t.stack.resize(256 * 1024);
    getcontext(&t.ctx);
    t.ctx.uc_stack.ss_sp = t.stack.data();
    t.ctx.uc_stack.ss_size = t.stack.size();
    t.ctx.uc_link = nullptr;
    makecontext(&t.ctx, trampoline, 0);
  }
  while (true) {
    bool progress = false;
    // Random order each pass, so that a missing barrier shows whichever thread writes first.
    static unsigned seed = 12345;
    std::vector<int> order(n);
    for (int i = 0; i < n; ++i) order[i] = i;
    for (int i = n - 1; i > 0; --i) {
      seed = seed * 1103515245u + 12345u;
      std::swap(order[i], order[(seed >> 8) % (i + 1)]);
    }
    for (int i : order) {
      Thread& t = s.threads[i];
      if (t.done || t.blocked) continue;
      s.cur = &t;
      swapcontext(&s.main_ctx, &t.ctx);
      progress = true;
    }
    // Warp barriers: all 32 lanes must wait on one.
    for (int w = 0; w < n / 32; ++w) {
      int waiting = 0, done = 0;
      for (int l = 0; l < 32; ++l) {
        const Thread& t = s.threads[w * 32 + l];
        waiting += !t.done && t.blocked == 2;
        done += t.done;
      }
      if (waiting == 32) {
        for (int l = 0; l < 32; ++l) s.threads[w * 32 + l].blocked = 0;
        progress = true;
        ++s.barriers;
      } else if (waiting > 0 && done > 0) {
        fail("warp barrier with exited lanes");
      }
    }
    int live = 0, at_block = 0;
    for (auto& t : s.threads) {
      live += !t.done;
      at_block += !t.done && t.blocked == 1;
    }
    if (live == 0) break;
    if (at_block == live) {
      for (auto& t : s.threads) t.blocked = 0;
      progress = true;
      ++s.barriers;
    }
    if (!progress) fail("deadlock: threads wait on different barriers");
  }
}

template <typename... KArgs>
struct Launch {
  void (*kernel)(KArgs...);
  dim3 grid, block;
  size_t smem;
  template <typename... Args>
  void operator()(Args&&... args) {
    std::tuple<KArgs...> tuple(std::forward<Args>(args)...);
    auto& s = S();
    s.grid_dim = grid;
    s.block_dim = block;
    for (unsigned z = 0; z < grid.z; ++z)
      for (unsigned y = 0; y < grid.y; ++y)
        for (unsigned x = 0; x < grid.x; ++x) {
          s.block_idx = make_uint3(x, y, z);
          s.smem.assign(smem + 16, 0xff);  // NaN garbage: uninitialized reads show up
          s.body = [&] { std::apply(kernel, tuple); };
          run_block();
        }
  }
};

template <typename... KArgs>
Launch<KArgs...> launch(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem = 0, cudaStream_t = nullptr) {
  return Launch<KArgs...>{kernel, grid, block, smem};
}

}  // namespace emu

#undef __global__
#undef __device__
#undef __host__
#undef __forceinline__
#undef __shared__
#undef __launch_bounds__
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(...)
#define threadIdx (emu::S().cur->tid)
#define blockIdx (emu::S().block_idx)
#define blockDim (emu::S().block_dim)
#define gridDim (emu::S().grid_dim)
#define __syncthreads() emu::syncthreads()
#define __syncwarp(...) emu::syncwarp()
#define __shfl_xor_sync(mask, v, m) emu::shfl_xor(v, m)
#define cudaGetLastError() cudaSuccess
#define cudaFuncSetAttribute(...) cudaSuccess
