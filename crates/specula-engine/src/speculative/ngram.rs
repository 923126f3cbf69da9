//! n-gram prompt lookup (Saxena 2023, "Prompt Lookup Decoding"; llama.cpp `lookup`): find the
//! longest recent suffix of the context, between `min_n` and `max_n` tokens, that occurred
//! earlier, and propose what followed its most recent earlier occurrence.
//!
//! **Structural matches.** Lists, tables, JSON arrays and SQL rows repeat their structure with
//! different numbers in it (`{"id": 7, "name": "user_7"}` after `{"id": 6, "name": "user_6"}`),
//! and the tokenizers of the catalog split numbers into digits, so right after a new number no
//! exact suffix matches and lookup proposes nothing where the rest of the line is predictable.
//! When the drafter knows which tokens spell numbers ([`NumberVocab`]), it also matches with
//! every number token equal to every other of its class (digits, or space + digits), and takes
//! that match when it is strictly longer than the longest exact one, or when both reach
//! `max_n` and the structural one goes on further back (up to 64 tokens: the last row of a
//! list against an older occurrence that only shares the last few tokens).
//!
//! **Numbers in the continuation.** The continuation of the earlier occurrence is one period
//! of the text behind; its numbers are one step behind too (`user_6` where `user_7` comes next).
//! With `m` the count of numbers between the earlier occurrence and now (the period in numbers),
//! each number `x` of the continuation is replaced by its extrapolation from the numbers `m`,
//! `2m` and `3m` before it at the same place in the structure (the same token before each):
//! constant second differences (three earlier periods agree: squares, triangular numbers)
//! continue quadratically, otherwise the first difference continues (`2x - x₋ₘ`: counters,
//! multiples, constants). The number is spelt with the tokenizer's own digit tokens, in groups
//! as its pre-tokenizer splits digits. The number being written when the lookup runs is
//! completed the same way when its digits so far agree with the extrapolation. All this only
//! when the last complete number written shows the text counting: it differs from the number
//! a period before it and equals that number's extrapolation (or, two periods in, that number
//! plus one). A verbatim copy (a row of the prompt written out again) repeats its numbers,
//! and its continuation is copied.
//!
//! **Past the end of the context.** A match less than `k` tokens back (a list whose rows are
//! shorter than the draft, a loop) has a continuation that stops at the context's end. The
//! draft then goes on from a lookup over the context followed by the draft so far (whose
//! numbers have counted on), until `k` tokens or no match.
//!
//! Every proposal is only a draft: a wrong token in it is rejected by verification, so the
//! drafter changes speed, never output. Measured on the shared prompts (`scripts/spec_bench.py`,
//! and `examples/ngram_replay.rs` for tau alone): see `docs/perf.md`.

use super::{Drafter, Proposal};
use std::collections::HashMap;
use std::sync::Arc;

/// Not a number token.
pub const NUMBER_NONE: u8 = 0;
/// A token of ASCII digits only (`7`, `42`).
pub const NUMBER_DIGITS: u8 = 1;
/// A space followed by ASCII digits only (` 42`).
pub const NUMBER_SPACE_DIGITS: u8 = 2;

/// The tokens of a vocabulary that spell numbers, and how the tokenizer spells a new one.
///
/// Built from the vocabulary strings ([`crate::tokenizer::Tokenizer::numbers`]); a number is a
/// maximal run of number tokens in which only the first may be spaced (`Ġ12` + `3` is ` 123`).
#[derive(Debug, Clone, Default)]
pub struct NumberVocab {
    /// Per token id: [`NUMBER_NONE`], [`NUMBER_DIGITS`] or [`NUMBER_SPACE_DIGITS`].
    classes: Vec<u8>,
    /// Number token -> its digits (without the space).
    digits: HashMap<u32, Box<str>>,
    /// (spaced, digits) -> token id.
    tokens: HashMap<(bool, Box<str>), u32>,
    /// The pre-tokenizer cuts a run of digits into groups of at most this many, left to right
    /// (1: Qwen2, SmolLM; 3: Llama 3).
    group: usize,
}

impl NumberVocab {
    /// From every vocabulary entry `(id, text)` with the leading-space marker already stripped
    /// (`spaced` says whether it had one); entries that are not all ASCII digits are ignored.
    /// `vocab_size` bounds the ids; `group` is the pre-tokenizer's digit group (at least 1).
    pub fn new(entries: impl IntoIterator<Item = (u32, bool, String)>, vocab_size: usize, group: usize) -> Self {
        let mut v = Self {
            classes: vec![NUMBER_NONE; vocab_size],
            group: group.max(1),
            ..Self::default()
        };
        for (id, spaced, text) in entries {
            if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) || id as usize >= vocab_size {
                continue;
            }
            v.classes[id as usize] = if spaced { NUMBER_SPACE_DIGITS } else { NUMBER_DIGITS };
            let text: Box<str> = text.into();
            v.tokens.entry((spaced, text.clone())).or_insert(id);
            v.digits.insert(id, text);
        }
        v
    }

    /// The class of a token id ([`NUMBER_NONE`] past the vocabulary).
    pub fn class(&self, t: u32) -> u8 {
        self.classes.get(t as usize).copied().unwrap_or(NUMBER_NONE)
    }

    /// Whether any token spells a number.
    pub fn is_empty(&self) -> bool {
        self.digits.is_empty()
    }

    /// The tokens that spell `digits` (spaced: with a leading space on the first group), in
    /// groups of `group` digits left to right; `None` when a group has no token.
    fn spell(&self, spaced: bool, digits: &str) -> Option<Vec<u32>> {
        let bytes = digits.as_bytes();
        let mut out = Vec::with_capacity(bytes.len().div_ceil(self.group));
        for (i, chunk) in bytes.chunks(self.group).enumerate() {
            let text = std::str::from_utf8(chunk).ok()?;
            out.push(*self.tokens.get(&(spaced && i == 0, Box::from(text)))?);
        }
        Some(out)
    }
}

