//! Tokenizers, built from GGUF metadata or loaded from a Hugging Face `tokenizer.json`.
//!
//! GGUF: `tokenizer.ggml.model = "gpt2"` (byte-level BPE) with `tokenizer.ggml.tokens`,
//! `.merges`, `.token_type` and the pre-tokenizer named by `tokenizer.ggml.pre`. The split
//! regexes per pre-tokenizer name are those of llama.cpp (`src/llama-vocab.cpp`,
//! `llm_tokenizer_bpe`), applied in sequence as isolating splits, followed by the GPT-2 byte-level
//! mapping. Control tokens (type 3) and unknown tokens (type 2) become special added tokens (matched
//! in text, dropped when decoding); user-defined tokens (type 4) become added tokens that decode
//! to their text, as llama.cpp treats them.
//!
//! GGUF `tokenizer.ggml.model = "llama"` (SentencePiece BPE: Llama 1/2, Gemma) has tokens with
//! scores and no merges. llama.cpp's `llm_tokenizer_spm` escapes spaces as `▁`, splits the text
//! into characters and repeatedly merges the adjacent pair whose concatenation is the
//! highest-scoring vocabulary token, the leftmost on a tie; characters left outside the
//! vocabulary become their bytes' `<0xXX>` tokens. As a BPE model that is: one merge per way of
//! splitting a token into two tokens, ranked by the token's score (the construction of
//! transformers' SentencePiece converters), with byte fallback.

use std::collections::HashMap;
use std::path::Path;

use crate::speculative::ngram::NumberVocab;
use anyhow::{anyhow, bail, Result};
use candle_core::quantized::gguf_file;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, PreTokenizerWrapper, SplitDelimiterBehavior};

/// The `tokenizer.ggml.model` values [`Tokenizer::from_gguf`] reads: byte-level BPE and
/// SentencePiece BPE.
pub const GGUF_MODELS: &[&str] = &["gpt2", "llama"];

/// GPT-2's split regex (also SmolLM's second stage), as in llama.cpp.
const GPT2_REGEX: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";
/// Qwen2 / Qwen3 split regex (llama.cpp `LLAMA_VOCAB_PRE_TYPE_QWEN2`).
const QWEN2_REGEX: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Llama 3 split regex (llama.cpp `LLAMA_VOCAB_PRE_TYPE_LLAMA3`).
const LLAMA3_REGEX: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// GPT-2's byte → printable-char table (the byte-level BPE alphabet).
pub fn bytes_to_unicode() -> Vec<char> {
    let mut bs: Vec<u32> = (b'!' as u32..=b'~' as u32)
        .chain(0xA1..=0xAC)
        .chain(0xAE..=0xFF)
        .collect();
    let mut cs = bs.clone();
    let mut n = 0;
    for b in 0..256u32 {
        if !bs.contains(&b) {
            bs.push(b);
            cs.push(256 + n);
            n += 1;
        }
    }
    let mut table = vec!['\0'; 256];
    for (b, c) in bs.iter().zip(cs) {
        table[*b as usize] = char::from_u32(c).unwrap_or('?');
    }
    table
}

/// The split regexes for a `tokenizer.ggml.pre` name, in application order.
pub fn pre_tokenizer_regexes(pre: &str) -> Result<Vec<&'static str>> {
    Ok(match pre {
        "default" | "gpt2" | "gpt-2" => vec![GPT2_REGEX],
        "smollm" | "starcoder" | "refact" | "codeshell" | "command-r" | "exaone" | "minerva-7b" => {
            vec![r"\p{N}", GPT2_REGEX]
        }
        "qwen2" | "qwen35" | "deepseek-r1-qwen" | "megrez" | "hunyuan" => vec![QWEN2_REGEX],
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "pixtral" => vec![LLAMA3_REGEX],
        other => bail!(
            "tokenizer.ggml.pre = '{other}' is not supported (known: default, gpt2, smollm, starcoder, qwen2, llama-bpe)"
        ),
    })
}

