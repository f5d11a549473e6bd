// Torch-facing CPU paged attention: checks the index values, cuts the call into tasks, runs them
// on torch's intra-op threads with the kernels of the active instruction set (isa.h).
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "cpu/isa.h"
#include "cpu/kernels.h"
#include "ops.h"

namespace batchgen::cpu {
namespace {

// Query rows (tokens x heads of a kv head) per prefill task at most: each K/V tile a task reads
// serves all its rows, so larger tasks go faster (32 -> 256 rows: 341-token prompts 1.15x, measured
// when prefill still transposed K) as long as there are tasks enough for every thread.
constexpr int64_t kPrefillRowsPerTask = 256;
constexpr int64_t kMinBytesPerWorker = 256 << 10;
constexpr int64_t kTasksPerWorker = 4;       // tasks per worker that balance ragged lengths
// A run reads its shared blocks once when that spares reading at least this many keys (n - 1
// times the shared ones). One layer of SmolLM2's heads, 2 threads, grouped vs each sample alone:
// 2 samples sharing 32 keys the same, 64 keys 9-20% faster, 4 samples sharing 32 keys 4-25%
// faster (amx_bf16, avx512_bf16, avx512). With the shared and own parts as separate tasks whose
// partial results were combined, 64 keys had been 10% slower.
constexpr int64_t kMinKeysSpared = 64;

AttnArgs make_args(torch::Tensor& out, const torch::Tensor& query, const torch::Tensor& key_cache,
                   const torch::Tensor& value_cache, const torch::Tensor& block_tables, double scale,
                   int64_t sliding_window, double logits_soft_cap, const KVScales& scales,
                   const c10::optional<torch::Tensor>& sinks) {
  AttnArgs a;
  a.query = query.data_ptr();
  a.query_token_stride = query.stride(0);
  a.query_head_stride = query.stride(1);
  a.out = out.data_ptr();
  a.out_token_stride = out.stride(0);
  a.out_head_stride = out.stride(1);
  a.key_cache = key_cache.data_ptr();
  a.value_cache = value_cache.data_ptr();
  a.block_tables = block_tables.data_ptr<int32_t>();
  a.max_blocks_per_seq = block_tables.size(1);
  a.num_heads = static_cast<int>(query.size(1));
  a.num_kv_heads = static_cast<int>(key_cache.size(1));
  a.block_size = static_cast<int>(key_cache.size(2));
  a.head_dim = static_cast<int>(key_cache.size(3));
  a.scale = static_cast<float>(scale);
  a.sliding_window = sliding_window;
  a.soft_cap = static_cast<float>(logits_soft_cap);
  a.inv_soft_cap = logits_soft_cap > 0 ? static_cast<float>(1.0 / logits_soft_cap) : 0.0f;
  a.kv_format = kv_format_of(key_cache);
  if (a.kv_format != KVFormat::same) {
    a.k_scale = scales.k.has_value() ? scales.k->data_ptr<float>() : nullptr;
    a.v_scale = scales.v.has_value() ? scales.v->data_ptr<float>() : nullptr;
  }
  a.sinks = sinks.has_value() ? sinks->data_ptr<float>() : nullptr;
  return a;
}

// The first key a task whose first query sits at `pos` reads: its window's first key rounded down to
// its block (0 without a window).
inline int64_t first_key_read(const AttnArgs& a, int64_t pos) {
  return window_begin(pos, a.sliding_window) / a.block_size * a.block_size;
}

// Each length must be in [1, max_blocks_per_seq * block_size] and each block id a sequence
// reads (its first ceil(len / block_size) table entries) must name a block of the cache.
void check_lengths_and_blocks(const char* op, const torch::Tensor& seq_lens, const torch::Tensor& block_tables,
                              int64_t block_size, int64_t num_blocks) {
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t max_blocks = block_tables.size(1);
  for (int64_t s = 0; s < seq_lens.size(0); ++s) {
    const int64_t len = lens[s];
    TORCH_CHECK_VALUE(len >= 1 && len <= max_blocks * block_size, op, ": seq_lens[", s, "] = ", len,
                      " is outside [1, max_blocks_per_seq * block_size = ", max_blocks * block_size, "]");
    const int64_t used = (len + block_size - 1) / block_size;
    for (int64_t b = 0; b < used; ++b) {
      const int32_t id = tables[s * max_blocks + b];
      TORCH_CHECK_VALUE(id >= 0 && id < num_blocks, op, ": block_tables[", s, ", ", b, "] = ", id,
                        " is not a block of the cache (num_blocks = ", num_blocks, ")");
    }
  }
}

// Threads worth waking for a call that reads kv_bytes of K and V: at most one per
// kMinBytesPerWorker, as a thread's wake-up costs about as much as reading that much.
int64_t useful_workers(int64_t kv_bytes) {
  return std::clamp<int64_t>(kv_bytes / kMinBytesPerWorker, 1, at::get_num_threads());
}

// How paged_attention_decode cuts a call that reads kv_bytes of K and V: the threads it wakes, and the kv heads a
// task takes: all of its sequence's when there are sequences enough to keep the workers busy (reading whole
// blocks, see AttnTask), one otherwise. A sequence's keys are never split between tasks: partial results
// combined afterwards would round differently from one walk (batch invariance, see attention_impl.h).
struct DecodeSplit {
  int64_t workers;
  int64_t heads_per_task;
};

DecodeSplit decode_split(int64_t num_seqs, int64_t num_kv_heads, int64_t kv_bytes) {
  const int64_t workers = useful_workers(kv_bytes);
  return {workers, num_seqs >= kTasksPerWorker * workers ? num_kv_heads : 1};
}

// Runs body(claim) on up to `workers` of torch's intra-op threads (no more than there are tasks); each thread
// takes tasks 0 .. num_tasks - 1 from a shared counter by calling claim(), which returns num_tasks or more once
// none is left, so that ragged tasks do not leave threads idle.
template <typename Body>
void run_claimed(int64_t num_tasks, int64_t workers, const Body& body) {
  std::atomic<int64_t> counter{0};
  const auto claim = [&counter] { return counter++; };
  at::parallel_for(0, std::min(workers, num_tasks), 1, [&](int64_t, int64_t) { body(claim); });
}

// Runs every task (run_claimed); a thread claims its next task as it starts one, so that the kernel can
// prefetch the next task's first K/V tile.
void run_tasks(const AttnArgs& args, AttendFn attend, const std::vector<AttnTask>& tasks, int64_t workers,
               int64_t scratch_floats) {
  const int64_t num_tasks = static_cast<int64_t>(tasks.size());
  run_claimed(num_tasks, workers, [&](const auto& claim) {
    std::vector<float> scratch(scratch_floats);
    for (int64_t task = claim(); task < num_tasks;) {
      const int64_t next = claim();
      attend(args, tasks[task], next < num_tasks ? &tasks[next] : nullptr, scratch.data());
      task = next;
    }
  });
}

// Tasks that keep `workers` threads busy through ragged task sizes (one thread needs no balance).
inline int64_t wanted_tasks(int64_t workers) { return workers == 1 ? 1 : kTasksPerWorker * workers; }

// Sequences side by side with the same group id (the samples of one request) whose block tables
// start with the same blocks: decode reads those blocks once for all of them. Only whole blocks
// before every member's last block count (a sequence writes its last block, so that one is its own),
// and only whole tiles of them: a member's own keys then start on a tile, as in its own walk.
// With a sliding window the shared keys read start at the first block any member's window holds.
struct SharedRun {
  int64_t first;
  int64_t count;
  int64_t tokens;  // keys in the shared blocks
  int64_t begin;   // the first shared key read (0 without a window)
};

std::vector<SharedRun> shared_runs(const AttnArgs& a, const int32_t* groups, const int32_t* lens, int64_t num_seqs) {
  const int32_t* tables = a.block_tables;
  const int64_t max_blocks = a.max_blocks_per_seq, block_size = a.block_size;
  std::vector<SharedRun> runs;
  int64_t end = 0;
  for (int64_t first = 0; first < num_seqs; first = end) {
    for (end = first + 1; end < num_seqs && groups[end] == groups[first];) ++end;
    const int32_t* lead = tables + first * max_blocks;
    int64_t blocks = end - first > 1 ? (lens[first] - 1) / block_size : 0;
    for (int64_t s = first + 1; s < end && blocks > 0; ++s) {
      const int32_t* table = tables + s * max_blocks;
      const int64_t limit = std::min<int64_t>(blocks, (lens[s] - 1) / block_size);
      for (blocks = 0; blocks < limit && table[blocks] == lead[blocks];) ++blocks;
    }
    const int64_t tokens = blocks * block_size / kTileKeys * kTileKeys;
    int64_t begin = tokens;
    for (int64_t s = first; s < end; ++s) begin = std::min(begin, first_key_read(a, lens[s] - 1));
    if ((end - first - 1) * (tokens - begin) >= kMinKeysSpared) runs.push_back({first, end - first, tokens, begin});
  }
  return runs;
}

// Decode where runs of samples share their prompt's blocks: one task per run (and kv head
// group) reads the shared blocks once for all the run's query rows, as prefill reads a block for
// all its tokens, then each member's own blocks for that member's rows (AttnTask::member_lens).
// Sequences in no run are decoded as usual.
void decode_shared(torch::Tensor& out, const AttnArgs& args, AttendFn attend, const int32_t* lens, int64_t num_seqs,
                   const std::vector<SharedRun>& runs, int64_t heads_per_task, int64_t workers) {
  const int64_t group = args.num_heads / args.num_kv_heads;
  const int64_t wanted = wanted_tasks(workers);
  // A run's task holds most of the arithmetic: with few runs, one task per kv head keeps threads
  // busy, and with fewer still the runs are cut into parts of 2 or more members (each part reads
  // the shared blocks once), as a task holds its members' own blocks too.
  const int64_t run_count = static_cast<int64_t>(runs.size());
  const int64_t run_heads = run_count >= wanted ? heads_per_task : 1;
  const int64_t head_tasks = run_count * ((args.num_kv_heads + run_heads - 1) / run_heads);
  const int64_t parts = std::max<int64_t>(1, (wanted + head_tasks - 1) / head_tasks);
  std::vector<bool> in_run(num_seqs, false);
  std::vector<AttnTask> tasks;
  int64_t widest = 1;
  for (const SharedRun& run : runs) {
    const int64_t end = run.first + run.count;
    const int64_t part = std::max<int64_t>(2, (run.count + parts - 1) / parts);
    widest = std::max(widest, std::min(part, run.count));
    std::fill(in_run.begin() + run.first, in_run.begin() + end, true);
    for (int64_t first = run.first; first < end; first += part) {
      const int64_t count = std::min(part, end - first);
      for (int64_t h = 0; h < args.num_kv_heads; h += run_heads) {
        tasks.push_back({first, h, first, count, run.tokens, run.begin, run.tokens, run_heads, lens});
      }
    }
  }
  for (int64_t s = 0; s < num_seqs; ++s) {
    if (in_run[s]) continue;
    const int64_t begin = first_key_read(args, lens[s] - 1);
    for (int64_t h = 0; h < args.num_kv_heads; h += heads_per_task) {
      tasks.push_back({s, h, s, 1, lens[s] - 1, begin, lens[s], heads_per_task});
    }
  }
  run_tasks(args, attend, tasks, workers,
            attend_scratch_floats(std::max(heads_per_task, run_heads * widest) * group, args.head_dim));
}

}  // namespace

KVFormat kv_format_of(const torch::Tensor& cache) {
  switch (cache.scalar_type()) {
    case torch::kFloat8_e4m3fn: return KVFormat::fp8_e4m3;
    case torch::kFloat8_e5m2: return KVFormat::fp8_e5m2;
    default: return KVFormat::same;
  }
}

DType dtype_of(const torch::Tensor& t) {
  switch (t.scalar_type()) {
    case torch::kFloat32: return DType::f32;
    case torch::kBFloat16: return DType::bf16;
    case torch::kFloat16: return DType::f16;
    default: TORCH_CHECK_VALUE(false, "unsupported dtype ", t.scalar_type());
  }
}

void paged_attention_decode(torch::Tensor& out, const torch::Tensor& query, const torch::Tensor& key_cache,
                            const torch::Tensor& value_cache, const torch::Tensor& block_tables,
                            const torch::Tensor& seq_lens, double scale, const c10::optional<torch::Tensor>& seq_groups,
                            int64_t sliding_window, double logits_soft_cap, const KVScales& scales,
                            const c10::optional<torch::Tensor>& sinks) {
  const int64_t num_seqs = query.size(0);
  const int64_t block_size = key_cache.size(2);
  check_lengths_and_blocks("paged_attention_decode", seq_lens, block_tables, block_size, key_cache.size(0));
  if (num_seqs == 0) return;

  const AttnArgs args =
      make_args(out, query, key_cache, value_cache, block_tables, scale, sliding_window, logits_soft_cap, scales,
                sinks);
  const AttendFn attend = active_kernels().attend[static_cast<int>(dtype_of(query))];
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t group = args.num_heads / args.num_kv_heads;
  int64_t total_len = 0;  // keys read
  for (int64_t s = 0; s < num_seqs; ++s) total_len += lens[s] - first_key_read(args, lens[s] - 1);
  const DecodeSplit split = decode_split(
      num_seqs, args.num_kv_heads, total_len * args.num_kv_heads * 2 * args.head_dim * key_cache.element_size());
  const int64_t workers = split.workers, heads_per_task = split.heads_per_task;
  if (seq_groups.has_value()) {
    const std::vector<SharedRun> runs = shared_runs(args, seq_groups->data_ptr<int32_t>(), lens, num_seqs);
    if (!runs.empty()) return decode_shared(out, args, attend, lens, num_seqs, runs, heads_per_task, workers);
  }
  std::vector<AttnTask> tasks;
  for (int64_t seq = 0; seq < num_seqs; ++seq) {
    const int64_t begin = first_key_read(args, lens[seq] - 1);
    for (int64_t h = 0; h < args.num_kv_heads; h += heads_per_task)
      tasks.push_back({seq, h, seq, 1, lens[seq] - 1, begin, lens[seq], heads_per_task});
  }
  run_tasks(args, attend, tasks, workers, attend_scratch_floats(heads_per_task * group, args.head_dim));
}

namespace {

// The sum of n bytes (a multiple of 32) as 64-bit words, in four independent sums.
uint64_t sum_words(const char* bytes, int64_t n, uint64_t total) {
  const auto* w = reinterpret_cast<const uint64_t*>(bytes);
  uint64_t s[4] = {total, 0, 0, 0};
  for (int64_t i = 0; i < n / 8; i += 4)
    for (int j = 0; j < 4; ++j) s[j] += w[i + j];
  return s[0] + s[1] + s[2] + s[3];
}

}  // namespace

int64_t read_decode_blocks(const torch::Tensor& key_cache, const torch::Tensor& value_cache,
                           const torch::Tensor& block_tables, const torch::Tensor& seq_lens, bool whole_blocks) {
  const int64_t num_seqs = seq_lens.size(0), block_size = key_cache.size(2), kv_heads = key_cache.size(1);
  check_lengths_and_blocks("read_decode_blocks", seq_lens, block_tables, block_size, key_cache.size(0));
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t max_blocks = block_tables.size(1);
  const int64_t piece = block_size * key_cache.size(3) * key_cache.element_size();  // one (block, kv head)
  const char* k_cache = static_cast<const char*>(key_cache.data_ptr());
  const char* v_cache = static_cast<const char*>(value_cache.data_ptr());
  int64_t total_len = 0;
  for (int64_t s = 0; s < num_seqs; ++s) total_len += lens[s];
  // Threads and tasks as paged_attention_decode chooses them (without a window: every key is read).
  const DecodeSplit split = decode_split(num_seqs, kv_heads, total_len * kv_heads * 2 * piece / block_size);
  const int64_t workers = split.workers, heads_per_task = split.heads_per_task;
  const int64_t tasks_per_seq = kv_heads / heads_per_task;
  const int64_t num_tasks = num_seqs * tasks_per_seq;
  const int64_t tile_blocks = kTileKeys / block_size;
  std::atomic<uint64_t> total{0};
  run_claimed(num_tasks, workers, [&](const auto& claim) {
    uint64_t sum = 0;
    for (int64_t task = claim(); task < num_tasks; task = claim()) {
      const int64_t seq = task / tasks_per_seq, head = task % tasks_per_seq * heads_per_task;
      const int32_t* table = tables + seq * max_blocks;
      const int64_t blocks = (lens[seq] + block_size - 1) / block_size;
      if (whole_blocks) {  // each block's kv heads together, K then V
        for (int64_t b = 0; b < blocks; ++b) {
          const int64_t at = (table[b] * kv_heads + head) * piece;
          sum = sum_words(k_cache + at, heads_per_task * piece, sum);
          sum = sum_words(v_cache + at, heads_per_task * piece, sum);
        }
        continue;
      }
      for (int64_t first = 0; first < blocks; first += tile_blocks) {  // decode's walk: tiles, kv heads inner
        const int64_t end = std::min(first + tile_blocks, blocks);
        for (int64_t h = head; h < head + heads_per_task; ++h) {
          for (int64_t b = first; b < end; ++b) sum = sum_words(k_cache + (table[b] * kv_heads + h) * piece, piece, sum);
          for (int64_t b = first; b < end; ++b) sum = sum_words(v_cache + (table[b] * kv_heads + h) * piece, piece, sum);
        }
      }
    }
    total += sum;
  });
  return static_cast<int64_t>(total.load());
}

void paged_attention_prefill(torch::Tensor& out, const torch::Tensor& query, const torch::Tensor& key_cache,
                             const torch::Tensor& value_cache, const torch::Tensor& block_tables,
                             const torch::Tensor& seq_lens, const torch::Tensor& query_start_loc, double scale,
                             int64_t sliding_window, double logits_soft_cap, const KVScales& scales,
                             const c10::optional<torch::Tensor>& key_limit,
                             const c10::optional<torch::Tensor>& sinks) {
  const char* op = "paged_attention_prefill";
  const int64_t num_seqs = seq_lens.size(0), num_tokens = query.size(0);
  check_lengths_and_blocks(op, seq_lens, block_tables, key_cache.size(2), key_cache.size(0));
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* starts = query_start_loc.data_ptr<int32_t>();
  TORCH_CHECK_VALUE(starts[0] == 0 && starts[num_seqs] == num_tokens, op,
                    ": query_start_loc must start at 0 and end at the number of query tokens (", num_tokens,
                    "), got ", starts[0], " .. ", starts[num_seqs]);
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t q_len = starts[s + 1] - starts[s];
    TORCH_CHECK_VALUE(q_len >= 0 && q_len <= lens[s], op, ": sequence ", s, " has ", q_len,
                      " query tokens (query_start_loc[", s + 1, "] - query_start_loc[", s, "]) but seq_lens[", s,
                      "] = ", lens[s], "; need 0 <= query tokens <= seq_len");
  }
  const int32_t* limits = key_limit.has_value() ? key_limit->data_ptr<int32_t>() : nullptr;
  for (int64_t s = 0; limits != nullptr && s < num_seqs; ++s) {
    const int64_t context = lens[s] - (starts[s + 1] - starts[s]);
    for (int64_t t = starts[s]; t < starts[s + 1]; ++t) {
      const int64_t position = context + t - starts[s];
      TORCH_CHECK_VALUE(limits[t] >= position && limits[t] < lens[s], op, ": key_limit[", t, "] = ", limits[t],
                        " is outside [its position ", position, ", seq_lens[", s, "] - 1 = ", lens[s] - 1, "]");
    }
  }

