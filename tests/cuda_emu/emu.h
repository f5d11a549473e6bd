// A small host emulation of the CUDA execution model, so that the kernels of engine_src/cuda run
// (slowly) on a CPU in tests/test_cuda_emulated.py. Each thread of a block is a ucontext fiber;
// __syncthreads, __syncwarp and warp shuffles are cooperative barriers, and the fibers run in a
// new random order after every barrier, so a missing barrier shows up as wrong results. A warp whose
// 32 lanes meet at a warp barrier may go on at once, ahead of the block's other warps, as on a GPU. A
// barrier that not every thread reaches aborts ("deadlock"). Blocks run one after another, so
// static __shared__ arrays become function statics; dynamic shared memory starts as NaN bytes.
// It includes the CUDA headers first and then redefines the CUDA keywords: include it first.
//
// The tensor-core instructions behind engine_src/cuda/mma.cuh (BATCHGEN_CUDA_EMU selects these) are
// warp-collective here as on the GPU: each lane puts its operands (or its ldmatrix row address)
// into the warp's exchange slots, all 32 lanes meet at a warp barrier, and each lane builds its own
// result from the others' slots per the PTX ISA's fragment layouts. An MMA multiplies the fp16/bf16
// operands exactly and sums each output's 16 products and its accumulator in double, rounded once
// to float (the hardware's order of additions is not documented; tests allow for the difference).
// cp.async copies land either at once or only when a cp.async.wait covers their group (a coin decides
// each), so a read before the wait (or, by another thread, before the barrier after it) sees stale
// bytes, and so does a read after a refill that was not fenced off by a barrier.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <tuple>
#include <vector>

using std::max;
using std::min;