/// One number of the context: a maximal run of number tokens.
#[derive(Debug, Clone, Copy)]
struct Run {
    /// First token.
    start: usize,
    /// One past the last token.
    end: usize,
    /// Its value (`None` past u64).
    value: Option<u64>,
    /// Digits written, leading zeros included.
    width: usize,
    /// Its first digit is a zero (`007`: with `width > 1`, extrapolations keep the width).
    leading_zero: bool,
    /// The first token carries a leading space.
    spaced: bool,
}

/// The n-gram drafter.
#[derive(Debug, Clone)]
pub struct NgramDrafter {
    /// Shortest suffix (tokens) that counts as a match; at least 1.
    pub min_n: usize,
    /// Longest suffix (tokens) compared; longer matches count as `max_n`.
    pub max_n: usize,
    /// The vocabulary's number tokens ([`crate::tokenizer::Tokenizer::numbers`]); `None`: exact
    /// matches and literal continuations only.
    pub numbers: Option<Arc<NumberVocab>>,
    /// With `numbers`: extrapolate the numbers of the continuation (true unless cleared: the
    /// structural matches alone, for measurement).
    pub extrapolate: bool,
    /// When the continuation reaches the end of the context before `k` tokens (the match is
    /// less than `k` tokens back: text repeating with a short period), look up again on the
    /// context followed by the draft so far, and so on up to `k` (true unless cleared).
    pub wrap: bool,
    /// The confidence cut ([`MatchStats`]): a draft keeps its first `j` tokens while the
    /// measured chance that all `j` are accepted, for its match class, is at least this.
    /// 0 proposes every draft whole (no cut).
    pub min_confidence: f64,
    /// Acceptance measured per match class, from the drafter's own earlier drafts (and the
    /// last draft, whose outcome the next context tells).
    pub stats: MatchStats,
}

impl Default for NgramDrafter {
    fn default() -> Self {
        Self {
            min_n: 2,
            max_n: 8,
            numbers: None,
            extrapolate: true,
            wrap: true,
            min_confidence: 0.0,
            stats: MatchStats::default(),
        }
    }
}

impl Drafter for NgramDrafter {
    fn propose(&mut self, context: &[u32], k: usize) -> anyhow::Result<Proposal> {
        Ok(Proposal::deterministic(self.propose_tokens(context, k)))
    }

    fn name(&self) -> &'static str {
        "ngram"
    }
}

impl NgramDrafter {
    /// Exact matches only, `min_n ..= max_n` tokens.
    pub fn new(min_n: usize, max_n: usize) -> Self {
        Self {
            min_n,
            max_n,
            ..Self::default()
        }
    }

    /// With structural matches and extrapolated numbers over this vocabulary's number tokens
    /// (none when it has no number tokens).
    pub fn with_numbers(mut self, numbers: Arc<NumberVocab>) -> Self {
        self.numbers = (!numbers.is_empty()).then_some(numbers);
        self
    }

    fn class(&self, t: u32) -> u8 {
        self.numbers.as_ref().map_or(NUMBER_NONE, |n| n.class(t))
    }

    /// Up to `k` tokens: the continuation of the most recent earlier occurrence of the longest
    /// suffix of `context` that occurred before (at least `min_n`, at most `max_n` tokens), or
    /// of the longest structural match when that is strictly longer, with its numbers
    /// extrapolated (see the module docs). Empty when nothing matches. One backward scan,
    /// O(len · matched length), and one pass over the context for its numbers.
    /// With `wrap`, a draft that reaches the context's end goes on from a lookup over the
    /// context and the draft (a list row of 5 tokens drafts 8 with k = 8).
    pub fn lookup(&self, context: &[u32], k: usize) -> Vec<u32> {
        self.classified_lookup(context, k).0
    }

    /// [`NgramDrafter::lookup`] with learning: first the outcome of the previous draft is read
    /// from `context` (the tokens after the length it was proposed at: its accepted prefix, then
    /// the target's own token) into [`NgramDrafter::stats`]; then the draft is looked up and,
    /// with [`NgramDrafter::min_confidence`], cut to what its match class's measured acceptance
    /// justifies ([`MatchStats::keep`]).
    ///
    /// The outcome is read as far as the context tells it: a draft that was not verified (or
    /// only a prefix of it; a step committed fewer tokens than it holds, all of them equal to
    /// it) is scored on the committed tokens only, the rest untested. So a caller may look up
    /// every step and verify the draft only on some (the lookup beside a model drafter).
    pub fn propose_tokens(&mut self, context: &[u32], k: usize) -> Vec<u32> {
        if let Some(p) = self.stats.pending.take() {
            // Learned only when the context went on from the one the draft was proposed for
            // (a step was verified): at least the target's own token follows it.
            if context.len() > p.at {
                let known = context.len() - p.at;
                let accepted = p.draft.iter().zip(&context[p.at..]).take_while(|(a, b)| a == b).count();
                self.stats.record(p.class, p.draft.len().min(known), accepted);
            }
        }
        let (mut draft, class) = self.classified_lookup(context, k);
        if self.min_confidence > 0.0 {
            draft.truncate(self.stats.keep(class, draft.len(), self.min_confidence));
        }
        if !draft.is_empty() {
            self.stats.pending = Some(Pending {
                at: context.len(),
                draft: draft.clone(),
                class,
            });
        }
        draft
    }

    /// The estimated conditional acceptance of each token of the last draft
    /// [`NgramDrafter::propose_tokens`] proposed (index j: the (j+1)-th token is accepted given
    /// the ones before it were), from its match class's record ([`MatchStats::acceptance`]);
    /// empty when it proposed nothing.
    pub fn pending_alphas(&self) -> Vec<f64> {
        match &self.stats.pending {
            Some(p) => self.stats.cautious(p.class, p.draft.len()),
            None => Vec::new(),
        }
    }

    /// The match class ([`MatchStats::class`]) of the last draft [`NgramDrafter::propose_tokens`]
    /// proposed, until its outcome is learned (None when it proposed nothing).
    pub fn pending_class(&self) -> Option<usize> {
        self.stats.pending.as_ref().map(|p| p.class)
    }

