//! With the `cuda` (or `cuda-train`) feature: compile `src/cuda/kernels.cu` with nvcc into a fat binary (sm_90
//! machine code plus compute_90 PTX) that `cuda::Gpu::open` loads at run time. Without the
//! feature this does nothing. `SPECULA_CUDA_STUB=1`
//! embeds no kernels (for checking the host code where there is no nvcc, as CI does).

use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    if std::env::var_os("CARGO_FEATURE_CUDA_BACKEND").is_none() {
        return;
    }
    println!("cargo:rerun-if-changed=src/cuda/kernels.cu");
    println!("cargo:rerun-if-env-changed=NVCC");
    println!("cargo:rerun-if-env-changed=CUDA_HOME");
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let nvcc = std::env::var("NVCC")
        .ok()
        .unwrap_or_else(|| match std::env::var("CUDA_HOME") {
            Ok(home) => format!("{home}/bin/nvcc"),
            Err(_) => "nvcc".to_string(),
        });
    let target = out.join("kernels.fatbin");
    println!("cargo:rerun-if-env-changed=SPECULA_CUDA_STUB");
    if std::env::var_os("SPECULA_CUDA_STUB").is_some_and(|v| v == "1") {
        // CI checks the CUDA build's host code on machines without nvcc: no kernels are
        // embedded, and `cuda::Gpu::open` says so at run time.
        std::fs::write(&target, b"").expect("writing an empty kernels.fatbin");
        return;
    }
    let status = Command::new(&nvcc)
        .args(["-fatbin", "-O3", "-std=c++17"])
        .args(["-gencode", "arch=compute_90,code=[sm_90,compute_90]"])
        .arg("-o")
        .arg(&target)
        .arg("src/cuda/kernels.cu")
        .status()
        .unwrap_or_else(|e| panic!("running {nvcc} (set NVCC or CUDA_HOME; docs/gpu.md): {e}"));
    assert!(status.success(), "{nvcc} failed on src/cuda/kernels.cu");
}
