//! Token constraints: structured output (JSON object, JSON schema, regex, Lark grammar) through
//! `llguidance`, applied as a sampling-time mask.
//!
//! A constraint masks each logits row with the state *after* every earlier token of the row's
//! prefix and advances only on committed tokens. Under speculation, verify row i is masked with
//! the state after `draft[..i]` (the drafts are committed into the constraint as they are
//! accepted, like penalties see them), so the committed tokens are exactly those plain decoding
//! with the same mask would give; the committed state never needs rolling back, because a
//! rejected draft token was never committed. A deterministic draft (n-gram lookup, greedy model
//! drafts) is cut at its first token the grammar does not allow ([`Constraint::valid_prefix`]):
//! such a token would be rejected anyway. A sampled draft is not (whether a drawn token is
//! verified must not depend on it). Model drafters mask their own rows with the state after
//! the drafts before them ([`Constraint::mask_after`], on a copy of the matcher), so they rarely
//! draw a forbidden token at all.

use std::sync::Arc;

use anyhow::{anyhow, bail, Result};
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, TokEnv, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory};

use crate::tokenizer::Tokenizer;

/// A sampling-time token constraint.
pub trait Constraint: Send {
    /// Set the logits of tokens not allowed next to `-inf`. `logits` has one entry per model
    /// vocabulary row.
    fn mask(&mut self, logits: &mut [f32]) -> Result<()>;
    /// Advance over a committed token (one the last mask allowed).
    fn commit(&mut self, token: u32) -> Result<()>;
    /// How many leading tokens of `tokens` the constraint allows in sequence from its current
    /// state (without advancing).
    fn valid_prefix(&mut self, tokens: &[u32]) -> usize {
        tokens.len()
    }
    /// Mask `logits` as [`Constraint::mask`] would once `drafted` were committed (the tokens a
    /// drafter proposed so far in this step), leaving the state as it was. Returns whether it
    /// masked: `false` (the default, and where `drafted` is not allowed in sequence) leaves the
    /// row as it is. A drafter's rows so masked propose only what the target's masked verify
    /// rows can accept ([`crate::speculative::DraftGuide::mask`]).
    fn mask_after(&mut self, drafted: &[u32], logits: &mut [f32]) -> Result<bool> {
        let _ = (drafted, logits);
        Ok(false)
    }
    /// Whether [`Constraint::mask_after`] may mask a draft row in the current state (a drafter
    /// with a reduced vocabulary then builds full-vocabulary rows for it). Default: no.
    fn masks_drafts(&self) -> bool {
        false
    }
}

/// What a request constrains its output to.
#[derive(Debug, Clone, PartialEq)]
pub enum GrammarSpec {
    /// Any JSON object (`response_format: {"type": "json_object"}`).
    JsonObject,
    /// JSON matching a JSON Schema (`response_format: {"type": "json_schema", ...}`).
    JsonSchema(serde_json::Value),
    /// A regular expression (llguidance regex syntax).
    Regex(String),
    /// A Lark grammar (llguidance's Lark dialect).
    Lark(String),
    /// A Lark grammar built from a request's tools, forcing a call (`tool_choice` `"required"`
    /// or a named function): compiled as [`GrammarSpec::Lark`], its errors are the tools'.
    ToolCalls(String),
}

/// Builds constraints for one tokenizer. Building the token trie costs ~0.1 s for a 150k vocab,
/// so an engine keeps one.
pub struct GrammarCompiler {
    factory: ParserFactory,
    vocab: usize,
    /// The bytes of every token id ([`token_words`]), shared with reasoning constraints.
    words: Arc<Vec<Vec<u8>>>,
    /// The model's end-of-generation ids; the first is the one llguidance knows.
    eos: Arc<[u32]>,
}

impl std::fmt::Debug for GrammarCompiler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarCompiler").field("vocab", &self.vocab).finish()
    }
}

/// The bytes each token id stands for, in toktrie's convention: vocabulary tokens as the text
/// they decode to ([`Tokenizer::token_bytes`]: byte-level BPE through the GPT-2 byte alphabet,
/// SentencePiece with `▁` as a space and `<0xXX>` byte tokens); special (control) tokens as
/// `0xFF` followed by their text (so a grammar never matches them as text), other added tokens
/// as their text, which they decode to; ids the tokenizer does not know (model rows past the
/// vocabulary) as empty words (never allowed).
fn token_words(tokenizer: &Tokenizer, rows: usize) -> Vec<Vec<u8>> {
    let added = tokenizer.inner().get_added_tokens_decoder();
    (0..rows as u32)
        .map(|id| {
            if let Some(t) = added.get(&id) {
                if !t.special {
                    // A user-defined token (Qwen's `<tool_call>`) decodes to its text, so a
                    // grammar may match it as that text.
                    return t.content.as_bytes().to_vec();
                }
                let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                w.extend_from_slice(t.content.as_bytes());
                return w;
            }
            tokenizer.token_bytes(id).unwrap_or_default()
        })
        .collect()
}

