#!/usr/bin/env python3
"""Structured output under speculation, side by side: JSON-schema chat requests sent in turn to
one or more running servers (e.g. one started with SPECULA_DRAFT_MASK=0 beside one without),
each also with `"spec": "off"` on the first server as the AR baseline, interleaved so machine
noise hits all alike. Prints decode tok/s (completion tokens over wall time), the ratio to AR,
tau and the acceptance rate per (server, temperature).

    specula serve --port 18300 --spec on &
    SPECULA_DRAFT_MASK=0 specula serve --port 18301 --spec on &
    python3 scripts/json_spec_bench.py --servers masked=http://127.0.0.1:18300,unmasked=http://127.0.0.1:18301
"""
import argparse, json, time, urllib.request

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "city": {"type": "string"},
        "hobbies": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "city", "hobbies"],
}
PROMPTS = [
    "Describe a fictional person as JSON with name, age, city and hobbies.",
    "Invent a character for a novel and give their details as JSON.",
    "Give me a JSON record for a made-up customer.",
    "Create a JSON profile of a retired sailor.",
]


def call(url, body):
    r = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                               headers={"content-type": "application/json"})
    t = time.time()
    v = json.load(urllib.request.urlopen(r))
    return v, time.time() - t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--servers", required=True, help="label=url,label=url (the first also runs AR)")
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--seeds", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    servers = [s.split("=", 1) for s in a.servers.split(",")]
    configs = [("ar", servers[0][1], "off")] + [(label, url, None) for label, url in servers]
    rf = {"type": "json_schema", "json_schema": {"name": "record", "schema": SCHEMA}}
    for temp in [float(t) for t in a.temperatures.split(",")]:
        tot = {c[0]: dict(toks=0, t=0.0, drafted=0, accepted=0, committed=0, steps=0) for c in configs}
        for _ in range(a.rounds):
            for p in PROMPTS:
                for seed in range(a.seeds if temp > 0 else 1):
                    for label, url, spec in configs:
                        body = {"messages": [{"role": "user", "content": p}], "temperature": temp,
                                "max_tokens": a.max_tokens, "seed": seed, "response_format": rf}
                        if spec:
                            body["spec"] = spec
                        v, dt = call(url, body)
                        s, d = v.get("spec_stats", {}), tot[label]
                        d["toks"] += v["usage"]["completion_tokens"]
                        d["t"] += dt
                        for k, f in [("drafted", "drafted"), ("accepted", "accepted"),
                                     ("committed", "committed"), ("steps", "target_steps")]:
                            d[k] += s.get(f, 0)
        ar = tot["ar"]["toks"] / tot["ar"]["t"]
        for label, _, _ in configs:
            d = tot[label]
            rate = d["toks"] / d["t"]
            print(f"T={temp:g} {label:10} {rate:7.1f} tok/s  {rate / ar:5.2f}x AR  "
                  f"tau {d['committed'] / max(1, d['steps']):.2f}  "
                  f"acceptance {d['accepted'] / max(1, d['drafted']):.2f} ({d['accepted']}/{d['drafted']})",
                  flush=True)


if __name__ == "__main__":
    main()
