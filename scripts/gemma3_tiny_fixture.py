#!/usr/bin/env python3
"""Generates tests/fixtures/gemma3-tiny/: a tiny random Gemma 3 text model as a HF bundle
(config.json, model.safetensors, tokenizer.json, tokenizer_config.json, README.md) and
reference.json, the HF transformers float32 logits of every position of 3 fixed token sequences.
Run by hand, not in CI:

    /work/venv/bin/python scripts/gemma3_tiny_fixture.py

Made with Python 3.11, torch 2.15.0 (CPU), transformers 5.25.0, safetensors 0.8.0,
tokenizers 0.23.3.

The model exercises what distinguishes Gemma 3 from a Llama-style model: `(1 + w)` RMSNorm
weights everywhere (including the per-head q_norm/k_norm), all re-initialised to N(0, 0.3)
because Gemma initialises them to zero; the query scale query_pre_attn_scalar^-1/2 with
query_pre_attn_scalar = 24 (deliberately not head_dim = 32); a sliding window of 5 on layers 0-2
(the test sequences are longer than that) and full attention on layer 3; the two RoPE bases
(1e6 global, 1e4 local); the sqrt(hidden) embedding scale; GeGLU (gelu_pytorch_tanh) MLP; tied
embeddings.

Config field names: transformers 5.x no longer stores `rope_theta` / `rope_local_base_freq` as
config attributes. They are passed as the legacy keyword arguments (which this version still
accepts) and end up in `rope_parameters` = {"full_attention": {"rope_theta": 1e6, ...},
"sliding_attention": {"rope_theta": 1e4, ...}}. The saved config.json is kept as transformers 5
writes it, so the fixture tests that layout (Hub configs of transformers 4 have the two
top-level keys instead; Specula reads both).
"""
import json
import math
import os
import shutil

import safetensors
import tokenizers
import torch
import transformers
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
OUT = os.path.join(ROOT, "tests/fixtures/gemma3-tiny")
VOCAB = 512
SEQ_LENS = [7, 12, 19]


def sig6(x):
    """Round to 6 significant digits (as a float that json writes compactly)."""
    return float(f"{x:.6g}")


def make_config():
    return Gemma3TextConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        query_pre_attn_scalar=24,
        sliding_window=5,
        layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
        rope_theta=1_000_000.0,
        rope_local_base_freq=10_000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=256,
        hidden_activation="gelu_pytorch_tanh",
        final_logit_softcapping=None,
        attn_logit_softcapping=None,
        tie_word_embeddings=True,
        bos_token_id=2,
        eos_token_id=1,
        pad_token_id=0,
    )


def vocab_tokens():
    """512 distinct tokens: 4 specials, then letters/digits/punctuation, then filler words."""
    toks = ["<pad>", "<eos>", "<bos>", "<unk>"]
    chars = [chr(c) for c in range(33, 127)]  # printable ASCII without space: 94 tokens
    toks += chars
    i = 0
    while len(toks) < VOCAB:
        toks.append(f"w{i}")
        i += 1
    assert len(toks) == VOCAB and len(set(toks)) == VOCAB
    return toks


def write_tokenizer(out):
    toks = vocab_tokens()
    vocab = {t: i for i, t in enumerate(toks)}
    tj = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": True}
            for i, t in enumerate(toks[:4])
        ],
        "normalizer": None,
        "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": None,
        "decoder": None,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"},
    }
    with open(os.path.join(out, "tokenizer.json"), "w") as f:
        json.dump(tj, f, ensure_ascii=False)
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<bos>", "eos_token": "<eos>", "add_bos_token": True}, f, indent=2)
        f.write("\n")
    # Check it loads and round-trips with the tokenizers library (the Rust crate reads the same JSON).
    t = tokenizers.Tokenizer.from_file(os.path.join(out, "tokenizer.json"))
    assert t.get_vocab_size() == VOCAB, t.get_vocab_size()
    enc = t.encode("w0 a <bos> w413 zzz")
    assert enc.ids == [vocab["w0"], vocab["a"], 2, vocab["w413"], 3], enc.ids
    assert t.id_to_token(511) == toks[511]


