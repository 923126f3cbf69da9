#!/usr/bin/env python3
"""Write the GGUF and safetensors seed inputs of the gguf_header and safetensors_header fuzz
targets (fuzz/seeds/*/): minimal headers (valid and with each kind of problem the checks report)
and the headers of the tiny fixtures in tests/fixtures (tensor data cut off)."""
import struct, json, os, sys
out=os.path.dirname(os.path.abspath(__file__))
root=os.path.dirname(os.path.dirname(out))
# ---- GGUF ----
def s(x, v=3):
    b=x.encode(); return (struct.pack('<I',len(b)) if v==1 else struct.pack('<Q',len(b)))+b
def cnt(n,v): return struct.pack('<I',n) if v==1 else struct.pack('<Q',n)
def kv(k,ty,val,v=3):
    return s(k,v)+struct.pack('<I',ty)+val
def u32(x): return struct.pack('<I',x)
def f32(x): return struct.pack('<f',x)
def sval(x,v=3): return s(x,v)
def arr(elty, items, v=3): return u32(elty)+cnt(len(items),v)+b''.join(items)
def gguf(version, kvs, tensors, align=32, data=None):
    v=version
    h=b'GGUF'+u32(v)+cnt(len(tensors),v)+cnt(len(kvs),v)
    for k,ty,val in kvs: h+=kv(k,ty,val,v)
    for name,ne,ty,off in tensors:
        h+=s(name,v)+u32(len(ne))+b''.join((u32(d) if v==1 else struct.pack('<Q',d)) for d in ne)+u32(ty)+struct.pack('<Q',off)
    pad=(-len(h))%align
    h+=b'\0'*pad
    return h+(data or b'')
def llama_kvs(v, extra=()):
    toks=['<s>','</s>','a','b','c','ab','bc','Ġa']
    return [
      ('general.architecture',8,sval('llama',v)),
      ('general.name',8,sval('tiny',v)),
      ('llama.block_count',4,u32(1)),
      ('llama.embedding_length',4,u32(32)),
      ('llama.feed_forward_length',4,u32(64)),
      ('llama.context_length',4,u32(64)),
      ('llama.attention.head_count',4,u32(2)),
      ('llama.attention.head_count_kv',4,u32(1)),
      ('llama.attention.layer_norm_rms_epsilon',6,f32(1e-5)),
      ('llama.rope.freq_base',6,f32(10000.0)),
      ('tokenizer.ggml.model',8,sval('gpt2',v)),
      ('tokenizer.ggml.pre',8,sval('default',v)),
      ('tokenizer.ggml.tokens',9,arr(8,[sval(t,v) for t in toks],v)),
      ('tokenizer.ggml.token_type',9,arr(5,[struct.pack('<i',1)]*len(toks),v)),
      ('tokenizer.ggml.merges',9,arr(8,[sval('a b',v),sval('b c',v)],v)),
      ('tokenizer.ggml.bos_token_id',4,u32(0)),
      ('tokenizer.ggml.eos_token_id',4,u32(1)),
      ('tokenizer.chat_template',8,sval("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}",v)),
    ]+list(extra)
def llama_tensors():
    # (name, ne in ggml order (innermost first), type, offset); F32 = 0, Q8_0 = 8
    t=[]; off=0
    def add(name,ne,ty,nbytes):
        nonlocal off
        t.append((name,ne,ty,off)); off+=nbytes; off+=(-off)%32
    add('token_embd.weight',[32,8],0,32*8*4)
    add('output_norm.weight',[32],0,32*4)
    add('blk.0.attn_q.weight',[32,32],8,32*34)
    add('blk.0.attn_norm.weight',[32],0,32*4)
    add('blk.0.attn_k.weight',[32,16],0,32*16*4)
    add('blk.0.attn_v.weight',[32,16],0,32*16*4)
    add('blk.0.attn_output.weight',[32,32],8,32*34)
    add('blk.0.ffn_norm.weight',[32],0,32*4)
    add('blk.0.ffn_gate.weight',[32,64],8,64*34)
    add('blk.0.ffn_up.weight',[32,64],8,64*34)
    add('blk.0.ffn_down.weight',[64,32],8,32*2*34)
    return t, off