    /// The draft and the match class of its first lookup ([`MatchStats::class`]).
    fn classified_lookup(&self, context: &[u32], k: usize) -> (Vec<u32>, usize) {
        let (mut draft, class) = self.lookup_once(context, k);
        if !self.wrap || draft.is_empty() || draft.len() >= k {
            return (draft, class);
        }
        let mut ext = Vec::with_capacity(context.len() + k);
        ext.extend_from_slice(context);
        ext.extend_from_slice(&draft);
        while draft.len() < k {
            let more = self.lookup_once(&ext, k - draft.len()).0;
            if more.is_empty() {
                break;
            }
            ext.extend_from_slice(&more);
            draft.extend(more);
        }
        (draft, class)
    }

    /// One lookup: the continuation of one match, as far as the context goes, and the match's
    /// class.
    fn lookup_once(&self, context: &[u32], k: usize) -> (Vec<u32>, usize) {
        let len = context.len();
        let max_n = self.max_n.min(len.saturating_sub(1));
        let min_n = self.min_n.max(1);
        if k == 0 || max_n < min_n {
            return (Vec::new(), 0);
        }
        let structural = self.numbers.is_some();
        // Equal, or numbers of one class.
        let same_shape = |a: u32, b: u32| {
            let ca = self.class(a);
            a == b || (ca != NUMBER_NONE && ca == self.class(b))
        };
        let last = len - 1;
        // (matched length, end of the occurrence) of the best exact and structural matches.
        let (mut exact, mut shape) = ((0usize, 0usize), (0usize, 0usize));
        // `end` is the last token of a candidate occurrence; its continuation starts at end + 1.
        for end in (0..last).rev() {
            let reach = max_n.min(end + 1);
            let mut j = 0;
            while j < reach && context[end - j] == context[last - j] {
                j += 1;
            }
            if j > exact.0 {
                exact = (j, end);
                if j == max_n {
                    break; // Nothing can be longer; the most recent longest wins.
                }
            }
            if structural && reach > shape.0.max(exact.0) {
                let mut s = j;
                while s < reach && same_shape(context[end - s], context[last - s]) {
                    s += 1;
                }
                if s > shape.0 {
                    shape = (s, end);
                }
            }
        }
        // Both matches at the cap: the one that goes on further back wins (a more recent row of
        // a list against an older occurrence that only shares the cap's worth of tokens).
        if structural && exact.0 == max_n && shape.0 == max_n && shape.1 != exact.1 {
            let further = |end: usize, same: &dyn Fn(u32, u32) -> bool| {
                let reach = TIE_BREAK_REACH.min(end + 1);
                (max_n..reach)
                    .take_while(|&j| same(context[end - j], context[last - j]))
                    .count()
            };
            if further(shape.1, &same_shape) > further(exact.1, &|a, b| a == b) {
                exact = (0, 0);
            }
        }
        let structural_won = shape.0 > exact.0;
        let (n, end) = if structural_won { shape } else { exact };
        if n < min_n {
            return (Vec::new(), 0);
        }
        let draft = match &self.numbers {
            Some(numbers) if self.extrapolate => continue_with_numbers(numbers, context, end, k),
            _ => literal_continuation(context, end, k),
        };
        (draft, MatchStats::class(n, structural_won))
    }
}

/// A draft waiting for its outcome: the context length it was proposed at, and its class.
#[derive(Debug, Clone)]
struct Pending {
    at: usize,
    draft: Vec<u32>,
    class: usize,
}

/// Match-length buckets of [`MatchStats::class`]: 1, 2, 3, 4-7, 8 or more tokens.
const LENGTH_BUCKETS: usize = 5;
/// Draft positions kept apart; later ones share the last.
const POSITIONS: usize = 4;
/// Decay of a class's counts per draft of that class.
const STATS_DECAY: f64 = 0.95;
/// Prior per-position acceptance of a class not yet measured, and its weight (pseudo-tests).
const PRIOR_ACCEPT: f64 = 0.9;
const PRIOR_WEIGHT: f64 = 2.0;
/// [`MatchStats::cautious`]: the prior acceptance of a class's first draft token.
const CAUTIOUS_PRIOR: f64 = 0.5;

/// Acceptance of the n-gram drafter's drafts per match class (match length bucket, exact or
/// structural) and draft position: at position `i`, how often the token was accepted when every
/// token before it was (decayed counts, as the draft-length controller's). A one-token match
/// in prose is right a third of the time; an 8-token match in a copied document nearly always:
/// one acceptance estimate for both (the controller's) either drafts the weak ones long or the
/// strong ones short. With the class's own estimate, a draft keeps only the tokens whose chance
/// of being reached and accepted is worth a verify row.
#[derive(Debug, Clone)]
pub struct MatchStats {
    /// Per class and position: (accepted, tested).
    counts: [[(f64, f64); POSITIONS]; 2 * LENGTH_BUCKETS],
    /// The last draft proposed, to learn its outcome from the next context.
    pending: Option<Pending>,
}

impl Default for MatchStats {
    fn default() -> Self {
        Self {
            counts: [[(0.0, 0.0); POSITIONS]; 2 * LENGTH_BUCKETS],
            pending: None,
        }
    }
}

impl MatchStats {
    /// The class of a match of `n` tokens (structural: only with numbers taken as equal).
    pub fn class(n: usize, structural: bool) -> usize {
        let bucket = match n {
            0 | 1 => 0,
            2 => 1,
            3 => 2,
            4..=7 => 3,
            _ => 4,
        };
        2 * bucket + usize::from(structural)
    }

    /// Feed the outcome of a draft of `drafted` tokens from a match of `class`, whose first
    /// `accepted` tokens were accepted: positions `0..accepted` accepted, the next one (if any)
    /// rejected, the rest never tested.
    pub fn record(&mut self, class: usize, drafted: usize, accepted: usize) {
        let Some(c) = self.counts.get_mut(class) else {
            return;
        };
        if drafted == 0 {
            return;
        }
        for p in c.iter_mut() {
            p.0 *= STATS_DECAY;
            p.1 *= STATS_DECAY;
        }
        let accepted = accepted.min(drafted);
        for i in 0..(accepted + usize::from(accepted < drafted)) {
            let p = &mut c[i.min(POSITIONS - 1)];
            p.0 += f64::from(u8::from(i < accepted));
            p.1 += 1.0;
        }
    }

