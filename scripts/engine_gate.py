#!/usr/bin/env python3
"""Exactness gate of a running `specula serve` (any device), through the HTTP API.

Usage:
    specula serve MODEL --device cuda:0 --max-batch 32 &
    python3 scripts/engine_gate.py --base-url http://127.0.0.1:8000 --out gate.json [--compare cpu.json]

1. Solo: every fixture prompt (tests/fixtures/prompts.jsonl), greedy chat, once with plain
   decoding (`"spec": "off"`) and once with n-gram speculation; the two must be byte-identical.
   Acceptance comes from the server's /metrics counters.
2. Batched: the prompts again, all at once at each of --levels concurrent streams, modes
   alternating off / ngram; every output must equal its solo plain run.
3. --compare FILE (repeatable): the solo outputs of another run; reports how many plain outputs
   are identical and where the first difference is. Against the same device with prefix reuse
   off (`--prefix-cache-mb 0`) they must all be identical (pass --must-match for that file);
   against another device (the CPU) this is a report: its kernels round differently.

Outputs are compared as text bytes plus the completion token count (the chat API returns no
token ids).

Exits 1 when a check fails. Standard library only.
"""

import argparse
import json
import sys
import threading
import time
import urllib.request
from pathlib import Path


def post(url, body):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=3600) as r:
        out = json.loads(r.read())
    return out, time.perf_counter() - t0


def metric(base, name):
    with urllib.request.urlopen(base + "/metrics", timeout=60) as r:
        text = r.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def chat(base, model, p, spec):
    body = {
        "model": model,
        "messages": p["messages"],
        "max_tokens": p.get("max_tokens", 128),
        "temperature": 0,
        "spec": spec,
    }
    out, secs = post(base + "/v1/chat/completions", body)
    c = out["choices"][0]
    return {
        "text": c["message"].get("content") or "",
        "finish_reason": c["finish_reason"],
        "completion_tokens": out["usage"]["completion_tokens"],
        "cached_tokens": (out["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0),
        "seconds": secs,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--prompts", default=str(Path(__file__).resolve().parent.parent / "tests/fixtures/prompts.jsonl"))
    ap.add_argument("--levels", default="4,16,32")
    ap.add_argument("--out")
    ap.add_argument("--compare", action="append", default=[])
    ap.add_argument("--must-match", action="append", default=[], help="a --compare file whose outputs must all match")
    a = ap.parse_args()
    base = a.base_url.rstrip("/")
    for _ in range(600):
        try:
            urllib.request.urlopen(base + "/health", timeout=5).read()
            break
        except Exception:
            time.sleep(1)
    with urllib.request.urlopen(base + "/v1/models", timeout=60) as r:
        info = json.loads(r.read())["data"][0]
    model = info["id"]
    prompts = [json.loads(l) for l in open(a.prompts) if l.strip()]
    failures = []
    solo = {}
    d0, a0 = metric(base, "specula_spec_draft_tokens_total"), metric(base, "specula_spec_accepted_tokens_total")
    for p in prompts:
        ar = chat(base, model, p, "off")
        sp = chat(base, model, p, "ngram")
        same = ar["text"].encode() == sp["text"].encode() and ar["completion_tokens"] == sp["completion_tokens"]
        if not same:
            failures.append(f"solo {p['id']}: ngram differs from plain decoding")
        solo[p["id"]] = {"ar": ar, "ngram": sp, "identical": same}
        print(f"{p['id']} {p['kind']}: {ar['completion_tokens']} tokens, AR {ar['completion_tokens'] / ar['seconds']:.0f} tok/s, "
              f"ngram {sp['completion_tokens'] / sp['seconds']:.0f} tok/s, identical={same}", flush=True)
    drafted = metric(base, "specula_spec_draft_tokens_total") - d0
    accepted = metric(base, "specula_spec_accepted_tokens_total") - a0
    batched = []
    for n in [int(x) for x in a.levels.split(",") if x]:
        jobs = [(prompts[i % len(prompts)], "ngram" if i % 2 else "off") for i in range(n)]
        results = [None] * n

        def run(i):
            p, spec = jobs[i]
            try:
                results[i] = chat(base, model, p, spec)
            except Exception as e:  # reported as a failure below
                results[i] = {"error": str(e)}

        t0 = time.perf_counter()
        threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        bad = []
        for i, r in enumerate(results):
            p, spec = jobs[i]
            want = solo[p["id"]]["ar"]
            if "error" in r or r["text"].encode() != want["text"].encode():
                bad.append(f"{p['id']}/{spec}")
        tokens = sum(r.get("completion_tokens", 0) for r in results)
        batched.append({"streams": n, "identical_to_solo": n - len(bad), "differing": bad,
                        "aggregate_tok_s": tokens / wall})
        if bad:
            failures.append(f"{n} streams: {len(bad)} outputs differ from their solo runs: {bad}")
        print(f"{n} streams: {n - len(bad)}/{n} identical to solo, aggregate {tokens / wall:.0f} tok/s", flush=True)
    report = {
        "model": model,
        "device": info.get("specula", {}).get("device"),
        "solo": solo,
        "solo_identical": sum(v["identical"] for v in solo.values()),
        # The n-gram run follows the plain run of the same prompt: its prompt comes from the
        # prefix cache (CPU) or the slot the plain run left (GPU), so identical outputs also
        # show that reuse is exact.
        "ngram_runs_with_cached_prompt": sum(v["ngram"]["cached_tokens"] > 0 for v in solo.values()),
        "prompts": len(prompts),
        "ngram_drafted": drafted,
        "ngram_accepted": accepted,
        "batched": batched,
        "failures": failures,
    }
    report["compare"] = []
    for path in a.compare:
        other = json.load(open(path))
        rows = []
        for pid, v in solo.items():
            o = other["solo"].get(pid)
            if o is None:
                continue
            x, y = v["ar"]["text"], o["ar"]["text"]
            k = next((i for i, (c, d) in enumerate(zip(x, y)) if c != d), min(len(x), len(y)))
            rows.append({"id": pid, "identical": x == y, "first_difference_at_char": None if x == y else k})
        same = sum(r["identical"] for r in rows)
        report["compare"].append({"file": path, "against": other.get("device"), "identical": same, "of": len(rows), "rows": rows})
        print(f"vs {path} ({other.get('device')}): {same}/{len(rows)} plain outputs identical")
        if path in a.must_match and same != len(rows):
            failures.append(f"{path}: {len(rows) - same} plain outputs differ")
    print(f"solo: {report['ngram_runs_with_cached_prompt']}/{len(prompts)} ngram runs reused the plain run's prompt KV")
    print(f"solo: {report['solo_identical']}/{len(prompts)} ngram outputs identical to AR; "
          f"ngram acceptance {accepted / max(drafted, 1):.2f} ({int(accepted)}/{int(drafted)})")
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=1))
    if failures:
        print("FAIL:", *failures, sep="\n  ")
        sys.exit(1)


if __name__ == "__main__":
    main()
