#!/usr/bin/env python3
"""Side-by-side AR vs speculative decoding benchmark, greedy, through `specula generate --json`.

For each prompt of the chosen kinds (tests/fixtures/prompts.jsonl), runs plain AR and each
speculative configuration back to back (interleaved, so machine noise hits both alike), checks
that the text is byte-identical, and reports decode tok/s as a ratio to AR, tau, acceptance by
draft position, and the measured costs that explain the ratio: the mean (k+1)-row verify forward
and the drafter's time per draft token, both in units of one 1-row target decode step, and the
gain they predict, tau / (verify_cost + k_mean * draft_cost).

Configurations are MODE:K[:fixed][@BINARY], MODE one of ngram, draft, mtp, block, on (adaptive
unless :fixed); mtp and block take the drafter from --mtp / --block, and on takes it too (the
MTP head, with n-gram lookup beside it). A configuration ending in
@BINARY runs that binary instead of --binary (for an old build side by side with a new one; both
are compared with the same AR run of --binary); one ending in +DRAFTER (after any @BINARY) uses
that MTP head or block drafter instead of --mtp / --block (two heads side by side).

    python3 scripts/spec_bench.py --model smollm2-135m-instruct --kinds easy_code,long_context \\
        --configs ngram:4,ngram:8,ngram:8:fixed
    python3 scripts/spec_bench.py --model qwen2.5-coder-1.5b-instruct \\
        --draft-model qwen2.5-coder-0.5b-instruct --kinds code,prose --configs draft:4,draft:4:fixed
    python3 scripts/spec_bench.py --kinds prose,code --mtp heads/smollm2-135m-instruct.mtp \\
        --configs mtp:1:fixed,mtp:2:fixed,mtp:3:fixed,mtp:3,ngram:4
"""

import argparse
import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def run(a, prompt, max_tokens, mode, k, fixed, binary=None, drafter=None):
    cmd = [binary or a.binary, "generate", "--model", a.model, "--chat", "--prompt", prompt, "--max-tokens", str(max_tokens),
           "--temperature", "0", "--json", "--spec", mode, "--draft-max", str(k)]
    if fixed:
        cmd.append("--fixed-k")
    if a.draft_model and mode != "off":
        cmd += ["--draft-model", a.draft_model]
    if a.draft_vocab and mode == "draft":
        cmd += ["--draft-vocab", a.draft_vocab]
        if a.draft_vocab_size:
            cmd += ["--draft-vocab-size", str(a.draft_vocab_size)]
    if drafter and mode in ("mtp", "block", "on"):
        cmd += ["--drafter", drafter]
    elif mode in ("mtp", "on") and a.mtp:
        cmd += ["--drafter", a.mtp]
    elif mode in ("block", "on") and a.block:
        cmd += ["--drafter", a.block]
    if a.threads:
        cmd += ["--threads", str(a.threads)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"{' '.join(cmd[:4])} ... failed:\n{out.stderr}")
    return json.loads(out.stdout)


def decode_rate(r):
    return (len(r["token_ids"]) - 1) / max(r["timings"]["decode_s"], 1e-9)


