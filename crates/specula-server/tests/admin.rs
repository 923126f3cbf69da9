//! `POST /v1/models/{id}/speculative`: run-time changes of the speculation default load exactly
//! what must be loaded (observed through `specula.loads` in `/v1/models` and
//! `specula_model_loads_total`), bad changes are 4xx and change nothing, and greedy output after
//! any change is the plain output.

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use axum::http::StatusCode;
use axum::Router;
use common::*;
use serde_json::{json, Value};
use specula_engine::engine::MAX_DRAFT;
use specula_engine::{catalog, Engine, LoadOptions};
use specula_server::{router, EngineHandle};

const CHAT: &str = "/v1/chat/completions";
const ADMIN: &str = "/v1/models/tiny/speculative";

/// A greedy chat body whose prompt repeats itself (n-gram lookup finds drafts); no `spec` field,
/// so the server default applies.
fn body() -> Value {
    json!({"messages": [{"role": "user", "content": "the then the thin the then the then the thin the then"}],
        "temperature": 0, "max_tokens": 60, "ignore_eos": true})
}

/// The `specula` object of the model in `/v1/models` (also checks `/v1/models/{id}` agrees).
async fn specula(app: &Router) -> Value {
    let list = get(app, "/v1/models").await.json();
    let m = list["data"][0].clone();
    assert_eq!(
        get(app, &format!("/v1/models/{}", m["id"].as_str().unwrap()))
            .await
            .json(),
        m
    );
    m["specula"].clone()
}

/// Load events of `kind` in `/v1/models` (`event: "load"` only).
fn loads_of(sp: &Value, kind: &str) -> usize {
    sp["loads"]
        .as_array()
        .expect("specula.loads is an array")
        .iter()
        .filter(|e| e["kind"] == kind && e["event"] == "load")
        .count()
}

/// `specula_model_loads_total{kind=...}` (or the unloads counter), 0 when absent.
async fn counter(app: &Router, name: &str, kind: &str) -> u64 {
    let text = get(app, "/metrics").await.text;
    let key = format!("{name}{{kind=\"{kind}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&key))
        .map(|v| v.trim().parse().unwrap())
        .unwrap_or(0)
}

/// Change the default and return the response (asserting 200).
async fn change(app: &Router, path: &str, b: Value) -> Value {
    let r = post(app, path, b.clone()).await;
    assert_eq!(r.status, StatusCode::OK, "{b}: {}", r.text);
    r.json()
}

/// Run `body()` without `spec`; returns (content, decode_path).
async fn run(app: &Router) -> (String, String) {
    let r = post(app, CHAT, body()).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text);
    let v = r.json();
    (
        v["choices"][0]["message"]["content"].as_str().unwrap().to_string(),
        v["spec_stats"]["decode_path"].as_str().unwrap().to_string(),
    )
}

fn spec_app() -> (Router, EngineHandle) {
    // Requests may attach the models of the tests' tmp directory (the draft models are there).
    let dirs = vec![PathBuf::from(env!("CARGO_TARGET_TMPDIR"))];
    let h = EngineHandle::spawn_with_queue(spec_engine(), 16).with_models_dirs(dirs);
    (router(h.clone()), h)
}

fn path_str(p: &Path) -> String {
    p.to_str().unwrap().to_string()
}

