#!/usr/bin/env python3
"""Another version of kernels.cu, made includable next to the current one (scripts/att_micro.cu,
-DOLD_KERNELS): `extern "C"` removed (the kernels go into namespace `old`) and every __device__
function renamed o_NAME (so argument-dependent lookup cannot pick the current file's).

usage: git show REV:crates/specula-engine/src/cuda/kernels.cu | python3 scripts/old_kernels.py > /tmp/old.cu
"""
import re
import sys

s = sys.stdin.read().replace('extern "C" ', "")
names = set(re.findall(r"__device__\s+(?:__forceinline__\s+)?[\w:<>,\s\*&]*?\b(\w+)\s*\(", s)) - {"if", "for"}
for n in sorted(names, key=len, reverse=True):
    s = re.sub(r"\b%s\b" % n, "o_" + n, s)
sys.stdout.write(s)
