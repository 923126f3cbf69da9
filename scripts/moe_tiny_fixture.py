#!/usr/bin/env python3
"""Generates the tiny random Mixture-of-Experts fixtures

    tests/fixtures/qwen3moe-tiny/        Qwen3MoeForCausalLM, HF bundle + model-q8_0.gguf
    tests/fixtures/qwen2moe-tiny/        Qwen2MoeForCausalLM, HF bundle + model-q8_0.gguf
    tests/fixtures/qwen3moe-tiny-mixed/  Qwen3MoeForCausalLM with a dense layer, HF only,
                                         experts saved in the fused 3D layout

each with reference.json: HF transformers float32 logits at every position of 3 fixed token
sequences, and (for the two GGUF fixtures) llama.cpp's logits for the same sequences on the
committed q8_0 GGUF plus a 16-token llama.cpp greedy continuation. Run by hand, not in CI:

    /work/venv/bin/python scripts/moe_tiny_fixture.py

Made with Python 3.11, torch 2.15.0 (CPU), transformers 5.25.0, safetensors 0.8.0,
tokenizers 0.23.3, and llama.cpp commit 0c1e570 (the tree vendored by llama-cpp-python 0.3.36,
built for CPU at /work/llama/build). Paths of the llama.cpp tree and build can be overridden with
the environment variables LLAMA_SRC and LLAMA_BUILD.

What the script does:
- trains a byte-level BPE tokenizer (512 tokens: 509 trained, then <|endoftext|>, <|im_start|>,
  <|im_end|>) on the small English + code text below, with Qwen2's pre-tokenizer (NFC, the
  Qwen2 split regex, ByteLevel without its own regex) and a ChatML chat template;
- builds each model with random weights (torch.manual_seed(seed), the seed searched upward from 0
  until the routing and the logits are robust, see `acceptable` and `q8_robust`) and saves it with
  `save_pretrained` (f32). Every matrix that the q8_0 GGUF quantizes is first rounded to values
  that q8_0 represents exactly (`round_to_q8_0`), so model-q8_0.gguf holds exactly the same
  weights as model.safetensors (checked: transformers on the dequantized GGUF gives bit-identical
  logits); llama.cpp's q8_0 logits then differ from transformers' only through llama.cpp's own
  arithmetic: mostly its q8_0 products (it quantizes the activations to q8_0 for them, ~0.1), plus
  the f16 KV cache (a few 1e-3, as the f32 GGUF shows);
- converts the two main fixtures with llama.cpp's convert_hf_to_gguf.py to q8_0 (committed) and
  f32 (/tmp only, for the cross-check). The converter only accepts BPE tokenizers whose
  pre-tokenizer hash it knows, so it is copied to a temporary directory and patched to map this
  tokenizer's hash to the `qwen2` pre-tokenizer (the copy is deleted afterwards);
- builds scripts/llamacpp_logits_dump.cpp against libllama into /tmp and runs it on the GGUFs
  with llama.cpp's default settings (f16 KV cache, flash attention auto), which Specula's
  reference mode `Engine::logits_as_llamacpp` reproduces;
- writes reference.json and prints the cross-check numbers (llama.cpp f32 and q8_0 vs HF).
"""
import ast
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile

import safetensors
import safetensors.torch
import tokenizers
import torch
import transformers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
FIXTURES = os.path.join(ROOT, "tests/fixtures")
LLAMA_SRC = os.environ.get("LLAMA_SRC", "/work/llama/llama_cpp_python-0.3.36/vendor/llama.cpp")
LLAMA_BUILD = os.environ.get("LLAMA_BUILD", "/work/llama/build")
TMP = "/tmp/moe_tiny_fixture"  # f32 GGUFs and the dump binary; not committed
DUMP_BIN = os.path.join(TMP, "llamacpp_logits_dump")

VOCAB = 512
N_TRAINED = 509  # ids 0..508 are ordinary tokens; 509..511 the special tokens
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
SEQ_LENS = [7, 12, 19]
N_GREEDY = 16
MIN_ROUTER_GAP = 2e-3  # required gap between the 2nd and 3rd router probability (brief: > 1e-3)
MAX_Q8_TRIES = 8  # candidate seeds (each converted to GGUF and run by llama.cpp) before giving up
Q8_MAX_DIFF = 0.25  # llama.cpp q8_0 activation noise alone gives ~0.1; an expert flipped by it gives 0.3-2
MIN_LOGIT_MARGIN = 2e-3  # required top1 - top2 logit margin at every reference position
ROUTER_SCALE = 1.5  # router weights N(0, 1.5 / sqrt(hidden)): router logits of std ~1.5 (maximises the 2nd-3rd probability gap)
LM_HEAD_STD = 0.2  # untied lm_head N(0, 0.2): logits of std ~1.6

