//! Measured tuning files (`specula_tuning.json`): what `specula tune` measured for one bundle on
//! one machine (AR and each drafter at k = 1..8, output equivalence to AR, tok/s, tau) and the
//! configuration it chose. `--spec default` follows the choice when the file matches the bundle
//! and the machine ([`TuningFile::check`]); [`crate::inspect`] reports it as the "verified" tier.
//!
//! Where the file lives ([`locations`]): next to the bundle (`<dir>/specula_tuning.json` for a
//! bundle directory, `<file stem>.specula_tuning.json` beside a GGUF file), or, for catalog
//! models and read-only bundles, `<cache>/tuning/<bundle name>.specula_tuning.json`.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::speculative::SpecMode;

/// The file name of a tuning file inside a bundle directory.
pub const TUNING_FILE: &str = "specula_tuning.json";
/// The format version written in `format`.
pub const FORMAT: u32 = 1;

/// Identity of a bundle: where it was, how big, and a fingerprint of its tensor directory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BundleId {
    /// The path as given when tuning (informational).
    pub path: String,
    /// Total bytes of the weight files.
    pub bytes: u64,
    /// `fnv1a64:` hash of every weight file's tensor directory (names, dtypes, shapes), from
    /// headers (see `inspect`); equal fingerprints mean the same tensors.
    pub fingerprint: String,
}

/// The machine a measurement was made on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Machine {
    /// CPU model (`/proc/cpuinfo` "model name"), or "unknown".
    pub cpu: String,
    /// Logical cores the process may use.
    pub logical_cores: usize,
    /// Worker threads used (`RAYON_NUM_THREADS`, else the logical cores).
    pub threads: usize,
    /// `std::env::consts::OS` / `ARCH`.
    pub os: String,
    pub arch: String,
}

impl Machine {
    /// This machine, now.
    pub fn current() -> Self {
        let cpu = std::fs::read_to_string("/proc/cpuinfo")
            .ok()
            .and_then(|s| {
                s.lines()
                    .find(|l| l.starts_with("model name"))
                    .and_then(|l| l.split_once(':'))
                    .map(|(_, v)| v.trim().to_string())
            })
            .unwrap_or_else(|| "unknown".to_string());
        let logical_cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
        let threads = crate::kernels::pool::configured_threads();
        Self {
            cpu,
            logical_cores,
            threads,
            os: std::env::consts::OS.to_string(),
            arch: std::env::consts::ARCH.to_string(),
        }
    }
}

/// The build that measured.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Build {
    /// Crate version.
    pub version: String,
    /// Git commit (short hash) the binary was built from, or "unknown".
    pub commit: String,
}

/// One measured configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TunedConfig {
    /// `ar`, `ngram` or `draft` (the configured draft model).
    pub drafter: String,
    /// Draft length per target step (0 for `ar`); with `adaptive`, the cap.
    pub k: usize,
    /// Whether k adapted per step (else fixed at `k`).
    pub adaptive: bool,
    /// Generated tokens per second of decoding over the prompt set.
    pub tok_s: f64,
    /// Mean tokens committed per target step.
    pub tau: f64,
    /// Accepted / drafted draft tokens.
    pub acceptance: f64,
    /// Output token ids equal to AR's on every prompt.
    pub equivalent: bool,
    /// The decode path the engine reported (e.g. `ngram`, or `ar (...)` when it fell back).
    pub decode_path: String,
    /// tok/s per prompt, in prompt order.
    pub per_prompt_tok_s: Vec<f64>,
}

impl TunedConfig {
    /// `ar`, `ngram k=3`, `draft k<=8 adaptive`.
    pub fn label(&self) -> String {
        match (self.drafter.as_str(), self.adaptive) {
            ("ar", _) => "ar".to_string(),
            (d, true) => format!("{d} k<={} adaptive", self.k),
            (d, false) => format!("{d} k={}", self.k),
        }
    }

    /// The speculative mode this configuration runs.
    pub fn mode(&self) -> Option<SpecMode> {
        match self.drafter.as_str() {
            "ar" => Some(SpecMode::Off),
            "ngram" => Some(SpecMode::Ngram),
            "draft" => Some(SpecMode::Draft),
            _ => None,
        }
    }
}

/// A `specula_tuning.json` file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TuningFile {
    /// [`FORMAT`].
    pub format: u32,
    pub bundle: BundleId,
    /// The draft model configured while tuning, if any.
    pub draft_model: Option<BundleId>,
    pub machine: Machine,
    pub build: Build,
    /// UTC time of the measurement, RFC 3339.
    pub date: String,
    /// Names of the built-in prompts measured, in order.
    pub prompts: Vec<String>,
    /// Tokens generated per prompt.
    pub max_tokens: usize,
    /// A configuration is chosen only when it is at least this much faster than AR (0.03 = 3%).
    pub min_gain: f64,
    /// Every configuration measured, AR first.
    pub configs: Vec<TunedConfig>,
    /// The chosen configuration (AR unless an output-equivalent one beat it by `min_gain`).
    pub best: TunedConfig,
}

/// What `--spec default` runs, from a tuning file.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TunedDefault {
    /// `Off` (AR), `Ngram` or `Draft`.
    pub mode: SpecMode,
    /// Draft length (cap, when adaptive).
    pub draft_max: usize,
    pub adaptive: bool,
    /// Measured tok/s of this choice and of AR.
    pub tok_s: f64,
    pub ar_tok_s: f64,
    /// The tuning file it came from.
    pub source: String,
}

