#!/usr/bin/env python3
"""Concurrency sweep against a running `specula serve`: aggregate and per-stream tok/s and TTFT.

Usage:
    python3 scripts/concurrency_bench.py --base-url http://127.0.0.1:8000 \
        --levels 1,2,4,8,16 --modes off,ngram --max-tokens 64

For each mode (the request's `spec` field) and each concurrency level N, N streaming chat
requests (greedy, fixture prompts of --kinds taken in turn, `ignore_eos` so every stream makes max-tokens
tokens) start together; reported: aggregate tok/s (all completion tokens / wall time), median
per-stream decode tok/s, median and max TTFT (time to the first content chunk). Start the server
with `--max-batch` at least the largest level (and `--max-queue` large enough). Standard library
only.
"""

import argparse
import json
import statistics
import threading
import time
import urllib.request
from pathlib import Path


def sse_chunks(url, body):
    """The JSON chunks of a streamed (server-sent events) POST of `body` to `url`."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=3600) as r:
        for raw in r:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                yield json.loads(line[6:])


def stream_one(url, body, out, i):
    t0 = time.perf_counter()
    ttft, n, usage = None, 0, None
    for chunk in sse_chunks(url, body):
        if chunk.get("usage"):
            usage = chunk["usage"]
        for c in chunk.get("choices", []):
            if c.get("delta", {}).get("content") and ttft is None:
                ttft = time.perf_counter() - t0
    t1 = time.perf_counter()
    n = usage["completion_tokens"] if usage else 0
    out[i] = {"ttft": ttft or (t1 - t0), "tokens": n, "seconds": t1 - t0}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--levels", default="1,2,4,8,16")
    ap.add_argument("--modes", default="off,ngram")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--json", action="store_true", help="print one JSON object per measurement")
    ap.add_argument("--kinds", default="prose,qa,code,easy_code,json",
                    help="fixture prompt kinds to cycle through (default: the short ones, so every level "
                         "runs the same mix; long_context prompts are ~1.5k tokens and dominate any level "
                         "that includes them)")
    args = ap.parse_args()
    root = Path(__file__).resolve().parent.parent
    kinds = set(args.kinds.split(","))
    prompts = [json.loads(l) for l in open(root / "tests/fixtures/prompts.jsonl") if l.strip()]
    prompts = [p for p in prompts if p.get("kind") in kinds]
    if not prompts:
        raise SystemExit(f"no fixture prompts of kinds {sorted(kinds)}")
    url = args.base_url.rstrip("/") + "/v1/chat/completions"
    rows = []
    for mode in args.modes.split(","):
        for n in [int(x) for x in args.levels.split(",")]:
            out = [None] * n
            threads = []
            t0 = time.perf_counter()
            for i in range(n):
                p = prompts[i % len(prompts)]
                body = {"messages": p["messages"], "temperature": 0, "max_tokens": args.max_tokens,
                        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
                        "spec": mode}
                t = threading.Thread(target=stream_one, args=(url, body, out, i))
                t.start()
                threads.append(t)
            for t in threads:
                t.join()
            wall = time.perf_counter() - t0
            tokens = sum(o["tokens"] for o in out)
            per_stream = [o["tokens"] / max(o["seconds"] - o["ttft"], 1e-9) for o in out]
            row = {"mode": mode, "streams": n, "aggregate_tok_s": tokens / wall,
                   "per_stream_tok_s_median": statistics.median(per_stream),
                   "ttft_median_s": statistics.median(o["ttft"] for o in out),
                   "ttft_max_s": max(o["ttft"] for o in out), "tokens": tokens, "wall_s": wall}
            rows.append(row)
            if args.json:
                print(json.dumps(row), flush=True)
            else:
                print(f"{mode:6} {n:3} streams: aggregate {row['aggregate_tok_s']:7.1f} tok/s | per-stream "
                      f"{row['per_stream_tok_s_median']:6.1f} tok/s | TTFT median {row['ttft_median_s']:.2f}s "
                      f"max {row['ttft_max_s']:.2f}s", flush=True)
    base = {r["mode"]: r["aggregate_tok_s"] for r in rows if r["streams"] == 1}
    for r in rows:
        if "off" in base:
            r["vs_single_stream_ar"] = r["aggregate_tok_s"] / base["off"]
    if not args.json:
        print("aggregate / single-stream AR:", ", ".join(f"{r['mode']}@{r['streams']}: {r.get('vs_single_stream_ar', 0):.2f}x" for r in rows))


if __name__ == "__main__":
    main()
