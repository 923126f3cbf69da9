//! safetensors headers: arbitrary bytes as a `.safetensors` file through the bounds-checked
//! header reader (`inspect::safetensors::scan_reader`, what `scan` runs over the file), its
//! per-tensor checks (`validate`) and the fused-experts split. Errors are fine; a panic,
//! overflow or huge allocation is not.

#![no_main]

use std::io::Cursor;

use libfuzzer_sys::fuzz_target;
use specula_engine::inspect::safetensors;

fuzz_target!(|data: &[u8]| {
    let Ok(scan) = safetensors::scan_reader(Cursor::new(data), data.len() as u64, "fuzz.safetensors") else {
        return;
    };
    let _ = safetensors::validate(&scan);
    let _ = scan.data_start();
    for t in &scan.tensors {
        let _ = t.elements();
        let _ = safetensors::dtype_size(&t.dtype);
        let _ = safetensors::split_fused_experts(&t.name, &t.dims);
    }
});