namespace emu {

struct AsyncCopy {
  void* dst;
  const void* src;
  int bytes;  // 16, or 0: zero fill
};

struct Thread {
  ucontext_t ctx;
  uint3 tid;
  bool done = false;
  int blocked = 0;  // 0 runnable, 1 block barrier, 2 warp barrier
  std::vector<char> stack;
  int exchange_phase = 0;  // which of the two exchange slots the next warp-collective op uses
  std::vector<AsyncCopy> async_open;               // cp.async copies not committed yet
  std::deque<std::vector<AsyncCopy>> async_groups;  // committed, oldest first
};

struct State {
  std::vector<Thread> threads;
  ucontext_t main_ctx;
  Thread* cur = nullptr;
  uint3 block_idx;
  dim3 block_dim, grid_dim;
  std::vector<unsigned char> smem;
  std::vector<unsigned long long> warp_buf;
  std::vector<uint32_t> exchange;  // per thread 2 phases x kExchangeWords words
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

inline void fail(const char* what);

// Warp-collective exchange: this lane's `n` words (n < kExchangeWords) go into its slot, the warp meets,
// and the result points at lane 0's slot of the same phase (lane l's at + l * kExchangeWords). The last
// word of a slot names the operation (`op`): every lane must be at the same one, or the warp diverged
// (on the GPU, undefined). The two phases alternate, so one barrier per exchange is enough: a lane can
// only overwrite a phase's slot after the next exchange's barrier, which every lane reaches after reading
// this one.
constexpr int kExchangeWords = 8;

inline const uint32_t* exchange(const uint32_t* words, int n, uint32_t op) {
  auto& s = S();
  const int t = linear_tid();
  const int phase = s.cur->exchange_phase;
  s.cur->exchange_phase ^= 1;
  const size_t warp0 = static_cast<size_t>(t & ~31);
  uint32_t* base = s.exchange.data() + (static_cast<size_t>(phase) * s.threads.size() + warp0) * kExchangeWords;
  uint32_t* mine = base + (t & 31) * kExchangeWords;
  std::memcpy(mine, words, n * sizeof(uint32_t));
  mine[kExchangeWords - 1] = op;
  syncwarp();
  for (int l = 0; l < 32; ++l) {
    if (base[l * kExchangeWords + kExchangeWords - 1] != op) fail("a warp's lanes at different collective operations");
  }
  return base;
}

inline bool in_smem(const void* p, size_t bytes) {
  auto& s = S();
  const auto* b = static_cast<const unsigned char*>(p);
  return b >= s.smem.data() && b + bytes <= s.smem.data() + s.smem.size();
}

inline float half_bits(uint16_t h, bool bf16) {
  if (bf16) {
    const uint32_t u = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  __half_raw x;
  x.x = h;
  return __half2float(__half(x));
}

// Element `half` (0 low, 1 high) of word `reg` of lane `lane` in an exchange.
inline uint16_t element(const uint32_t* slots, int lane, int reg, int half) {
  return static_cast<uint16_t>(slots[lane * kExchangeWords + reg] >> (16 * half));
}

// mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}: c += a b (layouts in engine_src/cuda/mma.cuh).
inline void mma_m16n8k16(bool bf16, float c[4], const uint32_t a[4], const uint32_t b[2]) {
  const uint32_t words[6] = {a[0], a[1], a[2], a[3], b[0], b[1]};
  const uint32_t* slots = exchange(words, 6, bf16 ? 2 : 1);
  const int lane = linear_tid() & 31;
  const int g = lane >> 2, t = lane & 3;
  for (int i = 0; i < 4; ++i) {
    const int row = g + 8 * (i >> 1);
    const int col = 2 * t + (i & 1);
    double sum = c[i];
    for (int k = 0; k < 16; ++k) {
      // A(row, k): register (row >= 8) + 2 (k >= 8) of lane 4 (row % 8) + (k % 8) / 2.
      const uint16_t x = element(slots, 4 * (row & 7) + ((k & 7) >> 1), (row >> 3) + 2 * (k >> 3), k & 1);
      // B(k, col): register 4 + (k >= 8) of lane 4 col + (k % 8) / 2.
      const uint16_t y = element(slots, 4 * col + ((k & 7) >> 1), 4 + (k >> 3), k & 1);
      sum += static_cast<double>(half_bits(x, bf16)) * static_cast<double>(half_bits(y, bf16));
    }
    c[i] = static_cast<float>(sum);
  }
}

// ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16: each lane reads its row (16 bytes) and the warp
// shares them out, so every row is read at the instruction, as on the GPU.
inline void ldmatrix_x4(uint32_t r[4], const void* row, bool trans) {
  if (reinterpret_cast<uintptr_t>(row) % 16 != 0) fail("ldmatrix row address not 16-byte aligned");
  if (!in_smem(row, 16)) fail("ldmatrix row address outside dynamic shared memory");
  uint32_t words[4];
  std::memcpy(words, row, 16);
  const uint32_t* slots = exchange(words, 4, trans ? 4 : 3);
  const int lane = linear_tid() & 31;
  for (int i = 0; i < 4; ++i) {
    if (!trans) {  // row lane / 4 of matrix i, elements 2 (lane % 4) and the next: one word
      r[i] = slots[(8 * i + lane / 4) * kExchangeWords + lane % 4];
    } else {  // column lane / 4 of rows 2 (lane % 4) and the next
      const int e = lane / 4;
      const uint32_t lo = element(slots, 8 * i + 2 * (lane % 4), e / 2, e % 2);
      const uint32_t hi = element(slots, 8 * i + 2 * (lane % 4) + 1, e / 2, e % 2);
      r[i] = lo | (hi << 16);
    }
  }
}

// The emulation's one source of chance (xorshift32, seeded): thread order, when copies land, warps going on.
inline unsigned coin_flip() {
  static unsigned coin = 2463534242u;
  coin ^= coin << 13;
  coin ^= coin >> 17;
  coin ^= coin << 5;
  return coin;
}

// cp.async.cg.shared.global [dst], [src], 16, bytes (bytes 0: zero fill, src not read).
inline void cp_async(void* dst, const void* src, int bytes) {
  if (reinterpret_cast<uintptr_t>(dst) % 16 != 0 || (bytes && reinterpret_cast<uintptr_t>(src) % 16 != 0)) {
    fail("cp.async address not 16-byte aligned");
  }
  if (!in_smem(dst, 16)) fail("cp.async destination outside dynamic shared memory");
  // Half the copies land at once, half only at the wait that covers them: the earliest and the latest a
  // GPU may make them visible, so both a read before the wait and a refill before the last read of the
  // old bytes (a missing barrier) show up.
  if (coin_flip() & 1) {
    if (bytes) {
      std::memcpy(dst, src, 16);
    } else {
      std::memset(dst, 0, 16);
    }
    return;
  }
  S().cur->async_open.push_back({dst, src, bytes});
}

inline void cp_async_commit() {
  Thread& t = *S().cur;
  t.async_groups.push_back(std::move(t.async_open));
  t.async_open.clear();
}

inline void cp_async_wait(int pending) {
  Thread& t = *S().cur;
  while (static_cast<int>(t.async_groups.size()) > pending) {
    for (const AsyncCopy& c : t.async_groups.front()) {
      if (c.bytes) {
        std::memcpy(c.dst, c.src, 16);
      } else {
        std::memset(c.dst, 0, 16);
      }
    }
    t.async_groups.pop_front();
  }
}

inline cudaError_t get_device(int* device) {
  *device = 0;
  return cudaSuccess;
}

// The emulated device is an sm_90, or of the major version in $BATCHGEN_EMU_CC_MAJOR (read at each call).
inline cudaError_t device_attribute(int* value, cudaDeviceAttr attr, int) {
  const char* major = std::getenv("BATCHGEN_EMU_CC_MAJOR");
  *value = attr == cudaDevAttrComputeCapabilityMajor ? (major ? std::atoi(major) : 9) : 0;
  return cudaSuccess;
}

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

// Releases warp w's lanes when all 32 wait at a warp barrier; a warp barrier with exited lanes is an error.
inline bool release_warp_if_met(int w) {
  auto& s = S();
  int waiting = 0, done = 0;
  for (int l = 0; l < 32; ++l) {
    const Thread& t = s.threads[w * 32 + l];
    waiting += !t.done && t.blocked == 2;
    done += t.done;
  }
  if (waiting == 32) {
    for (int l = 0; l < 32; ++l) s.threads[w * 32 + l].blocked = 0;
    ++s.barriers;
    return true;
  }
  if (waiting > 0 && done > 0) fail("warp barrier with exited lanes");
  return false;
}

inline void run_block() {
  auto& s = S();
  const int n = s.block_dim.x * s.block_dim.y * s.block_dim.z;
  if (n % 32 != 0) fail("block size not a multiple of 32");
  s.threads.clear();
  s.threads.resize(n);
  s.warp_buf.assign(n, 0);
  s.exchange.assign(static_cast<size_t>(2) * n * kExchangeWords, 0);
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
    std::deque<int> queue(n);
    for (int i = 0; i < n; ++i) queue[i] = i;
    for (int i = n - 1; i > 0; --i) std::swap(queue[i], queue[coin_flip() % (i + 1)]);
    while (!queue.empty()) {
      const int i = queue.front();
      queue.pop_front();
      Thread& t = s.threads[i];
      if (t.done || t.blocked) continue;
      s.cur = &t;
      swapcontext(&s.main_ctx, &t.ctx);
      progress = true;
      // The last lane of a warp at a warp barrier: on a coin, the warp goes on at once, ahead of the threads
      // this pass has not run yet, as a warp on a GPU never waits for the others at a warp barrier; so shared
      // memory that another warp has not written yet (a missing __syncthreads) is read stale here too, even
      // by a warp-collective ldmatrix.
      if (t.blocked == 2 && (coin_flip() & 1) && release_warp_if_met(i / 32)) {
        const int lane0 = i / 32 * 32, first = static_cast<int>(coin_flip() % 32);
        for (int l = 31; l >= 0; --l) queue.push_front(lane0 + (first + l) % 32);
      }
    }
    // Warp barriers: all 32 lanes must wait on one.
    for (int w = 0; w < n / 32; ++w) progress |= release_warp_if_met(w);
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
#define BATCHGEN_CUDA_EMU 1
#define __syncthreads() emu::syncthreads()
#define __syncwarp(...) emu::syncwarp()
#define __shfl_xor_sync(mask, v, m) emu::shfl_xor(v, m)
#define __ffs(x) __builtin_ffs(x)  // 1 + the index of the lowest set bit, 0 for 0: CUDA's integer intrinsic
#define cudaGetLastError() cudaSuccess
#define cudaFuncSetAttribute(...) cudaSuccess
#define cudaGetDevice(device) emu::get_device(device)
#define cudaDeviceGetAttribute(value, attr, device) emu::device_attribute(value, attr, device)
