//! `inspect`: bundle reports from headers only. The catalog models (each in under a second, the
//! right fields, no weight bytes read), tiny bundles with MTP heads in both layouts (trunk,
//! sidecar, GGUF `nextn`), markers without tensors, block drafters, draft models, and a corpus
//! of malformed bundles that must each give a clear diagnostic (and a clear load error) naming
//! the file and the field or tensor, without a panic.

mod common;

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Instant;

use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use specula_engine::inspect::{self, BundleReport, Component, InspectOptions, MtpStatus, Severity, Tier};
use specula_engine::model::Family;
use specula_engine::testing::{write_tiny_gguf, write_tiny_hf, TinySpec};
use specula_engine::{bundle, catalog};

/// Tests that read big files or measure this process's I/O run one at a time.
static HEAVY: Mutex<()> = Mutex::new(());

fn heavy() -> std::sync::MutexGuard<'static, ()> {
    HEAVY.lock().unwrap_or_else(|e| e.into_inner())
}

fn tmp() -> tempfile::TempDir {
    tempfile::tempdir().expect("tempdir")
}

fn run(path: &Path) -> BundleReport {
    inspect::inspect(path, &InspectOptions::default()).expect("inspect")
}

fn run_with(path: &Path, opts: InspectOptions) -> BundleReport {
    inspect::inspect(path, &opts).expect("inspect")
}

fn errors(r: &BundleReport) -> Vec<String> {
    r.errors().map(|d| d.to_string()).collect()
}

/// Tiny vocabulary size (256 bytes + 4 merges + 2 specials).
const TINY_VOCAB: usize = 262;

fn zeros(dims: &[usize]) -> Tensor {
    Tensor::zeros(dims, DType::F32, &Device::Cpu).expect("zeros")
}

/// The tensors of one HF-named transformer block of the tiny spec (hidden 64).
fn hf_block(prefix: &str) -> Vec<(String, Vec<usize>)> {
    [
        ("input_layernorm.weight", vec![64]),
        ("self_attn.q_proj.weight", vec![64, 64]),
        ("self_attn.k_proj.weight", vec![32, 64]),
        ("self_attn.v_proj.weight", vec![32, 64]),
        ("self_attn.o_proj.weight", vec![64, 64]),
        ("post_attention_layernorm.weight", vec![64]),
        ("mlp.gate_proj.weight", vec![128, 64]),
        ("mlp.up_proj.weight", vec![128, 64]),
        ("mlp.down_proj.weight", vec![64, 128]),
    ]
    .into_iter()
    .map(|(n, d)| (format!("{prefix}.{n}"), d))
    .collect()
}

/// Add tensors (zeros of the given shapes) to an HF bundle's model.safetensors.
fn add_hf_tensors(dir: &Path, extra: &[(String, Vec<usize>)]) {
    let path = dir.join("model.safetensors");
    let mut map: HashMap<String, Tensor> = candle_core::safetensors::load(&path, &Device::Cpu).expect("load st");
    for (n, d) in extra {
        map.insert(n.clone(), zeros(d));
    }
    candle_core::safetensors::save(&map, &path).expect("save st");
}

fn save_st(path: &Path, tensors: &[(String, Vec<usize>)]) {
    let map: HashMap<String, Tensor> = tensors.iter().map(|(n, d)| (n.clone(), zeros(d))).collect();
    candle_core::safetensors::save(&map, path).expect("save st");
}

fn edit_json(path: &Path, f: impl FnOnce(&mut serde_json::Value)) {
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).expect("read json")).expect("parse json");
    f(&mut v);
    std::fs::write(path, serde_json::to_string_pretty(&v).expect("json")).expect("write json");
}

fn tiny_hf(dir: &Path, family: Family) {
    write_tiny_hf(dir, &TinySpec::new(family)).expect("write tiny hf");
}

fn tiny_gguf(path: &Path, family: Family) {
    write_tiny_gguf(path, &TinySpec::new(family)).expect("write tiny gguf");
}

/// A tiny GGUF on batch-invariant kernels (Q8_0 projections), so speculation is possible.
fn tiny_gguf_q8(path: &Path, family: Family) {
    write_tiny_gguf(path, &TinySpec::with_dtype(family, GgmlDType::Q8_0)).expect("write tiny gguf");
}

/// Rewrite a GGUF file through `edit` (metadata, tensors in order).
type GgufEdit<'a> = &'a mut dyn FnMut(&mut Vec<(String, gguf_file::Value)>, &mut Vec<(String, QTensor)>);

fn rewrite_gguf(src: &Path, dst: &Path, edit: GgufEdit) {
    let mut f = std::fs::File::open(src).expect("open");
    let content = gguf_file::Content::read(&mut f).expect("read gguf");
    let mut md: Vec<(String, gguf_file::Value)> =
        content.metadata.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    md.sort_by(|a, b| a.0.cmp(&b.0));
    let mut names: Vec<&String> = content.tensor_infos.keys().collect();
    names.sort();
    let mut ts: Vec<(String, QTensor)> = names
        .into_iter()
        .map(|n| (n.clone(), content.tensor(&mut f, n, &Device::Cpu).expect("tensor")))
        .collect();
    edit(&mut md, &mut ts);
    let md_refs: Vec<(&str, &gguf_file::Value)> = md.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let t_refs: Vec<(&str, &QTensor)> = ts.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut out = std::fs::File::create(dst).expect("create");
    gguf_file::write(&mut out, &md_refs, &t_refs).expect("write gguf");
}

fn qzeros(dims: &[usize]) -> QTensor {
    QTensor::quantize(&zeros(dims), GgmlDType::F32).expect("quantize")
}

fn set_md(md: &mut Vec<(String, gguf_file::Value)>, key: &str, v: gguf_file::Value) {
    md.retain(|(k, _)| k != key);
    md.push((key.to_string(), v));
}

// ---------------------------------------------------------------------------------------------
// Catalog models.

#[test]
fn catalog_models_inspect_under_a_second_with_the_right_report() {
    let _g = heavy();
    // (name, architecture, layers, hidden, kv heads, head_dim, context, vocab, params ~, kinds)
    let expect = [
        (
            "smollm2-135m-instruct",
            "llama",
            30,
            576,
            3,
            64,
            8192,
            49152,
            134.5e6,
            "Q4_1",
        ),
        (
            "qwen2.5-coder-0.5b-instruct",
            "qwen2",
            24,
            896,
            2,
            64,
            32768,
            151936,
            630.2e6,
            "Q5_0",
        ),
        (
            "qwen2.5-coder-1.5b-instruct",
            "qwen2",
            28,
            1536,
            2,
            128,
            32768,
            151936,
            1.777e9,
            "Q4_K",
        ),
    ];
    for (name, arch, layers, hidden, kv, hd, ctx, vocab, params, top_dtype) in expect {
        let path = common::model_path(name);
        let t = Instant::now();
        let r = run(&path);
        let secs = t.elapsed().as_secs_f64();
        assert!(secs < 1.0, "{name}: inspect took {secs:.2}s");
        assert!(errors(&r).is_empty(), "{name}: {:?}", errors(&r));
        assert_eq!(r.architecture.as_deref(), Some(arch), "{name}");
        let c = r.config.as_ref().expect("config");
        assert_eq!(
            (
                c.num_layers,
                c.hidden_size,
                c.num_kv_heads,
                c.head_dim,
                c.context_length,
                c.vocab_size
            ),
            (layers, hidden, kv, hd, ctx, vocab),
            "{name}"
        );
        assert_eq!(r.context_length, Some(ctx));
        let rel = (r.parameters as f64 - params).abs() / params;
        assert!(rel < 0.01, "{name}: {} parameters", r.parameters);
        assert_eq!(r.quantization[0].dtype, top_dtype, "{name}: {:?}", r.quantization);
        let entry = catalog::lookup(name).expect("entry");
        assert_eq!(r.files[0].bytes, entry.size_bytes);
        assert_eq!(r.weight_bytes, r.quantization.iter().map(|q| q.bytes).sum::<u64>());
        assert!(r.weight_bytes <= entry.size_bytes && r.weight_bytes > entry.size_bytes * 9 / 10);
        assert!(
            r.tokenizer.found && r.tokenizer.vocab_size == Some(vocab),
            "{name}: {:?}",
            r.tokenizer
        );
        assert!(r.chat_template.is_some(), "{name}: chat template");
        // `specula pull` writes the MTP head the binary ships for the default model beside it
        // (`BUNDLED_DRAFTERS` in crates/specula/src/pull.rs), marked by `bundled.sha256`.
        let stem = path.file_stem().expect("stem").to_string_lossy().to_string();
        let shipped_head = path
            .with_file_name(format!("{stem}.mtp"))
            .join("bundled.sha256")
            .exists();
        let expect_mtp = if shipped_head {
            MtpStatus::Present
        } else {
            MtpStatus::Absent
        };
        assert_eq!(r.capabilities.mtp.status, expect_mtp, "{name}");
        assert!(r.capabilities.block_drafter.is_none());
        assert!(r.capabilities.ngram);
        assert!(
            r.kernels.as_ref().is_some_and(|k| k.batch_invariant),
            "{name}: {:?}",
            r.kernels
        );
        // A tuning file may exist in this cache (from `specula tune`); either way the tier says so.
        let tuned = r.tuning.as_ref().is_some_and(|t| t.applies);
        assert_eq!(
            r.tier,
            if tuned {
                Tier::Verified
            } else {
                Tier::CompatibleUnmeasured
            },
            "{name}"
        );
        assert_eq!(r.modes.off.drafter, "ar");
        let chain = if shipped_head { "mtp+ngram" } else { "ngram" };
        assert_eq!(r.modes.on.drafter, chain, "{name}");
        if !tuned {
            assert_eq!(r.modes.default.drafter, chain, "{name}");
        }
        let m = r.memory.as_ref().expect("memory");
        // f16 keys and values.
        let kv_tok = 2 * layers as u64 * kv as u64 * hd as u64 * 2;
        assert_eq!(m.kv_bytes_per_token, kv_tok);
        assert_eq!(m.kv_bytes, kv_tok * ctx as u64);
        assert!(m.weights_bytes > r.weight_bytes * 9 / 10, "{name}: {m:?}");
        assert_eq!(
            m.total_bytes,
            m.resident_after_load_bytes + m.kv_bytes + m.scratch_bytes
        );
        // Text and JSON renderings.
        let text = r.to_string();
        for s in [
            "architecture",
            "speculative capabilities",
            "tier:",
            "effective mode",
            "default",
        ] {
            assert!(text.contains(s), "{name}: text report lacks {s}:\n{text}");
        }
        let j = serde_json::to_value(&r).expect("json");
        for k in [
            "family",
            "parameters",
            "quantization",
            "tokenizer",
            "capabilities",
            "tier",
            "modes",
            "memory",
        ] {
            assert!(j.get(k).is_some(), "{name}: JSON lacks {k}");
        }
        assert_eq!(j["modes"]["off"]["drafter"], "ar");
    }
}