impl GrammarCompiler {
    /// For `tokenizer` and a model with `rows` logits rows; `eos` are the model's
    /// end-of-generation ids (a completed grammar may end with any of them, as Llama 3's
    /// `<|eot_id|>` or `<|eom_id|>`; ids past the rows are left out). Errors: no id in `eos`
    /// is below `rows`.
    pub fn new(tokenizer: &Tokenizer, rows: usize, eos: &[u32]) -> Result<Self> {
        let eos: Vec<u32> = eos.iter().copied().filter(|&t| (t as usize) < rows).collect();
        let &first = eos
            .first()
            .ok_or_else(|| anyhow!("no end-of-generation token within the model's {rows} logits to end a grammar"))?;
        let words = token_words(tokenizer, rows);
        let info = TokRxInfo::new(rows as u32, first);
        let trie = TokTrie::from(&info, &words);
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| anyhow!("grammar setup: {e}"))?;
        factory.quiet();
        Ok(Self {
            factory,
            vocab: rows,
            words: Arc::new(words),
            eos: eos.into(),
        })
    }

    /// The bytes of every token id, indexed by id (special tokens as `0xFF` + their text).
    pub fn words(&self) -> &Arc<Vec<Vec<u8>>> {
        &self.words
    }

    /// Compile a constraint. Errors (a bad schema, regex or grammar, one too large) are the
    /// client's: the message says what is wrong, in one line.
    ///
    /// The grammar library compiles recursively (a chain of rules or `$ref`s, nested groups):
    /// the work runs on a thread of its own with a [`COMPILE_STACK_BYTES`] stack (reserved, not
    /// touched unless used), and grammars are bounded by [`MAX_GRAMMAR_BYTES`] first, so no
    /// request can overflow a stack, which would abort the whole server.
    pub fn compile(&self, spec: &GrammarSpec) -> Result<GrammarConstraint> {
        let size = match spec {
            GrammarSpec::JsonObject => 0,
            GrammarSpec::JsonSchema(s) => s.to_string().len(),
            GrammarSpec::Regex(r) => r.len(),
            GrammarSpec::Lark(l) | GrammarSpec::ToolCalls(l) => l.len(),
        };
        if size > MAX_GRAMMAR_BYTES {
            bail!("the grammar is {size} bytes; at most {MAX_GRAMMAR_BYTES} are accepted");
        }
        std::thread::scope(|scope| {
            std::thread::Builder::new()
                .name("grammar-compile".into())
                .stack_size(COMPILE_STACK_BYTES)
                .spawn_scoped(scope, || self.compile_here(spec))
                .map_err(|e| anyhow!("grammar: could not start its compilation: {e}"))?
                .join()
                .unwrap_or_else(|_| {
                    Err(anyhow!(
                        "the grammar could not be compiled (the grammar library failed on it)"
                    ))
                })
        })
    }

    fn compile_here(&self, spec: &GrammarSpec) -> Result<GrammarConstraint> {
        let grammar = match spec {
            GrammarSpec::JsonObject => {
                TopLevelGrammar::from_json_schema(compact_layout(serde_json::json!({"type": "object"})))
            }
            GrammarSpec::JsonSchema(s) => TopLevelGrammar::from_json_schema(compact_layout(s.clone())),
            GrammarSpec::Regex(r) => TopLevelGrammar::from_regex(r),
            GrammarSpec::Lark(l) | GrammarSpec::ToolCalls(l) => TopLevelGrammar::from_lark(l.clone()),
        };
        let parser = self
            .factory
            .create_parser(grammar)
            .map_err(grammar_error(spec.param()))?;
        let mut matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(grammar_error(spec.param())(anyhow!("{e}")));
        }
        // A grammar that compiles may still admit no first token (a regex of the empty
        // language, a rule that only recurses into itself): its first mask is an error. Found
        // here it is the client's error, before any token; the mask is kept for the first step.
        // (A grammar whose every sentence is infinite but that has a first token,
        // `start: "a" start`, is not caught: it runs to max_tokens.)
        let first = match matcher.compute_mask_or_eos() {
            Ok(m) => m,
            Err(e) => {
                let first = brief(&e);
                tracing::debug!(error = %format!("{e:#}"), "grammar rejected at its first mask");
                return Err(if first.starts_with("NoExtensionBias") {
                    anyhow!("no output can satisfy it: the grammar admits no first token")
                } else {
                    anyhow!("the grammar could not be started: {first}")
                });
            }
        };
        Ok(GrammarConstraint {
            param: spec.param(),
            matcher,
            vocab: self.vocab,
            eos: self.eos.clone(),
            state_mask: Some(first),
        })
    }
}

/// llguidance's JSON options (its `x-guidance` object) for JSON a model writes under a mask:
/// `", "` between items, `": "` after keys and no other whitespace, as chat templates print
/// JSON. llguidance's default allows any run of whitespace between two tokens, and a model that
/// prefers whitespace to the next required key emits it until `max_tokens` (Qwen2.5-Coder-0.5B
/// with a book schema whose third key never came); a bound on each run (llama.cpp's one space,
/// or newlines and up to 20 of indentation) still let that model put 18 tabs before the comma.
/// `lenient`: unsupported keywords and formats are ignored (OpenAI's non-strict tools) instead
/// of being errors.
pub fn json_layout(lenient: bool) -> serde_json::Value {
    serde_json::json!({
        "whitespace_flexible": false,
        "item_separator": ", ",
        "key_separator": ": ",
        "lenient": lenient,
    })
}

/// `schema` with [`json_layout`] (not lenient) under the options the schema sets itself
/// (`x-guidance`: its keys win, the others are the layout's); a schema that is not an object is
/// left as it is.
fn compact_layout(mut schema: serde_json::Value) -> serde_json::Value {
    if let Some(o) = schema.as_object_mut() {
        let mut options = json_layout(false);
        match (options.as_object_mut(), o.get("x-guidance")) {
            (Some(base), Some(serde_json::Value::Object(own))) => {
                base.extend(own.iter().map(|(k, v)| (k.clone(), v.clone())));
            }
            // Not an object: llguidance names the error.
            (_, Some(_)) => return schema,
            _ => {}
        }
        o.insert("x-guidance".into(), options);
    }
    schema
}