#[tokio::test]
async fn switching_among_modes_without_a_new_drafter_loads_nothing() {
    let (app, _h) = spec_app();
    let sp = specula(&app).await;
    assert_eq!(sp["spec_default"], "off");
    assert_eq!(loads_of(&sp, "target"), 1, "{sp}");
    assert_eq!(loads_of(&sp, "draft"), 0, "{sp}");
    let loads_before = sp["loads"].clone();
    let (ar_text, path) = run(&app).await;
    assert_eq!(path, "ar");

    for (mode, drafter, decode_path) in [
        ("ngram", "ngram", "ngram"),
        ("on", "ngram", "ngram"),
        ("default", "ngram", "ngram"),
        ("off", "ar", "ar"),
    ] {
        let before = specula(&app).await;
        let v = change(&app, ADMIN, json!({"mode": mode})).await;
        assert_eq!(v["reloaded"], false, "{mode}: {v}");
        assert_eq!(v["events"], json!([]), "{mode}: {v}");
        assert_eq!(v["previous"]["mode"], before["spec_default"], "{v}");
        assert_eq!(
            v["spec"],
            json!({"mode": mode, "draft_max": 4, "adaptive": true, "sampled_verify": "coupled"}),
            "{v}"
        );
        let sp = specula(&app).await;
        assert_eq!(sp["spec_default"], mode);
        assert_eq!(sp["effective_spec"], v["effective_spec"]);
        assert_eq!(sp["effective_spec"]["drafter"], drafter, "{mode}: {sp}");
        assert_ne!(sp["effective_spec"], before["effective_spec"], "{mode}");
        assert_eq!(sp["loads"], loads_before, "{mode}: no load event");
        let (text, path) = run(&app).await;
        assert_eq!(path, decode_path, "{mode}");
        assert_eq!(text, ar_text, "{mode}: greedy output is the plain output");
    }

    // draft_max / adaptive alone change the default and load nothing either.
    let v = change(&app, ADMIN, json!({"mode": "ngram", "draft_max": 2, "adaptive": false})).await;
    assert_eq!(v["reloaded"], false);
    let sp = specula(&app).await;
    assert_eq!(
        (sp["draft_max"].clone(), sp["adaptive"].clone()),
        (json!(2), json!(false))
    );
    assert_eq!(sp["effective_spec"]["draft_max"], 2);
    assert_eq!(run(&app).await, (ar_text, "ngram".to_string()));
    assert_eq!(sp["sampled_verify"], "coupled");
    let v = change(&app, ADMIN, json!({"sampled_verify": "rejection"})).await;
    assert_eq!(v["spec"]["sampled_verify"], "rejection", "{v}");
    assert_eq!(v["previous"]["sampled_verify"], "coupled", "{v}");
    assert_eq!(specula(&app).await["sampled_verify"], "rejection");

    assert_eq!(counter(&app, "specula_model_loads_total", "target").await, 1);
    assert_eq!(counter(&app, "specula_model_loads_total", "draft").await, 0);
}

