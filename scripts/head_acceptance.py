#!/usr/bin/env python3
"""Acceptance of MTP heads on the shared prompts, side by side: greedy, a fixed number of drafts
per step (`--draft-max K --fixed-k`, K = 1 by default), per prompt kind. Deterministic (no
timing), so one run each. With K > 1 it prints the acceptance at each draft position given that
every earlier one was accepted (the rate that decides whether a longer draft pays).

    python3 scripts/head_acceptance.py heads/smollm2-135m-instruct.mtp /tmp/other-head
    python3 scripts/head_acceptance.py --k 2 heads/smollm2-135m-instruct.mtp
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
a.add_argument("--k", type=int, default=1, help="drafts per step (fixed)")
a = a.parse_args()
# acc[kind][head][position] = [accepted, drafted]
acc = collections.defaultdict(lambda: collections.defaultdict(lambda: [[0, 0] for _ in range(a.k)]))
for line in open(ROOT / "tests/fixtures/prompts.jsonl"):
    p = json.loads(line)
    for h in a.heads:
        cmd = [a.binary, "generate", "--model", a.model, "--chat", "--prompt", p["messages"][-1]["content"],
               "--max-tokens", str(p["max_tokens"]), "--temperature", "0", "--json", "--spec", "mtp",
               "--draft-max", str(a.k), "--fixed-k", "--drafter", h]
        s = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)["speculative"]
        for i, (n_acc, n_dr) in enumerate(zip(s["accepted_by_position"], s["drafted_by_position"])):
            acc[p["kind"]][h][i][0] += n_acc
            acc[p["kind"]][h][i][1] += n_dr


def cell(pos):
    """Acceptance at each position, conditional on the earlier ones, and the first's draft count."""
    rates = []
    for i, (n_acc, n_dr) in enumerate(pos):
        given = pos[i - 1][0] if i else n_dr
        rates.append(f"{n_acc / max(given, 1):.3f}")
    return (" / ".join(rates) + f" ({pos[0][1]})").ljust(16 + 8 * (a.k - 1))


print("kind           " + "  ".join(pathlib.Path(h).name[:16].ljust(16 + 8 * (a.k - 1)) for h in a.heads))
for k, v in acc.items():
    print(f"{k:14s} " + "  ".join(cell(v[h]) for h in a.heads))
tot = {h: [[sum(acc[k][h][i][j] for k in acc) for j in (0, 1)] for i in range(a.k)] for h in a.heads}
print("all            " + "  ".join(cell(tot[h]) for h in a.heads))
