#!/usr/bin/env python3
"""Requests one after another through running servers: what a server learns across requests.

`scripts/spec_bench.py` runs each prompt in a fresh `specula generate` process, so nothing carries
from one request to the next. A server keeps what its requests learned about drafting (the
draft-length controller's estimates) for the next one. This script starts one `specula serve` per variant (each with its own environment, e.g. a
switch that turns a prior off) plus one plain server for AR, then sends the shared prompts of
--kinds in file order, --rounds times, each prompt to every server in turn (one request at a
time on the machine, so the servers never share the cores), greedy, streamed. Each request's
decode tok/s is (completion tokens - 1) / (time from its first content chunk to its end); the
report gives, per kind and overall, each variant's speed as a ratio to AR (summed seconds per
token, as spec_bench), its tau and how many drafts the lookup made, and checks that every
output is byte-identical to AR's (greedy, and with --temperature above 0 too: every request is
seeded and verified by coupling, the default; a variant with `sampled_verify=rejection` gives other
samples and is not compared).

    python3 scripts/serve_bench.py --spec on --variant new --variant old:SPECULA_NGRAM_WRAP=0

    python3 scripts/serve_bench.py --drafter heads/smollm2-135m-instruct.mtp \
        --variant head:mode=mtp --variant head+lookup:mode=on

Servers are started with --model as given: a catalog model that ships a drafter (the default
model's MTP head) has it beside the cached file, so `on`/`default` draft with it even when
--draft-model is given too (pass --model as a path to another copy to measure the draft model).

A variant is NAME[:KEY=VALUE[,KEY=VALUE...]]: `mode`, `draft_max`, `adaptive` (true/false) and
`sampled_verify` (coupled/rejection) set that variant's requests' `spec` fields (default: --spec, --draft-max, adaptive), any other
KEY is an environment variable of its server. Standard library only.
"""

import argparse
import json
import math
import os
import pathlib
import subprocess
import sys
import time
import urllib.request

from concurrency_bench import sse_chunks

ROOT = pathlib.Path(__file__).resolve().parent.parent