/// An llguidance matcher as a [`Constraint`].
pub struct GrammarConstraint {
    /// The request parameter the grammar came from, named by its errors.
    param: &'static str,
    matcher: Matcher,
    vocab: usize,
    /// The model's end-of-generation ids: wherever the grammar allows its end (the first id, the
    /// one llguidance knows), every one of them is allowed, and each is committed as the first.
    eos: Arc<[u32]>,
    /// The mask of the committed state, when already computed (at compile time for the start,
    /// or by [`Constraint::mask_after`] for a draft row with nothing drafted before it, which
    /// the verify row at that position needs again): the next [`Constraint::mask`] takes it,
    /// [`Constraint::commit`] drops it.
    state_mask: Option<llguidance::toktrie::SimpleVob>,
}

impl GrammarConstraint {
    /// `token` as the matcher knows it at its current state: an end-of-generation id that the
    /// grammar does not take as a token of its own (a Lark grammar may name `<|eom_id|>`) is the
    /// end, the first id.
    fn as_matcher_token(&mut self, token: u32) -> u32 {
        if token != self.eos[0] && self.eos.contains(&token) && self.matcher.validate_tokens(&[token]).unwrap_or(0) == 0
        {
            self.eos[0]
        } else {
            token
        }
    }
}

/// The first line of an llguidance error: its later lines dump the parser's state, which is
/// for a grammar's author, not a client.
/// The first line of an error, at most 300 characters: what a client is told of the grammar
/// library's errors (which can carry a caught panic's backtrace, with paths of the build).
fn brief(e: &anyhow::Error) -> String {
    let line = format!("{e}").lines().next().unwrap_or_default().to_string();
    match line.char_indices().nth(300) {
        Some((i, _)) => format!("{}...", &line[..i]),
        None => line,
    }
}

/// The largest grammar, JSON schema (as JSON text), regex or tool grammar a request may
/// carry: far above hand-written grammars and schemas, and a bound on the compiler's work.
pub const MAX_GRAMMAR_BYTES: usize = 512 * 1024;

/// The stack of the thread that compiles a grammar: deep enough for any grammar within
/// [`MAX_GRAMMAR_BYTES`] (`tests/grammar_limits.rs` compiles the deepest ones).
pub const COMPILE_STACK_BYTES: usize = 1 << 30;

/// An error of the grammar library on a request's grammar (it failed to compile, or hit one of
/// its limits mid-generation, such as more than 2,000 items in a parser row): the client's
/// error, reported in one line.
#[derive(Debug, Clone)]
pub struct GrammarError {
    /// The request parameter the grammar came from: `response_format`, or `tools` for a
    /// grammar built from forced tool calls ([`GrammarSpec::param`]).
    pub param: &'static str,
    pub message: String,
}

impl std::fmt::Display for GrammarError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for GrammarError {}

/// A matcher's error on the grammar of `param`: its first line for the client (a
/// [`GrammarError`]), the whole dump in the log.
fn grammar_error(param: &'static str) -> impl Fn(anyhow::Error) -> anyhow::Error {
    move |e| {
        tracing::debug!(error = %format!("{e:#}"), "grammar error");
        anyhow::Error::new(GrammarError {
            param,
            message: format!("grammar: {}", brief(&e)),
        })
    }
}

impl GrammarSpec {
    /// The request parameter this grammar comes from: `tools` for forced tool calls,
    /// `response_format` otherwise.
    pub fn param(&self) -> &'static str {
        match self {
            GrammarSpec::ToolCalls(_) => "tools",
            _ => "response_format",
        }
    }
}

impl GrammarConstraint {
    /// `tokens` as the matcher knows them from its current state (an end-of-generation id the
    /// grammar does not take as its own token becomes the first id where it stands), and how
    /// many of them it allows in sequence.
    fn validated(&mut self, tokens: &[u32]) -> (Vec<u32>, usize) {
        let mut tokens = tokens.to_vec();
        loop {
            let n = self.matcher.validate_tokens(&tokens).unwrap_or(0);
            match tokens.get(n) {
                Some(&t) if t != self.eos[0] && self.eos.contains(&t) => tokens[n] = self.eos[0],
                _ => return (tokens, n),
            }
        }
    }

    /// Set the logits of tokens `allowed` does not hold to `-inf`.
    fn apply(&self, allowed: &llguidance::toktrie::SimpleVob, logits: &mut [f32]) {
        // Where the grammar may end, every end-of-generation id may: their logits are put back
        // after the mask.
        let ends: Vec<(usize, f32)> = if allowed.is_allowed(self.eos[0]) {
            self.eos
                .iter()
                .filter_map(|&t| logits.get(t as usize).map(|&l| (t as usize, l)))
                .collect()
        } else {
            Vec::new()
        };
        for (i, l) in logits.iter_mut().enumerate().take(self.vocab) {
            if !allowed.is_allowed(i as u32) {
                *l = f32::NEG_INFINITY;
            }
        }
        for (i, l) in ends {
            logits[i] = l;
        }
        for l in logits.iter_mut().skip(self.vocab) {
            *l = f32::NEG_INFINITY;
        }
    }
}

impl Constraint for GrammarConstraint {
    fn mask(&mut self, logits: &mut [f32]) -> Result<()> {
        let allowed = match self.state_mask.take() {
            Some(m) => m,
            None => self.matcher.compute_mask_or_eos().map_err(grammar_error(self.param))?,
        };
        self.apply(&allowed, logits);
        Ok(())
    }

    fn commit(&mut self, token: u32) -> Result<()> {
        self.state_mask = None;
        if self.matcher.is_stopped() {
            // The grammar is complete: only the end of generation follows.
            return Ok(());
        }
        let token = self.as_matcher_token(token);
        self.matcher.consume_token(token).map_err(grammar_error(self.param))
    }

    fn valid_prefix(&mut self, tokens: &[u32]) -> usize {
        if self.matcher.is_stopped() {
            return 0;
        }
        self.validated(tokens).1
    }

