//! The OpenAI routes' request parsing: arbitrary bytes as a JSON body, parsed as
//! `/v1/chat/completions` and as `/v1/completions` do (`specula_server::check_request`: every
//! parameter check before a request is queued, tools and `tool_choice` included), without
//! generating; a grammar the request constrains its answer to (`response_format`, or the call a
//! `tool_choice` forces) is then compiled for the tiny model, as the engine does when the request
//! starts.

#![no_main]

#[path = "common.rs"]
mod common;

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use specula_server::{check_request, EngineHandle};

fn handle() -> &'static EngineHandle {
    static H: OnceLock<EngineHandle> = OnceLock::new();
    H.get_or_init(|| EngineHandle::spawn_with_queue(common::tiny_engine(), 16))
}

fuzz_target!(|data: &[u8]| {
    let h = handle();
    // What axum's `Json` extractor does with the body.
    let Ok(body) = serde_json::from_slice::<serde_json::Value>(data) else {
        return;
    };
    for path in ["/v1/chat/completions", "/v1/completions"] {
        if let Ok(Some(grammar)) = check_request(h, path, &body) {
            common::compile(&grammar);
        }
    }
});
