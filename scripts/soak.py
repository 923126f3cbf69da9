#!/usr/bin/env python3
"""Soak test of a running `specula serve` (benchmark tier, not CI).

Usage:
    specula serve --max-batch 64 --max-queue 256 &
    python3 scripts/soak.py --base-url http://127.0.0.1:8000 --clients 64 --minutes 10 --pid $(pgrep -f 'specula serve')

Each of --clients threads loops until the time is up: a random fixture prompt, random
max_tokens (1..128), random spec mode (off/ngram/on), streamed or not; one request in five is
abandoned mid-stream (the connection closed after a few chunks) and one in ten is sent with a
short client timeout (a disconnect while queued or running). At the end it checks: no request
failed with a 5xx or an unexpected error; `/metrics` shows nothing running or queued and
`specula_kv_bytes` and `specula_kv_pool_blocks_in_use` back at 0 (no KV held by finished
requests: the block pool is full again); resident memory (VmRSS of
--pid, sampled every 5 s) is flat within 5% after the first third of the run. Exit 1 on a
failed check. Standard library only.
"""

import argparse
import json
import random
import socket
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path


def rss_kib(pid):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def metric(text, name):
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--pid", type=int, help="the server's process id (for VmRSS)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    root = Path(__file__).resolve().parent.parent
    prompts = [json.loads(l) for l in open(root / "tests/fixtures/prompts.jsonl") if l.strip()]
    url = args.base_url.rstrip("/") + "/v1/chat/completions"
    deadline = time.time() + args.minutes * 60
    lock = threading.Lock()
    counts = {"ok": 0, "abandoned": 0, "timeout": 0, "429": 0, "4xx": 0, "errors": []}

    def client(i):
        rng = random.Random(args.seed * 1000 + i)
        while time.time() < deadline:
            p = rng.choice(prompts)
            stream = rng.random() < 0.5
            body = {"messages": p["messages"], "max_tokens": rng.randint(1, 128), "temperature": 0,
                    "spec": rng.choice(["off", "ngram", "on"]), "stream": stream}
            timeout = 0.5 if rng.random() < 0.1 else 600
            abandon = stream and rng.random() < 0.2
            req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=timeout) as r:
                    if abandon:
                        for _ in range(3):
                            r.readline()
                        kind = "abandoned"
                    else:
                        r.read()
                        kind = "ok"
            except urllib.error.HTTPError as e:
                kind = "429" if e.code == 429 else "4xx" if e.code < 500 else None
                if kind is None:
                    with lock:
                        counts["errors"].append(f"HTTP {e.code}: {e.read()[:200]!r}")
                    continue
                if kind == "429":
                    time.sleep(0.2)
            except (socket.timeout, TimeoutError, urllib.error.URLError) as e:
                if timeout < 1:
                    kind = "timeout"
                else:
                    with lock:
                        counts["errors"].append(f"{type(e).__name__}: {e}")
                    continue
            with lock:
                counts[kind] += 1

    samples = []
    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(args.clients)]
    t0 = time.time()
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        if args.pid:
            samples.append((time.time() - t0, rss_kib(args.pid)))
        time.sleep(5)
    time.sleep(2)
    m = urllib.request.urlopen(args.base_url.rstrip("/") + "/metrics").read().decode()
    running, queued, kv = metric(m, "specula_requests_running"), metric(m, "specula_queue_depth"), metric(m, "specula_kv_bytes")
    pool_in_use, pool_bytes = metric(m, "specula_kv_pool_blocks_in_use"), metric(m, "specula_kv_pool_bytes")
    slots_in_use = metric(m, "specula_device_slots_in_use")
    print(json.dumps({k: v for k, v in counts.items() if k != "errors"}), f"errors={len(counts['errors'])}")
    failed = False
    for e in counts["errors"][:10]:
        print("error:", e)
        failed = True
    print(f"after the run: running={running} queued={queued} kv_bytes={kv} kv_pool_blocks_in_use={pool_in_use} kv_pool_bytes={pool_bytes} device_slots_in_use={slots_in_use}")
    if any(v not in (0, None) for v in (running, queued, kv, pool_in_use, slots_in_use)):
        print("FAIL: work or KV left over")
        failed = True
    if samples:
        steady = [r for t, r in samples if t >= (samples[-1][0] / 3)]
        lo, hi = min(steady), max(steady)
        print(f"VmRSS after warm-up: min {lo / 1024:.0f} MiB, max {hi / 1024:.0f} MiB ({(hi - lo) / lo * 100:.1f}% spread)")
        if hi > lo * 1.05:
            print("FAIL: resident memory not flat within 5%")
            failed = True
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