t,n=llama_tensors()
seeds={}
seeds['llama_v3.gguf']=gguf(3,llama_kvs(3),t,data=bytes(n))
seeds['llama_v2_truncated.gguf']=gguf(2,llama_kvs(2),t,data=bytes(64))
# regression (gguf_header crash, overflow in inspect's weights_in_memory): a norm of 2^62
# elements, whose f32 bytes overflow u64
t2=[(n,([1<<62] if n=='blk.0.attn_norm.weight' else ne),ty,off) for n,ne,ty,off in t]
seeds['regress_huge_norm.gguf']=gguf(3,llama_kvs(3),t2,data=bytes(n))
seeds['llama_v1.gguf']=gguf(1,llama_kvs(1),t,data=bytes(n))
nested=arr(9,[arr(4,[u32(1),u32(2)]),arr(8,[sval('x')])])
seeds['align64_nested.gguf']=gguf(3,[('general.architecture',8,sval('qwen3')),('general.alignment',4,u32(64)),('x.nested',9,nested),('x.u64',10,struct.pack('<Q',7)),('x.bool',7,b'\1'),('x.f64',12,struct.pack('<d',0.5)),('x.i8',1,b'\xff'),('x.u16',2,b'\1\0')],
   [('token_embd.weight',[4,2],0,0),('dup',[4],1,64),('dup',[4],1,128),('odd',[33],8,192),('unk',[4],99,256)],align=64,data=bytes(64))
# header of a real fixture GGUF (tensor data cut off)
def header_len(b):
    import io
    f=io.BytesIO(b); f.read(4); v=struct.unpack('<I',f.read(4))[0]
    rc=lambda: struct.unpack('<I' if v==1 else '<Q', f.read(4 if v==1 else 8))[0]
    nt=rc(); nk=rc()
    def rs(): return f.read(rc())
    def val(ty):
        sz={0:1,1:1,2:2,3:2,4:4,5:4,6:4,7:1,10:8,11:8,12:8}
        if ty in sz: f.read(sz[ty])
        elif ty==8: rs()
        elif ty==9:
            et=struct.unpack('<I',f.read(4))[0]; n=rc()
            for _ in range(n): val(et)
    for _ in range(nk):
        rs(); val(struct.unpack('<I',f.read(4))[0])
    for _ in range(nt):
        rs(); nd=struct.unpack('<I',f.read(4))[0]; f.read(nd*(4 if v==1 else 8)); f.read(12)
    return f.tell()
for src,name in [('tests/fixtures/qwen3moe-tiny/model-q8_0.gguf','qwen3moe_fixture_header.gguf')]:
    b=open(os.path.join(root,src),'rb').read()
    hl=header_len(b)
    print(src,'header',hl)
    if hl<=60000: seeds[name]=b[:hl+256]
for n,b in seeds.items():
    open(os.path.join(out,'gguf_header',n),'wb').write(b)
# ---- safetensors ----
def st(hdr, data=b'', pad=True):
    j=json.dumps(hdr,separators=(',',':')).encode()
    if pad: j+=b' '*((-len(j))%8)
    return struct.pack('<Q',len(j))+j+data
sts={}
sts['basic.safetensors']=st({"__metadata__":{"format":"pt"},"model.embed_tokens.weight":{"dtype":"F32","shape":[4,2],"data_offsets":[0,32]},"model.norm.weight":{"dtype":"BF16","shape":[2],"data_offsets":[32,36]}},bytes(36))
sts['fused_experts.safetensors']=st({"model.layers.0.mlp.experts.gate_up_proj":{"dtype":"F16","shape":[2,4,3],"data_offsets":[0,48]},"model.layers.0.mlp.experts.down_proj":{"dtype":"F16","shape":[2,3,2],"data_offsets":[48,72]}},bytes(72))
sts['problems.safetensors']=st({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]},"b":{"dtype":"X9","shape":[1],"data_offsets":[8,9]},"c":{"dtype":"I64","shape":[1],"data_offsets":[16,8]},"d":{"shape":[1]},"e":{"dtype":"U8","shape":[100],"data_offsets":[0,100]},"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"f":{"dtype":"BOOL","shape":[],"data_offsets":[0,1]}},bytes(16))
# duplicate key "a": json.dumps collapses it; write by hand
j=b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]},"m":{"dtype":"F8_E4M3","shape":[2,2],"data_offsets":[8,12]}}'
sts['duplicate.safetensors']=struct.pack('<Q',len(j))+j+bytes(12)
# head of a real fixture safetensors (data cut)
b=open(os.path.join(root,'tests/fixtures/qwen3moe-tiny/model.safetensors'),'rb').read()
hl=struct.unpack('<Q',b[:8])[0]
print('st fixture header',hl)
if hl<60000: sts['qwen3moe_fixture_header.safetensors']=b[:8+hl+64]
for n,b in sts.items():
    open(os.path.join(out,'safetensors_header',n),'wb').write(b)