#[tokio::test]
async fn a_draft_model_loads_once_and_only_when_it_changes() {
    let (app, _h) = spec_app();
    let (ar_text, _) = run(&app).await;
    let draft = path_str(&draft_model_path());

    // Not loaded yet: exactly one load event.
    let v = change(&app, ADMIN, json!({"mode": "draft", "draft_model": draft})).await;
    assert_eq!(v["reloaded"], true, "{v}");
    let events = v["events"].as_array().unwrap();
    assert_eq!(events.len(), 1, "{v}");
    assert_eq!(events[0]["event"], "load");
    assert_eq!(events[0]["kind"], "draft");
    assert_eq!(events[0]["model"], draft);
    assert!(events[0]["seconds"].as_f64().unwrap() >= 0.0, "{v}");
    assert!(events[0]["at"].as_u64().unwrap() > 1_600_000_000, "{v}");
    assert_eq!(v["draft_model"], draft);
    let sp = specula(&app).await;
    assert_eq!(sp["draft_model"], draft);
    assert_eq!(sp["spec_default"], "draft");
    assert_eq!(sp["effective_spec"]["drafter"], format!("draft-model:{draft}"));
    assert_eq!(loads_of(&sp, "draft"), 1, "{sp}");
    assert_eq!(sp["loads"].as_array().unwrap().last().unwrap(), &events[0]);
    let (text, path) = run(&app).await;
    assert_eq!(path, format!("draft-model:{draft}"));
    assert_eq!(text, ar_text, "greedy output with the draft model is the plain output");

    // The same draft model again, by name or by another path to the same file: nothing loads.
    let dir = draft_model_path().parent().unwrap().to_path_buf();
    let same_file = dir
        .join("..")
        .join(dir.file_name().unwrap())
        .join(draft_model_path().file_name().unwrap());
    for b in [
        json!({"mode": "draft", "draft_model": draft}),
        json!({"mode": "draft", "draft_model": path_str(&same_file)}),
        json!({"mode": "draft"}),
        json!({"mode": "off"}),
        json!({"mode": "on"}),
        json!({"mode": "draft", "draft_max": 3}),
    ] {
        let v = change(&app, ADMIN, b.clone()).await;
        assert_eq!(v["reloaded"], false, "{b}: {v}");
        assert_eq!(v["events"], json!([]), "{b}");
        assert_eq!(
            v["draft_model"], draft,
            "{b}: switching away from draft keeps it attached"
        );
    }
    let sp = specula(&app).await;
    assert_eq!(loads_of(&sp, "draft"), 1, "{sp}");
    assert_eq!(run(&app).await, (ar_text.clone(), format!("draft-model:{draft}")));

    // Another draft model (the target's own file drafts for it): load it, drop the old one.
    let other = path_str(&spec_model_path());
    let v = change(&app, ADMIN, json!({"draft_model": other})).await;
    assert_eq!(v["reloaded"], true);
    let kinds: Vec<(Value, Value)> = v["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| (e["event"].clone(), e["model"].clone()))
        .collect();
    assert_eq!(
        kinds,
        vec![(json!("load"), json!(other)), (json!("unload"), json!(draft))]
    );
    assert_eq!(run(&app).await, (ar_text.clone(), format!("draft-model:{other}")));

    // unload_draft frees it; `draft` then needs a draft model again.
    let v = change(&app, ADMIN, json!({"mode": "ngram", "unload_draft": true})).await;
    assert_eq!(v["reloaded"], true);
    assert_eq!(v["events"][0]["event"], "unload");
    assert_eq!(v["draft_model"], Value::Null);
    let sp = specula(&app).await;
    assert_eq!(sp["draft_model"], Value::Null);
    assert_eq!(sp["effective_spec"]["drafter"], "ngram");
    let r = post(&app, ADMIN, json!({"mode": "draft"})).await;
    assert_error(&r, StatusCode::BAD_REQUEST, Some("mode"));
    assert_eq!(specula(&app).await, sp, "a refused change changes nothing");
    // Nothing to unload: nothing happens.
    let v = change(&app, ADMIN, json!({"unload_draft": true})).await;
    assert_eq!(v["reloaded"], false);
    assert_eq!(run(&app).await, (ar_text, "ngram".to_string()));

    assert_eq!(counter(&app, "specula_model_loads_total", "draft").await, 2);
    assert_eq!(counter(&app, "specula_model_unloads_total", "draft").await, 2);
    assert_eq!(counter(&app, "specula_model_loads_total", "target").await, 1);
}

#[tokio::test]
async fn bad_changes_are_4xx_and_change_nothing() {
    let (app, _h) = spec_app();
    change(&app, ADMIN, json!({"mode": "ngram", "draft_max": 5})).await;
    let before = specula(&app).await;
    let missing = std::env::temp_dir().join("specula-no-such-draft-model.gguf");
    let garbage = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("specula-admin-not-a-model.gguf");
    std::fs::write(&garbage, b"this is not a GGUF file").unwrap();
    let cases = [
        (json!({"mode": "fast"}), "mode", "invalid_value"),
        (json!({"mode": 3}), "mode", "invalid_type"),
        (json!({"mode": "ngram", "k": 2}), "k", "unknown_parameter"),
        (json!({"draft_max": 0}), "draft_max", "invalid_value"),
        (json!({"draft_max": MAX_DRAFT + 1}), "draft_max", "invalid_value"),
        (json!({"adaptive": 1}), "adaptive", "invalid_type"),
        (json!({"sampled_verify": "always"}), "sampled_verify", "invalid_value"),
        (json!({"mode": "draft"}), "mode", "invalid_value"),
        // No MTP head or block drafter is attached: every request without `spec` would fail.
        (json!({"mode": "mtp"}), "mode", "invalid_value"),
        (json!({"mode": "block", "draft_max": 3}), "mode", "invalid_value"),
        (
            json!({"mode": "draft", "draft_model": path_str(&missing)}),
            "draft_model",
            "draft_model_not_found",
        ),
        (
            json!({"mode": "draft", "draft_model": "no-such-catalog-model"}),
            "draft_model",
            "draft_model_not_found",
        ),
        (
            json!({"mode": "draft", "draft_model": path_str(&garbage)}),
            "draft_model",
            "draft_model_unusable",
        ),
        (
            json!({"mode": "off", "unload_draft": true, "draft_model": "x"}),
            "unload_draft",
            "invalid_value",
        ),
    ];
    for (b, param, code) in cases {
        let r = post(&app, ADMIN, b.clone()).await;
        let e = assert_error(&r, StatusCode::BAD_REQUEST, Some(param));
        assert_eq!(e["code"], code, "{b}: {}", r.text);
        assert_eq!(specula(&app).await, before, "{b} changed the state");
        // Errors name files, never the server's directories (beyond the client's own words).
        let said = b["draft_model"].as_str().unwrap_or("\u{0}");
        let shown = r.text.replace(said, "");
        for dir in [std::env::temp_dir(), PathBuf::from(env!("CARGO_TARGET_TMPDIR"))] {
            let dir = dir.display().to_string();
            assert!(!shown.contains(&dir), "{b}: the error shows {dir}: {}", r.text);
        }
    }
    let r = post_raw(&app, ADMIN, "{not json").await;
    assert_error(&r, StatusCode::BAD_REQUEST, None);
    let r = post(&app, "/v1/models/other/speculative", json!({"mode": "off"})).await;
    let e = assert_error(&r, StatusCode::NOT_FOUND, Some("model"));
    assert_eq!(e["code"], "model_not_found");
    let r = post(&app, "/v1/models/tiny/other", json!({"mode": "off"})).await;
    assert_error(&r, StatusCode::NOT_FOUND, None);
    assert_eq!(specula(&app).await, before);
    assert_eq!(counter(&app, "specula_model_loads_total", "draft").await, 0);
    let (_, path) = run(&app).await;
    assert_eq!(path, "ngram");
}

#[tokio::test]
async fn a_change_waits_for_the_running_job() {
    let (app, h) = spec_app();
    let hold = h.hold().unwrap();
    let a = app.clone();
    let draft = path_str(&draft_model_path());
    let pending = tokio::spawn(async move { change(&a, ADMIN, json!({"mode": "draft", "draft_model": draft})).await });
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!pending.is_finished(), "the change runs between jobs");
    let sp = specula(&app).await;
    assert_eq!(sp["spec_default"], "off");
    assert_eq!(loads_of(&sp, "draft"), 0);
    drop(hold);
    let v = tokio::time::timeout(Duration::from_secs(60), pending)
        .await
        .expect("the change finishes once the engine is free")
        .unwrap();
    assert_eq!(v["reloaded"], true);
    assert_eq!(specula(&app).await["spec_default"], "draft");
}

