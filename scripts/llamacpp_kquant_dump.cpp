// Records llama.cpp's CPU matrix products for Q4_K and Q6_K weights, as llama-server runs them,
// for `kernels::kquants` test `matches_llamacpp_recorded_products`.
//
// Q4_K weights go in the CPU repack buffer (llama.cpp repacks Q4_K on any AVX2 CPU), Q6_K in
// the plain CPU buffer (its >= 8-row products take ggml's tiled kernel). Pseudo-random weights
// (valid super-blocks: random quants and scales, small positive f16 scales) and activations.
//
// Build against a llama.cpp build (ggml-cpu compiled for AVX-512 VNNI, as the reference files
// in tests/fixtures/reference were made; see tests/fixtures/llamacpp-kquant/README.md):
//   g++ -O1 -std=c++17 -I$LLAMA/ggml/include scripts/llamacpp_kquant_dump.cpp \
//       -L$BUILD/bin -lggml -lggml-base -lggml-cpu -Wl,-rpath,$BUILD/bin -o kquant_dump
//   ./kquant_dump q4k|q6k ROWS OUT.bin
// OUT.bin: i32 n, k, m; n*k/256 super-blocks (row-major); m*k f32 activations; m*n f32 results.
#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

ggml_backend_buffer_type_t ggml_backend_cpu_repack_buffer_type(void);

static uint64_t state = 88172645463325252ull;
static uint64_t next() { state ^= state << 13; state ^= state >> 7; state ^= state << 17; return state; }
static float uniform() { return (next() >> 40) / float(1 << 24) * 2.0f - 1.0f; }

int main(int argc, char ** argv) {
    if (argc != 4) { fprintf(stderr, "usage: %s q4k|q6k ROWS OUT.bin\n", argv[0]); return 2; }
    const bool q4k = strcmp(argv[1], "q4k") == 0;
    const int n = 16, k = 512, m = atoi(argv[2]);
    const size_t bb = q4k ? 144 : 210, nb = k / 256;
    std::vector<uint8_t> w(n * nb * bb);
    for (auto & b : w) b = next() & 0xff;
    for (size_t blk = 0; blk < n * nb; blk++) {
        uint8_t * p = &w[blk * bb];
        ggml_fp16_t d = ggml_fp32_to_fp16(0.001f + 0.01f * (uniform() + 1));
        if (q4k) {
            ggml_fp16_t dmin = ggml_fp32_to_fp16(0.001f + 0.005f * (uniform() + 1));
            memcpy(p, &d, 2);
            memcpy(p + 2, &dmin, 2);
        } else {
            for (int i = 192; i < 208; i++) p[i] = (uint8_t) (int8_t) ((int) (next() % 60) - 30);
            memcpy(p + 208, &d, 2);
        }
    }
    std::vector<float> x((size_t) m * k);
    for (auto & v : x) v = uniform() * 3.0f;

    ggml_init_params ip = { 16 * 1024 * 1024, nullptr, true };
    ggml_context * wctx = ggml_init(ip);
    ggml_tensor * W = ggml_new_tensor_2d(wctx, q4k ? GGML_TYPE_Q4_K : GGML_TYPE_Q6_K, k, n);
    ggml_backend_buffer_t wbuf = ggml_backend_alloc_ctx_tensors_from_buft(
        wctx, q4k ? ggml_backend_cpu_repack_buffer_type() : ggml_backend_cpu_buffer_type());
    ggml_backend_tensor_set(W, w.data(), 0, w.size());

    ggml_context * ctx = ggml_init(ip);
    ggml_tensor * X = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, k, m);
    ggml_tensor * Y = ggml_mul_mat(ctx, W, X);
    ggml_backend_buffer_t xbuf = ggml_backend_alloc_ctx_tensors_from_buft(ctx, ggml_backend_cpu_buffer_type());
    ggml_backend_tensor_set(X, x.data(), 0, x.size() * 4);
    ggml_cgraph * g = ggml_new_graph(ctx);
    ggml_build_forward_expand(g, Y);
    ggml_backend_t be = ggml_backend_cpu_init();
    ggml_backend_cpu_set_n_threads(be, 2);
    ggml_backend_graph_compute(be, g);
    std::vector<float> y((size_t) m * n);
    ggml_backend_tensor_get(Y, y.data(), 0, y.size() * 4);

    FILE * f = fopen(argv[3], "wb");
    if (!f) { perror(argv[3]); return 1; }
    const int32_t hdr[3] = { n, k, m };
    fwrite(hdr, 4, 3, f);
    fwrite(w.data(), 1, w.size(), f);
    fwrite(x.data(), 4, x.size(), f);
    fwrite(y.data(), 4, y.size(), f);
    fclose(f);
    ggml_backend_free(be);
    ggml_backend_buffer_free(xbuf);
    ggml_backend_buffer_free(wbuf);
    ggml_free(ctx);
    ggml_free(wctx);
    return 0;
}
