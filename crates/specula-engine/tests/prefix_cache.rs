//! The prefix cache is exact: a request whose prefix comes from the cache gives the bytes a
//! cold run gives (AR and speculative), the cached prefix really is the context (a secret in
//! the system prompt is answered after a hit), and multi-turn reuse covers earlier answers.

mod common;

use common::same;

use specula_engine::speculative::{SpecMode, SpecOptions};
use specula_engine::{ChatMessage, Engine, GenerateOutput, GenerateRequest, LoadOptions, SamplingParams};

fn engine(cache: bool) -> Engine {
    let path = common::model_path("smollm2-135m-instruct");
    let opts = LoadOptions {
        prefix_cache_bytes: if cache { 256 << 20 } else { 0 },
        ..LoadOptions::default()
    };
    Engine::load(&path, "smollm2", opts).expect("load")
}

fn run(e: &mut Engine, messages: &[ChatMessage], mode: SpecMode) -> GenerateOutput {
    let req = GenerateRequest {
        prompt_tokens: e.chat_prompt_tokens(messages).expect("prompt"),
        sampling: SamplingParams::greedy(),
        max_tokens: Some(40),
        stop: vec![],
        logprobs: Some(2),
        ignore_eos: false,
        spec: SpecOptions {
            mode,
            draft_max: 4,
            adaptive: false,
            sampled_verify: Default::default(),
        },
    };
    e.generate(&req, &mut |_| true).expect("generate")
}

const SYSTEM: &str = "You are the vault assistant of the Northwind museum. The secret code of the vault is \
    4721. Only staff may ask for it, and every staff member who asks gets the code. Visitors ask about \
    opening hours (9 to 17, closed on Mondays), tickets (12 euros, children free) and the cafe.";

fn chat(user: &str) -> Vec<ChatMessage> {
    vec![ChatMessage::new("system", SYSTEM), ChatMessage::new("user", user)]
}

#[test]
fn smollm2_cached_prefixes_give_cold_bytes() {
    let mut cold = engine(false);
    let mut warm = engine(true);
    let warmup = chat("When is the museum open?");
    let probe = chat("I am a staff member. What is the secret code of the vault?");
    for mode in [SpecMode::Off, SpecMode::Ngram] {
        let cold_probe = run(&mut cold, &probe, mode);
        assert_eq!(cold_probe.stats.cached_prompt_tokens, 0);
        // The warm-up request fills the cache with the system prompt's blocks.
        let w = run(&mut warm, &warmup, mode);
        same(&w, &run(&mut cold, &warmup, mode), &format!("{mode:?} warm-up"));
        let hit = run(&mut warm, &probe, mode);
        assert!(
            hit.stats.cached_prompt_tokens >= 48,
            "{mode:?}: the shared system prompt came from the cache ({} tokens)",
            hit.stats.cached_prompt_tokens
        );
        same(&hit, &cold_probe, &format!("{mode:?} probe after a hit"));
        assert!(
            hit.text.contains("4721"),
            "{mode:?}: the secret from the cached prefix: {:?}",
            hit.text
        );
        // The same prompt again: everything but the last prompt token is cached.
        let again = run(&mut warm, &probe, mode);
        same(&again, &cold_probe, &format!("{mode:?} same prompt again"));
        let prompt_len = warm.chat_prompt_tokens(&probe).expect("prompt").len();
        assert!(
            again.stats.cached_prompt_tokens + 16 >= prompt_len,
            "{mode:?}: whole blocks of the prompt reused"
        );
        // The next turn reuses the earlier answer's rows too.
        let mut turn2 = probe.clone();
        turn2.push(ChatMessage::new("assistant", &hit.text));
        turn2.push(ChatMessage::new("user", "Thank you. And the opening hours?"));
        let t2 = run(&mut warm, &turn2, mode);
        same(&t2, &run(&mut cold, &turn2, mode), &format!("{mode:?} second turn"));
        assert!(
            t2.stats.cached_prompt_tokens > prompt_len - 16,
            "{mode:?}: the first turn's rows were reused"
        );
    }
    let s = warm.prefix_cache_stats().expect("prefix cache on");
    assert!(
        s.hits >= 6 && s.hit_tokens > 0 && s.bytes > 0 && s.bytes <= s.budget_bytes,
        "{s:?}"
    );
}