/// A draft model attached before serving counts as loaded; naming it again loads nothing.
#[tokio::test]
async fn a_startup_draft_model_counts_once() {
    let mut e = spec_engine();
    let draft = path_str(&draft_model_path());
    e.attach_draft_model(&draft_model_path(), &draft).unwrap();
    let h = EngineHandle::spawn_with_queue(e, 16)
        .with_load_seconds(Some(1.5), Some(0.25))
        .with_models_dirs(vec![PathBuf::from(env!("CARGO_TARGET_TMPDIR"))]);
    let app = router(h);
    let sp = specula(&app).await;
    let loads = sp["loads"].as_array().unwrap();
    assert_eq!(loads.len(), 2, "{sp}");
    assert_eq!(
        (loads[0]["kind"].clone(), loads[0]["seconds"].clone()),
        (json!("target"), json!(1.5))
    );
    assert_eq!(
        (loads[1]["kind"].clone(), loads[1]["seconds"].clone()),
        (json!("draft"), json!(0.25))
    );
    let v = change(&app, ADMIN, json!({"mode": "draft", "draft_model": draft})).await;
    assert_eq!(v["reloaded"], false, "{v}");
    assert_eq!(counter(&app, "specula_model_loads_total", "draft").await, 1);
    assert_eq!(counter(&app, "specula_model_loads_total", "target").await, 1);
}

