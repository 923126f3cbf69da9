#!/usr/bin/env python3
"""Side-by-side AR vs speculative decoding benchmark, greedy, through `specula generate --json`.

For each prompt of the chosen kinds (tests/fixtures/prompts.jsonl), runs plain AR and each
speculative configuration back to back (interleaved, so machine noise hits both alike), checks
that the text is byte-identical, and reports decode tok/s, the ratio to AR, tau and acceptance.

    python3 scripts/spec_bench.py --model smollm2-135m-instruct --kinds easy_code,long_context
"""

import argparse
import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def run(binary, model, prompt, max_tokens, spec, draft_max):
    cmd = [binary, "generate", "--model", model, "--chat", "--prompt", prompt, "--max-tokens", str(max_tokens),
           "--temperature", "0", "--json", "--spec", spec, "--draft-max", str(draft_max)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--kinds", default="easy_code,long_context,prose")
    ap.add_argument("--draft-max", default="4,8")
    ap.add_argument("--binary", default=str(ROOT / "target/release/specula"))
    a = ap.parse_args()
    kinds = set(a.kinds.split(","))
    prompts = [json.loads(l) for l in open(ROOT / "tests/fixtures/prompts.jsonl")]
    totals = {}
    for p in prompts:
        if p["kind"] not in kinds:
            continue
        text = p["messages"][-1]["content"]
        ar = run(a.binary, a.model, text, p["max_tokens"], "off", 1)
        ar_rate = (len(ar["token_ids"]) - 1) / ar["timings"]["decode_s"]
        row = [p["id"], p["kind"], f"AR {ar_rate:6.1f} tok/s"]
        for k in a.draft_max.split(","):
            sp = run(a.binary, a.model, text, p["max_tokens"], "ngram", int(k))
            if sp["text"] != ar["text"]:
                print(f"{p['id']}: speculative output differs from AR (k={k})", file=sys.stderr)
                sys.exit(1)
            rate = (len(sp["token_ids"]) - 1) / sp["timings"]["decode_s"]
            s = sp["speculative"]
            row.append(f"k<={k}: {rate / ar_rate:4.2f}x tau {s['tau']:.2f} acc {s['acceptance_rate']:.2f}")
            t = totals.setdefault((p["kind"], k), [0.0, 0.0])
            t[0] += ar["timings"]["decode_s"] / (len(ar["token_ids"]) - 1)
            t[1] += sp["timings"]["decode_s"] / (len(sp["token_ids"]) - 1)
        print(" | ".join(row), flush=True)
    for (kind, k), (ar_t, sp_t) in sorted(totals.items()):
        print(f"{kind:13s} k<={k}: speculative / AR speed = {ar_t / sp_t:.2f}x (identical output)")


if __name__ == "__main__":
    main()