#[test]
fn qwen_pair_as_target_and_draft() {
    let _g = heavy();
    let target = common::model_path("qwen2.5-coder-1.5b-instruct");
    let draft = common::model_path("qwen2.5-coder-0.5b-instruct");
    let t = Instant::now();
    let r = run_with(
        &target,
        InspectOptions {
            draft_model: Some(draft.clone()),
            ..Default::default()
        },
    );
    assert!(t.elapsed().as_secs_f64() < 1.0, "took {:?}", t.elapsed());
    assert!(errors(&r).is_empty(), "{:?}", errors(&r));
    let d = r.capabilities.draft_model.as_ref().expect("draft model");
    assert!(d.compatible && d.tokenizer_match, "{d:?}");
    assert_eq!(d.vocab_size, Some(151936));
    assert_eq!(r.modes.on.drafter, "draft-model+ngram");
    if !r.tuning.as_ref().is_some_and(|t| t.applies) {
        assert_eq!(r.modes.default.drafter, "draft-model+ngram");
    }
    let m = r.memory.as_ref().expect("memory");
    assert!(m.draft_model_bytes > 400_000_000, "{m:?}");
    // A draft model with another tokenizer is refused, naming both problems.
    let smol = common::model_path("smollm2-135m-instruct");
    let r = run_with(
        &smol,
        InspectOptions {
            draft_model: Some(draft),
            ..Default::default()
        },
    );
    assert_eq!(r.tier, Tier::Incompatible);
    let e = errors(&r).join("\n");
    assert!(
        e.contains("tokenizer.ggml.pre differs") && e.contains("vocab mismatch"),
        "{e}"
    );
    assert_eq!(r.modes.default.drafter, "ar");
}

/// Bytes this process has read through read(2) and friends (`rchar` in /proc/self/io).
fn rchar() -> u64 {
    let s = std::fs::read_to_string("/proc/self/io").expect("/proc/self/io");
    s.lines()
        .find_map(|l| l.strip_prefix("rchar: "))
        .and_then(|v| v.trim().parse().ok())
        .expect("rchar")
}

#[test]
fn inspect_reads_no_weight_bytes() {
    let _g = heavy();
    // 1. The 1.1 GB catalog file: inspect reads its header (mostly the tokenizer, ~6 MB), not
    //    the 1.1 GB of weights.
    let path = common::model_path("qwen2.5-coder-1.5b-instruct");
    let before = rchar();
    let r = run(&path);
    let read = rchar() - before;
    assert!(r.config.is_some());
    assert!(
        read < 20_000_000,
        "inspect read {read} bytes of a {} byte file",
        r.files[0].bytes
    );

    // 2. Garbage in the data region changes nothing in the report; a truncated data region is
    //    reported as such (naming the tensors) while the header is still fully reported, and
    //    loading fails.
    let dir = tmp();
    let good = dir.path().join("good.gguf");
    tiny_gguf(&good, Family::Qwen2);
    let base = run(&good);
    assert!(errors(&base).is_empty(), "{:?}", errors(&base));
    let header_end = {
        let s = inspect::gguf::scan(&good).expect("scan");
        s.data_offset as usize
    };
    let mut bytes = std::fs::read(&good).expect("read");
    for b in &mut bytes[header_end..] {
        *b = 0xFF;
    }
    let garbage = dir.path().join("garbage.gguf");
    std::fs::write(&garbage, &bytes).expect("write");
    let g = run(&garbage);
    assert_eq!(g.fingerprint, base.fingerprint);
    assert_eq!(g.parameters, base.parameters);
    assert_eq!(g.diagnostics, base.diagnostics);
    assert_eq!(g.tier, base.tier);
    assert_eq!(
        serde_json::to_value(&g.capabilities).expect("json"),
        serde_json::to_value(&base.capabilities).expect("json")
    );
    let truncated = dir.path().join("truncated.gguf");
    std::fs::write(&truncated, &bytes[..header_end + 64]).expect("write");
    let t = run(&truncated);
    assert_eq!(t.config.as_ref().map(|c| c.hidden_size), Some(64), "header still read");
    assert!(t.tokenizer.found && t.chat_template.is_some());
    assert_eq!(t.tier, Tier::Incompatible);
    assert!(
        t.errors()
            .any(|d| d.message.contains("past the end of the file") && d.file.ends_with("truncated.gguf")),
        "{:?}",
        errors(&t)
    );
    let e = bundle::load(&truncated, &Device::Cpu)
        .expect_err("truncated file loads")
        .to_string();
    assert!(
        e.contains("truncated.gguf") && e.contains("past the end of the file"),
        "{e}"
    );

    // 3. The same for safetensors: data replaced by garbage inspects identically; cut short it
    //    is reported per tensor, and loading fails naming the file and tensor.
    let hf = dir.path().join("hf");
    tiny_hf(&hf, Family::Llama);
    let base = run(&hf);
    assert!(errors(&base).is_empty(), "{:?}", errors(&base));
    let st = hf.join("model.safetensors");
    let mut bytes = std::fs::read(&st).expect("read");
    let n = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")) as usize;
    for b in &mut bytes[8 + n..] {
        *b = 0xAB;
    }
    std::fs::write(&st, &bytes).expect("write");
    let g = run(&hf);
    assert_eq!(g.fingerprint, base.fingerprint);
    assert_eq!(g.diagnostics, base.diagnostics);
    std::fs::write(&st, &bytes[..8 + n + 100]).expect("write");
    let t = run(&hf);
    assert_eq!(t.config.as_ref().map(|c| c.num_layers), Some(2));
    assert!(
        t.errors().any(|d| d.message.contains("past the end of the file")),
        "{:?}",
        errors(&t)
    );
    let e = bundle::load(&hf, &Device::Cpu)
        .expect_err("truncated loads")
        .to_string();
    assert!(
        e.contains("model.safetensors") && e.contains("past the end of the file"),
        "{e}"
    );
}

