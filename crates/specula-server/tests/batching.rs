//! Continuous batching: with 1, 4, 16 and 32 concurrent greedy streams mixing plain decoding,
//! n-gram and draft-model speculation, every stream's output is byte-identical to the same
//! request run alone, and the engine really decoded them together (`specula_batch_sequences`).

mod common;

use common::*;
use serde_json::{json, Value};
use specula_engine::{catalog, Engine, LoadOptions};
use specula_server::{router, EngineHandle};

const CHAT: &str = "/v1/chat/completions";

fn smollm2() -> Engine {
    smollm2_with(LoadOptions::default())
}

fn smollm2_with(opts: LoadOptions) -> Engine {
    let entry = catalog::lookup(catalog::DEFAULT_MODEL).expect("catalog entry");
    let path = specula_engine::cache::models_dir().join(entry.file_name);
    assert!(
        path.exists(),
        "{} is not in the model cache; run `specula pull {}` (scripts/test.sh does)",
        path.display(),
        catalog::DEFAULT_MODEL
    );
    let mut engine = Engine::load(&path, "smollm2", opts).expect("load SmolLM2");
    // SmolLM2 drafts for itself: the draft-model path with the model at hand.
    engine.attach_draft_model(&path, "smollm2-draft").expect("attach draft");
    engine
}

/// 32 requests over the fixture prompts (not the long-context ones): spec off / ngram / draft in turn, lengths 8..24, every
/// third one streamed.
fn requests() -> Vec<Value> {
    let text = std::fs::read_to_string(repo_root().join("tests/fixtures/prompts.jsonl")).expect("fixture prompts");
    let prompts: Vec<Value> = text
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str::<Value>(l).expect("fixture line"))
        // Short prompts: the long-context ones would make this a prefill test.
        .filter(|p| p["kind"] != "long_context")
        .collect();
    (0..32)
        .map(|i| {
            let p = &prompts[(i * 7) % prompts.len()];
            let spec = ["off", "ngram", "draft"][i % 3];
            json!({"messages": p["messages"], "temperature": 0, "max_tokens": 8 + (i * 5) % 17,
                   "spec": {"mode": spec, "draft_max": 1 + i % 6}, "stream": i % 3 == 2})
        })
        .collect()
}

fn repo_root() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(2)
        .expect("repository root")
        .to_path_buf()
}

/// The text of a reply: the message content, or the streamed content deltas.
fn content(reply: &Reply, streamed: bool) -> String {
    assert_eq!(reply.status, axum::http::StatusCode::OK, "{}", reply.text);
    if !streamed {
        return reply.json()["choices"][0]["message"]["content"]
            .as_str()
            .expect("content")
            .to_string();
    }
    // Data events only (a long wait in the queue also brings keep-alive comments, ":").
    reply
        .text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .filter_map(|d| {
            let v: Value = serde_json::from_str(d).expect("chunk");
            v["choices"][0]["delta"]["content"].as_str().map(str::to_string)
        })
        .collect()
}

/// The value of an unlabelled metric in a `/metrics` text (0 when absent).
fn metric_value(text: &str, name: &str) -> u64 {
    text.lines()
        .find(|l| l.split(' ').next() == Some(name))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse::<f64>().ok())
        .map_or(0, |v| v as u64)
}

