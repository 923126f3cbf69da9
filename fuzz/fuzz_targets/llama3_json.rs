//! `cargo +nightly fuzz run llama3_json`: the Llama3 tool-call parser on arbitrary input, whole and split
//! into random pieces (same events, structurally sound, no panic).
#![no_main]

use libfuzzer_sys::fuzz_target;
use specula_fuzz::tools::{fuzz, Dialect};

fuzz_target!(|data: &[u8]| fuzz::tool_parser(Dialect::Llama3, data));
