#!/usr/bin/env python3
"""Same speed: build B against build A side by side, with an A/A control, on this noisy machine.

Each round runs A, B and A again (a copy of A, the control) in that order, one `bench --json`
each, and reads decode tok/s, prefill tok/s and the 8-row verify cost (`bench --verify-rows 8`),
then the 16-stream aggregate decode (`bench --engine --streams 16`). Printed: every round's
numbers and the medians of the paired ratios B/A and A'/A (the control shows the noise).

    cp target/release/specula /tmp/specula-new
    python3 scripts/speed_ab.py --a /tmp/specula-old --b /tmp/specula-new --rounds 5
"""
import argparse
import json
import shutil
import statistics
import subprocess
import tempfile
from pathlib import Path

PLAIN = ["bench", "--json", "--model", "smollm2-135m-instruct", "--prompt-tokens", "256", "--gen-tokens", "64",
         "--runs", "3", "--verify-rows", "8"]
ENGINE = ["bench", "--json", "--engine", "--model", "smollm2-135m-instruct", "--streams", "16", "--modes", "off",
          "--gen-tokens", "64", "--prompt-tokens", "64", "--runs", "1"]


def metrics(binary):
    d = json.loads(subprocess.run([binary, *PLAIN], capture_output=True, text=True, check=True).stdout)
    e = json.loads(subprocess.run([binary, *ENGINE], capture_output=True, text=True, check=True).stdout)
    verify8 = [v["ms"] for v in d["verify_cost"] if v["rows"] == 8][0]
    agg = [l for l in e["levels"] if l["mode"] == "off" and l["streams"] == 16][0]["aggregate_decode_tok_s"]
    # Higher is better for every entry (the verify cost as 8-row verifies per second).
    return {"decode tok/s": d["decode_tok_s"], "prefill tok/s": d["prefill_tok_s"],
            "8-row verify /s": 1000.0 / verify8, "16-stream tok/s": agg}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--a", required=True)
    ap.add_argument("--b", required=True)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    control = Path(tempfile.mkdtemp()) / "specula-a-copy"
    shutil.copy2(a.a, control)
    rows = []
    for r in range(a.rounds):
        ma, mb, mc = metrics(a.a), metrics(a.b), metrics(str(control))
        rows.append((ma, mb, mc))
        print(f"round {r}: " + "; ".join(f"{k} A {ma[k]:.1f} B {mb[k]:.1f} A' {mc[k]:.1f}" for k in ma), flush=True)
    print("\nmetric                B/A (median of rounds)   A'/A control")
    for k in rows[0][0]:
        ba = statistics.median(mb[k] / ma[k] for ma, mb, _ in rows)
        ca = statistics.median(mc[k] / ma[k] for ma, _, mc in rows)
        print(f"{k:20s}  {ba:.3f}                    {ca:.3f}")


if __name__ == "__main__":
    main()