impl TunedDefault {
    /// `ngram k=3 (1.42x AR, measured: /path/specula_tuning.json)`.
    pub fn describe(&self) -> String {
        let what = match (self.mode, self.adaptive) {
            (SpecMode::Off, _) => "ar".to_string(),
            (m, true) => format!("{} k<={} adaptive", m.as_str(), self.draft_max),
            (m, false) => format!("{} k={}", m.as_str(), self.draft_max),
        };
        let ratio = if self.ar_tok_s > 0.0 {
            self.tok_s / self.ar_tok_s
        } else {
            1.0
        };
        format!("{what} ({ratio:.2}x AR, measured: {})", self.source)
    }
}

impl TuningFile {
    /// Does this file apply to `bundle` on `machine`? `Err` says why not (another bundle, another
    /// machine, another thread count, an unknown format).
    pub fn check(&self, bundle: &BundleId, machine: &Machine) -> Result<(), String> {
        if self.format != FORMAT {
            return Err(format!("format {} (this build reads {FORMAT})", self.format));
        }
        if self.bundle.fingerprint != bundle.fingerprint || self.bundle.bytes != bundle.bytes {
            return Err(format!(
                "measured for another bundle ({}, fingerprint {})",
                self.bundle.path, self.bundle.fingerprint
            ));
        }
        if self.machine.cpu != machine.cpu || self.machine.logical_cores != machine.logical_cores {
            return Err(format!(
                "measured on another machine ({}, {} cores)",
                self.machine.cpu, self.machine.logical_cores
            ));
        }
        if self.machine.threads != machine.threads {
            return Err(format!(
                "measured with {} threads, running with {}",
                self.machine.threads, machine.threads
            ));
        }
        Ok(())
    }

    /// The measured choice given the draft model configured now: the recorded best when its
    /// drafter is available, else the fastest output-equivalent configuration that is
    /// (at least `min_gain` faster than AR), else AR. `draft_model` is the identity of the draft
    /// model configured now, if any.
    pub fn choice(&self, draft_model: Option<&BundleId>, source: &Path) -> TunedDefault {
        let same_draft = match (&self.draft_model, draft_model) {
            (Some(a), Some(b)) => a.fingerprint == b.fingerprint,
            _ => false,
        };
        let available = |c: &TunedConfig| c.drafter != "draft" || same_draft;
        let ar = self.configs.iter().find(|c| c.drafter == "ar");
        let ar_tok_s = ar.map(|c| c.tok_s).unwrap_or(0.0);
        let pick = if available(&self.best) {
            Some(self.best.clone())
        } else {
            self.configs
                .iter()
                .filter(|c| c.drafter != "ar" && c.equivalent && available(c))
                .filter(|c| c.tok_s > ar_tok_s * (1.0 + self.min_gain))
                .max_by(|a, b| a.tok_s.total_cmp(&b.tok_s))
                .cloned()
        };
        let (mode, k, adaptive, tok_s) = match pick.as_ref().and_then(|c| c.mode().map(|m| (m, c))) {
            Some((m, c)) => (m, c.k.max(1), c.adaptive, c.tok_s),
            None => (SpecMode::Off, 1, false, ar_tok_s),
        };
        TunedDefault {
            mode,
            draft_max: k,
            adaptive,
            tok_s,
            ar_tok_s,
            // Shown to clients: the file's name, not its server path.
            source: source
                .file_name()
                .map_or_else(|| source.display().to_string(), |n| n.to_string_lossy().into_owned()),
        }
    }

    /// Read and parse a tuning file. Errors name the file.
    pub fn read(path: &Path) -> anyhow::Result<Self> {
        let s = std::fs::read_to_string(path).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        serde_json::from_str(&s).map_err(|e| anyhow::anyhow!("{}: not a tuning file: {e}", path.display()))
    }
}

/// A bundle's display name: the directory name, or the GGUF file's stem.
fn bundle_stem(bundle: &Path) -> String {
    let name = if bundle.is_dir() {
        bundle.file_name()
    } else {
        bundle.file_stem()
    };
    name.map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "bundle".to_string())
}

/// Where the tuning file of `bundle` may live, in lookup order: next to the bundle, then in the
/// cache (`<cache>/tuning/<name>.specula_tuning.json`).
pub fn locations(bundle: &Path) -> [PathBuf; 2] {
    let beside = if bundle.is_dir() {
        bundle.join(TUNING_FILE)
    } else {
        bundle.with_file_name(format!("{}.{TUNING_FILE}", bundle_stem(bundle)))
    };
    let cached = crate::cache::cache_dir()
        .join("tuning")
        .join(format!("{}.{TUNING_FILE}", bundle_stem(bundle)));
    [beside, cached]
}

/// Where `specula tune` writes: the cache for bundles inside the model cache (catalog models),
/// else next to the bundle.
pub fn write_location(bundle: &Path) -> PathBuf {
    let [beside, cached] = locations(bundle);
    let in_cache = bundle
        .canonicalize()
        .ok()
        .zip(crate::cache::models_dir().canonicalize().ok())
        .is_some_and(|(b, m)| b.starts_with(m));
    if in_cache {
        cached
    } else {
        beside
    }
}

/// The first tuning file found for `bundle` ([`locations`] order), parsed. A file that exists but
/// does not parse is returned as `Err` with its path.
pub fn find(bundle: &Path) -> Option<(PathBuf, anyhow::Result<TuningFile>)> {
    locations(bundle).into_iter().find(|p| p.is_file()).map(|p| {
        let r = TuningFile::read(&p);
        (p, r)
    })
}

/// Now as RFC 3339 UTC (`2026-11-30T12:34:56Z`).
pub fn now_rfc3339() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Howard Hinnant's civil_from_days.
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}