# Qwen2's pre-tokenizer split regex (contractions, letters with one leading non-letter, single
# digits, punctuation runs with trailing newlines, newline runs, whitespace).
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Training text for the tokenizer (written for this fixture).
TEXT = r'''
The small model reads a sentence, one token at a time, and guesses what comes next. It is not
trained: its weights are random numbers, so the guesses are nonsense, but they are the same
nonsense on every machine, and that is all a test needs. A mixture of experts replaces the one
feed-forward block of each layer with several smaller ones. A router looks at the hidden state of
each token and picks two experts; their outputs are weighted and added. Some models also keep a
shared expert that every token passes through, scaled by a learned gate.

When the weather is good we walk to the river, sit on the bench near the old bridge and watch the
boats. My sister likes to count the birds; I prefer to read. Yesterday there were seven ducks,
three swans and a heron that stood very still for an hour. We'll go again on Sunday if it's dry.
They've said the café will open at nine, but I'm not sure they're right. Don't forget the keys!

Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 256 1024 3.14159 2.71828 1e-6 65536.
Questions? Answers. Lists: apples, pears, plums; cats, dogs, mice. "Quotes" and 'single quotes'.

def softmax(xs):
    m = max(xs)
    es = [math.exp(x - m) for x in xs]
    s = sum(es)
    return [e / s for e in es]

def top_k(probs, k):
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    return order[:k]

class Router:
    def __init__(self, weight, k=2, normalize=True):
        self.weight = weight
        self.k = k
        self.normalize = normalize

    def __call__(self, hidden):
        logits = [sum(w * h for w, h in zip(row, hidden)) for row in self.weight]
        probs = softmax(logits)
        chosen = top_k(probs, self.k)
        weights = [probs[i] for i in chosen]
        if self.normalize:
            total = sum(weights)
            weights = [w / total for w in weights]
        return chosen, weights

fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

pub fn expert_forward(gate: &[f32], up: &[f32], out: &mut Vec<f32>) {
    for (g, u) in gate.iter().zip(up.iter()) {
        out.push(silu(*g) * *u);
    }
}

impl Tokenizer {
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, Error> {
        let pieces = self.split(text)?;
        let mut ids = Vec::with_capacity(pieces.len());
        for piece in pieces {
            ids.extend(self.bpe(piece));
        }
        Ok(ids)
    }
}

#include <stdio.h>
int main(int argc, char **argv) {
    for (int i = 0; i < argc; i++) {
        printf("%d: %s\n", i, argv[i]);
    }
    return 0;
}

SELECT name, count(*) FROM tokens WHERE length(name) > 3 GROUP BY name ORDER BY 2 DESC;
{"model": "tiny", "experts": 8, "top_k": 2, "layers": [0, 1, 2, 3], "ok": true}

The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. How
vexingly quick daft zebras jump! The five boxing wizards jump quickly. Sphinx of black quartz,
judge my vow. A journey of a thousand miles begins with a single step, and a test of a thousand
lines begins with a single assertion. Read the error message twice before changing the code.
Every function should do one thing, and the name should say which thing it is.
'''


def sig6(x):
    """Round to 6 significant digits (as a float that json writes compactly)."""
    return float(f"{x:.6g}")


# ---------------------------------------------------------------------------------------------
# Tokenizer


def build_tokenizer():
    tok = tokenizers.Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=N_TRAINED, min_frequency=1, show_progress=False, special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    lines = [l for l in TEXT.split("\n")]
    tok.train_from_iterator(lines, trainer)
    assert tok.get_vocab_size() == N_TRAINED, tok.get_vocab_size()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    assert tok.get_vocab_size() == VOCAB
    assert [tok.token_to_id(s) for s in SPECIALS] == [509, 510, 511]
    return tok