    fn masks_drafts(&self) -> bool {
        !self.matcher.is_stopped()
    }

    fn mask_after(&mut self, drafted: &[u32], logits: &mut [f32]) -> Result<bool> {
        if drafted.is_empty() {
            let allowed = match self.state_mask.take() {
                Some(m) => m,
                None => self.matcher.compute_mask_or_eos().map_err(grammar_error(self.param))?,
            };
            self.apply(&allowed, logits);
            self.state_mask = Some(allowed);
            return Ok(true);
        }
        if self.matcher.is_stopped() {
            return Ok(false);
        }
        let (tokens, n) = self.validated(drafted);
        if n < tokens.len() {
            return Ok(false);
        }
        // On a copy of the matcher (it shares the lexer's caches, not its state): an error
        // there, or a grammar llguidance cannot roll back (`stop=` and `max_tokens=` lexemes),
        // never touches the committed state the target's masks come from.
        let mut ahead = self.matcher.clone();
        ahead.consume_tokens(&tokens).map_err(grammar_error(self.param))?;
        let allowed = ahead.compute_mask_or_eos().map_err(grammar_error(self.param))?;
        self.apply(&allowed, logits);
        Ok(true)
    }
}

/// How a request's reasoning block (`<think>…</think>`) is bounded. The bound is enforced by
/// the sampling-time mask: once the reasoning has used its budget, every row allows only the
/// next token of the close marker, so under speculation the forced close lands exactly where
/// plain decoding puts it (a draft that disagrees is rejected like any other).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReasoningControl {
    /// The text that opens reasoning, e.g. `<think>`.
    pub open: String,
    /// The text that closes it, e.g. `</think>`.
    pub close: String,
    /// The rendered prompt already opened the block (its generation prompt ends with `open`):
    /// the output starts inside the reasoning.
    pub starts_open: bool,
    /// Reasoning tokens allowed (tokens committed after the open marker and before the close
    /// marker); then the close marker is forced. `None` = unbounded.
    pub max_tokens: Option<usize>,
    /// Reasoning characters allowed (Unicode scalar values after the open marker); then the
    /// close marker is forced. Used for the bounded think prelude before a structured answer.
    /// `None` = unbounded.
    pub max_chars: Option<usize>,
}

/// What a request constrains its output to: a grammar for the answer and bounds on the
/// reasoning before it. With both, the grammar applies after the reasoning block closes (a
/// thinking model gets a bounded think prelude, then the constrained answer).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct OutputControl {
    pub grammar: Option<GrammarSpec>,
    pub reasoning: Option<ReasoningControl>,
}

impl OutputControl {
    /// No constraint at all.
    pub fn is_empty(&self) -> bool {
        self.grammar.is_none() && self.reasoning.is_none()
    }
}

/// Where the output is relative to the reasoning block.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Phase {
    /// Nothing decided yet: the output so far (`seen`) is blank or a proper prefix of the open
    /// marker.
    Start { seen: Vec<u8> },
    /// Inside the reasoning: `tokens` and `chars` used, `tail` = the last bytes (enough to find
    /// the close marker across token boundaries).
    Thinking { tokens: usize, chars: usize, tail: Vec<u8> },
    /// The budget is spent: the close marker's token `next` is forced.
    Forcing { next: usize },
    /// After the reasoning (or there was none): the answer, under the grammar if any.
    Answer,
}

/// A [`ReasoningControl`] (and optionally a grammar for the answer) as a [`Constraint`].
///
/// Rules: the output is reasoning when it starts with the open marker (after blanks, when no
/// grammar is set; exactly at the start when one is, since a grammar must see every answer
/// byte) or when the prompt opened it; reasoning ends at the first close marker, or when the
/// budget forces one. Tokens are matched on bytes, so a marker split over several tokens counts.
/// Bytes after the close marker within the same token belong to no phase (typically the
/// newlines of `>\n\n`); the grammar starts at the next token.
pub struct ReasoningConstraint {
    words: Arc<Vec<Vec<u8>>>,
    open: Vec<u8>,
    close: Vec<u8>,
    forced_close: Vec<u32>,
    max_tokens: Option<usize>,
    max_chars: Option<usize>,
    phase: Phase,
    answer: Option<Box<dyn Constraint>>,
}

/// A token's text bytes (the special-token marker stripped).
fn text_of(word: &[u8]) -> &[u8] {
    match word.first() {
        Some(&TokTrie::SPECIAL_TOKEN_MARKER) => &word[1..],
        _ => word,
    }
}

impl ReasoningConstraint {
    /// `words`: the bytes of each token id ([`GrammarCompiler::words`]); `forced_close`: the
    /// token ids of `control.close` (what the budget forces); `answer`: the grammar of the
    /// answer, if any. Errors: an empty open or close marker, or `forced_close` empty.
    pub fn new(
        words: Arc<Vec<Vec<u8>>>,
        control: &ReasoningControl,
        forced_close: Vec<u32>,
        answer: Option<Box<dyn Constraint>>,
    ) -> Result<Self> {
        if control.open.is_empty() || control.close.is_empty() || forced_close.is_empty() {
            return Err(anyhow!("reasoning markers must not be empty"));
        }
        let mut c = Self {
            words,
            open: control.open.as_bytes().to_vec(),
            close: control.close.as_bytes().to_vec(),
            forced_close,
            max_tokens: control.max_tokens,
            max_chars: control.max_chars,
            phase: Phase::Answer,
            answer,
        };
        c.phase = if control.starts_open {
            c.thinking(0, 0, Vec::new())
        } else {
            Phase::Start { seen: Vec::new() }
        };
        Ok(c)
    }

