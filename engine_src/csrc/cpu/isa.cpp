#include "cpu/isa.h"

#include <torch/extension.h>

#include <atomic>
#include <cstdlib>

#if defined(__x86_64__) && defined(__linux__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace batchgen::cpu {

bool amx_emulation_asked() {
  const char* env = std::getenv("BATCHGEN_EMULATE_AMX");
  return env != nullptr && std::string(env) == "1";
}

bool has_amx(int feature_bit) {
#if defined(__x86_64__) && defined(__linux__)
  // AMX-TILE (CPUID leaf 7, EDX bit 24) and Linux's leave to use the tile data (arch_prctl
  // ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA, once per process): without it the first tile
  // instruction kills the process.
  static const bool tiles_usable = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) || (edx & (1u << 24)) == 0) return false;
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  return tiles_usable && __get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) && (edx & (1u << feature_bit)) != 0;
#else
  (void)feature_bit;
  return false;
#endif
}

namespace {

struct Candidate {
  const KernelTable& (*table)();
  bool (*supported)();
};

bool always() { return true; }

#ifdef BATCHGEN_HAVE_AVX2
bool has_avx2() {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}
#endif

#ifdef BATCHGEN_HAVE_AVX512
// Must cover the target list of kernels_avx512.cpp.
bool has_avx512() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}

// Must cover the target list of kernels_avx512_bf16.cpp. AVX512-VBMI converts fp8 caches to bf16 (BytesToBF16):
// every processor with AVX512-BF16 has it (AMD Zen 4 on, Intel Sapphire Rapids on) except Intel's Cooper Lake,
// which runs the avx512 table.
bool has_avx512_bf16() {
  return has_avx512() && __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512vbmi");
}

bool has_amx_bf16() { return has_avx512_bf16() && has_amx(22); }

// The emulated tile unit runs the amx_bf16 code where the processor has everything else it needs; where AMX
// runs, amx_bf16 itself is tested (and the emulation only when asked, to compare the two).
bool emulates_amx() { return has_avx512_bf16() && (!has_amx_bf16() || amx_emulation_asked()); }
#endif

std::atomic<int64_t> tile_products{0};

// Slowest first (the emulated tile unit the slowest of all: never chosen by default).
const std::vector<Candidate>& candidates() {
  static const std::vector<Candidate> list = {
#ifdef BATCHGEN_HAVE_AVX512
      {&amx_emulated::kernel_table, &emulates_amx},
#endif
      {&scalar::kernel_table, &always},
#ifdef BATCHGEN_HAVE_AVX2
      {&avx2::kernel_table, &has_avx2},
#endif
#ifdef BATCHGEN_HAVE_AVX512
      {&avx512::kernel_table, &has_avx512},
      {&avx512_bf16::kernel_table, &has_avx512_bf16},
      {&amx_bf16::kernel_table, &has_amx_bf16},
#endif
  };
  return list;
}

const KernelTable* find_supported(const std::string& name) {
  for (const Candidate& c : candidates()) {
    if (name == c.table().name && c.supported()) return &c.table();
  }
  return nullptr;
}

std::atomic<const KernelTable*> active{nullptr};

std::string supported_list() {
  std::string joined;
  for (const std::string& name : supported_isas()) joined += (joined.empty() ? "" : ", ") + name;
  return joined;
}

const KernelTable* initial_choice() {
  const char* env = std::getenv("BATCHGEN_CPU_ISA");
  if (env != nullptr && *env != '\0') {
    const KernelTable* chosen = find_supported(env);
    TORCH_CHECK_VALUE(chosen != nullptr, "BATCHGEN_CPU_ISA=", env,
                      " is not supported by this build and processor; supported: ", supported_list());
    return chosen;
  }
  return find_supported(supported_isas().back());
}

}  // namespace

int64_t emulated_tile_products() { return tile_products.load(std::memory_order_relaxed); }
void count_emulated_tile_product() { tile_products.fetch_add(1, std::memory_order_relaxed); }

std::vector<std::string> supported_isas() {
  std::vector<std::string> names;
  for (const Candidate& c : candidates()) {
    if (c.supported()) names.emplace_back(c.table().name);
  }
  return names;
}

const KernelTable& active_kernels() {
  const KernelTable* table = active.load(std::memory_order_acquire);
  if (table == nullptr) {
    table = initial_choice();
    active.store(table, std::memory_order_release);
  }
  return *table;
}

void set_isa(const std::string& name) {
  const KernelTable* chosen = find_supported(name);
  TORCH_CHECK_VALUE(chosen != nullptr, "CPU instruction set '", name,
                    "' is not supported by this build and processor; supported: ", supported_list());
  active.store(chosen, std::memory_order_release);
}

}  // namespace batchgen::cpu
