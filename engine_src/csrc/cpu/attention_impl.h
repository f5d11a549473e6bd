// The paged attention kernel, written once against a `Vec` of floats and compiled once per
// instruction set: kernels_<isa>.cpp defines BATCHGEN_ISA_NS, includes the matching vec_<isa>.h
// and then kernel_table_impl.h, which includes this file. Everything has internal linkage.
//
// A task (see AttnTask) copies its query rows to scratch memory and streams the K and V of its
// sequence in tiles of kTileKeys keys (one or more cache blocks of one kv head). Each tile serves
// groups of up to kGroupRows query rows at once (the heads sharing a kv head, and for prefill several
// tokens), so a task reads K/V from memory once. Softmax is online, in fp32: per row a running
// max m, a running sum l and an unnormalised accumulator acc, rescaled whenever the max grows.
// Its per-tile cost (reductions, the max's dependency chain, the accumulator's rescale) is why a
// tile spans 64 keys rather than one 16-token block: prefill 1.3x faster, decode from L2 1.25x;
// 128 keys gained nothing more.
//
// Batch invariance: a row's result is a function of its query, its position and its keys' K/V
// alone, bit for bit, whatever else the call holds. Every row takes the same path: tiles start at
// absolute key positions (multiples of kTileKeys), a score is one dot product in one order
// (tile_scores), the softmax step is per row, and a tile's values go into a fixed number of sums
// chosen by each key's index in the tile, so keys past a row's limit (read for other rows of its
// group) add exact zeros. Prefill and decode, chunked or not, alone or beside other sequences, from
// shared blocks or not, on any number of threads, give the same bits; the engine's seeded
// reproducibility rests on this (tests/test_attention_invariance.py).
#ifndef BATCHGEN_ISA_NS
#error "define BATCHGEN_ISA_NS before including attention_impl.h"
#endif

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "cpu/dtype.h"
#include "cpu/kernels.h"

namespace batchgen::cpu::BATCHGEN_ISA_NS {
namespace {

constexpr int kMaxTileBlocks = kTileKeys / 8;  // blocks of the smallest size in a tile
constexpr float kExpLow = -87.0f;  // exp below this counts as 0 (it is about 2^-125.5)
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int64_t kPrefetchBytes = 16384;  // how far ahead of its use K/V is prefetched
static_assert(kTileKeys % Vec::N == 0, "a tile's scores are whole vectors");
static_assert(kTileKeys % 32 == 0, "a tile holds whole blocks of every size (8, 16, 32)");

// bf16 caches use the processor's bf16 dot product where the Vec has one (BATCHGEN_DOT_BF16),
// on pairs of elements: for the scores the pairs are adjacent elements of q and k, whose bf16
// products are exact in fp32, so only the conversion of K is saved; for the values the pairs are
// the same element of two V rows, weighted by the two probabilities rounded to bf16 (as flash
// attention does on GPUs; the sums stay fp32), which halves the work. The queries then stay in
// bf16; otherwise they are converted to fp32 once per task.
#ifdef BATCHGEN_DOT_BF16
constexpr bool kHasDotBF16 = true;
#else
constexpr bool kHasDotBF16 = false;
#endif
template <typename T>
constexpr bool kPairs = kHasDotBF16 && std::is_same_v<T, BF16>;
template <typename T>
using PairsTag = std::bool_constant<kPairs<T>>;
template <typename T>
using QueryT = std::conditional_t<kPairs<T>, BF16, float>;

// bf16 caches on the amx_bf16 table take every path on the tile unit (attention_amx.h).
#ifdef BATCHGEN_AMX
template <typename T>
constexpr bool kTilePath = std::is_same_v<T, BF16>;
#else
template <typename T>
constexpr bool kTilePath = false;
#endif
struct AmxWork;

inline int64_t min_i64(int64_t a, int64_t b) { return a < b ? a : b; }

// exp(x) for x <= 0, relative error ~2e-7: exp(x) = 2^n * exp(r) with n = round(x / ln2) and
// |r| <= ln2 / 2, where a degree-6 Taylor polynomial is accurate to float precision. ln2 is
// split in two (Cody-Waite) so that x - n * ln2 stays exact.
inline Vec exp_nonpositive(Vec x) {
  const Vec clamped = max(x, Vec::set1(kExpLow));
  const Vec n = round_nearest(clamped * Vec::set1(1.44269504088896341f));
  Vec r = fma(n, Vec::set1(-0.693359375f), clamped);
  r = fma(n, Vec::set1(2.12194440e-4f), r);
  Vec p = Vec::set1(1.0f / 720.0f);
  p = fma(p, r, Vec::set1(1.0f / 120.0f));
  p = fma(p, r, Vec::set1(1.0f / 24.0f));
  p = fma(p, r, Vec::set1(1.0f / 6.0f));
  p = fma(p, r, Vec::set1(0.5f));
  p = fma(p, r, Vec::set1(1.0f));
  p = fma(p, r, Vec::set1(1.0f));
  return zero_if_below(scale_pow2(p, n), x, kExpLow);
}

// silu(g) = g * sigmoid(g) with exp only ever of -|g| (no overflow): sigmoid(g) = 1 / (1 + e) for g >= 0 and
// e / (1 + e) below, e = exp(-|g|).
inline Vec silu(Vec g) {
  const Vec e = exp_nonpositive(Vec::zero() - max(g, Vec::zero() - g));
  const Vec inv = Vec::set1(1.0f) / (Vec::set1(1.0f) + e);
  return g * blend_below(g, 0.0f, e * inv, inv);
}

// tanh(x), relative error ~2e-7, for the soft cap of the scores. Below |x| = 0.55 an odd
// polynomial x + x^3 P(x^2), P a least-squares fit of (tanh(x) - x) / x^3 on [0, 0.55] weighted for
// relative error (~6e-8 evaluated in float32); from there (1 - e) / (1 + e) with e = exp(-2|x|),
// where e <= 0.34 leaves no cancellation. Lanes holding NaN give NaN or anything: such scores
// (K rows past a sequence's end) are masked afterwards.
inline Vec tanh_vec(Vec x) {
  const Vec a = max(x, Vec::zero() - x);
  const Vec z = a * a;
  Vec p = Vec::set1(-0.006356495898216963f);
  p = fma(p, z, Vec::set1(0.021127240732312202f));
  p = fma(p, z, Vec::set1(-0.05386507883667946f));
  p = fma(p, z, Vec::set1(0.13332699239253998f));
  p = fma(p, z, Vec::set1(-0.33333319425582886f));
  const Vec small = fma(a * z, p, a);
  const Vec one = Vec::set1(1.0f);
  const Vec e = exp_nonpositive(a * Vec::set1(-2.0f));
  const Vec t = blend_below(a, 0.55f, small, (one - e) / (one + e));
  return blend_below(x, 0.0f, Vec::zero() - t, t);
}

// The query (and out) head of the task's row r: rows run over kv heads, then tokens, then the
// heads sharing a kv head (see AttnTask).
struct RowIndex {
  int64_t token;
  int64_t head;
};
inline RowIndex row_index(const AttnTask& task, int group, int64_t r) {
  const int64_t per_kv_head = task.q_count * group;
  const int64_t h = r / per_kv_head, within = r % per_kv_head;
  return {task.q_begin + within / group, (task.kv_head + h) * group + within % group};
}

// Copies the task's query rows to q, D elements each.
template <typename T>
void load_queries(const AttnArgs& a, const AttnTask& task, int group, QueryT<T>* q) {
  const int D = a.head_dim;
  const int64_t count = task.kv_head_count * task.q_count * group;
  for (int64_t r = 0; r < count; ++r) {
    const RowIndex at = row_index(task, group, r);
    const T* src = static_cast<const T*>(a.query) + at.token * a.query_token_stride + at.head * a.query_head_stride;
    QueryT<T>* dst = q + r * D;
    if constexpr (kPairs<T>) {  // as 32-bit words, in vectors: not a memcpy call for each 128-byte row
      const float* from = reinterpret_cast<const float*>(src);
      float* to = reinterpret_cast<float*>(dst);
      int i = 0;
      for (; i + Vec::N <= D / 2; i += Vec::N) Vec::load(from + i).store(to + i);
      for (; i < D / 2; ++i) to[i] = from[i];
    } else {
      for (int i = 0; i < D; i += Vec::N) Vec::load(src + i).store(dst + i);
    }
  }
}

// Walks the next tile's bytes a few cache lines at a time, interleaved with the work on the
// current tile. Block ids are scattered, so the hardware prefetcher cannot guess where the next
// tile starts; prefetching a whole tile at once instead (more requests than the core can keep
// in flight) measured 1.5x slower than this steady trickle. The lines go to L2 (hint T1), not L1:
// on a Zen 4 VM decode over cold K/V read 17.6-24 GB/s against 10.6-18 with T0 (interleaved runs),
// "mixed"'s decode attention 3-7% faster; on the AMX Xeon T1 and T2 gained nothing.
struct Prefetcher {
  const char* next = nullptr;
  const char* end = nullptr;

