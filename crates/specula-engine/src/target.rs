//! The target: the model whose logits decide every committed token, behind one contract for every
//! device, so that [`crate::Engine::step`] is the one step path.
//!
//! A forward takes segments, one per sequence: the tokens to feed at positions `kv.len() ..`, the
//! sequence's target state, and which logits rows it needs. On the CPU ([`crate::model::Model`])
//! the state is the sequence's KV rows; on a device ([`crate::device::DeviceTarget`]) the KV rows
//! live in the sequence's slot there, and the host state only counts the committed positions.
//! Either way the forward appends the fed positions to the state, and rolling back to a
//! committed length is [`TargetState::commit`], the one place a sequence's target state is cut.

use anyhow::{bail, Result};
use candle_core::Tensor;

use crate::device::{run_segments, DeviceSegment, RowOut, SlotLease};
use crate::engine::DeviceState;
use crate::kv_cache::KvCache;
use crate::model::{LogitsRows, Model, Segment};

/// What a sequence holds in the target between steps: its KV rows on the host, or on a device
/// target the count of the committed positions of its KV slot there, with the slot's lease.
#[derive(Debug)]
pub struct TargetState {
    kv: KvCache,
    slot: Option<SlotLease>,
}

impl TargetState {
    /// A state over `kv` (empty, or holding a cached prefix), without a device slot.
    pub fn new(kv: KvCache) -> Self {
        Self { kv, slot: None }
    }

    /// Hold a device KV slot (the sequence runs on an attached device).
    pub fn set_slot(&mut self, lease: SlotLease) {
        self.slot = Some(lease);
    }

    /// The device KV slot held, if any.
    pub fn slot(&self) -> Option<u32> {
        self.slot.as_ref().map(SlotLease::slot)
    }

    /// Committed positions.
    pub fn len(&self) -> usize {
        self.kv.len()
    }

    pub fn is_empty(&self) -> bool {
        self.kv.is_empty()
    }

    /// The host KV cache (a forward appends to it; the prefix cache reads and fills it).
    pub fn kv(&self) -> &KvCache {
        &self.kv
    }

    pub fn kv_mut(&mut self) -> &mut KvCache {
        &mut self.kv
    }

    /// Keep the first `len` positions and drop the rest: the rejected drafts after a verify,
    /// or the rows past a prefix-cache hit. KV rows are cut; a device slot's dropped positions
    /// are overwritten when they are fed again. (A recurrent state would restore its checkpoint
    /// at `len` here.)
    pub fn commit(&mut self, len: usize) {
        self.kv.truncate(len);
    }

    /// The KV cache, the device slot released (a finished sequence).
    pub fn into_kv(self) -> KvCache {
        self.kv
    }
}

/// One sequence's part of a [`Target::forward`].
#[derive(Debug)]
pub struct TargetSegment<'a> {
    /// Tokens to feed, at positions `state.len() .. state.len() + tokens.len()`.
    pub tokens: &'a [u32],
    /// The sequence's target state; the forward advances it by `tokens.len()`.
    pub state: &'a mut TargetState,
    /// Which rows need logits.
    pub rows: LogitsRows,
    /// Only each row's argmax is needed (greedy without anything that reads the logits).
    pub argmax_only: bool,
}

/// The rows a forward returns for one segment.
#[derive(Debug, Clone, PartialEq)]
pub enum TargetRows {
    /// f32 logits `[vocab]` per row.
    Logits(Vec<Vec<f32>>),
    /// Each row's argmax (lowest id on a tie, [`crate::sampling::argmax`]).
    Argmax(Vec<u32>),
}

