//! GGUF headers: arbitrary bytes as a GGUF file through the bounds-checked header reader
//! (`inspect::gguf::scan_reader`, what `scan` runs over the file), its tensor-directory checks
//! (`validate`), the conversion to candle's `Content` and the metadata helpers; a header that
//! reads is then written to a file (under /dev/shm when there is one) and put through what
//! loading (`bundle::gguf::GgufHeader::read`) and `specula inspect` (`inspect::inspect`) do with
//! it. Errors and diagnostics are fine; a panic, overflow or huge allocation is not.

#![no_main]

use std::io::Cursor;
use std::path::PathBuf;
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use specula_engine::bundle::gguf::GgufHeader;
use specula_engine::inspect::{self, gguf, InspectOptions};

/// The file each input is written to (one directory per process: `inspect` reads the GGUF
/// file's directory for sidecars).
fn scratch() -> &'static PathBuf {
    static P: OnceLock<PathBuf> = OnceLock::new();
    P.get_or_init(|| {
        let base = PathBuf::from("/dev/shm");
        let base = if base.is_dir() { base } else { std::env::temp_dir() };
        let dir = base.join(format!("specula-fuzz-gguf.{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("scratch dir");
        dir.join("model.gguf")
    })
}

fuzz_target!(|data: &[u8]| {
    let Ok(scan) = gguf::scan_reader(Cursor::new(data), data.len() as u64, "fuzz.gguf") else {
        return;
    };
    let _ = gguf::validate(&scan);
    for t in &scan.tensors {
        let _ = (t.elements(), t.data_bytes(), gguf::type_name(t.type_id));
    }
    for k in scan.metadata.keys() {
        let _ = gguf::meta_f64(&scan.metadata, k);
        let _ = gguf::meta_usize(&scan.metadata, k);
        let _ = gguf::meta_str(&scan.metadata, k);
        let _ = gguf::meta_array_len(&scan.metadata, k);
    }
    let _ = scan.into_content();

    let path = scratch();
    std::fs::write(path, data).expect("write the scratch file");
    if let Ok(h) = GgufHeader::read(path) {
        let _ = h.arch();
    }
    let _ = inspect::inspect(path, &InspectOptions::default());
});
