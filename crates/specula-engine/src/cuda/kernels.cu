// Specula's CUDA kernels: the decode / verify forward of a dense Llama / Qwen2 / Qwen3 model.
//
// The promise these kernels keep is batch invariance: every output row is computed by the same
// instructions in the same order whatever the number of rows in the launch (and whatever the
// other rows are), so the logits of row i of a (k+1)-row verify are bitwise equal to a one-row
// decode at the same position. How:
//   * gemm_{bf16,q8}_{MT}x{NT}: tensor cores for every row count; the K split and the fold
//     order of one output depend on K only (the comment above gemm_impl says how), so the tile
//     chosen for a row count changes speed, never bits.
//   * gemv_m{M} (the reference kernels, SPECULA_CUDA_GEMM=gemv): one warp owns RW output
//     features; each lane walks K in 8-element chunks at lane, lane+32, ... and folds them into
//     one f32 accumulator per (row, feature) with round-to-nearest FMAs in that fixed order,
//     then a fixed xor-butterfly across the warp. M (1..16) only changes how many accumulators
//     a lane keeps, never the order of one accumulator's operations.
//   * rmsnorm / attention / argmax: one block per row (and head) with a fixed-shape block
//     reduction; what a row reads depends only on its own position and slot.
// Build: nvcc -fatbin for sm_90 machine code plus compute_90 PTX (build.rs), without fast-math (expf, rsqrtf and sincosf are
// the IEEE-faithful library versions; nothing is reassociated).

#include <cuda_bf16.h>
#include <stdint.h>

typedef unsigned short bf16_t;  // raw bf16 bits

__device__ __forceinline__ float bf_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf_hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }
__device__ __forceinline__ float bf2f(bf16_t b) { return __uint_as_float(((uint32_t)b) << 16); }
__device__ __forceinline__ bf16_t f2bf(float f) {
  __nv_bfloat16 b = __float2bfloat16_rn(f);
  return *reinterpret_cast<bf16_t*>(&b);
}

__device__ __forceinline__ void unpack8(const uint4& v, float* f) {
  f[0] = bf_lo(v.x); f[1] = bf_hi(v.x);
  f[2] = bf_lo(v.y); f[3] = bf_hi(v.y);
  f[4] = bf_lo(v.z); f[5] = bf_hi(v.z);
  f[6] = bf_lo(v.w); f[7] = bf_hi(v.w);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Programmatic dependent launch (sm_90; no-ops when a kernel is launched without it): wait
// until the previous kernel in the stream has finished and its writes are visible, and let
// the next kernel start its own prologue. Every kernel waits before touching activations.
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void pdl_launch() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }

// Fixed-order block reductions: warp butterflies, then every warp folds the per-warp values the
// same way, so every thread returns the same bits. `sh` holds 32 floats.
__device__ float block_sum(float v, float* sh) {
  int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
  v = warp_sum(v);
  __syncthreads();
  if (lane == 0) sh[w] = v;
  __syncthreads();
  float t = lane < nw ? sh[lane] : 0.0f;
  return warp_sum(t);
}

__device__ float block_max(float v, float* sh) {
  int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) sh[w] = v;
  __syncthreads();
  float t = lane < nw ? sh[lane] : -INFINITY;
  return warp_max(t);
}

// block_sum (MAX false) / block_max (MAX true) of N values at once: value j gets the bits
// block_sum / block_max give it alone. `sh` holds N x 32 floats.
template <int N, bool MAX>
__device__ void block_reduce_n(float (&v)[N], float (*sh)[32]) {
  int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
#pragma unroll
  for (int j = 0; j < N; j++) v[j] = MAX ? warp_max(v[j]) : warp_sum(v[j]);
  __syncthreads();
  if (lane == 0)
#pragma unroll
    for (int j = 0; j < N; j++) sh[j][w] = v[j];
  __syncthreads();
#pragma unroll
  for (int j = 0; j < N; j++)
    v[j] = MAX ? warp_max(lane < nw ? sh[j][lane] : -INFINITY) : warp_sum(lane < nw ? sh[j][lane] : 0.0f);
}

// One row of RMSNorm by a whole block: y = bf16(x * rsqrt(mean(x^2) + eps) * w), H a multiple
// of 4. Each thread folds the squares of its float4s i4 = tid, tid + blockDim, ... in that order
// (the loads of up to 8 of them issued together, so a row costs one memory round trip, where a
// scalar loop paid one per element), then block_sum: the bits depend only on the row and the
// block size (256 everywhere).
__device__ __forceinline__ float4 ld_f4(const float* p) { return *reinterpret_cast<const float4*>(p); }
// The kernel's PDL wait is in here: the weights (constant) load before it, x after.
__device__ __forceinline__ void rmsnorm_row(const float* x, const bf16_t* __restrict__ w, bf16_t* y, int H, float eps,
                                            float* sh) {
  constexpr int V = 8;
  const int n4 = H / 4, nt = blockDim.x;
  float4 v[V];
  uint2 wv[V];
  if (n4 <= V * nt) {
#pragma unroll
    for (int j = 0; j < V; j++) {
      const int i4 = threadIdx.x + j * nt;
      wv[j] = i4 < n4 ? *reinterpret_cast<const uint2*>(w + 4 * i4) : make_uint2(0, 0);
    }
  }
  pdl_wait();
  pdl_launch();
  float ss = 0.0f;
  for (int base = 0; base < n4; base += V * nt) {
#pragma unroll
    for (int j = 0; j < V; j++) {
      const int i4 = base + threadIdx.x + j * nt;
      v[j] = i4 < n4 ? ld_f4(x + 4 * i4) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
#pragma unroll
    for (int j = 0; j < V; j++) {
      ss = __fmaf_rn(v[j].x, v[j].x, ss);
      ss = __fmaf_rn(v[j].y, v[j].y, ss);
      ss = __fmaf_rn(v[j].z, v[j].z, ss);
      ss = __fmaf_rn(v[j].w, v[j].w, ss);
    }
  }
  ss = block_sum(ss, sh);
  const float inv = rsqrtf(ss / (float)H + eps);
  auto out = [&](const float4& a, const uint2& b, int i4) {
    const uint32_t lo = (uint32_t)f2bf(a.x * inv * bf_lo(b.x)) | ((uint32_t)f2bf(a.y * inv * bf_hi(b.x)) << 16);
    const uint32_t hi = (uint32_t)f2bf(a.z * inv * bf_lo(b.y)) | ((uint32_t)f2bf(a.w * inv * bf_hi(b.y)) << 16);
    *reinterpret_cast<uint2*>(y + 4 * i4) = make_uint2(lo, hi);
  };
  if (n4 <= V * nt) {  // the row is still in registers
#pragma unroll
    for (int j = 0; j < V; j++) {
      const int i4 = threadIdx.x + j * nt;
      if (i4 < n4) out(v[j], wv[j], i4);
    }
  } else {
    for (int i4 = threadIdx.x; i4 < n4; i4 += nt)
      out(ld_f4(x + 4 * i4), *reinterpret_cast<const uint2*>(w + 4 * i4), i4);
  }
}

// SiLU(g) * u rounded to bf16: the silu_mul kernel and the gate/up GEMM's SiLU epilogue.
__device__ __forceinline__ bf16_t silu_mul1(float g, float u) { return f2bf(g / (1.0f + expf(-g)) * u); }

// ---------------------------------------------------------------------------------------------
// Y[m, n] = sum_k W[n, k] * X[m, k] (+ R[m, n]) for m < M, n < N.
// W: bf16 [N, K] row-major; X: bf16 [M, K]; R, Y: f32 [M, N] (R may alias Y, or be null).
// K must be a multiple of 8. Block: 256 threads (8 warps), each warp RW consecutive features.
template <int M, int RW, int U>
__device__ __forceinline__ void gemv_impl(const bf16_t* __restrict__ W, const bf16_t* __restrict__ X,
                                          const float* R, float* Y, int N, int K) {
  pdl_wait();
  pdl_launch();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int n0 = (blockIdx.x * (blockDim.x >> 5) + warp) * RW;
  if (n0 >= N) return;
  const int KV = K >> 3;
  const uint4* wrow[RW];
#pragma unroll
  for (int r = 0; r < RW; r++) {
    int n = min(n0 + r, N - 1);
    wrow[r] = reinterpret_cast<const uint4*>(W + (size_t)n * K);
  }
  const uint4* xv = reinterpret_cast<const uint4*>(X);
  float acc[M][RW];
#pragma unroll
  for (int m = 0; m < M; m++)
#pragma unroll
    for (int r = 0; r < RW; r++) acc[m][r] = 0.0f;

  int kv = lane;
  // U chunks per lane in flight; the fold order per accumulator is kv, kv+32, kv+64, ... as in
  // the tail loop below, so U changes speed only.
  for (; kv + 32 * (U - 1) < KV; kv += 32 * U) {
    uint4 wv[U][RW];
#pragma unroll
    for (int u = 0; u < U; u++)
#pragma unroll
      for (int r = 0; r < RW; r++) wv[u][r] = __ldcs(wrow[r] + kv + 32 * u);
#pragma unroll
    for (int u = 0; u < U; u++) {
      float wf[RW][8];
#pragma unroll
      for (int r = 0; r < RW; r++) unpack8(wv[u][r], wf[r]);
#pragma unroll
      for (int m = 0; m < M; m++) {
        float xf[8];
        unpack8(__ldg(xv + (size_t)m * KV + kv + 32 * u), xf);
#pragma unroll
        for (int r = 0; r < RW; r++)
#pragma unroll
          for (int j = 0; j < 8; j++) acc[m][r] = __fmaf_rn(wf[r][j], xf[j], acc[m][r]);
      }
    }
  }
  for (; kv < KV; kv += 32) {
    float wf[RW][8];
#pragma unroll
    for (int r = 0; r < RW; r++) unpack8(__ldcs(wrow[r] + kv), wf[r]);
#pragma unroll
    for (int m = 0; m < M; m++) {
      float xf[8];
      unpack8(__ldg(xv + (size_t)m * KV + kv), xf);
#pragma unroll
      for (int r = 0; r < RW; r++)
#pragma unroll
        for (int j = 0; j < 8; j++) acc[m][r] = __fmaf_rn(wf[r][j], xf[j], acc[m][r]);
    }
  }
#pragma unroll
  for (int m = 0; m < M; m++)
#pragma unroll
    for (int r = 0; r < RW; r++) {
      float s = warp_sum(acc[m][r]);
      int n = n0 + r;
      if (lane == 0 && n < N) {
        size_t i = (size_t)m * N + n;
        Y[i] = R ? R[i] + s : s;
      }
    }
}

#define GEMV(M, U)                                                                             \
  extern "C" __global__ void __launch_bounds__(256)                                            \
      gemv_m##M(const bf16_t* W, const bf16_t* X, const float* R, float* Y, int N, int K) {    \
    gemv_impl<M, 2, U>(W, X, R, Y, N, K);                                                      \
  }
GEMV(1, 4) GEMV(2, 4) GEMV(3, 4) GEMV(4, 4) GEMV(5, 2) GEMV(6, 2) GEMV(7, 2) GEMV(8, 2)
GEMV(9, 1) GEMV(10, 1) GEMV(11, 1) GEMV(12, 1) GEMV(13, 1) GEMV(14, 1) GEMV(15, 1) GEMV(16, 1)