/// A tokenizer with the model's special-token knowledge. Cloning is cheap (shared vocabulary).
#[derive(Clone)]
pub struct Tokenizer {
    inner: std::sync::Arc<tokenizers::Tokenizer>,
    /// BOS token, when the model has one.
    pub bos_token: Option<(u32, String)>,
    /// The end-of-sequence token named by the bundle.
    pub eos_token: Option<(u32, String)>,
    /// Prepend BOS when encoding a prompt (`tokenizer.ggml.add_bos_token` / `add_bos_token`).
    pub add_bos: bool,
    /// The tokens that spell numbers ([`Tokenizer::numbers`]).
    numbers: std::sync::Arc<NumberVocab>,
    /// The most UTF-8 bytes any vocabulary string has (at least 1).
    max_token_bytes: usize,
    /// What [`Tokenizer::encode_with_text_spans`] needs, each part built on its first use.
    text_mode: std::sync::Arc<TextMode>,
    /// How the vocabulary strings spell text ([`Tokenizer::token_bytes`]).
    spelling: Spelling,
}

/// How a tokenizer's vocabulary strings spell the bytes of text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Spelling {
    /// GPT-2's byte alphabet (byte-level BPE): one printable character per byte.
    ByteLevel,
    /// SentencePiece: `▁` for a space, `<0xXX>` tokens for bytes outside the vocabulary, the rest
    /// as UTF-8 text.
    SentencePiece,
}

impl Spelling {
    /// The spelling a `tokenizers` object decodes with: SentencePiece when its decoder undoes
    /// `▁` or byte fallback (`Metaspace`, `ByteFallback`), else byte-level.
    fn of(inner: &tokenizers::Tokenizer) -> Self {
        let decoder = inner
            .get_decoder()
            .and_then(|d| serde_json::to_string(d).ok())
            .unwrap_or_default();
        if !decoder.contains("ByteLevel") && (decoder.contains("ByteFallback") || decoder.contains("Metaspace")) {
            Spelling::SentencePiece
        } else {
            Spelling::ByteLevel
        }
    }
}

/// The special (control) tokens' texts with a matcher for them, and a copy of the tokenizer
/// that reads them as ordinary text (built only when some data holds such text).
#[derive(Default)]
struct TextMode {
    /// Leftmost-longest matcher of the special tokens' texts, as the tokenizer's added
    /// vocabulary matches them, and the id of each pattern.
    specials: std::sync::OnceLock<(aho_corasick::AhoCorasick, Vec<u32>)>,
    /// `inner` with `encode_special_tokens` set: special-token text is tokenized as text.
    plain: std::sync::OnceLock<tokenizers::Tokenizer>,
}

/// What the n-gram drafter and the prompt-length check need from `inner`'s vocabulary (added
/// tokens included), from one pass over it:
///
/// - the tokens that spell numbers, from the vocabulary strings (byte-level BPE writes a leading
///   space as `Ġ`, SentencePiece as `▁`), and the pre-tokenizer's digit group: the most digits
///   one token of an encoded long number holds;
/// - the most UTF-8 bytes of any vocabulary string (never below one). A vocabulary string spells
///   at least as many bytes of text as its token stands for (byte-level BPE writes one text byte
///   as one or two; SentencePiece's `▁` is three for one space), so no token covers more text
///   than this.
fn vocab_facts(inner: &tokenizers::Tokenizer) -> (std::sync::Arc<NumberVocab>, usize) {
    let vocab = inner.get_vocab(true);
    let n = vocab.values().map(|&id| id as usize + 1).max().unwrap_or(0);
    let max_bytes = vocab.keys().map(String::len).max().unwrap_or(0).max(1);
    let entries = vocab.iter().map(
        |(text, &id)| match text.strip_prefix('Ġ').or_else(|| text.strip_prefix('▁')) {
            Some(rest) => (id, true, rest.to_string()),
            None => (id, false, text.clone()),
        },
    );
    let group = inner
        .encode_fast("12345678901234567890", false)
        .ok()
        .and_then(|enc| {
            enc.get_tokens()
                .iter()
                .map(|t| t.bytes().filter(u8::is_ascii_digit).count())
                .max()
        })
        .unwrap_or(1);
    (std::sync::Arc::new(NumberVocab::new(entries, n, group)), max_bytes)
}

