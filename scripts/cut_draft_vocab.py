#!/usr/bin/env python3
"""Cut a trained head's draft vocabulary (FR-Spec) to its N most frequent tokens, without training.

A head's draft LM head is the target's own LM-head rows for the token ids in its `draft_vocab`
tensor, so a smaller set is a smaller matrix to read per draft token; the target still verifies
over the full vocabulary, so output is unchanged. The ids are ranked by their count in the
training text (the `data/sequences.json` a `specula distill` run wrote, prompts and answers, as
distill ranks them; ties: lower id first), `--keep` ids (end-of-sequence) first. Every other
tensor is copied byte for byte; config.json gains `training.draft_vocab_cut`.

    python3 scripts/cut_draft_vocab.py HEAD_DIR 8192 OUT_DIR --sequences RUN/data/sequences.json --keep 2
"""

import argparse
import collections
import json
import pathlib
import struct

a = argparse.ArgumentParser()
a.add_argument("head")
a.add_argument("n", type=int)
a.add_argument("out")
a.add_argument("--sequences", required=True, help="a distill run's data/sequences.json")
a.add_argument("--keep", default="", help="comma-separated ids always kept (end-of-sequence)")
a = a.parse_args()
head, out = pathlib.Path(a.head), pathlib.Path(a.out)
seqs = json.load(open(a.sequences))["sequences"]["sequences"]
count = collections.Counter(t for s in seqs for t in s)
keep_ids = {int(x) for x in a.keep.split(",") if x}
raw = (head / "model.safetensors").read_bytes()
(hl,) = struct.unpack("<Q", raw[:8])
hdr = json.loads(raw[8 : 8 + hl])
base = 8 + hl
dv = hdr.get("draft_vocab")
if dv is None or dv["dtype"] != "I64" or len(dv["shape"]) != 1:
    raise SystemExit(f"{head}/model.safetensors: no 1-D I64 tensor 'draft_vocab'")
lo, hi = dv["data_offsets"]
ids = list(struct.unpack(f"<{(hi - lo) // 8}q", raw[base + lo : base + hi]))
missing = keep_ids - set(ids)
if missing:
    print(f"warning: --keep ids {sorted(missing)} are not in the draft vocabulary; they stay out")
if a.n >= len(ids):
    raise SystemExit(f"the draft vocabulary has {len(ids)} ids; cut to fewer")
ranked = sorted(ids, key=lambda t: (t not in keep_ids, -count[t], t))
kept = sorted(ranked[: a.n])
total = sum(count.values())
cov = lambda s: sum(count[t] for t in s) / total
print(f"{len(ids)} -> {len(kept)} ids; share of the training text's tokens covered {cov(ids):.4f} -> {cov(kept):.4f}")
tensors = [(k, v, raw[base + v["data_offsets"][0] : base + v["data_offsets"][1]]) for k, v in hdr.items()
           if k not in ("__metadata__", "draft_vocab")]
tensors.append(("draft_vocab", {"dtype": "I64", "shape": [len(kept)]}, struct.pack(f"<{len(kept)}q", *kept)))
new, blobs, off = {}, [], 0
if "__metadata__" in hdr:
    new["__metadata__"] = hdr["__metadata__"]
for k, v, data in tensors:
    new[k] = {"dtype": v["dtype"], "shape": v["shape"], "data_offsets": [off, off + len(data)]}
    off += len(data)
    blobs.append(data)
hj = json.dumps(new, separators=(",", ":")).encode()
hj += b" " * (-len(hj) % 8)
out.mkdir(parents=True, exist_ok=True)
with open(out / "model.safetensors", "wb") as f:
    f.write(struct.pack("<Q", len(hj)) + hj + b"".join(blobs))
cfg = json.loads((head / "config.json").read_text())
cfg.setdefault("training", {})["draft_vocab_cut"] = {
    "from": len(ids), "to": len(kept), "ranked_by": "token counts of the training text",
    "covered_before": round(cov(ids), 4), "covered_after": round(cov(kept), 4)}
(out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
