//! `cargo +nightly fuzz run reasoning`: the `<think>` splitter on arbitrary input, whole and
//! split into random pieces (same events, no panic).
#![no_main]

use libfuzzer_sys::fuzz_target;
use specula_fuzz::tools::fuzz;

fuzz_target!(|data: &[u8]| fuzz::reasoning(data));