/// The real default model drafting for itself: one draft load, then greedy output
/// byte-identical to plain decoding, with a fixed k and adaptive; a draft model with another
/// tokenizer is refused.
#[tokio::test]
async fn smollm2_drafts_for_itself_after_a_switch() {
    let entry = catalog::lookup(catalog::DEFAULT_MODEL).expect("catalog entry");
    let path = specula_engine::cache::models_dir().join(entry.file_name);
    assert!(
        path.exists(),
        "{} is not in the model cache; run `specula pull {}` (scripts/test.sh does)",
        path.display(),
        catalog::DEFAULT_MODEL
    );
    let engine = Engine::load(&path, "smollm2", LoadOptions::default()).expect("load SmolLM2");
    // The operator allows the tests' models and the model cache (so the catalog file can be
    // named by its path too).
    let dirs = vec![
        PathBuf::from(env!("CARGO_TARGET_TMPDIR")),
        specula_engine::cache::models_dir(),
    ];
    let app = router(EngineHandle::spawn_with_queue(engine, 16).with_models_dirs(dirs));
    let admin = "/v1/models/smollm2/speculative";
    let ask = json!({"messages": [{"role": "user", "content": "List the days of the week, then list them again."}],
        "temperature": 0, "max_tokens": 48});
    let ar = post(&app, CHAT, ask.clone()).await.json();
    assert_eq!(ar["spec_stats"]["decode_path"], "ar");

    let r = post(
        &app,
        admin,
        json!({"mode": "draft", "draft_model": path_str(&draft_model_path())}),
    )
    .await;
    let e = assert_error(&r, StatusCode::BAD_REQUEST, Some("draft_model"));
    assert!(e["message"].as_str().unwrap().contains("cannot draft for"), "{e}");

    let v = change(
        &app,
        admin,
        json!({"mode": "draft", "draft_model": catalog::DEFAULT_MODEL, "draft_max": 4, "adaptive": false}),
    )
    .await;
    assert_eq!(v["reloaded"], true);
    assert_eq!(v["events"].as_array().unwrap().len(), 1, "{v}");
    let sp = specula(&app).await;
    assert_eq!(loads_of(&sp, "draft"), 1);
    // Fixed k, then adaptive: drafting costs a whole target step per token, so no k pays and
    // the draft model starts only at the controller's probes (`DraftLength::start_pays`).
    // Either way the text is plain decoding's.
    let mut adaptive = ask.clone();
    adaptive["spec"] = json!({"mode": "draft", "adaptive": true});
    for (body, fixed) in [(ask.clone(), true), (adaptive, false)] {
        let spec = post(&app, CHAT, body).await.json();
        assert_eq!(
            spec["spec_stats"]["decode_path"],
            format!("draft-model:{}", catalog::DEFAULT_MODEL)
        );
        assert_eq!(
            spec["choices"][0]["message"]["content"],
            ar["choices"][0]["message"]["content"]
        );
        if fixed {
            assert!(
                spec["spec_stats"]["accepted"].as_u64().unwrap() > 0,
                "{}",
                spec["spec_stats"]
            );
        }
    }
    let v = change(&app, admin, json!({"mode": "draft", "draft_model": path_str(&path)})).await;
    assert_eq!(
        v["reloaded"], false,
        "the catalog name and the file are the same model: {v}"
    );
}

/// A tuning choice was measured with the drafters attached at startup: it stops applying while
/// another set is attached and applies again once the startup set is back.
#[tokio::test]
async fn the_tuning_choice_follows_the_startup_drafters() {
    use specula_engine::speculative::{SpecMode, SpecOptions};
    use specula_engine::tuning::TunedDefault;
    let mut e = spec_engine();
    e.set_tuned_default(Some(TunedDefault {
        mode: SpecMode::Off,
        draft_max: 1,
        adaptive: false,
        tok_s: 10.0,
        ar_tok_s: 10.0,
        source: "test".to_string(),
    }));
    let spec = SpecOptions {
        mode: SpecMode::Default,
        ..Default::default()
    };
    let app = router(
        EngineHandle::spawn_with_spec(e, 16, spec).with_models_dirs(vec![PathBuf::from(env!("CARGO_TARGET_TMPDIR"))]),
    );
    let sp = specula(&app).await;
    assert!(sp["tuned_default"].is_object(), "{sp}");
    assert_eq!(sp["effective_spec"]["drafter"], "ar", "{sp}");
    assert_eq!(run(&app).await.1, "ar");

    let draft = path_str(&draft_model_path());
    change(&app, ADMIN, json!({"draft_model": draft})).await;
    let sp = specula(&app).await;
    assert_eq!(sp["spec_default"], "default");
    assert_eq!(sp["tuned_default"], Value::Null, "{sp}");
    // `default` with a draft model: n-gram lookup beside it, in the listing and the requests.
    assert_eq!(
        sp["effective_spec"]["drafter"],
        format!("draft-model:{draft}+ngram"),
        "{sp}"
    );
    assert_eq!(run(&app).await.1, format!("draft-model:{draft}+ngram"));

    change(&app, ADMIN, json!({"unload_draft": true})).await;
    let sp = specula(&app).await;
    assert!(sp["tuned_default"].is_object(), "{sp}");
    assert_eq!(sp["effective_spec"]["drafter"], "ar", "{sp}");
    assert_eq!(run(&app).await.1, "ar");
}

