//! Run-time changes of the speculation default (`POST /v1/models/{id}/speculative`) and the log
//! of model loads shown in `/v1/models` (`specula.loads`) and counted by
//! `specula_model_loads_total{kind}`.
//!
//! A change is a control message on the engine worker's job channel: it runs between two
//! generations, after the jobs queued before it and before those queued after it. A draft model
//! it needs is read first, in the HTTP handler off the worker thread (checked against the target
//! from its headers before its weights; cancelled if the client goes away), and attached by the
//! worker with a move; a change whose client went away before the worker reached it is dropped.
//! It loads only when what must be loaded changes: a draft model that is not attached yet (or another one than the
//! attached one); switching among `off`, `ngram`, `on`, `default` and `draft` with what is
//! already attached loads nothing. Switching away from `draft` keeps the draft model attached
//! (switching back is then free, and `on` / `default` keep using it); `"unload_draft": true`
//! frees it. A failed load changes nothing.
//!
//! Requests resolve the server default into their own settings when they are parsed, so a
//! request admitted before a change runs with the settings it was admitted with. If those name
//! a draft model that a change unloaded before the request ran, it fails with a 400; if the
//! draft model was replaced, it drafts with the new one (greedy output is the same either way).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, PoisonError};
use std::time::Instant;

use axum::extract::rejection::JsonRejection;
use axum::extract::{Path as UrlPath, State};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Serialize;
use serde_json::{json, Value};
use specula_engine::engine::{LoadedDraft, MAX_DRAFT};
use specula_engine::speculative::{SampledVerify, SpecMode, SpecOptions};
use specula_engine::tuning::TunedDefault;
use specula_engine::Engine;
use tokio::sync::oneshot;

use crate::error::ApiError;
use crate::metrics::Metrics;
use crate::params::Body;
use crate::worker::{effective_spec_json, EngineHandle, ModelCell, ModelInfo};

/// How many load events `/v1/models` keeps (the oldest are dropped first).
pub const MAX_LOAD_LOG: usize = 32;

/// One model load or unload.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LoadEvent {
    /// `load` or `unload`.
    pub event: &'static str,
    /// `target` or `draft`.
    pub kind: &'static str,
    /// The model's id (for a draft model: the name or path it was asked for by).
    pub model: String,
    /// The name of the file or directory it was read from, when known (the name only: no
    /// server path reaches a response; the log line of the load has the path).
    pub file: Option<String>,
    /// Seconds the load took; `None` for an unload, and for a load done before the server
    /// started whose time was not reported.
    pub seconds: Option<f64>,
    /// Unix seconds when it happened.
    pub at: u64,
}

impl LoadEvent {
    fn new(event: &'static str, kind: &'static str, model: &str, path: Option<&Path>, seconds: Option<f64>) -> Self {
        Self {
            event,
            kind,
            model: model.to_string(),
            file: path.and_then(Path::file_name).map(|n| n.to_string_lossy().into_owned()),
            seconds,
            at: crate::worker::unix_now(),
        }
    }
}

/// The load events of the engine handed to the server (the target, and the draft model if one
/// is attached), counted in `metrics`.
pub(crate) fn startup_loads(engine: &Engine, metrics: &Metrics) -> Vec<LoadEvent> {
    let mut loads = vec![LoadEvent::new("load", "target", engine.model_id(), None, None)];
    metrics.model_loads.with_label_values(&["target"]).inc();
    if let Some(d) = engine.draft_model_id() {
        loads.push(LoadEvent::new("load", "draft", d, None, None));
        metrics.model_loads.with_label_values(&["draft"]).inc();
    }
    for e in &loads {
        tracing::info!(kind = e.kind, model = %e.model, "model loaded before serving");
    }
    loads
}

/// Fill in the seconds of the startup loads (see [`EngineHandle::with_load_seconds`]).
pub(crate) fn set_startup_seconds(loads: &mut [LoadEvent], target: Option<f64>, draft: Option<f64>) {
    for e in loads.iter_mut().filter(|e| e.event == "load" && e.seconds.is_none()) {
        e.seconds = match e.kind {
            "target" => target,
            _ => draft,
        };
    }
}

