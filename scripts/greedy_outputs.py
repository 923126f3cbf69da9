#!/usr/bin/env python3
"""Greedy outputs of the shared prompts (tests/fixtures/prompts.jsonl) as JSON lines, with the
prompt and output token ids, for `examples/ngram_replay.rs`:

    python3 scripts/greedy_outputs.py --model qwen2.5-coder-0.5b-instruct > /tmp/q05.jsonl
"""
import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--binary", default=str(ROOT / "target/release/specula"))
    ap.add_argument("--kinds", default="all")
    a = ap.parse_args()
    for line in open(ROOT / "tests/fixtures/prompts.jsonl"):
        p = json.loads(line)
        if a.kinds != "all" and p["kind"] not in a.kinds.split(","):
            continue
        cmd = [a.binary, "generate", "--model", a.model, "--chat", "--prompt", p["messages"][-1]["content"],
               "--max-tokens", str(p["max_tokens"]), "--temperature", "0", "--json", "--spec", "off"]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            sys.exit(f"{p['id']}: {out.stderr}")
        r = json.loads(out.stdout)
        print(json.dumps({"id": p["id"], "kind": p["kind"], "prompt_token_ids": r["prompt_token_ids"],
                          "token_ids": r["token_ids"], "text": r["text"]}), flush=True)


if __name__ == "__main__":
    main()