  void lines(int count) {
    for (; count > 0 && next < end; --count, next += 64) __builtin_prefetch(next, 0, 2);
  }
};

// fp8 caches (AttnArgs::kv_format): the plain score and value loops (tile_scores and values_chunks, on
// every table for float32 and fp16 activations, and for bf16 ones where the Vec has no bf16 dot product)
// read the fp8 bytes themselves and convert them in registers (a tile of Fp8 elements, CachedLoad), and so
// does the bf16 pair path where it does not transpose K (Fp8Pairs). The paths that need the tile in memory
// as T (the transposed K, the tile unit) widen each tile into scratch memory first (widen_fp8) and then run
// as on any cache of T. Both formats convert to float32, bf16 and fp16 exactly and every way gives the same
// floats, so the bits are those of a cache of T holding the same values; the scales are applied outside (the
// scores' scale, the output's normalisation). On the Zen 2 the widening pass cost more than the fp8 bytes saved
// (16-bit decode 1.5x slower than over a 16-bit cache, scripts/PERF.md), hence the loops that read fp8 directly.

// An fp8 cache's element, as the element type of a tile that the plain loops read without widening.
struct Fp8 {
  uint8_t bits;
};

// An fp8 cache's element as the bf16 pair path reads it where it does not transpose K (decode, and any task
// of at most kGroupRows rows a kv head): each step's bytes converted to bf16 in registers (BytesToBF16), the
// same values a widened tile holds, so the same bits, without writing the tile to memory and reading it back.
// With attend_tile out of line, decode on Zen 4 (bench_kv_fp8.py --decode, scripts/PERF.md): one layer of 64 x
// 1,024 tokens 1.47-1.51 -> 1.20-1.23 ms, 30 layers' caches in turn 0.63-0.69 -> 0.55-0.60 ms a layer.
struct Fp8Pairs {
  uint8_t bits;
};

// Vec::N cached elements of type S as floats: a cache of T's as Vec::load reads them, an fp8 cache's
// converted in registers. The fp8 bytes go through fp16 bits, where e5m2 is fp16's top byte, and e4m3's
// bits shifted into fp16's place read as the value times 2^-8 (subnormals too), which the multiply by 256
// (`unbias`) undoes: exact. e4m3's NaN (0x7f, never written by reshape_and_cache) reads 480.
// value() leaves the multiply out: the values loop takes its elements divided by `unbias` and its
// probabilities times `unbias` (scale_probabilities), the same products exactly (p <= 1, unbias a power of
// two), one multiply a probability instead of one an element (single-thread e4m3 decode on Zen 2 7.1-7.2 ->
// 6.5-6.9 ms). The scores keep the multiply: folded into the queries instead (q * 256), a query element
// beyond 2^120 would overflow where its product with the widened key does not.
template <typename S>
struct CachedLoad {
  static constexpr float unbias = 1.0f;
  static constexpr int kRegisters = 0;  // vector registers its conversion keeps (see kTokenStep)

  explicit CachedLoad(KVFormat) {}
  Vec operator()(const S* p) const { return Vec::load(p); }
  Vec value(const S* p) const { return Vec::load(p); }
#ifdef BATCHGEN_DOT_BF16
  // The pair path's operands (S = BF16): `count` elements at p; rows a and b (zeros where b is null)
  // interleaved, kPairChunk elements.
  BF16Pairs pairs(const S* p, int count) const { return BF16Pairs::load(p, count); }
  void interleaved(const S* a, const S* b, BF16Pairs& lo, BF16Pairs& hi) const {
    const BF16Pairs x = BF16Pairs::load(a, 2 * Vec::N);
    const BF16Pairs y = b != nullptr ? BF16Pairs::load(b, 2 * Vec::N) : BF16Pairs::zero();
    lo = interleave_lo(x, y);
    hi = interleave_hi(x, y);
  }
#endif
};

template <>
struct CachedLoad<Fp8> {
  static constexpr int kRegisters = 3;  // the mask, the shift count, unbias_vec
  int shift;
  float unbias;
  Vec unbias_vec;

  explicit CachedLoad(KVFormat f)
      : shift(f == KVFormat::fp8_e5m2 ? 8 : 7),
        unbias(f == KVFormat::fp8_e5m2 ? 1.0f : 256.0f),
        unbias_vec(Vec::set1(unbias)) {}
  Vec operator()(const Fp8* p) const { return value(p) * unbias_vec; }
  Vec value(const Fp8* p) const { return Vec::load_fp8_as_half(&p->bits, shift); }
};

// Whether T's plain loops read an fp8 cache's bytes in registers (else the tile is widened first, or read as
// Fp8Pairs by the pair path).
template <typename T>
constexpr bool kFp8InRegisters = !kPairs<T> && !kTilePath<T>;

// n fp8 bytes (a multiple of Vec::N) as T, exactly, with CachedLoad's conversion.
template <typename T>
void widen_fp8_through_float(const uint8_t* src, T* dst, int64_t n, KVFormat f) {
  const CachedLoad<Fp8> load(f);
  alignas(64) float wide[Vec::N];
  for (int64_t i = 0; i < n; i += Vec::N) {
    const Vec x = load(reinterpret_cast<const Fp8*>(src + i));
    if constexpr (std::is_same_v<T, BF16>) {  // bf16 holds the value: its float's top half
      x.store(wide);
      for (int j = 0; j < Vec::N; ++j) dst[i + j].bits = static_cast<uint16_t>(float_bits(wide[j]) >> 16);
    } else {
      x.store(dst + i);
    }
  }
}

#ifdef BATCHGEN_DOT_BF16
// The table conversion of format f's bytes to bf16 (BytesToBF16), made once per format from what
// widen_fp8_through_float makes of the 128 magnitudes, so the two give the same bits for every byte (NaNs too).
inline const BytesToBF16& bytes_to_bf16(KVFormat f) {
  auto make = [](KVFormat format) {
    alignas(64) uint8_t bytes[128];
    BF16 wide[128];
    for (int b = 0; b < 128; ++b) bytes[b] = static_cast<uint8_t>(b);
    widen_fp8_through_float(bytes, wide, 128, format);
    return BytesToBF16(wide);
  };
  static const BytesToBF16 e4m3 = make(KVFormat::fp8_e4m3), e5m2 = make(KVFormat::fp8_e5m2);
  return f == KVFormat::fp8_e5m2 ? e5m2 : e4m3;
}

template <>
struct CachedLoad<Fp8Pairs> {
  static constexpr float unbias = 1.0f;  // the exact values: no scaled probabilities
  static constexpr int kRegisters = BytesToBF16::kRegisters;
  BytesToBF16 to_bf16;

  explicit CachedLoad(KVFormat f) : to_bf16(bytes_to_bf16(f)) {}
  BF16Pairs pairs(const Fp8Pairs* p, int count) const { return to_bf16.pairs(&p->bits, count); }
  void interleaved(const Fp8Pairs* a, const Fp8Pairs* b, BF16Pairs& lo, BF16Pairs& hi) const {
    to_bf16.interleaved(&a->bits, b != nullptr ? &b->bits : nullptr, lo, hi);
  }
  Vec value(const Fp8Pairs* p) const { return first_floats(to_bf16.pairs(&p->bits, Vec::N)); }
};

// Whether T's tasks read an fp8 cache as Fp8Pairs where they do not transpose K.
template <typename T>
constexpr bool kFp8Pairs = kPairs<T> && !kTilePath<T>;
#else
template <typename T>
constexpr bool kFp8Pairs = false;
#endif

// n fp8 bytes (a multiple of Vec::N) as T, exactly: bf16 by table where the kernel table has the bf16 dot
// product, else through float32. Both give the same bits.
template <typename T>
void widen_fp8(const uint8_t* src, T* dst, int64_t n, KVFormat f) {
#ifdef BATCHGEN_DOT_BF16
  if constexpr (std::is_same_v<T, BF16>) {
    const int64_t whole = n / 32 * 32;
    bytes_to_bf16(f)(src, dst, whole);
    src += whole, dst += whole, n -= whole;
  }
#endif
  widen_fp8_through_float(src, dst, n, f);
}

// The K and V of one (block, kv head), and prefetchers for those of a block ahead.
template <typename T>
struct BlockKV {
  const T* k;
  const T* v;
  Prefetcher next_k;
  Prefetcher next_v;
};

// The blocks of one tile: keys b * BS .. (b + 1) * BS - 1 of the tile are block[b]'s rows, of elements S
// (T, or Fp8 read by the plain loops), which `load` reads as floats.
template <typename S>
struct Tile {
  BlockKV<S> block[kMaxTileBlocks];
  int count;
  CachedLoad<S> load;