/// What a change asks for (the request body); absent fields keep the current setting.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct SpecChange {
    pub mode: Option<SpecMode>,
    pub draft_max: Option<usize>,
    pub adaptive: Option<bool>,
    pub sampled_verify: Option<SampledVerify>,
    /// Attach this draft model (a pulled catalog name, or a GGUF file or bundle directory
    /// under the server's models directories), unless it is the attached one.
    pub draft_model: Option<String>,
    /// Where `draft_model` is, resolved by the HTTP handler under the operator's rules
    /// ([`resolve_draft_model`]).
    pub draft_path: Option<PathBuf>,
    /// Detach the draft model.
    pub unload_draft: bool,
    /// Seconds the handler took to read `draft_model` off the worker thread, if it did.
    pub load_seconds: Option<f64>,
}

const FIELD_NAMES: [&str; 6] = [
    "mode",
    "draft_model",
    "draft_max",
    "adaptive",
    "sampled_verify",
    "unload_draft",
];
const FIELDS: &str = "'mode', 'draft_model', 'draft_max', 'adaptive', 'sampled_verify' and 'unload_draft'";

/// Parse the body of `POST /v1/models/{id}/speculative`.
fn parse_change(v: &Value) -> Result<SpecChange, ApiError> {
    if let Some(key) = v
        .as_object()
        .and_then(|o| o.keys().find(|k| !FIELD_NAMES.contains(&k.as_str())))
    {
        return Err(ApiError::invalid(
            format!("Unrecognized request argument supplied: '{key}'. A speculation change takes {FIELDS}."),
            Some(key),
        )
        .with_code("unknown_parameter"));
    }
    let b = Body::new(v)?;
    let mode = match b.str("mode")? {
        None => None,
        Some(m) => Some(SpecMode::parse(m).ok_or_else(|| {
            ApiError::invalid(
                format!("Invalid 'mode' '{m}': expected one of 'off', 'default', 'on', 'ngram', 'draft', 'mtp' and 'block'."),
                Some("mode"),
            )
        })?),
    };
    let draft_max = b.int_in("draft_max", 1, MAX_DRAFT as i128)?.map(|k| k as usize);
    let adaptive = b.bool("adaptive")?;
    let sampled_verify = match b.str("sampled_verify")? {
        None => None,
        Some(m) => Some(crate::params::sampled_verify(m, "sampled_verify")?),
    };
    let draft_model = b.str("draft_model")?.map(str::to_string);
    if draft_model.as_deref() == Some("") {
        return Err(ApiError::invalid(
            "Invalid 'draft_model': expected a file, a directory or a catalog name, got ''.",
            Some("draft_model"),
        ));
    }
    let unload_draft = b.bool("unload_draft")?.unwrap_or(false);
    if unload_draft && (draft_model.is_some() || mode == Some(SpecMode::Draft)) {
        return Err(ApiError::invalid(
            "'unload_draft' cannot be combined with 'draft_model' or mode 'draft'.",
            Some("unload_draft"),
        ));
    }
    Ok(SpecChange {
        mode,
        draft_max,
        adaptive,
        sampled_verify,
        draft_model,
        draft_path: None,
        unload_draft,
        load_seconds: None,
    })
}

/// A change on its way to the engine worker.
pub(crate) struct Control {
    pub change: SpecChange,
    /// `change.draft_model`, read and checked by the HTTP handler off the worker thread (`None`
    /// when it is the attached one, or none is asked for).
    pub loaded: Option<LoadedDraft>,
    /// The model info of the handle that asked (replaced once the change is made).
    pub cell: ModelCell,
    pub reply: oneshot::Sender<Result<Outcome, ApiError>>,
}

/// What a change did.
#[derive(Debug)]
pub(crate) struct Outcome {
    previous: SpecOptions,
    info: Arc<ModelInfo>,
    events: Vec<LoadEvent>,
}

