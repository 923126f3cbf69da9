//! What `off`, `default` and `on` resolve to for a bundle: the drafter, k and why, or why plain
//! decoding.

use super::*;

pub(super) struct ResolveInput<'a> {
    pub(super) target_ok: bool,
    pub(super) draft_ok: bool,
    pub(super) kernels: Option<&'a KernelReport>,
    pub(super) mtp: &'a MtpReport,
    pub(super) block: Option<&'a BlockDrafterReport>,
    pub(super) draft_model: Option<&'a DraftModelReport>,
    pub(super) tuned: Option<&'a TunedDefault>,
}

fn ar(reason: impl Into<String>) -> ModeResolution {
    ModeResolution {
        drafter: "ar".into(),
        k: None,
        adaptive: false,
        reason: reason.into(),
    }
}

/// The effective drafter for off / default / on, as the engine resolves them
/// (`Engine::resolve_spec_mode`): default = the tuning choice, else MTP head, else block drafter,
/// else draft model, else n-gram, else AR; on = the best drafter available, adaptive k.
pub(super) fn resolve_modes(x: ResolveInput) -> EffectiveModes {
    let off = ar("speculation off");
    if !x.target_ok || !x.draft_ok {
        let why = if x.target_ok {
            "the configured draft model cannot draft for this bundle (see diagnostics); serve refuses it"
        } else {
            "the bundle does not load (see diagnostics)"
        };
        return EffectiveModes {
            off,
            default: ar(why),
            on: ar(why),
        };
    }
    if let Some(k) = x.kernels.filter(|k| !k.batch_invariant) {
        let why = format!("speculation would not be exact: {}", k.reason);
        return EffectiveModes {
            off,
            default: ar(why.clone()),
            on: ar(why),
        };
    }
    // The drafter `on` picks: the order is `sequence::resolve`'s, the one place it is written.
    let mut note = None;
    let mtp_ok = x.mtp.status == MtpStatus::Present && x.mtp.location.as_deref() != Some("trunk");
    if x.mtp.status == MtpStatus::Present && !mtp_ok {
        note = Some("an MTP head is in the trunk, but serve loads MTP heads from sidecars only (--drafter)");
    }
    let block = x.block.filter(|b| b.valid);
    let draft = x.draft_model.filter(|d| d.compatible);
    let picked = crate::sequence::resolve(SpecMode::On, draft.is_some(), mtp_ok, block.is_some());
    let mut best = match (picked, block, draft) {
        (Some(SpecMode::Mtp), _, _) => Some(ModeResolution {
            drafter: "mtp".into(),
            k: Some(4),
            adaptive: true,
            reason: "the bundle's native MTP head".into(),
        }),
        (Some(SpecMode::Block), Some(b), _) => Some(ModeResolution {
            drafter: "block".into(),
            k: b.block_size.map(|s| s.saturating_sub(1)),
            adaptive: true,
            reason: format!("the bundled block drafter ({})", b.path),
        }),
        (Some(SpecMode::Draft), _, Some(d)) => Some(ModeResolution {
            drafter: "draft-model".into(),
            k: Some(4),
            adaptive: true,
            reason: format!("the configured draft model {}", d.path),
        }),
        _ => None,
    };
    if let Some(b) = best.as_mut() {
        // `crate::sequence::lookup_beside`: adaptive k with a model drafter.
        b.drafter.push_str("+ngram");
        b.reason.push_str(", with n-gram lookup beside it");
    }
    let mut chain = best.unwrap_or_else(|| ModeResolution {
        drafter: "ngram".into(),
        k: Some(4),
        adaptive: true,
        reason: "n-gram prompt lookup (no model drafter available)".into(),
    });
    if let Some(n) = note {
        chain.reason = format!("{}; {n}", chain.reason);
    }
    let default = match x.tuned {
        Some(t) => ModeResolution {
            // A tuned choice runs its drafter alone (`Engine::effective_spec` replaces `default`
            // with the tuned mode, so no lookup beside it).
            drafter: match t.mode {
                SpecMode::Off => "ar".into(),
                SpecMode::Draft => "draft-model".into(),
                m => m.as_str().to_string(),
            },
            k: (t.mode != SpecMode::Off).then_some(t.draft_max),
            adaptive: t.mode != SpecMode::Off && t.adaptive,
            reason: format!("tuning file choice: {}", t.describe()),
        },
        None => ModeResolution {
            reason: format!("{} (unmeasured: run `specula tune`)", chain.reason),
            ..chain.clone()
        },
    };
    EffectiveModes {
        off,
        default,
        on: chain,
    }
}
