//! The Mixture-of-Experts MLP: a router picks the top-k of its softmax per token, the token
//! runs those SwiGLU experts, and their outputs are summed weighted by the routing
//! probabilities; optionally a shared expert every token runs, scaled by a sigmoid gate.
//!
//! Reference: Shazeer et al. 2017, "Outrageously Large Neural Networks: The Sparsely-Gated
//! Mixture-of-Experts Layer"; Qwen2-MoE / Qwen3-MoE as transformers (`modeling_qwen2_moe.py`,
//! `modeling_qwen3_moe.py`) and llama.cpp (`build_moe_ffn` in `llama-graph.cpp`) run them.
//!
//! **Batch invariance.** A token's output is a function of its own row only, computed in a
//! fixed order whatever the other rows of the pass are: the router's logits by a fixed-order
//! dot product, the softmax and top-k per row, each expert's products on Specula's
//! batch-invariant kernels (row i of an m-row product is bitwise the one-row product, so
//! gathering the rows that chose an expert into one product changes no bit), and the weighted
//! sum in the order of the token's top-k ranks (llama.cpp's order: `e_0 w_0 + e_1 w_1 + ...`),
//! then the shared expert's gated output added last.

use anyhow::{bail, Result};

use super::{attention, GatedMlp as Expert, Linear};

/// The shared expert of Qwen2-MoE / Qwen3-Next: every token runs it, and its output is scaled
/// by `sigmoid(gate · x)`.
#[derive(Debug, Clone)]
pub struct SharedExpert {
    pub expert: Expert,
    /// The gate's weights, `[hidden]` f32.
    pub gate: Vec<f32>,
}

/// The weights and routing of one MoE MLP.
#[derive(Debug, Clone)]
pub struct MoeMlp {
    /// The router, `[experts, hidden]` f32 row-major.
    router: Vec<f32>,
    experts: Vec<Expert>,
    shared: Option<SharedExpert>,
    /// Experts per token (top-k).
    top_k: usize,
    /// Renormalize the top-k probabilities to sum to 1.
    norm_topk: bool,
    hidden: usize,
}

/// `a · b` in a fixed order: eight f32 partial sums over the 8-wide chunks, combined in a
/// fixed tree, then the tail. Vectorizes, and gives the same bits for the same row wherever it
/// is computed.
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    s
}

impl MoeMlp {
    /// An MoE MLP from its router (`[experts, hidden]` f32 row-major), its experts (each of the
    /// same widths), an optional shared expert, `top_k` experts per token and whether their
    /// weights are renormalized. Errors: shapes that disagree, `top_k` of 0 or more than the
    /// experts.
    pub fn new(
        router: Vec<f32>,
        experts: Vec<Expert>,
        shared: Option<SharedExpert>,
        top_k: usize,
        norm_topk: bool,
    ) -> Result<Self> {
        let n = experts.len();
        if n == 0 || top_k == 0 || top_k > n {
            bail!("{top_k} experts per token out of {n}: expected 1 to {n}");
        }
        if !router.len().is_multiple_of(n) {
            bail!("the router has {} values, not a multiple of {n} experts", router.len());
        }
        let hidden = router.len() / n;
        if let Some(s) = &shared {
            if s.gate.len() != hidden {
                bail!(
                    "the shared expert's gate has {} values, the hidden size is {hidden}",
                    s.gate.len()
                );
            }
        }
        Ok(Self {
            router,
            experts,
            shared,
            top_k,
            norm_topk,
            hidden,
        })
    }

    /// Whether every expert's products run on batch-invariant kernels.
    pub fn is_batch_invariant(&self) -> bool {
        self.experts.iter().all(Expert::is_batch_invariant)
            && self.shared.as_ref().is_none_or(|s| s.expert.is_batch_invariant())
    }

    /// The routed experts.
    pub fn experts(&self) -> &[Expert] {
        &self.experts
    }

    /// The shared expert, if any.
    pub fn shared(&self) -> Option<&SharedExpert> {
        self.shared.as_ref()
    }