  explicit Tile(KVFormat f) : load(f) {}
};

inline int lines_for(int64_t bytes) { return static_cast<int>((bytes + 63) / 64); }

// Whether `held` vectors fit in the vector registers beside S's conversion constants.
template <typename S>
constexpr bool fits_registers(int held) {
  return held + CachedLoad<S>::kRegisters <= Vec::kRegisters;
}

// Tokens handled side by side by the plain tile_scores: the most of 8, 4 and 2 (each divides every block
// size) whose accumulators (TS * NG), query vectors (NG) and key vector fit in the registers. Each
// query load then serves TS tokens, and NG * TS independent FMA chains hide the FMA latency. SmolLM2's
// decode (NG = 3) on AVX2 went from 2 tokens to 4 (scripts/PERF.md). A score's own sum is one chain
// whatever the step, so a row's scores depend on neither TS nor NG.
template <typename S, int NG>
constexpr int kTokenStep = fits_registers<S>(8 * NG + NG + 1) ? 8 : fits_registers<S>(4 * NG + NG + 1) ? 4 : 2;

// The bf16 pair path's step: its x vectors are all loaded before the rows', so TS of them, TS * NG
// accumulators and a query pair must fit. 4 tokens for every row group (NG <= kGroupRows); SmolLM2's decode
// (NG = 3) took 2 before, ~8% slower on Zen 4 (scripts/PERF.md).
constexpr int kPairTokenStep = 4;
#ifdef BATCHGEN_DOT_BF16
static_assert(fits_registers<BF16>(4 * kGroupRows + 4 + 1) && fits_registers<Fp8Pairs>(4 * kGroupRows + 4 + 1),
              "the pair path's step fits the registers");
#endif

// Sums acc[i][g] into s[g][t + i] (tokens t .. t + TS - 1, rows 0 .. NG - 1). Forced inline: as
// a call it would take the accumulators through memory (GCC keeps it out of line otherwise).
template <int TS, int NG>
__attribute__((always_inline)) inline void store_scores(const Vec (&acc)[TS][NG], int t, float* s) {
  if constexpr (TS % 4 == 0) {
    for (int g = 0; g < NG; ++g) {
      for (int i = 0; i < TS; i += 4) {
        float* row = s + g * kTileKeys + t + i;
        reduce_add4(acc[i][g], acc[i + 1][g], acc[i + 2][g], acc[i + 3][g], row, row + 2);
      }
    }
  } else {
    static_assert(TS == 2, "token steps of 2 or a multiple of 4");
    for (int g = 0; g < NG; g += 2) {
      float unused[2];
      const bool pair = g + 1 < NG;
      reduce_add4(acc[0][g], acc[1][g], pair ? acc[0][g + 1] : Vec::zero(), pair ? acc[1][g + 1] : Vec::zero(),
                  s + g * kTileKeys + t, pair ? s + (g + 1) * kTileKeys + t : unused);
    }
  }
}

// s[g][t] = q_g . k_t for the first n rows of a block's K, n rounded up to kTokenStep (rows that
// exist in the block; their scores are masked later). Each q load serves kTokenStep tokens.
// Forced inline, as are the other score and value loops: once the variants had grown the walk, GCC
// kept them out of line, a call per block (decode of 256 x 128-token sequences ~5% slower).
// `load` is taken by value: a local copy stays in registers, where the tile's own may be reloaded after
// each store of scores (a vector type may alias a float).
template <typename S, int NG>
__attribute__((always_inline)) inline void tile_scores(std::false_type /*pairs*/, const float* q, BlockKV<S>& tile,
                                                       const CachedLoad<S> load, int D, int n, float* s) {
  constexpr int TS = kTokenStep<S, NG>;
  // The next block's K goes out TS tokens' worth a step, spread over the step's chunks (a burst of 16
  // lines at the step's start made cold float32 decode ~10% slower on Zen 2).
  const int prefetch = lines_for(int64_t{TS} * Vec::N * sizeof(S));  // per chunk
  const S* k = tile.k;
  for (int t = 0; t < n; t += TS, k += TS * D) {
    Vec acc[TS][NG];
    for (int i = 0; i < TS; ++i)
      for (int g = 0; g < NG; ++g) acc[i][g] = Vec::zero();
    for (int c = 0; c < D; c += Vec::N) {
      tile.next_k.lines(prefetch);
      Vec qg[NG];
      for (int g = 0; g < NG; ++g) qg[g] = Vec::load(q + g * D + c);
      for (int i = 0; i < TS; ++i) {
        const Vec x = load(k + i * D + c);
        for (int g = 0; g < NG; ++g) acc[i][g] = fma(qg[g], x, acc[i][g]);
      }
    }
    store_scores<TS, NG>(acc, t, s);
  }
}

#ifdef BATCHGEN_DOT_BF16
// tile_scores with bf16 dot products on pairs of elements: D is a multiple of 16, so the last
// step of 2 * Vec::N elements may be a half one.
template <typename S, int NG>
__attribute__((always_inline)) inline void tile_scores(std::true_type /*pairs*/, const BF16* q, BlockKV<S>& tile,
                                                       const CachedLoad<S> load, int D, int n, float* s) {
  constexpr int TS = kPairTokenStep;
  const S* k = tile.k;
  const int prefetch = lines_for(int64_t{TS} * D * sizeof(S));
  for (int t = 0; t < n; t += TS) {
    tile.next_k.lines(prefetch);
    Vec acc[TS][NG];
    for (int i = 0; i < TS; ++i)
      for (int g = 0; g < NG; ++g) acc[i][g] = Vec::zero();
    for (int c = 0; c < D; c += 2 * Vec::N) {
      const int count = D - c < 2 * Vec::N ? D - c : 2 * Vec::N;
      BF16Pairs x[TS];
      for (int i = 0; i < TS; ++i) x[i] = load.pairs(k + (t + i) * D + c, count);
      for (int g = 0; g < NG; ++g) {
        const BF16Pairs qg = BF16Pairs::load(q + g * D + c, count);
        for (int i = 0; i < TS; ++i) acc[i][g] = dot_pairs(qg, x[i], acc[i][g]);
      }
    }
    store_scores<TS, NG>(acc, t, s);
  }
}

#endif

#ifdef BATCHGEN_DOT_BF16
// Prefill tiles serve several row groups, which pays for transposing their K once into pairs:
// kt[j * kTileKeys + t] holds elements 2j, 2j + 1 of key t, so one vector holds pair j of 16 keys
// and the scores need no horizontal sums. Blocks must be whole 16-key and head_dim whole
// 32-element pieces.
inline bool can_transpose_keys(int D, int BS) { return D % 32 == 0 && BS % 16 == 0; }

template <typename T>
void transpose_keys(Tile<T>& tile, int D, int BS, uint32_t* kt) {
  const int W = D / 2;  // pairs per key
  const int lines = lines_for(int64_t{BS} * D * sizeof(BF16));
  for (int b = 0; b < tile.count; ++b) {
    if (tile.block[b].k == nullptr) continue;  // before the task's sliding window: not read
    tile.block[b].next_k.lines(lines);
    const uint32_t* k = reinterpret_cast<const uint32_t*>(tile.block[b].k);
    for (int t = 0; t < BS; t += 16)
      for (int j = 0; j < W; j += 16) transpose16x16(k + t * W + j, W, kt + j * kTileKeys + b * BS + t, kTileKeys);
  }
}

// The scores of a transposed tile, bit for bit those of tile_scores (batch invariance): there, lane l
// of a row's accumulator sums the pairs l, l + 16, ... of q and k (one dot product each, in that
// order), and reduce_add4 adds the 16 lanes in a fixed tree: z_e = (a_e + a_8+e) + (a_4+e + a_12+e),
// then (z_0 + z_2) + (z_1 + z_3). Here a "leaf" is lane l's sum for 16 keys at once (key per lane),
// and the leaves go through the same tree as whole vectors: 15 additions per 16 keys instead of
// horizontal sums per key.
static_assert(Vec::N == 16, "the tree below is vec_avx512.h's reduce_add4");

// leaf[g][c] = lane l's sum for row g and the 16 keys of chunk c0 + c.
template <int NG, int KC>
__attribute__((always_inline)) inline void score_leaves(const BF16* q, const uint32_t* kt, int D, int c0, int l,
                                                        Vec (&leaf)[NG][KC]) {
  for (int g = 0; g < NG; ++g)
    for (int c = 0; c < KC; ++c) leaf[g][c] = Vec::zero();
  for (int j = l; j < D / 2; j += Vec::N) {
    BF16Pairs k[KC];
    for (int c = 0; c < KC; ++c) {
      k[c] = BF16Pairs::load(reinterpret_cast<const BF16*>(kt + j * kTileKeys + (c0 + c) * 16), 32);
    }
    for (int g = 0; g < NG; ++g) {
      const BF16Pairs w = BF16Pairs::broadcast_pair(q + g * D + 2 * j);
      for (int c = 0; c < KC; ++c) leaf[g][c] = dot_pairs(k[c], w, leaf[g][c]);
    }
  }
}

// z[g][c] = (leaf e + leaf 8 + e) + (leaf 4 + e + leaf 12 + e).
template <int NG, int KC>
__attribute__((always_inline)) inline void score_quad(const BF16* q, const uint32_t* kt, int D, int c0, int e,
                                                      Vec (&z)[NG][KC]) {
  Vec a[NG][KC], b[NG][KC];
  score_leaves<NG, KC>(q, kt, D, c0, e, a);
  score_leaves<NG, KC>(q, kt, D, c0, 8 + e, b);
  for (int g = 0; g < NG; ++g)
    for (int c = 0; c < KC; ++c) z[g][c] = a[g][c] + b[g][c];
  score_leaves<NG, KC>(q, kt, D, c0, 4 + e, a);
  score_leaves<NG, KC>(q, kt, D, c0, 12 + e, b);
  for (int g = 0; g < NG; ++g)
    for (int c = 0; c < KC; ++c) z[g][c] = z[g][c] + (a[g][c] + b[g][c]);
}

// s[g][t] = q_g . k_t for keys t in [16 * c0, 16 * (c0 + KC)) of a transposed tile.
template <int NG, int KC>
__attribute__((always_inline)) inline void scores_transposed(const BF16* q, const uint32_t* kt, int D, int c0,
                                                             float* s) {
  Vec half[NG][KC], z[NG][KC];
  score_quad<NG, KC>(q, kt, D, c0, 0, half);
  score_quad<NG, KC>(q, kt, D, c0, 2, z);
  for (int g = 0; g < NG; ++g)
    for (int c = 0; c < KC; ++c) half[g][c] = half[g][c] + z[g][c];  // w_0 = z_0 + z_2
  Vec other[NG][KC];
  score_quad<NG, KC>(q, kt, D, c0, 1, other);
  score_quad<NG, KC>(q, kt, D, c0, 3, z);
  for (int g = 0; g < NG; ++g)
    for (int c = 0; c < KC; ++c) (half[g][c] + (other[g][c] + z[g][c])).store(s + g * kTileKeys + (c0 + c) * 16);
}

// The scores of keys [first, n) (first a multiple of 16, n rounded up to 16) of a transposed tile, 16 keys
// at a time: few live vectors per row, so NG rows stay in registers.
template <int NG>
__attribute__((always_inline)) inline void scores_transposed(const BF16* q, const uint32_t* kt, int D, int first,
                                                             int n, float* s) {
  for (int c0 = first / 16; c0 * 16 < n; ++c0) scores_transposed<NG, 1>(q, kt, D, c0, s);
}
#endif

// What masks a tile's scores from key `limit` on, in registers (storing -inf over the scores and loading
// them again became a memcpy call per row): the scores from the limit on are zeroed (they may be NaN, from
// K rows past a sequence's end) where -t + limit - 0.5 < 0, then kKeyMask.add + kTileKeys - limit is
// added, 0 before the key and -inf from it.
struct KeyMask {
  float minus_index[kTileKeys];
  float add[2 * kTileKeys];
  constexpr KeyMask() : minus_index(), add() {
    for (int t = 0; t < kTileKeys; ++t) minus_index[t] = static_cast<float>(-t);
    for (int i = kTileKeys; i < 2 * kTileKeys; ++i) add[i] = kNegInf;
  }
};
constexpr KeyMask kKeyMask{};

// Online softmax step of rows 0 .. NG - 1 of a row group over one tile, row g's scores at
// s + g * kTileKeys: scales the raw scores, masks those at and past limit[g], updates m[g] and l[g],
// leaves the tile's probabilities exp(s - m) in s and sets correction[g], the factor by which the
// row's accumulator must be rescaled. `width` is the number of scores to touch, a multiple of
// Vec::N. The rows go through each phase together and the scaled scores stay in registers: one
// row's max and sum are chains of dependent reductions, and rows side by side overlap them (taken
// one row at a time, the step was 30% of prefill attention). The rescale factors are one vector exp.
template <int NG>
__attribute__((always_inline)) inline void softmax_rows(float* s, const int* limit, int width, float scale, float* m,
                                                        float* l, float* correction) {
  constexpr int kMaxVecs = kTileKeys / Vec::N;
  constexpr int kLanes = (NG + Vec::N - 1) / Vec::N * Vec::N;
  const int vecs = width / Vec::N;
  const Vec vscale = Vec::set1(scale);
  Vec x[NG][kMaxVecs];
  float m_new[NG];
  float delta[kLanes] = {};  // m - m_new, 0 where m stays (also in rows that see none of the tile)
  for (int g = 0; g < NG; ++g) {
    float* row = s + g * kTileKeys;
    m_new[g] = m[g];
    if (limit[g] <= 0) continue;  // this row sees none of the tile (causal prefill)
    for (int i = 0; i < vecs; ++i) x[g][i] = Vec::load(row + i * Vec::N) * vscale;
    if (limit[g] < width) {  // the last tile of a row: -inf from the key at limit on
      const Vec before = Vec::set1(static_cast<float>(limit[g]) - 0.5f);  // limit - t > 0 before the limit
      const float* infinities = kKeyMask.add + kTileKeys - limit[g];
      for (int i = 0; i < vecs; ++i) {
        const Vec ahead = Vec::load(kKeyMask.minus_index + i * Vec::N) + before;
        x[g][i] = zero_if_below(x[g][i], ahead, 0.0f) + Vec::load(infinities + i * Vec::N);
      }
    }
    // From -inf, which max(-inf, x) turns into x exactly (a NaN too): starting from x[g][0], GCC warned that
    // it might be read unset.
    Vec vmax = Vec::set1(kNegInf);
    for (int i = 0; i < vecs; ++i) vmax = max(vmax, x[g][i]);
    const float tile_max = reduce_max(vmax);
    if (tile_max > m[g]) {
      m_new[g] = tile_max;
      delta[g] = m[g] - tile_max;  // -inf on the first tile: the factor is 0
    }
  }
  float factor[kLanes];
  for (int i = 0; i < kLanes; i += Vec::N) exp_nonpositive(Vec::load(delta + i)).store(factor + i);
  for (int g = 0; g < NG; ++g) {
    float* row = s + g * kTileKeys;
    correction[g] = factor[g];
    if (limit[g] <= 0) {
      for (int t = 0; t < width; ++t) row[t] = 0.0f;
      continue;
    }
    const Vec shift = Vec::set1(-m_new[g]);
    Vec sum = Vec::zero();
    for (int i = 0; i < vecs; ++i) {
      const Vec p = exp_nonpositive(x[g][i] + shift);
      p.store(row + i * Vec::N);
      sum = sum + p;
    }
    l[g] = l[g] * factor[g] + reduce_add(sum);
    m[g] = m_new[g];
  }
}

// A tile's values are summed in kValueChains independent chains (enough to hide the FMA latency),
// key t of the tile into chain t % kValueChains, then the chains in order: the same sums for a row
// whatever the rows beside it, the block size (a multiple of kValueChains) or how many keys its
// group reads (those past the row's limit have p = 0 and add exact zeros).
constexpr int kValueChains = 2;
constexpr int kPairChains = 1;  // on the bf16 pair path, chains of key pairs (the rows give the ILP)
static_assert(8 % kValueChains == 0 && 8 % (2 * kPairChains) == 0, "blocks hold whole steps of the chains");

// Output chunks of Vec::N elements summed side by side by values_chunks: the most of 4, 2 and 1 whose
// accumulators (kValueChains * NG * CW), V vectors (CW) and broadcast probability fit in the registers.
// Each broadcast then serves CW chunks and kValueChains * NG * CW chains hide the FMA latency: SmolLM2's
// decode (NG = 3) on AVX2 went from 1 chunk to 2 (scripts/PERF.md). A chunk's sums are the same whatever CW.
template <typename S, int NG>
constexpr int kValueChunks = fits_registers<S>(kValueChains * NG * 4 + 4 + 1)   ? 4
                             : fits_registers<S>(kValueChains * NG * 2 + 2 + 1) ? 2
                                                                                 : 1;

// acc_g[c, c + CW N) = acc_g[c, c + CW N) * correction_g + sum_{t < n} p[g][t] * v_t[c, c + CW N): the
// accumulators of CW output chunks stay in registers, one per (row, chain, chunk), across the tile's
// blocks. `prefetch` lines of each block's next V go out per step of kValueChains keys.
template <typename S, int NG, int CW>
__attribute__((always_inline)) inline
void values_chunks(const float* p, const float* correction, Tile<S>& tile, int D, int BS, int fb, int n, int c,
                   int prefetch, float* acc) {
  constexpr int C = kValueChains;
  constexpr int N = Vec::N;
  const CachedLoad<S> load = tile.load;  // in registers (see tile_scores)
  Vec sum[C][NG][CW];
  for (int g = 0; g < NG; ++g) {
    const Vec correct = Vec::set1(correction[g]);
    for (int w = 0; w < CW; ++w) {
      sum[0][g][w] = Vec::load(acc + g * D + c + w * N) * correct;
      for (int i = 1; i < C; ++i) sum[i][g][w] = Vec::zero();
    }
  }
  // Key `row` (its V from element c on) into chain i, with probabilities pt[g * kTileKeys].
  auto add_key = [&](int i, const S* row, const float* pt) {
    Vec x[CW];
    for (int w = 0; w < CW; ++w) x[w] = load.value(row + w * N);  // p is scaled to match (scale_probabilities)
    for (int g = 0; g < NG; ++g) {
      const Vec pg = Vec::set1(pt[g * kTileKeys]);
      for (int w = 0; w < CW; ++w) sum[i][g][w] = fma(pg, x[w], sum[i][g][w]);
    }
  };
  for (int b = fb; b * BS < n; ++b) {
    Prefetcher& next = tile.block[b].next_v;
    const S* v = tile.block[b].v + c;
    const float* pb = p + b * BS;
    const int nb = min_i64(BS, n - b * BS);
    int t = 0;
    for (; t + C <= nb; t += C, v += C * D, pb += C) {
      next.lines(prefetch);
      for (int i = 0; i < C; ++i) add_key(i, v + i * D, pb + i);
    }
    for (int i = 0; i < C - 1; ++i)  // t is a multiple of C: key t + i goes to chain i
      if (t + i < nb) add_key(i, v + i * D, pb + i);
  }
  for (int g = 0; g < NG; ++g) {
    for (int w = 0; w < CW; ++w) {
      Vec total = sum[0][g][w];
      for (int i = 1; i < C; ++i) total = total + sum[i][g][w];
      total.store(acc + g * D + c + w * N);
    }
  }
}

// p[g][t] *= unbias for the NG rows of a row group and t < width (exact: 0 <= p <= 1, unbias a power of two),
// for the values loop over fp8 V read without it (CachedLoad::value).
template <int NG>
__attribute__((always_inline)) inline void scale_probabilities(float* p, int width, float unbias) {
  const Vec u = Vec::set1(unbias);
  for (int g = 0; g < NG; ++g)
    for (int t = 0; t < width; t += Vec::N) (Vec::load(p + g * kTileKeys + t) * u).store(p + g * kTileKeys + t);
}

// acc_g = acc_g * correction_g + sum_{t < n} p[g][t] * v_t for the NG rows of a row group. The blocks
// before block fb hold no key the group sees (p = 0 there) and are not read.
template <typename S, int NG>
__attribute__((always_inline)) inline
void tile_values(std::false_type /*pairs*/, const float* p, const float* correction, Tile<S>& tile, int D, int BS,
                 int fb, int n, float* acc) {
  constexpr int CW = kValueChunks<S, NG>;
  // A block's bytes per chunk, spread over its steps of kValueChains keys (see tile_scores).
  const int prefetch = lines_for(int64_t{kValueChains} * Vec::N * sizeof(S));
  int c = 0;
  for (; c + CW * Vec::N <= D; c += CW * Vec::N)
    values_chunks<S, NG, CW>(p, correction, tile, D, BS, fb, n, c, CW * prefetch, acc);
  for (; c < D; c += Vec::N) values_chunks<S, NG, 1>(p, correction, tile, D, BS, fb, n, c, prefetch, acc);
}

#ifdef BATCHGEN_DOT_BF16
constexpr int kPairChunk = 2 * Vec::N;  // elements of an output chunk on the pair path

// tile_values on bf16 pairs: V rows t and t + 1 interleaved element by element, times the pair
// (p_t, p_t+1) in bf16. The interleave works within 128-bit lanes, so the accumulators hold
// each kPairChunk chunk permuted (see unpermute_pairs); a last half chunk (head_dim 80) goes
// through values_chunks, in order. Pair j of the tile (keys 2j, 2j + 1) goes into chain j % TP,
// whatever the rows (as in values_chunks).
template <typename S, int NG>
__attribute__((always_inline)) inline
void tile_values(std::true_type /*pairs*/, const float* p, const float* correction, Tile<S>& tile, int D, int BS,
                 int fb, int n, float* acc) {
  constexpr int TP = kPairChains;
  const CachedLoad<S> load = tile.load;  // in registers (see tile_scores)
  BF16 pb[NG][kTileKeys];           // p in bf16; zero past each row's limit, as p is
  const int width = (n + Vec::N - 1) / Vec::N * Vec::N;
  for (int g = 0; g < NG; ++g)
    for (int c = 0; c < width; c += Vec::N) store_bf16(Vec::load(p + g * kTileKeys + c), pb[g] + c);
  const int prefetch = lines_for(int64_t{BS} * kPairChunk * sizeof(S));
  int c = 0;
  for (; c + kPairChunk <= D; c += kPairChunk) {
    Vec lo[TP][NG], hi[TP][NG];
    for (int g = 0; g < NG; ++g) {
      lo[0][g] = Vec::load(acc + g * D + c) * Vec::set1(correction[g]);
      hi[0][g] = Vec::load(acc + g * D + c + Vec::N) * Vec::set1(correction[g]);
      for (int i = 1; i < TP; ++i) lo[i][g] = hi[i][g] = Vec::zero();
    }
    for (int b = fb; b * BS < n; ++b) {
      tile.block[b].next_v.lines(prefetch);
      const S* v = tile.block[b].v;
      const int first = b * BS, nb = min_i64(BS, n - first);
      // One step: rows t, t + 1 of the block (the second as zeros when t + 1 == nb: V past n may be NaN).
      auto step = [&](int i, int t) {
        BF16Pairs x_lo, x_hi;
        load.interleaved(v + t * D + c, t + 1 < nb ? v + (t + 1) * D + c : nullptr, x_lo, x_hi);
        for (int g = 0; g < NG; ++g) {
          const BF16Pairs w = BF16Pairs::broadcast_pair(pb[g] + first + t);
          lo[i][g] = dot_pairs(x_lo, w, lo[i][g]);
          hi[i][g] = dot_pairs(x_hi, w, hi[i][g]);
        }
      };
      int t = 0;
      for (; t + 2 * TP <= nb; t += 2 * TP)
        for (int i = 0; i < TP; ++i) step(i, t + 2 * i);
      for (int i = 0; i < TP; ++i)  // t is a multiple of 2 * TP: pair t + 2i goes to chain i
        if (t + 2 * i < nb) step(i, t + 2 * i);
    }
    for (int g = 0; g < NG; ++g) {
      Vec total_lo = lo[0][g], total_hi = hi[0][g];
      for (int i = 1; i < TP; ++i) {
        total_lo = total_lo + lo[i][g];
        total_hi = total_hi + hi[i][g];
      }
      total_lo.store(acc + g * D + c);
      total_hi.store(acc + g * D + c + Vec::N);
    }
  }
  if (c < D) values_chunks<S, NG, 1>(p, correction, tile, D, BS, fb, n, c, 0, acc);
}

// Restores the order of a row accumulated by the pair path (see unpermute_chunk).
inline void unpermute_pairs(float* row, int D) {
  for (int c = 0; c + kPairChunk <= D; c += kPairChunk) {
    Vec lo = Vec::load(row + c), hi = Vec::load(row + c + Vec::N);
    unpermute_chunk(lo, hi);
    lo.store(row + c);
    hi.store(row + c + Vec::N);
  }
}
#endif

// The per-row state of a task, in its scratch memory.
template <typename T>
struct Rows {
  QueryT<T>* q;  // [rows][D]
  float* acc;    // [rows][D]
  float* m;      // [rows]
  float* l;      // [rows]
  float* s;      // [kGroupRows][kTileKeys], the scores of the row group at work

