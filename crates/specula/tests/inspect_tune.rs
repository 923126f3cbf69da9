//! `specula inspect`, `specula tune` and `--memory-check` through the binary, on tiny random
//! models written by the test (no catalog model needed).

use std::path::Path;
use std::process::{Command, Output};

use serde_json::Value;
use specula_engine::model::Family;
use specula_engine::testing::{write_tiny_gguf, TinySpec};

fn specula(args: &[&str], cache: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_specula"))
        .args(args)
        .env("SPECULA_CACHE", cache)
        .env("RAYON_NUM_THREADS", "2")
        .env("RUST_LOG", "info")
        .output()
        .expect("running specula")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// A tiny model on batch-invariant kernels (Q8_0), so speculation is exact and used.
fn tiny(path: &Path) {
    // ggml type 8 is Q8_0.
    let q8 = specula_engine::inspect::gguf::dtype_of(8).expect("Q8_0");
    let spec = TinySpec {
        context: 2048,
        ..TinySpec::with_dtype(Family::Qwen2, q8)
    };
    write_tiny_gguf(path, &spec).expect("write tiny gguf");
}

#[test]
fn inspect_text_json_and_a_broken_bundle() {
    let dir = tempfile::tempdir().expect("tempdir");
    let model = dir.path().join("tiny.gguf");
    tiny(&model);
    let m = model.to_str().expect("utf8 path");
    let out = specula(&["inspect", m], dir.path());
    assert!(out.status.success(), "{}", text(&out.stderr));
    let t = text(&out.stdout);
    for s in [
        "architecture   qwen2",
        "MTP head       absent",
        "tier: compatible but unmeasured",
        "default  ngram",
    ] {
        assert!(t.contains(s), "lacks {s:?}:\n{t}");
    }
    let out = specula(&["inspect", m, "--json"], dir.path());
    assert!(out.status.success());
    let j: Value = serde_json::from_slice(&out.stdout).expect("JSON report");
    assert_eq!(j["tier"], "compatible-unmeasured");
    assert_eq!(j["modes"]["on"]["drafter"], "ngram");
    assert_eq!(j["config"]["hidden_size"], 64);

    // A truncated copy: exit status 1, the diagnostic names the file and the tensor.
    let bytes = std::fs::read(&model).expect("read");
    let cut = dir.path().join("cut.gguf");
    std::fs::write(&cut, &bytes[..bytes.len() - 1000]).expect("write");
    let out = specula(&["inspect", cut.to_str().expect("utf8")], dir.path());
    assert!(!out.status.success());
    let t = text(&out.stdout) + &text(&out.stderr);
    assert!(
        t.contains("cut.gguf") && t.contains("past the end of the file") && t.contains("incompatible"),
        "{t}"
    );
    // Loading it fails the same way (the header check runs before any weight is read).
    let out = specula(
        &["generate", "--model", cut.to_str().expect("utf8"), "--prompt", "hi"],
        dir.path(),
    );
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("past the end of the file"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn tune_writes_a_file_that_default_follows() {
    let dir = tempfile::tempdir().expect("tempdir");
    let model = dir.path().join("tiny.gguf");
    tiny(&model);
    let m = model.to_str().expect("utf8 path");
    let out = specula(&["tune", m, "--k-max", "2", "--max-tokens", "12"], dir.path());
    assert!(out.status.success(), "{}", text(&out.stderr));
    // Written next to the bundle (not a catalog model).
    let file = dir.path().join("tiny.specula_tuning.json");
    let j: Value = serde_json::from_str(&std::fs::read_to_string(&file).expect("tuning file")).expect("JSON");
    let configs = j["configs"].as_array().expect("configs");
    // AR, ngram k=1, k=2, adaptive.
    assert_eq!(configs.len(), 4, "{j}");
    assert!(configs.iter().all(|c| c["equivalent"] == true), "{j}");
    assert!(configs.iter().all(|c| c["tok_s"].as_f64().is_some_and(|x| x > 0.0)));
    for k in ["machine", "build", "date", "best", "bundle", "prompts"] {
        assert!(j.get(k).is_some(), "lacks {k}: {j}");
    }
    assert!(j["build"]["commit"].as_str().is_some_and(|c| !c.is_empty()));
    let best = &j["best"];
    let ar = configs[0]["tok_s"].as_f64().expect("ar");
    if best["drafter"] != "ar" {
        assert!(best["tok_s"].as_f64().expect("best") > ar * 1.03, "{j}");
    }

    // inspect reports it, and `generate --spec default` follows it and says so.
    let out = specula(&["inspect", m, "--json"], dir.path());
    let r: Value = serde_json::from_slice(&out.stdout).expect("JSON report");
    assert_eq!(r["tier"], "verified", "{r}");
    assert_eq!(r["tuning"]["applies"], true);
    let out = specula(
        &[
            "generate",
            "--model",
            m,
            "--prompt",
            "hello",
            "--max-tokens",
            "8",
            "--spec",
            "default",
            "--json",
        ],
        dir.path(),
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stderr).contains("spec default:") && text(&out.stderr).contains("tuning file"));
    let g: Value = serde_json::from_slice(&out.stdout).expect("generate JSON");
    let path = g["speculative"]["decode_path"].as_str().expect("decode path");
    let want = if best["drafter"] == "ar" { "ar" } else { "ngram" };
    assert_eq!(path, want, "{g}");
}

#[test]
fn memory_check_logs_the_estimate() {
    let dir = tempfile::tempdir().expect("tempdir");
    let model = dir.path().join("tiny.gguf");
    tiny(&model);
    let m = model.to_str().expect("utf8 path");
    let out = specula(
        &[
            "generate",
            "--model",
            m,
            "--prompt",
            "hi",
            "--max-tokens",
            "2",
            "--memory-check",
            "strict",
        ],
        dir.path(),
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let e = text(&out.stderr);
    assert!(
        e.contains("memory check") && e.contains("KV cache") && e.contains("available"),
        "{e}"
    );
    let out = specula(
        &["generate", "--model", m, "--prompt", "hi", "--memory-check", "nonsense"],
        dir.path(),
    );
    assert!(!out.status.success());
}