impl TargetRows {
    pub fn len(&self) -> usize {
        match self {
            Self::Logits(r) => r.len(),
            Self::Argmax(a) => a.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// One segment's result of a [`Target::forward`].
#[derive(Debug)]
pub struct SegmentOutput {
    pub rows: TargetRows,
    /// The hidden states after the requested taps, in the order asked, each `[fed tokens,
    /// hidden]` f32 (empty on a target without hidden-state output).
    pub hidden: Vec<Tensor>,
}

/// A target model on some device.
pub trait Target {
    /// Whether a row's bits are the same whatever else is in the forward: only then are
    /// sequences batched together (and speculation exact).
    fn batch_invariant(&self) -> bool;
    /// Whether [`Target::forward`] returns hidden states for taps (native drafters read them).
    fn hidden_states(&self) -> bool;
    /// Why a sequence with taps cannot run here (when [`Target::hidden_states`] is false).
    fn no_hidden_reason(&self) -> String;
    /// One forward over `segs`; `taps` are block indices as [`Model::forward`]'s. Errors: a
    /// segment past the context, a token outside the vocabulary, a device failure; the states
    /// of the segments are then as before the call.
    fn forward(&self, segs: &mut [TargetSegment<'_>], taps: &[usize]) -> Result<Vec<SegmentOutput>>;
}

impl Target for Model {
    fn batch_invariant(&self) -> bool {
        Model::batch_invariant(self)
    }

    fn hidden_states(&self) -> bool {
        true
    }

    fn no_hidden_reason(&self) -> String {
        String::new()
    }

    fn forward(&self, segs: &mut [TargetSegment<'_>], taps: &[usize]) -> Result<Vec<SegmentOutput>> {
        let argmax_only: Vec<bool> = segs.iter().map(|s| s.argmax_only).collect();
        let mut cpu: Vec<Segment<'_>> = segs
            .iter_mut()
            .map(|s| Segment {
                tokens: s.tokens,
                kv: s.state.kv_mut(),
                rows: s.rows,
            })
            .collect();
        let outs = self.forward_batch(&mut cpu, taps)?;
        outs.into_iter()
            .zip(argmax_only)
            .map(|(out, argmax)| {
                // Greedy without logit bias, penalties, logprobs or taps: only the argmax of
                // each row matters, read in place.
                let rows = if argmax {
                    TargetRows::Argmax(argmax_rows(&out.logits)?)
                } else {
                    TargetRows::Logits(out.logits.to_vec2::<f32>()?)
                };
                Ok(SegmentOutput {
                    rows,
                    hidden: out.hidden,
                })
            })
            .collect()
    }
}

impl Target for DeviceState {
    fn batch_invariant(&self) -> bool {
        self.batch_invariant
    }

    fn hidden_states(&self) -> bool {
        false
    }

    fn no_hidden_reason(&self) -> String {
        format!(
            "{}: this drafter needs hidden-state taps, which the device path does not return",
            self.name
        )
    }

    /// The segments' rows go through [`run_segments`] (one forward, or several of at most the
    /// device's row limit), each at its slot and its committed length; then each state counts
    /// the positions fed.
    fn forward(&self, segs: &mut [TargetSegment<'_>], taps: &[usize]) -> Result<Vec<SegmentOutput>> {
        if !taps.is_empty() {
            bail!("{}", self.no_hidden_reason());
        }
        let dev: Vec<DeviceSegment<'_>> = segs
            .iter()
            .map(|s| {
                let Some(slot) = s.state.slot() else {
                    bail!("the sequence holds no KV slot");
                };
                Ok(DeviceSegment {
                    tokens: s.tokens,
                    slot,
                    start: s.state.len(),
                    rows: s.rows,
                    argmax_only: device_argmax() && s.argmax_only,
                })
            })
            .collect::<Result<_>>()?;
        let outs = {
            let mut t = self.target.lock().unwrap_or_else(|e| e.into_inner());
            run_segments(&mut **t, &dev)?
        };
        drop(dev);
        let mut res = Vec::with_capacity(segs.len());
        for (s, rows) in segs.iter_mut().zip(outs) {
            s.state.kv_mut().advance(s.tokens.len())?;
            res.push(SegmentOutput {
                rows: device_rows(rows)?,
                hidden: Vec::new(),
            });
        }
        Ok(res)
    }
}

/// A device forward's rows for one segment: all argmax, or all logits.
fn device_rows(rows: Vec<RowOut>) -> Result<TargetRows> {
    if rows.iter().all(|r| matches!(r, RowOut::Argmax(_))) && !rows.is_empty() {
        let a = rows
            .into_iter()
            .filter_map(|r| match r {
                RowOut::Argmax(t) => Some(t),
                RowOut::Logits(_) => None,
            })
            .collect();
        return Ok(TargetRows::Argmax(a));
    }
    let logits = rows
        .into_iter()
        .map(|r| match r {
            RowOut::Logits(l) => Ok(l),
            RowOut::Argmax(_) => Err(anyhow::anyhow!("a device step mixed argmax and logits rows")),
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(TargetRows::Logits(logits))
}

/// The argmax of each row of a `[rows, vocab]` f32 tensor on the CPU (lowest id on a tie),
/// read in place.
fn argmax_rows(t: &Tensor) -> Result<Vec<u32>> {
    let (_, vocab) = t.dims2()?;
    let (storage, layout) = t.storage_and_layout();
    let candle_core::Storage::Cpu(cpu) = &*storage else {
        bail!("the logits are not on the CPU");
    };
    let data = cpu.as_slice::<f32>()?;
    let Some((start, end)) = layout.contiguous_offsets() else {
        bail!("the logits are not contiguous");
    };
    Ok(data[start..end]
        .chunks_exact(vocab.max(1))
        .map(crate::sampling::argmax)
        .collect())
}

/// `SPECULA_DEVICE_ARGMAX=0` makes a device target return full logits rows for greedy requests
/// too (instead of only their argmax): a switch for side-by-side measurements only.
fn device_argmax() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("SPECULA_DEVICE_ARGMAX").map_or(true, |v| v != "0"))
}