impl Outcome {
    fn to_json(&self) -> Value {
        let m = &self.info;
        json!({
            "object": "specula.spec_change",
            "model": m.id,
            "reloaded": !self.events.is_empty(),
            "events": self.events,
            "previous": spec_json(&self.previous),
            "spec": spec_json(&m.spec),
            "draft_model": m.draft_model,
            "effective_spec": m.effective_spec,
        })
    }
}

fn spec_json(s: &SpecOptions) -> Value {
    json!({
        "mode": s.mode.as_str(),
        "draft_max": s.draft_max,
        "adaptive": s.adaptive,
        "sampled_verify": s.sampled_verify.as_str(),
    })
}

/// Which draft model is attached: the id it was attached under and its file (canonical), when
/// known (a draft model attached before serving under an id that is neither a path nor a pulled
/// catalog name has none).
#[derive(Debug, Clone, PartialEq)]
struct DraftKey {
    id: String,
    path: Option<PathBuf>,
}

/// The worker's view of what is attached, and what the tuning file chose at startup.
pub(crate) struct DraftState {
    current: Option<DraftKey>,
    startup: Option<DraftKey>,
    /// The measured choice `default` followed at startup; it was measured with the startup
    /// drafters, so it applies only while those are what is attached.
    startup_tuned: Option<TunedDefault>,
}

fn canonical(p: &Path) -> PathBuf {
    std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf())
}

impl DraftState {
    pub(crate) fn new(engine: &Engine) -> Self {
        let current = engine.draft_model_id().map(|id| DraftKey {
            id: id.to_string(),
            path: specula_engine::cache::resolve_local(id).ok().map(|p| canonical(&p)),
        });
        Self {
            startup: current.clone(),
            current,
            startup_tuned: engine.tuned_default().cloned(),
        }
    }
}

enum Action {
    Keep,
    Load { id: String, path: PathBuf },
    Unload,
}

/// Make a change on the worker thread and answer it; a change whose client went away before
/// it ran is dropped, not applied. A panic is answered as a 500 (the engine is left as the
/// panic left it).
pub(crate) fn apply(engine: &mut Engine, state: &mut DraftState, ctl: Control, metrics: &Metrics) {
    let Control {
        change,
        loaded,
        cell,
        reply,
    } = ctl;
    if reply.is_closed() {
        tracing::info!("speculation change dropped: its client went away before it ran");
        return;
    }
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        change_on_worker(engine, state, &change, loaded, &cell, metrics)
    }));
    let result = result.unwrap_or_else(|panic| {
        let msg = panic
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "unknown panic".to_string());
        tracing::error!("engine panicked while changing the speculation default: {msg}");
        Err(ApiError::internal(format!(
            "engine panicked while changing the speculation default: {msg}"
        )))
    });
    if let Err(e) = &result {
        tracing::info!("speculation change rejected: {}", e.message);
    }
    let _ = reply.send(result);
}