  AttnArgs args =
      make_args(out, query, key_cache, value_cache, block_tables, scale, sliding_window, logits_soft_cap, scales,
                sinks);
  args.key_limit = limits;
  const AttendFn attend = active_kernels().attend[static_cast<int>(dtype_of(query))];
  const int64_t group = args.num_heads / args.num_kv_heads;
  auto count_tasks = [&](int64_t tokens_per_task) {
    int64_t count = 0;
    for (int64_t s = 0; s < num_seqs; ++s) count += (starts[s + 1] - starts[s] + tokens_per_task - 1) / tokens_per_task;
    return count * args.num_kv_heads;
  };
  int64_t tile = std::max<int64_t>(1, kPrefillRowsPerTask / group);  // query tokens per task
  while (tile > 1 && count_tasks(tile) < kTasksPerWorker * at::get_num_threads()) tile = (tile + 1) / 2;
  std::vector<AttnTask> tasks;
  int64_t keys_read = 0;  // summed over tasks, each of which reads its keys and values once
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t q_len = starts[s + 1] - starts[s], context = lens[s] - q_len;
    for (int64_t j = 0; j < q_len; j += tile) {
      const int64_t count = std::min(tile, q_len - j);
      const int64_t begin = first_key_read(args, context + j);
      int64_t keys_end = 0;  // with key limits: one past the largest of the task's rows
      for (int64_t t = starts[s] + j; limits != nullptr && t < starts[s] + j + count; ++t) {
        keys_end = std::max<int64_t>(keys_end, limits[t] + 1);
      }
      keys_read += args.num_kv_heads * ((keys_end > 0 ? keys_end : context + j + count) - begin);
      for (int64_t h = 0; h < args.num_kv_heads; ++h) {
        tasks.push_back({s, h, starts[s] + j, count, context + j, begin, lens[s], 1, nullptr, keys_end});
      }
    }
  }
  // Costliest first (a task's cost grows with the keys its last row reads), so the tail of the
  // dynamic schedule is made of short tasks.
  std::stable_sort(tasks.begin(), tasks.end(), [](const AttnTask& x, const AttnTask& y) {
    const int64_t x_end = x.keys_end > 0 ? x.keys_end : x.q_pos + x.q_count;
    const int64_t y_end = y.keys_end > 0 ? y.keys_end : y.q_pos + y.q_count;
    return x_end - x.kv_begin > y_end - y.kv_begin;
  });
  const int64_t workers = useful_workers(keys_read * 2 * args.head_dim * key_cache.element_size());
  run_tasks(args, attend, tasks, workers, attend_scratch_floats(tile * group, args.head_dim));
}

}  // namespace batchgen::cpu