class Agg:
    """Sums over prompts for one (kind, config)."""

    def __init__(self):
        self.ar_s = self.sp_s = 0.0
        self.steps = self.committed = self.drafted = self.accepted = 0
        self.draft_s = 0.0
        self.fw = {}  # rows -> [count, total ms]
        self.by_pos = []  # [drafted, accepted]

    def add(self, ar, sp):
        n_ar, n_sp = len(ar["token_ids"]) - 1, len(sp["token_ids"]) - 1
        if n_ar <= 0 or n_sp <= 0:
            return
        self.ar_s += ar["timings"]["decode_s"] / n_ar
        self.sp_s += sp["timings"]["decode_s"] / n_sp
        s = sp["speculative"]
        self.steps += s["target_steps"]
        self.committed += s["committed"]
        self.drafted += s["drafted"]
        self.accepted += s["accepted"]
        self.draft_s += s["draft_s"]
        for f in s["target_forwards"]:
            e = self.fw.setdefault(f["rows"], [0, 0.0])
            e[0] += f["count"]
            e[1] += f["count"] * f["mean_ms"]
        for i, (d, acc) in enumerate(zip(s["drafted_by_position"], s["accepted_by_position"])):
            while len(self.by_pos) <= i:
                self.by_pos.append([0, 0])
            self.by_pos[i][0] += d
            self.by_pos[i][1] += acc

    def report(self, kind, cfg):
        speed = self.ar_s / self.sp_s if self.sp_s else 0.0
        tau = self.committed / max(self.steps, 1)
        one = self.fw.get(1)
        t1 = one[1] / one[0] if one and one[0] else None
        verify = [(r, c, ms) for r, (c, ms) in sorted(self.fw.items()) if r > 1]
        line = f"{kind:13s} {cfg:15.40s} speed {speed:4.2f}x AR | tau {tau:4.2f} | acceptance {self.accepted / max(self.drafted, 1):4.2f}"
        line += " | by position " + " ".join(f"{a / d:.2f}" for d, a in self.by_pos if d)
        if t1 and verify:
            n_verify = sum(c for _, c, _ in verify)
            k_mean = sum((r - 1) * c for r, c, _ in verify) / n_verify
            v_cost = sum(ms for _, _, ms in verify) / n_verify / t1
            d_cost = (1e3 * self.draft_s / max(self.drafted, 1)) / t1
            # Steps that did not verify cost one decode step each.
            frac_v = n_verify / max(self.steps, 1)
            step_cost = frac_v * (v_cost + k_mean * d_cost) + (1 - frac_v)
            line += (f" | verify(k={k_mean:.1f}) {v_cost:.2f} steps, draft {d_cost:.3f} steps/token,"
                     f" {100 * frac_v:.0f}% of steps verify -> predicted {tau / step_cost:.2f}x")
            line += " | cost by rows " + " ".join(f"{r}:{ms / c / t1:.2f}" for r, c, ms in verify if c >= 3)
        print(line, flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--draft-model")
    ap.add_argument("--draft-vocab", help="a draft vocabulary file for the draft model (configs draft:K)")
    ap.add_argument("--draft-vocab-size", type=int)
    ap.add_argument("--mtp", help="an MTP head (for configs mtp:K)")
    ap.add_argument("--block", help="a block drafter folder (for configs block:K)")
    ap.add_argument("--kinds", default="easy_code,long_context,prose")
    ap.add_argument("--configs", default="ngram:4,ngram:8")
    ap.add_argument("--threads", type=int)
    ap.add_argument("--binary", default=str(ROOT / "target/release/specula"))
    a = ap.parse_args()
    kinds = a.kinds.split(",")
    if a.kinds == "all":
        kinds = ["prose", "qa", "code", "easy_code", "json", "long_context"]
    configs = []
    for c in a.configs.split(","):
        c_head, _, drafter = c.partition("+")
        spec, _, binary = c_head.partition("@")
        parts = spec.split(":")
        configs.append((c, parts[0], int(parts[1]), len(parts) > 2 and parts[2] == "fixed", binary or None,
                        drafter or None))
    prompts = [json.loads(line) for line in open(ROOT / "tests/fixtures/prompts.jsonl")]
    aggs = {}
    for p in prompts:
        if p["kind"] not in kinds:
            continue
        text = p["messages"][-1]["content"]
        ar = run(a, text, p["max_tokens"], "off", 1, False)
        row = [p["id"], p["kind"], f"AR {decode_rate(ar):6.1f} tok/s"]
        for name, mode, k, fixed, binary, drafter in configs:
            sp = run(a, text, p["max_tokens"], mode, k, fixed, binary, drafter)
            if sp["text"] != ar["text"]:
                sys.exit(f"{p['id']}: speculative output differs from AR ({name})")
            s = sp["speculative"]
            row.append(f"{name}: {decode_rate(sp) / decode_rate(ar):4.2f}x tau {s['tau']:.2f} acc {s['acceptance_rate']:.2f}")
            aggs.setdefault((p["kind"], name), Agg()).add(ar, sp)
        print(" | ".join(row), flush=True)
    print()
    for kind in kinds:
        for name, *_ in configs:
            if (kind, name) in aggs:
                aggs[(kind, name)].report(kind, name)


if __name__ == "__main__":
    main()
