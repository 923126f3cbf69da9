//! Records the git commit the binary is built from (`SPECULA_BUILD_COMMIT`, used in tuning
//! files and GPU benchmark receipts; `-dirty` when tracked files were changed). Outside a git
//! checkout the variable is empty and "unknown" is recorded.

use std::process::Command;

fn main() {
    let commit = Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    // `-dirty` when tracked files differ from the commit (benchmark receipts say so).
    let dirty = !commit.is_empty()
        && Command::new("git")
            .args(["status", "--porcelain", "--untracked-files=no"])
            .output()
            .is_ok_and(|o| o.status.success() && !o.stdout.is_empty());
    println!(
        "cargo:rustc-env=SPECULA_BUILD_COMMIT={commit}{}",
        if dirty { "-dirty" } else { "" }
    );
    // Rebuild when HEAD moves (a commit or a branch switch) or the index changes, not on every
    // file change.
    for p in ["../../.git/HEAD", "../../.git/refs/heads", "../../.git/index"] {
        if std::path::Path::new(p).exists() {
            println!("cargo:rerun-if-changed={p}");
        }
    }
    println!("cargo:rerun-if-changed=build.rs");
}