def main():
    torch.set_num_threads(1)
    os.makedirs(OUT, exist_ok=True)
    for name in os.listdir(OUT):
        if name != "README.md":  # README.md is hand-written
            p = os.path.join(OUT, name)
            shutil.rmtree(p) if os.path.isdir(p) else os.remove(p)

    config = make_config()
    torch.manual_seed(0)
    model = Gemma3ForCausalLM._from_config(config, attn_implementation="eager", dtype=torch.float32)
    model.eval()

    # Norm weights: Gemma multiplies by (1 + w) and initialises w = 0; randomise them so the offset
    # matters. Other weights: the default init (std 0.02) gives near-uniform logits; scale them up.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0.0, 0.3)
            elif name == "model.embed_tokens.weight":
                # Tied, so this sets both the input (x sqrt(64)) and the logit scale. Larger values give
                # larger logits but make every position's argmax its own input token (the embedding
                # carried by the residual dominates); 0.2 gives logit std ~1.65 and 10 of 38 positions
                # whose argmax is not the input token.
                p.normal_(0.0, 0.2)
            else:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[1]))
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr(), "lm_head not tied"

    model.save_pretrained(OUT, safe_serialization=True)
    os.chmod(os.path.join(OUT, "model.safetensors"), 0o644)  # written 0600
    for extra in ["generation_config.json"]:
        p = os.path.join(OUT, extra)
        if os.path.exists(p):
            os.remove(p)

    cfg_path = os.path.join(OUT, "config.json")
    cj = json.load(open(cfg_path))
    assert cj["model_type"] == "gemma3_text", cj["model_type"]
    print("config.json keys:", sorted(cj.keys()))
    print("rope_parameters:", cj["rope_parameters"])

    write_tokenizer(OUT)

    # Round trip: reload config + weights and check they compute the same thing.
    cfg2 = Gemma3TextConfig.from_pretrained(OUT)
    for k in ["query_pre_attn_scalar", "sliding_window", "layer_types", "head_dim", "hidden_activation",
              "final_logit_softcapping", "attn_logit_softcapping", "tie_word_embeddings", "rope_parameters"]:
        assert getattr(cfg2, k) == getattr(config, k), (k, getattr(cfg2, k), getattr(config, k))
    model2 = Gemma3ForCausalLM.from_pretrained(OUT, attn_implementation="eager", dtype=torch.float32).eval()
    with safetensors.safe_open(os.path.join(OUT, "model.safetensors"), "pt") as f:
        names = sorted(f.keys())
    print(f"model.safetensors: {len(names)} tensors:", names)

    gen = torch.Generator().manual_seed(1234)
    seqs = []
    with torch.no_grad():
        for n in SEQ_LENS:
            ids = torch.randint(4, VOCAB, (n,), generator=gen).tolist()
            logits = model(torch.tensor([ids])).logits[0].float()
            logits2 = model2(torch.tensor([ids])).logits[0].float()
            assert torch.equal(logits, logits2), "reloaded model differs"
            top2 = logits.topk(2, dim=-1).values
            print(f"len {n}: logits std {logits.std().item():.3f}, "
                  f"argmax != input token at {(logits.argmax(-1) != torch.tensor(ids)).sum().item()} positions, "
                  f"min top1-top2 margin {(top2[:, 0] - top2[:, 1]).min().item():.4f}")
            assert logits.std().item() > 1.0
            seqs.append({
                "tokens": ids,
                "argmax": logits.argmax(dim=-1).tolist(),
                "logits": [[sig6(v) for v in row.tolist()] for row in logits],
            })

    ref = {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "dtype": "float32",
        "attn_implementation": "eager",
        "bos_added": False,
        "sequences": seqs,
        "hidden_last_layer_note": (
            "logits[i] are the float32 logits (after the final (1 + w) RMSNorm and the tied lm_head, no "
            "soft-capping) of position i given tokens[0..=i], exactly as listed (no BOS is prepended), "
            "rounded to 6 significant digits; argmax[i] is their greedy argmax (from the unrounded "
            "logits). Hidden states of the last layer are not stored."
        ),
    }
    with open(os.path.join(OUT, "reference.json"), "w") as f:
        json.dump(ref, f, separators=(",", ":"))
        f.write("\n")

    total = 0
    for name in sorted(os.listdir(OUT)):
        size = os.path.getsize(os.path.join(OUT, name))
        total += size
        print(f"{name}: {size} bytes")
    print(f"total {total} bytes")
    # The f32 weights alone are 229,440 parameters = ~918 KB, so the directory is ~1.1 MB.
    assert total < 1_200_000, total


if __name__ == "__main__":
    main()
