#!/usr/bin/env python3
"""PyTorch side of the GPU comparison (docs/gpu.md): the same architecture shape as
`specula bench --device cuda:0 --shape NAME`, random bf16 weights, transformers' StaticCache and
torch.compile(mode="reduce-overhead") (CUDA graphs). Run it in the same device call as the
specula bench so the two are a side-by-side ratio.

Prints RESULT lines and, with --json FILE, writes them as JSON:
  copy bandwidth (bytes read + written per second), weight bytes and the bandwidth floor,
  decode tok/s per batch size (greedy, context 128 as specula's bench).

usage: python3 scripts/gpu_torch_baseline.py --shape qwen3-8b [--batches 1,64] [--json out.json]
"""
import argparse
import json
import time

import torch

SHAPES = {
    "qwen3-0.6b": dict(arch="qwen3", vocab=151936, hidden=1024, inter=3072, layers=28, heads=16, kv=8, hd=128, tied=True, theta=1e6),
    "qwen3-1.7b": dict(arch="qwen3", vocab=151936, hidden=2048, inter=6144, layers=28, heads=16, kv=8, hd=128, tied=True, theta=1e6),
    "qwen3-8b": dict(arch="qwen3", vocab=151936, hidden=4096, inter=12288, layers=36, heads=32, kv=8, hd=128, tied=False, theta=1e6),
    "llama-3.1-8b": dict(arch="llama", vocab=128256, hidden=4096, inter=14336, layers=32, heads=32, kv=8, hd=128, tied=False, theta=5e5),
    "qwen3-30b-a3b": dict(arch="qwen3moe", vocab=151936, hidden=2048, inter=6144, layers=48, heads=32, kv=4, hd=128, tied=False, theta=1e6,
                          experts=128, top_k=8, expert_inter=768),
}


def build(shape):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    s = SHAPES[shape]
    common = dict(vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["inter"],
                  num_hidden_layers=s["layers"], num_attention_heads=s["heads"], num_key_value_heads=s["kv"],
                  head_dim=s["hd"], max_position_embeddings=8192, rms_norm_eps=1e-6,
                  tie_word_embeddings=s["tied"], attention_bias=False,
                  rope_parameters={"rope_type": "default", "rope_theta": s["theta"]})
    if s["arch"] == "qwen3":
        cfg, cls = Qwen3Config(**common), Qwen3ForCausalLM
    elif s["arch"] == "qwen3moe":
        cfg = Qwen3MoeConfig(**common, num_experts=s["experts"], num_experts_per_tok=s["top_k"],
                             moe_intermediate_size=s["expert_inter"], norm_topk_prob=True,
                             decoder_sparse_step=1, mlp_only_layers=[])
        cls = Qwen3MoeForCausalLM
    else:
        common["rope_parameters"] = {"rope_type": "llama3", "rope_theta": s["theta"], "factor": 8.0,
                                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 8192}
        cfg, cls = LlamaConfig(**common), LlamaForCausalLM
    torch.manual_seed(0)
    with torch.device("cuda"):
        torch.set_default_dtype(torch.bfloat16)
        m = cls(cfg)
        torch.set_default_dtype(torch.float32)
    return cfg, m.eval()


def copy_bandwidth():
    x = torch.empty(1 << 30, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    y.copy_(x)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    torch.cuda.synchronize()
    bw = 2 * x.numel() * 2 * 10 / (time.perf_counter() - t)
    del x, y
    torch.cuda.empty_cache()
    return bw


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES))
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--json")
    ap.add_argument("--verify", default="", help="row counts of the verify-cost timing, e.g. 2,4,8")
    a = ap.parse_args()
    from transformers import StaticCache

    out = {"torch": torch.__version__, "device": torch.cuda.get_device_name(0), "shape": a.shape}
    bw = copy_bandwidth()
    out["copy_bandwidth_tb_s"] = bw / 1e12
    print(f"RESULT copy_bw {bw / 1e12:.2f} TB/s", flush=True)
    cfg, m = build(a.shape)
    wb = 2 * sum(p.numel() for p in m.parameters())
    out["weight_bytes"] = wb
    sh = SHAPES[a.shape]
    if "experts" in sh:
        # A one-row step reads top_k of the experts of each layer (specula's step_bytes).
        per_expert = 2 * 3 * sh["hidden"] * sh["expert_inter"]
        wb -= sh["layers"] * (sh["experts"] - sh["top_k"]) * per_expert
        out["step_bytes"] = wb
    out["floor_tok_s"] = bw / wb
    print(f"RESULT weights {wb / 1e9:.2f} GB, floor {wb / bw * 1e3:.3f} ms/token = {bw / wb:.0f} tok/s", flush=True)
    P, steps = 128, 40
    # MoE routing in transformers has data-dependent control flow: compile without fullgraph.
    fwd = torch.compile(m.forward, mode="reduce-overhead", fullgraph="experts" not in sh)
    out["decode"] = []
    with torch.inference_mode():
        for B in [int(b) for b in a.batches.split(",")]:
            cache = StaticCache(config=cfg, max_batch_size=B, max_cache_len=P + steps + 64)
            prompt = ((torch.arange(P, device="cuda") * 7919 + 13) % cfg.vocab_size)[None].repeat(B, 1)
            o = m(prompt, past_key_values=cache, cache_position=torch.arange(P, device="cuda"), use_cache=True)
            tok = o.logits[:, -1:].argmax(-1)

            def step(p, tok):
                pos = torch.tensor([p], device="cuda")
                r = fwd(tok, past_key_values=cache, cache_position=pos, position_ids=pos[None].repeat(B, 1), use_cache=True)
                return r.logits[:, -1:].argmax(-1).clone()

            p = P
            for _ in range(12):
                tok = step(p, tok)
                p += 1
            tok.cpu()
            t = time.perf_counter()
            for _ in range(steps):
                tok = step(p, tok)
                p += 1
                tok.cpu()
            dt = (time.perf_counter() - t) / steps
            out["decode"].append({"batch": B, "ms_per_step": dt * 1e3, "tok_s_aggregate": B / dt})
            print(f"RESULT torch_compiled_decode B={B}: {dt * 1e3:.3f} ms/step, {B / dt:.0f} tok/s aggregate", flush=True)
            del cache
            torch.cuda.empty_cache()
    if a.verify:
        # Verify cost: an r-row forward at batch 1 after the prompt, over a one-row one.
        out["verify"] = []
        with torch.inference_mode():
            cache = StaticCache(config=cfg, max_batch_size=1, max_cache_len=P + 64)
            prompt = ((torch.arange(P, device="cuda") * 7919 + 13) % cfg.vocab_size)[None]
            m(prompt, past_key_values=cache, cache_position=torch.arange(P, device="cuda"), use_cache=True)
            base = None
            for r in [1] + [int(x) for x in a.verify.split(",")]:
                toks = prompt[:, :r]
                pos = torch.arange(P, P + r, device="cuda")
                for _ in range(5):
                    fwd(toks, past_key_values=cache, cache_position=pos, position_ids=pos[None], use_cache=True)
                torch.cuda.synchronize()
                t = time.perf_counter()
                for _ in range(20):
                    fwd(toks, past_key_values=cache, cache_position=pos, position_ids=pos[None], use_cache=True)
                torch.cuda.synchronize()
                dt = (time.perf_counter() - t) / 20
                base = base or dt
                out["verify"].append({"rows": r, "ms": dt * 1e3, "relative_to_one_row": dt / base})
                print(f"RESULT torch_compiled_verify rows={r}: {dt * 1e3:.3f} ms = {dt / base:.2f}x", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