/// Steps that decoded more than one request, from `/metrics`.
async fn batched_steps(app: &axum::Router) -> (u64, u64) {
    let text = get(app, "/metrics").await.text;
    let find = |key: &str| -> u64 {
        text.lines()
            .find(|l| l.starts_with(key))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    let single = find("specula_batch_sequences_bucket{le=\"1\"}");
    let total = find("specula_batch_sequences_count");
    (total - single, total)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_streams_are_byte_identical_to_solo_runs() {
    let reqs = requests();
    // Alone: one request at a time.
    let solo_app = router(EngineHandle::spawn_with_queue(smollm2(), 64));
    let mut solo = Vec::new();
    for r in &reqs {
        solo.push(content(&post(&solo_app, CHAT, r.clone()).await, r["stream"] == true));
    }
    assert!(solo.iter().all(|s| !s.is_empty()));
    // Together, at several batch sizes, with the prefix cache on (the requests repeat prompts).
    let cached = LoadOptions {
        prefix_cache_bytes: 256 << 20,
        ..LoadOptions::default()
    };
    let handle = EngineHandle::spawn_with_queue(smollm2_with(cached), 64);
    let app = router(handle.clone());
    for concurrency in [1usize, 4, 16, 32] {
        let handle = handle.clone().with_max_batch(concurrency);
        assert_eq!(handle.max_batch(), concurrency);
        let (before, _) = batched_steps(&app).await;
        let futures = reqs.iter().take(concurrency.max(4)).map(|r| {
            let app = app.clone();
            let r = r.clone();
            async move { content(&post(&app, CHAT, r.clone()).await, r["stream"] == true) }
        });
        let got = futures::future::join_all(futures).await;
        for (i, g) in got.iter().enumerate() {
            assert_eq!(
                g.as_bytes(),
                solo[i].as_bytes(),
                "request {i} ({}) at concurrency {concurrency}",
                reqs[i]["spec"]
            );
        }
        let (after, total) = batched_steps(&app).await;
        if concurrency == 1 {
            assert_eq!(after, before, "max_batch 1 never batches");
        } else {
            assert!(
                after > before,
                "concurrency {concurrency}: no step decoded two requests ({total} steps)"
            );
        }
    }
    // Every KV block is back in the pool once the requests are done (the gauge is set after
    // the worker answers a step's requests, so it may lag the last answer by a step).
    let mut in_use = u64::MAX;
    for _ in 0..100 {
        let m = get(&app, "/metrics").await.text;
        in_use = metric_value(&m, "specula_kv_pool_blocks_in_use");
        if in_use == 0 {
            assert!(metric_value(&m, "specula_kv_pool_bytes") > 0, "{m}");
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert_eq!(in_use, 0, "KV blocks still held after every request finished");
    let metrics = get(&app, "/metrics").await.text;
    let hits: u64 = metrics
        .lines()
        .find(|l| l.starts_with("specula_prefix_cache_hits_total"))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .expect("prefix cache hit counter");
    assert!(hits > 0, "repeated prompts hit the prefix cache");
}

/// The second identical prompt is served from the prefix cache: usage and /metrics say so, and
/// the answer is the same bytes.
#[tokio::test]
async fn a_repeated_prompt_reports_a_prefix_cache_hit() {
    let opts = LoadOptions {
        prefix_cache_bytes: 64 << 20,
        ..LoadOptions::default()
    };
    let app = router(EngineHandle::spawn_with_queue(smollm2_with(opts), 4));
    let body = json!({"messages": [{"role": "user", "content": "Name three rivers of Europe."}],
        "temperature": 0, "max_tokens": 24});
    let first = post(&app, CHAT, body.clone()).await.json();
    let second = post(&app, CHAT, body).await.json();
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .expect("cached_tokens");
    let prompt = second["usage"]["prompt_tokens"].as_u64().expect("prompt_tokens");
    assert!(cached > 0 && cached < prompt, "cached {cached} of {prompt}");
    assert_eq!(
        first["choices"][0]["message"]["content"], second["choices"][0]["message"]["content"],
        "same bytes from the cache"
    );
    let metrics = get(&app, "/metrics").await.text;
    assert!(metrics.contains("specula_prefix_cache_hits_total 1"), "{metrics}");
    assert!(metrics.contains("specula_prefix_cache_misses_total 1"), "{metrics}");
}

/// KV admission on the tiny model: a request whose worst case exceeds the budget is a 400
/// naming the numbers; two requests that fit alone but not together run one after the other
/// (never in one step), with the outputs of solo runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_kv_budget_refuses_what_cannot_fit_and_queues_what_must_wait() {
    let e = spec_engine();
    let per_token = e.kv_bytes_per_token();
    // Room for 3 KV blocks (a request reserves its worst case in whole blocks).
    let block = specula_engine::kv_cache::KV_BLOCK;
    let handle = EngineHandle::spawn_with_queue(e, 8)
        .with_max_batch(4)
        .with_kv_budget(3 * block * per_token);
    let app = router(handle.clone());
    let body = |max_tokens: usize| json!({"prompt": "the hen and the fox", "temperature": 0, "max_tokens": max_tokens, "ignore_eos": true});
    let r = post(&app, "/v1/completions", body(200)).await;
    let err = assert_error(&r, axum::http::StatusCode::BAD_REQUEST, Some("max_tokens"));
    let msg = err["message"].as_str().unwrap_or_default();
    assert!(msg.contains("KV budget") && msg.contains("MiB"), "{msg}");
    // Two requests queued together (the worker held until both wait), then released.
    let pair = |max_tokens: usize| {
        let app = app.clone();
        let handle = handle.clone();
        async move {
            let guard = handle.hold().expect("hold");
            let tasks: Vec<_> = (0..2)
                .map(|_| {
                    let app = app.clone();
                    tokio::spawn(async move { post(&app, "/v1/completions", body(max_tokens)).await })
                })
                .collect();
            while handle.waiting() < 2 {
                tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            }
            drop(guard);
            let mut texts = Vec::new();
            for t in tasks {
                let r = t.await.expect("task");
                assert_eq!(r.status, axum::http::StatusCode::OK, "{}", r.text);
                texts.push(r.json()["choices"][0]["text"].clone());
            }
            texts
        }
    };
    // Two blocks each (the prompt + 100 tokens): one fits, two do not, so they run one after
    // the other.
    let solo = post(&app, "/v1/completions", body(100)).await.json();
    let (before, _) = batched_steps(&app).await;
    for t in pair(100).await {
        assert_eq!(t, solo["choices"][0]["text"]);
    }
    let (after, _) = batched_steps(&app).await;
    assert_eq!(after, before, "the two requests never shared a step");
    // One block each: both fit, so they share steps.
    pair(10).await;
    let (shared, _) = batched_steps(&app).await;
    assert!(shared > after, "small requests were batched together");
}

/// The KV pool's gauges read the pool from the start (a preallocated pool, `--kv-budget-mb`),
/// not only after the first request (fresh-user trial: `specula_kv_pool_bytes` read 0 after the
/// log said the pool was preallocated).
#[tokio::test]
async fn kv_pool_gauges_read_the_pool_before_any_request() {
    let engine = smollm2_with(LoadOptions::default());
    let blocks = engine.model().kv_pool().reserve_bytes(4 << 20);
    assert!(blocks > 0);
    let app = router(EngineHandle::spawn_with_queue(engine, 4));
    let m = get(&app, "/metrics").await.text;
    assert!(metric_value(&m, "specula_kv_pool_bytes") > 0, "{m}");
    assert_eq!(metric_value(&m, "specula_kv_pool_blocks_in_use"), 0, "{m}");
}