  Rows from(int64_t first, int D) const { return {q + first * D, acc + first * D, m + first, l + first, s}; }
};

// The keys of one tile that the rows of a row group see: row g those in [low[g], limit[g]) (low > 0 in the
// first tile of a sliding window; limit 0 for a row that sees none), the group those from block fb on.
struct GroupKeys {
  int low[kMaxGroupRows];
  int limit[kMaxGroupRows];
  int fb;
  bool any_low;  // some low[g] > 0
};

// rows.s[g][t] = q_{r0 + g} . k_t for the tile's keys from block fb to n (rounded up), from kt, the tile's K
// transposed, where the row groups share it, else from the blocks; the same bits either way.
template <typename T, typename S, int NG>
__attribute__((always_inline)) inline
void row_group_scores(const Rows<T>& rows, int64_t r0, Tile<S>& tile, [[maybe_unused]] const uint32_t* kt, int D,
                      int BS, int fb, int n) {
#ifdef BATCHGEN_DOT_BF16
  if constexpr (kPairs<T>) {
    if (kt != nullptr) return scores_transposed<NG>(rows.q + r0 * D, kt, D, fb * BS, n, rows.s);
  }
#endif
  for (int b = fb; b * BS < n; ++b)
    tile_scores<S, NG>(PairsTag<T>{}, rows.q + r0 * D, tile.block[b], tile.load, D, min_i64(BS, n - b * BS),
                       rows.s + b * BS);
}

// The attention variants on a row group's scores s[g][t] (t < width), in memory, before softmax_rows, which
// is then called with scale 1 (an exact multiply): the scaled scores, soft-capped (cap * tanh(s / cap)) when
// a cap is set, and -inf before each row's sliding window (keys.low; scores of blocks the group did not
// read are left unwritten by the dot products and overwritten here). Kept out of softmax_rows, whose
// scores stay in registers, so that the plain path's code does not change; with a window alone it runs
// only in the tile where some row's window starts (the same products as softmax_rows' either way).
inline void score_variants(const AttnArgs& a, const GroupKeys& keys, int ng, int width, float* s) {
  const Vec scale = Vec::set1(a.scale), cap = Vec::set1(a.soft_cap), inv_cap = Vec::set1(a.inv_soft_cap);
  for (int g = 0; g < ng; ++g) {
    if (keys.limit[g] <= 0) continue;  // a row that sees none of the tile
    float* row = s + g * kTileKeys;
    for (int t = 0; t < width; t += Vec::N) {
      Vec x = Vec::load(row + t) * scale;
      if (a.soft_cap > 0.0f) x = tanh_vec(x * inv_cap) * cap;  // masked after: tanh(-inf) would be -1
      x.store(row + t);
    }
    for (int t = 0; t < keys.low[g]; ++t) row[t] = kNegInf;
  }
}

// Query rows r0 .. r0 + NG - 1 against one tile of S elements; row g sees the tile's keys
// [keys.low[g], keys.limit[g]).
// Kept out of the walk: inlined there (as GCC chose for Fp8Pairs), the pair path's value accumulators went to
// the stack at every step (bf16 decode over fp8 in L2, one thread, Zen 4: 178 -> 150 us with this).
template <typename T, typename S, int NG>
__attribute__((noinline)) void attend_tile(const AttnArgs& a, const Rows<T>& rows, int64_t r0, const GroupKeys& keys,
                                           Tile<S>& tile, const uint32_t* kt) {
  const int D = a.head_dim, BS = a.block_size;
  const int fb = keys.fb;
  int n = 0;
  for (int g = 0; g < NG; ++g) n = keys.limit[g] > n ? keys.limit[g] : n;
  // The score loops may read K rows past n (inside the block, masked); the V loop reads valid rows
  // only, as 0 * (garbage V, possibly NaN) would not be 0.
  row_group_scores<T, S, NG>(rows, r0, tile, kt, D, BS, fb, n);
  const int width = (n + Vec::N - 1) / Vec::N * Vec::N;
  float scale = a.scale;
  if (a.soft_cap > 0.0f || keys.any_low) {  // the variants scale the scores themselves
    score_variants(a, keys, NG, width, rows.s);
    scale = 1.0f;
  }
  float correction[NG];
  softmax_rows<NG>(rows.s, keys.limit, width, scale, rows.m + r0, rows.l + r0, correction);
  if (tile.load.unbias != 1.0f) scale_probabilities<NG>(rows.s, width, tile.load.unbias);  // fp8 e4m3
  tile_values<S, NG>(PairsTag<T>{}, rows.s, correction, tile, D, BS, fb, n, rows.acc + r0 * D);
}

}  // namespace
}  // namespace batchgen::cpu::BATCHGEN_ISA_NS

