//! S-law: speculative sampling commits tokens with exactly the target's law.
//!
//! For vocab 4 and drafts of up to 3 tokens, this enumerates every outcome of drafting (each
//! draft sequence with its probability under q) and of acceptance (every branch the production
//! [`accept_sampled`] can take, with its exact probability, through an enumerating
//! [`Randomness`]), over the emitted stream: a rejection does not end generation, the next step
//! drafts again from the new prefix, until `N` tokens are emitted. The law of the first `N`
//! tokens must equal the target's autoregressive law `prod p(t_i | t_<i)` exactly (to f64
//! rounding; every probability here is a multiple of 1/16, exact in f32).
//!
//! The same harness run on planted defects (accepting with p/q without the min, resampling
//! from p instead of the residual, a greedy bonus token, accepting with p regardless of q) must
//! report a law mismatch: the test can fail.

use std::collections::{BTreeMap, HashMap};

use specula_engine::speculative::verify::{accept_sampled, Randomness};

const V: u32 = 4;
/// Tokens of the emitted stream whose law is checked.
const N: usize = 4;

/// A distribution over the vocab as sparse `(token, prob)` pairs, zero entries omitted.
type Dist = Vec<(u32, f32)>;

/// A deterministic pseudo-random function of (seed, prefix).
fn mix(seed: u64, prefix: &[u32]) -> u64 {
    let mut h = seed ^ 0x9E37_79B9_7F4A_7C15;
    for &t in prefix {
        h = (h ^ (t as u64 + 1)).wrapping_mul(0x100_0000_01B3);
        h ^= h >> 29;
    }
    h.wrapping_mul(0xBF58_476D_1CE4_E5B9) ^ (h >> 31)
}

/// A distribution with probabilities in sixteenths, zeros allowed, chosen by `h`.
fn dyadic(h: u64) -> Dist {
    let mut w = [0u32; V as usize];
    let mut x = h;
    for _ in 0..16 {
        w[(x % V as u64) as usize] += 1;
        x = x.rotate_right(7).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xABCD;
    }
    w.iter()
        .enumerate()
        .filter(|(_, &c)| c > 0)
        .map(|(t, &c)| (t as u32, c as f32 / 16.0))
        .collect()
}

fn onehot(t: u32) -> Dist {
    vec![(t, 1.0)]
}

fn uniform() -> Dist {
    (0..V).map(|t| (t, 0.25)).collect()
}

/// A distribution as a function of the prefix.
type DistFn = Box<dyn Fn(&[u32]) -> Dist>;
/// A deterministic drafter's proposal as a function of the prefix.
type TokenFn = Box<dyn Fn(&[u32]) -> u32>;

/// An adversarial (p, q) family: target p and drafter q as functions of the prefix. `q = None`
/// is a deterministic drafter proposing `det(prefix)`.
struct Family {
    name: &'static str,
    p: DistFn,
    q: Option<DistFn>,
    det: TokenFn,
}

fn families() -> Vec<Family> {
    let fam = |name, p: DistFn, q: Option<DistFn>| Family {
        name,
        p,
        q,
        det: Box::new(|pre: &[u32]| (mix(7, pre) % V as u64) as u32),
    };
    vec![
        fam(
            "random p, random q",
            Box::new(|pre| dyadic(mix(1, pre))),
            Some(Box::new(|pre| dyadic(mix(2, pre)))),
        ),
        fam(
            "q equals p",
            Box::new(|pre| dyadic(mix(3, pre))),
            Some(Box::new(|pre| dyadic(mix(3, pre)))),
        ),
        fam(
            "disjoint supports",
            Box::new(|_| vec![(0, 0.5), (1, 0.5)]),
            Some(Box::new(|_| vec![(2, 0.75), (3, 0.25)])),
        ),
        fam(
            "p one-hot, q uniform",
            Box::new(|pre| onehot((mix(4, pre) % V as u64) as u32)),
            Some(Box::new(|_| uniform())),
        ),
        fam(
            "p uniform, q one-hot",
            Box::new(|_| uniform()),
            Some(Box::new(|pre| onehot((mix(5, pre) % V as u64) as u32))),
        ),
        fam(
            "q concentrated where p is small",
            Box::new(|_| vec![(0, 0.0625), (1, 0.5), (2, 0.4375)]),
            Some(Box::new(|_| vec![(0, 0.875), (3, 0.125)])),
        ),
        fam(
            "p depends on the prefix, q does not",
            Box::new(|pre| dyadic(mix(6, pre))),
            Some(Box::new(|_| vec![(1, 0.25), (2, 0.75)])),
        ),
        fam(
            "deterministic drafter, random p",
            Box::new(|pre| dyadic(mix(8, pre))),
            None,
        ),
        fam(
            "deterministic drafter, p one-hot",
            Box::new(|pre| onehot((mix(9, pre) % V as u64) as u32)),
            None,
        ),
    ]
}

