// Prints llama.cpp's logits for every position of fixed token sequences, and a greedy
// continuation of the first sequence, as JSON on stdout. Used by scripts/moe_tiny_fixture.py
// for the `llamacpp` section of tests/fixtures/qwen3moe-tiny/reference.json and
// tests/fixtures/qwen2moe-tiny/reference.json.
//
// Each sequence is decoded in ONE batch with logits requested at every position, on a fresh
// KV cache (cleared between sequences), in llama.cpp's default settings: an f16 KV cache and
// flash attention `auto` (on for the CPU), which Specula's reference mode reproduces
// (`Engine::logits_as_llamacpp`). The deviations from an f32 reference come from the GGUF
// weight type, the activations' quantization in the products, the f16 cache and the summation
// order.
// CPU only, 1 thread (deterministic).
//
// Build against a CPU llama.cpp build (static libs, OpenMP on), e.g. with
//   LLAMA=/work/llama/llama_cpp_python-0.3.36/vendor/llama.cpp BUILD=/work/llama/build
//   g++ -O1 -std=c++17 -I$LLAMA/include -I$LLAMA/ggml/include scripts/llamacpp_logits_dump.cpp \
//       $BUILD/src/libllama.a $BUILD/ggml/src/libggml.a $BUILD/ggml/src/libggml-cpu.a \
//       $BUILD/ggml/src/libggml-base.a -fopenmp -lpthread -ldl -o /tmp/llamacpp_logits_dump
// Run:
//   /tmp/llamacpp_logits_dump MODEL.gguf N_GREEDY IDS [IDS ...]     (IDS: comma-separated ids)
// Output:
//   {"n_vocab": V, "sequences": [{"tokens": [...], "logits": [[V floats] per position]}, ...],
//    "greedy": {"prompt": [...], "generated": [N_GREEDY ids]}}
#include "llama.h"
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

static void quiet_log(enum ggml_log_level level, const char * text, void *) {
    if (level == GGML_LOG_LEVEL_ERROR) fputs(text, stderr);
}

static std::vector<llama_token> parse_ids(const char * s) {
    std::vector<llama_token> ids;
    std::string cur;
    for (const char * p = s;; p++) {
        if (*p == ',' || *p == '\0') {
            if (!cur.empty()) ids.push_back((llama_token) atoi(cur.c_str()));
            cur.clear();
            if (*p == '\0') break;
        } else {
            cur += *p;
        }
    }
    return ids;
}

static int argmax(const float * v, int n) {
    int best = 0;
    for (int i = 1; i < n; i++) if (v[i] > v[best]) best = i;
    return best;
}

// Decodes `toks` at positions pos0.. in one batch; logits at every position if all_logits,
// else only at the last one.
static void decode(llama_context * ctx, const std::vector<llama_token> & toks, int pos0, bool all_logits) {
    llama_batch b = llama_batch_init((int32_t) toks.size(), 0, 1);
    for (size_t i = 0; i < toks.size(); i++) {
        b.token[i] = toks[i];
        b.pos[i] = pos0 + (llama_pos) i;
        b.n_seq_id[i] = 1;
        b.seq_id[i][0] = 0;
        b.logits[i] = all_logits || i + 1 == toks.size();
    }
    b.n_tokens = (int32_t) toks.size();
    if (llama_decode(ctx, b) != 0) { fprintf(stderr, "llama_decode failed\n"); exit(1); }
    llama_batch_free(b);
}

int main(int argc, char ** argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: %s MODEL.gguf N_GREEDY IDS [IDS ...]\n", argv[0]);
        return 2;
    }
    llama_log_set(quiet_log, nullptr);
    llama_backend_init();

    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) { fprintf(stderr, "cannot load %s\n", argv[1]); return 1; }
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    const int n_greedy = atoi(argv[2]);

    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = 256;
    cp.n_batch = 256;
    cp.n_ubatch = 256;
    cp.n_seq_max = 1;
    cp.n_threads = 1;
    cp.n_threads_batch = 1;
    cp.type_k = GGML_TYPE_F16;
    cp.type_v = GGML_TYPE_F16;
    cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_AUTO;
    cp.no_perf = true;
    llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) { fprintf(stderr, "cannot create context\n"); return 1; }

    printf("{\"n_vocab\":%d,\"sequences\":[", n_vocab);
    std::vector<llama_token> first;
    for (int s = 3; s < argc; s++) {
        std::vector<llama_token> toks = parse_ids(argv[s]);
        if (s == 3) first = toks;
        llama_memory_clear(llama_get_memory(ctx), true);
        decode(ctx, toks, 0, true);
        printf("%s{\"tokens\":[", s == 3 ? "" : ",");
        for (size_t i = 0; i < toks.size(); i++) printf("%s%d", i ? "," : "", toks[i]);
        printf("],\"logits\":[");
        for (size_t i = 0; i < toks.size(); i++) {
            const float * l = llama_get_logits_ith(ctx, (int32_t) i);
            printf("%s[", i ? "," : "");
            for (int j = 0; j < n_vocab; j++) printf("%s%.9g", j ? "," : "", l[j]);
            printf("]");
        }
        printf("]}");
    }
    printf("],");

    // Greedy continuation of the first sequence: one batch for the prompt, then one token at a time.
    llama_memory_clear(llama_get_memory(ctx), true);
    decode(ctx, first, 0, false);
    std::vector<llama_token> gen;
    int pos = (int) first.size();
    for (int k = 0; k < n_greedy; k++) {
        const float * l = llama_get_logits_ith(ctx, -1);
        llama_token t = argmax(l, n_vocab);
        gen.push_back(t);
        if (k + 1 < n_greedy) decode(ctx, {t}, pos++, false);
    }
    printf("\"greedy\":{\"prompt\":[");
    for (size_t i = 0; i < first.size(); i++) printf("%s%d", i ? "," : "", first[i]);
    printf("],\"generated\":[");
    for (size_t i = 0; i < gen.size(); i++) printf("%s%d", i ? "," : "", gen[i]);
    printf("]}}\n");

    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
