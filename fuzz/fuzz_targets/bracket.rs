//! `cargo +nightly fuzz run bracket`: the Bracket tool-call parser on arbitrary input, whole and split
//! into random pieces (same events, structurally sound, no panic).
#![no_main]

use libfuzzer_sys::fuzz_target;
use specula_fuzz::tools::{fuzz, Dialect};

fuzz_target!(|data: &[u8]| fuzz::tool_parser(Dialect::Bracket, data));