/// Enumerates every branch of the decisions an acceptance function makes: each run follows a
/// script of choices (extended with choice 0 past its end) and multiplies the branch weights.
#[derive(Default)]
struct Enumerator {
    script: Vec<usize>,
    arity: Vec<usize>,
    pos: usize,
    weight: f64,
}

impl Enumerator {
    fn choose(&mut self, n: usize) -> usize {
        if self.pos == self.script.len() {
            self.script.push(0);
        }
        self.arity.truncate(self.pos);
        self.arity.push(n);
        let c = self.script[self.pos];
        self.pos += 1;
        c
    }

    /// Move the script to the next unexplored branch; false when all are done.
    fn advance(&mut self) -> bool {
        self.script.truncate(self.pos);
        while let Some(last) = self.script.pop() {
            let j = self.script.len();
            if last + 1 < self.arity[j] {
                self.script.push(last + 1);
                return true;
            }
        }
        false
    }
}

impl Randomness for Enumerator {
    fn bernoulli(&mut self, prob: f64) -> bool {
        let c = self.choose(2);
        self.weight *= if c == 0 { prob } else { 1.0 - prob };
        c == 0
    }

    fn categorical(&mut self, weights: &[f64]) -> usize {
        let total: f64 = weights.iter().sum();
        let c = self.choose(weights.len());
        self.weight *= weights[c] / total;
        c
    }
}

/// The acceptance function under test (production or a planted defect).
type AcceptFn = fn(&[u32], Option<&[Dist]>, &mut dyn FnMut(usize) -> Dist, &mut dyn Randomness) -> (usize, u32);

/// Every outcome (accepted length, next token) of one acceptance call with its probability.
fn acceptance_outcomes(
    accept: AcceptFn,
    prefix: &[u32],
    draft: &[u32],
    qs: Option<&[Dist]>,
    f: &Family,
) -> Vec<((usize, u32), f64)> {
    let mut out = Vec::new();
    let mut e = Enumerator::default();
    loop {
        e.pos = 0;
        e.weight = 1.0;
        let mut rows_asked = 0;
        let mut target = |i: usize| {
            assert_eq!(i, rows_asked, "rows must be asked in order");
            rows_asked += 1;
            let mut ctx = prefix.to_vec();
            ctx.extend_from_slice(&draft[..i]);
            (f.p)(&ctx)
        };
        let r = accept(draft, qs, &mut target, &mut e);
        if e.weight != 0.0 {
            out.push((r, e.weight));
        }
        if !e.advance() {
            return out;
        }
    }
}

/// Every draft of length `k` after `prefix` with its probability under the drafter, and the q
/// rows it was drawn from (`None` for the deterministic drafter).
fn drafts(f: &Family, prefix: &[u32], k: usize) -> Vec<(Vec<u32>, Option<Vec<Dist>>, f64)> {
    let mut out = vec![(Vec::new(), f.q.as_ref().map(|_| Vec::new()), 1.0)];
    for _ in 0..k {
        let mut next = Vec::new();
        for (d, qs, w) in out {
            let mut ctx = prefix.to_vec();
            ctx.extend_from_slice(&d);
            match &f.q {
                None => {
                    let mut d2 = d.clone();
                    d2.push((f.det)(&ctx));
                    next.push((d2, None, w));
                }
                Some(q) => {
                    let qi = q(&ctx);
                    for &(t, pt) in &qi {
                        let mut d2 = d.clone();
                        d2.push(t);
                        let mut qs2 = qs.clone().unwrap_or_default();
                        qs2.push(qi.clone());
                        next.push((d2, Some(qs2), w * pt as f64));
                    }
                }
            }
        }
        out = next;
    }
    out
}

/// The law of the first N emitted tokens under speculative decoding with draft length `k`.
/// Prefixes are expanded shortest first, merging equal prefixes, so the work is bounded by the
/// number of distinct prefixes rather than the number of paths.
fn spec_law(accept: AcceptFn, f: &Family, k: usize) -> HashMap<Vec<u32>, f64> {
    let mut law = HashMap::new();
    let mut frontier: BTreeMap<(usize, Vec<u32>), f64> = BTreeMap::new();
    frontier.insert((0, Vec::new()), 1.0);
    while let Some(((_, prefix), w)) = frontier.pop_first() {
        if prefix.len() >= N {
            *law.entry(prefix[..N].to_vec()).or_insert(0.0) += w;
            continue;
        }
        for (draft, qs, wq) in drafts(f, &prefix, k) {
            for ((a, next), wa) in acceptance_outcomes(accept, &prefix, &draft, qs.as_deref(), f) {
                let mut p2 = prefix.clone();
                p2.extend_from_slice(&draft[..a]);
                p2.push(next);
                p2.truncate(N);
                *frontier.entry((p2.len(), p2)).or_insert(0.0) += w * wq * wa;
            }
        }
    }
    law
}

