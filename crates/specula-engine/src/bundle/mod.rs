//! Model bundles: a GGUF file, or a Hugging Face directory (config.json + safetensors +
//! tokenizer.json). [`load`] reads either into a [`LoadedBundle`].

pub mod gguf;
pub mod hf;

use std::path::Path;

use anyhow::{bail, Result};
use candle_core::Device;

use crate::arch::ModelConfig;
use crate::chat::ChatTemplate;
use crate::model::Model;
use crate::tokenizer::Tokenizer;

/// Everything loaded from a bundle.
#[derive(Debug)]
pub struct LoadedBundle {
    pub model: Model,
    pub tokenizer: Tokenizer,
    /// The bundle's chat template, if it ships one.
    pub template: Option<ChatTemplate>,
    /// Token ids that end generation (EOS, end-of-turn), sorted.
    pub eos_ids: Vec<u32>,
    /// Display name from the bundle's metadata.
    pub name: String,
    /// Weight formats in use, e.g. "Q4_1 x211, F32 x61".
    pub quantization: String,
}

/// Is `path` a bundle this crate can load, and which kind?
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BundleKind {
    Gguf,
    HuggingFace,
}

/// Classify a path: a `.gguf` file (or any file starting with the GGUF magic), or a directory
/// with `config.json`.
pub fn kind_of(path: &Path) -> Result<BundleKind> {
    if path.is_dir() {
        if path.join("config.json").exists() {
            return Ok(BundleKind::HuggingFace);
        }
        let ggufs: Vec<_> = std::fs::read_dir(path)?
            .filter_map(|e| e.ok())
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|x| x == "gguf"))
            .collect();
        if ggufs.len() == 1 {
            return Ok(BundleKind::Gguf);
        }
        bail!(
            "{}: a directory without config.json (and not exactly one .gguf file)",
            path.display()
        );
    }
    let mut magic = [0u8; 4];
    use std::io::Read;
    let mut f = open_file(path).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    if f.read_exact(&mut magic).is_ok() && &magic == b"GGUF" {
        return Ok(BundleKind::Gguf);
    }
    bail!(
        "{}: not a GGUF file (bad magic) and not a bundle directory",
        path.display()
    )
}

/// Open `path` for reading if it is a regular file (symbolic links followed). A FIFO, a device
/// or a socket is refused before it is opened: opening a FIFO blocks until a writer comes, and
/// a path reaches the loaders from requests (`/v1/models/{id}/speculative`'s `draft_model`), so
/// one request could stop the engine thread. Errors: the path does not exist, is not a regular
/// file, or cannot be opened.
pub fn open_file(path: &Path) -> std::io::Result<std::fs::File> {
    let meta = std::fs::metadata(path)?;
    if !meta.is_file() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "not a regular file (a FIFO, device or socket is not read)",
        ));
    }
    std::fs::File::open(path)
}

/// The text of the regular file `path` ([`open_file`]).
pub fn read_text(path: &Path) -> std::io::Result<String> {
    let mut s = String::new();
    std::io::Read::read_to_string(&mut open_file(path)?, &mut s)?;
    Ok(s)
}

/// Load a bundle from a GGUF file, a directory holding one GGUF file, or an HF directory.
///
/// The headers are checked first ([`crate::inspect::read_part`]: config fields, tensor names,
/// shapes and dtypes against the config, data ranges, tokenizer, chat template), so a malformed
/// bundle fails before any weight is read, with an error naming the file and the field or tensor.
pub fn load(path: &Path, device: &Device) -> Result<LoadedBundle> {
    load_with(path, device, &|_, _| Ok(()))
}

/// A check of a bundle's tokenizer and config that runs before any weight is read.
pub type BeforeWeights<'a> = &'a dyn Fn(&Tokenizer, &ModelConfig) -> Result<()>;

/// As [`load`], with `before_weights` run on the bundle's tokenizer and config once they are
/// read and before any weight is: its error ends the load, so a bundle that cannot serve (a
/// draft model with another tokenizer, a load whose client went away) costs a header read, not
/// a weight read.
pub fn load_with(path: &Path, device: &Device, before_weights: BeforeWeights) -> Result<LoadedBundle> {
    let part = crate::inspect::read_part(path, crate::inspect::Component::Target)?;
    if let Some(d) = part
        .diags
        .iter()
        .find(|d| d.severity == crate::inspect::Severity::Error)
    {
        if d.subject.is_empty() {
            bail!("{}: {}", d.file, d.message);
        }
        bail!("{}: {}: {}", d.file, d.subject, d.message);
    }
    match kind_of(path)? {
        BundleKind::Gguf if path.is_dir() => {
            let f = std::fs::read_dir(path)?
                .filter_map(|e| e.ok())
                .map(|e| e.path())
                .find(|p| p.extension().is_some_and(|x| x == "gguf"));
            match f {
                Some(f) => gguf::load(&f, device, before_weights),
                None => bail!("{}: no .gguf file", path.display()),
            }
        }
        BundleKind::Gguf => gguf::load(path, device, before_weights),
        BundleKind::HuggingFace => hf::load(path, device, before_weights),
    }
}

/// Compile a bundle's chat template with the tokenizer's BOS/EOS strings; `origin` names the
/// file and field for the error.
pub(crate) fn compile_template(src: &str, tok: &Tokenizer, origin: &str) -> Result<ChatTemplate> {
    let text = |t: &Option<(u32, String)>| t.as_ref().map(|t| t.1.clone()).unwrap_or_default();
    ChatTemplate::new(src, &text(&tok.bos_token), &text(&tok.eos_token))
        .map_err(|e| anyhow::anyhow!("{origin} does not compile: {e}"))
}

/// Tokens that end a turn by name, as llama.cpp detects end-of-generation tokens
/// (`llama_vocab::impl::load`, the EOG list).
pub(crate) fn end_of_generation_ids(tok: &Tokenizer) -> Vec<u32> {
    [
        "<|im_end|>",
        "<|endoftext|>",
        "<|eot_id|>",
        "<|eom_id|>",
        "<end_of_turn>",
        "<|end|>",
        "<|return|>",
        "</s>",
    ]
    .iter()
    .filter_map(|t| tok.token_to_id(t))
    .collect()
}
