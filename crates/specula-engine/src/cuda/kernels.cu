// Specula's CUDA kernels: the decode / verify forward of a dense Llama / Qwen2 / Qwen3 model.
//
// The promise these kernels keep is batch invariance: every output row is computed by the same
// instructions in the same order whatever the number of rows in the launch (and whatever the
// other rows are), so the logits of row i of a (k+1)-row verify are bitwise equal to a one-row
// decode at the same position. How:
//   * gemv_m{M}: one warp owns RW output features; each lane walks K in 8-element chunks at
//     lane, lane+32, ... and folds them into one f32 accumulator per (row, feature) with
//     round-to-nearest FMAs in that fixed order, then a fixed xor-butterfly across the warp.
//     M (the number of input rows, 1..16) only changes how many accumulators a lane keeps, never
//     the order of one accumulator's operations.
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

// ---------------------------------------------------------------------------------------------
// Y[m, n] = sum_k W[n, k] * X[m, k] (+ R[m, n]) for m < M, n < N.
// W: bf16 [N, K] row-major; X: bf16 [M, K]; R, Y: f32 [M, N] (R may alias Y, or be null).
// K must be a multiple of 8. Block: 256 threads (8 warps), each warp RW consecutive features.
template <int M, int RW, int U>
__device__ __forceinline__ void gemv_impl(const bf16_t* __restrict__ W, const bf16_t* __restrict__ X,
                                          const float* R, float* Y, int N, int K) {
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
// X[r, :] = E[tok[r], :] (f32 residual stream). Grid: rows.
extern "C" __global__ void embed_rows(const bf16_t* E, const int* tok, float* X, int H) {
  const bf16_t* e = E + (size_t)tok[blockIdx.x] * H;
  float* x = X + (size_t)blockIdx.x * H;
  for (int i = threadIdx.x; i < H; i += blockDim.x) x[i] = bf2f(e[i]);
}

// Y[r, :] = bf16(X[r, :] * rsqrt(mean(X[r, :]^2) + eps) * w). Grid: rows; block 256.
extern "C" __global__ void rmsnorm_bf16(const float* X, const bf16_t* w, bf16_t* Y, int H, float eps) {
  __shared__ float sh[32];
  const float* x = X + (size_t)blockIdx.x * H;
  float ss = 0.0f;
  for (int i = threadIdx.x; i < H; i += blockDim.x) ss = __fmaf_rn(x[i], x[i], ss);
  ss = block_sum(ss, sh);
  float inv = rsqrtf(ss / (float)H + eps);
  bf16_t* y = Y + (size_t)blockIdx.x * H;
  for (int i = threadIdx.x; i < H; i += blockDim.x) y[i] = f2bf(x[i] * inv * bf2f(w[i]));
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
  float v = 0.0f;
  if (active) {
    v = QKV[(size_t)r * width + h * hd + d];
    if (bias) v += bias[h * hd + d];
  }
  const size_t cache_row = ((size_t)slot[r] * max_ctx + pos[r]) * nkv;
  if (h >= nh + nkv) {  // a V head: uniform across the block
    if (active) Vc[(cache_row + (h - nh - nkv)) * hd + d] = f2bf(v);
    return;
  }
  const bf16_t* nw = h < nh ? qnorm : knorm;
  if (nw) {
    float ss = block_sum(v * v, sh);
    if (active) v = v * rsqrtf(ss / (float)hd + eps) * bf2f(nw[d]);
  }
  if (active) xs[d] = v;
  __syncthreads();
  if (!active) return;
  const int half = hd / 2;
  float out;
  if (interleaved) {
    float c, s;
    sincosf((float)pos[r] * inv_freq[d / 2], &s, &c);
    out = (d & 1) == 0 ? xs[d] * c - xs[d + 1] * s : xs[d] * c + xs[d - 1] * s;
  } else {
    int i = d < half ? d : d - half;
    float c, s;
    sincosf((float)pos[r] * inv_freq[i], &s, &c);
    out = d < half ? xs[d] * c - xs[d + half] * s : xs[d] * c + xs[d - half] * s;
  }
  if (h < nh)
    Q[((size_t)r * nh + h) * hd + d] = out;
  else
    Kc[(cache_row + (h - nh)) * hd + d] = f2bf(out);
}

// Causal attention of one row and one query head over its slot's cache, positions 0..=pos[r].
// Q: f32 [rows, nh, hd]; S: f32 scratch [rows, nh, max_ctx]; O: bf16 [rows, nh * hd].
// Grid: (rows, nh); block: 256 threads (8 warps). Scores: one thread per position. Weighted
// sum of V: warp w folds positions w, w + 8, ... (lane owns d = lane + 32 j), then the 8 warp
// partials are added in warp order: a fixed order that depends only on pos[r].
extern "C" __global__ void attention_rows(const float* Q, const bf16_t* Kc, const bf16_t* Vc, const int* pos,
                                          const int* slot, float* S, bf16_t* O, int nh, int nkv, int hd,
                                          int max_ctx, float scale) {
  __shared__ float sh[32];
  __shared__ float q[256];
  __shared__ float part[8][256];
  const int r = blockIdx.x, h = blockIdx.y;
  const int kvh = h / (nh / nkv);
  const int L = pos[r] + 1;
  for (int d = threadIdx.x; d < hd; d += blockDim.x) q[d] = Q[((size_t)r * nh + h) * hd + d];
  __syncthreads();
  float* s = S + ((size_t)r * nh + h) * max_ctx;
  const size_t stride = (size_t)nkv * hd;
  const bf16_t* kb = Kc + (size_t)slot[r] * max_ctx * stride + (size_t)kvh * hd;
  const bf16_t* vb = Vc + (size_t)slot[r] * max_ctx * stride + (size_t)kvh * hd;
  float mx = -INFINITY;
  for (int t = threadIdx.x; t < L; t += blockDim.x) {
    const uint4* k = reinterpret_cast<const uint4*>(kb + (size_t)t * stride);
    float a = 0.0f;
    for (int c = 0; c < hd / 8; c++) {
      float kf[8];
      unpack8(k[c], kf);
#pragma unroll
      for (int j = 0; j < 8; j++) a = __fmaf_rn(q[c * 8 + j], kf[j], a);
    }
    a *= scale;
    s[t] = a;
    mx = fmaxf(mx, a);
  }
  mx = block_max(mx, sh);
  float sum = 0.0f;
  for (int t = threadIdx.x; t < L; t += blockDim.x) {
    float e = expf(s[t] - mx);
    s[t] = e;
    sum += e;
  }
  sum = block_sum(sum, sh);  // its barriers also publish s[] to the block
  const float inv = 1.0f / sum;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int nj = (hd + 31) >> 5;
  float acc[8];
#pragma unroll
  for (int j = 0; j < 8; j++) acc[j] = 0.0f;
#pragma unroll 4
  for (int t = warp; t < L; t += 8) {
    const float p = s[t];
    const bf16_t* v = vb + (size_t)t * stride;
#pragma unroll
    for (int j = 0; j < 8; j++) {
      int d = lane + 32 * j;
      if (j < nj && d < hd) acc[j] = __fmaf_rn(p, bf2f(v[d]), acc[j]);
    }
  }
#pragma unroll
  for (int j = 0; j < 8; j++) {
    int d = lane + 32 * j;
    if (j < nj && d < hd) part[warp][d] = acc[j];
  }
  __syncthreads();
  for (int d = threadIdx.x; d < hd; d += blockDim.x) {
    float o = part[0][d];
#pragma unroll
    for (int w = 1; w < 8; w++) o += part[w][d];
    O[((size_t)r * nh + h) * hd + d] = f2bf(o * inv);
  }
}

// A[r, i] = bf16(silu(G) * U) with GU = [G | U]: f32 [rows, 2I]. Grid-stride over rows * I.
extern "C" __global__ void silu_mul(const float* GU, bf16_t* A, int I, int rows) {
  size_t n = (size_t)rows * I;
  for (size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x; idx < n; idx += (size_t)gridDim.x * blockDim.x) {
    size_t r = idx / I, i = idx % I;
    float g = GU[r * 2 * I + i], u = GU[r * 2 * I + I + i];
    A[idx] = f2bf(g / (1.0f + expf(-g)) * u);
  }
}

// out[r] = the smallest index of the largest logit in row r. Grid: rows; block 1024.
extern "C" __global__ void argmax_rows(const float* Lg, int V, int* out) {
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
  for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (unsigned long long)gridDim.x * blockDim.x) {
    unsigned long long z = seed + i * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    float u = (float)(z >> 40) * (1.0f / 8388608.0f) - 1.0f;
    P[i] = f2bf(offset + scale * u);
  }
}