    fn word(&self, token: u32) -> &[u8] {
        self.words.get(token as usize).map(|w| text_of(w)).unwrap_or(&[])
    }

    /// The thinking phase with these counts, or forcing when a budget is spent.
    fn thinking(&self, tokens: usize, chars: usize, tail: Vec<u8>) -> Phase {
        let spent = self.max_tokens.is_some_and(|m| tokens >= m) || self.max_chars.is_some_and(|m| chars >= m);
        if spent {
            Phase::Forcing { next: 0 }
        } else {
            Phase::Thinking { tokens, chars, tail }
        }
    }

    /// After the reasoning text `text` (following the open marker, or a continuation of it):
    /// thinking with updated counts, or the answer when `text` completes the close marker.
    fn after_reasoning_text(&self, tokens: usize, chars: usize, tail: &[u8], text: &[u8]) -> Phase {
        let mut joined = tail.to_vec();
        joined.extend_from_slice(text);
        if joined.windows(self.close.len()).any(|w| w == self.close.as_slice()) {
            return Phase::Answer;
        }
        let keep = self.close.len().saturating_sub(1);
        let tail = joined[joined.len().saturating_sub(keep)..].to_vec();
        // Characters: UTF-8 bytes that are not continuation bytes.
        let n = text.iter().filter(|&&b| b & 0xC0 != 0x80).count();
        self.thinking(tokens, chars + n, tail)
    }

    /// Whether `token` may continue an opening `seen` toward the open marker.
    fn continues_open(&self, seen: &[u8], token: u32) -> bool {
        let w = self.word(token);
        if w.is_empty() {
            return false;
        }
        let mut s = seen.to_vec();
        s.extend_from_slice(w);
        let s = self.trim_blank(&s);
        !s.is_empty() && (self.open.starts_with(s) || s.starts_with(&self.open))
    }

    /// Leading blanks are skipped before the open marker only when no grammar must see them.
    fn trim_blank<'a>(&self, s: &'a [u8]) -> &'a [u8] {
        if self.answer.is_some() {
            s
        } else {
            s.trim_ascii_start()
        }
    }

    /// The phase after `token`, and whether `token` belongs to the answer.
    fn step(&self, phase: &Phase, token: u32) -> (Phase, bool) {
        let w = self.word(token);
        match phase {
            Phase::Answer => (Phase::Answer, true),
            Phase::Forcing { next } => {
                if next + 1 >= self.forced_close.len() {
                    (Phase::Answer, false)
                } else {
                    (Phase::Forcing { next: next + 1 }, false)
                }
            }
            Phase::Thinking { tokens, chars, tail } => (self.after_reasoning_text(tokens + 1, *chars, tail, w), false),
            Phase::Start { seen } => {
                let mut s = seen.clone();
                s.extend_from_slice(w);
                let t = self.trim_blank(&s);
                if t.starts_with(&self.open) {
                    let rest = &t[self.open.len()..];
                    let tokens = usize::from(!rest.is_empty());
                    (self.after_reasoning_text(tokens, 0, &[], rest), false)
                } else if self.open.starts_with(t) && (self.answer.is_none() || !t.is_empty()) {
                    (Phase::Start { seen: s }, false)
                } else {
                    (Phase::Answer, true)
                }
            }
        }
    }
}

impl Constraint for ReasoningConstraint {
    fn mask(&mut self, logits: &mut [f32]) -> Result<()> {
        match &self.phase {
            Phase::Answer => match self.answer.as_mut() {
                Some(a) => a.mask(logits),
                None => Ok(()),
            },
            Phase::Thinking { .. } => Ok(()),
            Phase::Forcing { next } => {
                let keep = self.forced_close[*next] as usize;
                for (i, l) in logits.iter_mut().enumerate() {
                    if i != keep {
                        *l = f32::NEG_INFINITY;
                    }
                }
                Ok(())
            }
            Phase::Start { seen } => {
                if self.answer.is_none() {
                    return Ok(());
                }
                let seen = seen.clone();
                if !seen.is_empty() {
                    // Half an open marker: only its continuation.
                    for (i, l) in logits.iter_mut().enumerate() {
                        if !self.continues_open(&seen, i as u32) {
                            *l = f32::NEG_INFINITY;
                        }
                    }
                    return Ok(());
                }
                // The first token: the answer's grammar, or the start of reasoning.
                let open_ok: Vec<(usize, f32)> = logits
                    .iter()
                    .enumerate()
                    .filter(|&(i, _)| self.continues_open(&[], i as u32))
                    .map(|(i, &l)| (i, l))
                    .collect();
                if let Some(a) = self.answer.as_mut() {
                    a.mask(logits)?;
                }
                for (i, l) in open_ok {
                    logits[i] = l;
                }
                Ok(())
            }
        }
    }

    fn commit(&mut self, token: u32) -> Result<()> {
        let (phase, to_answer) = self.step(&self.phase, token);
        self.phase = phase;
        match self.answer.as_mut() {
            Some(a) if to_answer => a.commit(token),
            _ => Ok(()),
        }
    }

    fn valid_prefix(&mut self, tokens: &[u32]) -> usize {
        let mut phase = self.phase.clone();
        for (i, &t) in tokens.iter().enumerate() {
            match &phase {
                Phase::Answer => {
                    return i + self
                        .answer
                        .as_mut()
                        .map_or(tokens.len() - i, |a| a.valid_prefix(&tokens[i..]));
                }
                Phase::Forcing { next } if self.forced_close[*next] != t => return i,
                Phase::Start { seen } if self.answer.is_some() && !self.continues_open(seen, t) => {
                    if !seen.is_empty() {
                        return i;
                    }
                    return i + self
                        .answer
                        .as_mut()
                        .map_or(tokens.len() - i, |a| a.valid_prefix(&tokens[i..]));
                }
                _ => {}
            }
            phase = self.step(&phase, t).0;
        }
        tokens.len()
    }

