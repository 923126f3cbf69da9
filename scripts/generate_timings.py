#!/usr/bin/env python3
"""Per-prompt timings of `specula generate --json`: prefill and decode time and the mean time of a
target forward by row count, for the fixture prompts of chosen kinds (one process per prompt:
nothing is cached between prompts).

Usage:
    python3 scripts/generate_timings.py --bin target/release/specula --model smollm2-135m-instruct \
        --device cuda:0 --kinds long_context,prose [--spec off] [--max-tokens 128]

Standard library only.
"""

import argparse
import json
import subprocess
from pathlib import Path


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="target/release/specula")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--kinds", default="long_context")
    ap.add_argument("--spec", default="off")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompts", default=str(Path(__file__).resolve().parent.parent / "tests/fixtures/prompts.jsonl"))
    a = ap.parse_args()
    kinds = set(a.kinds.split(","))
    for line in open(a.prompts):
        if not line.strip():
            continue
        p = json.loads(line)
        if p["kind"] not in kinds:
            continue
        cmd = [a.bin, "generate", "--model", a.model, "--device", a.device, "--chat", "--prompt",
               p["messages"][-1]["content"], "--max-tokens", str(a.max_tokens), "--spec", a.spec, "--json"]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            print(p["id"], "failed:", r.stderr.strip().splitlines()[-1:])
            continue
        out = json.loads(r.stdout.strip().splitlines()[-1])
        t, u = out["timings"], out["usage"]
        fwd = " ".join(f"{f['rows']}r:{f['mean_ms']:.2f}ms×{f['count']}" for f in out["speculative"]["target_forwards"])
        print(f"{p['id']} {p['kind']}: prompt {u['prompt_tokens']} tokens, prefill {t['prefill_s'] * 1e3:.1f} ms "
              f"({u['prompt_tokens'] / max(t['prefill_s'], 1e-9):.0f} tok/s), decode {u['completion_tokens']} tokens in "
              f"{t['decode_s'] * 1e3:.1f} ms ({u['completion_tokens'] / max(t['decode_s'], 1e-9):.0f} tok/s); forwards {fwd}",
              flush=True)


if __name__ == "__main__":
    main()