impl TextMode {
    fn specials(&self, inner: &tokenizers::Tokenizer) -> Result<&(aho_corasick::AhoCorasick, Vec<u32>)> {
        if let Some(s) = self.specials.get() {
            return Ok(s);
        }
        let mut specials: Vec<(String, u32)> = inner
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, t)| t.special && !t.content.is_empty())
            .map(|(id, t)| (t.content, id))
            .collect();
        specials.sort_by_key(|&(_, id)| id);
        let ac = aho_corasick::AhoCorasick::builder()
            .match_kind(aho_corasick::MatchKind::LeftmostLongest)
            .build(specials.iter().map(|(t, _)| t.as_str()))
            .map_err(|e| anyhow!("building the special-token matcher: {e}"))?;
        let ids = specials.into_iter().map(|(_, id)| id).collect();
        Ok(self.specials.get_or_init(|| (ac, ids)))
    }

    fn plain(&self, inner: &tokenizers::Tokenizer) -> &tokenizers::Tokenizer {
        self.plain.get_or_init(|| {
            let mut plain = inner.clone();
            plain.set_encode_special_tokens(true);
            plain
        })
    }
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size())
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish()
    }
}

fn meta_str<'a>(md: &'a HashMap<String, gguf_file::Value>, key: &str) -> Option<&'a str> {
    md.get(key).and_then(|v| v.to_string().ok()).map(|s| s.as_str())
}

fn meta_u32(md: &HashMap<String, gguf_file::Value>, key: &str) -> Option<u32> {
    md.get(key)
        .and_then(|v| v.to_u32().ok().or_else(|| v.to_i32().ok().map(|x| x as u32)))
}

/// The metadata array `key` of `n` entries, each read by `get`; None when absent. Errors: not an
/// array, an entry `get` refuses, or a count other than `n`.
fn meta_array<T>(
    md: &HashMap<String, gguf_file::Value>,
    key: &str,
    n: usize,
    get: impl Fn(&gguf_file::Value) -> candle_core::Result<T>,
) -> Result<Option<Vec<T>>> {
    let Some(v) = md.get(key) else {
        return Ok(None);
    };
    let values: Vec<T> = v
        .to_vec()
        .map_err(|e| anyhow!("{key}: {e}"))?
        .iter()
        .map(|x| get(x).map_err(|e| anyhow!("{key}: {e}")))
        .collect::<Result<_>>()?;
    if values.len() != n {
        bail!("{key} has {} entries for {n} tokens", values.len());
    }
    Ok(Some(values))
}

/// `tokenizer.ggml.token_type` (1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6
/// byte), all normal when absent. Errors: as [`meta_array`].
fn token_types(md: &HashMap<String, gguf_file::Value>, n: usize) -> Result<Vec<i32>> {
    Ok(meta_array(md, "tokenizer.ggml.token_type", n, gguf_file::Value::to_i32)?.unwrap_or_else(|| vec![1; n]))
}

fn meta_strings(md: &HashMap<String, gguf_file::Value>, key: &str) -> Result<Vec<String>> {
    let v = md.get(key).ok_or_else(|| anyhow!("missing metadata key '{key}'"))?;
    v.to_vec()
        .map_err(|e| anyhow!("metadata '{key}' is not an array: {e}"))?
        .iter()
        .map(|x| {
            x.to_string()
                .cloned()
                .map_err(|e| anyhow!("metadata '{key}' holds a non-string: {e}"))
        })
        .collect()
}