#ifdef BATCHGEN_AMX
#include "cpu/attention_amx.h"
#endif

namespace batchgen::cpu::BATCHGEN_ISA_NS {
namespace {

template <typename T, typename S>
void attend_tile_rows(const AttnArgs& a, int ng, const Rows<T>& rows, int64_t r0, const GroupKeys& keys,
                      Tile<S>& tile, const uint32_t* kt) {
  switch (ng) {
    case 1: return attend_tile<T, S, 1>(a, rows, r0, keys, tile, kt);
    case 2: return attend_tile<T, S, 2>(a, rows, r0, keys, tile, kt);
    case 3: return attend_tile<T, S, 3>(a, rows, r0, keys, tile, kt);
    default: return attend_tile<T, S, 4>(a, rows, r0, keys, tile, kt);
  }
}

template <typename T>
void write_rows(const AttnArgs& a, const AttnTask& task, int group, const Rows<T>& rows) {
  const int D = a.head_dim;
  const int64_t count = task.kv_head_count * task.q_count * group;
#ifdef BATCHGEN_DOT_BF16
  if constexpr (kPairs<T>) {
    for (int64_t r = 0; r < count; ++r) unpermute_pairs(rows.acc + r * D, D);
  }
#endif
  for (int64_t r = 0; r < count; ++r) {
    const RowIndex at = row_index(task, group, r);
    T* dst = static_cast<T*>(a.out) + at.token * a.out_token_stride + at.head * a.out_head_stride;
    // A sink joins the sum as exp(sink - m) (+inf for a row that saw no key: its output is then 0, as without).
    const float total = a.sinks != nullptr ? rows.l[r] + std::exp(a.sinks[at.head] - rows.m[r]) : rows.l[r];
    float inv = total > 0.0f ? 1.0f / total : 0.0f;
    if (a.v_scale != nullptr) inv *= a.v_scale[at.head / group];  // an fp8 cache's values, scaled once
    const float* acc = rows.acc + r * D;
    int i = 0;
#ifdef BATCHGEN_DOT_BF16
    if constexpr (kPairs<T>) {
      for (; i + Vec::N <= D; i += Vec::N) store_bf16(Vec::load(acc + i) * Vec::set1(inv), dst + i);
    }
#endif
    for (; i < D; ++i) dst[i] = from_float<T>(acc[i] * inv);
  }
}

// The tiles a task visits in order: tile by tile over its keys, its kv heads inner, each tile the
// K (or V) of up to blocks_per_tile blocks of one kv head. Tiles start at multiples of kTileKeys;
// the blocks of the first tile before the task's kv_begin (a sliding window's) are not read.
// A default TileWalk has no tiles (no next task).
struct TileWalk {
  const int32_t* table = nullptr;  // the sequence's block table
  int64_t first_block = 0;         // the first block of the task's first tile
  int64_t begin_block = 0;         // the first block the task reads
  int64_t blocks = 0;              // blocks from first_block to the task's last
  int64_t kv_head = 0;
  int64_t heads = 1;
  int blocks_per_tile = 1;
  int64_t block_elems = 0;       // one block, all kv heads
  int64_t block_tile_elems = 0;  // one (block, kv head)

