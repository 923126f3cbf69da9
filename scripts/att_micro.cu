// Attention micro-benchmark for the device: Specula's attention kernels (kernels.cu, included)
// alone at the qwen3-8b attention shape (32 query heads, 8 KV heads, head_dim 128), on random
// q / K / V, timed with CUDA events over a cache of 36 layers (each launch reads another layer,
// as a decode step does), so a profiler (ncu) can be pointed at one kernel.
//
// With -DOLD_KERNELS="path": the kernels of another kernels.cu (`scripts/old_kernels.py` makes
// one includable) are compiled in namespace `old`, run on the same inputs, and every output is compared bit for bit with the
// current kernels' (the attention output and, for the RoPE kernels, the K / V cache rows).
//
// Build (here, no GPU needed):
//   git show HEAD:crates/specula-engine/src/cuda/kernels.cu | python3 scripts/old_kernels.py > /tmp/old.cu
//   nvcc -arch=sm_90 -O3 -std=c++17 -DOLD_KERNELS='"/tmp/old.cu"' -o .gpu/att_micro scripts/att_micro.cu
// Run (device): att_micro [REPS]   one line per (case, kernel): microseconds a launch, K+V GB/s,
//   and "bits equal" / "BITS DIFFER" against the first kernel of the case.
// Under ncu: ncu --clock-control none -k regex:NAME -c 1 att_micro 3
#include "../crates/specula-engine/src/cuda/kernels.cu"
#ifdef OLD_KERNELS
namespace old {
#include OLD_KERNELS
}
#endif

// Experimental instantiations (micro only): batch sizes, register budgets, prefetch.
#define XATT(NAME, MINB, ...) \
  __global__ void __launch_bounds__(256, MINB) NAME(ATT_ARGS) { attention_impl<__VA_ARGS__>(ATT_PASS); }
#define XROPE(NAME, MINB, ...) \
  __global__ void __launch_bounds__(256, MINB) NAME(ATT_ROPE_ARGS) { attention_impl<__VA_ARGS__>(ATT_ROPE_PASS); }
XATT(x_g4_b4_pf1, 4, 2, 8, 2, false, 4, 1)
XATT(x_g4_b3_k4v16, 3, 4, 16, 2, false, 4, 0)
XATT(x_g4_b2_k4v16, 2, 4, 16, 2, false, 4, 0)
XATT(x_g4_b2_k8v16, 2, 8, 16, 2, false, 4, 0)
XATT(x_deep_h128_pf0, 2, 4, 16, 2, false, 1, 0)
XROPE(x_rope_deep_h128_pf0, 2, 4, 16, 2, true, 1, 0)
XROPE(x_rope_deep_h128_pf1, 2, 4, 16, 2, true, 1, 1)
XROPE(x_rope_deep_h128_k8, 2, 8, 16, 2, true, 1, 3)

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#define CK(x)                                                                             \
  do {                                                                                    \
    cudaError_t e_ = (x);                                                                 \
    if (e_ != cudaSuccess) {                                                              \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      exit(1);                                                                            \
    }                                                                                     \
  } while (0)

__global__ void fill_f32(float* p, unsigned long long n, unsigned long long seed, float scale) {
  for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
       i += (unsigned long long)gridDim.x * blockDim.x)
    p[i] = scale * splitmix_u(seed, i);
}

typedef void (*AttFn)(const float*, const bf16_t*, const bf16_t*, const int*, const int*, float*, float*, int*,
                      bf16_t*, int, int, int, int, float, int);
typedef void (*RopeFn)(const float*, const bf16_t*, const bf16_t*, const int*, const int*, float*, float*, int*,
                       bf16_t*, int, int, int, int, float, int, const float*, const float*, const bf16_t*,
                       const bf16_t*, const float*, float, int);

typedef void (*StoreFn)(const float*, const float*, const bf16_t*, const bf16_t*, const float*, const int*,
                        const int*, float*, bf16_t*, bf16_t*, int, int, int, int, float, int);