// ---------------------------------------------------------------------------------------------
// Tensor-core GEMM for every row count: Y[m, n] = sum_k W[n, k] X[m, k] (+ R[m, n]).
// W: bf16 [N, K] (or Q8_0: int8 [N, K] with f32 scales [N, ceil(K/32)], one per 32-wide
// chunk); X: bf16 [M, K]; R, Y: f32 [M, N]. K a multiple of 8.
//
// Batch invariance: a block owns 16·MT features and 8·NT rows; its 8 warps split K into 8
// slices of whole 32-wide chunks (the split depends on K only). In its slice a warp folds each
// chunk into its accumulators with two mma.sync.m16n8k16 (features as the A operand, input rows
// as B), in chunk order; then the 8 slice partials of an output are added in slice order and
// the residual last. Every step of that is the same for an output whatever M, MT or NT are: an
// mma's output element depends only on its own row of A, column of B and accumulator, and a
// row's place in the tile changes nothing. So one row decoded alone and the same row inside a
// 64-row batch get the same bits. Zero-padded chunk lanes and rows are the same for every M.
// Within a chunk the k order is permuted (lane tig holds k = 8 tig .. 8 tig + 7 and feeds half
// to each mma) identically for W and X, which keeps the dot product and allows 16-byte loads.
// Q8_0: each chunk's two mmas fold into a zeroed partial that is scaled and added:
// acc = fma(d, partial, acc), the llama.cpp Q8_0 block (32 weights, one scale).
__device__ __forceinline__ void mma16816(float* c, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Two int8 weights to a bf16 pair (exact: |q| <= 128 fits bf16's 8-bit significand).
__device__ __forceinline__ uint32_t i8x2_bf16x2(uint32_t w, int shift) {
  float lo = (float)(int)(signed char)((w >> shift) & 0xff);
  float hi = (float)(int)(signed char)((w >> (shift + 8)) & 0xff);
  return (uint32_t)f2bf(lo) | ((uint32_t)f2bf(hi) << 16);
}

#define GEMM_SLICES 8

// A 16-byte weight load that bypasses L1 and asks L2 to fetch the whole 256-byte span (a warp
// reads 64 contiguous bytes of a row per load, and the next chunks follow).
__device__ __forceinline__ uint4 ld_stream16(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

// cp.async of 16 bytes into shared memory, zero-filled when `ok` is false (nothing is read then).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool ok) {
  const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(d), "l"(src), "r"(ok ? 16 : 0) : "memory");
}

// cp.async of one lane's weight piece (16 bytes of bf16, or 8 of Q8_0 int8) into shared memory,
// zero-filled when `ok` is false (nothing is read then).
__device__ __forceinline__ void cp_async_w(void* dst, const void* src, bool ok, bool q8) {
  const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  if (q8)
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;" ::"r"(d), "l"(src), "r"(ok ? 8 : 0) : "memory");
  else
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;" ::"r"(d), "l"(src), "r"(ok ? 16 : 0)
                 : "memory");
}

// S = 0: each lane holds the weights of its next U chunks in registers (load_w), which caps the
// bytes in flight by the registers the tile's accumulators leave. S >= 2: the weights stream
// through an S-stage cp.async ring in dynamic shared memory ([S][U][MT][2][256 lanes] x 16
// bytes), S - 1 groups of U chunks ahead; each lane reads back only what it copied, so no barrier
// is needed. Same loads, same fold: the same bits either way.
//
// SILU (the `_silu` kernels, for the gate/up GEMM, R null): the matrix's rows are gate and up
// features interleaved in groups of 8, so a block holds both halves of each pair; it writes
// Act[m, f] = silu_mul1(g, u) (bf16 [M, N / 2]) instead of Y: each output is the same fold, and
// the values are the silu_mul kernel's. A compile-time switch: the plain kernels keep the code
// (and the speed) they had without it.
//
// XR (with S >= 2, the `_px` kernels): the X fragments go through the same ring, each lane
// copying the 16-byte pieces it later reads ([S][U][NT][256 lanes] x 16 bytes after the
// weights), so a fold no longer waits on an L2 round trip for its X. Same values, same fold.
//
// FG > 1 (with XR, the `_pp` kernels: 256 x FG threads): FG feature groups of 16 MT features a
// block, warp w folding K slice w % 8 of group w / 8, so the FG warps of one slice read the same
// X pieces: each copies 1 / FG of them into the ring and a named barrier per slice (the FG warps
// of it) orders the copies before the reads and the reads before the next copy into that stage.
// A block streams FG times the weights for the same X bytes. Each warp's fold is the one it has
// with FG = 1: the same bits.
template <int MT, int NT, int U, bool Q8, int S = 0, bool SILU = false, bool XR = false, int FG = 1>
__device__ __forceinline__ void gemm_impl(const void* __restrict__ Wp, const float* __restrict__ Ws,
                                          const bf16_t* __restrict__ X, const float* R, float* Y, int M,
                                          int N, int K, bf16_t* Act) {
  static_assert(FG == 1 || (XR && NT % FG == 0), "feature groups share X through the ring");
  __shared__ float red[FG * GEMM_SLICES][MT * 16][9];
  const int warp = FG > 1 ? (threadIdx.x >> 5) % GEMM_SLICES : threadIdx.x >> 5, lane = threadIdx.x & 31,
            gid = lane >> 2, tig = lane & 3;
  const int fg = FG > 1 ? (threadIdx.x >> 5) / GEMM_SLICES : 0;
  // The lane's index among the 256 threads of its feature group.
  const int glane = FG > 1 ? threadIdx.x & 255 : threadIdx.x;
  const int r0 = blockIdx.x * (NT * 8);
  const int fb = blockIdx.y * (FG * MT * 16);
  const int f0 = fb + fg * (MT * 16);
  const int nch = (K + 31) >> 5;
  const int per = (nch + GEMM_SLICES - 1) / GEMM_SLICES;
  const int cbeg = min(warp * per, nch), cend = min(cbeg + per, nch);

  // The two weight rows this lane reads per m-tile (gid and gid + 8), clamped to N - 1 (their
  // results are never written).
  int wrow[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; mt++)
#pragma unroll
    for (int h = 0; h < 2; h++) wrow[mt][h] = min(f0 + mt * 16 + gid + 8 * h, N - 1);
  // The input rows this lane reads per n-tile; -1: past M (zeros).
  int xrow[NT];
#pragma unroll
  for (int nt = 0; nt < NT; nt++) xrow[nt] = r0 + nt * 8 + gid < M ? r0 + nt * 8 + gid : -1;

  float acc[MT][NT][4];
#pragma unroll
  for (int mt = 0; mt < MT; mt++)
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
      for (int i = 0; i < 4; i++) acc[mt][nt][i] = 0.0f;

  // Weight loads of U chunks from chunk c (zeros past the slice or K).
  auto load_w = [&](uint4 (&wa)[U][MT][2], int c) {
#pragma unroll
    for (int u = 0; u < U; u++) {
      const int k = (c + u) * 32 + tig * 8;
      const bool ok = c + u < cend && k < K;
#pragma unroll
      for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
          if (!ok) {
            wa[u][mt][h] = make_uint4(0, 0, 0, 0);
          } else if (Q8) {
            const uint2 q = __ldcs(reinterpret_cast<const uint2*>(
                reinterpret_cast<const signed char*>(Wp) + (size_t)wrow[mt][h] * K + k));
            wa[u][mt][h] = make_uint4(q.x, q.y, 0, 0);
          } else {
            wa[u][mt][h] = ld_stream16(reinterpret_cast<const bf16_t*>(Wp) + (size_t)wrow[mt][h] * K + k);
          }
        }
    }
  };
  // The math of U chunks from chunk c whose weights are in wa: every X fragment of the U chunks
  // is loaded first (they come from L2), then the mmas run.
  extern __shared__ uint4 wsm[];
  // The ring's X piece of (stage, u, nt) for this lane (XR).
  auto xslot = [&](int stage, int u, int nt) -> uint4* {
    return wsm + S * U * MT * 2 * 256 * FG + ((stage * U + u) * NT + nt) * 256 + glane;
  };
  auto fold = [&](const uint4 (&wa)[U][MT][2], int c, int stage = 0) {
    uint4 xb[U][NT];
#pragma unroll
    for (int u = 0; u < U; u++) {
      const int k = (c + u) * 32 + tig * 8;
      const bool ok = c + u < cend && k < K;
#pragma unroll
      for (int nt = 0; nt < NT; nt++) {
        if constexpr (XR)
          xb[u][nt] = *xslot(stage, u, nt);
        else
          xb[u][nt] = (ok && xrow[nt] >= 0) ? __ldg(reinterpret_cast<const uint4*>(X + (size_t)xrow[nt] * K + k))
                                            : make_uint4(0, 0, 0, 0);
      }
    }
#pragma unroll
    for (int u = 0; u < U; u++) {
      if (c + u < cend) {  // warp-uniform
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
          uint4 a = wa[u][mt][0], b = wa[u][mt][1];
          if (Q8) {
            // int8 lanes: bytes 0-3 of .x are k 0..3, of .y k 4..7.
            a = make_uint4(i8x2_bf16x2(a.x, 0), i8x2_bf16x2(a.x, 16), i8x2_bf16x2(a.y, 0), i8x2_bf16x2(a.y, 16));
            b = make_uint4(i8x2_bf16x2(b.x, 0), i8x2_bf16x2(b.x, 16), i8x2_bf16x2(b.y, 0), i8x2_bf16x2(b.y, 16));
          }
          float sa = 0.0f, sb = 0.0f;
          if (Q8) {
            sa = __ldg(Ws + (size_t)wrow[mt][0] * nch + c + u);
            sb = __ldg(Ws + (size_t)wrow[mt][1] * nch + c + u);
          }
#pragma unroll
          for (int nt = 0; nt < NT; nt++) {
            if (Q8) {
              float p[4] = {0.0f, 0.0f, 0.0f, 0.0f};
              mma16816(p, a.x, b.x, a.y, b.y, xb[u][nt].x, xb[u][nt].y);
              mma16816(p, a.z, b.z, a.w, b.w, xb[u][nt].z, xb[u][nt].w);
              acc[mt][nt][0] = __fmaf_rn(sa, p[0], acc[mt][nt][0]);
              acc[mt][nt][1] = __fmaf_rn(sa, p[1], acc[mt][nt][1]);
              acc[mt][nt][2] = __fmaf_rn(sb, p[2], acc[mt][nt][2]);
              acc[mt][nt][3] = __fmaf_rn(sb, p[3], acc[mt][nt][3]);
            } else {
              mma16816(acc[mt][nt], a.x, b.x, a.y, b.y, xb[u][nt].x, xb[u][nt].y);
              mma16816(acc[mt][nt], a.z, b.z, a.w, b.w, xb[u][nt].z, xb[u][nt].w);
            }
          }
        }
      }
    }
  };

  // The first U chunks' weights load before waiting for the previous kernel (weights are
  // constant), so with programmatic dependent launch the weight stream starts while the
  // previous kernel finishes.
  uint4 wa[U][MT][2];
  if constexpr (S == 0) {
    load_w(wa, cbeg);
    pdl_wait();
    pdl_launch();
    for (int c = cbeg; c < cend; c += U) {
      fold(wa, c);
      if (c + U < cend) load_w(wa, c + U);
    }
  } else if constexpr (S < 0) {
    // Two register batches of U chunks, alternating: one batch's loads stay in flight while
    // the other folds (S = 0 leaves the weight stream idle during each fold).
    uint4 wb[U][MT][2];
    load_w(wa, cbeg);
    load_w(wb, cbeg + U);
    pdl_wait();
    pdl_launch();
    for (int c = cbeg; c < cend; c += 2 * U) {
      fold(wa, c);
      if (c + 2 * U < cend) load_w(wa, c + 2 * U);
      if (c + U < cend) {
        fold(wb, c + U);
        if (c + 3 * U < cend) load_w(wb, c + 3 * U);
      }
    }
  } else {
    auto slot = [&](int stage, int u, int mt, int h) -> uint4* {
      return wsm + ((((stage * U + u) * MT + mt) * 2 + h) * (256 * FG) + threadIdx.x);
    };
    // Copy the weights of chunks c .. c + U - 1 into `stage` (not committed).
    auto copy_w = [&](int stage, int c) {
#pragma unroll
      for (int u = 0; u < U; u++) {
        const int k = (c + u) * 32 + tig * 8;
        const bool ok = c + u < cend && k < K;
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
          for (int h = 0; h < 2; h++) {
            const size_t e = (size_t)wrow[mt][h] * K + k;
            const void* src = !ok ? Wp
                              : Q8 ? (const void*)(reinterpret_cast<const signed char*>(Wp) + e)
                                   : (const void*)(reinterpret_cast<const bf16_t*>(Wp) + e);
            cp_async_w(slot(stage, u, mt, h), src, ok, Q8);
          }
      }
    };
    // The same as one commit group (maybe empty).
    auto issue = [&](int stage, int c) {
      copy_w(stage, c);
      cp_async_commit();
    };
    // XR: the X pieces of chunks c .. c + U - 1 into `stage` (zeros past the slice, K or M).
    auto issue_x = [&](int stage, int c) {
#pragma unroll
      for (int u = 0; u < U; u++) {
        const int k = (c + u) * 32 + tig * 8;
        const bool ok = c + u < cend && k < K;
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
          if (FG > 1 && nt / (NT / FG) != fg) continue;  // another group's warp copies it
          const bool in = ok && xrow[nt] >= 0;
          cp_async16(xslot(stage, u, nt), in ? (const void*)(X + (size_t)xrow[nt] * K + k) : (const void*)X, in);
        }
      }
    };
    if constexpr (XR) {
      // Weights are constant: the first S - 1 stages' weights are copied before the wait for
      // the previous kernel, then their X after it, one commit group a stage: the first group
      // holds all those weights and X of stage 0, the next ones X of stages 1 .. S - 2. So a
      // stage's weights and X are done when its group is, and wait_group S - 2 still covers
      // both (the loop then commits each stage's X and weights as one group).
#pragma unroll
      for (int s = 0; s < S - 1; s++) copy_w(s, cbeg + s * U);
      pdl_wait();
      pdl_launch();
#pragma unroll
      for (int s = 0; s < S - 1; s++) {
        issue_x(s, cbeg + s * U);
        cp_async_commit();
      }
    } else {
#pragma unroll
      for (int s = 0; s < S - 1; s++) issue(s, cbeg + s * U);
      pdl_wait();
      pdl_launch();
    }
    int stage = 0;
    for (int c = cbeg; c < cend; c += U) {
      asm volatile("cp.async.wait_group %0;" ::"n"(S - 2) : "memory");
      if constexpr (FG > 1) asm volatile("bar.sync %0, %1;" ::"r"(1 + warp), "n"(32 * FG) : "memory");
#pragma unroll
      for (int u = 0; u < U; u++)
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
          for (int h = 0; h < 2; h++) {
            const uint4 v = *slot(stage, u, mt, h);
            wa[u][mt][h] = Q8 ? make_uint4(v.x, v.y, 0, 0) : v;
          }
      if constexpr (XR) issue_x(stage == 0 ? S - 1 : stage - 1, c + (S - 1) * U);
      issue(stage == 0 ? S - 1 : stage - 1, c + (S - 1) * U);
      fold(wa, c, stage);
      stage = stage + 1 == S ? 0 : stage + 1;
    }
  }

  // Fold the 8 slice partials in slice order, one n-tile at a time.