    /// The estimated acceptance at draft position `i` of a match of `class`, given every
    /// earlier position was accepted.
    pub fn acceptance(&self, class: usize, i: usize) -> f64 {
        let (a, t) = self.counts[class][i.min(POSITIONS - 1)];
        (a + PRIOR_ACCEPT * PRIOR_WEIGHT) / (t + PRIOR_WEIGHT)
    }

    /// Conditional acceptance estimates of the first `n` positions of a draft from a match of
    /// `class`, for weighing a lookup draft against another drafter's: the first position's
    /// prior is [`CAUTIOUS_PRIOR`] (not [`PRIOR_ACCEPT`]), and each later position's prior is
    /// the estimate of the position before it (as the draft-length controller's), so a class
    /// or position not yet tested is not taken for a near-certain one.
    pub fn cautious(&self, class: usize, n: usize) -> Vec<f64> {
        let mut prev = CAUTIOUS_PRIOR;
        (0..n)
            .map(|i| {
                let (a, t) = self.counts[class][i.min(POSITIONS - 1)];
                prev = (a + prev * PRIOR_WEIGHT) / (t + PRIOR_WEIGHT);
                prev
            })
            .collect()
    }

    /// How many of a `len`-token draft from a match of `class` to propose: the longest prefix
    /// whose estimated chance of being accepted whole is at least `min_confidence`.
    pub fn keep(&self, class: usize, len: usize, min_confidence: f64) -> usize {
        let mut reach = 1.0;
        for i in 0..len {
            reach *= self.acceptance(class, i);
            if reach < min_confidence {
                return i;
            }
        }
        len
    }
}

/// The numbers of `context`, in order.
fn number_runs(numbers: &NumberVocab, context: &[u32]) -> Vec<Run> {
    let mut runs: Vec<Run> = Vec::new();
    let mut open = false;
    for (i, &t) in context.iter().enumerate() {
        let class = numbers.class(t);
        let starts = class == NUMBER_SPACE_DIGITS || (class == NUMBER_DIGITS && !open);
        open = class != NUMBER_NONE;
        if class == NUMBER_NONE {
            continue;
        }
        let digits = numbers.digits.get(&t).map_or("", |d| d);
        if starts {
            runs.push(Run {
                start: i,
                end: i,
                value: Some(0),
                width: 0,
                leading_zero: digits.starts_with('0'),
                spaced: class == NUMBER_SPACE_DIGITS,
            });
        }
        if let Some(run) = runs.last_mut() {
            run.end = i + 1;
            run.width += digits.len();
            for b in digits.bytes() {
                run.value = run
                    .value
                    .and_then(|v| v.checked_mul(10))
                    .and_then(|v| v.checked_add(u64::from(b - b'0')));
            }
        }
    }
    runs
}

/// The value of the number `m` runs after `runs[r]`, extrapolated from `runs[r]` and the runs
/// `m`, `2m`, `3m` before it (see the module docs); `None` when the runs do not line up (another
/// token before them, another spacing, no value) or the result is negative.
fn extrapolate(runs: &[Run], context: &[u32], r: usize, m: usize) -> Option<u64> {
    let lined_up = |a: &Run, b: &Run| {
        a.spaced == b.spaced
            && a.start > 0
            && b.start > 0
            && context[a.start - 1] == context[b.start - 1]
            && a.value.is_some()
            && b.value.is_some()
    };
    if m == 0 || r < m || !lined_up(&runs[r], &runs[r - m]) {
        return None;
    }
    let v = |i: usize| i128::from(runs[i].value.unwrap_or(0));
    let (x2, x1) = (v(r), v(r - m));
    let mut next = 2 * x2 - x1;
    if r >= 3 * m && lined_up(&runs[r - m], &runs[r - 2 * m]) && lined_up(&runs[r - 2 * m], &runs[r - 3 * m]) {
        let (x0, xm) = (v(r - 2 * m), v(r - 3 * m));
        let d2 = x2 - 2 * x1 + x0;
        if d2 == x1 - 2 * x0 + xm {
            next += d2;
        }
    }
    u64::try_from(next).ok()
}

/// The tokens of the extrapolated successor of `runs[r]` (spelt like it: spacing, leading
/// zeros), or `None`.
fn successor_tokens(numbers: &NumberVocab, runs: &[Run], context: &[u32], r: usize, m: usize) -> Option<Vec<u32>> {
    let value = extrapolate(runs, context, r, m)?;
    let run = &runs[r];
    let mut digits = value.to_string();
    if run.leading_zero && run.width > 1 && digits.len() < run.width {
        digits = format!("{}{digits}", "0".repeat(run.width - digits.len()));
    }
    numbers.spell(run.spaced, &digits)
}

/// Whether the text counts on with period `m` (in numbers) rather than repeats itself: the
/// last complete number of the context (not the one it may end in) differs from the number `m`
/// before it, and equals that number's extrapolation (with two periods written only: is one
/// more). A verbatim copy (a
/// row of the prompt written out again) has the same numbers a period back, and is continued
/// literally; `runs[..upto]` are the runs that start before the context's end.
fn counts_on(runs: &[Run], context: &[u32], upto: usize, m: usize) -> bool {
    let Some(trailing) = upto.checked_sub(1) else {
        return false;
    };
    let last = if runs[trailing].end == context.len() {
        trailing.checked_sub(1)
    } else {
        Some(trailing)
    };
    let Some(c) = last.filter(|&c| m > 0 && c >= m) else {
        return false;
    };
    if runs[c].value.is_none() || runs[c].value == runs[c - m].value {
        return false;
    }
    match extrapolate(runs, context, c - m, m) {
        Some(v) => runs[c].value == Some(v),
        // Two periods only: counting by one.
        None => runs[c - m].value.and_then(|v| v.checked_add(1)) == runs[c].value,
    }
}