def write_tokenizer(tok, out):
    tok.save(os.path.join(out, "tokenizer.json"))
    tc = {
        "tokenizer_class": "Qwen2Tokenizer",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "add_prefix_space": False,
        "errors": "replace",
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "model_max_length": 256,
        "chat_template": CHATML,
    }
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(tc, f, indent=2)
        f.write("\n")
    # transformers (as the GGUF converter loads it) must tokenize exactly like the tokenizers file.
    hf = AutoTokenizer.from_pretrained(out)
    sample = "Hello world! def f(x):\n    return x * 42  # ok\n<|im_start|>user\nhi<|im_end|>"
    assert hf.encode(sample) == tok.encode(sample).ids, (hf.encode(sample), tok.encode(sample).ids)
    assert tok.decode(tok.encode(sample).ids, skip_special_tokens=False) == sample
    chat = hf.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", repr(chat)


# ---------------------------------------------------------------------------------------------
# Models


def common_kwargs(n_layers):
    return dict(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=n_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        max_position_embeddings=256,
        tie_word_embeddings=False,
        hidden_act="silu",
        bos_token_id=509,  # <|endoftext|>, as Qwen's configs (never prepended: add_bos_token false)
        eos_token_id=511,  # <|im_end|>
        pad_token_id=509,
    )


VARIANTS = {
    "qwen3moe-tiny": dict(
        cls=Qwen3MoeForCausalLM, gguf=True, fused=False,
        config=lambda: Qwen3MoeConfig(**common_kwargs(4), head_dim=16, norm_topk_prob=True,
                                      mlp_only_layers=[], attention_bias=False),
    ),
    "qwen2moe-tiny": dict(
        cls=Qwen2MoeForCausalLM, gguf=True, fused=False,
        config=lambda: Qwen2MoeConfig(**common_kwargs(4), shared_expert_intermediate_size=64,
                                      norm_topk_prob=False, mlp_only_layers=[], qkv_bias=True),
    ),
    "qwen3moe-tiny-mixed": dict(
        cls=Qwen3MoeForCausalLM, gguf=False, fused=True,
        config=lambda: Qwen3MoeConfig(**common_kwargs(3), head_dim=16, norm_topk_prob=False,
                                      mlp_only_layers=[1], attention_bias=False),
    ),
}


def init_weights(model, seed):
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # RMSNorm weights (x * w), incl. q_norm/k_norm: not all 1
                p.normal_(1.0, 0.2)
            elif name.endswith(".bias"):  # Qwen2 q/k/v biases: large enough to matter
                p.normal_(0.0, 0.3)
            elif name == "model.embed_tokens.weight":
                p.normal_(0.0, 1.0)
            elif name == "lm_head.weight":
                p.normal_(0.0, LM_HEAD_STD)
            elif name.endswith("mlp.gate.weight"):  # router [E, H]
                p.normal_(0.0, ROUTER_SCALE / math.sqrt(p.shape[-1]))
            else:  # Linear [out, in] and the fused experts [E, out, in]: N(0, 1/fan_in)
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]))
            # Every matrix that the q8_0 GGUF quantizes (all but the norms, biases, routers and the
            # shared-expert gate, which the converter keeps f32) is made exactly representable in q8_0.
            if p.dim() >= 2 and not name.endswith("mlp.gate.weight") and not name.endswith("shared_expert_gate.weight"):
                p.copy_(round_to_q8_0(p))


def round_to_q8_0(w):
    """Rounds a weight to values that q8_0 stores exactly: per block of 32 along the last dim,
    d = f16(max|w| / 127) and w = d * round(w / d), so that max|w| = 127 d. The converter then
    recomputes the same d and integer quants, and the q8_0 GGUF holds exactly the f32 weights."""
    shape = w.shape
    b = w.reshape(-1, 32).double()
    d = (b.abs().amax(dim=1, keepdim=True) / 127).half().double()
    q = torch.round(b / d).clamp(-127, 127)
    return (q * d).float().reshape(shape)


def run_hf(model, seqs):
    """Logits per sequence and the sorted router probabilities of every (sequence, layer, position)."""
    router_probs = []
    hooks = []
    for layer in model.model.layers:
        if hasattr(layer.mlp, "gate") and hasattr(layer.mlp, "experts"):
            hooks.append(layer.mlp.gate.register_forward_hook(
                lambda mod, inp, out: router_probs.append(torch.softmax(out[0].float(), dim=-1))))
    logits = []
    with torch.no_grad():
        for ids in seqs:
            logits.append(model(torch.tensor([ids])).logits[0].float())
    for h in hooks:
        h.remove()
    return logits, router_probs