impl Tokenizer {
    /// Build from GGUF metadata (the `tokenizer.ggml.*` keys). Errors name the missing or
    /// unsupported key.
    pub fn from_gguf(md: &HashMap<String, gguf_file::Value>) -> Result<Self> {
        let model = meta_str(md, "tokenizer.ggml.model")
            .ok_or_else(|| anyhow!("missing metadata key 'tokenizer.ggml.model'"))?;
        if model == "llama" {
            return Self::from_gguf_spm(md);
        }
        if model != "gpt2" {
            bail!(
                "tokenizer.ggml.model = '{model}' is not supported (supported: {})",
                GGUF_MODELS.join(", ")
            );
        }
        let pre = meta_str(md, "tokenizer.ggml.pre").unwrap_or("default");
        let tokens = meta_strings(md, "tokenizer.ggml.tokens")?;
        let merges = meta_strings(md, "tokenizer.ggml.merges")?;
        let types = token_types(md, tokens.len())?;
        let mut vocab = Vocab::default();
        for (i, t) in tokens.iter().enumerate() {
            vocab.insert(t.clone(), i as u32);
        }
        let merges = merges
            .iter()
            .enumerate()
            .map(|(i, m)| {
                m.split_once(' ')
                    .map(|(a, b)| (a.to_string(), b.to_string()))
                    .ok_or_else(|| anyhow!("tokenizer.ggml.merges[{i}] = '{m}' is not 'left right'"))
            })
            .collect::<Result<Vec<_>>>()?;
        let ignore_merges = matches!(pre, "llama3" | "llama-v3" | "llama-bpe");
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .ignore_merges(ignore_merges)
            .build()
            .map_err(|e| anyhow!("building the BPE model from GGUF metadata: {e}"))?;
        let mut inner = tokenizers::Tokenizer::new(bpe);
        let mut pretoks: Vec<PreTokenizerWrapper> = Vec::new();
        for re in pre_tokenizer_regexes(pre)? {
            let split = Split::new(
                SplitPattern::Regex(re.to_string()),
                SplitDelimiterBehavior::Isolated,
                false,
            )
            .map_err(|e| anyhow!("pre-tokenizer regex for '{pre}': {e}"))?;
            pretoks.push(split.into());
        }
        pretoks.push(ByteLevel::new(false, false, false).into());
        inner.with_pre_tokenizer(Some(Sequence::new(pretoks)));
        inner.with_decoder(Some(ByteLevelDecoder::default()));
        Ok(Self::finish_gguf(md, inner, &tokens, &types))
    }

    /// The added tokens of a GGUF vocabulary, the special-token ids and the derived facts: the
    /// part [`Tokenizer::from_gguf`] shares between its models.
    fn finish_gguf(
        md: &HashMap<String, gguf_file::Value>,
        mut inner: tokenizers::Tokenizer,
        tokens: &[String],
        types: &[i32],
    ) -> Self {
        let mut added = Vec::new();
        for (i, t) in tokens.iter().enumerate() {
            match types[i] {
                2 | 3 => added.push(AddedToken::from(t.clone(), true)),
                4 => added.push(AddedToken::from(t.clone(), false).normalized(false)),
                _ => {}
            }
        }
        inner.add_special_tokens(&added);
        let tok = |key: &str| meta_u32(md, key).and_then(|id| tokens.get(id as usize).map(|s| (id, s.clone())));
        let (numbers, max_token_bytes) = vocab_facts(&inner);
        Self {
            numbers,
            max_token_bytes,
            text_mode: Default::default(),
            spelling: Spelling::of(&inner),
            inner: inner.into(),
            bos_token: tok("tokenizer.ggml.bos_token_id"),
            eos_token: tok("tokenizer.ggml.eos_token_id"),
            add_bos: md
                .get("tokenizer.ggml.add_bos_token")
                .and_then(|v| v.to_bool().ok())
                .unwrap_or(false),
        }
    }