/// Over HTTP a draft model is a pulled catalog model or a model under the operator's
/// `--models-dir`: any other path is refused before it is opened, with the same error whether it
/// exists or not (no probing of the server's files), and a server without models directories
/// takes catalog names only.
#[tokio::test]
async fn draft_models_come_from_the_catalog_or_the_models_dirs_only() {
    let (app, _h) = spec_app();
    let outside = tempfile::tempdir().expect("tempdir");
    let real = outside.path().join("model.gguf");
    std::fs::copy(draft_model_path(), &real).expect("copy");
    let missing = outside.path().join("missing.gguf");
    let inside_by_dots = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join("..")
        .join("..")
        .join("Cargo.toml");
    let mut messages = Vec::new();
    for p in [real.clone(), missing, PathBuf::from("/etc/passwd"), inside_by_dots] {
        let r = post(&app, ADMIN, json!({"mode": "draft", "draft_model": path_str(&p)})).await;
        let e = assert_error(&r, StatusCode::BAD_REQUEST, Some("draft_model"));
        assert_eq!(e["code"], "draft_model_not_found", "{}: {e}", p.display());
        messages.push(e["message"].as_str().unwrap().replace(&path_str(&p), "PATH"));
    }
    assert!(
        messages.windows(2).all(|w| w[0] == w[1]),
        "the errors differ: {messages:?}"
    );
    // A name relative to a models directory.
    let name = draft_model_path().file_name().unwrap().to_string_lossy().to_string();
    let v = change(&app, ADMIN, json!({"mode": "draft", "draft_model": name})).await;
    assert_eq!(v["reloaded"], true, "{v}");
    // Without models directories: catalog names only.
    let app = router(EngineHandle::spawn_with_queue(spec_engine(), 16));
    let r = post(
        &app,
        ADMIN,
        json!({"mode": "draft", "draft_model": path_str(&draft_model_path())}),
    )
    .await;
    let e = assert_error(&r, StatusCode::BAD_REQUEST, Some("draft_model"));
    assert!(e["message"].as_str().unwrap().contains("--models-dir"), "{e}");
}

/// A change whose client went away before the worker reached it is dropped, not applied later:
/// nothing is loaded or switched.
#[tokio::test]
async fn an_abandoned_change_is_not_applied() {
    let (app, h) = spec_app();
    let before = specula(&app).await;
    let hold = h.hold().unwrap();
    let a = app.clone();
    let draft = path_str(&draft_model_path());
    let gave_up = tokio::time::timeout(
        Duration::from_millis(300),
        post(&a, ADMIN, json!({"mode": "draft", "draft_model": draft})),
    )
    .await;
    assert!(gave_up.is_err(), "the change waits for the held worker");
    drop(hold);
    // A generation queued after the abandoned change runs once the worker has passed it.
    let (_, path) = run(&app).await;
    assert_eq!(path, "ar");
    assert_eq!(specula(&app).await, before);
    assert_eq!(counter(&app, "specula_model_loads_total", "draft").await, 0);
}

/// A draft model is read in the request's handler, not on the engine's thread: with the engine
/// busy, a draft model with another tokenizer is refused at once (from its header, before its
/// weights), and the refusal changes nothing.
#[tokio::test]
async fn draft_models_are_checked_off_the_engine_thread() {
    let (app, h) = spec_app();
    let before = specula(&app).await;
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen3moe-tiny/model-q8_0.gguf");
    let other = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("specula-admin-other-tokenizer.gguf");
    std::fs::copy(&fixture, &other).unwrap();
    let hold = h.hold().unwrap();
    let r = tokio::time::timeout(
        Duration::from_secs(20),
        post(&app, ADMIN, json!({"mode": "draft", "draft_model": path_str(&other)})),
    )
    .await
    .expect("a draft model with another tokenizer is refused while the engine is busy");
    let e = assert_error(&r, StatusCode::BAD_REQUEST, Some("draft_model"));
    assert_eq!(e["code"], "draft_model_unusable", "{}", r.text);
    assert!(
        e["message"].as_str().unwrap().contains("cannot draft for"),
        "{}",
        r.text
    );
    drop(hold);
    assert_eq!(specula(&app).await, before);
    assert_eq!(counter(&app, "specula_model_loads_total", "draft").await, 0);
}