/// The target's autoregressive law of N tokens.
fn ar_law(f: &Family) -> HashMap<Vec<u32>, f64> {
    let mut law = HashMap::new();
    let mut stack = vec![(Vec::<u32>::new(), 1.0f64)];
    while let Some((prefix, w)) = stack.pop() {
        if prefix.len() == N {
            *law.entry(prefix).or_insert(0.0) += w;
            continue;
        }
        for (t, pt) in (f.p)(&prefix) {
            let mut p2 = prefix.clone();
            p2.push(t);
            stack.push((p2, w * pt as f64));
        }
    }
    law
}

/// The largest |spec - AR| over all sequences of N tokens.
fn max_law_error(accept: AcceptFn, f: &Family, k: usize) -> f64 {
    let (spec, ar) = (spec_law(accept, f, k), ar_law(f));
    spec.keys()
        .chain(ar.keys())
        .map(|s| (spec.get(s).copied().unwrap_or(0.0) - ar.get(s).copied().unwrap_or(0.0)).abs())
        .fold(0.0, f64::max)
}

fn production(d: &[u32], q: Option<&[Dist]>, t: &mut dyn FnMut(usize) -> Dist, r: &mut dyn Randomness) -> (usize, u32) {
    accept_sampled(d, q, t, r)
}

#[test]
fn committed_tokens_follow_the_target_law_exactly() {
    for f in families() {
        for k in 1..=3 {
            let err = max_law_error(production, &f, k);
            assert!(err < 1e-12, "family `{}`, k = {k}: law differs by {err:e}", f.name);
        }
    }
}

// ---- planted defects: the harness must catch each ----

#[derive(Clone, Copy, PartialEq)]
enum Defect {
    /// Accept with probability p/q, not min(1, p/q).
    NoMin,
    /// Resample from p instead of norm(max(0, p - q)) after a rejection.
    ResampleFromP,
    /// The bonus token after a full accept is p's argmax instead of a draw.
    GreedyBonus,
    /// Accept with probability p(d), ignoring q.
    IgnoreQ,
    /// No defect (the control).
    Nothing,
}

fn prob(d: &[(u32, f32)], t: u32) -> f64 {
    d.iter().find(|x| x.0 == t).map_or(0.0, |x| x.1 as f64)
}

fn draw(p: &[(u32, f32)], w: &[f64], r: &mut dyn Randomness) -> u32 {
    p[r.categorical(w)].0
}

/// A deliberately wrong acceptance, one defect at a time.
fn defective(
    defect: Defect,
    draft: &[u32],
    q: Option<&[Dist]>,
    target: &mut dyn FnMut(usize) -> Dist,
    r: &mut dyn Randomness,
) -> (usize, u32) {
    for (i, &d) in draft.iter().enumerate() {
        let p = target(i);
        let qi: Dist = q.map_or_else(|| onehot(d), |q| q[i].clone());
        let (pd, qd) = (prob(&p, d), prob(&qi, d));
        let a = match defect {
            Defect::NoMin => pd / qd,
            Defect::IgnoreQ => pd,
            _ => (pd / qd).min(1.0),
        };
        if a > 0.0 && r.bernoulli(a) {
            continue;
        }
        let w: Vec<f64> = if defect == Defect::ResampleFromP {
            p.iter().map(|x| x.1 as f64).collect()
        } else {
            p.iter().map(|x| (x.1 as f64 - prob(&qi, x.0)).max(0.0)).collect()
        };
        if w.iter().all(|&x| x == 0.0) {
            let pw: Vec<f64> = p.iter().map(|x| x.1 as f64).collect();
            return (i, draw(&p, &pw, r));
        }
        return (i, draw(&p, &w, r));
    }
    let p = target(draft.len());
    if defect == Defect::GreedyBonus {
        let best = p.iter().fold(p[0], |b, &x| if x.1 > b.1 { x } else { b });
        return (draft.len(), best.0);
    }
    let pw: Vec<f64> = p.iter().map(|x| x.1 as f64).collect();
    (draft.len(), draw(&p, &pw, r))
}

