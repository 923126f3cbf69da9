// GEMM micro-benchmark for the device: Specula's GEMM kernels (kernels.cu, included) alone, on
// random bf16 weights, at the qwen3-8b layer shapes, timed with CUDA events, so a profiler
// (ncu) can be pointed at one kernel without the rest of `specula bench`.
//
// Build (here, no GPU needed):
//   nvcc -arch=sm_90 -O3 -std=c++17 -o /tmp/gemm_micro scripts/gemm_micro.cu
// Run (device): gemm_micro [ROWS [REPS]]   prints one line per kernel and shape:
//   kernel, shape, microseconds a launch, weight GB/s.
// Under ncu: ncu --clock-control none -k regex:NAME -c 1 gemm_micro 64 3
#include "../crates/specula-engine/src/cuda/kernels.cu"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#define CK(x)                                                                    \
  do {                                                                           \
    cudaError_t e = (x);                                                         \
    if (e != cudaSuccess) {                                                      \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e)); \
      exit(1);                                                                   \
    }                                                                            \
  } while (0)

typedef void (*GemmFn)(const void*, const float*, const bf16_t*, const float*, float*, int, int, int, bf16_t*);
typedef void (*SeqFn)(const void*, const float*, const bf16_t*, const float*, float*, int, int, int, bf16_t*,
                      float*, int*);

struct Shape {
  const char* name;
  int n, k;
  bool silu;
};

int main(int argc, char** argv) {
  const int M = argc > 1 ? atoi(argv[1]) : 64;
  const int reps = argc > 2 ? atoi(argv[2]) : 50;
  const Shape shapes[] = {
      {"gate_up", 24576, 4096, true}, {"down", 4096, 12288, false}, {"qkv", 6144, 4096, false}, {"o", 4096, 4096, false}};
  size_t wmax = 24576ull * 4096;
  bf16_t *W, *X, *Act;
  float *Y, *P;
  int* C;
  CK(cudaMalloc(&W, wmax * 2));
  CK(cudaMalloc(&X, (size_t)M * 12288 * 2));
  CK(cudaMalloc(&Act, (size_t)M * 12288 * 2));
  CK(cudaMalloc(&Y, (size_t)M * 24576 * 4));
  CK(cudaMalloc(&P, 256ull * 8 * 128 * 64 * 4));
  CK(cudaMalloc(&C, 256 * 4));
  CK(cudaMemset(C, 0, 256 * 4));
  fill_uniform_bf16<<<4096, 256>>>(W, wmax, 1, 0.02f, 0.0f);
  fill_uniform_bf16<<<256, 256>>>(X, (size_t)M * 12288, 2, 1.0f, 0.0f);
  CK(cudaDeviceSynchronize());
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));

  struct Tile {
    const char* name;
    GemmFn plain, silu;
    int mt, nt, smem, groups;
  };
  const Tile tiles[] = {
      {"2x8", gemm_bf16_2x8, gemm_bf16_2x8_silu, 2, 8, 0, 1},
      {"2x8_pipe", gemm_bf16_2x8_pipe, gemm_bf16_2x8_pipe_silu, 2, 8, 3 * 2 * 2 * 2 * 256 * 16, 1},
      {"2x8_px", gemm_bf16_2x8_px, gemm_bf16_2x8_px_silu, 2, 8, 3 * 12 * 256 * 16, 1},
      {"2x8_px4", gemm_bf16_2x8_px4, gemm_bf16_2x8_px4_silu, 2, 8, 4 * 12 * 256 * 16, 1},
      {"2x8_px2", gemm_bf16_2x8_px2, gemm_bf16_2x8_px2_silu, 2, 8, 2 * 12 * 256 * 16, 1},
      {"2x8_pp", gemm_bf16_2x8_pp, gemm_bf16_2x8_pp_silu, 2, 8, 3 * 16 * 256 * 16, 2},
      {"2x4", gemm_bf16_2x4, gemm_bf16_2x4_silu, 2, 4, 0, 1},
      {"1x2_db", gemm_bf16_1x2_db, gemm_bf16_1x2_silu_db, 1, 2, 0, 1},
      {"1x1", gemm_bf16_1x1, gemm_bf16_1x1_silu, 1, 1, 0, 1},
  };
  struct Seq {
    const char* name;
    SeqFn plain, silu;
    int rt, smem;
  };
  const Seq seqs[] = {
      {"seq", gemm_seq_bf16, gemm_seq_bf16_silu, 64, 4 * 4 * 64 * 64},
      {"seq32", gemm_seq32_bf16, gemm_seq32_bf16_silu, 32, 4 * 4 * 32 * 64},
  };
  for (const Shape& s : shapes) {
    const double gb = (double)s.n * s.k * 2 / 1e9;
    auto report = [&](const char* kname, float ms) {
      const double us = ms * 1000.0 / reps;
      printf("%-10s %-8s M=%d n=%d k=%d: %8.2f us  %6.0f GB/s\n", kname, s.name, M, s.n, s.k, us, gb / (us * 1e-6));
    };
    for (const Tile& t : tiles) {
      if (M > t.nt * 8 * 8 && t.nt < 8) continue;  // narrow tiles only for few rows
      GemmFn f = s.silu ? t.silu : t.plain;
      if (t.smem) CK(cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize, t.smem));
      dim3 grid((M + t.nt * 8 - 1) / (t.nt * 8), (s.n + t.mt * 16 * t.groups - 1) / (t.mt * 16 * t.groups));
      const int threads = 256 * t.groups;
      for (int w = 0; w < 3; w++) f<<<grid, threads, t.smem>>>(W, nullptr, X, nullptr, Y, M, s.n, s.k, s.silu ? Act : nullptr);
      CK(cudaEventRecord(a));
      for (int r = 0; r < reps; r++)
        f<<<grid, threads, t.smem>>>(W, nullptr, X, nullptr, Y, M, s.n, s.k, s.silu ? Act : nullptr);
      CK(cudaEventRecord(b));
      CK(cudaEventSynchronize(b));
      CK(cudaGetLastError());
      float ms;
      CK(cudaEventElapsedTime(&ms, a, b));
      report(t.name, ms);
    }
    if (M <= 32) continue;
    for (const Seq& q : seqs) {
      SeqFn f = s.silu ? q.silu : q.plain;
      CK(cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize, q.smem));
      const int tiles_n = (s.n + 127) / 128, tiles_m = (M + q.rt - 1) / q.rt;
      for (int ks = 1; ks <= 8; ks *= 2) {
        if (ks > 1 && tiles_n * tiles_m > 256) break;
        dim3 grid(tiles_m, tiles_n, ks);
        for (int w = 0; w < 3; w++)
          f<<<grid, 256, q.smem>>>(W, nullptr, X, nullptr, Y, M, s.n, s.k, s.silu ? Act : nullptr, P, C);
        CK(cudaEventRecord(a));
        for (int r = 0; r < reps; r++)
          f<<<grid, 256, q.smem>>>(W, nullptr, X, nullptr, Y, M, s.n, s.k, s.silu ? Act : nullptr, P, C);
        CK(cudaEventRecord(b));
        CK(cudaEventSynchronize(b));
        CK(cudaGetLastError());
        float ms;
        CK(cudaEventElapsedTime(&ms, a, b));
        char nm[32];
        snprintf(nm, sizeof nm, "%s/ks%d", q.name, ks);
        report(nm, ms);
      }
    }
  }
  return 0;
}
