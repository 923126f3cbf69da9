//! Where pulled models live: `$SPECULA_CACHE` if set, else the user's cache directory
//! (`~/.cache/specula` on Linux), with model files under `models/`.

use std::path::{Path, PathBuf};

use crate::catalog::CatalogEntry;

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

/// The verified file of a pulled catalog model under the cache root `cache`, if present: it must
/// exist with exactly the catalog size, and its `<file>.sha256` marker (written by `specula pull`
/// after a full hash check) must record the catalog hash. The file itself is not re-hashed.
pub fn verified_model_in(cache: &Path, entry: &CatalogEntry) -> Option<PathBuf> {
    let path = cache.join("models").join(entry.file_name);
    let meta = std::fs::metadata(&path).ok()?;
    if !meta.is_file() || meta.len() != entry.size_bytes {
        return None;
    }
    let mut marker = path.as_os_str().to_owned();
    marker.push(".sha256");
    let marker = std::fs::read_to_string(PathBuf::from(marker)).ok()?;
    let recorded = marker.split_whitespace().next()?;
    recorded.eq_ignore_ascii_case(entry.sha256).then_some(path)
}

/// A model argument (a GGUF file, a bundle directory or a catalog name) as a local path, without
/// fetching anything: an existing path as is, else the verified file of a pulled catalog model
/// ([`verified_model_in`] under [`cache_dir`]). Errors say which: no such file and no such
/// catalog name, or a catalog model that is not pulled yet (`specula pull NAME`).
pub fn resolve_local(spec: &str) -> anyhow::Result<PathBuf> {
    let as_path = Path::new(spec);
    if !spec.is_empty() && as_path.exists() {
        return Ok(as_path.to_path_buf());
    }
    resolve_catalog(spec)
}

/// The verified local file of the catalog model `spec` (never a path: a name only). Errors:
/// not a catalog name, or not downloaded.
pub fn resolve_catalog(spec: &str) -> anyhow::Result<PathBuf> {
    let Some(entry) = crate::catalog::lookup(spec) else {
        anyhow::bail!(
            "'{spec}' is not a file or directory, and not a catalog name (known: {})",
            crate::catalog::names().join(", ")
        );
    };
    verified_model_in(&cache_dir(), &entry).ok_or_else(|| {
        anyhow::anyhow!(
            "catalog model '{spec}' is not downloaded (expected at {}); run `specula pull {spec}` first",
            models_dir().join(entry.file_name).display()
        )
    })
}