/// Up to `k` tokens of `context` after `end`, as written.
fn literal_continuation(context: &[u32], end: usize, k: usize) -> Vec<u32> {
    context[end + 1..(end + 1 + k).min(context.len())].to_vec()
}

/// How far back (tokens) two matches that both reach `max_n` are compared to choose one.
const TIE_BREAK_REACH: usize = 64;

/// Up to `k` tokens continuing `context` from its earlier occurrence ending at `end`: the
/// literal tokens after it with every complete number replaced by its successor, and the number
/// the context ends in (if any) completed, when the text counts on ([`counts_on`]); otherwise
/// the literal tokens (module docs).
fn continue_with_numbers(numbers: &NumberVocab, context: &[u32], end: usize, k: usize) -> Vec<u32> {
    let len = context.len();
    let runs = number_runs(numbers, context);
    // Index of the run containing or preceding a position, by starts.
    let upto = |pos: usize| runs.partition_point(|r| r.start <= pos);
    let (at_end, at_last) = (upto(end), upto(len - 1));
    let m = at_last - at_end;
    if !counts_on(&runs, context, at_last, m) {
        return literal_continuation(context, end, k);
    }
    let mut out = Vec::with_capacity(k);
    let mut p = end + 1;
    // The context ends inside a number and the occurrence inside another: complete it.
    if at_end > 0 && at_last > 0 && runs[at_end - 1].end > end && runs[at_last - 1].end == len {
        let (earlier, now) = (at_end - 1, &runs[at_last - 1]);
        if let Some(tokens) = successor_tokens(numbers, &runs, context, earlier, m) {
            let written = &context[now.start..];
            if let Some(rest) = tokens.strip_prefix(written) {
                out.extend_from_slice(rest);
                p = runs[earlier].end;
            }
        }
    }
    while out.len() < k && p < len {
        let r = upto(p);
        if r > 0 && runs[r - 1].start == p && runs[r - 1].end < len {
            if let Some(tokens) = successor_tokens(numbers, &runs, context, r - 1, m) {
                out.extend(tokens);
                p = runs[r - 1].end;
                continue;
            }
        }
        out.push(context[p]);
        p += 1;
    }
    out.truncate(k);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proposes_the_continuation_of_the_longest_match() {
        let d = NgramDrafter::new(1, 3);
        // ... 1 2 3 [4 5] ... 1 2 3 -> 4 5
        assert_eq!(d.lookup(&[1, 2, 3, 4, 5, 9, 1, 2, 3], 2), vec![4, 5]);
        // The most recent occurrence wins.
        assert_eq!(d.lookup(&[7, 1, 8, 7, 1, 9, 7, 1], 1), vec![9]);
        // The longest match wins over a more recent shorter one.
        assert_eq!(d.lookup(&[6, 7, 1, 8, 5, 7, 1, 9, 2, 6, 7, 1], 1), vec![8]);
        // One lookup stops at the end of the context; with wrapping (the default) the draft
        // goes on from a lookup over the context and the draft so far.
        let once = NgramDrafter {
            wrap: false,
            ..d.clone()
        };
        assert_eq!(once.lookup(&[5, 6, 5], 4), vec![6, 5]);
        assert_eq!(d.lookup(&[5, 6, 5], 4), vec![6, 5, 6, 5]);
        assert_eq!(d.lookup(&[1, 2, 3, 1, 2], 5), vec![3, 1, 2, 3, 1]);
        // No match, nothing proposed.
        assert!(d.lookup(&[1, 2, 3], 4).is_empty());
        assert!(d.lookup(&[1, 2, 1, 2], 0).is_empty());
        assert!(d.lookup(&[], 3).is_empty());
        assert!(d.lookup(&[4], 3).is_empty());
    }

    #[test]
    fn min_n_is_respected() {
        let d = NgramDrafter::new(2, 3);
        assert!(d.lookup(&[1, 5, 2, 1], 2).is_empty(), "a 1-gram match is below min_n");
        assert_eq!(d.lookup(&[1, 5, 2, 1, 5], 2), vec![2, 1]);
    }

    /// The scan must agree with the definition: for n from max_n down to min_n, the most
    /// recent earlier occurrence of the n-token suffix whose continuation exists.
    #[test]
    fn exact_lookup_matches_the_definition() {
        fn reference(ctx: &[u32], k: usize, min_n: usize, max_n: usize) -> Vec<u32> {
            let len = ctx.len();
            for n in (min_n.max(1)..=max_n).rev() {
                if n >= len {
                    continue;
                }
                for start in (0..len - n).rev() {
                    if ctx[start..start + n] == ctx[len - n..] {
                        let from = start + n;
                        return ctx[from..(from + k).min(len)].to_vec();
                    }
                }
            }
            Vec::new()
        }
        let mut state = 0x2545_F491_4F6C_DD1Du64;
        for case in 0..3000 {
            let len = 1 + case % 40;
            let alphabet = 2 + (case % 5) as u64;
            let ctx: Vec<u32> = (0..len)
                .map(|_| {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    (state % alphabet) as u32
                })
                .collect();
            for (min_n, max_n) in [(1, 3), (2, 4), (2, 8), (3, 3)] {
                let k = 1 + case % 6;
                let wrapping = NgramDrafter::new(min_n, max_n);
                let once = NgramDrafter {
                    wrap: false,
                    ..wrapping.clone()
                };
                assert_eq!(
                    once.lookup(&ctx, k),
                    reference(&ctx, k, min_n, max_n),
                    "{ctx:?} k={k} n={min_n}..={max_n}"
                );
                // Wrapping: the reference again on the context and the draft, until k or none.
                let mut ext = ctx.clone();
                let mut want = Vec::new();
                while want.len() < k {
                    let more = reference(&ext, k - want.len(), min_n, max_n);
                    if more.is_empty() {
                        break;
                    }
                    ext.extend(&more);
                    want.extend(more);
                }
                assert_eq!(
                    wrapping.lookup(&ctx, k),
                    want,
                    "{ctx:?} k={k} n={min_n}..={max_n} wrapped"
                );
            }
        }
    }

    /// Tokens 10..=19 are the digits 0-9, 20..=29 space + digit; 1..=9 are structure.
    fn numbers() -> Arc<NumberVocab> {
        let digits = (0..10u32).map(|d| (10 + d, false, d.to_string()));
        let spaced = (0..10u32).map(|d| (20 + d, true, d.to_string()));
        Arc::new(NumberVocab::new(digits.chain(spaced), 32, 1))
    }

    /// `n` as digit tokens (spaced: the first with a leading space).
    fn num(n: u64, spaced: bool) -> Vec<u32> {
        n.to_string()
            .bytes()
            .enumerate()
            .map(|(i, b)| u32::from(b - b'0') + if spaced && i == 0 { 20 } else { 10 })
            .collect()
    }

    /// `{ id: N, name: user_N }`: `1 2 [ N] 4 5 [N] 6 7`.
    fn record(n: u64) -> Vec<u32> {
        [vec![1, 2], num(n, true), vec![4, 5], num(n, false), vec![6, 7]].concat()
    }

    /// A list whose rows are shorter than k: the draft wraps past the context's end, and the
    /// numbers of every wrapped row count on.
    #[test]
    fn a_draft_wraps_past_the_end_and_keeps_counting() {
        let d = NgramDrafter::new(2, 8).with_numbers(numbers());
        // ` 1 ; 2 ; 3 ;` (3 is the separator) -> ` 4 ; 5 ; 6 ;`
        let ctx = [
            vec![1],
            num(1, true),
            vec![3],
            num(2, true),
            vec![3],
            num(3, true),
            vec![3],
        ]
        .concat();
        let want = [num(4, true), vec![3], num(5, true), vec![3], num(6, true), vec![3]].concat();
        assert_eq!(d.lookup(&ctx, 6), want);
        let once = NgramDrafter { wrap: false, ..d };
        assert_eq!(once.lookup(&ctx, 6), [num(4, true), vec![3]].concat());
    }

    #[test]
    fn a_new_number_matches_the_structure_around_an_earlier_one() {
        let d = NgramDrafter::new(2, 4).with_numbers(numbers());
        // `{ id : 16 , name : 16 } {` then `id : 17`: no exact 2-gram ends in 17, the
        // structural match proposes what followed the earlier number.
        let ctx = [1, 2, 3, 11, 16, 4, 5, 3, 11, 16, 6, 1, 2, 3, 11, 17];
        assert_eq!(d.lookup(&ctx, 3), vec![4, 5, 3]);
        assert!(NgramDrafter::new(2, 4).lookup(&ctx, 3).is_empty(), "no exact match");
        // A number of another class (space + digit) does not match a digit.
        let ctx = [1, 2, 3, 11, 16, 4, 5, 3, 21, 26, 6, 1, 2, 3, 11, 27];
        assert!(d.lookup(&ctx, 3).is_empty());
    }

    #[test]
    fn an_exact_match_wins_unless_the_structural_one_is_longer() {
        let d = NgramDrafter::new(2, 4).with_numbers(numbers());
        // Exact 4-gram `5 3 11 16` occurred (continued by 7), and a structural one `5 3 11 12`
        // (continued by 8): both at the cap, compared further back. Both go on one more token
        // (9 = 9) and no further: the exact continuation is proposed.
        let ctx = [9, 5, 3, 11, 16, 7, 9, 5, 3, 11, 12, 8, 9, 5, 3, 11, 16];
        assert_eq!(d.lookup(&ctx, 1), vec![7]);
        // Only the structural one goes on further back (9 = 9 before it, nothing before the
        // exact one): the structural continuation.
        let ctx = [5, 3, 11, 16, 7, 9, 5, 3, 11, 12, 8, 9, 5, 3, 11, 16];
        assert_eq!(d.lookup(&ctx, 1), vec![8]);
        // Exact match of 2 (`11 16` -> 7); structural match of 4 (`5 3 11 12` -> 8) wins.
        let ctx = [11, 16, 7, 9, 5, 3, 11, 12, 8, 9, 5, 3, 11, 16];
        assert_eq!(NgramDrafter::new(2, 4).lookup(&ctx, 1), vec![7]);
        assert_eq!(d.lookup(&ctx, 1), vec![8]);
        // Non-number tokens never match each other.
        let ctx = [1, 2, 9, 3, 1];
        assert!(d.lookup(&ctx, 1).is_empty());
    }

    #[test]
    fn numbers_in_the_continuation_count_on() {
        let d = NgramDrafter::new(2, 4).with_numbers(numbers());
        // Three records and the start of a fourth: the continuation of the third, with every
        // number one on, is the rest of the fourth and the start of the fifth.
        let ctx = [record(1), record(2), record(3), vec![1, 2], num(4, true), vec![4, 5]].concat();
        let want = [num(4, false), vec![6, 7, 1, 2], num(5, true), vec![4, 5]].concat();
        assert_eq!(d.lookup(&ctx, 8), want);
        // Without the number vocabulary: the literal continuation of the same occurrence.
        let literal = [num(3, false), vec![6, 7, 1, 2], num(4, true), vec![4, 5]].concat();
        assert_eq!(NgramDrafter::new(2, 4).lookup(&ctx, 8), literal);
        // 9 -> 10 changes the width: the number being written (` 1` of ` 10`) is completed,
        // and the next one is spelt with two digits.
        let ctx = [record(8), record(9), vec![1, 2], num(1, true)].concat();
        let want = [num(0, false), vec![4, 5], num(10, false), vec![6, 7]].concat();
        assert_eq!(d.lookup(&ctx, 7), want);
        // Digits written so far that disagree with the extrapolation: the number is left as
        // written, the continuation goes on from the earlier one (the next number still counts on).
        let ctx = [record(8), record(9), vec![1, 2], num(3, true)].concat();
        assert_eq!(d.lookup(&ctx, 4), [vec![4, 5], num(10, false)].concat());
    }

    #[test]
    fn constant_second_differences_continue_quadratically() {
        let d = NgramDrafter::new(2, 4).with_numbers(numbers());
        // ` N : N²,` for N = 1..5, then ` 6 :`.
        let line = |n: u64| [num(n, true), vec![3], num(n * n, true), vec![4]].concat();
        let ctx = [line(1), line(2), line(3), line(4), line(5), num(6, true), vec![3]].concat();
        // One lookup reaches the end of the context after ` 7 :`; the wrapped draft goes on
        // with ` 49,`.
        let once = NgramDrafter {
            wrap: false,
            ..d.clone()
        };
        assert_eq!(
            once.lookup(&ctx, 8),
            [num(36, true), vec![4], num(7, true), vec![3]].concat()
        );
        assert_eq!(
            d.lookup(&ctx, 8),
            [num(36, true), vec![4], num(7, true), vec![3], num(49, true), vec![4]].concat()
        );
        // Two periods only: the first difference (25 + 9 = 34, rejected by the target).
        let ctx = [line(4), line(5), num(6, true), vec![3]].concat();
        assert_eq!(d.lookup(&ctx, 2), [num(34, true)].concat()[..2].to_vec());
    }

    #[test]
    fn only_numbers_at_the_same_place_in_the_structure_are_extrapolated() {
        let v = numbers();
        let next = |ctx: &[u32], r, m| extrapolate(&number_runs(&v, ctx), ctx, r, m);
        let lined = [vec![8], num(1, true), vec![4, 8], num(2, true), vec![4]].concat();
        assert_eq!(next(&lined, 1, 1), Some(3));
        assert_eq!(next(&lined, 1, 0), None, "no period");
        assert_eq!(next(&lined, 0, 1), None, "nothing before the first");
        // Another token before the earlier number, or another spacing.
        let other = [vec![8], num(1, true), vec![4, 9], num(2, true), vec![4]].concat();
        assert_eq!(next(&other, 1, 1), None);
        let unspaced = [vec![8], num(1, true), vec![4, 8], num(2, false), vec![4]].concat();
        assert_eq!(next(&unspaced, 1, 1), None);
        // Counting down below zero: no extrapolation.
        let down = [vec![8], num(3, false), vec![4, 8], num(1, false), vec![4]].concat();
        assert_eq!(next(&down, 1, 1), None);
        // A run is every digit token after the first, spaced or not; a spaced one starts another.
        let runs = number_runs(&v, &[num(12, true), num(305, false), num(7, true)].concat());
        let got: Vec<_> = runs
            .iter()
            .map(|r| (r.start, r.end, r.value, r.width, r.spaced))
            .collect();
        assert_eq!(got, vec![(0, 5, Some(12305), 5, true), (5, 6, Some(7), 1, true)]);

        // Leading zeros keep the width, and the number being written is completed:
        // `1 007 2 1 008 2 1 0` -> `0 9 2` (009).
        let d = NgramDrafter::new(2, 4).with_numbers(numbers());
        let ctx = vec![1, 10, 10, 17, 2, 1, 10, 10, 18, 2, 1, 10];
        assert_eq!(d.lookup(&ctx, 3), vec![10, 19, 2]);
    }

    #[test]
    fn a_verbatim_copy_keeps_its_numbers() {
        let d = NgramDrafter::new(2, 4).with_numbers(numbers());
        // Rows `1 [ a] 4 [ b] 6` of a table, then the third written out again: its numbers are
        // the earlier row's, not one on (B's 2 and C's 1 would extrapolate to 0).
        let row = |a: u64, b: u64| [vec![1], num(a, true), vec![4], num(b, true), vec![6]].concat();
        let ctx = [row(3, 7), row(5, 2), row(8, 1), vec![1], num(8, true), vec![4]].concat();
        assert_eq!(d.lookup(&ctx, 3), [num(1, true), vec![6, 1]].concat());
    }

    #[test]
    fn numbers_are_spelt_in_the_tokenizer_groups() {
        // A Llama 3 style vocabulary: digit groups of up to three, left to right.
        let entries = [(1, "1"), (2, "0"), (3, "100"), (4, "99"), (5, "999")].map(|(id, t)| (id, false, t.to_string()));
        let v = NumberVocab::new(entries, 8, 3);
        assert_eq!(v.spell(false, "1000"), Some(vec![3, 2]));
        assert_eq!(v.spell(false, "999"), Some(vec![5]));
        assert_eq!(v.spell(false, "12"), None, "no token for the group");
        assert_eq!(v.spell(true, "1"), None, "no spaced token");
        assert_eq!(v.class(3), NUMBER_DIGITS);
        assert_eq!(v.class(7), NUMBER_NONE);
        assert_eq!(v.class(99), NUMBER_NONE, "past the vocabulary");
    }

    #[test]
    fn match_classes_bucket_length_and_kind() {
        let classes: Vec<usize> = [1, 2, 3, 4, 7, 8, 20]
            .iter()
            .map(|&n| MatchStats::class(n, false))
            .collect();
        assert_eq!(classes, vec![0, 2, 4, 6, 6, 8, 8]);
        assert_eq!(MatchStats::class(1, true), 1);
        assert_eq!(MatchStats::class(9, true), 9);
    }

    #[test]
    fn match_stats_count_tested_positions_and_cut_weak_classes() {
        let mut s = MatchStats::default();
        // The prior: 0.9 per position, so 0.9^j >= 0.3 keeps up to 11 tokens.
        assert!((s.acceptance(0, 0) - 0.9).abs() < 1e-12);
        assert_eq!(s.keep(0, 8, 0.3), 8);
        // A 4-token draft accepted up to 2: positions 0 and 1 accepted, 2 rejected, 3 untested.
        s.record(0, 4, 2);
        assert_eq!(s.counts[0][0], (1.0, 1.0));
        assert_eq!(s.counts[0][1], (1.0, 1.0));
        assert_eq!(s.counts[0][2], (0.0, 1.0));
        assert_eq!(s.counts[0][3], (0.0, 0.0));
        // Fully accepted: no rejected position; positions past the last share its counts.
        let mut s = MatchStats::default();
        s.record(2, 6, 6);
        assert_eq!(s.counts[2][3], (3.0, 3.0));
        // The next record decays the class's counts first (0.95), other classes untouched.
        s.record(2, 1, 0);
        assert!((s.counts[2][0].0 - 0.95).abs() < 1e-12 && (s.counts[2][0].1 - 1.95).abs() < 1e-12);
        assert_eq!(s.counts[0][0], (0.0, 0.0));

        // A class whose first token is rejected every time: (0 + 1.8) / (20 + 2) ~ 0.08 after
        // many drafts (decayed to ~20 tests), below any useful cut: nothing is proposed.
        let mut s = MatchStats::default();
        for _ in 0..200 {
            s.record(0, 3, 0);
        }
        let a = s.acceptance(0, 0);
        assert!((a - 1.8 / (20.0 + 2.0)).abs() < 1e-3, "{a}");
        assert_eq!(s.keep(0, 8, 0.3), 0);
        // Half of the first tokens accepted, the rest always: one token is worth it at 0.3
        // (reach ~0.5), all eight too (later positions ~1).
        let mut s = MatchStats::default();
        for i in 0..200 {
            s.record(0, 8, if i % 2 == 0 { 0 } else { 8 });
        }
        let first = s.acceptance(0, 0);
        assert!((0.5..0.6).contains(&first), "{first}");
        assert!(s.acceptance(0, 3) > 0.99);
        assert_eq!(s.keep(0, 8, 0.3), 8);
        assert_eq!(s.keep(0, 8, 0.6), 0);
    }

    /// The drafter learns the outcome of its last draft from the next context, and cuts the
    /// drafts of a class that keeps failing, while another class still drafts whole.
    #[test]
    fn the_drafter_learns_from_the_next_context() {
        let mut d = NgramDrafter {
            min_confidence: 0.3,
            ..NgramDrafter::new(1, 4)
        };
        // `1 2 ... 1` matches one token (class 0) and proposes `2 3`.
        let ctx = vec![1, 2, 3, 9, 1];
        assert_eq!(d.propose_tokens(&ctx, 2), vec![2, 3]);
        // Proposed again for the same context (nothing verified in between): nothing learned.
        assert_eq!(d.propose_tokens(&ctx, 2), vec![2, 3]);
        assert_eq!(d.stats.counts[0][0], (0.0, 0.0));
        // The target wrote `2 5`: one accepted, the second rejected.
        let ctx = [ctx, vec![2, 5]].concat();
        d.propose_tokens(&ctx, 2);
        assert_eq!(d.stats.counts[0][0], (1.0, 1.0));
        assert_eq!(d.stats.counts[0][1], (0.0, 1.0));
        assert_eq!(d.stats.counts[0][2], (0.0, 0.0));

        // One-token matches that always fail end up proposing nothing; a 4-token match of the
        // same context still drafts whole.
        let mut d = NgramDrafter {
            min_confidence: 0.3,
            ..NgramDrafter::new(1, 4)
        };
        for _ in 0..100 {
            d.stats.record(MatchStats::class(1, false), 2, 0);
        }
        assert!(d.propose_tokens(&[1, 2, 3, 9, 1], 2).is_empty());
        assert_eq!(d.propose_tokens(&[5, 6, 7, 8, 1, 2, 5, 6, 7, 8], 2), vec![1, 2]);
        // Without the cut the same stats change nothing.
        d.min_confidence = 0.0;
        assert_eq!(d.propose_tokens(&[1, 2, 3, 9, 1], 2), vec![2, 3]);
    }

    /// A draft that was not verified whole (the lookup beside a model drafter, whose step
    /// committed fewer tokens than the draft holds) is scored only as far as the committed
    /// tokens go; [`NgramDrafter::pending_alphas`] gives the cautious estimates of the draft.
    #[test]
    fn an_unverified_draft_is_scored_on_the_committed_tokens_only() {
        let mut d = NgramDrafter::new(1, 4);
        let ctx = vec![1, 2, 3, 4, 5, 9, 1];
        assert_eq!(d.propose_tokens(&ctx, 4), vec![2, 3, 4, 5]);
        // Untested class: the cautious prior 0.5, then each position follows the one before.
        assert_eq!(d.pending_alphas(), vec![0.5; 4]);
        // Another drafter's step committed `2 3`, both equal to the draft: two positions
        // accepted, none rejected, the last two untested.
        let ctx = [ctx, vec![2, 3]].concat();
        d.propose_tokens(&ctx, 4);
        assert_eq!(d.stats.counts[0][0], (1.0, 1.0));
        assert_eq!(d.stats.counts[0][1], (1.0, 1.0));
        assert_eq!(d.stats.counts[0][2], (0.0, 0.0));
        // (1 + 0.5 * 2) / (1 + 2) = 2/3 at positions 0 and then (1 + 2/3 * 2) / 3 = 7/9; the
        // untested positions keep the estimate before them.
        let a = d.stats.cautious(0, 4);
        let want = [2.0 / 3.0, 7.0 / 9.0, 7.0 / 9.0, 7.0 / 9.0];
        assert!(a.iter().zip(want).all(|(x, y)| (x - y).abs() < 1e-12), "{a:?}");
        // A step that committed a token unlike the draft's first: position 0 rejected.
        let mut d = NgramDrafter::new(1, 4);
        let ctx = vec![1, 2, 3, 4, 5, 9, 1];
        d.propose_tokens(&ctx, 4);
        d.propose_tokens(&[ctx, vec![7]].concat(), 4);
        assert_eq!(d.stats.counts[0][0], (0.0, 1.0));
        assert_eq!(d.stats.counts[0][1], (0.0, 0.0));
    }

    /// Without number tokens in the context, the number vocabulary changes nothing.
    #[test]
    fn contexts_without_numbers_are_unchanged() {
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        let plain = NgramDrafter::new(2, 4);
        let with = NgramDrafter::new(2, 4).with_numbers(numbers());
        for case in 0..2000 {
            let len = 1 + case % 50;
            let ctx: Vec<u32> = (0..len)
                .map(|_| {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    1 + (state % (2 + case as u64 % 6)) as u32
                })
                .collect();
            let k = 1 + case % 8;
            assert_eq!(with.lookup(&ctx, k), plain.lookup(&ctx, k), "{ctx:?} k={k}");
        }
    }
}
