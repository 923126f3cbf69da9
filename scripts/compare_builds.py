#!/usr/bin/env python3
"""Same bytes from two builds: greedy and seeded-sampled outputs of the catalog models with every
drafter each has (off, ngram, the Qwen draft-model pair, SmolLM2's MTP head and block drafter),
solo (`generate --json`) and as a batch of 8 concurrent requests to `serve`, compared byte for
byte (text and token ids) between build A and build B. Exits 1 on any difference.

    python3 scripts/compare_builds.py --a /tmp/specula-old --b target/release/specula
    python3 scripts/compare_builds.py --a OLD --b NEW --quick     # one prompt per case, SmolLM2 only

The models must be pulled (`specula pull NAME`). Prompts: tests/fixtures/prompts.jsonl.
"""
import argparse
import concurrent.futures
import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SMOL = "smollm2-135m-instruct"
Q05 = "qwen2.5-coder-0.5b-instruct"
Q15 = "qwen2.5-coder-1.5b-instruct"

BLOCK = str(ROOT / "heads/smollm2-135m-instruct.drafter")

# (model, [(--spec mode, extra CLI arguments)]); the last mode is also run as a batch of 8.
CASES = [
    (SMOL, [("off", []), ("ngram", []), ("block", ["--drafter", BLOCK]), ("mtp", [])]),
    (Q05, [("off", []), ("ngram", [])]),
    (Q15, [("off", []), ("ngram", []), ("draft", ["--draft-model", Q05])]),
]
SAMPLING = [("greedy", ["--temperature", "0"]), ("seeded", ["--temperature", "0.8", "--top-p", "0.95", "--seed", "42"])]


def prompts(n):
    out = []
    for line in open(ROOT / "tests/fixtures/prompts.jsonl"):
        p = json.loads(line)
        out.append(p["messages"][-1]["content"])
    # Spread over the kinds of text the file holds.
    step = max(1, len(out) // n)
    return out[::step][:n]


def generate(binary, model, extra, spec, sampling, prompt, max_tokens):
    cmd = [binary, "generate", "--model", model, *extra, "--chat", "--prompt", prompt, "--max-tokens",
           str(max_tokens), "--json", "--spec", spec, *sampling]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"{' '.join(cmd)}: {out.stderr}")
    d = json.loads(out.stdout)
    return d["text"], d.get("token_ids")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def batch(binary, model, extra, spec, sampling, ps, max_tokens):
    """The 8 prompts sent at once to one server; the texts in prompt order."""
    port = free_port()
    srv = subprocess.Popen([binary, "serve", model, *extra, "--port", str(port), "--spec", spec,
                            "--max-batch", "8"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        base = f"http://127.0.0.1:{port}"
        for _ in range(600):
            if srv.poll() is not None:
                sys.exit(f"{binary} serve {model} exited with {srv.returncode}")
            try:
                urllib.request.urlopen(base + "/health", timeout=1)
                break
            except OSError:
                time.sleep(0.2)
        temp = float(sampling[sampling.index("--temperature") + 1])

        def one(i):
            body = {"model": model, "messages": [{"role": "user", "content": ps[i]}], "max_tokens": max_tokens,
                    "temperature": temp}
            if "--seed" in sampling:
                body["seed"] = int(sampling[sampling.index("--seed") + 1])
                body["top_p"] = float(sampling[sampling.index("--top-p") + 1])
            req = urllib.request.Request(base + "/v1/chat/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=600) as r:
                return json.load(r)["choices"][0]["message"]["content"]

        with concurrent.futures.ThreadPoolExecutor(8) as ex:
            return list(ex.map(one, range(len(ps))))
    finally:
        srv.terminate()
        srv.wait()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--a", required=True, help="build A (e.g. the binary before a change)")
    ap.add_argument("--b", required=True, help="build B")
    ap.add_argument("--prompts", type=int, default=3, help="prompts per solo case")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    cases = CASES[:1] if a.quick else CASES
    n = 1 if a.quick else a.prompts
    diffs = 0
    runs = 0
    for model, specs in cases:
        for spec, extra in specs:
            for sname, sampling in SAMPLING:
                for i, p in enumerate(prompts(n)):
                    ra = generate(a.a, model, extra, spec, sampling, p, a.max_tokens)
                    rb = generate(a.b, model, extra, spec, sampling, p, a.max_tokens)
                    runs += 1
                    same = ra == rb
                    diffs += not same
                    print(f"{'same' if same else 'DIFF'}  solo   {model} spec={spec} {sname} prompt {i}", flush=True)
        # A batch of 8 with the model's strongest drafter, greedy and seeded.
        ps = prompts(8)
        for sname, sampling in SAMPLING:
            spec, extra = specs[-1]
            ra = batch(a.a, model, extra, spec, sampling, ps, a.max_tokens)
            rb = batch(a.b, model, extra, spec, sampling, ps, a.max_tokens)
            runs += 1
            same = ra == rb
            diffs += not same
            print(f"{'same' if same else 'DIFF'}  batch8 {model} spec={spec} {sname}", flush=True)
    print(f"{runs - diffs} same, {diffs} different")
    sys.exit(1 if diffs else 0)


if __name__ == "__main__":
    main()