  int64_t tiles() const { return (blocks + blocks_per_tile - 1) / blocks_per_tile * heads; }
  int64_t first(int64_t visit) const { return first_block + visit / heads * blocks_per_tile; }
  int count(int64_t visit) const {
    return static_cast<int>(min_i64(blocks_per_tile, first_block + blocks - first(visit)));
  }
  // Blocks at the start of tile `visit` that are not read (before the task's first block; only in its
  // first tile of each kv head).
  int skipped(int64_t visit) const { return visit < heads ? static_cast<int>(begin_block - first_block) : 0; }
  // Elements from the start of the cache to block b of tile `visit`.
  int64_t offset(int64_t visit, int b) const {
    return table[first(visit) + b] * block_elems + (kv_head + visit % heads) * block_tile_elems;
  }
};

// The end of the keys the task's rows see (its last row's when causal).
inline int64_t keys_seen(const AttnTask& task) {
  return min_i64(task.kv_end, task.keys_end > 0 ? task.keys_end : task.q_pos + task.q_count);
}

// One past the last key the task's query token j sees: its own position's, or its key_limit's.
inline int64_t row_stop(const AttnArgs& a, const AttnTask& task, int64_t j) {
  const int64_t last = a.key_limit != nullptr ? a.key_limit[task.q_begin + j] : task.q_pos + j;
  return min_i64(task.kv_end, last + 1);
}

// The position of the task's query token j: q_pos + j, or for the shared keys of samples (member_lens)
// sample j's own last position.
inline int64_t row_position(const AttnTask& task, int64_t j) {
  return task.member_lens != nullptr ? task.member_lens[task.q_begin + j] - 1 : task.q_pos + j;
}

inline TileWalk tile_walk(const AttnArgs& a, const AttnTask& task) {
  const int BS = a.block_size;
  const int64_t block_tile_elems = int64_t{BS} * a.head_dim;
  const int64_t kv_stop = keys_seen(task);
  const int64_t tile_begin = task.kv_begin / kTileKeys * kTileKeys;
  return {a.block_tables + task.seq * a.max_blocks_per_seq,
          tile_begin / BS,
          task.kv_begin / BS,
          (kv_stop - tile_begin + BS - 1) / BS,
          task.kv_head,
          task.kv_head_count,
          kTileKeys / BS,
          a.num_kv_heads * block_tile_elems,
          block_tile_elems};
}

// One walk over a task's tiles (see TileWalk) for `rows`: per_head rows for each of the walk's kv
// heads, head_stride rows apart; `task` says which keys each row sees. The tiles after the walk's
// last are next_walk's, whose first ones are prefetched. kt holds the tile's K transposed when the
// row groups share it, else is null. The tiles hold the cache's elements as S: T, or Fp8 where T's
// loops read fp8 themselves; an fp8 cache read as T is widened into `staging` tile by tile.
template <typename T, typename S>
void attend_walk(const AttnArgs& a, const AttnTask& task, const TileWalk& walk, const TileWalk& next_walk,
                 const Rows<T>& rows, int64_t head_stride, int64_t per_head, uint32_t* kt,
                 [[maybe_unused]] const AmxWork* amx, [[maybe_unused]] T* staging) {
  const int D = a.head_dim;
  const int BS = a.block_size;
  const int group = a.num_heads / a.num_kv_heads;
  const int64_t heads = walk.heads;
  const bool fp8 = a.kv_format != KVFormat::same;
  constexpr bool tiles_of_t = std::is_same_v<S, T>;  // then an fp8 cache is widened into staging
  const int64_t element = fp8 ? 1 : int64_t{sizeof(T)};  // bytes of a cached element
  const char* k_cache = static_cast<const char*>(a.key_cache);
  const char* v_cache = static_cast<const char*>(a.value_cache);
  const int64_t num_tiles = walk.tiles();
  const int64_t all_tiles = num_tiles + next_walk.tiles();
  const int64_t bytes = walk.block_tile_elems * element;
  AttnArgs scaled = a;  // an fp8 cache's kv head: its key scale folded into the scores' scale
  // Prefetch far enough ahead that about kPrefetchBytes of K and V are worked on between the
  // request and the use: one tile for large tiles, several for small ones, which go faster.
  const int64_t tile_bytes = bytes * walk.blocks_per_tile;
  const int64_t ahead = 2 * tile_bytes >= kPrefetchBytes ? 1 : kPrefetchBytes / (2 * tile_bytes);
  constexpr int group_rows = kTilePath<T> ? kMaxGroupRows : kGroupRows;
#ifdef BATCHGEN_AMX
  const int64_t groups = (per_head + group_rows - 1) / group_rows;  // row groups of one kv head
  const int64_t qt_size = qt_group_size(D);
  if constexpr (kTilePath<T>) {
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t r0 = 0; r0 < per_head; r0 += group_rows)
        queries_to_tiles(rows.q + (h * head_stride + r0) * D, static_cast<int>(min_i64(group_rows, per_head - r0)), D,
                         amx->qt + (h * groups + r0 / group_rows) * qt_size);
  }
#endif
  for (int64_t visit = 0; visit < num_tiles; ++visit) {
    const int64_t h = visit % heads, start = walk.first(visit) * BS;
    const int64_t ahead_visit = visit + ahead;
    const bool ahead_here = ahead_visit < num_tiles;
    const TileWalk& ahead_walk = ahead_here ? walk : next_walk;
    const int64_t ahead_tile = ahead_here ? ahead_visit : ahead_visit - num_tiles;
    const int ahead_count = ahead_visit < all_tiles ? ahead_walk.count(ahead_tile) : 0;
    const int ahead_skipped = ahead_visit < all_tiles ? ahead_walk.skipped(ahead_tile) : 0;
    Tile<S> tile(a.kv_format);
    tile.count = walk.count(visit);
    const int skipped = walk.skipped(visit);
    for (int b = 0; b < tile.count; ++b) {
      BlockKV<S>& kv = tile.block[b];
      if (b < skipped) {
        kv = {nullptr, nullptr, {}, {}};
        continue;
      }
      const int64_t offset = walk.offset(visit, b) * element;
      kv = {reinterpret_cast<const S*>(k_cache + offset), reinterpret_cast<const S*>(v_cache + offset), {}, {}};
      if (b < ahead_count && b >= ahead_skipped) {
        const int64_t next = ahead_walk.offset(ahead_tile, b) * element;
        kv.next_k = {k_cache + next, k_cache + next + bytes};
        kv.next_v = {v_cache + next, v_cache + next + bytes};
      }
      if constexpr (tiles_of_t) {
        if (fp8) {  // widened into the staging tile, K then V, block b at keys b * BS
          T* k = staging + int64_t{b} * BS * D;
          T* v = k + int64_t{kTileKeys} * D;
          widen_fp8(reinterpret_cast<const uint8_t*>(k_cache + offset), k, walk.block_tile_elems, a.kv_format);
          widen_fp8(reinterpret_cast<const uint8_t*>(v_cache + offset), v, walk.block_tile_elems, a.kv_format);
          kv.k = k;
          kv.v = v;
        }
      }
    }
    if (fp8 && a.k_scale != nullptr) scaled.scale = a.scale * a.k_scale[walk.kv_head + h];  // folded in
    const AttnArgs& tile_args = fp8 ? scaled : a;
#ifdef BATCHGEN_DOT_BF16
    if constexpr (kPairs<T>) {  // kt is null otherwise
      if (kt != nullptr) transpose_keys(tile, D, BS, kt);
    }
#endif
    const Rows<T> head_rows = rows.from(h * head_stride, D);
    const int tile_keys = tile.count * BS;
#ifdef BATCHGEN_AMX
    KeySource src{};
    if constexpr (kTilePath<T>) {
      const int valid = static_cast<int>(min_i64(tile_keys, keys_seen(task) - start));
      interleave_values(tile, D, BS, valid, amx->vi);
      src = key_source(tile, D, BS, amx->keys);
    }
#endif
    for (int64_t r0 = 0; r0 < per_head; r0 += group_rows) {
      const int ng = static_cast<int>(min_i64(group_rows, per_head - r0));
      GroupKeys keys;
      keys.fb = 0;
      keys.any_low = false;
      int any = 0;
      for (int i = 0; i < ng; ++i) {
        const int64_t visible = row_stop(a, task, (r0 + i) / group) - start;
        keys.limit[i] = visible <= 0 ? 0 : static_cast<int>(min_i64(visible, tile_keys));
        keys.low[i] = 0;
        any |= keys.limit[i];
      }
      if (any == 0) continue;
      if (a.sliding_window > 0) {  // each row's first key; the group reads from the block of the first
        int first_key = tile_keys;
        any = 0;
        for (int i = 0; i < ng; ++i) {
          const int64_t before = window_begin(row_position(task, (r0 + i) / group), a.sliding_window) - start;
          keys.low[i] = before <= 0 ? 0 : static_cast<int>(min_i64(before, tile_keys));
          if (keys.low[i] >= keys.limit[i]) keys.low[i] = keys.limit[i] = 0;  // the window ends before the tile
          if (keys.limit[i] > 0 && keys.low[i] < first_key) first_key = keys.low[i];
          keys.any_low |= keys.low[i] > 0;
          any |= keys.limit[i];
        }
        if (any == 0) continue;
        keys.fb = first_key / BS;
      }
#ifdef BATCHGEN_AMX
      if constexpr (kTilePath<T>) {
        attend_tile_amx(tile_args, ng, head_rows, r0, keys, src, amx->qt + (h * groups + r0 / group_rows) * qt_size,
                        *amx);
        continue;
      }
#endif
      attend_tile_rows<T, S>(tile_args, ng, head_rows, r0, keys, tile, kt);
    }
  }
}

// Member j of a task over samples sharing blocks (AttnTask::member_lens): its own keys only (from its
// sliding window's first block, where that comes after the shared keys).
inline AttnTask member_task(const AttnArgs& a, const AttnTask& task, int64_t j) {
  AttnTask member = task;
  member.seq = member.q_begin = task.q_begin + j;
  member.q_count = 1;
  member.kv_end = task.member_lens[member.seq];
  member.q_pos = member.kv_end - 1;
  const int64_t window_block = window_begin(member.q_pos, a.sliding_window) / a.block_size * a.block_size;
  member.kv_begin = task.kv_end > window_block ? task.kv_end : window_block;
  member.member_lens = nullptr;
  return member;
}

// Whether a task's tiles serve several row groups of T on the pair path, which then transposes each tile's K
// once (transpose_keys) from a tile of T.
template <typename T>
bool transposes_keys([[maybe_unused]] const AttnArgs& a, [[maybe_unused]] const AttnTask& task) {
#ifdef BATCHGEN_DOT_BF16
  const int64_t per_head = task.q_count * (a.num_heads / a.num_kv_heads);
  return kPairs<T> && !kTilePath<T> && per_head > kGroupRows && can_transpose_keys(a.head_dim, a.block_size);
#else
  return false;
#endif
}

// attend for a task whose tiles hold the cache's elements as S (see attend_walk).
template <typename T, typename S>
void attend_as(const AttnArgs& a, const AttnTask& task, const AttnTask* next_task, float* scratch) {
  const int D = a.head_dim;
  const int group = a.num_heads / a.num_kv_heads;
  const int64_t heads = task.kv_head_count;
  const int64_t per_head = task.q_count * group;  // rows of one kv head
  const int64_t count = heads * per_head;
  Rows<T> rows;  // q takes rows * D floats whatever its type (see attend_scratch_floats)
  rows.q = reinterpret_cast<QueryT<T>*>(scratch);
  rows.acc = scratch + count * D;
  rows.m = rows.acc + count * D;
  rows.l = rows.m + count;
  rows.s = rows.l + count;
  uint32_t* kt = nullptr;  // the transposed K of the tile at work, when row groups share it
  AmxWork* amx = nullptr;  // the tile path's scratch
#ifdef BATCHGEN_AMX
  AmxWork work;
  if constexpr (kTilePath<T>) {
    work = amx_work(rows.s + kMaxGroupRows * kTileKeys, count, heads, D);
    amx = &work;
    configure_tiles();
  }
#endif
#ifdef BATCHGEN_DOT_BF16
  if (transposes_keys<T>(a, task) && std::is_same_v<S, T>) {
    const auto after_scores = reinterpret_cast<uintptr_t>(rows.s + kGroupRows * kTileKeys);
    kt = reinterpret_cast<uint32_t*>((after_scores + 63) / 64 * 64);
  }
#endif
  // Over fp8 bytes (S = Fp8) the walk and its loops see T only through the query rows, floats for every such
  // T: float's copy serves bf16 and fp16 activations too (compiled once, not three times).
  using WalkT = std::conditional_t<std::is_same_v<S, Fp8>, float, T>;
  static_assert(std::is_same_v<QueryT<WalkT>, QueryT<T>>, "the same query rows");
  const Rows<WalkT> walk_rows{rows.q, rows.acc, rows.m, rows.l, rows.s};
  WalkT* staging = nullptr;  // an fp8 cache's tile, widened
  if (std::is_same_v<S, T> && a.kv_format != KVFormat::same) {
    const auto after_base = reinterpret_cast<uintptr_t>(scratch + attend_base_floats(count, D));
    staging = reinterpret_cast<WalkT*>((after_base + 63) / 64 * 64);
  }
  load_queries<T>(a, task, group, rows.q);
  for (int64_t i = 0; i < count * D; ++i) rows.acc[i] = 0.0f;
  for (int64_t r = 0; r < count; ++r) {
    rows.m[r] = kNegInf;
    rows.l[r] = 0.0f;
  }
  // The tiles after this task's last are the next task's.
  const TileWalk after = next_task != nullptr ? tile_walk(a, *next_task) : TileWalk{};
  if (task.member_lens == nullptr) {
    attend_walk<WalkT, S>(a, task, tile_walk(a, task), after, walk_rows, per_head, per_head, kt, amx, staging);
  } else {
    // The shared keys for every member's rows, then each member's own keys for its rows alone: the
    // online softmax carries on, so no partial results need combining.
    attend_walk<WalkT, S>(a, task, tile_walk(a, task), tile_walk(a, member_task(a, task, 0)), walk_rows, per_head,
                          per_head, kt, amx, staging);
    for (int64_t j = 0; j < task.q_count; ++j) {
      const AttnTask member = member_task(a, task, j);
      const TileWalk next_walk = j + 1 < task.q_count ? tile_walk(a, member_task(a, task, j + 1)) : after;
      attend_walk<WalkT, S>(a, member, tile_walk(a, member), next_walk, walk_rows.from(j * group, D), per_head,
                            group, nullptr, amx, staging);
    }
  }
  write_rows<T>(a, task, group, rows);
#ifdef BATCHGEN_AMX
  if constexpr (kTilePath<T>) _tile_release();
#endif
}

// One task (AttnTask) of T activations: over an fp8 cache the tiles hold the bytes themselves where T's
// loops read them (kFp8InRegisters, and kFp8Pairs where the task does not transpose K), else elements of T.
template <typename T>
void attend(const AttnArgs& a, const AttnTask& task, const AttnTask* next_task, float* scratch) {
  if constexpr (kFp8InRegisters<T>) {
    if (a.kv_format != KVFormat::same) return attend_as<T, Fp8>(a, task, next_task, scratch);
  }
  if constexpr (kFp8Pairs<T>) {
    if (a.kv_format != KVFormat::same && !transposes_keys<T>(a, task))
      return attend_as<T, Fp8Pairs>(a, task, next_task, scratch);
  }
  attend_as<T, T>(a, task, next_task, scratch);
}

}  // namespace
}  // namespace batchgen::cpu::BATCHGEN_ISA_NS
