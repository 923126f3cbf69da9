#!/usr/bin/env python3
"""HF transformers reference outputs of Gemma-3-270M (the catalog's `gemma-3-270m` Q4_K_M GGUF),
written as tests/fixtures/reference/transformers-gemma-3-270m.jsonl. Run by hand, not in CI:

    /work/venv/bin/python scripts/gemma_transformers_reference.py --gguf /work/gemma-3-270m-q4_k_m.gguf

Made with Python 3, torch 2.15.0 (CPU, float32, 1 thread), transformers 5.25.0, gguf 0.19.0,
tokenizers 0.23.3, sentencepiece 0.2.3, accelerate 1.16.0 (transformers requires it to load GGUF).

transformers' GGUF support dequantizes the Q4_K_M weights to float32 and converts the GGUF
vocabulary into a transformers tokenizer. The model is loaded with attn_implementation="eager".

For each line of tests/fixtures/prompts.jsonl (the last message's "content" used as a raw
completion prompt, no chat template: it is a base model), the prompt ids are taken from the
matching line of tests/fixtures/reference/llamacpp-gemma-3-270m.jsonl (`prompt_tokens`, BOS
first), so both references see identical inputs. The content is also tokenized with the
transformers tokenizer (add_special_tokens=True) and `tokenizer_equal` records whether those ids
equal llama.cpp's.

Fields per line: id, model ("gemma-3-270m"), prompt_tokens, tokenizer_equal, completion_tokens
(32 greedy tokens: argmax of the float32 logits, no sampling, no repetition penalty, no stop on
EOS), first_top5 (the 5 most likely first tokens as [id, logprob], logprob = log-softmax of the
raw logits over the full vocabulary, best first).
"""
import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
PROMPTS = os.path.join(ROOT, "tests/fixtures/prompts.jsonl")
LLAMACPP = os.path.join(ROOT, "tests/fixtures/reference/llamacpp-gemma-3-270m.jsonl")
OUT = os.path.join(ROOT, "tests/fixtures/reference/transformers-gemma-3-270m.jsonl")
NEW_TOKENS = 32


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", default="/work/gemma-3-270m-q4_k_m.gguf")
    ap.add_argument("--out", default=OUT)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    gguf_dir, gguf_name = os.path.split(os.path.abspath(args.gguf))
    t0 = time.time()
    tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf_dir, gguf_file=gguf_name, dtype=torch.float32, attn_implementation="eager"
    )
    model.eval()
    print(f"loaded in {time.time() - t0:.1f}s: {type(model).__name__}, config {model.config.model_type}, "
          f"vocab {model.config.vocab_size}, query_pre_attn_scalar {model.config.query_pre_attn_scalar}, "
          f"sliding_window {model.config.sliding_window}", file=sys.stderr)

    prompts = [json.loads(l) for l in open(PROMPTS) if l.strip()]
    refs = [json.loads(l) for l in open(LLAMACPP) if l.strip()]
    assert len(prompts) == len(refs), (len(prompts), len(refs))

    rows = []
    for p, r in zip(prompts, refs):
        assert p["id"] == r["id"], (p["id"], r["id"])
        content = p["messages"][-1]["content"]
        ids = list(r["prompt_tokens"])
        hf_ids = tok(content, add_special_tokens=True)["input_ids"]
        t1 = time.time()
        with torch.no_grad():
            out = model(torch.tensor([ids]), use_cache=True, logits_to_keep=1)
            logits = out.logits[0, -1].float()
            lp = torch.log_softmax(logits, dim=-1)
            top = torch.topk(lp, 5)
            first_top5 = [[int(i), float(v)] for v, i in zip(top.values, top.indices)]
            past = out.past_key_values
            completion = []
            nxt = int(torch.argmax(logits))
            for step in range(NEW_TOKENS):
                completion.append(nxt)
                if step == NEW_TOKENS - 1:
                    break
                out = model(torch.tensor([[nxt]]), past_key_values=past, use_cache=True)
                past = out.past_key_values
                nxt = int(torch.argmax(out.logits[0, -1]))
        row = {
            "id": p["id"],
            "model": "gemma-3-270m",
            "prompt_tokens": ids,
            "tokenizer_equal": hf_ids == ids,
            "completion_tokens": completion,
            "first_top5": first_top5,
        }
        rows.append(row)
        print(f"{p['id']}: {len(ids)} prompt tokens, tok_eq={row['tokenizer_equal']}, "
              f"first={completion[0]} (llama.cpp {r['completion_tokens'][0]}), {time.time() - t1:.1f}s",
              file=sys.stderr, flush=True)

    with open(args.out, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    print(f"wrote {args.out} (transformers {transformers.__version__}, torch {torch.__version__})", file=sys.stderr)


if __name__ == "__main__":
    main()