    /// A SentencePiece-BPE vocabulary (`tokenizer.ggml.model = "llama"`) as a BPE model (see the
    /// module docs). Errors name the missing or malformed key.
    fn from_gguf_spm(md: &HashMap<String, gguf_file::Value>) -> Result<Self> {
        let tokens = meta_strings(md, "tokenizer.ggml.tokens")?;
        let types = token_types(md, tokens.len())?;
        let scores = meta_array(md, "tokenizer.ggml.scores", tokens.len(), gguf_file::Value::to_f32)?
            .ok_or_else(|| anyhow!("missing metadata key 'tokenizer.ggml.scores'"))?;
        let mut vocab = Vocab::default();
        for (i, t) in tokens.iter().enumerate() {
            // A later duplicate does not take an earlier token's id (llama.cpp keeps the first).
            vocab.entry(t.clone()).or_insert(i as u32);
        }
        // Merges: every split of a normal token (type 1) into two tokens, the token's score
        // first (the highest merges first), then its id, then the split's position.
        let mut merges: Vec<(f32, u32, usize, String, String)> = Vec::new();
        for (id, t) in tokens.iter().enumerate() {
            if types[id] != 1 || vocab.get(t) != Some(&(id as u32)) {
                continue;
            }
            for (pos, _) in t.char_indices().skip(1) {
                let (l, r) = t.split_at(pos);
                if vocab.contains_key(l) && vocab.contains_key(r) {
                    merges.push((scores[id], id as u32, pos, l.to_string(), r.to_string()));
                }
            }
        }
        merges.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
        let merges = merges.into_iter().map(|(_, _, _, l, r)| (l, r)).collect();
        let mut bpe = BPE::builder().vocab_and_merges(vocab, merges).byte_fallback(true);
        if let Some((_, unk)) = meta_u32(md, "tokenizer.ggml.unknown_token_id")
            .and_then(|id| tokens.get(id as usize).map(|s| (id, s.clone())))
        {
            bpe = bpe.unk_token(unk);
        }
        let bpe = bpe
            .build()
            .map_err(|e| anyhow!("building the SentencePiece model from GGUF metadata: {e}"))?;
        let mut inner = tokenizers::Tokenizer::new(bpe);
        let add_space_prefix = md
            .get("tokenizer.ggml.add_space_prefix")
            .and_then(|v| v.to_bool().ok())
            .unwrap_or(true);
        let mut normalizers: Vec<tokenizers::NormalizerWrapper> = Vec::new();
        if add_space_prefix {
            normalizers.push(tokenizers::normalizers::Prepend::new("▁".to_string()).into());
        }
        normalizers.push(
            tokenizers::normalizers::Replace::new(" ", "▁")
                .map_err(|e| anyhow!("SentencePiece normalizer: {e}"))?
                .into(),
        );
        inner.with_normalizer(Some(tokenizers::normalizers::Sequence::new(normalizers)));
        let mut decoders: Vec<tokenizers::DecoderWrapper> = vec![
            tokenizers::normalizers::Replace::new("▁", " ")
                .map_err(|e| anyhow!("SentencePiece decoder: {e}"))?
                .into(),
            tokenizers::decoders::byte_fallback::ByteFallback::default().into(),
            tokenizers::decoders::fuse::Fuse::default().into(),
        ];
        if add_space_prefix {
            decoders.push(tokenizers::decoders::strip::Strip::new(' ', 1, 0).into());
        }
        inner.with_decoder(Some(tokenizers::decoders::sequence::Sequence::new(decoders)));
        Ok(Self::finish_gguf(md, inner, &tokens, &types))
    }

