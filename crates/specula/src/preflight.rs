//! Before and right after a load (`serve`, `generate`): inspect the bundle from its headers,
//! check the memory estimate against what the machine has (`--memory-check`), and make
//! `--spec default` follow a tuning file measured on this machine.

use std::path::Path;

use anyhow::Result;
use specula_engine::inspect::{self, memory, BundleReport, InspectOptions};
use specula_engine::speculative::{SpecMode, SpecOptions};
use specula_engine::Engine;

/// `--memory-check`.
#[derive(clap::ValueEnum, Debug, Clone, Copy, Default)]
pub enum MemoryCheckArg {
    /// No check.
    Off,
    /// Log a warning with the numbers when the estimate exceeds available memory; load anyway.
    #[default]
    Advisory,
    /// Refuse to load when the estimate exceeds available memory.
    Strict,
}

impl From<MemoryCheckArg> for memory::MemoryCheck {
    fn from(a: MemoryCheckArg) -> Self {
        match a {
            MemoryCheckArg::Off => Self::Off,
            MemoryCheckArg::Advisory => Self::Advisory,
            MemoryCheckArg::Strict => Self::Strict,
        }
    }
}

/// Inspect `model` (and `draft`) from headers and run the memory preflight, with the KV cache
/// estimated for `kv_context` tokens (`--ctx-size`; default: the model's window). Strict mode errors
/// with the numbers when the estimate exceeds MemAvailable; advisory mode warns. Problems in the
/// bundle itself are left to the loader, whose errors are the same diagnostics.
pub fn before_load(
    model: &Path,
    draft: Option<&Path>,
    check: MemoryCheckArg,
    kv_context: Option<usize>,
) -> Result<Option<BundleReport>> {
    let opts = InspectOptions {
        draft_model: draft.map(Path::to_path_buf),
        kv_context,
        ..Default::default()
    };
    let report = match inspect::inspect(model, &opts) {
        Ok(r) => r,
        Err(e) => {
            tracing::debug!("inspect before load: {e:#}");
            return Ok(None);
        }
    };
    if let Some(m) = &report.memory {
        let check = memory::MemoryCheck::from(check);
        if check != memory::MemoryCheck::Off {
            let p = memory::preflight(m, memory::available_memory(), check)?;
            if p.over {
                tracing::warn!(
                    "memory check (advisory): the load may not fit: {}; loading anyway (--memory-check strict refuses)",
                    p.summary
                );
            } else {
                tracing::info!("memory check: {}", p.summary);
            }
        }
    }
    Ok(Some(report))
}

/// With `--spec default`, make the engine follow the bundle's tuning file when it was measured
/// on this machine for this bundle (and, for a draft-model choice, the same draft model), and
/// log what `default` runs and why.
pub fn apply_tuning(engine: &mut Engine, report: Option<&BundleReport>, spec: &SpecOptions) {
    if spec.mode != SpecMode::Default {
        return;
    }
    let tuning = report.and_then(|r| r.tuning.as_ref());
    match tuning {
        Some(t) if t.applies => {
            if let Some(choice) = &t.choice {
                tracing::info!("spec default: {} (tuning file)", choice.describe());
                engine.set_tuned_default(Some(choice.clone()));
            }
        }
        Some(t) => tracing::info!(
            "spec default: built-in order (MTP head, block drafter, draft model, n-gram); tuning file {} does not apply: {}",
            t.path,
            t.reason.as_deref().unwrap_or("?")
        ),
        None => tracing::info!(
            "spec default: built-in order (MTP head, block drafter, draft model, n-gram), unmeasured: \
             run `specula tune` to measure what pays on this machine"
        ),
    }
}

/// [`before_load`] for command-line model arguments (paths or catalog names, pulled if missing,
/// as the load that follows would).
pub fn for_args(
    model: &str,
    draft: Option<&str>,
    check: MemoryCheckArg,
    kv_context: Option<usize>,
) -> Result<Option<BundleReport>> {
    let path = crate::pull::resolve_model(model, true)?;
    let draft = draft.map(|d| crate::pull::resolve_model(d, true)).transpose()?;
    before_load(&path, draft.as_deref(), check, kv_context)
}