def wait_ready(url, proc, timeout=300):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            sys.exit(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except Exception:
            time.sleep(0.5)
    sys.exit("server did not become ready")


def request(url, messages, max_tokens, spec, temperature, seed):
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": temperature, "seed": seed, "stream": True,
            "stream_options": {"include_usage": True}, "spec": spec}
    first, text, usage, stats = None, [], None, None
    for chunk in sse_chunks(url + "/v1/chat/completions", body):
        usage = chunk.get("usage") or usage
        stats = chunk.get("spec_stats") or stats
        for c in chunk.get("choices", []):
            piece = c.get("delta", {}).get("content")
            if piece:
                if first is None:
                    first = time.perf_counter()
                text.append(piece)
    end = time.perf_counter()
    n = usage["completion_tokens"] if usage else 0
    return {"text": "".join(text), "tokens": n, "decode_s": end - (first or end), "stats": stats or {}}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--binary", default=str(ROOT / "target/release/specula"))
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--drafter", help="the native drafter the speculative servers load")
    ap.add_argument("--draft-model", help="the draft model the speculative servers load")
    ap.add_argument("--spec", default="on", help="the requests' speculation mode")
    ap.add_argument("--draft-max", type=int, default=4)
    ap.add_argument("--kinds", default="all")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="above 0 the outputs are samples (AR's and each variant's differ; not compared)")
    ap.add_argument("--variant", action="append", default=[], help="NAME[:VAR=VALUE,...]")
    ap.add_argument("--port", type=int, default=18400)
    a = ap.parse_args()
    variants = []
    for v in a.variant or [a.spec]:
        name, _, envs = v.partition(":")
        if any("=" not in e for e in envs.split(",") if e):
            sys.exit(f"variant {v!r}: expected NAME[:KEY=VALUE,...]")
        env = dict(e.split("=", 1) for e in envs.split(",") if e)
        spec = {"mode": env.pop("mode", a.spec), "draft_max": int(env.pop("draft_max", a.draft_max))}
        if "adaptive" in env:
            spec["adaptive"] = env.pop("adaptive") == "true"
        if "sampled_verify" in env:
            spec["sampled_verify"] = env.pop("sampled_verify")
        if name == "ar" or name in [v[0] for v in variants]:
            sys.exit(f"variant name {name!r} is taken")
        variants.append((name, env, spec))
    prompts = [json.loads(l) for l in open(ROOT / "tests/fixtures/prompts.jsonl")]
    if a.kinds != "all":
        kinds = a.kinds.split(",")
        prompts = [p for p in prompts if p["kind"] in kinds]
    servers = []
    try:
        for i, (name, env, _) in enumerate([("ar", {}, {"mode": "off"})] + variants):
            port = a.port + i
            cmd = [a.binary, "serve", a.model, "--host", "127.0.0.1", "--port", str(port)]
            if name != "ar":
                if a.drafter:
                    cmd += ["--drafter", a.drafter]
                if a.draft_model:
                    cmd += ["--draft-model", a.draft_model]
            log = open(f"/tmp/serve_bench_{name}.log", "w")
            proc = subprocess.Popen(cmd, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT)
            servers.append((name, f"http://127.0.0.1:{port}", proc))
            wait_ready(servers[-1][1], proc)
        specs = {"ar": {"mode": "off"}, **{name: spec for name, _, spec in variants}}
        agg = {}  # (kind, name) -> [seconds per token, tokens committed, steps, lookup drafts]
        for rnd in range(a.rounds):
            for p in prompts:
                outs = {}
                for name, url, _ in servers:
                    outs[name] = request(url, p["messages"], a.max_tokens, specs[name], a.temperature, 1000 * rnd + 7)
                ar = outs["ar"]
                for name, o in outs.items():
                    # Greedy, and seeded samples verified by coupling (the default), are
                    # plain decoding's output.
                    exact = a.temperature == 0 or specs[name].get("sampled_verify", "coupled") != "rejection"
                    if exact and o["text"] != ar["text"]:
                        sys.exit(f"{p['id']}: {name} output differs from AR")
                if any(o["tokens"] < 2 for o in outs.values()):
                    continue  # every server's sums cover the same prompts
                for name, o in outs.items():
                    s = o["stats"]
                    for key in (p["kind"], "all"):
                        e = agg.setdefault((key, name), [0.0, 0, 0, 0])
                        e[0] += o["decode_s"] / (o["tokens"] - 1)
                        e[1] += s.get("committed", 0)
                        e[2] += s.get("target_steps", 0)
                        e[3] += s.get("lookup_drafted", 0)
                line = f"round {rnd} {p['id']:4s} {p['kind']:13s}"
                for name, _, _ in servers[1:]:
                    o = outs[name]
                    if o["tokens"] >= 2 and ar["tokens"] >= 2:
                        r = (ar["decode_s"] / (ar["tokens"] - 1)) / max(o["decode_s"] / (o["tokens"] - 1), 1e-9)
                        line += f" | {name} {r:4.2f}x tau {o['stats'].get('tau', 0):4.2f} lookup {o['stats'].get('lookup_drafted', 0)}"
                print(line, flush=True)
        print()
        for kind in sorted({k for k, _ in agg}, key=lambda k: (k == "all", k)):
            ar = agg.get((kind, "ar"))
            line = f"{kind:13s}"
            for name, _, _ in servers[1:]:
                e = agg.get((kind, name))
                if ar and e and e[0]:
                    line += f" | {name} {ar[0] / e[0]:4.2f}x AR, tau {e[1] / max(e[2], 1):4.2f}, lookup drafts {e[3]}"
            print(line, flush=True)
        kinds = sorted({k for k, _ in agg} - {"all"})
        line = "geometric mean over kinds"
        for name, _, _ in servers[1:]:
            ratios = [agg[(k, "ar")][0] / agg[(k, name)][0] for k in kinds if agg.get((k, name)) and agg[(k, name)][0]]
            if ratios:
                line += f" | {name} {math.prod(ratios) ** (1 / len(ratios)):4.2f}x"
        print(line, flush=True)
    finally:
        for _, _, proc in servers:
            proc.terminate()
        for _, _, proc in servers:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


if __name__ == "__main__":
    main()