#pragma unroll
  for (int nt = 0; nt < NT; nt++) {
    __syncthreads();
    const int wr = fg * GEMM_SLICES + warp;
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
      red[wr][mt * 16 + gid][2 * tig] = acc[mt][nt][0];
      red[wr][mt * 16 + gid][2 * tig + 1] = acc[mt][nt][1];
      red[wr][mt * 16 + gid + 8][2 * tig] = acc[mt][nt][2];
      red[wr][mt * 16 + gid + 8][2 * tig + 1] = acc[mt][nt][3];
    }
    __syncthreads();
    if constexpr (SILU) {
      for (int i = threadIdx.x; i < FG * MT * 8 * 8; i += blockDim.x) {
        const int fa = i % (FG * MT * 8), r = i / (FG * MT * 8);
        const int g0 = (fa / (MT * 8)) * GEMM_SLICES, f = fa % (MT * 8);
        const int fr = (f / 8) * 16 + f % 8;  // the gate row of pair f; its up row is 8 further
        const int n = fb + (fa / (MT * 8)) * (MT * 16) + fr, m = r0 + nt * 8 + r;
        if (n < N && m < M) {
          float g = red[g0][fr][r], u = red[g0][fr + 8][r];
#pragma unroll
          for (int w = 1; w < GEMM_SLICES; w++) {
            g += red[g0 + w][fr][r];
            u += red[g0 + w][fr + 8][r];
          }
          Act[(size_t)m * (N / 2) + fb / 2 + fa] = silu_mul1(g, u);
        }
      }
    } else {
      for (int i = threadIdx.x; i < FG * MT * 16 * 8; i += blockDim.x) {
        const int fa = i % (FG * MT * 16), r = i / (FG * MT * 16);
        const int g0 = (fa / (MT * 16)) * GEMM_SLICES, f = fa % (MT * 16);
        const int n = fb + fa, m = r0 + nt * 8 + r;
        if (n < N && m < M) {
          float s = red[g0][f][r];
#pragma unroll
          for (int w = 1; w < GEMM_SLICES; w++) s += red[g0 + w][f][r];
          const size_t o = (size_t)m * N + n;
          Y[o] = R ? R[o] + s : s;
        }
      }
    }
  }
}

#define GEMM_ARGS \
  const void *W, const float *Ws, const bf16_t *X, const float *R, float *Y, int M, int N, int K, bf16_t *Act
#define GEMM_PASS W, Ws, X, R, Y, M, N, K, Act
// gemm_{bf16,q8}_{MT}x{NT}[_silu]: U / UQ (bf16 / Q8_0 chunks in flight per lane) change speed
// only. On the H200 at one row, bf16 ran 4% faster with 8 than with 4, and Q8_0 12% slower
// (docs/perf.md).
#define GEMM_KERNEL(NAME, MT, NT, U, Q8, S, SILU) \
  extern "C" __global__ void __launch_bounds__(256) NAME(GEMM_ARGS) { gemm_impl<MT, NT, U, Q8, S, SILU>(GEMM_PASS); }