def stats(logits, router_probs, seqs):
    probs = torch.cat(router_probs, 0)
    top = probs.topk(3, dim=-1)
    router_gap = (top.values[:, 1] - top.values[:, 2]).min().item()
    pairs = {tuple(sorted(p)) for p in top.indices[:, :2].tolist()}
    usage = torch.bincount(top.indices[:, :2].flatten(), minlength=probs.shape[1]).tolist()
    margins = []
    not_input = 0
    for l, ids in zip(logits, seqs):
        t2 = l.topk(2, dim=-1).values
        margins.append((t2[:, 0] - t2[:, 1]).min().item())
        not_input += (l.argmax(-1) != torch.tensor(ids)).sum().item()
    std = torch.cat(logits).std().item()
    return dict(router_gap=router_gap, logit_margin=min(margins), logit_std=std,
                argmax_not_input=not_input, expert_pairs=len(pairs), expert_usage=usage,
                router_rows=probs.shape[0])


def acceptable(s):
    return (s["router_gap"] > MIN_ROUTER_GAP and s["logit_margin"] > MIN_LOGIT_MARGIN
            and 1.0 < s["logit_std"] < 2.5 and s["argmax_not_input"] > 0 and min(s["expert_usage"]) > 0)


def greedy_hf(model, ids, n):
    ids = list(ids)
    out = []
    with torch.no_grad():
        for _ in range(n):
            t = model(torch.tensor([ids])).logits[0, -1].argmax().item()
            out.append(t)
            ids.append(t)
    return out


def to_fused(path, config):
    """Rewrites model.safetensors from per-expert tensors to the fused 3D layout:
    mlp.experts.gate_up_proj [E, 2*I, H] (rows 0..I-1 gate, I..2I-1 up) and
    mlp.experts.down_proj [E, H, I]."""
    sd = safetensors.torch.load_file(path)
    with safetensors.safe_open(path, "pt") as f:
        meta = f.metadata()
    out = {}
    E = config.num_experts
    for layer in range(config.num_hidden_layers):
        pre = f"model.layers.{layer}.mlp.experts"
        if f"{pre}.0.gate_proj.weight" not in sd:
            continue
        gate = torch.stack([sd.pop(f"{pre}.{e}.gate_proj.weight") for e in range(E)])
        up = torch.stack([sd.pop(f"{pre}.{e}.up_proj.weight") for e in range(E)])
        down = torch.stack([sd.pop(f"{pre}.{e}.down_proj.weight") for e in range(E)])
        out[f"{pre}.gate_up_proj"] = torch.cat([gate, up], dim=1).contiguous()
        out[f"{pre}.down_proj"] = down.contiguous()
    assert not any(".experts." in k and k.split(".experts.")[1][0].isdigit() for k in sd)
    out.update(sd)
    safetensors.torch.save_file(out, path, metadata=meta)


# ---------------------------------------------------------------------------------------------
# llama.cpp


def patched_converter(tmpdir, fixture_dir):
    """Copies convert_hf_to_gguf.py (+ conversion/, gguf-py/) and registers this tokenizer's
    pre-tokenizer hash as `qwen2`. Returns the path of the copied convert_hf_to_gguf.py."""
    dst = os.path.join(tmpdir, "llama.cpp")
    os.makedirs(dst)
    shutil.copy(os.path.join(LLAMA_SRC, "convert_hf_to_gguf.py"), dst)
    shutil.copytree(os.path.join(LLAMA_SRC, "conversion"), os.path.join(dst, "conversion"))
    shutil.copytree(os.path.join(LLAMA_SRC, "gguf-py"), os.path.join(dst, "gguf-py"))
    base = os.path.join(dst, "conversion", "base.py")
    src = open(base).read()
    # The converter hashes str(AutoTokenizer.encode(chktxt)); compute the same hash here.
    m = re.search(r"^\s*chktxt = (.*)$", src, re.M)
    chktxt = ast.literal_eval(m.group(1))
    import hashlib
    hf = AutoTokenizer.from_pretrained(fixture_dir)
    chkhsh = hashlib.sha256(str(hf.encode(chktxt)).encode()).hexdigest()
    anchor = "        res = None\n"
    assert src.count(anchor) == 1
    src = src.replace(anchor, anchor + f'        if chkhsh == "{chkhsh}":\n'
                      f'            # specula tests/fixtures MoE tiny tokenizer (scripts/moe_tiny_fixture.py)\n'
                      f'            res = "qwen2"\n')
    open(base, "w").write(src)
    return os.path.join(dst, "convert_hf_to_gguf.py"), chkhsh


