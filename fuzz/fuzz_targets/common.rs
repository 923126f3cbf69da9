//! Shared by the fuzz targets: the tiny random model (built once per process) and a panic hook
//! that tells a panic the server catches from one that would take it down.

#![allow(dead_code)]

use std::cell::RefCell;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Once;

use specula_engine::constraint::GrammarSpec;
use specula_engine::model::Family;
use specula_engine::testing::{write_tiny_gguf, TinySpec};
use specula_engine::{Engine, LoadOptions};

/// The client-facing id of the tiny model (what a request's `model` field names).
pub const MODEL: &str = "tiny";

/// Load the tiny random Llama-family model (the one `crates/specula-server/tests` serve),
/// written to a temporary file that is removed once loaded.
pub fn tiny_engine() -> Engine {
    install_panic_hook();
    let path = std::env::temp_dir().join(format!(
        "specula-fuzz-tiny.{}.{:?}.gguf",
        std::process::id(),
        std::thread::current().id()
    ));
    write_tiny_gguf(&path, &TinySpec::new(Family::Llama)).expect("write the tiny model");
    let e = Engine::load(&path, MODEL, LoadOptions::default()).expect("load the tiny model");
    let _ = std::fs::remove_file(&path);
    e
}

thread_local! {
    /// An engine for compiling grammars (`Engine::compile_grammar` takes `&mut self`).
    static COMPILER: RefCell<Engine> = RefCell::new(tiny_engine());
}

/// Compile `spec` as the engine does when a request with it starts (`Engine::compile_grammar`:
/// the size bound, then the compile on its own big-stack thread). Errors are the client's.
pub fn compile(spec: &GrammarSpec) -> bool {
    COMPILER.with(|e| e.borrow_mut().compile_grammar(spec).is_ok())
}

/// Panics caught on the grammar-compile thread (the server answers them as a 400).
pub static CAUGHT_PANICS: AtomicUsize = AtomicUsize::new(0);

/// libfuzzer-sys aborts on every panic, even one that is caught. The server catches a panic of
/// the grammar library (on the `grammar-compile` thread, `GrammarCompiler::compile`) and answers
/// it as the client's error, so such a panic is counted (the first few printed) and not a
/// crash; any other panic still aborts.
pub fn install_panic_hook() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let fuzzer_hook = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if std::thread::current().name() == Some("grammar-compile") {
                let n = CAUGHT_PANICS.fetch_add(1, Ordering::Relaxed);
                if n < 5 {
                    eprintln!("caught panic #{} on the grammar-compile thread (an error to the client): {info}", n + 1);
                }
                return;
            }
            fuzzer_hook(info)
        }));
    });
}
