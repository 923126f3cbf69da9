//! Records the git commit the binary is built from (`SPECULA_BUILD_COMMIT`, used in tuning
//! files). Outside a git checkout the variable is empty and "unknown" is recorded.

use std::process::Command;

fn main() {
    let commit = Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    println!("cargo:rustc-env=SPECULA_BUILD_COMMIT={commit}");
    // Rebuild when HEAD moves (a commit or a branch switch), not on every file change.
    for p in ["../../.git/HEAD", "../../.git/refs/heads"] {
        if std::path::Path::new(p).exists() {
            println!("cargo:rerun-if-changed={p}");
        }
    }
    println!("cargo:rerun-if-changed=build.rs");
}