    /// Once the answer has begun, the answer's grammar masks draft rows; before it (reasoning,
    /// the forced close) draft rows are left as they are.
    fn mask_after(&mut self, drafted: &[u32], logits: &mut [f32]) -> Result<bool> {
        match (&self.phase, self.answer.as_mut()) {
            (Phase::Answer, Some(a)) => a.mask_after(drafted, logits),
            _ => Ok(false),
        }
    }

    fn masks_drafts(&self) -> bool {
        matches!((&self.phase, &self.answer), (Phase::Answer, Some(a)) if a.masks_drafts())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A toy vocabulary: each id's bytes.
    fn vocab() -> Arc<Vec<Vec<u8>>> {
        let words = [
            "<", "think", ">", "</", "hello", " ", "{", "}", "<think>", "</think>", ">\n\n", "x", "\n",
        ];
        Arc::new(words.iter().map(|w| w.as_bytes().to_vec()).collect())
    }
    const LT: u32 = 0;
    const THINK: u32 = 1;
    const GT: u32 = 2;
    const LTS: u32 = 3;
    const HELLO: u32 = 4;
    const SP: u32 = 5;
    const OPEN: u32 = 8;
    const CLOSE: u32 = 9;
    const GTNL: u32 = 10;
    const X: u32 = 11;
    const NL: u32 = 12;

    /// The tiny test model's tokenizer and its logits rows.
    fn tiny_tokenizer() -> (crate::tokenizer::Tokenizer, usize) {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("tiny.gguf");
        crate::testing::write_tiny_gguf(&path, &crate::testing::TinySpec::new(crate::model::Family::Llama))
            .expect("write");
        let bundle = crate::bundle::load(&path, &candle_core::Device::Cpu).expect("load");
        let rows = bundle.model.config().vocab_size;
        (bundle.tokenizer, rows)
    }

    /// The ids a constraint's mask leaves finite on a row of `rows` logits.
    fn allowed_ids(c: &mut GrammarConstraint, rows: usize) -> Vec<u32> {
        let mut l = vec![0f32; rows];
        c.mask(&mut l).expect("mask");
        (0..rows as u32).filter(|&t| l[t as usize].is_finite()).collect()
    }

    /// A completed grammar may end with any of the model's end-of-generation ids (Llama 3's
    /// `<|eot_id|>` and `<|eom_id|>`), not only the first: each is allowed where the grammar may
    /// end, committed and validated as the end. The tiny model's two special tokens stand in.
    #[test]
    fn a_grammar_may_end_with_any_end_of_generation_id() {
        let (tok, rows) = tiny_tokenizer();
        let tok = &tok;
        let (end, start) = (
            tok.token_to_id("<|im_end|>").expect("<|im_end|>"),
            tok.token_to_id("<|im_start|>").expect("<|im_start|>"),
        );
        let ends = [end, start];
        let compiler = GrammarCompiler::new(tok, rows, &ends).expect("compiler");
        let allowed = |c: &mut GrammarConstraint| allowed_ids(c, rows);
        let ab = tok.encode("ab").expect("encode");
        for last in ends {
            let mut c = compiler.compile(&GrammarSpec::Regex("ab".into())).expect("compile");
            assert!(!allowed(&mut c).contains(&start), "not before the grammar may end");
            let mut all = ab.clone();
            all.push(last);
            assert_eq!(c.valid_prefix(&all), all.len(), "ending with {last}");
            for &t in &ab {
                c.commit(t).expect("commit");
            }
            assert_eq!(allowed(&mut c), vec![end.min(start), end.max(start)]);
            c.commit(last).expect("the end commits");
        }
        // The start's mask, kept from compiling, is used only before the first commit.
        let mut c = compiler.compile(&GrammarSpec::Regex("ab".into())).expect("compile");
        c.commit(ab[0]).expect("commit");
        assert_eq!(allowed(&mut c), vec![ab[1]]);
        // An end-of-generation id the grammar names as a token of its own is that token.
        let mut c = compiler
            .compile(&GrammarSpec::Lark("start: \"a\" <|im_start|> \"b\"".into()))
            .expect("compile");
        assert_eq!(c.valid_prefix(&[ab[0], start, ab[1], end]), 4);
        c.commit(ab[0]).expect("commit");
        assert_eq!(allowed(&mut c), vec![start]);
        c.commit(start).expect("the grammar's own token");
        assert_eq!(allowed(&mut c), vec![ab[1]]);
        // Ids past the model's rows are left out; none left is an error.
        assert!(GrammarCompiler::new(tok, rows, &[rows as u32 + 5, end]).is_ok());
        assert!(GrammarCompiler::new(tok, rows, &[rows as u32]).is_err());
        assert!(GrammarCompiler::new(tok, rows, &[]).is_err());
    }

    /// A draft row's mask after drafted tokens is the mask the verify row there gets once those
    /// tokens are committed, and reading it changes nothing: the next masks are the same as
    /// without it, also when the drafts complete the grammar or end it, and for a grammar
    /// llguidance cannot roll back. Drafts the grammar does not allow in sequence leave the row
    /// as it is.
    #[test]
    fn a_draft_rows_mask_is_the_committed_mask_and_changes_nothing() {
        let (tok, rows) = tiny_tokenizer();
        let tok = &tok;
        let end = tok.token_to_id("<|im_end|>").expect("<|im_end|>");
        let compiler = GrammarCompiler::new(tok, rows, &[end]).expect("compiler");
        let text = tok.encode("aba cab").expect("encode");
        let after = |c: &mut GrammarConstraint, drafted: &[u32]| {
            let mut l = vec![0f32; rows];
            assert!(c.mask_after(drafted, &mut l).expect("mask_after"));
            (0..rows as u32)
                .filter(|&t| l[t as usize].is_finite())
                .collect::<Vec<u32>>()
        };
        // The second grammar stops after the text: only the end may follow.
        for (spec, split) in ["(ab|a c)+", "aba cab"]
            .into_iter()
            .flat_map(|g| (0..text.len()).map(move |split| (GrammarSpec::Regex(g.into()), split)))
        {
            let mut c = compiler.compile(&spec).expect("compile");
            let mut reference = compiler.compile(&spec).expect("compile");
            for &t in &text[..split] {
                c.commit(t).expect("commit");
                reference.commit(t).expect("commit");
            }
            // Every draft prefix from here, including the one that reaches the end.
            let mut drafted = text[split..].to_vec();
            drafted.push(end);
            for n in 0..=drafted.len() {
                let masked = after(&mut c, &drafted[..n]);
                let mut r = compiler.compile(&spec).expect("compile");
                for &t in text[..split].iter().chain(&drafted[..n]) {
                    r.commit(t).expect("commit");
                }
                assert_eq!(masked, allowed_ids(&mut r, rows), "split {split}, {n} drafted");
            }
            assert_eq!(
                allowed_ids(&mut c, rows),
                allowed_ids(&mut reference, rows),
                "split {split}"
            );
            for &t in &text[split..] {
                c.commit(t).expect("the state was left as it was");
            }
        }
        // A grammar llguidance cannot roll back (a `stop=` lexeme): the lookahead runs on a
        // copy, so the committed state stays usable.
        let spec = GrammarSpec::Lark("start: \"a\" line\nline[stop=\"c\"]: /[ab ]*/".into());
        let mut c = compiler.compile(&spec).expect("compile");
        let mut r = compiler.compile(&spec).expect("compile");
        let drafted = tok.encode("aab").expect("encode");
        let masked = after(&mut c, &drafted);
        for &t in &drafted {
            r.commit(t).expect("commit");
        }
        assert_eq!(masked, allowed_ids(&mut r, rows));
        for &t in &drafted {
            c.commit(t).expect("the committed state is still usable");
        }
        assert_eq!(allowed_ids(&mut c, rows), allowed_ids(&mut r, rows));
        // Drafts the grammar does not allow: no mask.
        let mut c = compiler
            .compile(&GrammarSpec::Regex("(ab|a c)+".into()))
            .expect("compile");
        let bad = tok.encode("ba").expect("encode");
        let mut l = vec![0f32; rows];
        assert!(!c.mask_after(&bad, &mut l).expect("mask_after"));
        assert!(l.iter().all(|x| *x == 0.0));
        assert_eq!(allowed_ids(&mut c, rows), vec![tok.encode("a").expect("encode")[0]]);
    }

    /// JSON answers are laid out as `{"a": 1, "b": 2}`: no whitespace but the separators'
    /// own, so a model cannot fill its output with whitespace. A schema's own options stand.
    #[test]
    fn json_answers_have_no_free_whitespace() {
        let (tok, rows) = tiny_tokenizer();
        let tok = &tok;
        let end = tok.token_to_id("<|im_end|>").expect("<|im_end|>");
        let compiler = GrammarCompiler::new(tok, rows, &[end]).expect("compiler");
        let one = |text: &str| {
            let t = tok.encode(text).expect("encode");
            assert_eq!(t.len(), 1, "{text:?}");
            t[0]
        };
        let [open, space, nl, quote, a, colon, one_digit, comma] = ["{", " ", "\n", "\"", "a", ":", "1", ","].map(one);
        let allowed = |c: &mut GrammarConstraint| allowed_ids(c, rows);
        for spec in [
            GrammarSpec::JsonObject,
            GrammarSpec::JsonSchema(serde_json::json!({"type": "object", "properties": {"a": {"type": "integer"}}})),
        ] {
            let mut c = compiler.compile(&spec).expect("compile");
            assert_eq!(allowed(&mut c), vec![open], "{spec:?}");
            c.commit(open).expect("{");
            let next = allowed(&mut c);
            assert!(
                next.contains(&quote) && !next.contains(&space) && !next.contains(&nl),
                "{spec:?}"
            );
            for t in [quote, a, quote] {
                c.commit(t).expect("key");
            }
            assert_eq!(allowed(&mut c), vec![colon], "{spec:?}");
            c.commit(colon).expect(":");
            let next = allowed(&mut c);
            assert!(
                next.contains(&space) && next.iter().all(|&t| tok.decode(&[t]).starts_with(' ')),
                "{spec:?}: the key separator is \": \" ({next:?})"
            );
            c.commit(space).expect("space");
            c.commit(one_digit).expect("1");
            let next = allowed(&mut c);
            assert!(
                !next.contains(&space) && !next.contains(&nl) && next.contains(&comma),
                "{spec:?}"
            );
        }
        let own =
            GrammarSpec::JsonSchema(serde_json::json!({"type": "object", "x-guidance": {"whitespace_flexible": true}}));
        let mut c = compiler.compile(&own).expect("compile");
        c.commit(open).expect("{");
        for _ in 0..30 {
            c.commit(space).expect("any run of whitespace");
        }
        // Options the schema does not set keep the layout's.
        let partial = GrammarSpec::JsonSchema(serde_json::json!({"type": "object", "x-guidance": {"lenient": true}}));
        let mut c = compiler.compile(&partial).expect("compile");
        c.commit(open).expect("{");
        assert!(!allowed(&mut c).contains(&space));
        let bad = GrammarSpec::JsonSchema(serde_json::json!({"type": "object", "x-guidance": "compact"}));
        assert!(compiler.compile(&bad).is_err());
    }

    fn control(starts_open: bool, max_tokens: Option<usize>) -> ReasoningControl {
        ReasoningControl {
            open: "<think>".into(),
            close: "</think>".into(),
            starts_open,
            max_tokens,
            max_chars: None,
        }
    }

    fn allowed(c: &mut ReasoningConstraint) -> Vec<u32> {
        let mut l = vec![0f32; 13];
        c.mask(&mut l).expect("mask");
        (0..13).filter(|&i| l[i as usize].is_finite()).collect()
    }

    #[test]
    fn budget_forces_the_close_marker_then_frees_the_answer() {
        let mut c =
            ReasoningConstraint::new(vocab(), &control(true, Some(3)), vec![LTS, THINK, GT], None).expect("new");
        for t in [HELLO, SP, HELLO] {
            assert_eq!(allowed(&mut c).len(), 13);
            c.commit(t).expect("commit");
        }
        // Budget spent: only the close marker, token by token.
        for t in [LTS, THINK, GT] {
            assert_eq!(allowed(&mut c), vec![t]);
            c.commit(t).expect("commit");
        }
        assert_eq!(c.phase, Phase::Answer);
        assert_eq!(allowed(&mut c).len(), 13);
    }

    #[test]
    fn a_close_marker_split_over_tokens_ends_reasoning_before_the_budget() {
        let mut c = ReasoningConstraint::new(vocab(), &control(true, Some(10)), vec![CLOSE], None).expect("new");
        for t in [HELLO, LTS, THINK, GTNL] {
            c.commit(t).expect("commit");
        }
        assert_eq!(c.phase, Phase::Answer);
        // A later budget does not apply to the answer.
        for _ in 0..20 {
            c.commit(X).expect("commit");
        }
        assert_eq!(allowed(&mut c).len(), 13);
    }

    #[test]
    fn reasoning_opened_by_the_output_counts_after_the_marker() {
        let mut c = ReasoningConstraint::new(vocab(), &control(false, Some(2)), vec![CLOSE], None).expect("new");
        for t in [NL, LT, THINK, GT, HELLO] {
            assert_eq!(allowed(&mut c).len(), 13, "before {t}");
            c.commit(t).expect("commit");
        }
        assert!(matches!(c.phase, Phase::Thinking { tokens: 1, .. }), "{:?}", c.phase);
        c.commit(HELLO).expect("commit");
        assert_eq!(allowed(&mut c), vec![CLOSE]);
        // valid_prefix follows the same rules without advancing.
        assert_eq!(c.valid_prefix(&[CLOSE, X, X]), 3);
        assert_eq!(c.valid_prefix(&[X]), 0);
        assert_eq!(allowed(&mut c), vec![CLOSE]);
    }

    #[test]
    fn output_that_does_not_open_reasoning_is_never_bounded() {
        let mut c = ReasoningConstraint::new(vocab(), &control(false, Some(0)), vec![CLOSE], None).expect("new");
        c.commit(HELLO).expect("commit");
        assert_eq!(c.phase, Phase::Answer);
        c.commit(OPEN).expect("commit");
        assert_eq!(c.phase, Phase::Answer, "a later <think> is content");
    }

    /// A grammar stand-in: allows only `{`, `x` and `}`.
    struct Braces(Vec<u32>);
    impl Constraint for Braces {
        fn mask(&mut self, logits: &mut [f32]) -> Result<()> {
            for (i, l) in logits.iter_mut().enumerate() {
                if ![6, 7, 11].contains(&i) {
                    *l = f32::NEG_INFINITY;
                }
            }
            Ok(())
        }
        fn commit(&mut self, token: u32) -> Result<()> {
            self.0.push(token);
            Ok(())
        }
        fn valid_prefix(&mut self, tokens: &[u32]) -> usize {
            tokens.iter().take_while(|t| [6, 7, 11].contains(*t)).count()
        }
    }

    #[test]
    fn with_a_grammar_the_first_token_is_the_grammar_or_the_open_marker() {
        let mut c = ReasoningConstraint::new(
            vocab(),
            &control(false, Some(1)),
            vec![CLOSE],
            Some(Box::new(Braces(vec![]))),
        )
        .expect("new");
        // `<`, `<think>` (open marker prefixes) and the grammar's tokens.
        assert_eq!(allowed(&mut c), vec![LT, 6, 7, OPEN, X]);
        c.commit(LT).expect("commit");
        assert_eq!(allowed(&mut c), vec![THINK], "half a marker: only its continuation");
        assert_eq!(c.valid_prefix(&[THINK, GT, HELLO, CLOSE, 6, X, SP]), 6);
        for t in [THINK, GT, HELLO] {
            c.commit(t).expect("commit");
        }
        assert_eq!(allowed(&mut c), vec![CLOSE]);
        c.commit(CLOSE).expect("commit");
        assert_eq!(allowed(&mut c), vec![6, 7, X]);
        c.commit(6).expect("commit");
        assert_eq!(c.phase, Phase::Answer);
    }

    #[test]
    fn with_a_grammar_a_non_marker_first_token_goes_to_the_grammar() {
        let mut c = ReasoningConstraint::new(
            vocab(),
            &control(false, None),
            vec![CLOSE],
            Some(Box::new(Braces(vec![]))),
        )
        .expect("new");
        assert_eq!(c.valid_prefix(&[6, X, 7]), 3);
        assert_eq!(
            c.valid_prefix(&[SP]),
            0,
            "blank before the marker is the grammar's, which refuses it"
        );
        c.commit(6).expect("commit");
        assert_eq!(c.phase, Phase::Answer);
        assert_eq!(allowed(&mut c), vec![6, 7, X]);
    }
}
