//! Where pulled models live: `$SPECULA_CACHE` if set, else the user's cache directory
//! (`~/.cache/specula` on Linux), with model files under `models/`.

use std::path::PathBuf;

/// The cache root.
pub fn cache_dir() -> PathBuf {
    match std::env::var_os("SPECULA_CACHE") {
        Some(p) if !p.is_empty() => PathBuf::from(p),
        _ => dirs::cache_dir().unwrap_or_else(std::env::temp_dir).join("specula"),
    }
}

/// The directory holding pulled model files.
pub fn models_dir() -> PathBuf {
    cache_dir().join("models")
}