    /// Load a Hugging Face `tokenizer.json`; `bos`/`eos` come from `tokenizer_config.json` /
    /// `generation_config.json` (resolved by the bundle loader).
    pub fn from_hf_file(path: &Path, bos: Option<String>, eos: Option<String>, add_bos: bool) -> Result<Self> {
        let text = crate::bundle::read_text(path).map_err(|e| anyhow!("{}: {e}", path.display()))?;
        let inner: tokenizers::Tokenizer = text.parse().map_err(|e| anyhow!("{}: {e}", path.display()))?;
        let lookup = |s: Option<String>| s.and_then(|s| inner.token_to_id(&s).map(|id| (id, s)));
        let (numbers, max_token_bytes) = vocab_facts(&inner);
        Ok(Self {
            bos_token: lookup(bos),
            eos_token: lookup(eos),
            add_bos,
            numbers,
            max_token_bytes,
            text_mode: Default::default(),
            spelling: Spelling::of(&inner),
            inner: inner.into(),
        })
    }

    /// Vocabulary size including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Encode text; special-token text (e.g. `<|im_start|>`) maps to its token. BOS is prepended
    /// when the model asks for it and the text does not already start with it.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode_fast(text, false)
            .map_err(|e| anyhow!("tokenization failed: {e}"))?;
        let mut ids = enc.get_ids().to_vec();
        if self.add_bos {
            if let Some((bos, _)) = &self.bos_token {
                if ids.first() != Some(bos) {
                    ids.insert(0, *bos);
                }
            }
        }
        Ok(ids)
    }

    /// Encode `text` whose byte ranges `spans` are data, not markup (message contents placed
    /// by a chat template): special-token text inside a span is tokenized as the ordinary text
    /// it spells, so content cannot close a turn or open a system turn; special-token text
    /// elsewhere maps to its token as in [`Tokenizer::encode`]. With no special-token text
    /// inside any span the ids are exactly [`Tokenizer::encode`]'s (the text is split at the
    /// same special tokens and the pieces between are tokenized alike). BOS as in `encode`.
    /// Errors: a span outside `text` or not on character boundaries; tokenization failures.
    pub fn encode_with_text_spans(&self, text: &str, spans: &[std::ops::Range<usize>]) -> Result<Vec<u32>> {
        if let Some(r) = spans.iter().find(|r| {
            r.start > r.end || r.end > text.len() || !text.is_char_boundary(r.start) || !text.is_char_boundary(r.end)
        }) {
            bail!("text span {r:?} is not within the {}-byte text", text.len());
        }
        if spans.is_empty() {
            return self.encode(text);
        }
        let (specials, special_ids) = self.text_mode.specials(&self.inner)?;
        let inside = |a: usize, b: usize| spans.iter().any(|r| a < r.end && r.start < b);
        if !specials.find_iter(text).any(|m| inside(m.start(), m.end())) {
            return self.encode(text);
        }
        let plain_tok = self.text_mode.plain(&self.inner);
        let mut ids = Vec::new();
        let mut at = 0;
        let plain = |piece: &str, ids: &mut Vec<u32>| -> Result<()> {
            if !piece.is_empty() {
                let enc = plain_tok
                    .encode_fast(piece, false)
                    .map_err(|e| anyhow!("tokenization failed: {e}"))?;
                ids.extend_from_slice(enc.get_ids());
            }
            Ok(())
        };
        for m in specials.find_iter(text) {
            if inside(m.start(), m.end()) {
                continue; // data: stays in the text piece, tokenized as text
            }
            plain(&text[at..m.start()], &mut ids)?;
            ids.push(special_ids[m.pattern().as_usize()]);
            at = m.end();
        }
        plain(&text[at..], &mut ids)?;
        if self.add_bos {
            if let Some((bos, _)) = &self.bos_token {
                if ids.first() != Some(bos) {
                    ids.insert(0, *bos);
                }
            }
        }
        Ok(ids)
    }

    /// Whether `text` holds the text of a special (control) token. Errors: the matcher of the
    /// special tokens could not be built.
    pub fn has_special_text(&self, text: &str) -> Result<bool> {
        Ok(!text.is_empty() && self.text_mode.specials(&self.inner)?.0.is_match(text))
    }

    /// Decode ids to text, special tokens skipped; invalid UTF-8 becomes U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> String {
        self.inner.decode(ids, true).unwrap_or_default()
    }

    /// The text of one token as it appears in output (special tokens by name).
    pub fn token_text(&self, id: u32) -> String {
        self.inner.decode(&[id], false).unwrap_or_default()
    }

    /// Id of a token given by its exact vocabulary string.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The vocabulary string of an id.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// How this tokenizer's vocabulary strings spell text.
    pub fn spelling(&self) -> Spelling {
        self.spelling
    }

    /// The bytes of text a vocabulary token stands for, by the tokenizer's [`Spelling`]:
    /// byte-level strings through GPT-2's byte alphabet (a string outside it as its UTF-8
    /// text); SentencePiece `▁` as a space and `<0xXX>` as that byte. Added tokens are not
    /// treated specially here (their text is their bytes). None for an id outside the
    /// vocabulary.
    pub fn token_bytes(&self, id: u32) -> Option<Vec<u8>> {
        let s = self.inner.id_to_token(id)?;
        Some(match self.spelling {
            Spelling::ByteLevel => {
                static BYTE_OF: std::sync::OnceLock<HashMap<char, u8>> = std::sync::OnceLock::new();
                let byte_of = BYTE_OF.get_or_init(|| {
                    bytes_to_unicode()
                        .into_iter()
                        .enumerate()
                        .map(|(b, c)| (c, b as u8))
                        .collect()
                });
                s.chars()
                    .map(|c| byte_of.get(&c).copied())
                    .collect::<Option<Vec<u8>>>()
                    .unwrap_or_else(|| s.into_bytes())
            }
            Spelling::SentencePiece => {
                let byte = s
                    .strip_prefix("<0x")
                    .and_then(|h| h.strip_suffix('>'))
                    .filter(|h| h.len() == 2)
                    .and_then(|h| u8::from_str_radix(h, 16).ok());
                match byte {
                    Some(b) => vec![b],
                    None => s.replace('▁', " ").into_bytes(),
                }
            }
        })
    }

    /// The tokens that spell numbers and how a new number is spelt, for the n-gram drafter's
    /// structural matches and extrapolated numbers ([`crate::speculative::ngram::NgramDrafter`]).
    pub fn numbers(&self) -> std::sync::Arc<NumberVocab> {
        self.numbers.clone()
    }

    /// The most text bytes one token covers (an upper bound: the longest vocabulary string in
    /// UTF-8 bytes). A text of `n` bytes encodes to at least `n / max_token_bytes()` tokens.
    pub fn max_token_bytes(&self) -> usize {
        self.max_token_bytes
    }

    /// The underlying `tokenizers` object.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }
}