fn change_on_worker(
    engine: &mut Engine,
    state: &mut DraftState,
    change: &SpecChange,
    loaded: Option<LoadedDraft>,
    cell: &ModelCell,
    metrics: &Metrics,
) -> Result<Outcome, ApiError> {
    let cur = cell.read().unwrap_or_else(PoisonError::into_inner).clone();
    let previous = cur.spec;
    let spec = SpecOptions {
        mode: change.mode.unwrap_or(previous.mode),
        draft_max: change.draft_max.unwrap_or(previous.draft_max),
        adaptive: change.adaptive.unwrap_or(previous.adaptive),
        sampled_verify: change.sampled_verify.unwrap_or(previous.sampled_verify),
    };

    // What must be loaded or unloaded.
    let action = match &change.draft_model {
        Some(name) if state.current.as_ref().is_some_and(|k| &k.id == name) => Action::Keep,
        Some(name) => {
            let path = change.draft_path.clone().ok_or_else(|| {
                ApiError::invalid(
                    format!("Invalid 'draft_model': '{name}' was not resolved."),
                    Some("draft_model"),
                )
                .with_code("draft_model_not_found")
            })?;
            let same_file = state
                .current
                .as_ref()
                .is_some_and(|k| k.path.as_ref() == Some(&canonical(&path)));
            if same_file {
                Action::Keep
            } else {
                Action::Load { id: name.clone(), path }
            }
        }
        None if change.unload_draft && state.current.is_some() => Action::Unload,
        None => Action::Keep,
    };
    let draft_after = match &action {
        Action::Keep => state.current.is_some(),
        Action::Load { .. } => true,
        Action::Unload => false,
    };
    if spec.mode == SpecMode::Draft && !draft_after {
        return Err(ApiError::invalid(
            format!(
                "Speculative mode 'draft' needs a draft model, and {} has none attached: give 'draft_model' \
                 (a GGUF file, a bundle directory or a pulled catalog name).",
                cur.id
            ),
            Some("mode"),
        ));
    }
    if let Some(what) = cur.missing_native_drafter(spec.mode) {
        return Err(ApiError::invalid(
            format!(
                "Speculative mode '{}' needs {what}, and {} has none attached (start the server \
                 with --drafter DIR); nothing was changed.",
                spec.mode.as_str(),
                cur.id
            ),
            Some("mode"),
        ));
    }

    let mut events = Vec::new();
    match action {
        Action::Keep => {}
        Action::Load { id, path } => {
            let (seconds, draft) = match loaded.filter(|d| d.id() == id) {
                Some(d) => (change.load_seconds.unwrap_or(0.0), d),
                // Attached since the handler looked (or detached): read it here after all.
                None => {
                    let t = Instant::now();
                    let d = engine
                        .draft_loader()
                        .load(&path, &id, &AtomicBool::new(false))
                        .map_err(|e| unusable_draft(&id, &e))?;
                    (t.elapsed().as_secs_f64(), d)
                }
            };
            engine.attach_loaded_draft(draft);
            metrics.model_loads.with_label_values(&["draft"]).inc();
            tracing::info!(kind = "draft", model = %id, path = %path.display(), "model loaded in {seconds:.2}s");
            events.push(LoadEvent::new("load", "draft", &id, Some(&path), Some(seconds)));
            if let Some(old) = state.current.take() {
                metrics.model_unloads.with_label_values(&["draft"]).inc();
                tracing::info!(kind = "draft", model = %old.id, "model unloaded (replaced)");
                events.push(LoadEvent::new("unload", "draft", &old.id, old.path.as_deref(), None));
            }
            state.current = Some(DraftKey {
                id,
                path: Some(canonical(&path)),
            });
        }
        Action::Unload => {
            let old = state.current.take();
            let id = engine.detach_draft_model().unwrap_or_default();
            metrics.model_unloads.with_label_values(&["draft"]).inc();
            tracing::info!(kind = "draft", model = %id, "model unloaded");
            events.push(LoadEvent::new(
                "unload",
                "draft",
                &id,
                old.as_ref().and_then(|k| k.path.as_deref()),
                None,
            ));
        }
    }
    if !events.is_empty() {
        let tuned = (state.current == state.startup)
            .then(|| state.startup_tuned.clone())
            .flatten();
        engine.set_tuned_default(tuned);
    }
    // Cannot fail after the checks above; kept as the one definition of a servable default.
    crate::worker::check_spec_default(engine, &spec).map_err(|e| ApiError::invalid(e, Some("mode")))?;

    let mut loads = cur.loads.clone();
    loads.extend(events.iter().cloned());
    let drop_n = loads.len().saturating_sub(MAX_LOAD_LOG);
    loads.drain(..drop_n);
    let info = Arc::new(ModelInfo {
        spec,
        draft_model: engine.draft_model_id().map(str::to_string),
        effective_spec: effective_spec_json(engine, &spec),
        tuned_default: engine.tuned_default().and_then(|t| serde_json::to_value(t).ok()),
        loads,
        ..(*cur).clone()
    });
    *cell.write().unwrap_or_else(PoisonError::into_inner) = info.clone();
    tracing::info!(
        model = %info.id,
        spec = spec.mode.as_str(),
        draft_max = spec.draft_max,
        adaptive = spec.adaptive,
        draft_model = info.draft_model.as_deref().unwrap_or("none"),
        drafter = %info.effective_spec["drafter"],
        reloaded = !events.is_empty(),
        "speculation default changed"
    );
    Ok(Outcome { previous, info, events })
}

