#!/usr/bin/env python3
"""Depth-1 acceptance of MTP heads on the shared prompts, side by side: greedy, one draft per
step (`--draft-max 1 --fixed-k`), per prompt kind. Deterministic (no timing), so one run each.

    python3 scripts/head_acceptance.py heads/smollm2-135m-instruct.mtp /tmp/other-head
"""

import argparse
import collections
import json
import pathlib
import subprocess

ROOT = pathlib.Path(__file__).resolve().parent.parent

a = argparse.ArgumentParser()
a.add_argument("heads", nargs="+")
a.add_argument("--binary", default=str(ROOT / "target/release/specula"))
a.add_argument("--model", default="smollm2-135m-instruct")
a = a.parse_args()
acc = collections.defaultdict(lambda: collections.defaultdict(lambda: [0, 0]))
for line in open(ROOT / "tests/fixtures/prompts.jsonl"):
    p = json.loads(line)
    for h in a.heads:
        cmd = [a.binary, "generate", "--model", a.model, "--chat", "--prompt", p["messages"][-1]["content"],
               "--max-tokens", str(p["max_tokens"]), "--temperature", "0", "--json", "--spec", "mtp",
               "--draft-max", "1", "--fixed-k", "--drafter", h]
        s = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)["speculative"]
        acc[p["kind"]][h][0] += s["accepted"]
        acc[p["kind"]][h][1] += s["drafted"]
print("kind           " + "  ".join(pathlib.Path(h).name[:16].ljust(16) for h in a.heads))
for k, v in acc.items():
    print(f"{k:14s} " + "  ".join(f"{v[h][0] / max(v[h][1], 1):.3f} ({v[h][1]})".ljust(16) for h in a.heads))
tot = {h: [sum(acc[k][h][i] for k in acc) for i in (0, 1)] for h in a.heads}
print("all            " + "  ".join(f"{tot[h][0] / max(tot[h][1], 1):.3f} ({tot[h][1]})".ljust(16) for h in a.heads))