/// Check that two tokenizers encode and decode identically: same vocabulary (every id maps to the
/// same token), same BPE merges, same added/special tokens, same pre-tokenizer and normalizer.
/// A draft model must pass this against its target, since drafts are passed as token ids.
///
/// Errors name the first difference found.
pub fn check_same_tokenizer(target: &Tokenizer, draft: &Tokenizer) -> Result<()> {
    let json = |t: &Tokenizer| -> Result<serde_json::Value> {
        let s = t
            .inner()
            .to_string(false)
            .map_err(|e| anyhow::anyhow!("tokenizer serialization: {e}"))?;
        Ok(serde_json::from_str(&s)?)
    };
    let (a, b) = (json(target)?, json(draft)?);
    let (va, vb) = (target.vocab_size(), draft.vocab_size());
    if va != vb {
        anyhow::bail!("tokenizer vocabularies differ in size: target {va}, draft {vb}");
    }
    for id in 0..va as u32 {
        let (ta, tb) = (target.id_to_token(id), draft.id_to_token(id));
        if ta != tb {
            anyhow::bail!("tokenizers differ at token id {id}: target {ta:?}, draft {tb:?}");
        }
    }
    for (field, what) in [
        ("/model/merges", "BPE merges"),
        ("/added_tokens", "added/special tokens"),
        ("/pre_tokenizer", "pre-tokenizer"),
        ("/normalizer", "normalizer"),
        ("/model/type", "tokenizer model type"),
    ] {
        if a.pointer(field) != b.pointer(field) {
            anyhow::bail!("tokenizers differ in their {what}");
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::speculative::ngram::{NUMBER_DIGITS, NUMBER_NONE, NUMBER_SPACE_DIGITS};
    use gguf_file::Value as V;

    fn tokenizer(tokens: &[String], merges: &[String], types: &[i32]) -> Tokenizer {
        let mut md = HashMap::new();
        md.insert("tokenizer.ggml.model".to_string(), V::String("gpt2".into()));
        md.insert("tokenizer.ggml.pre".to_string(), V::String("qwen2".into()));
        md.insert(
            "tokenizer.ggml.tokens".to_string(),
            V::Array(tokens.iter().map(|t| V::String(t.clone())).collect()),
        );
        md.insert(
            "tokenizer.ggml.merges".to_string(),
            V::Array(merges.iter().map(|t| V::String(t.clone())).collect()),
        );
        md.insert(
            "tokenizer.ggml.token_type".to_string(),
            V::Array(types.iter().map(|&t| V::I32(t)).collect()),
        );
        Tokenizer::from_gguf(&md).expect("tokenizer")
    }

    #[test]
    fn number_classes_mark_digit_tokens() {
        let (mut tokens, mut merges, mut types) = crate::testing::tiny_vocab();
        let sp = tokens[b' ' as usize].clone();
        merges.extend([format!("{sp} 4"), "4 2".to_string()]);
        tokens.extend([format!("{sp}4"), "42".to_string(), format!("{sp}x4")]);
        types.extend([1, 1, 1]);
        let t = tokenizer(&tokens, &merges, &types);
        let c = t.numbers();
        for (id, text) in tokens.iter().enumerate() {
            let want = match text.as_str() {
                "0" | "1" | "2" | "3" | "4" | "5" | "6" | "7" | "8" | "9" | "42" => NUMBER_DIGITS,
                s if s == format!("{sp}4") => NUMBER_SPACE_DIGITS,
                _ => NUMBER_NONE,
            };
            assert_eq!(c.class(id as u32), want, "token {id} {text:?}");
        }
    }

    #[test]
    fn draft_tokenizer_check_names_the_first_difference() {
        let (tokens, merges, types) = crate::testing::tiny_vocab();
        let base = tokenizer(&tokens, &merges, &types);
        check_same_tokenizer(&base, &tokenizer(&tokens, &merges, &types)).expect("identical");

        // Rename a token no merge refers to (the last one, a special token).
        let mut renamed = tokens.clone();
        let id = renamed.len() - 1;
        renamed[id].push('x');
        let err = check_same_tokenizer(&base, &tokenizer(&renamed, &merges, &types)).expect_err("renamed token");
        assert!(err.to_string().contains(&format!("token id {id}")), "{err}");

        let shorter = &tokens[..tokens.len() - 1];
        let err = check_same_tokenizer(&base, &tokenizer(shorter, &merges, &types[..types.len() - 1]))
            .expect_err("smaller vocab");
        assert!(err.to_string().contains("differ in size"), "{err}");

        let fewer_merges = &merges[..merges.len() - 1];
        let err = check_same_tokenizer(&base, &tokenizer(&tokens, fewer_merges, &types)).expect_err("merges");
        assert!(err.to_string().contains("BPE merges"), "{err}");
    }
}