def convert(converter, fixture_dir, outtype, outfile):
    subprocess.run([sys.executable, converter, fixture_dir, "--outtype", outtype, "--outfile", outfile],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def build_dump():
    os.makedirs(TMP, exist_ok=True)
    b = LLAMA_BUILD
    subprocess.run([
        "g++", "-O1", "-std=c++17", f"-I{LLAMA_SRC}/include", f"-I{LLAMA_SRC}/ggml/include",
        os.path.join(ROOT, "scripts/llamacpp_logits_dump.cpp"),
        f"{b}/src/libllama.a", f"{b}/ggml/src/libggml.a", f"{b}/ggml/src/libggml-cpu.a",
        f"{b}/ggml/src/libggml-base.a", "-fopenmp", "-lpthread", "-ldl", "-o", DUMP_BIN,
    ], check=True)


def run_dump(gguf_path, seqs):
    args = [DUMP_BIN, gguf_path, str(N_GREEDY)] + [",".join(map(str, s)) for s in seqs]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run(args, check=True, capture_output=True, text=True, env=env)
    d = json.loads(r.stdout)
    assert d["n_vocab"] == VOCAB
    return [torch.tensor(s["logits"]) for s in d["sequences"]], d["greedy"]["generated"]


def gguf_summary(gguf_path, gguf_py):
    """Metadata keys (without the tokenizer arrays) and block-0 tensors of a GGUF."""
    sys.path.insert(0, gguf_py)
    import gguf
    r = gguf.GGUFReader(gguf_path)
    meta = {}
    for k, f in r.fields.items():
        if k in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges", "tokenizer.ggml.scores"):
            continue
        if k.startswith("GGUF."):
            continue
        try:
            v = f.contents()
        except Exception:
            v = "?"
        meta[k] = v
    tensors = [(t.name, [int(x) for x in t.shape], t.tensor_type.name) for t in r.tensors
               if t.name.startswith("blk.0.") or not t.name.startswith("blk.")]
    return meta, tensors


# ---------------------------------------------------------------------------------------------


def clean(out):
    os.makedirs(out, exist_ok=True)
    for name in os.listdir(out):
        if name != "README.md":  # README.md is hand-written
            p = os.path.join(out, name)
            shutil.rmtree(p) if os.path.isdir(p) else os.remove(p)


def make_variant(name, spec, tok, seqs, converter_state):
    """Searches seeds upward from 0 until the HF model is `acceptable` and, for the GGUF fixtures,
    also robust under q8_0 (`q8_robust`); writes the fixture directory for that seed."""
    seed = 0
    tried = []
    while True:
        report = try_variant(name, spec, tok, seqs, converter_state, seed)
        if report["ok"]:
            return report
        tried.append((report["max_diff_q8"], report["seed"]))
        if len(tried) == MAX_Q8_TRIES:
            # No seed routes identically under llama.cpp's q8_0 arithmetic: take the closest one.
            best = min(tried)[1]
            print(f"[{name}] no q8_0-robust seed in {MAX_Q8_TRIES} tries, using seed {best}")
            return try_variant(name, spec, tok, seqs, converter_state, best, force=True)
        seed = report["seed"] + 1


def q8_robust(r):
    """llama.cpp on the q8_0 GGUF must route like the f32 model at every position (no jump in the
    logit difference, same argmax), and transformers with the dequantized q8_0 weights must keep a
    router gap > MIN_ROUTER_GAP / 2 and agree with llama.cpp q8_0 too."""
    return (r["max_diff_q8"] < Q8_MAX_DIFF and r["argmax_mismatch_q8"] == 0
            and r["dequant_router_gap"] > MIN_ROUTER_GAP / 2 and r["max_diff_q8_vs_dequant"] < Q8_MAX_DIFF)


def hf_on_dequantized_gguf(model, gguf_path, gguf_py, seqs):
    """transformers' logits and router probabilities with every weight replaced by the GGUF's
    (dequantized) weight: separates q8_0 weight rounding from llama.cpp's own arithmetic."""
    import copy
    sys.path.insert(0, gguf_py)
    import gguf
    from gguf.quants import dequantize
    r = gguf.GGUFReader(gguf_path)
    gt = {t.name: torch.from_numpy(dequantize(t.data, t.tensor_type).copy()).float() for t in r.tensors}
    m = copy.deepcopy(model)
    sd = m.state_dict()
    used = set()

    def put(hf, g, reshape=None):
        v = gt[g] if reshape is None else gt[g].reshape(reshape)
        assert sd[hf].shape == v.shape, (hf, sd[hf].shape, v.shape)
        sd[hf].copy_(v)
        used.add(g)

    put("model.embed_tokens.weight", "token_embd.weight")
    put("lm_head.weight", "output.weight")
    put("model.norm.weight", "output_norm.weight")
    for i in range(model.config.num_hidden_layers):
        b, h = f"blk.{i}.", f"model.layers.{i}."
        for g, hf in [("attn_q", "self_attn.q_proj"), ("attn_k", "self_attn.k_proj"),
                      ("attn_v", "self_attn.v_proj"), ("attn_output", "self_attn.o_proj")]:
            put(h + hf + ".weight", b + g + ".weight")
            if b + g + ".bias" in gt:
                put(h + hf + ".bias", b + g + ".bias")
        for g, hf in [("attn_q_norm", "self_attn.q_norm"), ("attn_k_norm", "self_attn.k_norm"),
                      ("attn_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm")]:
            if b + g + ".weight" in gt:
                put(h + hf + ".weight", b + g + ".weight")
        put(h + "mlp.gate.weight", b + "ffn_gate_inp.weight")
        sd[h + "mlp.experts.gate_up_proj"].copy_(
            torch.cat([gt[b + "ffn_gate_exps.weight"], gt[b + "ffn_up_exps.weight"]], dim=1))
        used.update([b + "ffn_gate_exps.weight", b + "ffn_up_exps.weight"])
        put(h + "mlp.experts.down_proj", b + "ffn_down_exps.weight")
        if b + "ffn_up_shexp.weight" in gt:
            for g, hf in [("ffn_gate_shexp", "gate_proj"), ("ffn_up_shexp", "up_proj"), ("ffn_down_shexp", "down_proj")]:
                put(h + "mlp.shared_expert." + hf + ".weight", b + g + ".weight")
            put(h + "mlp.shared_expert_gate.weight", b + "ffn_gate_inp_shexp.weight", (1, -1))
    assert used == set(gt), set(gt) - used
    return run_hf(m, seqs)


def try_variant(name, spec, tok, seqs, converter_state, seed, force=False):
    out = os.path.join(FIXTURES, name)
    clean(out)
    config = spec["config"]()
    cls = spec["cls"]
    while True:
        model = cls._from_config(config, attn_implementation="eager", dtype=torch.float32).eval()
        init_weights(model, seed)
        logits, rp = run_hf(model, seqs)
        st = stats(logits, rp, seqs)
        print(f"[{name}] seed {seed}: {st}")
        if acceptable(st):
            break
        seed += 1
        assert seed < 1000

    model.save_pretrained(out, safe_serialization=True)
    st_path = os.path.join(out, "model.safetensors")
    for extra in ["generation_config.json"]:
        p = os.path.join(out, extra)
        if os.path.exists(p):
            os.remove(p)
    if spec["fused"]:
        to_fused(st_path, config)
    os.chmod(st_path, 0o644)
    write_tokenizer(tok, out)
    with safetensors.safe_open(st_path, "pt") as f:
        shapes = {k: list(f.get_slice(k).get_shape()) for k in f.keys()}
    print(f"[{name}] model.safetensors: {len(shapes)} tensors; layer 0:")
    for k in sorted(shapes):
        if re.match(r"model\.layers\.[01]\.", k) and not re.search(r"\.experts\.[1-9]", k):
            print(f"    {k} {shapes[k]}")

    # Reload from disk (for the mixed variant: from the fused layout) and check identical logits.
    model2, info = cls.from_pretrained(out, attn_implementation="eager", dtype=torch.float32,
                                       output_loading_info=True)
    model2.eval()
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    for k, v in model.state_dict().items():
        assert torch.equal(v, model2.state_dict()[k]), f"reloaded weight {k} differs"
    logits2, _ = run_hf(model2, seqs)
    reload_diff = max((a - b).abs().max().item() for a, b in zip(logits, logits2))
    print(f"[{name}] reloaded from disk: weights bit-identical, max |dlogit| {reload_diff:.3g}")
    # Per-expert files reload to bit-identical logits. The fused file reloads to bit-identical
    # weights but logits that differ by ~1e-6 (f32 rounding of the expert matmuls on the loaded
    # tensors); the reference logits are those of the in-memory model (= the per-expert reload).
    assert reload_diff == 0.0 if not spec["fused"] else reload_diff < 1e-5, reload_diff

    ref = {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "dtype": "float32",
        "attn_implementation": "eager",
        "bos_added": False,
        "seed": seed,
        "min_router_gap_2nd_3rd": sig6(st["router_gap"]),
        "min_top1_top2_logit_margin": sig6(st["logit_margin"]),
        "sequences": [
            {"tokens": ids, "argmax": l.argmax(-1).tolist(), "logits": [[sig6(v) for v in row.tolist()] for row in l]}
            for ids, l in zip(seqs, logits)
        ],
        "greedy": {"prompt": seqs[0], "generated": greedy_hf(model, seqs[0], N_GREEDY)},
        "note": (
            "sequences[k].logits[i]: transformers float32 logits (eager attention) of position i given "
            "tokens[0..=i], fed exactly as listed (no BOS), rounded to 6 significant digits; argmax from the "
            "unrounded logits. greedy: 16 tokens generated greedily by transformers from sequences[0]. "
            "min_router_gap_2nd_3rd: smallest gap between the 2nd and 3rd largest router softmax probability "
            "over all MoE layers and reference positions; min_top1_top2_logit_margin: smallest top-1/top-2 "
            "logit margin over the reference positions."
        ),
    }
    report = {"name": name, "seed": seed, "stats": st, "reload_diff": reload_diff, "ok": True}

    if spec["gguf"]:
        converter, chkhsh, gguf_py = converter_state
        q8 = os.path.join(out, "model-q8_0.gguf")
        f32 = os.path.join(TMP, f"{name}-f32.gguf")
        convert(converter, out, "q8_0", q8)
        convert(converter, out, "f32", f32)
        lq8, greedy_q8 = run_dump(q8, seqs)
        lf32, greedy_f32 = run_dump(f32, seqs)
        d_f32 = max((a - b).abs().max().item() for a, b in zip(lf32, logits))
        d_q8 = max((a - b).abs().max().item() for a, b in zip(lq8, logits))
        am_q8 = sum((a.argmax(-1) != b.argmax(-1)).sum().item() for a, b in zip(lq8, logits))
        am_f32 = sum((a.argmax(-1) != b.argmax(-1)).sum().item() for a, b in zip(lf32, logits))
        ldq, rpdq = hf_on_dequantized_gguf(model, q8, gguf_py, seqs)
        report["dequant_router_gap"] = stats(ldq, rpdq, seqs)["router_gap"]
        report["max_diff_q8_vs_dequant"] = max((a - b).abs().max().item() for a, b in zip(lq8, ldq))
        report["max_diff_dequant_vs_f32"] = max((a - b).abs().max().item() for a, b in zip(ldq, logits))
        report.update(max_diff_f32=d_f32, max_diff_q8=d_q8, argmax_mismatch_q8=am_q8, argmax_mismatch_f32=am_f32,
                      greedy_hf=ref["greedy"]["generated"], greedy_f32=greedy_f32, greedy_q8=greedy_q8,
                      chkhsh=chkhsh, gguf_q8=gguf_summary(q8, gguf_py), gguf_f32=gguf_summary(f32, gguf_py))
        print(f"[{name}] llama.cpp f32 GGUF vs transformers: max |dlogit| {d_f32:.3g}, argmax mismatches {am_f32}")
        print(f"[{name}] llama.cpp q8_0 GGUF vs transformers: max |dlogit| {d_q8:.3g}, argmax mismatches {am_q8}")
        print(f"[{name}] transformers on dequantized q8_0 weights: router gap {report['dequant_router_gap']:.3g}, "
              f"max |dlogit| vs llama.cpp q8_0 {report['max_diff_q8_vs_dequant']:.3g}, "
              f"vs transformers f32 {report['max_diff_dequant_vs_f32']:.3g}")
        report["ok"] = force or q8_robust(report)
        if not report["ok"]:
            print(f"[{name}] seed {seed}: q8_0 routing not robust, trying the next seed")
            return report
        print(f"[{name}] greedy hf {ref['greedy']['generated']}\n    llama f32 {greedy_f32}\n    llama q8 {greedy_q8}")
        ref["llamacpp"] = {
            "llama_cpp_commit": "0c1e570",
            "gguf": "model-q8_0.gguf",
            "program": "scripts/llamacpp_logits_dump.cpp (CPU, 1 thread, llama.cpp's defaults: f16 KV cache, flash attention auto)",
            "sequences": [
                {"tokens": ids, "argmax": l.argmax(-1).tolist(), "logits": [[sig6(v) for v in row.tolist()] for row in l]}
                for ids, l in zip(seqs, lq8)
            ],
            "greedy": {"prompt": seqs[0], "generated": greedy_q8},
            "max_abs_diff_vs_transformers": sig6(d_q8),
            "max_abs_diff_f32_gguf_vs_transformers": sig6(d_f32),
            "max_abs_diff_vs_transformers_on_dequantized_q8_0": sig6(report["max_diff_q8_vs_dequant"]),
            "note": (
                "llama.cpp logits of the q8_0 GGUF in this directory: each sequence decoded in one batch with "
                "logits at every position, rounded to 6 significant digits. greedy: 16 tokens generated "
                "greedily by llama.cpp on the q8_0 GGUF from sequences[0]. The q8_0 weights equal the f32 "
                "safetensors weights exactly, so the differences to the transformers logits come from llama.cpp "
                "quantizing the activations to q8_0 in its matrix products. max_abs_diff_f32_gguf_vs_transformers "
                "is for an f32 GGUF converted the same way (not committed)."
            ),
        }

    with open(os.path.join(out, "reference.json"), "w") as f:
        json.dump(ref, f, separators=(",", ":"))
        f.write("\n")
    return report


def main():
    torch.set_num_threads(1)
    tok = build_tokenizer()
    gen = torch.Generator().manual_seed(1234)
    seqs = [torch.randint(0, N_TRAINED, (n,), generator=gen).tolist() for n in SEQ_LENS]
    print("sequences:", seqs)
    print("decoded:", [tok.decode(s) for s in seqs])

    os.makedirs(TMP, exist_ok=True)
    build_dump()
    reports = []
    with tempfile.TemporaryDirectory() as tmpdir:
        converter_state = None
        for name, spec in VARIANTS.items():
            if spec["gguf"] and converter_state is None:
                # The tokenizer is the same for all fixtures: write it to get the hash from a bundle.
                tdir = os.path.join(tmpdir, "tok")
                os.makedirs(tdir)
                write_tokenizer(tok, tdir)
                conv, chkhsh = patched_converter(tmpdir, tdir)
                converter_state = (conv, chkhsh, os.path.join(tmpdir, "llama.cpp", "gguf-py"))
            reports.append(make_variant(name, spec, tok, seqs, converter_state))

    for r in reports:
        print(f"\n== {r['name']} (seed {r['seed']}) ==")
        for k, v in r["stats"].items():
            print(f"  {k}: {v}")
        for k in ["reload_diff", "max_diff_f32", "max_diff_q8", "argmax_mismatch_f32", "argmax_mismatch_q8",
                  "dequant_router_gap", "max_diff_q8_vs_dequant", "max_diff_dequant_vs_f32", "greedy_hf",
                  "greedy_f32", "greedy_q8", "chkhsh"]:
            if k in r:
                print(f"  {k}: {r[k]}")
        for which in ["gguf_q8", "gguf_f32"]:
            if which in r:
                meta, tensors = r[which]
                print(f"  {which} metadata:")
                for k, v in meta.items():
                    print(f"    {k} = {v}")
                print(f"  {which} tensors (gguf-py shape = ggml ne order):")
                for t in tensors:
                    print(f"    {t}")
    total = 0
    for name in VARIANTS:
        d = os.path.join(FIXTURES, name)
        for fn in sorted(os.listdir(d)):
            size = os.path.getsize(os.path.join(d, fn))
            total += size
            print(f"{name}/{fn}: {size} bytes")
    print(f"total {total} bytes")
    assert total < 6_000_000, total


if __name__ == "__main__":
    main()