#define GEMM(MT, NT, U, UQ)                                                      \
  GEMM_KERNEL(gemm_bf16_##MT##x##NT, MT, NT, U, false, 0, false)                \
  GEMM_KERNEL(gemm_q8_##MT##x##NT, MT, NT, UQ, true, 0, false)                  \
  GEMM_KERNEL(gemm_bf16_##MT##x##NT##_silu, MT, NT, U, false, 0, true)          \
  GEMM_KERNEL(gemm_q8_##MT##x##NT##_silu, MT, NT, UQ, true, 0, true)
GEMM(1, 1, 8, 4) GEMM(1, 2, 8, 4) GEMM(2, 4, 2, 2) GEMM(2, 8, 2, 2) GEMM(4, 8, 1, 1)

// The narrow tiles with two alternating register batches of half the chunks (the same
// registers as one batch of U). On the H200 (qwen3-8b bf16, one call): the 1x1 tile slower
// (187 against 216 tok/s at one row), the 1x2 tile faster (10 and 16 rows 5-6%), so the host
// runs the 1x2 tile this way by default (Gpu::db_from_nt).
#define GEMM_DB(MT, NT, U, UQ)                                                   \
  GEMM_KERNEL(gemm_bf16_##MT##x##NT##_db, MT, NT, U, false, -2, false)          \
  GEMM_KERNEL(gemm_q8_##MT##x##NT##_db, MT, NT, UQ, true, -2, false)            \
  GEMM_KERNEL(gemm_bf16_##MT##x##NT##_silu_db, MT, NT, U, false, -2, true)      \
  GEMM_KERNEL(gemm_q8_##MT##x##NT##_silu_db, MT, NT, UQ, true, -2, true)
GEMM_DB(1, 1, 4, 2) GEMM_DB(1, 2, 4, 2)

// The 2x8 tile (above 32 rows) with its weights through a 3-stage cp.async ring of two chunks
// per stage (96 KB of dynamic shared memory): on the H200, qwen3-8b bf16 at 64 rows, its GEMMs
// took 8.42 ms a step against 8.75 with the weights in registers (kernel by kernel; 64 streams
// 5,714 vs 5,563 tok/s). One chunk per stage, 4 stages and two blocks per multiprocessor (three
// times the bytes in flight) was slower: 10.71 ms. So the 64-row GEMM is not short of weight bytes
// in flight; the X fragments each warp reads from L2 (docs/gpu.md) are the next limit.
// The 2x8 tile with its X through the ring as well (XR; S stages of one chunk: 48 KB each).
// px2: 2 stages (one chunk ahead) and two blocks a multiprocessor (96 KB each).
#define GEMM_PX(NAME, S, MINB, Q8, SILU)                                                        \
  extern "C" __global__ void __launch_bounds__(256, MINB) NAME(GEMM_ARGS) {                     \
    gemm_impl<2, 8, 1, Q8, S, SILU, true>(GEMM_PASS);                                           \
  }
#define GEMM_PXS(NAME, S, MINB)                         \
  GEMM_PX(gemm_bf16_2x8_##NAME, S, MINB, false, false)  \
  GEMM_PX(gemm_q8_2x8_##NAME, S, MINB, true, false)     \
  GEMM_PX(gemm_bf16_2x8_##NAME##_silu, S, MINB, false, true) \
  GEMM_PX(gemm_q8_2x8_##NAME##_silu, S, MINB, true, true)
GEMM_PXS(px, 3, 1) GEMM_PXS(px4, 4, 1) GEMM_PXS(px2, 2, 2)
// The 2x8 tile in two feature groups sharing X (FG = 2, 512 threads: 64 features x 64 rows a
// block), both operands through a 3-stage ring (64 KB a stage: 32 of weights, 32 of X), one
// block a multiprocessor: twice the weight bytes in flight of `_px` for the same X.
#define GEMM_PP(NAME, Q8, SILU)                                                                 \
  extern "C" __global__ void __launch_bounds__(512, 1) NAME(GEMM_ARGS) {                        \
    gemm_impl<2, 8, 1, Q8, 3, SILU, true, 2>(GEMM_PASS);                                        \
  }
GEMM_PP(gemm_bf16_2x8_pp, false, false)
GEMM_PP(gemm_q8_2x8_pp, true, false)
GEMM_PP(gemm_bf16_2x8_pp_silu, false, true)
GEMM_PP(gemm_q8_2x8_pp_silu, true, true)
// The 2x4 tile (32 rows a block) with both operands through a 3-stage ring (96 KB, two blocks a
// multiprocessor): at 33..64 rows for layers whose 2x8 grid has at most one block a
// multiprocessor (down and o of qwen3-8b: 128 blocks), twice the blocks. Slower on the H200
// (down 2.12 against 1.81 ms a step), so only behind SPECULA_CUDA_NARROW64=1.
#define GEMM_PX24(NAME, Q8, SILU) \
  extern "C" __global__ void __launch_bounds__(256, 2) NAME(GEMM_ARGS) { gemm_impl<2, 4, 1, Q8, 3, SILU, true>(GEMM_PASS); }
GEMM_PX24(gemm_bf16_2x4_px, false, false)
GEMM_PX24(gemm_q8_2x4_px, true, false)
GEMM_PX24(gemm_bf16_2x4_px_silu, false, true)
GEMM_PX24(gemm_q8_2x4_px_silu, true, true)
GEMM_KERNEL(gemm_bf16_2x8_pipe, 2, 8, 2, false, 3, false)
GEMM_KERNEL(gemm_q8_2x8_pipe, 2, 8, 2, true, 3, false)
GEMM_KERNEL(gemm_bf16_2x8_pipe_silu, 2, 8, 2, false, 3, true)
GEMM_KERNEL(gemm_q8_2x8_pipe_silu, 2, 8, 2, true, 3, true)

// Measured on the H200 (qwen3-8b bf16) and not the default: at 64 rows every seq
// kernel was slower than the 2x8 tile with its X through the ring (gate/up 4.60 ms a step with
// gemm_seq, 4.93 gemm_seq6, 4.95 gemm_seq32, 5.87 gemm_seqw, against 3.22 with _px2), and in
// prefill too (512 tokens 8,041 against 9,261 tok/s). With one block of 8 warps a
// multiprocessor, each warp walking all of K, the chain of each warp is long and its stalls
// are not hidden; the ring for the weights made it slower still. SPECULA_CUDA_GEMM_WIDE=seq
// picks them.
//
// gemm_seq[32]_{bf16,q8}[_silu]: the GEMM above 32 rows, with the bits of gemm_impl and a tile
// of 128 features x 64 rows (x 32 rows: gemm_seq32). Warp w owns features 16w..16w+15 of the
// block's 128 and all its rows, and walks the K slices itself, one after the other: a slice's
// chunks fold into a zeroed partial, chunk by chunk and in chunk order (what gemm_impl's warp of
// that slice does), and the partials are added to a running total in slice order (what
// gemm_impl's reduction does), the residual last. So the 8 warps need the same X chunk at the
// same step and share it through a cp.async ring in shared memory: each X byte enters a
// multiprocessor once per 128 features instead of once per 32 (at 64 rows gemm_impl's X reads
// from L2 are twice the weight bytes). (Sharing it through L1 instead was 1.5x slower.)
//
// Grid (row tiles, feature tiles, KS), KS in {1, 2, 4, 8}: block z walks slices
// [z * 8 / KS, (z + 1) * 8 / KS). With KS > 1 (narrow layers, which have few feature tiles)
// block 0 writes its running total and the others each slice's partial to P (f32, 256 KB a
// tile), and the tile's last block to finish (an atomic count in C, zero between launches) adds
// them in slice order: the same additions in the same order.
// U: chunks per weight batch (two batches alternate: 2U chunks, 2U KB a warp, in flight).
#define SEQ_XST 4  // stages of the X ring, U chunks each (4 KB a chunk of 64 rows: 64 x 64 bytes)


// WS > 0 (gemm_seqw): the weights go through shared memory too, in one ring with X of WS stages
// of U chunks ([WS][U][RT rows][4] X pieces, then [WS][U][2][256 lanes] weight pieces), WS - 1
// stages ahead: the bytes in flight are no longer capped by the registers the accumulators
// leave. Each lane reads back only the weight pieces it copied. Same loads, same fold.
template <int NT, int U, bool Q8, bool SILU, int WS = 0>
__device__ __forceinline__ void gemm_seq_impl(const void* __restrict__ Wp, const float* __restrict__ Ws,
                                              const bf16_t* __restrict__ X, const float* R, float* Y, int M,
                                              int N, int K, bf16_t* Act, float* P, int* C) {
  constexpr int RT = 8 * NT;       // rows a block
  // [SEQ_XST or WS][U][RT rows][4 lanes' pieces] (then, WS > 0, the weight ring)
  extern __shared__ uint4 xsm[];
  __shared__ int last;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gid = lane >> 2, tig = lane & 3;
  const int r0 = blockIdx.x * RT;
  const int f0 = blockIdx.y * 128 + warp * 16;
  const int KS = gridDim.z, z = blockIdx.z, spb = GEMM_SLICES / KS;
  const int nch = (K + 31) >> 5;
  const int per = (nch + GEMM_SLICES - 1) / GEMM_SLICES;
  const int s0 = z * spb;
  const int cb = min(s0 * per, nch), ce = min((s0 + spb) * per, nch);
  const int wrow0 = min(f0 + gid, N - 1), wrow1 = min(f0 + gid + 8, N - 1);
  int xrow[NT];
#pragma unroll
  for (int nt = 0; nt < NT; nt++) xrow[nt] = r0 + nt * 8 + gid < M ? r0 + nt * 8 + gid : -1;
  float* Pt = P + (size_t)(blockIdx.y * gridDim.x + blockIdx.x) * (GEMM_SLICES * 8 * 256 * 4);

  float tot[NT][4], acc[NT][4];
#pragma unroll
  for (int nt = 0; nt < NT; nt++)
#pragma unroll
    for (int i = 0; i < 4; i++) tot[nt][i] = acc[nt][i] = 0.0f;

  // The slice being folded and its chunks left; end_slice closes it (slice 0: the total is its
  // partial; later slices add theirs, or, in blocks z > 0, write it to P).
  int s = s0, left = per;
  auto end_slice = [&]() {
    if (z == 0) {
#pragma unroll
      for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int i = 0; i < 4; i++) tot[nt][i] = s == 0 ? acc[nt][i] : tot[nt][i] + acc[nt][i];
    } else {
#pragma unroll
      for (int nt = 0; nt < NT; nt++)
        reinterpret_cast<float4*>(Pt)[((size_t)s * 8 + nt) * 256 + threadIdx.x] =
            make_float4(acc[nt][0], acc[nt][1], acc[nt][2], acc[nt][3]);
    }
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
      for (int i = 0; i < 4; i++) acc[nt][i] = 0.0f;
    s++;
    left = per;
  };

  auto load_w = [&](uint4 (&wa)[U][2], int c) {
#pragma unroll
    for (int u = 0; u < U; u++) {
      const int k = (c + u) * 32 + tig * 8;
      const bool ok = c + u < ce && k < K;
#pragma unroll
      for (int h = 0; h < 2; h++) {
        const int wr = h ? wrow1 : wrow0;
        if (!ok) {
          wa[u][h] = make_uint4(0, 0, 0, 0);
        } else if (Q8) {
          const uint2 q =
              __ldcs(reinterpret_cast<const uint2*>(reinterpret_cast<const signed char*>(Wp) + (size_t)wr * K + k));
          wa[u][h] = make_uint4(q.x, q.y, 0, 0);
        } else {
          wa[u][h] = ld_stream16(reinterpret_cast<const bf16_t*>(Wp) + (size_t)wr * K + k);
        }
      }
    }
  };
  // The X pieces of chunks c .. c + U - 1 for the block's RT rows into ring stage `st` (one
  // commit group; zeros past M or K, nothing past the block's chunks).
  auto issue_x = [&](int st, int c) {
#pragma unroll
    for (int i = threadIdx.x; i < U * RT * 4; i += 256) {
      const int u = i / (RT * 4), row = (i / 4) % RT, q = i & 3;
      const int k = (c + u) * 32 + q * 8;
      if (c + u < ce) {
        const bool ok = k < K && r0 + row < M;
        cp_async16(xsm + ((st * U + u) * RT + row) * 4 + q, ok ? (const void*)(X + (size_t)(r0 + row) * K + k) : X,
                   ok);
      }
    }
    cp_async_commit();
  };
  auto fold = [&](const uint4 (&wa)[U][2], int c, int st) {
#pragma unroll
    for (int u = 0; u < U; u++) {
      if (c + u < ce) {  // block-uniform
        uint4 a = wa[u][0], b = wa[u][1];
        float sa = 0.0f, sb = 0.0f;
        if (Q8) {
          a = make_uint4(i8x2_bf16x2(a.x, 0), i8x2_bf16x2(a.x, 16), i8x2_bf16x2(a.y, 0), i8x2_bf16x2(a.y, 16));
          b = make_uint4(i8x2_bf16x2(b.x, 0), i8x2_bf16x2(b.x, 16), i8x2_bf16x2(b.y, 0), i8x2_bf16x2(b.y, 16));
          sa = __ldg(Ws + (size_t)wrow0 * nch + c + u);
          sb = __ldg(Ws + (size_t)wrow1 * nch + c + u);
        }
        uint4 xb[NT];
#pragma unroll
        for (int nt = 0; nt < NT; nt++) xb[nt] = xsm[((st * U + u) * RT + nt * 8 + gid) * 4 + tig];
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
          if (Q8) {
            float p[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            mma16816(p, a.x, b.x, a.y, b.y, xb[nt].x, xb[nt].y);
            mma16816(p, a.z, b.z, a.w, b.w, xb[nt].z, xb[nt].w);
            acc[nt][0] = __fmaf_rn(sa, p[0], acc[nt][0]);
            acc[nt][1] = __fmaf_rn(sa, p[1], acc[nt][1]);
            acc[nt][2] = __fmaf_rn(sb, p[2], acc[nt][2]);
            acc[nt][3] = __fmaf_rn(sb, p[3], acc[nt][3]);
          } else {
            mma16816(acc[nt], a.x, b.x, a.y, b.y, xb[nt].x, xb[nt].y);
            mma16816(acc[nt], a.z, b.z, a.w, b.w, xb[nt].z, xb[nt].w);
          }
        }
        if (--left == 0) end_slice();
      }
    }
  };
  // Before the batch of ring stage b: its copies are done and visible, and every warp is done
  // with stage b - 1, whose slot then takes the batch SEQ_XST - 1 ahead.
  auto ring_step = [&](int b, int c) {
    asm volatile("cp.async.wait_group %0;" ::"n"(SEQ_XST - 2) : "memory");
    __syncthreads();
    issue_x((b + SEQ_XST - 1) % SEQ_XST, c + (SEQ_XST - 1) * U);
  };

  if constexpr (WS > 0) {
    uint4* wsm = xsm + WS * U * RT * 4;
    auto wslot = [&](int st, int u, int h) -> uint4* { return wsm + ((st * U + u) * 2 + h) * 256 + threadIdx.x; };
    // The weight pieces of chunks c .. c + U - 1 into stage `st` (not committed).
    auto issue_w = [&](int st, int c) {
#pragma unroll
      for (int u = 0; u < U; u++) {
        const int k = (c + u) * 32 + tig * 8;
        const bool ok = c + u < ce && k < K;
#pragma unroll
        for (int h = 0; h < 2; h++) {
          const size_t e = (size_t)(h ? wrow1 : wrow0) * K + k;
          const void* src = !ok ? Wp
                            : Q8 ? (const void*)(reinterpret_cast<const signed char*>(Wp) + e)
                                 : (const void*)(reinterpret_cast<const bf16_t*>(Wp) + e);
          cp_async_w(wslot(st, u, h), src, ok, Q8);
        }
      }
    };
    // Weights are constant: the first WS - 1 stages' weights (one commit group each) are in
    // flight before the wait for the previous kernel; then their X (one group each). Stage b's
    // weight group always precedes its X group, so "all but the newest WS - 2 groups done"
    // covers both.
#pragma unroll
    for (int st = 0; st < WS - 1; st++) {
      issue_w(st, cb + st * U);
      cp_async_commit();
    }
    pdl_wait();
    pdl_launch();
#pragma unroll
    for (int st = 0; st < WS - 1; st++) issue_x(st, cb + st * U);
    int st = 0;
    uint4 wa[U][2];
    for (int c = cb; c < ce; c += U) {
      asm volatile("cp.async.wait_group %0;" ::"n"(WS - 2) : "memory");
      __syncthreads();
      const int nx = st == 0 ? WS - 1 : st - 1;
      issue_w(nx, c + (WS - 1) * U);
      issue_x(nx, c + (WS - 1) * U);  // commits both
#pragma unroll
      for (int u = 0; u < U; u++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
          const uint4 v = *wslot(st, u, h);
          wa[u][h] = Q8 ? make_uint4(v.x, v.y, 0, 0) : v;
        }
      fold(wa, c, st);
      st = st + 1 == WS ? 0 : st + 1;
    }
  } else {
    // Weights are constant: the first two batches load before the wait for the previous kernel.
    uint4 wa[U][2], wb[U][2];
    load_w(wa, cb);
    load_w(wb, cb + U);
    pdl_wait();
    pdl_launch();
#pragma unroll
    for (int st = 0; st < SEQ_XST - 1; st++) issue_x(st, cb + st * U);
    int b = 0;
    for (int c = cb; c < ce; c += 2 * U) {
      ring_step(b, c);
      fold(wa, c, b % SEQ_XST);
      b++;
      if (c + 2 * U < ce) load_w(wa, c + 2 * U);
      if (c + U < ce) {
        ring_step(b, c + U);
        fold(wb, c + U, b % SEQ_XST);
        b++;
        if (c + 3 * U < ce) load_w(wb, c + 3 * U);
      }
    }
  }
  // A last slice cut short by K, and empty slices (their zero partials are added, as in
  // gemm_impl's reduction).
  while (s < s0 + spb) end_slice();
  asm volatile("cp.async.wait_group 0;" ::: "memory");

  if (KS > 1) {
    if (z == 0) {
#pragma unroll
      for (int nt = 0; nt < NT; nt++)
        reinterpret_cast<float4*>(Pt)[(size_t)nt * 256 + threadIdx.x] =
            make_float4(tot[nt][0], tot[nt][1], tot[nt][2], tot[nt][3]);
    }
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(&C[blockIdx.y * gridDim.x + blockIdx.x], 1) == KS - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
      const float4 v = __ldcg(reinterpret_cast<const float4*>(Pt) + (size_t)nt * 256 + threadIdx.x);
      tot[nt][0] = v.x, tot[nt][1] = v.y, tot[nt][2] = v.z, tot[nt][3] = v.w;
    }
    for (int t = spb; t < GEMM_SLICES; t++) {
#pragma unroll
      for (int nt = 0; nt < NT; nt++) {
        const float4 v = __ldcg(reinterpret_cast<const float4*>(Pt) + ((size_t)t * 8 + nt) * 256 + threadIdx.x);
        tot[nt][0] += v.x, tot[nt][1] += v.y, tot[nt][2] += v.z, tot[nt][3] += v.w;
      }
    }
    if (threadIdx.x == 0) C[blockIdx.y * gridDim.x + blockIdx.x] = 0;
  }

  // The mma layout: tot[nt][j] is feature f0 + gid, tot[nt][2 + j] feature f0 + gid + 8, both
  // of row r0 + nt * 8 + 2 * tig + j.
#pragma unroll
  for (int nt = 0; nt < NT; nt++)
#pragma unroll
    for (int j = 0; j < 2; j++) {
      const int m = r0 + nt * 8 + 2 * tig + j;
      if (m >= M) continue;
      if constexpr (SILU) {
        // The gate feature f0 + gid's up feature is f0 + gid + 8 (interleaved in groups of 8).
        if (f0 < N) Act[(size_t)m * (N / 2) + f0 / 2 + gid] = silu_mul1(tot[nt][j], tot[nt][2 + j]);
      } else {
#pragma unroll
        for (int h = 0; h < 2; h++) {
          const int n = f0 + gid + 8 * h;
          if (n < N) {
            const size_t o = (size_t)m * N + n;
            Y[o] = R ? R[o] + tot[nt][2 * h + j] : tot[nt][2 * h + j];
          }
        }
      }
    }
}

// 64-row tiles (one block a multiprocessor), and 32-row tiles (two: half the accumulators, and
// twice the blocks for the few-tile layers; each weight byte is then read by two blocks).
// (and 64-row tiles with 12 chunks of weights in flight a warp: gemm_seq6).
#define SEQ_KERNEL(NAME, NT, U, MINB, Q8, SILU, WS)                                                \
  extern "C" __global__ void __launch_bounds__(256, MINB) NAME(GEMM_ARGS, float* P, int* C) {     \
    gemm_seq_impl<NT, U, Q8, SILU, WS>(GEMM_PASS, P, C);                                           \
  }
#define SEQ_KERNELS(NAME, NT, U, MINB, WS)                   \
  SEQ_KERNEL(NAME##_bf16, NT, U, MINB, false, false, WS)     \
  SEQ_KERNEL(NAME##_q8, NT, U, MINB, true, false, WS)        \
  SEQ_KERNEL(NAME##_bf16_silu, NT, U, MINB, false, true, WS) \
  SEQ_KERNEL(NAME##_q8_silu, NT, U, MINB, true, true, WS)
SEQ_KERNELS(gemm_seq, 8, 4, 1, 0)
SEQ_KERNELS(gemm_seq32, 4, 4, 2, 0)
SEQ_KERNELS(gemm_seq6, 8, 6, 1, 0)
// 64-row tiles with the weights in the ring: 8 stages of 2 chunks, 14 chunks (112 KB a
// multiprocessor) of weights in flight (192 KB of shared memory).
SEQ_KERNELS(gemm_seqw, 8, 2, 1, 8)

// Synthetic Q8_0 weights: Q[i] = int8 in [-127, 127], D[j] = scale * (1 + u/2) per 32-chunk,
// from splitmix64 like fill_uniform_bf16.
__device__ __forceinline__ float splitmix_u(unsigned long long seed, unsigned long long i) {
  unsigned long long z = seed + i * 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return (float)(z >> 40) * (1.0f / 8388608.0f) - 1.0f;
}

extern "C" __global__ void fill_q8(signed char* Q, float* D, unsigned long long n, unsigned long long nd,
                                   unsigned long long seed, float scale) {
  pdl_wait();
  pdl_launch();
  for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (unsigned long long)gridDim.x * blockDim.x) {
    Q[i] = (signed char)__float2int_rn(127.0f * splitmix_u(seed, i));
    if (i < nd) D[i] = scale * (1.0f + 0.5f * splitmix_u(seed ^ 0x5555ull, i));
  }
}

// ---------------------------------------------------------------------------------------------
// X[r, :] = E[tok[r], :] (f32 residual stream). Grid: rows.
extern "C" __global__ void embed_rows(const bf16_t* E, const int* tok, float* X, int H) {
  pdl_wait();
  pdl_launch();
  const bf16_t* e = E + (size_t)tok[blockIdx.x] * H;
  float* x = X + (size_t)blockIdx.x * H;
  for (int i = threadIdx.x; i < H; i += blockDim.x) x[i] = bf2f(e[i]);
}

// Y[r, :] = bf16(X[r, :] * rsqrt(mean(X[r, :]^2) + eps) * w). Grid: rows; block 256.
extern "C" __global__ void rmsnorm_bf16(const float* X, const bf16_t* w, bf16_t* Y, int H, float eps) {
  __shared__ float sh[32];
  rmsnorm_row(X + (size_t)blockIdx.x * H, w, Y + (size_t)blockIdx.x * H, H, eps, sh);
}

// block_sum over groups of gw warps (the block's threads in groups of 32 gw): each group gets
// the bits block_sum gives a block of exactly that group's threads.
__device__ float group_sum(float v, float* sh, int gw) {
  int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  v = warp_sum(v);
  __syncthreads();
  if (lane == 0) sh[w] = v;
  __syncthreads();
  float t = lane < gw ? sh[(w / gw) * gw + lane] : 0.0f;
  return warp_sum(t);
}

// What element d of a q or k head needs besides the activations: its norm weight (nw null: no
// norm) and its RoPE rotation (c, s) at position p. Constants only, so the kernels load them
// before their PDL wait.
struct HeadConst {
  bool norm;
  float nwd, c, s;
};
__device__ __forceinline__ HeadConst head_const(const bf16_t* nw, const float* inv_freq, int d, int hd, int p,
                                                int interleaved) {
  HeadConst k;
  k.norm = nw != nullptr;
  k.nwd = nw ? bf2f(nw[d]) : 1.0f;
  const int i = interleaved ? d / 2 : (d < hd / 2 ? d : d - hd / 2);
  sincosf((float)p * inv_freq[i], &k.s, &k.c);
  return k;
}

// One q or k head element after its RMSNorm (ss: the head's sum of squares).
__device__ __forceinline__ float head_norm(float v, float ss, const HeadConst& k, int hd, float eps) {
  return k.norm ? v * rsqrtf(ss / (float)hd + eps) * k.nwd : v;
}

// Element d of a head after RoPE; xs holds the head (hd values).
__device__ __forceinline__ float rope_at(const float* xs, int d, int hd, const HeadConst& k, int interleaved) {
  const int half = hd / 2;
  const float c = k.c, s = k.s;
  if (interleaved) return (d & 1) == 0 ? xs[d] * c - xs[d + 1] * s : xs[d] * c + xs[d - 1] * s;
  return d < half ? xs[d] * c - xs[d + half] * s : xs[d] * c + xs[d - half] * s;
}

// After the fused QKV projection: bias (Qwen2), per-head RMSNorm of q and k (Qwen3), RoPE at
// the row's position, q to Q (f32 [rows, nh, hd]) and k, v into the row's KV slot.
// QKV: f32 [rows, (nh + 2 nkv) hd]; caches: bf16 [slots, max_ctx, nkv, hd] for this layer.
// Grid: (rows, nh + 2 nkv); block: hd rounded up to a multiple of 32 (hd <= 256, even).
extern "C" __global__ void qkv_rope_store(const float* QKV, const float* bias, const bf16_t* qnorm,
                                          const bf16_t* knorm, const float* inv_freq, const int* pos,
                                          const int* slot, float* Q, bf16_t* Kc, bf16_t* Vc, int nh,
                                          int nkv, int hd, int max_ctx, float eps, int interleaved) {
  __shared__ float sh[32];
  __shared__ float xs[256];
  const int r = blockIdx.x, h = blockIdx.y, d = threadIdx.x;
  const bool active = d < hd;
  const int width = (nh + 2 * nkv) * hd;
  const bf16_t* nw = h < nh ? qnorm : knorm;
  // Constants (bias, norm weight, rotation) before the wait, activations after.
  const float b = active && bias ? bias[h * hd + d] : 0.0f;
  HeadConst hc = {false, 1.0f, 1.0f, 0.0f};
  if (active && h < nh + nkv) hc = head_const(nw, inv_freq, d, hd, pos[r], interleaved);
  pdl_wait();
  pdl_launch();
  float v = 0.0f;
  if (active) {
    v = QKV[(size_t)r * width + h * hd + d];
    if (bias) v += b;
  }
  const size_t cache_row = ((size_t)slot[r] * max_ctx + pos[r]) * nkv;
  if (h >= nh + nkv) {  // a V head: uniform across the block
    if (active) Vc[(cache_row + (h - nh - nkv)) * hd + d] = f2bf(v);
    return;
  }
  if (nw) {
    float ss = block_sum(v * v, sh);
    if (active) v = head_norm(v, ss, hc, hd, eps);
  }
  if (active) xs[d] = v;
  __syncthreads();
  if (!active) return;
  const float out = rope_at(xs, d, hd, hc, interleaved);
  if (h < nh)
    Q[((size_t)r * nh + h) * hd + d] = out;
  else
    Kc[(cache_row + (h - nh)) * hd + d] = f2bf(out);
}

// Causal attention of one row and one query head over its slot's cache, positions 0..=pos[r],
// split over the keys (flash-decoding) so a long context is spread over many blocks.
// The row's L = pos + 1 keys are cut into na = min(ATT_SPLITS, ceil(L / ATT_MIN_KEYS)) ranges,
// range z being keys [z L / na, (z + 1) L / na): the cut depends on L only, never on the batch.
// Per range, one block: scores (8 lanes per key, each folding its 16-byte chunks of q.k in
// order, then a fixed butterfly; kept in shared memory up to ATT_SMEM_KEYS keys), the range's max
// m and sum s of exp(score - m), and acc = sum over its keys of exp(score - m) v (warp w folds
// keys w, w + 8, ... of the range, lane l owns d = 4 l .. 4 l + 3 and 128 further; the 8 warp
// partials added in warp order). Every load of a phase is issued before its math (unrolled), so a
// short context costs a few memory round trips, not one per key chunk. With one
// range (L <= ATT_MIN_KEYS) that is the output: acc / s. Otherwise each range stores (m, s, acc)
// and the block that finishes the last range (an atomic count per row and head) merges them in
// range order: M = max m_z, S = sum s_z e^(m_z - M), O = (sum acc_z e^(m_z - M)) / S.
// Q: f32 [rows, nh, hd]; S: f32 scratch [rows, nh, max_ctx]; P: f32 scratch
// [rows, nh, ATT_SPLITS, hd + 2]; C: int [rows, nh], zero between launches; O: bf16 [rows, nh * hd].
// Grid: (rows * G, nh): block (r * G + g, h) takes ranges g, g + G, ... of row r (G changes
// speed, not bits); block: 256 threads (8 warps).
#define ATT_SPLITS 16
#define ATT_MIN_KEYS 256
#define ATT_SMEM_KEYS 2048
// KB / VB: key passes (32 keys each) / V positions of a warp whose loads are issued together
// before their math; NCL: 16-byte K chunks a lane holds per key (head_dim <= 64 NCL; 2 or 4);
// PF: which of the range's K (1) and V (2) lines the block asks L2 for first.
// Speed only: the operations and their order are the same for any of them.
//
// ROPE (`attention_rope_rows_*`, forwards whose rows are all of different sequences): the block
// also does qkv_rope_store's work for its row with the same device functions (so the same bits):
// its q heads from QKV into shared memory, and, in a block that takes the range holding position
// pos (the only blocks that read it), k and v of head kvh into the cache (every such block of
// the KV head writes the same bytes, then reads its own). Needs 2 * round_up(hd, 32) <= 256.
// QG > 1 (`attention_rows_g4`, QG = 4): one block takes QG query heads of one KV head (grid y: kv head
// and group), loading each K and V row once for all of them; per head it runs the operations of
// QG = 1 in the same order (every per-head value below is what QG = 1 computes), so the bits do
// not depend on QG. Needs hd <= 128.
template <int KB, int VB, int NCL, bool ROPE = false, int QG = 1, int PF = 3>
__device__ __forceinline__ void attention_impl(const float* Q, const bf16_t* Kc, const bf16_t* Vc, const int* pos,
                                               const int* slot, float* S, float* P, int* C, bf16_t* O, int nh,
                                               int nkv, int hd, int max_ctx, float scale, int G,
                                               const float* QKV = nullptr, const float* bias = nullptr,
                                               const bf16_t* qnorm = nullptr, const bf16_t* knorm = nullptr,
                                               const float* inv_freq = nullptr, float eps = 0.0f,
                                               int interleaved = 0) {
  static_assert(NCL == 2 || NCL == 4, "head_dim up to 128 or 256");
  static_assert(QG == 1 || NCL == 2, "the grouped kernel takes head_dim up to 128");
  constexpr int QD = 64 * NCL;  // head_dim capacity of q[] and part[]
  constexpr int SK = ATT_SMEM_KEYS / QG;   // scores per head kept in shared memory
  __shared__ float sh[QG][32];
  __shared__ float q[QG][QD];
  __shared__ float part[QG][8][QD];
  __shared__ float ssc[QG][SK];
  __shared__ int last;
  // Positions and slots come from the host before the graph starts, and the cache lines of
  // earlier positions from earlier forwards: all of this may run before the previous kernel
  // ends (programmatic dependent launch); the activations only after pdl_wait.
  // Grid (rows * G, heads), or (rows, heads, G) (the host's choice, dispatch order only: the
  // blocks of the later key ranges, empty for a short context, go last).
  const int r = gridDim.z > 1 ? blockIdx.x : blockIdx.x / G, g = gridDim.z > 1 ? blockIdx.z : blockIdx.x % G;
  const int qpk = nh / nkv, hg = (qpk + QG - 1) / QG;  // q heads per KV head; groups per KV head
  const int kvh = QG == 1 ? blockIdx.y / qpk : blockIdx.y / hg;
  const int h0 = QG == 1 ? blockIdx.y : kvh * qpk + (blockIdx.y % hg) * QG;
  const int nq = min(QG, kvh * qpk + qpk - h0);  // heads h0 .. h0 + nq - 1
  const int L = pos[r] + 1;
  const int na = min(ATT_SPLITS, (L + ATT_MIN_KEYS - 1) / ATT_MIN_KEYS);
  if (g >= na) return;
  const size_t stride = (size_t)nkv * hd;
  const bf16_t* kb = Kc + (size_t)slot[r] * max_ctx * stride + (size_t)kvh * hd;
  const bf16_t* vb = Vc + (size_t)slot[r] * max_ctx * stride + (size_t)kvh * hd;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int kl = threadIdx.x & 7, grp = threadIdx.x >> 3, nc = hd / 8;
  // Ask L2 for the block's K and V rows (128-byte lines) first: the score phase's loads and,
  // overlapped with it, the V phase's then wait on L2 rather than on DRAM.
  if constexpr (PF != 0) {
    const int lines = (hd * 2 + 127) / 128;
    for (int z = g; z < na; z += G) {
      const int a = (int)((long long)z * L / na), b = (int)((long long)(z + 1) * L / na);
      for (int i = threadIdx.x; i < (b - a) * lines; i += blockDim.x) {
        const size_t e = (size_t)(a + i / lines) * stride + (i % lines) * 64;
        if (PF & 1) prefetch_l2(kb + e);
        if (PF & 2) prefetch_l2(vb + e);
      }
    }
  }
  // ROPE: the block's heads e = 0 .. QG (q heads h0 + e, then k head kvh at e = QG), 256 / hp
  // of them a pass (thread t takes head p * 256 / hp + t / hp of pass p, element t % hp); v by
  // threads [0, hd). Their constants (bias, norm weight, rotation) load before the wait too.
  constexpr int NP = (QG + 2) / 2;  // passes (at least two heads a pass: 2 round_up(hd, 32) <= 256)
  const int hp = (hd + 31) & ~31, per = 256 / hp, part_of = threadIdx.x / hp, hdx = threadIdx.x % hp;
  const bool ractive = ROPE && part_of < per && hdx < hd;
  int hcol[NP];
  float hb[NP];
  float bv = 0.0f;
  HeadConst hcq = {false, 1.0f, 1.0f, 0.0f}, hck = hcq;
#pragma unroll
  for (int p = 0; p < NP; p++) {
    const int e = p * per + part_of;
    hcol[p] = ractive && (e < nq || e == QG) ? (e < QG ? h0 + e : nh + kvh) * hd + hdx : -1;
    hb[p] = hcol[p] >= 0 && bias ? bias[hcol[p]] : 0.0f;
  }
  if (ractive) {
    hcq = head_const(qnorm, inv_freq, hdx, hd, L - 1, interleaved);
    hck = head_const(knorm, inv_freq, hdx, hd, L - 1, interleaved);
  }
  const int vcol = (nh + nkv + kvh) * hd + threadIdx.x;
  if (ROPE && bias && threadIdx.x < hd) bv = bias[vcol];
  pdl_wait();
  pdl_launch();
  if constexpr (ROPE) {
    const int d = hdx;
    const int width = (nh + 2 * nkv) * hd;
    float hv[NP], vv = 0.0f;
#pragma unroll
    for (int p = 0; p < NP; p++) {
      hv[p] = 0.0f;
      if (hcol[p] >= 0) {
        hv[p] = QKV[(size_t)r * width + hcol[p]];
        if (bias) hv[p] += hb[p];
      }
    }
    if (threadIdx.x < hd) {
      vv = QKV[(size_t)r * width + vcol];
      if (bias) vv += bv;
    }
#pragma unroll
    for (int p = 0; p < NP; p++) {
      const int e = p * per + part_of;
      if (qnorm || knorm) {
        const float ss = group_sum(hv[p] * hv[p], sh[0], hp / 32);
        if (hcol[p] >= 0) hv[p] = head_norm(hv[p], ss, e < QG ? hcq : hck, hd, eps);
      }
      if (hcol[p] >= 0) part[0][e][d] = hv[p];
    }
    __syncthreads();
    const bool writes = (na - 1) % G == g;  // this block takes the range holding position pos
    const size_t cache_row = ((size_t)slot[r] * max_ctx + pos[r]) * nkv + kvh;
#pragma unroll
    for (int p = 0; p < NP; p++) {
      const int e = p * per + part_of;
      if (hcol[p] < 0) continue;
      const float out = rope_at(part[0][e], d, hd, e < QG ? hcq : hck, interleaved);
      if (e < QG)
        q[e][d] = out;
      else if (writes)
        const_cast<bf16_t*>(Kc)[cache_row * hd + d] = f2bf(out);
    }
    if (writes && threadIdx.x < hd) const_cast<bf16_t*>(Vc)[cache_row * hd + threadIdx.x] = f2bf(vv);
    __syncthreads();  // part[] read; q, k and v written (visible to the block from here)
  } else {
    // The block's nq heads of q, all loads first (nq * hd <= 256 QL).
    constexpr int QL = (QG * QD + 255) / 256;
    float qv[QL];
#pragma unroll
    for (int u = 0; u < QL; u++) {
      const int i = threadIdx.x + 256 * u;
      qv[u] = i < nq * hd ? Q[((size_t)r * nh + h0) * hd + i] : 0.0f;
    }
#pragma unroll
    for (int u = 0; u < QL; u++) {
      const int i = threadIdx.x + 256 * u;
      if (i < nq * hd) q[i / hd][i % hd] = qv[u];
    }
  }
  for (int z = g; z < na; z += G) {
    const int a = (int)((long long)z * L / na), b = (int)((long long)(z + 1) * L / na);
    __syncthreads();  // q is loaded; the previous range's part[] and scores are consumed
    // The range's scores: in shared memory when they fit, else in S.
    float* sc[QG];
#pragma unroll
    for (int j = 0; j < QG; j++)
      sc[j] = b - a <= SK ? ssc[j] : S + ((size_t)r * nh + h0 + min(j, nq - 1)) * max_ctx + a;
    // Scores: 8 lanes per key (32 keys a pass); lane kl folds the q.k products of its 16-byte
    // chunks kl, kl + 8, ... in order, then a fixed xor butterfly over the 8 lanes.
    float mx[QG];
#pragma unroll
    for (int j = 0; j < QG; j++) mx[j] = -INFINITY;
    // KB passes (32 keys each) at a time: all their K loads are issued first, predicated, and
    // only then folded, pass by pass in key order (a loop that loads inside each pass's branch
    // gets one memory round trip per pass: the compiler does not hoist loads across them).
    for (int t0 = a; t0 < b; t0 += 32 * KB) {
      uint4 kr[KB][NCL];
#pragma unroll
      for (int u = 0; u < KB; u++) {
        const int t = t0 + 32 * u + grp;
        const uint4* k = reinterpret_cast<const uint4*>(kb + (size_t)min(t, b - 1) * stride);
#pragma unroll
        for (int i = 0; i < NCL; i++) kr[u][i] = t < b && kl + 8 * i < nc ? k[kl + 8 * i] : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int u = 0; u < KB; u++) {
        const int t = t0 + 32 * u + grp;
        float acc[QG];
#pragma unroll
        for (int j = 0; j < QG; j++) acc[j] = 0.0f;
        if (t < b) {
#pragma unroll
          for (int i = 0; i < NCL; i++) {
            const int c = kl + 8 * i;
            if (c < nc) {
              float kf[8];
              unpack8(kr[u][i], kf);
#pragma unroll
              for (int j = 0; j < QG; j++)
#pragma unroll
                for (int e = 0; e < 8; e++) acc[j] = __fmaf_rn(q[j][c * 8 + e], kf[e], acc[j]);
            }
          }
        }
#pragma unroll
        for (int j = 0; j < QG; j++) {
          acc[j] += __shfl_xor_sync(0xffffffffu, acc[j], 4);
          acc[j] += __shfl_xor_sync(0xffffffffu, acc[j], 2);
          acc[j] += __shfl_xor_sync(0xffffffffu, acc[j], 1);
          acc[j] *= scale;
          if (t < b) {
            if (kl == 0 && j < nq) sc[j][t - a] = acc[j];
            mx[j] = fmaxf(mx[j], acc[j]);
          }
        }
      }
    }
    block_reduce_n<QG, true>(mx, sh);  // its barriers also publish sc[] to the block
    float sum[QG];
#pragma unroll
    for (int j = 0; j < QG; j++) {
      sum[j] = 0.0f;
      if (j < nq)
        for (int t = a + threadIdx.x; t < b; t += blockDim.x) {
          float e = expf(sc[j][t - a] - mx[j]);
          sc[j][t - a] = e;
          sum[j] += e;
        }
    }
    block_reduce_n<QG, false>(sum, sh);  // and these the exponentials
    // The weighted sum of V: warp w takes positions a + w, a + w + 8, ... in order; lane l
    // holds dimensions 4 l .. 4 l + 3 (and 128 further for head_dim > 128).
    constexpr int VJ = NCL / 2;  // groups of 32 lanes x 4 dimensions: hd <= 128 VJ
    float acc[QG][VJ][4];
#pragma unroll
    for (int j = 0; j < QG; j++)
#pragma unroll
      for (int i = 0; i < VJ; i++)
#pragma unroll
        for (int e = 0; e < 4; e++) acc[j][i][e] = 0.0f;
    const int nv = hd / 4;
    // VB positions of a warp at a time: their V loads first (predicated), then the folds in
    // position order.
    for (int t0 = a + warp; t0 < b; t0 += 8 * VB) {
      uint2 vr[VB][VJ];
#pragma unroll
      for (int u = 0; u < VB; u++) {
        const int t = t0 + 8 * u;
        const uint2* v = reinterpret_cast<const uint2*>(vb + (size_t)min(t, b - 1) * stride);
#pragma unroll
        for (int i = 0; i < VJ; i++) {
          const int c = lane + 32 * i;
          vr[u][i] = t < b && c < nv ? v[c] : make_uint2(0, 0);
        }
      }
#pragma unroll
      for (int u = 0; u < VB; u++) {
        const int t = t0 + 8 * u;
        if (t < b) {
          float p[QG];
#pragma unroll
          for (int j = 0; j < QG; j++) p[j] = j < nq ? sc[j][t - a] : 0.0f;
#pragma unroll
          for (int i = 0; i < VJ; i++) {
            const int c = lane + 32 * i;
            if (c < nv) {
              const uint2 w = vr[u][i];
#pragma unroll
              for (int j = 0; j < QG; j++) {
                acc[j][i][0] = __fmaf_rn(p[j], bf_lo(w.x), acc[j][i][0]);
                acc[j][i][1] = __fmaf_rn(p[j], bf_hi(w.x), acc[j][i][1]);
                acc[j][i][2] = __fmaf_rn(p[j], bf_lo(w.y), acc[j][i][2]);
                acc[j][i][3] = __fmaf_rn(p[j], bf_hi(w.y), acc[j][i][3]);
              }
            }
          }
        }
      }
    }
#pragma unroll
    for (int j = 0; j < QG; j++)
#pragma unroll
      for (int i = 0; i < VJ; i++) {
        const int c = lane + 32 * i;
        if (c < nv) {
#pragma unroll
          for (int e = 0; e < 4; e++) part[j][warp][4 * c + e] = acc[j][i][e];
        }
      }
    __syncthreads();
    if (na == 1) {
      for (int j = 0; j < nq; j++) {
        const float inv = 1.0f / sum[j];
        for (int d = threadIdx.x; d < hd; d += blockDim.x) {
          float o = part[j][0][d];
#pragma unroll
          for (int w = 1; w < 8; w++) o += part[j][w][d];
          O[((size_t)r * nh + h0 + j) * hd + d] = f2bf(o * inv);
        }
      }
      return;
    }
    for (int j = 0; j < nq; j++) {
      float* pz = P + (((size_t)r * nh + h0 + j) * ATT_SPLITS + z) * (hd + 2);
      for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float o = part[j][0][d];
#pragma unroll
        for (int w = 1; w < 8; w++) o += part[j][w][d];
        pz[2 + d] = o;
      }
      if (threadIdx.x == 0) {
        pz[0] = mx[j];
        pz[1] = sum[j];
      }
    }
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(&C[(size_t)r * nh + h0], 1) == na - 1;
    __syncthreads();
    if (last) {
      __threadfence();
      for (int j = 0; j < nq; j++) {
        const float* pr = P + ((size_t)r * nh + h0 + j) * ATT_SPLITS * (hd + 2);
        float M = -INFINITY;
        for (int y = 0; y < na; y++) M = fmaxf(M, __ldcg(pr + (size_t)y * (hd + 2)));
        float tot = 0.0f;
        for (int y = 0; y < na; y++) {
          const float* py = pr + (size_t)y * (hd + 2);
          tot += __ldcg(py + 1) * expf(__ldcg(py) - M);
        }
        const float inv = 1.0f / tot;
        for (int d = threadIdx.x; d < hd; d += blockDim.x) {
          float o = 0.0f;
          for (int y = 0; y < na; y++) {
            const float* py = pr + (size_t)y * (hd + 2);
            o = __fmaf_rn(__ldcg(py + 2 + d), expf(__ldcg(py) - M), o);
          }
          O[((size_t)r * nh + h0 + j) * hd + d] = f2bf(o * inv);
        }
      }
      if (threadIdx.x == 0) C[(size_t)r * nh + h0] = 0;
    }
  }
}

#define ATT_ARGS                                                                                  \
  const float *Q, const bf16_t *Kc, const bf16_t *Vc, const int *pos, const int *slot, float *S, float *P, \
      int *C, bf16_t *O, int nh, int nkv, int hd, int max_ctx, float scale, int G
#define ATT_PASS Q, Kc, Vc, pos, slot, S, P, C, O, nh, nkv, hd, max_ctx, scale, G
// `_h128`: the same kernels for head_dim <= 128 (NCL 2: half the registers for K chunks, so
// more key passes in flight).
extern "C" __global__ void __launch_bounds__(256, 4) attention_rows(ATT_ARGS) { attention_impl<1, 4, 4>(ATT_PASS); }
extern "C" __global__ void __launch_bounds__(256, 4) attention_rows_h128(ATT_ARGS) { attention_impl<2, 8, 2>(ATT_PASS); }
// More loads in flight per thread, half the blocks per multiprocessor: faster for a few rows
// (docs/gpu.md), slower for many (GpuModel::enqueue picks; SPECULA_CUDA_ATT overrides).
extern "C" __global__ void __launch_bounds__(256, 2) attention_rows_deep(ATT_ARGS) { attention_impl<2, 8, 4>(ATT_PASS); }
extern "C" __global__ void __launch_bounds__(256, 2) attention_rows_deep_h128(ATT_ARGS) { attention_impl<4, 16, 2>(ATT_PASS); }
// Four query heads of one KV head per block (QG above; grid y: kv heads x groups per kv head).
// Groups of 2 were slower than one head per block on the H200.
extern "C" __global__ void __launch_bounds__(256, 2) attention_rows_g4(ATT_ARGS) { attention_impl<2, 8, 2, false, 4>(ATT_PASS); }
// The same code held to fewer registers for 3 or 4 blocks a multiprocessor (at 64 rows and a
// short context the 512 blocks of qwen3-8b are two waves at 2 a multiprocessor, each block a
// chain of dependent phases): speed only. At 4 (the default), without the L2 prefetch of the
// block's K and V lines (PF 0: at 64 rows a layer's K and V are about the size of L2, and the
// prefetches cost the block time), with it (`_pf`), or with 4 key passes loaded at
// once (`_k4`).
extern "C" __global__ void __launch_bounds__(256, 3) attention_rows_g4_b3(ATT_ARGS) { attention_impl<2, 8, 2, false, 4>(ATT_PASS); }
extern "C" __global__ void __launch_bounds__(256, 4) attention_rows_g4_b4(ATT_ARGS) { attention_impl<2, 8, 2, false, 4, 0>(ATT_PASS); }
extern "C" __global__ void __launch_bounds__(256, 4) attention_rows_g4_b4_pf(ATT_ARGS) { attention_impl<2, 8, 2, false, 4>(ATT_PASS); }
extern "C" __global__ void __launch_bounds__(256, 4) attention_rows_g4_b4_k4(ATT_ARGS) { attention_impl<4, 8, 2, false, 4, 0>(ATT_PASS); }
// attention_rows_deep with qkv_rope_store's work in front (ROPE above), for forwards of one row.
#define ATT_ROPE_ARGS                                                                             \
  ATT_ARGS, const float *QKV, const float *bias, const bf16_t *qnorm, const bf16_t *knorm,        \
      const float *inv_freq, float eps, int interleaved
#define ATT_ROPE_PASS ATT_PASS, QKV, bias, qnorm, knorm, inv_freq, eps, interleaved
extern "C" __global__ void __launch_bounds__(256, 2) attention_rope_rows_deep(ATT_ROPE_ARGS) {
  attention_impl<2, 8, 4, true>(ATT_ROPE_PASS);
}
extern "C" __global__ void __launch_bounds__(256, 2) attention_rope_rows_deep_h128(ATT_ROPE_ARGS) {
  attention_impl<4, 16, 2, true>(ATT_ROPE_PASS);
}
// attention_rows_g4_b4 with qkv_rope_store's work in front, for forwards whose rows are all of
// different sequences (no row reads a position another row of the forward writes).
extern "C" __global__ void __launch_bounds__(256, 4) attention_rope_rows_g4_b4(ATT_ROPE_ARGS) {
  attention_impl<2, 8, 2, true, 4, 0>(ATT_ROPE_PASS);
}
extern "C" __global__ void __launch_bounds__(256, 4) attention_rope_rows_g4_b4_k4(ATT_ROPE_ARGS) {
  attention_impl<4, 8, 2, true, 4, 0>(ATT_ROPE_PASS);
}

// A[r, i] = bf16(silu(G) * U), GU f32 [rows, 2I] with the gate and up features interleaved in
// groups of 8 (the gate/up matrix's row order, see `cuda::load`): G[i] at 16 (i / 8) + i % 8, U[i]
// 8 further. Grid-stride over rows * I.
extern "C" __global__ void silu_mul(const float* GU, bf16_t* A, int I, int rows) {
  pdl_wait();
  pdl_launch();
  size_t n = (size_t)rows * I;
  for (size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x; idx < n; idx += (size_t)gridDim.x * blockDim.x) {
    size_t r = idx / I, i = idx % I;
    const float* gu = GU + r * 2 * I + (i / 8) * 16 + i % 8;
    A[idx] = silu_mul1(gu[0], gu[8]);
  }
}

// out[r] = the smallest index of the largest logit in row r. Grid: rows; block 1024.
extern "C" __global__ void argmax_rows(const float* Lg, int V, int* out) {
  pdl_wait();
  pdl_launch();
  __shared__ float bv[1024];
  __shared__ int bi[1024];
  const float* l = Lg + (size_t)blockIdx.x * V;
  float best = -INFINITY;
  int idx = 0x7fffffff;
  for (int i = threadIdx.x; i < V; i += blockDim.x) {
    float v = l[i];
    if (v > best) { best = v; idx = i; }
  }
  bv[threadIdx.x] = best;
  bi[threadIdx.x] = idx;
  __syncthreads();
  for (int o = blockDim.x / 2; o > 0; o >>= 1) {
    if (threadIdx.x < o) {
      float v2 = bv[threadIdx.x + o];
      int i2 = bi[threadIdx.x + o];
      if (v2 > bv[threadIdx.x] || (v2 == bv[threadIdx.x] && i2 < bi[threadIdx.x])) {
        bv[threadIdx.x] = v2;
        bi[threadIdx.x] = i2;
      }
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) out[blockIdx.x] = bi[0];
}

// P[i] = bf16(offset + scale * u_i), u_i uniform in [-1, 1) from splitmix64(seed + i):
// synthetic weights generated on the device.
extern "C" __global__ void fill_uniform_bf16(bf16_t* P, unsigned long long n, unsigned long long seed,
                                             float scale, float offset) {
  pdl_wait();
  pdl_launch();
  for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (unsigned long long)gridDim.x * blockDim.x) {
    P[i] = f2bf(offset + scale * splitmix_u(seed, i));
  }
}

// ---------------------------------------------------------------------------------------------
// Mixture-of-Experts (Qwen3-MoE, Qwen2-MoE): routing, expert products, weighted sum.
//
// Batch invariance: a row's output depends on its own values only. The router's logits come
// from the batch-invariant GEMM; routing is per row (one warp, fixed-order reductions); each
// (row, expert) product is a dot product folded in a fixed order (lane l takes the 8-wide
// chunks l, l + 32, ... in order, then warp_sum) whatever other rows share the expert's block;
// the weighted sum is per row in top-k rank order. Grouping rows by expert is for the weight
// reads only: the rows routed to an expert read its weights in one block.

// One warp per row r: softmax over the E router logits L[r * LS + e] (the max, then the
// exponentials summed in a fixed order), the top-k logits (ties to the lower expert), their
// probabilities, renormalized to sum to 1 when `norm`. ids / wts: [rows, topk].
extern "C" __global__ void moe_route(const float* L, int E, int LS, int topk, int norm, int* ids, float* wts) {
  pdl_wait();
  pdl_launch();
  const int r = blockIdx.x, lane = threadIdx.x;
  const float* l = L + (size_t)r * LS;
  float mx = -INFINITY;
  for (int e = lane; e < E; e += 32) mx = fmaxf(mx, l[e]);
  mx = warp_max(mx);
  float s = 0.0f;
  for (int e = lane; e < E; e += 32) s += expf(l[e] - mx);
  s = warp_sum(s);
  int chosen[8];
  float p[8];
  float total = 0.0f;
  for (int k = 0; k < topk; k++) {
    float best = -INFINITY;
    int bi = 0x7fffffff;
    for (int e = lane; e < E; e += 32) {
      bool taken = false;
      for (int j = 0; j < k; j++) taken |= chosen[j] == e;
      const float v = l[e];
      if (!taken && (v > best || (v == best && e < bi))) {
        best = v;
        bi = e;
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float v2 = __shfl_xor_sync(0xffffffffu, best, o);
      const int i2 = __shfl_xor_sync(0xffffffffu, bi, o);
      if (v2 > best || (v2 == best && i2 < bi)) {
        best = v2;
        bi = i2;
      }
    }
    chosen[k] = bi;
    p[k] = expf(best - mx) / s;
    total += p[k];
  }
  if (lane == 0) {
    for (int k = 0; k < topk; k++) {
      ids[r * topk + k] = chosen[k];
      wts[r * topk + k] = norm ? p[k] / total : p[k];
    }
  }
}

// One block of at least E threads: per expert e, the (row, rank) pairs routed to it (pair id
// r * topk + k, in row-major order) at pairs[off[e] .. off[e + 1]]. n: rows * topk.
extern "C" __global__ void moe_plan(const int* ids, int n, int E, int* off, int* pairs) {
  pdl_wait();
  pdl_launch();
  extern __shared__ int cnt[];
  const int e = threadIdx.x;
  if (e < E) {
    int c = 0;
    for (int i = 0; i < n; i++) c += ids[i] == e;
    cnt[e] = c;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int acc = 0;
    for (int i = 0; i < E; i++) {
      const int t = cnt[i];
      cnt[i] = acc;
      acc += t;
    }
    off[E] = acc;
  }
  __syncthreads();
  if (e < E) {
    int o = cnt[e];
    off[e] = o;
    for (int i = 0; i < n; i++)
      if (ids[i] == e) pairs[o++] = i;
  }
}

// The products of expert blockIdx.y for the pairs routed to it. W: [E, NR * F, KD] (NR = 2: F
// gate rows, then F up rows; NR = 1: F rows), bf16, or with Q8 int8 values and f32 scales D
// [E, NR * F, KD / 32] (llama.cpp's Q8_0: one scale per 32 weights); X: bf16 rows of KD, the
// pair's row p / topk (GU) or the pair's own row p (down). GU: Out bf16 [pairs, F] =
// silu_mul1(gate, up); else Out f32 [pairs, F]. Block: 8 warps of RW features; up to MP pairs
// share each weight load. Q8: a chunk's 8 products fold into a zeroed partial, then
// acc = fma(d, partial, acc).
template <int RW, int MP, int U, bool GU, bool Q8>
__device__ __forceinline__ void moe_gemv(const void* __restrict__ W, const float* __restrict__ D,
                                         const bf16_t* __restrict__ X, const int* __restrict__ off,
                                         const int* __restrict__ pairs, int topk, void* Out, int F, int KD) {
  constexpr int NR = GU ? 2 : 1;
  pdl_wait();
  pdl_launch();
  const int e = blockIdx.y;
  const int p0 = off[e], p1 = off[e + 1];
  if (p0 == p1) return;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int f0 = (blockIdx.x * (blockDim.x >> 5) + warp) * RW;
  if (f0 >= F) return;
  const int KV = KD >> 3;
  size_t row[NR][RW];
#pragma unroll
  for (int h = 0; h < NR; h++)
#pragma unroll
    for (int r = 0; r < RW; r++) row[h][r] = (size_t)e * NR * F + (size_t)h * F + min(f0 + r, F - 1);
  for (int pc = p0; pc < p1; pc += MP) {
    const int np = min(MP, p1 - pc);
    const uint4* xr[MP];
    int pid[MP];
#pragma unroll
    for (int m = 0; m < MP; m++) {
      pid[m] = pairs[pc + min(m, np - 1)];
      const int xrow = GU ? pid[m] / topk : pid[m];
      xr[m] = reinterpret_cast<const uint4*>(X + (size_t)xrow * KD);
    }
    float acc[MP][NR][RW];
#pragma unroll
    for (int m = 0; m < MP; m++)
#pragma unroll
      for (int h = 0; h < NR; h++)
#pragma unroll
        for (int r = 0; r < RW; r++) acc[m][h][r] = 0.0f;
    // Each accumulator folds chunks kv, kv + 32, ... in order (U only batches the loads).
    for (int kv0 = lane; kv0 < KV; kv0 += 32 * U) {
      uint4 wv[U][NR][RW];
      float dv[U][NR][RW];
#pragma unroll
      for (int u = 0; u < U; u++)
#pragma unroll
        for (int h = 0; h < NR; h++)
#pragma unroll
          for (int r = 0; r < RW; r++) {
            const int kv = kv0 + 32 * u;
            const bool in = kv < KV;
            if (Q8) {
              const uint2 q = in ? __ldcs(reinterpret_cast<const uint2*>(
                                       reinterpret_cast<const signed char*>(W) + row[h][r] * KD) + kv)
                                 : make_uint2(0, 0);
              wv[u][h][r] = make_uint4(q.x, q.y, 0, 0);
              dv[u][h][r] = in ? __ldg(D + row[h][r] * ((KD + 31) >> 5) + (kv >> 2)) : 0.0f;
            } else {
              wv[u][h][r] = in ? __ldcs(reinterpret_cast<const uint4*>(reinterpret_cast<const bf16_t*>(W) +
                                                                       row[h][r] * KD) + kv)
                               : make_uint4(0, 0, 0, 0);
              dv[u][h][r] = 1.0f;
            }
          }
#pragma unroll
      for (int u = 0; u < U; u++) {
        const int kv = kv0 + 32 * u;
        if (kv >= KV) break;
        float wf[NR][RW][8];
#pragma unroll
        for (int h = 0; h < NR; h++)
#pragma unroll
          for (int r = 0; r < RW; r++) {
            if (Q8) {
#pragma unroll
              for (int j = 0; j < 4; j++) {
                wf[h][r][j] = (float)(signed char)((wv[u][h][r].x >> (8 * j)) & 0xff);
                wf[h][r][4 + j] = (float)(signed char)((wv[u][h][r].y >> (8 * j)) & 0xff);
              }
            } else {
              unpack8(wv[u][h][r], wf[h][r]);
            }
          }
#pragma unroll
        for (int m = 0; m < MP; m++) {
          if (m >= np) break;
          float xf[8];
          unpack8(__ldg(xr[m] + kv), xf);
#pragma unroll
          for (int h = 0; h < NR; h++)
#pragma unroll
            for (int r = 0; r < RW; r++) {
              if (Q8) {
                float part = 0.0f;
#pragma unroll
                for (int j = 0; j < 8; j++) part = __fmaf_rn(wf[h][r][j], xf[j], part);
                acc[m][h][r] = __fmaf_rn(dv[u][h][r], part, acc[m][h][r]);
              } else {
#pragma unroll
                for (int j = 0; j < 8; j++) acc[m][h][r] = __fmaf_rn(wf[h][r][j], xf[j], acc[m][h][r]);
              }
            }
        }
      }
    }
#pragma unroll
    for (int m = 0; m < MP; m++) {
      if (m >= np) break;
#pragma unroll
      for (int r = 0; r < RW; r++) {
        const float a = warp_sum(acc[m][0][r]);
        const float b = GU ? warp_sum(acc[m][NR - 1][r]) : 0.0f;
        const int f = f0 + r;
        if (lane == 0 && f < F) {
          const size_t i = (size_t)pid[m] * F + f;
          if (GU)
            reinterpret_cast<bf16_t*>(Out)[i] = silu_mul1(a, b);
          else
            reinterpret_cast<float*>(Out)[i] = a;
        }
      }
    }
  }
}

#define MOE_GEMV_ARGS \
  const void *W, const float *D, const bf16_t *X, const int *off, const int *pairs, int topk, void *Out, int F, int KD
extern "C" __global__ void __launch_bounds__(256) moe_gate_up(MOE_GEMV_ARGS) {
  moe_gemv<2, 4, 2, true, false>(W, D, X, off, pairs, topk, Out, F, KD);
}
extern "C" __global__ void __launch_bounds__(256) moe_down(MOE_GEMV_ARGS) {
  moe_gemv<2, 4, 2, false, false>(W, D, X, off, pairs, topk, Out, F, KD);
}
extern "C" __global__ void __launch_bounds__(256) moe_gate_up_q8(MOE_GEMV_ARGS) {
  moe_gemv<2, 4, 2, true, true>(W, D, X, off, pairs, topk, Out, F, KD);
}
extern "C" __global__ void __launch_bounds__(256) moe_down_q8(MOE_GEMV_ARGS) {
  moe_gemv<2, 4, 2, false, true>(W, D, X, off, pairs, topk, Out, F, KD);
}

// X[r, j] += sum_k wts[r, k] * Y[r * topk + k, j] (the ranks in order), plus
// sigmoid(L[r * LS + E]) * S[r, j] (the shared expert and its gate) when S is not null.
// Grid-stride over rows * H.
extern "C" __global__ void moe_combine(float* X, const float* Y, const float* wts, int topk, int H, int rows,
                                       const float* S, const float* L, int LS, int E) {
  pdl_wait();
  pdl_launch();
  const size_t n = (size_t)rows * H;
  for (size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x; idx < n; idx += (size_t)gridDim.x * blockDim.x) {
    const size_t r = idx / H, j = idx % H;
    float m = 0.0f;
    for (int k = 0; k < topk; k++) {
      const float t = __fmul_rn(wts[r * topk + k], Y[(r * topk + k) * H + j]);
      m = k == 0 ? t : __fadd_rn(m, t);
    }
    if (S) {
      const float g = 1.0f / (1.0f + expf(-L[r * LS + E]));
      m = __fadd_rn(m, __fmul_rn(g, S[idx]));
    }
    X[idx] = __fadd_rn(X[idx], m);
  }
}