struct Kern {
  const char* name;
  AttFn f;
  RopeFn rf;
  int qg;
  StoreFn store = nullptr;  // launched first (qkv_rope_store), as the unfused forward does
};

constexpr int NH = 32, NKV = 8, HD = 128, LAYERS = 36;

int main(int argc, char** argv) {
  const int reps = argc > 1 ? atoi(argv[1]) : 50;
  const int maxr = 64, maxc = 4160;
  const size_t layer = (size_t)maxr * maxc * NKV * HD;  // bf16 elements of one layer's K (or V)
  bf16_t *K, *V, *O, *Oref, *qn, *kn;
  float *Q, *QKV, *S, *P, *invf;
  int *C, *pos, *slot;
  CK(cudaMalloc(&K, layer * LAYERS * 2));
  CK(cudaMalloc(&V, layer * LAYERS * 2));
  CK(cudaMalloc(&O, (size_t)maxr * NH * HD * 2));
  CK(cudaMalloc(&Oref, (size_t)maxr * NH * HD * 2));
  CK(cudaMalloc(&Q, (size_t)maxr * NH * HD * 4));
  CK(cudaMalloc(&QKV, (size_t)maxr * (NH + 2 * NKV) * HD * 4));
  CK(cudaMalloc(&S, (size_t)maxr * NH * maxc * 4));
  CK(cudaMalloc(&P, (size_t)maxr * NH * ATT_SPLITS * (HD + 2) * 4));
  CK(cudaMalloc(&C, maxr * NH * 4));
  CK(cudaMalloc(&pos, maxr * 4));
  CK(cudaMalloc(&slot, maxr * 4));
  CK(cudaMalloc(&qn, HD * 2));
  CK(cudaMalloc(&kn, HD * 2));
  CK(cudaMalloc(&invf, HD / 2 * 4));
  CK(cudaMemset(C, 0, maxr * NH * 4));
  fill_uniform_bf16<<<4096, 256>>>(K, layer * LAYERS, 1, 1.0f, 0.0f);
  fill_uniform_bf16<<<4096, 256>>>(V, layer * LAYERS, 2, 1.0f, 0.0f);
  fill_uniform_bf16<<<1, 128>>>(qn, HD, 3, 0.2f, 1.0f);
  fill_uniform_bf16<<<1, 128>>>(kn, HD, 4, 0.2f, 1.0f);
  fill_f32<<<256, 256>>>(Q, (size_t)maxr * NH * HD, 5, 1.0f);
  fill_f32<<<256, 256>>>(QKV, (size_t)maxr * (NH + 2 * NKV) * HD, 6, 1.0f);
  {
    std::vector<float> f(HD / 2);
    for (int i = 0; i < HD / 2; i++) f[i] = powf(1e6f, -2.0f * i / HD);
    CK(cudaMemcpy(invf, f.data(), f.size() * 4, cudaMemcpyHostToDevice));
  }
  CK(cudaDeviceSynchronize());
  cudaEvent_t ea, eb;
  CK(cudaEventCreate(&ea));
  CK(cudaEventCreate(&eb));
  const float scale = 1.0f / sqrtf((float)HD);

  // Rows at positions base + (r * spread) % 64 (slot r each), as decode rows of the bench;
  // returns the positions.
  auto set_rows = [&](int rows, int base, int spread) {
    std::vector<int> p(rows), s(rows);
    for (int r = 0; r < rows; r++) {
      p[r] = base + (r * spread) % 64;
      s[r] = r;
    }
    CK(cudaMemcpy(pos, p.data(), rows * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(slot, s.data(), rows * 4, cudaMemcpyHostToDevice));
    return p;
  };
  auto run = [&](const Kern& k, int rows, int li) {
    const int heads = k.qg == 1 ? NH : NKV;
    const int G = std::max(1, std::min(ATT_SPLITS, 528 / std::max(1, rows * heads)));
    const bf16_t *kc = K + layer * li, *vc = V + layer * li;
    dim3 grid(rows * G, heads);
    if (k.store)
      k.store<<<dim3(rows, NH + 2 * NKV), HD>>>(QKV, nullptr, qn, kn, invf, pos, slot, Q, K + layer * li,
                                               V + layer * li, NH, NKV, HD, maxc, 1e-6f, 0);
    if (k.rf)
      k.rf<<<grid, 256>>>(Q, kc, vc, pos, slot, S, P, C, O, NH, NKV, HD, maxc, scale, G, QKV, nullptr, qn, kn, invf,
                         1e-6f, 0);
    else
      k.f<<<grid, 256>>>(Q, kc, vc, pos, slot, S, P, C, O, NH, NKV, HD, maxc, scale, G);
  };
  struct Case {
    const char* name;
    int rows, base, spread;
    std::vector<Kern> ks;
  };
#ifdef OLD_KERNELS
#define OLDK(n, qg) {"old " #n, old::n, nullptr, qg}
#define OLDR(n) {"old " #n, nullptr, old::n, 1}
#define OLDS(n, qg) {"old qkv_rope_store + " #n, old::n, nullptr, qg, old::qkv_rope_store}
#else
#define OLDS(n, qg) {"cur qkv_rope_store + " #n, n, nullptr, qg, qkv_rope_store}
#define OLDK(n, qg) {"cur " #n, n, nullptr, qg}
#define OLDR(n) {"cur " #n, nullptr, n, 1}
#endif
  const std::vector<Kern> g4 = {OLDK(attention_rows_g4_b4, 4),
                                {"attention_rows_g4_b4", attention_rows_g4_b4, nullptr, 4},
                                {"attention_rows_g4_b4_pf", attention_rows_g4_b4_pf, nullptr, 4},
                                {"attention_rows_g4_b4_k4", attention_rows_g4_b4_k4, nullptr, 4},
                                {"x_g4_b4_pf1", x_g4_b4_pf1, nullptr, 4},
                                {"x_g4_b3_k4v16", x_g4_b3_k4v16, nullptr, 4},
                                {"x_g4_b2_k4v16", x_g4_b2_k4v16, nullptr, 4},
                                {"x_g4_b2_k8v16", x_g4_b2_k8v16, nullptr, 4},
                                {"attention_rows_g4_b3", attention_rows_g4_b3, nullptr, 4},
                                {"attention_rows_g4", attention_rows_g4, nullptr, 4},
                                {"attention_rows_h128", attention_rows_h128, nullptr, 1}};
  const std::vector<Kern> g4r = {OLDS(attention_rows_g4_b4, 4),
                                 {"attention_rope_rows_g4_b4", nullptr, attention_rope_rows_g4_b4, 4},
                                 {"attention_rope_rows_g4_b4_k4", nullptr, attention_rope_rows_g4_b4_k4, 4},
                                 {"qkv_rope_store + attention_rows_g4_b4", attention_rows_g4_b4, nullptr, 4,
                                  qkv_rope_store}};
  const std::vector<Kern> one = {OLDR(attention_rope_rows_deep),
                                 {"attention_rope_rows_deep_h128", nullptr, attention_rope_rows_deep_h128, 1},
                                 {"attention_rope_rows_deep", nullptr, attention_rope_rows_deep, 1},
                                 {"x_rope_deep_h128_pf0", nullptr, x_rope_deep_h128_pf0, 1},
                                 {"x_rope_deep_h128_pf1", nullptr, x_rope_deep_h128_pf1, 1},
                                 {"x_rope_deep_h128_k8", nullptr, x_rope_deep_h128_k8, 1}};
  const std::vector<Kern> few = {OLDK(attention_rows_deep, 1),
                                 {"attention_rows_deep_h128", attention_rows_deep_h128, nullptr, 1},
                                 {"attention_rows_deep", attention_rows_deep, nullptr, 1},
                                 {"x_deep_h128_pf0", x_deep_h128_pf0, nullptr, 1},
                                 {"attention_rows_h128", attention_rows_h128, nullptr, 1}};
  const std::vector<Case> cases = {
      {"64 rows ctx 128-191", 64, 128, 1, g4},  {"64 rows ctx 64-127", 64, 64, 1, g4},
      {"64 rows rope 128-191", 64, 128, 1, g4r}, {"32 rows rope 300-363", 32, 300, 2, g4r},
      {"64 rows rope 1000", 64, 1000, 7, g4r},  {"64 rows ctx 1000-1063", 64, 1000, 7, g4},
      {"16 rows ctx 128-143", 16, 128, 1, few}, {"4 rows ctx 128-131", 4, 128, 1, few},
      {"4 rows ctx 3000", 4, 3000, 1, few},     {"1 row ctx 128", 1, 127, 0, one},
      {"1 row ctx 300", 1, 299, 0, one},        {"1 row ctx 4096", 1, 4095, 0, one}};
  const size_t on = (size_t)maxr * NH * HD;
  std::vector<unsigned short> ref(on), out(on), kref, kout;
  for (const Case& c : cases) {
    const std::vector<int> p = set_rows(c.rows, c.base, c.spread);
    long long keys = 0;
    for (int r = 0; r < c.rows; r++) keys += p[r] + 1;
    // Element offset of row r's k / v (slot r, its position) in layer 0 of the cache.
    auto kv_row = [&](int r) { return ((size_t)r * maxc + p[r]) * NKV * HD; };
    for (size_t ki = 0; ki < c.ks.size(); ki++) {
      const Kern& k = c.ks[ki];
      CK(cudaMemset(O, 0, on * 2));
      if (ki > 0 && (k.rf || k.store)) {
        // Poison the rows' k / v (the previous kernel wrote them), so this one must write them.
        for (int r = 0; r < c.rows; r++) {
          CK(cudaMemset(K + kv_row(r), 0x7f, NKV * HD * 2));
          CK(cudaMemset(V + kv_row(r), 0x7f, NKV * HD * 2));
        }
      }
      run(k, c.rows, 0);
      CK(cudaGetLastError());
      CK(cudaDeviceSynchronize());
      CK(cudaMemcpy(out.data(), O, (size_t)c.rows * NH * HD * 2, cudaMemcpyDeviceToHost));
      // The RoPE kernels write each row's k / v at its slot and position: compare those too.
      std::vector<unsigned short> kv(2 * NKV * HD * c.rows);
      if (k.rf || k.store) {
        for (int r = 0; r < c.rows; r++) {
          CK(cudaMemcpy(kv.data() + 2 * r * NKV * HD, K + kv_row(r), NKV * HD * 2, cudaMemcpyDeviceToHost));
          CK(cudaMemcpy(kv.data() + (2 * r + 1) * NKV * HD, V + kv_row(r), NKV * HD * 2, cudaMemcpyDeviceToHost));
        }
      }
      const char* verdict = "reference";
      if (ki == 0) {
        ref = out;
        kref = kv;
      } else {
        const bool eq = memcmp(ref.data(), out.data(), (size_t)c.rows * NH * HD * 2) == 0 && kv == kref;
        verdict = eq ? "bits equal" : "BITS DIFFER";
      }
      for (int i = 0; i < 3; i++) run(k, c.rows, 1 + i % (LAYERS - 1));
      CK(cudaEventRecord(ea));
      for (int i = 0; i < reps; i++) run(k, c.rows, 1 + i % (LAYERS - 1));
      CK(cudaEventRecord(eb));
      CK(cudaEventSynchronize(eb));
      float ms = 0;
      CK(cudaEventElapsedTime(&ms, ea, eb));
      const double us = 1000.0 * ms / reps;
      const double gbs = (double)keys * NKV * HD * 2 * 2 / (us * 1e3);
      printf("%-22s %-32s %8.2f us  %7.1f GB/s  %s\n", c.name, k.name, us, gbs, verdict);
    }
  }
  return 0;
}