/// The 400 of a draft model that does not load or cannot draft for the target; server paths in
/// the loader's message are cut to file names.
fn unusable_draft(id: &str, e: &anyhow::Error) -> ApiError {
    let e = specula_engine::inspect::redact_paths(&format!("{e:#}"));
    ApiError::invalid(
        format!("The draft model '{id}' could not be attached (nothing was changed): {e}."),
        Some("draft_model"),
    )
    .with_code("draft_model_unusable")
}

/// Sets its flag when dropped: a load whose HTTP handler was dropped (the client went away)
/// stops at its next check.
struct CancelOnDrop(Arc<AtomicBool>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// Where a request's `draft_model` is, under the operator's rules: a pulled catalog model by
/// name, or a regular file or bundle directory inside one of `dirs` (`--models-dir`; a name
/// relative to a directory, or an absolute path that canonicalizes inside one). Nothing else is
/// opened, and the error is the same whether another path exists or not, so the endpoint cannot
/// probe the file system. Errors: 400 `draft_model_not_found`.
pub fn resolve_draft_model(name: &str, dirs: &[PathBuf]) -> Result<PathBuf, ApiError> {
    let not_found = |why: String| {
        ApiError::invalid(format!("Invalid 'draft_model': {why}."), Some("draft_model"))
            .with_code("draft_model_not_found")
    };
    if specula_engine::catalog::lookup(name).is_some() {
        return specula_engine::cache::resolve_catalog(name)
            .map_err(|e| not_found(specula_engine::inspect::redact_paths(&format!("{e:#}"))));
    }
    if dirs.is_empty() {
        return Err(not_found(format!(
            "'{name}' is not a catalog model, and this server loads no model files over HTTP (its operator allows them with --models-dir)"
        )));
    }
    let given = Path::new(name);
    let candidates: Vec<PathBuf> = if given.is_absolute() {
        vec![given.to_path_buf()]
    } else {
        dirs.iter().map(|d| d.join(given)).collect()
    };
    let allowed: Vec<PathBuf> = dirs.iter().filter_map(|d| std::fs::canonicalize(d).ok()).collect();
    for c in candidates {
        let Ok(real) = std::fs::canonicalize(&c) else { continue };
        let inside = allowed.iter().any(|d| real.starts_with(d));
        let kind_ok = std::fs::metadata(&real).is_ok_and(|m| m.is_file() || m.is_dir());
        if inside && kind_ok {
            return Ok(real);
        }
    }
    Err(not_found(format!(
        "'{name}' is not a catalog model, and no model of that name is in the server's models directories"
    )))
}

/// `POST /v1/models/{id}/speculative`: change the speculation default of requests without a
/// `spec` field, loading or unloading a draft model when needed (see the module docs). Other
/// `POST /v1/models/...` paths are 404.
pub async fn post_model(
    State(h): State<EngineHandle>,
    rest: Result<UrlPath<String>, axum::extract::rejection::PathRejection>,
    body: Result<Json<Value>, JsonRejection>,
) -> Response {
    let Ok(UrlPath(rest)) = rest else {
        return crate::api::bad_path().into_response();
    };
    let Some(id) = rest.strip_suffix("/speculative") else {
        let path = format!("/v1/models/{rest}");
        if rest == h.model().id {
            return ApiError::method_not_allowed_here("POST", &path, "GET").into_response();
        }
        return ApiError::route_not_found("POST", &path).into_response();
    };
    if id != h.model().id {
        return ApiError::model_not_found(id).into_response();
    }
    let mut change = match body.map_err(ApiError::from).and_then(|Json(v)| parse_change(&v)) {
        Ok(c) => c,
        Err(e) => return e.into_response(),
    };
    if let Some(name) = change.draft_model.clone() {
        let dirs = h.models_dirs();
        // A few stats and a canonicalization: off the async workers all the same.
        let resolved = tokio::task::spawn_blocking(move || resolve_draft_model(&name, &dirs)).await;
        match resolved {
            Ok(Ok(p)) => change.draft_path = Some(p),
            Ok(Err(e)) => return e.into_response(),
            Err(_) => return ApiError::internal("resolving the draft model failed").into_response(),
        }
    }
    // Read a draft model that is not the attached one here, off the worker thread (which keeps
    // generating meanwhile): its tokenizer is checked from the headers before any weight, and
    // a client that goes away cancels the load at that check.
    let mut loaded = None;
    if let (Some(id), Some(path)) = (change.draft_model.clone(), change.draft_path.clone()) {
        if h.model().draft_model.as_deref() != Some(id.as_str()) {
            let cancel = CancelOnDrop(Arc::new(AtomicBool::new(false)));
            let flag = cancel.0.clone();
            let loader = h.draft_loader();
            let t = Instant::now();
            let read = tokio::task::spawn_blocking(move || {
                let r = loader.load(&path, &id, &flag);
                r.map_err(|e| unusable_draft(&id, &e))
            })
            .await;
            drop(cancel);
            match read {
                Ok(Ok(d)) => {
                    change.load_seconds = Some(t.elapsed().as_secs_f64());
                    loaded = Some(d);
                }
                Ok(Err(e)) => {
                    tracing::info!("speculation change rejected: {}", e.message);
                    return e.into_response();
                }
                Err(_) => return ApiError::internal("loading the draft model failed").into_response(),
            }
        }
    }
    let (tx, rx) = oneshot::channel();
    if h.control(change, loaded, tx).is_err() {
        return ApiError::internal("the engine worker is not running").into_response();
    }
    match rx.await {
        Ok(Ok(outcome)) => Json(outcome.to_json()).into_response(),
        Ok(Err(e)) => e.into_response(),
        Err(_) => ApiError::internal("the engine worker stopped").into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_changes() {
        assert_eq!(parse_change(&json!({})).unwrap(), SpecChange::default());
        let c = parse_change(&json!({"mode": "draft", "draft_model": "m.gguf", "draft_max": 6, "adaptive": false}))
            .unwrap();
        assert_eq!(c.mode, Some(SpecMode::Draft));
        assert_eq!(c.draft_model.as_deref(), Some("m.gguf"));
        assert_eq!(c.draft_max, Some(6));
        assert_eq!(c.adaptive, Some(false));
        assert!(
            parse_change(&json!({"mode": "off", "unload_draft": true}))
                .unwrap()
                .unload_draft
        );
        // null = absent.
        assert_eq!(parse_change(&json!({"mode": null})).unwrap(), SpecChange::default());
        for (body, param) in [
            (json!({"mode": "fast"}), "mode"),
            (json!({"mode": 1}), "mode"),
            (json!({"draft_max": 0}), "draft_max"),
            (json!({"draft_max": MAX_DRAFT + 1}), "draft_max"),
            (json!({"adaptive": "yes"}), "adaptive"),
            (json!({"draft_model": ""}), "draft_model"),
            (json!({"spec": "ngram"}), "spec"),
            (json!({"unload_draft": true, "mode": "draft"}), "unload_draft"),
            (json!({"unload_draft": true, "draft_model": "m"}), "unload_draft"),
        ] {
            let e = parse_change(&body).unwrap_err();
            assert_eq!(e.status, axum::http::StatusCode::BAD_REQUEST, "{body}");
            assert_eq!(e.param.as_deref(), Some(param), "{body}: {e:?}");
        }
        assert!(parse_change(&json!(["mode"])).is_err());
    }

    #[test]
    fn startup_seconds_fill_only_unknown_loads() {
        let ev = |kind, seconds| LoadEvent {
            event: "load",
            kind,
            model: "m".into(),
            file: None,
            seconds,
            at: 0,
        };
        let mut loads = vec![ev("target", None), ev("draft", None), ev("draft", Some(0.5))];
        let mut got = loads.clone();
        set_startup_seconds(&mut got, Some(1.0), Some(2.0));
        loads[0].seconds = Some(1.0);
        loads[1].seconds = Some(2.0);
        assert_eq!(got, loads);
    }
}