macro_rules! mutant {
    ($name:ident, $defect:expr) => {
        fn $name(
            d: &[u32],
            q: Option<&[Dist]>,
            t: &mut dyn FnMut(usize) -> Dist,
            r: &mut dyn Randomness,
        ) -> (usize, u32) {
            defective($defect, d, q, t, r)
        }
    };
}
mutant!(no_min, Defect::NoMin);
mutant!(resample_from_p, Defect::ResampleFromP);
mutant!(greedy_bonus, Defect::GreedyBonus);
mutant!(ignore_q, Defect::IgnoreQ);
mutant!(no_defect, Defect::Nothing);

#[test]
fn planted_defects_are_caught() {
    let fams = families();
    for (name, accept) in [
        ("no min", no_min as AcceptFn),
        ("resample from p", resample_from_p as AcceptFn),
        ("greedy bonus", greedy_bonus as AcceptFn),
        ("ignore q", ignore_q as AcceptFn),
    ] {
        let worst = fams
            .iter()
            .flat_map(|f| (1..=3).map(move |k| (f, k)))
            .map(|(f, k)| max_law_error(accept, f, k))
            .fold(0.0, f64::max);
        assert!(
            worst > 1e-3,
            "planted defect `{name}` went unnoticed (max law error {worst:e})"
        );
    }
    // The same code with no defect planted passes: what the mutants trip on is their defect.
    for f in &fams {
        for k in 1..=3 {
            let err = max_law_error(no_defect, f, k);
            assert!(err < 1e-12, "control, family `{}`, k = {k}: {err:e}", f.name);
        }
    }
}

/// The law of the token committed at a position where one sampled draft `d ~ q` may be verified
/// (vocab 2, target `p`): `keep(d, q(d))` says whether the draft is verified (production
/// [`accept_sampled`] on it) or dropped (the token is drawn from `p`, as a step without a
/// draft does).
fn one_draft_law(p: &Dist, q: &Dist, keep: &dyn Fn(u32, f32) -> bool) -> [f64; 2] {
    let mut law = [0.0; 2];
    for &(d, qd) in q {
        if !keep(d, qd) {
            for &(t, pt) in p {
                law[t as usize] += qd as f64 * pt as f64;
            }
            continue;
        }
        let mut e = Enumerator::default();
        loop {
            e.pos = 0;
            e.weight = 1.0;
            let (accepted, next) = accept_sampled(&[d], Some(std::slice::from_ref(q)), &mut |_| p.clone(), &mut e);
            // The committed token at this position: the draft, or the residual draw.
            let t = if accepted == 1 { d } else { next };
            law[t as usize] += qd as f64 * e.weight;
            if !e.advance() {
                break;
            }
        }
    }
    law
}

/// A draft-length policy that drops sampled drafts by their own confidence would bias the law
/// (q = (0.9, 0.1), p = (0.5, 0.5): 0.55 / 0.45; to f32 rounding, 0.9 being inexact in f32);
/// the production policy
/// (`DraftLength::verified_prefix`, with a calibration that would cut a 0.1-confidence greedy
/// draft) keeps every sampled draft, and the law is p's.
#[test]
fn a_confidence_cut_of_sampled_drafts_would_bias_the_law() {
    use specula_engine::speculative::{DraftLength, Proposal};
    let p: Dist = vec![(0, 0.5), (1, 0.5)];
    let q: Dist = vec![(0, 0.9), (1, 0.1)];
    // A controller that has learned that low-confidence first drafts fail, with verify rows
    // that are not free: it cuts a greedy 0.1-confidence draft and keeps a 0.9 one.
    let mut ctl = DraftLength::new(4, true);
    for r in 1..=5 {
        ctl.observe_forward(r, 0.01 * (1.0 + 0.3 * (r - 1) as f64));
    }
    ctl.observe_draft(1, 0.001, 0.0);
    for _ in 0..100 {
        ctl.observe_confidence(&[0.95], 1);
        ctl.observe_confidence(&[0.05], 0);
    }
    let greedy = |c: f32| Proposal {
        tokens: vec![0],
        q: None,
        confidence: Some(vec![c]),
    };
    assert_eq!(ctl.verified_prefix(&greedy(0.1)), 0, "the greedy draft is cut");
    assert_eq!(ctl.verified_prefix(&greedy(0.9)), 1);
    // The planted defect: the same cut applied to sampled drafts.
    let biased = one_draft_law(&p, &q, &|_, c| ctl.cut(&[c]) == 1);
    assert!((biased[0] - 0.55).abs() < 1e-6, "{biased:?}");
    // Production: a sampled proposal is verified whole.
    let production = one_draft_law(&p, &q, &|d, c| {
        ctl.verified_prefix(&Proposal {
            tokens: vec![d],
            q: Some(vec![q.clone()]),
            confidence: Some(vec![c]),
        }) == 1
    });
    assert!(
        (production[0] - 0.5).abs() < 1e-6 && (production[1] - 0.5).abs() < 1e-6,
        "{production:?}"
    );
}