#[test]
fn kernel_prediction_matches_the_loaded_model() {
    let _g = heavy();
    let dir = tmp();
    let mut cases: Vec<PathBuf> = Vec::new();
    for (i, dt) in [
        GgmlDType::F32,
        GgmlDType::Q4_0,
        GgmlDType::Q8_0,
        GgmlDType::Q4K,
        GgmlDType::Q6K,
    ]
    .into_iter()
    .enumerate()
    {
        let p = dir.path().join(format!("t{i}.gguf"));
        write_tiny_gguf(&p, &TinySpec::with_dtype(Family::Qwen2, dt)).expect("write");
        cases.push(p);
    }
    let hf = dir.path().join("hf");
    tiny_hf(&hf, Family::Qwen3);
    cases.push(hf);
    cases.push(common::model_path("smollm2-135m-instruct"));
    cases.push(common::model_path("qwen2.5-coder-0.5b-instruct"));
    for p in cases {
        let r = run(&p);
        let predicted = r.kernels.as_ref().expect("kernels").batch_invariant;
        let loaded = bundle::load(&p, &Device::Cpu).expect("load").model.batch_invariant();
        assert_eq!(predicted, loaded, "{}: {:?}", p.display(), r.kernels);
        let expect_tier = if predicted { r.tier } else { Tier::ArOnly };
        assert_eq!(r.tier, expect_tier);
        if !predicted {
            assert_eq!(r.modes.default.drafter, "ar");
            assert_eq!(r.modes.on.drafter, "ar");
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Drafters.

fn mtp_deepseek(layer: usize) -> Vec<(String, Vec<usize>)> {
    let p = format!("model.layers.{layer}");
    let mut v = vec![
        (format!("{p}.enorm.weight"), vec![64]),
        (format!("{p}.hnorm.weight"), vec![64]),
        (format!("{p}.eh_proj.weight"), vec![64, 128]),
        (format!("{p}.shared_head.norm.weight"), vec![64]),
        (format!("{p}.shared_head.head.weight"), vec![TINY_VOCAB, 64]),
    ];
    v.extend(hf_block(&p));
    v
}

fn mtp_qwen3_next() -> Vec<(String, Vec<usize>)> {
    let mut v = vec![
        ("mtp.fc.weight".to_string(), vec![64, 128]),
        ("mtp.pre_fc_norm_embedding.weight".to_string(), vec![64]),
        ("mtp.pre_fc_norm_hidden.weight".to_string(), vec![64]),
        ("mtp.norm.weight".to_string(), vec![64]),
    ];
    v.extend(hf_block("mtp.layers.0"));
    v
}

#[test]
fn mtp_head_deepseek_layout_in_the_trunk() {
    let _g = heavy();
    let dir = tmp();
    tiny_hf(dir.path(), Family::Qwen3);
    add_hf_tensors(dir.path(), &mtp_deepseek(2));
    edit_json(&dir.path().join("config.json"), |c| {
        c["num_nextn_predict_layers"] = 1.into()
    });
    let r = run(dir.path());
    let m = &r.capabilities.mtp;
    assert_eq!(m.status, MtpStatus::Present, "{:?}", r.diagnostics);
    assert_eq!(m.layout.as_deref(), Some("deepseek-v3"));
    assert_eq!(m.location.as_deref(), Some("trunk"));
    assert_eq!((m.declared, m.depth, m.layer_ids.clone()), (Some(1), 1, vec![2]));
    assert_eq!(m.tensors, 14);
    assert!(m
        .marker
        .as_deref()
        .is_some_and(|s| s.contains("num_nextn_predict_layers")));
    assert!(errors(&r).is_empty(), "{:?}", errors(&r));
    assert!(r.to_string().contains("present: deepseek-v3 layout"));
    // The trunk still loads (MTP tensors are extra).
    bundle::load(dir.path(), &Device::Cpu).expect("load");
}

#[test]
fn mtp_head_qwen3_next_layout_with_marker_in_text_config() {
    let _g = heavy();
    let dir = tmp();
    tiny_hf(dir.path(), Family::Qwen3);
    add_hf_tensors(dir.path(), &mtp_qwen3_next());
    edit_json(&dir.path().join("config.json"), |c| {
        let inner = c.clone();
        *c = serde_json::json!({"model_type": "qwen3", "text_config": inner});
        c["text_config"]["mtp_num_hidden_layers"] = 1.into();
    });
    let r = run(dir.path());
    let m = &r.capabilities.mtp;
    assert_eq!(m.status, MtpStatus::Present, "{:?}", r.diagnostics);
    assert_eq!(m.layout.as_deref(), Some("qwen3-next"));
    assert_eq!((m.declared, m.depth, m.tensors), (Some(1), 1, 13));
    assert!(m
        .marker
        .as_deref()
        .is_some_and(|s| s.contains("text_config.mtp_num_hidden_layers")));
    assert!(errors(&r).is_empty(), "{:?}", errors(&r));
}

#[test]
fn mtp_head_in_a_sidecar_and_gguf_nextn() {
    let _g = heavy();
    // Sidecar folder next to an HF trunk.
    let dir = tmp();
    tiny_hf(dir.path(), Family::Llama);
    std::fs::create_dir(dir.path().join("mtp")).expect("mkdir");
    save_st(&dir.path().join("mtp/model.safetensors"), &mtp_qwen3_next());
    std::fs::write(dir.path().join("mtp/config.json"), r#"{"mtp_num_hidden_layers": 1}"#).expect("write");
    let r = run(dir.path());
    let m = &r.capabilities.mtp;
    assert_eq!(m.status, MtpStatus::Present, "{:?}", r.diagnostics);
    assert!(m.location.as_deref().is_some_and(|l| l.ends_with("mtp")), "{m:?}");

    // A sidecar file beside a GGUF file, given by path.
    let g = dir.path().join("t.gguf");
    tiny_gguf(&g, Family::Llama);
    let side = dir.path().join("head.safetensors");
    save_st(&side, &mtp_deepseek(2));
    let r = run_with(
        &g,
        InspectOptions {
            drafter: Some(side.clone()),
            ..Default::default()
        },
    );
    let m = &r.capabilities.mtp;
    assert_eq!(m.status, MtpStatus::Present, "{:?}", r.diagnostics);
    assert_eq!(m.location.as_deref(), Some(side.display().to_string().as_str()));

    // llama.cpp's GGUF layout: blk.{n}.nextn.* on the last `nextn_predict_layers` blocks.
    let src = dir.path().join("src.gguf");
    tiny_gguf_q8(&src, Family::Qwen2);
    let dst = dir.path().join("nextn.gguf");
    rewrite_gguf(&src, &dst, &mut |md, ts| {
        set_md(md, "qwen2.block_count", gguf_file::Value::U32(3));
        set_md(md, "qwen2.nextn_predict_layers", gguf_file::Value::U32(1));
        let copy: Vec<(String, QTensor)> = ts
            .iter()
            .filter(|(n, _)| n.starts_with("blk.1."))
            .map(|(n, t)| {
                let q = QTensor::quantize(&zeros(t.shape().dims()), t.dtype()).expect("quantize");
                (n.replacen("blk.1.", "blk.2.", 1), q)
            })
            .collect();
        ts.extend(copy);
        for (n, d) in [
            ("enorm", vec![64]),
            ("hnorm", vec![64]),
            ("eh_proj", vec![64, 128]),
            ("shared_head_norm", vec![64]),
        ] {
            ts.push((format!("blk.2.nextn.{n}.weight"), qzeros(&d)));
        }
    });
    let r = run(&dst);
    let m = &r.capabilities.mtp;
    assert_eq!(m.status, MtpStatus::Present, "{:?}", r.diagnostics);
    assert_eq!(
        (m.layout.as_deref(), m.layer_ids.clone()),
        (Some("deepseek-v3"), vec![2])
    );
    assert!(m
        .marker
        .as_deref()
        .is_some_and(|s| s.contains("qwen2.nextn_predict_layers = 1")));
    // Reported, but serve loads MTP heads from sidecars only: the modes fall through to the
    // next drafter and say so.
    assert!(r.kernels.as_ref().is_some_and(|k| k.batch_invariant), "{:?}", r.kernels);
    assert_eq!(r.modes.on.drafter, "ngram");
    assert!(
        r.modes.on.reason.contains("MTP head is in the trunk"),
        "{:?}",
        r.modes.on
    );
}

/// A sidecar MTP head (or a block drafter) that `inspect` found but serve could not attach (its
/// load failed, or the device leaves native drafters out) stops being a capability: the report
/// says why in a warning, and the modes fall back to the next drafter, as the engine does.
#[test]
fn a_drafter_found_but_not_attached_leaves_the_modes() {
    let _g = heavy();
    let dir = tmp();
    let g = dir.path().join("t.gguf");
    tiny_gguf_q8(&g, Family::Llama);
    let side = dir.path().join("head.safetensors");
    save_st(&side, &mtp_deepseek(2));
    write_block_drafter(&dir.path().join("drafter"));
    let mut r = run_with(
        &g,
        InspectOptions {
            drafter: Some(side.clone()),
            ..Default::default()
        },
    );
    assert_eq!(r.capabilities.mtp.status, MtpStatus::Present, "{:?}", r.diagnostics);
    assert_eq!(
        (r.modes.on.drafter.as_str(), r.modes.default.drafter.as_str()),
        ("mtp+ngram", "mtp+ngram")
    );
    let before = r.diagnostics.len();

    // Nothing left out: nothing changes.
    assert!(!r.not_attached(None, None));
    assert_eq!(r.diagnostics.len(), before);
    assert_eq!(r.modes.on.drafter, "mtp+ngram");

    let why = "the device leaves native drafters out";
    assert!(r.not_attached(Some(why), None));
    assert_eq!(r.capabilities.mtp.status, MtpStatus::NotLoaded);
    let warned: Vec<_> = r
        .diagnostics
        .iter()
        .filter(|d| d.component == Component::Mtp && d.severity == Severity::Warning && d.message.contains(why))
        .collect();
    assert_eq!(warned.len(), 1, "{:?}", r.diagnostics);
    assert_eq!(warned[0].file, side.display().to_string());
    for m in [&r.modes.on, &r.modes.default] {
        assert_eq!(m.drafter, "ngram", "{m:?}");
        assert!(!m.reason.contains("MTP"), "{m:?}");
    }
    // Said once: a second call finds nothing more to drop.
    assert!(!r.not_attached(Some(why), None));
    assert_eq!(r.diagnostics.len(), before + 1);

    // A block drafter the report found valid, then left out by serve.
    let mut r = run_with(
        &g,
        InspectOptions {
            drafter: Some(dir.path().join("drafter")),
            ..Default::default()
        },
    );
    assert!(
        r.capabilities.block_drafter.as_ref().is_some_and(|b| b.valid),
        "{:?}",
        r.diagnostics
    );
    assert_eq!(r.modes.on.drafter, "block+ngram");
    assert!(r.not_attached(None, Some("its load failed")));
    assert!(r.capabilities.block_drafter.as_ref().is_some_and(|b| !b.valid));
    assert!(r
        .diagnostics
        .iter()
        .any(|d| d.component == Component::Drafter && d.message.contains("its load failed")));
    assert_eq!(r.modes.on.drafter, "ngram", "{:?}", r.modes.on);
}

#[test]
fn mtp_markers_without_tensors_are_declared_but_absent() {
    let _g = heavy();
    let dir = tmp();
    tiny_hf(dir.path(), Family::Qwen3);
    edit_json(&dir.path().join("config.json"), |c| {
        c["num_nextn_predict_layers"] = 2.into()
    });
    let r = run(dir.path());
    assert_eq!(r.capabilities.mtp.status, MtpStatus::DeclaredButAbsent);
    assert_eq!(r.capabilities.mtp.declared, Some(2));
    let w = r
        .diagnostics
        .iter()
        .find(|d| d.component == Component::Mtp)
        .expect("a diagnostic");
    assert_eq!(w.severity, Severity::Warning);
    assert!(
        w.file.ends_with("config.json") && w.subject == "num_nextn_predict_layers",
        "{w}"
    );
    assert!(w.message.contains("declared but absent"), "{w}");
    // Not a capability: on/default are n-gram, the tier is unaffected.
    assert_eq!(r.modes.on.drafter, "ar"); // f32 HF weights: not batch-invariant
    assert_eq!(r.tier, Tier::ArOnly);
    assert!(r.to_string().contains("declared but absent"));
    // The same on a GGUF file whose metadata declares nextn layers.
    let g = dir.path().join("x.gguf");
    let src = dir.path().join("src.gguf");
    tiny_gguf(&src, Family::Llama);
    rewrite_gguf(&src, &g, &mut |md, _| {
        set_md(md, "llama.nextn_predict_layers", gguf_file::Value::U32(1));
    });
    let r = run(&g);
    assert_eq!(r.capabilities.mtp.status, MtpStatus::DeclaredButAbsent);
}

/// A valid block drafter for the tiny target (hidden 64, 2 layers, vocab 262).
fn write_block_drafter(dir: &Path) {
    std::fs::create_dir_all(dir).expect("mkdir");
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_string_pretty(&serde_json::json!({
            "architectures": ["DFlashDraftModel"],
            "block_size": 4,
            "hidden_size": 64,
            "num_hidden_layers": 1,
            "vocab_size": TINY_VOCAB,
            "dflash_config": {"target_layer_ids": [0, 1], "mask_token_id": 261},
        }))
        .expect("json"),
    )
    .expect("write");
    let mut t = vec![
        ("fc.weight".to_string(), vec![64, 128]),
        ("hidden_norm.weight".to_string(), vec![64]),
        ("norm.weight".to_string(), vec![64]),
    ];
    t.extend(hf_block("layers.0"));
    save_st(&dir.join("model.safetensors"), &t);
}

#[test]
fn block_drafter_folder_is_found_and_validated() {
    let _g = heavy();
    let dir = tmp();
    tiny_hf(dir.path(), Family::Qwen3);
    write_block_drafter(&dir.path().join("drafter"));
    let r = run(dir.path());
    let b = r.capabilities.block_drafter.as_ref().expect("block drafter");
    assert!(b.valid, "{:?}", r.diagnostics);
    assert_eq!(b.block_size, Some(4));
    assert_eq!(b.target_layer_ids, vec![0, 1]);
    assert_eq!(
        (b.hidden_size, b.vocab_size, b.layers, b.mask_token_id),
        (Some(64), Some(TINY_VOCAB), Some(1), Some(261))
    );
    assert_eq!(b.tensors, 12);
    assert!(errors(&r).is_empty(), "{:?}", errors(&r));

    // In a directory holding one GGUF file, and as a sidecar given by path.
    let gdir = tmp();
    tiny_gguf_q8(&gdir.path().join("m.gguf"), Family::Llama);
    write_block_drafter(&gdir.path().join("drafter"));
    let r = run(gdir.path());
    assert!(
        r.capabilities.block_drafter.as_ref().is_some_and(|b| b.valid),
        "{:?}",
        r.diagnostics
    );
    let side = tmp();
    write_block_drafter(&side.path().join("dflash"));
    let r = run_with(
        &gdir.path().join("m.gguf"),
        InspectOptions {
            drafter: Some(side.path().join("dflash")),
            ..Default::default()
        },
    );
    let b = r.capabilities.block_drafter.as_ref().expect("sidecar drafter");
    assert!(b.valid && b.path.ends_with("dflash"), "{b:?}");
    // Default and on draft with it (no MTP head to prefer), k = block_size - 1.
    assert_eq!(r.modes.default.drafter, "block+ngram");
    assert_eq!(r.modes.on.drafter, "block+ngram");
    assert!(
        r.modes.default.reason.contains("block drafter"),
        "{:?}",
        r.modes.default
    );
}

#[test]
fn draft_model_checked_from_metadata() {
    let _g = heavy();
    let dir = tmp();
    let t = dir.path().join("t.gguf");
    let d = dir.path().join("d.gguf");
    write_tiny_gguf(&t, &TinySpec::with_dtype(Family::Qwen2, GgmlDType::Q8_0)).expect("write");
    write_tiny_gguf(
        &d,
        &TinySpec {
            layers: 1,
            seed: 7,
            ..TinySpec::with_dtype(Family::Qwen2, GgmlDType::Q8_0)
        },
    )
    .expect("write");
    let r = run_with(
        &t,
        InspectOptions {
            draft_model: Some(d.clone()),
            ..Default::default()
        },
    );
    let dm = r.capabilities.draft_model.as_ref().expect("draft");
    assert!(dm.compatible && dm.tokenizer_match, "{:?}", r.diagnostics);
    assert_eq!(r.modes.on.drafter, "draft-model+ngram");
    assert_eq!(r.tier, Tier::CompatibleUnmeasured);
    // An HF draft for a GGUF target: compared through the tokenizers themselves.
    let hf = dir.path().join("hf");
    tiny_hf(&hf, Family::Qwen2);
    let r = run_with(
        &t,
        InspectOptions {
            draft_model: Some(hf),
            ..Default::default()
        },
    );
    assert!(
        r.capabilities.draft_model.as_ref().is_some_and(|d| d.tokenizer_match),
        "{:?}",
        r.diagnostics
    );
    // Another tokenizer (one token renamed): refused, naming the token id.
    let other = dir.path().join("o.gguf");
    rewrite_gguf(&d, &other, &mut |md, _| {
        if let Some((_, gguf_file::Value::Array(a))) = md.iter_mut().find(|(k, _)| k == "tokenizer.ggml.tokens") {
            a[100] = gguf_file::Value::String("renamed".into());
        }
    });
    let r = run_with(
        &t,
        InspectOptions {
            draft_model: Some(other),
            ..Default::default()
        },
    );
    assert_eq!(r.tier, Tier::Incompatible);
    let e = errors(&r).join("\n");
    assert!(e.contains("o.gguf") && e.contains("tokenizer.ggml.tokens[100]"), "{e}");
}

// ---------------------------------------------------------------------------------------------
// The malformed corpus.

/// One malformed bundle: how to make it, what inspect must say (file suffix, subject, message
/// part), and, when loading applies, what the load error must contain.
struct Case {
    name: &'static str,
    make: fn(&Path) -> PathBuf,
    file: &'static str,
    subject: &'static str,
    message: &'static str,
    severity: Severity,
    /// Substrings of the load error (`None`: loading the target is not affected).
    load: Option<&'static [&'static str]>,
}

fn hf_bundle(root: &Path) -> PathBuf {
    let d = root.join("hf");
    tiny_hf(&d, Family::Qwen2);
    d
}

fn gguf_bundle(root: &Path) -> PathBuf {
    let p = root.join("m.gguf");
    tiny_gguf(&p, Family::Llama);
    p
}

/// Write a safetensors file with a handmade header.
fn raw_safetensors(path: &Path, header: &str, data_len: usize) {
    let mut f = std::fs::File::create(path).expect("create");
    f.write_all(&(header.len() as u64).to_le_bytes()).expect("write");
    f.write_all(header.as_bytes()).expect("write");
    f.write_all(&vec![0u8; data_len]).expect("write");
}

/// Replace `model.safetensors` of an HF bundle by one whose header is `edit`ed JSON.
fn edit_st_header(dir: &Path, edit: impl FnOnce(&str) -> String) {
    let p = dir.join("model.safetensors");
    let bytes = std::fs::read(&p).expect("read");
    let n = u64::from_le_bytes(bytes[..8].try_into().expect("8")) as usize;
    let header = std::str::from_utf8(&bytes[8..8 + n]).expect("utf8");
    let new = edit(header.trim_end());
    let mut out = (new.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(new.as_bytes());
    out.extend_from_slice(&bytes[8 + n..]);
    std::fs::write(&p, out).expect("write");
}

fn corpus() -> Vec<Case> {
    vec![
        Case {
            name: "missing config.json",
            make: |r| {
                let d = hf_bundle(r);
                std::fs::remove_file(d.join("config.json")).expect("rm");
                d
            },
            file: "config.json",
            subject: "",
            message: "missing config.json",
            severity: Severity::Error,
            load: Some(&["hf", "config.json"]),
        },
        Case {
            name: "config.json is not JSON",
            make: |r| {
                let d = hf_bundle(r);
                std::fs::write(d.join("config.json"), "{\"model_type\": \"qwen2\",, }").expect("write");
                d
            },
            file: "config.json",
            subject: "",
            message: "invalid JSON",
            severity: Severity::Error,
            load: Some(&["config.json", "invalid JSON"]),
        },
        Case {
            name: "unknown architecture",
            make: |r| {
                let d = hf_bundle(r);
                edit_json(&d.join("config.json"), |c| c["model_type"] = "gpt_neox".into());
                d
            },
            file: "config.json",
            subject: "model_type",
            message: "'gpt_neox' is not supported",
            severity: Severity::Error,
            load: Some(&["config.json", "model_type", "gpt_neox"]),
        },
        Case {
            name: "missing hidden_size",
            make: |r| {
                let d = hf_bundle(r);
                edit_json(&d.join("config.json"), |c| {
                    c.as_object_mut().expect("object").remove("hidden_size");
                });
                d
            },
            file: "config.json",
            subject: "hidden_size",
            message: "missing",
            severity: Severity::Error,
            load: Some(&["config.json", "hidden_size"]),
        },
        Case {
            name: "vocab mismatch between config and embedding",
            make: |r| {
                let d = hf_bundle(r);
                edit_json(&d.join("config.json"), |c| c["vocab_size"] = 300.into());
                d
            },
            file: "model.safetensors",
            subject: "model.embed_tokens.weight",
            message: "expected [300, 64]",
            severity: Severity::Error,
            load: Some(&["model.safetensors", "model.embed_tokens.weight", "expected [300, 64]"]),
        },
        Case {
            name: "tokenizer larger than the embedding",
            make: |r| {
                let d = hf_bundle(r);
                edit_json(&d.join("config.json"), |c| c["vocab_size"] = 200.into());
                let p = d.join("model.safetensors");
                let mut m: HashMap<String, Tensor> = candle_core::safetensors::load(&p, &Device::Cpu).expect("load");
                m.insert("model.embed_tokens.weight".into(), zeros(&[200, 64]));
                m.insert("lm_head.weight".into(), zeros(&[200, 64]));
                candle_core::safetensors::save(&m, &p).expect("save");
                d
            },
            file: "tokenizer.json",
            subject: "vocab",
            message: "vocab mismatch",
            severity: Severity::Error,
            load: Some(&["tokenizer.json", "vocab mismatch"]),
        },
        Case {
            name: "missing tokenizer",
            make: |r| {
                let d = hf_bundle(r);
                std::fs::remove_file(d.join("tokenizer.json")).expect("rm");
                d
            },
            file: "tokenizer.json",
            subject: "",
            message: "missing tokenizer.json",
            severity: Severity::Error,
            load: Some(&["tokenizer.json", "missing"]),
        },
        Case {
            name: "truncated safetensors header",
            make: |r| {
                let d = hf_bundle(r);
                let p = d.join("model.safetensors");
                let bytes = std::fs::read(&p).expect("read");
                std::fs::write(&p, &bytes[..40]).expect("write");
                d
            },
            file: "model.safetensors",
            subject: "header",
            message: "truncated header",
            severity: Severity::Error,
            load: Some(&["model.safetensors", "truncated header"]),
        },
        Case {
            name: "safetensors offsets past the end of the file",
            make: |r| {
                let d = hf_bundle(r);
                edit_st_header(&d, |h| {
                    let mut v: serde_json::Value = serde_json::from_str(h).expect("json");
                    let t = &mut v["model.norm.weight"]["data_offsets"];
                    let b = t[0].as_u64().expect("u64");
                    *t = serde_json::json!([b + 10_000_000, b + 10_000_256]);
                    v.to_string()
                });
                d
            },
            file: "model.safetensors",
            subject: "model.norm.weight",
            message: "past the end of the file",
            severity: Severity::Error,
            load: Some(&["model.safetensors", "model.norm.weight", "past the end of the file"]),
        },
        Case {
            name: "duplicate tensor in a safetensors header",
            make: |r| {
                let d = hf_bundle(r);
                edit_st_header(&d, |h| {
                    let v: serde_json::Value = serde_json::from_str(h).expect("json");
                    let entry = v["model.norm.weight"].to_string();
                    let body = h.trim_end().strip_suffix('}').expect("a JSON object");
                    format!("{body},\"model.norm.weight\":{entry}}}")
                });
                d
            },
            file: "model.safetensors",
            subject: "model.norm.weight",
            message: "duplicate tensor",
            severity: Severity::Error,
            load: Some(&["model.safetensors", "model.norm.weight", "duplicate"]),
        },
        Case {
            name: "unknown safetensors dtype",
            make: |r| {
                let d = hf_bundle(r);
                edit_st_header(&d, |h| {
                    let mut v: serde_json::Value = serde_json::from_str(h).expect("json");
                    v["model.norm.weight"]["dtype"] = "Q9".into();
                    v.to_string()
                });
                d
            },
            file: "model.safetensors",
            subject: "model.norm.weight",
            message: "unknown dtype 'Q9'",
            severity: Severity::Error,
            load: Some(&["model.safetensors", "model.norm.weight", "Q9"]),
        },
        Case {
            name: "a dtype the loader cannot use",
            make: |r| {
                let d = hf_bundle(r);
                edit_st_header(&d, |h| {
                    let mut v: serde_json::Value = serde_json::from_str(h).expect("json");
                    v["model.norm.weight"]["dtype"] = "U32".into();
                    v.to_string()
                });
                d
            },
            file: "model.safetensors",
            subject: "model.norm.weight",
            message: "dtype U32 (f32, f16 or bf16 expected)",
            severity: Severity::Error,
            load: Some(&["model.safetensors", "model.norm.weight", "U32"]),
        },
        Case {
            name: "sharded index naming a missing shard",
            make: |r| {
                let d = hf_bundle(r);
                let p = d.join("model.safetensors");
                std::fs::rename(&p, d.join("model-00001-of-00002.safetensors")).expect("mv");
                let st = inspect::safetensors::scan(&d.join("model-00001-of-00002.safetensors")).expect("scan");
                let mut map = serde_json::Map::new();
                for t in &st.tensors {
                    map.insert(t.name.clone(), "model-00001-of-00002.safetensors".into());
                }
                map.insert("lm_head.weight".into(), "model-00002-of-00002.safetensors".into());
                let idx = serde_json::json!({"metadata": {}, "weight_map": map});
                std::fs::write(d.join("model.safetensors.index.json"), idx.to_string()).expect("write");
                d
            },
            file: "model.safetensors.index.json",
            subject: "weight_map.lm_head.weight",
            message: "names shard 'model-00002-of-00002.safetensors', which does not exist",
            severity: Severity::Error,
            load: Some(&["model.safetensors.index.json", "model-00002-of-00002.safetensors"]),
        },
        Case {
            name: "missing tensor",
            make: |r| {
                let d = hf_bundle(r);
                let p = d.join("model.safetensors");
                let mut m: HashMap<String, Tensor> = candle_core::safetensors::load(&p, &Device::Cpu).expect("load");
                m.remove("model.layers.1.mlp.down_proj.weight");
                candle_core::safetensors::save(&m, &p).expect("save");
                d
            },
            file: "model.safetensors",
            subject: "model.layers.1.mlp.down_proj.weight",
            message: "missing tensor",
            severity: Severity::Error,
            load: Some(&["model.layers.1.mlp.down_proj.weight", "missing tensor"]),
        },
        Case {
            name: "GGUF duplicate tensor",
            make: |r| {
                let src = gguf_bundle(r);
                let dst = r.join("dup.gguf");
                rewrite_gguf(&src, &dst, &mut |_, ts| {
                    ts.push(("output_norm.weight".into(), qzeros(&[64])));
                });
                dst
            },
            file: "dup.gguf",
            subject: "output_norm.weight",
            message: "duplicate tensor",
            severity: Severity::Error,
            load: Some(&["dup.gguf", "output_norm.weight", "duplicate"]),
        },
        Case {
            name: "GGUF unknown tensor type",
            make: |r| {
                let src = gguf_bundle(r);
                let dst = r.join("badtype.gguf");
                let mut bytes = std::fs::read(&src).expect("read");
                // Patch the type of `output_norm.weight` in the tensor directory: the u32 after
                // its name, dimension count and dimensions.
                let name = b"output_norm.weight";
                let at = bytes.windows(name.len()).rposition(|w| w == name).expect("name");
                let ty = at + name.len() + 4 + 8;
                bytes[ty..ty + 4].copy_from_slice(&99u32.to_le_bytes());
                std::fs::write(&dst, bytes).expect("write");
                dst
            },
            file: "badtype.gguf",
            subject: "output_norm.weight",
            message: "tensor type 99",
            severity: Severity::Error,
            load: Some(&["badtype.gguf", "output_norm.weight", "type 99"]),
        },
        Case {
            name: "GGUF misaligned tensor offset",
            make: |r| {
                let src = gguf_bundle(r);
                let dst = r.join("misaligned.gguf");
                let mut bytes = std::fs::read(&src).expect("read");
                // The u64 offset of `output_norm.weight` (1-D): after its name, dimension count,
                // dimension and type; moved by 4 bytes, off the 32-byte alignment.
                let name = b"output_norm.weight";
                let at = bytes.windows(name.len()).rposition(|w| w == name).expect("name");
                let off = at + name.len() + 4 + 8 + 4;
                let old = u64::from_le_bytes(bytes[off..off + 8].try_into().expect("8 bytes"));
                bytes[off..off + 8].copy_from_slice(&(old + 4).to_le_bytes());
                std::fs::write(&dst, bytes).expect("write");
                dst
            },
            file: "misaligned.gguf",
            subject: "output_norm.weight",
            message: "not a multiple of the alignment 32",
            severity: Severity::Error,
            load: Some(&["misaligned.gguf", "output_norm.weight", "alignment"]),
        },
        Case {
            name: "GGUF absurd block count",
            make: |r| {
                let src = gguf_bundle(r);
                let dst = r.join("layers.gguf");
                rewrite_gguf(&src, &dst, &mut |md, _| {
                    set_md(md, "llama.block_count", gguf_file::Value::U64(1 << 40));
                });
                dst
            },
            file: "layers.gguf",
            subject: "llama.block_count",
            message: "1099511627776 layers",
            severity: Severity::Error,
            load: Some(&["llama.block_count", "1099511627776 layers", "blk.1099511627775."]),
        },
        Case {
            name: "GGUF block count short of the file's layers",
            make: |r| {
                let src = gguf_bundle(r);
                let dst = r.join("short.gguf");
                rewrite_gguf(&src, &dst, &mut |md, _| {
                    set_md(md, "llama.block_count", gguf_file::Value::U32(1));
                });
                dst
            },
            file: "short.gguf",
            subject: "llama.block_count",
            message: "also holds 'blk.1.",
            severity: Severity::Error,
            load: Some(&["llama.block_count", "1 layers", "blk.1."]),
        },
        Case {
            name: "HF absurd num_hidden_layers",
            make: |r| {
                let d = hf_bundle(r);
                edit_json(&d.join("config.json"), |c| c["num_hidden_layers"] = (1u64 << 40).into());
                d
            },
            file: "config.json",
            subject: "num_hidden_layers",
            message: "1099511627776 layers",
            severity: Severity::Error,
            load: Some(&["num_hidden_layers", "1099511627776 layers"]),
        },
        Case {
            name: "GGUF truncated header",
            make: |r| {
                let src = gguf_bundle(r);
                let dst = r.join("cut.gguf");
                let bytes = std::fs::read(&src).expect("read");
                std::fs::write(&dst, &bytes[..2000]).expect("write");
                dst
            },
            file: "cut.gguf",
            subject: "header",
            message: "truncated header",
            severity: Severity::Error,
            load: Some(&["cut.gguf", "truncated header"]),
        },
        Case {
            name: "GGUF alignment 0 (a division by zero in candle's reader)",
            make: |r| {
                let src = gguf_bundle(r);
                let dst = r.join("align.gguf");
                rewrite_gguf(&src, &dst, &mut |md, _| {
                    set_md(md, "general.alignment", gguf_file::Value::U32(0))
                });
                dst
            },
            file: "align.gguf",
            subject: "header",
            message: "general.alignment",
            severity: Severity::Error,
            load: Some(&["align.gguf", "general.alignment"]),
        },
        Case {
            name: "GGUF unknown architecture",
            make: |r| {
                let src = gguf_bundle(r);
                let dst = r.join("arch.gguf");
                rewrite_gguf(&src, &dst, &mut |md, _| {
                    set_md(md, "general.architecture", gguf_file::Value::String("mamba9".into()))
                });
                dst
            },
            file: "arch.gguf",
            subject: "general.architecture",
            message: "'mamba9' is not supported",
            severity: Severity::Error,
            load: Some(&["arch.gguf", "general.architecture", "mamba9"]),
        },
        Case {
            name: "GGUF without a tokenizer",
            make: |r| {
                let src = gguf_bundle(r);
                let dst = r.join("notok.gguf");
                rewrite_gguf(&src, &dst, &mut |md, _| {
                    md.retain(|(k, _)| !k.starts_with("tokenizer."))
                });
                dst
            },
            file: "notok.gguf",
            subject: "tokenizer.ggml.model",
            message: "no tokenizer",
            severity: Severity::Error,
            load: Some(&["notok.gguf", "tokenizer.ggml.model"]),
        },
        Case {
            name: "GGUF wrong hidden size in metadata",
            make: |r| {
                let src = gguf_bundle(r);
                let dst = r.join("hidden.gguf");
                rewrite_gguf(&src, &dst, &mut |md, _| {
                    set_md(md, "llama.embedding_length", gguf_file::Value::U32(96))
                });
                dst
            },
            file: "hidden.gguf",
            subject: "token_embd.weight",
            message: "expected [262, 96]",
            severity: Severity::Error,
            load: Some(&["hidden.gguf", "token_embd.weight", "expected [262, 96]"]),
        },
        Case {
            name: "drafter with the wrong hidden size",
            make: |r| {
                let d = hf_bundle(r);
                write_block_drafter(&d.join("drafter"));
                edit_json(&d.join("drafter/config.json"), |c| c["hidden_size"] = 96.into());
                d
            },
            file: "drafter/config.json",
            subject: "hidden_size",
            message: "the target's hidden size is 64",
            severity: Severity::Error,
            load: None,
        },
        Case {
            name: "drafter fc.weight of the wrong shape",
            make: |r| {
                let d = hf_bundle(r);
                write_block_drafter(&d.join("drafter"));
                edit_json(&d.join("drafter/config.json"), |c| {
                    c["dflash_config"]["target_layer_ids"] = serde_json::json!([1])
                });
                d
            },
            file: "drafter/model.safetensors",
            subject: "fc.weight",
            message: "expected [64, 64]",
            severity: Severity::Error,
            load: None,
        },
        Case {
            name: "drafter target layer out of range, vocab mismatch",
            make: |r| {
                let d = hf_bundle(r);
                write_block_drafter(&d.join("drafter"));
                edit_json(&d.join("drafter/config.json"), |c| {
                    c["dflash_config"]["target_layer_ids"] = serde_json::json!([0, 5]);
                });
                d
            },
            file: "drafter/config.json",
            subject: "target_layer_ids[1]",
            message: "the target has 2 layers",
            severity: Severity::Error,
            load: None,
        },
        Case {
            name: "drafter vocab mismatch",
            make: |r| {
                let d = hf_bundle(r);
                write_block_drafter(&d.join("drafter"));
                edit_json(&d.join("drafter/config.json"), |c| c["vocab_size"] = 32000.into());
                d
            },
            file: "drafter/config.json",
            subject: "vocab_size",
            message: "vocab mismatch",
            severity: Severity::Error,
            load: None,
        },
        Case {
            name: "drafter without config.json",
            make: |r| {
                let d = hf_bundle(r);
                write_block_drafter(&d.join("drafter"));
                std::fs::remove_file(d.join("drafter/config.json")).expect("rm");
                d
            },
            file: "drafter/config.json",
            subject: "",
            message: "needs config.json",
            severity: Severity::Error,
            load: None,
        },
        Case {
            name: "MTP markers without tensors",
            make: |r| {
                let d = hf_bundle(r);
                edit_json(&d.join("config.json"), |c| c["mtp_num_hidden_layers"] = 1.into());
                d
            },
            file: "config.json",
            subject: "mtp_num_hidden_layers",
            message: "declared but absent",
            severity: Severity::Warning,
            load: None,
        },
        Case {
            name: "MTP eh_proj of the wrong shape",
            make: |r| {
                let d = hf_bundle(r);
                let mut t = mtp_deepseek(2);
                t[2].1 = vec![64, 64];
                add_hf_tensors(&d, &t);
                d
            },
            file: "model.safetensors",
            subject: "model.layers.2.eh_proj.weight",
            message: "expected [64, 128]",
            severity: Severity::Error,
            load: None,
        },
        Case {
            name: "MTP declared deeper than its tensors",
            make: |r| {
                let d = hf_bundle(r);
                add_hf_tensors(&d, &mtp_deepseek(2));
                edit_json(&d.join("config.json"), |c| c["num_nextn_predict_layers"] = 2.into());
                d
            },
            file: "model.safetensors",
            subject: "model.layers.3",
            message: "declares 2 MTP layer(s)",
            severity: Severity::Error,
            load: None,
        },
    ]
}

#[test]
fn malformed_corpus_gives_clear_diagnostics_and_load_errors() {
    let _g = heavy();
    let cases = corpus();
    assert!(cases.len() >= 12);
    let mut failures = Vec::new();
    for c in &cases {
        let dir = tmp();
        let path = (c.make)(dir.path());
        let outcome = std::panic::catch_unwind(|| inspect::inspect(&path, &InspectOptions::default()));
        let report = match outcome {
            Err(_) => {
                failures.push(format!("{}: inspect panicked", c.name));
                continue;
            }
            Ok(Err(e)) => {
                failures.push(format!("{}: inspect failed instead of reporting: {e:#}", c.name));
                continue;
            }
            Ok(Ok(r)) => r,
        };
        let hit = report.diagnostics.iter().find(|d| {
            d.severity == c.severity
                && d.file.ends_with(c.file)
                && (c.subject.is_empty() || d.subject == c.subject)
                && d.message.contains(c.message)
        });
        if hit.is_none() {
            failures.push(format!(
                "{}: no {:?} diagnostic for {} / {} / '{}'; got:\n    {}",
                c.name,
                c.severity,
                c.file,
                c.subject,
                c.message,
                report
                    .diagnostics
                    .iter()
                    .map(|d| d.to_string())
                    .collect::<Vec<_>>()
                    .join("\n    ")
            ));
        }
        if c.severity == Severity::Error && c.load.is_some() && report.tier != Tier::Incompatible {
            failures.push(format!("{}: tier {:?}, expected incompatible", c.name, report.tier));
        }
        // The text rendering lists it too.
        if hit.is_some() && !report.to_string().contains(c.message) {
            failures.push(format!("{}: the text report does not show the diagnostic", c.name));
        }
        let load = std::panic::catch_unwind(|| bundle::load(&path, &Device::Cpu).map(|_| ()));
        match (load, c.load) {
            (Err(_), _) => failures.push(format!("{}: loading panicked", c.name)),
            (Ok(Ok(())), Some(_)) => failures.push(format!("{}: loaded", c.name)),
            (Ok(Err(e)), Some(parts)) => {
                let msg = format!("{e:#}");
                for p in parts {
                    if !msg.contains(p) {
                        failures.push(format!("{}: load error lacks '{p}': {msg}", c.name));
                    }
                }
            }
            (Ok(Err(e)), None) => failures.push(format!("{}: the target should load: {e:#}", c.name)),
            (Ok(Ok(())), None) => {}
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} cases:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}

#[test]
fn not_a_bundle_is_an_error_naming_the_path() {
    let _g = heavy();
    let dir = tmp();
    let e = inspect::inspect(&dir.path().join("nope"), &InspectOptions::default()).expect_err("missing");
    assert!(e.to_string().contains("no such file"), "{e}");
    let junk = dir.path().join("junk.bin");
    std::fs::File::create(&junk)
        .and_then(|mut f| f.write_all(b"not a model"))
        .expect("write");
    let e = inspect::inspect(&junk, &InspectOptions::default()).expect_err("junk");
    assert!(
        e.to_string().contains("junk.bin") && e.to_string().contains("not a GGUF file"),
        "{e}"
    );
    let empty = dir.path().join("empty");
    std::fs::create_dir(&empty).expect("mkdir");
    assert!(inspect::inspect(&empty, &InspectOptions::default()).is_err());
    // A safetensors header of bad JSON is a diagnostic, not a panic.
    let d = dir.path().join("st");
    std::fs::create_dir(&d).expect("mkdir");
    raw_safetensors(&d.join("model.safetensors"), "{not json", 0);
    let r = run(&d);
    assert!(
        r.errors().any(|e| e.message.contains("not a JSON object")),
        "{:?}",
        errors(&r)
    );
}

// ---------------------------------------------------------------------------------------------
// Tuning files and the memory preflight.

fn config(drafter: &str, k: usize, tok_s: f64, equivalent: bool) -> specula_engine::tuning::TunedConfig {
    specula_engine::tuning::TunedConfig {
        drafter: drafter.into(),
        k,
        adaptive: false,
        tok_s,
        tau: 1.5,
        acceptance: 0.5,
        equivalent,
        decode_path: drafter.into(),
        per_prompt_tok_s: vec![tok_s],
    }
}

#[test]
fn tuning_file_decides_default_and_the_tier() {
    use specula_engine::speculative::{SpecMode, SpecOptions};
    use specula_engine::tuning::{self, Build, Machine, TuningFile};
    let _g = heavy();
    let dir = tmp();
    let path = dir.path().join("t.gguf");
    tiny_gguf_q8(&path, Family::Qwen3);
    let before = run(&path);
    assert_eq!(before.tier, Tier::CompatibleUnmeasured);
    let file = TuningFile {
        format: tuning::FORMAT,
        bundle: before.bundle_id(),
        draft_model: Some(tuning::BundleId {
            path: "elsewhere/draft.gguf".into(),
            bytes: 1,
            fingerprint: "fnv1a64:0000000000000001".into(),
        }),
        machine: Machine::current(),
        build: Build {
            version: "0.1.0".into(),
            commit: "test".into(),
        },
        date: tuning::now_rfc3339(),
        prompts: vec!["prose".into()],
        max_tokens: 16,
        min_gain: 0.03,
        configs: vec![
            config("ar", 0, 100.0, true),
            config("ngram", 3, 150.0, true),
            config("ngram", 5, 170.0, false),
            config("draft", 2, 200.0, true),
        ],
        best: config("draft", 2, 200.0, true),
    };
    let [beside, _] = tuning::locations(&path);
    assert_eq!(beside, dir.path().join("t.specula_tuning.json"));
    let write = |f: &TuningFile| std::fs::write(&beside, serde_json::to_string(f).expect("json")).expect("write");
    write(&file);
    // The recorded best needs a draft model that is not configured: the fastest equivalent
    // configuration available is chosen (ngram k=3; k=5 is faster but not output-equivalent).
    let r = run(&path);
    let t = r.tuning.as_ref().expect("tuning");
    assert!(t.applies, "{t:?}");
    assert_eq!(r.tier, Tier::Verified);
    assert_eq!(
        (r.modes.default.drafter.as_str(), r.modes.default.k),
        ("ngram", Some(3))
    );
    assert!(r.modes.default.reason.contains("tuning file"), "{:?}", r.modes.default);
    let choice = t.choice.clone().expect("choice");
    assert_eq!(
        (choice.mode, choice.draft_max, choice.adaptive),
        (SpecMode::Ngram, 3, false)
    );

    // The engine follows it for `default` (and only for `default`), output unchanged.
    let mut engine = specula_engine::Engine::load(&path, "t", specula_engine::LoadOptions::default()).expect("load");
    let gen = |engine: &mut specula_engine::Engine, mode: SpecMode| {
        let req = specula_engine::GenerateRequest {
            prompt_tokens: vec![258, 40, 72, 101, 259, 32, 116, 104, 258, 40, 72, 101],
            sampling: specula_engine::SamplingParams::greedy(),
            max_tokens: Some(24),
            stop: vec![],
            logprobs: None,
            ignore_eos: true,
            spec: SpecOptions {
                mode,
                ..Default::default()
            },
        };
        engine.generate(&req, &mut |_| true).expect("generate")
    };
    let ar = gen(&mut engine, SpecMode::Off);
    assert_eq!(engine.resolve_spec_mode(SpecMode::Default), Some(SpecMode::Ngram));
    engine.set_tuned_default(Some(choice));
    let spec = engine.effective_spec(SpecOptions {
        mode: SpecMode::Default,
        ..Default::default()
    });
    assert_eq!((spec.mode, spec.draft_max, spec.adaptive), (SpecMode::Ngram, 3, false));
    let d = gen(&mut engine, SpecMode::Default);
    assert_eq!(d.stats.spec.decode_path, "ngram");
    assert_eq!(d.token_ids, ar.token_ids);
    // A measured AR choice makes `default` plain decoding; `on` still speculates.
    let mut ar_file = file.clone();
    ar_file.best = config("ar", 0, 100.0, true);
    ar_file.draft_model = None;
    ar_file.configs.truncate(1);
    write(&ar_file);
    let r = run(&path);
    let choice = r.tuning.as_ref().and_then(|t| t.choice.clone()).expect("choice");
    assert_eq!(choice.mode, SpecMode::Off);
    assert_eq!(
        (r.modes.default.drafter.as_str(), r.modes.on.drafter.as_str()),
        ("ar", "ngram")
    );
    engine.set_tuned_default(Some(choice));
    assert_eq!(engine.resolve_spec_mode(SpecMode::Default), None);
    assert_eq!(engine.resolve_spec_mode(SpecMode::On), Some(SpecMode::Ngram));
    assert_eq!(gen(&mut engine, SpecMode::Default).stats.spec.decode_path, "ar");

    // Measured elsewhere, or for another bundle: reported, not applied.
    let mut other = file.clone();
    other.machine.cpu = "another CPU".into();
    write(&other);
    let r = run(&path);
    let t = r.tuning.as_ref().expect("tuning");
    assert!(
        !t.applies && t.reason.as_deref().is_some_and(|s| s.contains("another machine")),
        "{t:?}"
    );
    assert_eq!(r.tier, Tier::CompatibleUnmeasured);
    assert!(r.modes.default.reason.contains("unmeasured"), "{:?}", r.modes.default);
    let mut other = file.clone();
    other.bundle.fingerprint = "fnv1a64:0123456789abcdef".into();
    write(&other);
    let r = run(&path);
    assert!(r
        .tuning
        .as_ref()
        .and_then(|t| t.reason.clone())
        .is_some_and(|s| s.contains("another bundle")));
    // An unreadable file is a warning naming it.
    std::fs::write(&beside, "{ not json").expect("write");
    let r = run(&path);
    assert!(
        r.diagnostics
            .iter()
            .any(|d| d.component == Component::Tuning && d.file.ends_with("t.specula_tuning.json")),
        "{:?}",
        r.diagnostics
    );
    assert_eq!(r.tier, Tier::CompatibleUnmeasured);
}

#[test]
fn memory_preflight_advises_or_refuses_with_the_numbers() {
    use specula_engine::inspect::memory::{self, MemoryCheck};
    let _g = heavy();
    let dir = tmp();
    let path = dir.path().join("t.gguf");
    tiny_gguf(&path, Family::Llama);
    let r = run(&path);
    let m = r.memory.clone().expect("estimate");
    // KV: 2 × 2 layers × 2 KV heads × 16 dims × 2 bytes (f16) per token, over the 256-token context.
    assert_eq!(m.kv_bytes_per_token, 2 * 2 * 2 * 16 * 2);
    assert_eq!((m.kv_context, m.kv_bytes), (256, 256 * 256));
    assert!(m.weights_bytes > 0 && m.scratch_bytes > 0);
    let e = memory::preflight(&m, Some(1000), MemoryCheck::Strict).expect_err("strict refuses");
    let msg = e.to_string();
    for part in ["strict", "weights", "KV cache", "256 tokens", "available 1.0 KB"] {
        assert!(msg.contains(part), "lacks {part}: {msg}");
    }
    let p = memory::preflight(&m, Some(1000), MemoryCheck::Advisory).expect("advisory loads");
    assert!(p.over && p.summary.contains("available 1.0 KB"), "{p:?}");
    assert!(!memory::preflight(&m, Some(1000), MemoryCheck::Off).expect("off").over);
    assert!(
        !memory::preflight(&m, Some(u64::MAX), MemoryCheck::Strict)
            .expect("fits")
            .over
    );
    // A shorter context shrinks the KV term only.
    let short = run_with(
        &path,
        InspectOptions {
            kv_context: Some(64),
            ..Default::default()
        },
    );
    let s = short.memory.expect("estimate");
    assert_eq!((s.kv_bytes, s.weights_bytes), (64 * 256, m.weights_bytes));
    assert!(memory::available_memory().is_some_and(|a| a > 0));
    assert!(memory::resident_bytes().is_some_and(|a| a > 0));
}

/// A FIFO (or a bundle directory holding one) is refused at once by the loader and by
/// `inspect`: opening a FIFO blocks until a writer comes, and a model path can come from a
/// request (`/v1/models/{id}/speculative`'s `draft_model`), so one request could stop the engine.
#[test]
fn a_fifo_is_refused_without_blocking() {
    let dir = tmp();
    let fifo = dir.path().join("model.gguf");
    let made = std::process::Command::new("mkfifo").arg(&fifo).status();
    if !made.is_ok_and(|s| s.success()) {
        eprintln!("SKIP: mkfifo is not available");
        return;
    }
    let hf = dir.path().join("hf");
    tiny_hf(&hf, Family::Qwen2);
    std::fs::remove_file(hf.join("config.json")).expect("rm");
    let made = std::process::Command::new("mkfifo")
        .arg(hf.join("config.json"))
        .status();
    assert!(made.is_ok_and(|s| s.success()));
    for path in [fifo.clone(), hf.clone()] {
        let p = path.clone();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let load = specula_engine::bundle::load(&p, &candle_core::Device::Cpu)
                .err()
                .map(|e| format!("{e:#}"));
            let insp = inspect::inspect(&p, &InspectOptions::default()).map(|r| errors(&r));
            let _ = tx.send((load, insp));
        });
        let (load, insp) = rx
            .recv_timeout(std::time::Duration::from_secs(20))
            .unwrap_or_else(|_| panic!("{}: blocked on a FIFO", path.display()));
        let load = load.expect("a FIFO does not load");
        assert!(load.contains("not a regular file"), "{}: {load}", path.display());
        let refused = match insp {
            Err(e) => format!("{e:#}").contains("not a regular file"),
            Ok(errs) => errs.iter().any(|e| e.contains("not a regular file")),
        };
        assert!(refused, "{}: inspect does not say so", path.display());
    }
}