    /// The experts one row `x` (`[hidden]`) is routed to, by rank, with their weights: the
    /// router's logits, their softmax (f32 exponentials, their sum in f64 as ggml's
    /// `soft_max`), the `top_k` largest (ties to the lower expert number), renormalized when
    /// configured.
    pub fn route(&self, x: &[f32]) -> Vec<(usize, f32)> {
        let logits: Vec<f32> = self.router.chunks_exact(self.hidden).map(|w| dot(w, x)).collect();
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let exps: Vec<f32> = logits.iter().map(|&l| (l - max).exp()).collect();
        let sum: f64 = exps.iter().map(|&e| f64::from(e)).sum();
        let inv = (1.0 / sum) as f32;
        let probs: Vec<f32> = exps.iter().map(|&e| e * inv).collect();
        let mut taken = vec![false; probs.len()];
        let mut top = Vec::with_capacity(self.top_k);
        for _ in 0..self.top_k {
            let mut best: Option<usize> = None;
            for (e, &p) in probs.iter().enumerate() {
                if !taken[e] && best.is_none_or(|b| p > probs[b]) {
                    best = Some(e);
                }
            }
            let Some(b) = best else { break };
            taken[b] = true;
            top.push((b, probs[b]));
        }
        if self.norm_topk {
            let s: f32 = top.iter().map(|&(_, p)| p).sum();
            for (_, p) in top.iter_mut() {
                *p /= s;
            }
        }
        top
    }

    /// The MLP of `h` (`rows` rows of `[hidden]` f32, row-major): `[rows, hidden]`. The rows
    /// routed to the same expert share its products (one parallel pass for every expert's gate
    /// and up, one for the downs).
    pub fn forward(&self, h: &[f32], rows: usize) -> Result<Vec<f32>> {
        let hs = self.hidden;
        if h.len() != rows * hs {
            bail!("the MoE input has {} values, expected {rows} rows of {hs}", h.len());
        }
        let routes: Vec<Vec<(usize, f32)>> = h.chunks_exact(hs).map(|x| self.route(x)).collect();
        // Per expert, the rows routed to it (in row order).
        let mut members: Vec<Vec<usize>> = vec![Vec::new(); self.experts.len()];
        for (r, route) in routes.iter().enumerate() {
            for &(e, _) in route {
                members[e].push(r);
            }
        }
        let used: Vec<usize> = (0..self.experts.len()).filter(|&e| !members[e].is_empty()).collect();
        let inputs: Vec<Vec<f32>> = used
            .iter()
            .map(|&e| {
                members[e]
                    .iter()
                    .flat_map(|&r| h[r * hs..(r + 1) * hs].iter().copied())
                    .collect()
            })
            .collect();
        // The products: every used expert's gate and up, and the shared expert's, in one pass.
        let mut items: Vec<(&Linear, &[f32], usize)> = Vec::with_capacity(2 * used.len() + 2);
        for (&e, x) in used.iter().zip(&inputs) {
            let ex = &self.experts[e];
            items.push((&ex.gate, x, members[e].len()));
            items.push((&ex.up, x, members[e].len()));
        }
        if let Some(s) = &self.shared {
            items.push((&s.expert.gate, h, rows));
            items.push((&s.expert.up, h, rows));
        }
        let gu = Linear::forward_rows_each(&items)?;
        let acts: Vec<Vec<f32>> = gu.chunks_exact(2).map(|p| attention::silu_mul(&p[0], &p[1])).collect();
        let mut items: Vec<(&Linear, &[f32], usize)> = Vec::with_capacity(used.len() + 1);
        for (&e, a) in used.iter().zip(&acts) {
            items.push((&self.experts[e].down, a, members[e].len()));
        }
        if let Some(s) = &self.shared {
            items.push((&s.expert.down, &acts[used.len()], rows));
        }
        let downs = Linear::forward_rows_each(&items)?;
        // Where each expert's output rows are: `slot[e]` indexes `downs`, row `members[e][i]`
        // is its row i.
        let mut slot = vec![usize::MAX; self.experts.len()];
        for (i, &e) in used.iter().enumerate() {
            slot[e] = i;
        }
        let mut out = vec![0f32; rows * hs];
        let mut cursor = vec![0usize; self.experts.len()];
        for (r, route) in routes.iter().enumerate() {
            let o = &mut out[r * hs..(r + 1) * hs];
            for (rank, &(e, w)) in route.iter().enumerate() {
                let i = cursor[e];
                cursor[e] += 1;
                debug_assert_eq!(members[e][i], r);
                let y = &downs[slot[e]][i * hs..(i + 1) * hs];
                if rank == 0 {
                    for (o, &y) in o.iter_mut().zip(y) {
                        *o = y * w;
                    }
                } else {
                    for (o, &y) in o.iter_mut().zip(y) {
                        *o += y * w;
                    }
                }
            }
            if let Some(s) = &self.shared {
                let g = dot(&s.gate, &h[r * hs..(r + 1) * hs]);
                let g = 1.0 / (1.0 + (-g).exp());
                let y = &downs[used.len()][r * hs..(r + 1) * hs];
                for (o, &y) in o.iter_mut().zip(y) {
                    *o += y * g;
                }
            }
        }
        Ok(out)
    }
}
