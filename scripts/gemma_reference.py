#!/usr/bin/env python3
"""Reference outputs of llama.cpp on Gemma-3-270M (the catalog's `gemma-3-270m` GGUF), written as
fixtures under tests/fixtures/reference/. Run by hand, not in CI:

    python3 scripts/gemma_reference.py --server LLAMA_BUILD/bin/llama-server --model gemma-3-270m-q4_k_m.gguf

LLAMA_BUILD is llama.cpp built from the llama-cpp-python 0.3.36 sdist (see the models notes).
Writes:
- llamacpp-gemma-3-270m.jsonl: per prompt of tests/fixtures/prompts.jsonl, its user message as a
  raw completion prompt (the base model has no chat template): prompt tokens (BOS first),
  greedy completion tokens, text, finish reason and the first token's top-5 raw logprobs
  (the same fields as the other llama.cpp references; see that directory's README);
- llamacpp-gemma3-tokenize.jsonl: token ids of a corpus of texts (whitespace runs, newlines,
  code, markup, many scripts, emoji, bytes outside the vocabulary), as llama.cpp tokenizes them
  without BOS and without special-token parsing (so the corpus holds no control-token text:
  Specula matches those in prompt text).
"""
import argparse
import json
import os
import subprocess
import time
import urllib.request

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
OUT = os.path.join(ROOT, "tests/fixtures/reference")

CORPUS = [
    "Hello world",
    " Hello world",
    "  two leading spaces",
    "trailing space ",
    "many     spaces   between",
    "tab\tseparated\tvalues",
    "line one\nline two\n\nline four\n\n\n\nafter four newlines",
    "\n",
    " ",
    "",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < 10; ++i) { printf(\"%d\\n\", i); }",
    "<table><tr><td>cell</td></tr></table>",
    "<h1>Title</h1>\n<p>Paragraph with <b>bold</b> text.</p>",
    "{\"name\": \"Ada\", \"age\": 36, \"tags\": [\"math\", \"engines\"]}",
    "The year 1843: 3.14159, -42, 1e-9, 0x1F, 1,000,000.",
    "Ünïcödé façade naïve coöperate",
    "Москва — столица России.",
    "東京は日本の首都です。",
    "北京是中国的首都。",
    "서울은 한국의 수도입니다.",
    "مرحبا بالعالم",
    "שלום עולם",
    "नमस्ते दुनिया",
    "สวัสดีชาวโลก",
    "Γειά σου Κόσμε",
    "emoji: 😀🎉👍🏽 family: 👨‍👩‍👧‍👦 flags: 🇫🇷🇯🇵",
    "math: ∀x∈ℝ, x² ≥ 0; ∑ᵢ aᵢ = ∫ f(x) dx",
    "private use: \ue000\ue001 and rare: 𓀀𓀁 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "control chars: \u0001\u0002\u007f end",
    "zero\u200bwidth\u200djoiner and nbsp\u00a0here",
    "CamelCaseIdentifierWithManyParts and snake_case_identifier_too",
    "https://example.com/path/to/page?query=1&other=two#fragment",
    "user@example.com, +1 (555) 123-4567",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "abababababababababababababababababababab",
    "........................................",
    "!!!???!!!???",
    "    indented code\n\tand a tab\r\nwindows line end",
    "[multimodal] marker as text",
    "The quick brown fox jumps over the lazy dog. " * 8,
]


def post(port, path, body):
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--server", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--port", type=int, default=18081)
    ap.add_argument("--max-tokens", type=int, default=64)
    a = ap.parse_args()
    srv = subprocess.Popen(
        [a.server, "-m", a.model, "-c", "8192", "-np", "1", "-t", "2", "--host", "127.0.0.1", "--port", str(a.port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(120):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{a.port}/health", timeout=1)
                break
            except Exception:
                time.sleep(0.5)
        with open(os.path.join(OUT, "llamacpp-gemma3-tokenize.jsonl"), "w") as f:
            for text in CORPUS:
                ids = post(a.port, "/tokenize", {"content": text, "add_special": False, "parse_special": False})
                f.write(json.dumps({"text": text, "tokens": ids["tokens"]}, ensure_ascii=False) + "\n")
        prompts = [json.loads(l) for l in open(os.path.join(ROOT, "tests/fixtures/prompts.jsonl")) if l.strip()]
        with open(os.path.join(OUT, "llamacpp-gemma-3-270m.jsonl"), "w") as f:
            for p in prompts:
                content = p["messages"][-1]["content"]
                toks = post(a.port, "/tokenize", {"content": content, "add_special": True, "parse_special": True})["tokens"]
                n = min(p["max_tokens"], a.max_tokens)
                r = post(
                    a.port,
                    "/completion",
                    {
                        "prompt": toks,
                        "n_predict": n,
                        "temperature": 0,
                        "top_k": 1,
                        "n_probs": 5,
                        "return_tokens": True,
                        "cache_prompt": False,
                        "seed": 0,
                        "repeat_penalty": 1.0,
                        "dry_multiplier": 0,
                    },
                )
                top5 = [[t["id"], t["logprob"]] for t in r["completion_probabilities"][0]["top_logprobs"]]
                stop = r.get("stop_type")
                f.write(
                    json.dumps(
                        {
                            "id": p["id"],
                            "model": "gemma-3-270m",
                            "max_tokens": n,
                            "finish_reason": "stop" if stop in ("eos", "word") else "length",
                            "prompt_tokens": toks,
                            "completion_tokens": r["tokens"],
                            "text": r["content"],
                            "first_top5": top5,
                        },
                        ensure_ascii=False,
                    )
                    + "\n"
                )
    finally:
        srv.terminate()
        srv.wait()


if __name__ == "__main__":
    main()
