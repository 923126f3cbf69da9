//! Training text for `specula distill`: user files and the target's own greedy answers to a
//! built-in prompt set. Cached as `data/sequences.json` in the output directory.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

use super::{DistillOptions, Progress};
use specula_engine::chat::ChatMessage;
use specula_engine::sampling::SamplingParams;
use specula_engine::speculative::SpecOptions;
use specula_engine::types::GenerateRequest;
use specula_engine::Engine;

/// Token sequences to train on, with where they came from.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Sequences {
    pub sequences: Vec<Vec<u32>>,
    /// Per sequence, the index of its first generated token: the prompt's length for the
    /// target's answers, 0 for user text (every token counts as text to draft). Empty (a cache
    /// written before this field) means 0 everywhere.
    #[serde(default)]
    pub answer_starts: Vec<usize>,
    /// Human-readable description of the sources (for the training record).
    #[serde(default)]
    pub sources: Vec<String>,
}

impl Sequences {
    pub fn tokens(&self) -> usize {
        self.sequences.iter().map(Vec::len).sum()
    }

    /// The first generated token of sequence `s` (0 when it is all user text).
    pub fn answer_start(&self, s: usize) -> usize {
        self.answer_starts.get(s).copied().unwrap_or(0)
    }

    /// Append `other`'s sequences and sources.
    pub fn extend(&mut self, other: Sequences) {
        let n = self.sequences.len();
        self.answer_starts.resize(n, 0);
        self.answer_starts
            .extend((0..other.sequences.len()).map(|s| other.answer_start(s)));
        self.sequences.extend(other.sequences);
        self.sources.extend(other.sources);
    }
}

/// File extensions read from `--data` directories.
const TEXT_EXTS: &[&str] = &[
    "txt", "md", "rst", "py", "rs", "js", "ts", "go", "c", "h", "cpp", "java", "json", "toml", "yaml", "yml", "sh",
    "html", "css", "sql",
];

fn collect_files(p: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
    if p.is_dir() {
        let mut entries: Vec<PathBuf> = std::fs::read_dir(p)
            .with_context(|| format!("reading {}", p.display()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .collect();
        entries.sort();
        for e in entries {
            if e.is_dir() {
                collect_files(&e, out)?;
            } else if e.extension().is_some_and(|x| TEXT_EXTS.iter().any(|t| x == *t)) {
                out.push(e);
            }
        }
    } else if p.is_file() {
        out.push(p.to_path_buf());
    } else {
        bail!("--data {}: no such file or directory", p.display());
    }
    Ok(())
}

/// Tokenize user text: each file cut into sequences of at most `max_len` tokens.
pub fn from_files(engine: &Engine, paths: &[PathBuf], max_len: usize) -> Result<Sequences> {
    let mut files = Vec::new();
    for p in paths {
        collect_files(p, &mut files)?;
    }
    let mut out = Sequences::default();
    for f in &files {
        let Ok(text) = std::fs::read_to_string(f) else {
            continue; // not UTF-8: skipped
        };
        let ids = engine
            .tokenize(&text)
            .map_err(|e| anyhow::anyhow!("{}: {e}", f.display()))?;
        for chunk in ids.chunks(max_len.max(8)) {
            if chunk.len() >= 8 {
                out.sequences.push(chunk.to_vec());
            }
        }
    }
    if !files.is_empty() {
        out.sources.push(format!(
            "{} file(s) from {}: {} tokens",
            files.len(),
            paths
                .iter()
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(", "),
            out.tokens()
        ));
    }
    Ok(out)
}

/// Task templates of the built-in prompt set (`{}` = a topic). None is a prompt of the
/// benchmark set (`tests/fixtures/prompts.jsonl`); they cover the same kinds of request (prose,
/// questions, code, structured output) with other wording.
const TASKS: &[&str] = &[
    "Explain {} to a beginner in a short paragraph.",
    "Write three bullet points about {}.",
    "Give a step-by-step guide related to {}.",
    "Write a short story in which {} plays a role.",
    "Write a polite email to a colleague about {}.",
    "What are the pros and cons of {}? Answer briefly.",
    "Summarise the history of {} in a few sentences.",
    "Write a Python function related to {}, with a docstring and a usage example.",
    "Write a JavaScript snippet that demonstrates something about {}.",
    "Write a Rust function related to {}, with comments.",
    "Write a SQL query for a table about {} and explain it.",
    "Write a bash script that helps with {}.",
    "Describe a common mistake people make with {} and how to avoid it.",
    "Write a haiku and a short explanation about {}.",
    "Give a JSON object describing {} with a few fields.",
    "Answer a quiz question about {} and explain the answer.",
    "Compare {} with a related idea in a short table.",
    "Write a short dialogue between two friends about {}.",
    "List five facts about {}.",
    "Write unit tests in Python for a function that deals with {}.",
    "In one sentence, what is {}?",
    "Who is a famous person associated with {}? Answer briefly.",
    "Describe a quiet evening that involves {} in a few sentences.",
    "Write the first paragraph of a novel about {}.",
    "Write a short advertisement for a product related to {}.",
    "Write a limerick about {}.",
    "Give me a fun fact about {}.",
    "Why does {} matter? Answer in two sentences.",
    "Write a Python class that models {}.",
    "Write a C function related to {} and explain how it works.",
    "Fix the bugs in a short Python snippet about {} and show the corrected code.",
    "Write a Go program that prints something about {}.",
    "Return a JSON list of three objects about {}, each with a name and a description.",
    "Write a YAML configuration for a small service about {}.",
    "Describe {} as if you were a tour guide.",
    "Write a product review of something related to {}.",
    "Explain {} using an analogy.",
    "What questions would a child ask about {}? List four.",
    "Write a short news report about a discovery in {}.",
    "Write a regular expression related to {} and explain each part.",
    "Write a short paragraph describing {}.",
    "Name one surprising thing about {}. Answer in one sentence.",
    "Return a JSON object with the fields name, category and summary for {}. Output only the JSON.",
    "Write a numbered list of ten things related to {}.",
    "Write a Python dict literal that maps five words related to {} to their lengths, one entry per line.",
];

const TOPICS: &[&str] = &[
    "sorting algorithms",
    "the water cycle",
    "linked lists",
    "baking bread",
    "machine learning",
    "recursion",
    "the solar system",
    "hash maps",
    "gardening in spring",
    "climate change",
    "binary search",
    "public transport",
    "regular expressions",
    "the French revolution",
    "photosynthesis",
    "HTTP requests",
    "time management",
    "prime numbers",
    "volcanoes",
    "unit testing",
    "saving money",
    "the immune system",
    "string formatting",
    "mountain hiking",
    "databases",
    "electric cars",
    "file input and output",
    "the Roman empire",
    "chess openings",
    "matrix multiplication",
    "healthy breakfast",
    "version control with git",
    "ocean currents",
    "dates and times",
    "learning a language",
    "graph traversal",
    "renewable energy",
    "error handling",
    "birds migration",
    "web accessibility",
    "coffee brewing",
    "caching",
    "the moon landing",
    "stacks and queues",
    "team meetings",
    "JSON parsing",
    "earthquakes",
    "command line tools",
    "music theory",
    "dynamic programming",
    "a lighthouse",
    "an old bookshop",
    "winter in the city",
    "a lost umbrella",
    "a robot that learns to paint",
    "rivers",
    "the printing press",
    "penguins",
    "football",
    "a summer festival",
    "deserts",
    "the internet",
    "bees",
    "a mountain village",
    "trains",
    "a birthday party",
    "rainforests",
    "the Olympic games",
    "a museum at night",
    "space telescopes",
    "a small bakery",
    "friendship",
    "the human heart",
    "castles",
    "a night market",
    "vaccines",
    "lighthouses and ships",
    "the stock market",
    "a school trip",
    "origami",
    "wolves",
    "a jazz concert",
    "the Great Wall of China",
    "bicycles",
    "a thunderstorm",
    "the alphabet",
    "glaciers",
    "a job interview",
    "recycling",
    "a garden party",
    "the number zero",
    "submarines",
    "a rainy afternoon",
    "chocolate",
    "airports",
    "the Amazon river",
    "a video game",
    "a street musician",
    "the periodic table",
    "dinosaurs",
    "the Renaissance",
    "a camping trip",
    "board games",
    "sleep",
    "a city at dawn",
    "the ocean floor",
    "knitting",
    "the history of money",
    "black holes",
    "a village school",
    "weather forecasting",
    "tea",
    "ancient Egypt",
    "a long train journey",
    "snow",
    "robots in factories",
    "the Silk Road",
    "a fox in the forest",
    "a wedding",
    "public libraries",
    "pizza",
    "bridges",
    "the first computers",
    "a power outage",
    "cats",
    "dogs",
    "a marathon",
    "sunflowers",
    "windmills",
    "the Arctic",
    "a broken phone",
    "moving to a new city",
    "a street food stall",
    "the violin",
    "a family dinner",
    "mushrooms",
    "satellites",
    "a detective",
    "paper airplanes",
    "a science fair",
    "coral reefs",
    "an old clock",
    "pirates",
    "the phases of the Moon",
    "a mountain lake",
    "typewriters",
    "a hospital night shift",
    "kites",
    "the metric system",
    "whales",
    "a road trip",
    "ice cream",
    "skyscrapers",
    "a lost key",
    "electricity",
    "tides",
    "an art gallery",
    "folk tales",
    "a greenhouse",
    "maps and navigation",
    "the postal service",
    "a snowstorm",
    "owls",
    "a rooftop garden",
    "soup",
    "a first day at work",
    "a village fair",
    "magnets",
    "the history of writing",
    "frogs",
    "autumn leaves",
    "a ski resort",
    "spices",
    "the Industrial Revolution",
    "sandcastles",
    "a noisy neighbour",
    "the speed of light",
    "a thrift shop",
    "elephants",
    "a picnic",
    "the atmosphere",
    "a camera",
    "the piano",
    "a haunted house",
    "volunteering",
    "pancakes",
    "podcasts",
    "carpentry",
    "a lunar eclipse",
    "trees in a city park",
    "a toy shop",
    "rock climbing",
    "password security",
    "compilers",
    "operating systems",
    "spreadsheets",
    "network protocols",
    "image compression",
    "shopping carts",
    "inventory tracking",
    "temperature conversion",
    "a to-do list app",
    "student grades",
    "a bank account",
    "text statistics",
    "parsing CSV files",
    "URL routing",
    "rate limiting",
    "binary trees",
    "fizzbuzz",
    "countdown timers",
    "random numbers",
    "email validation",
    "sorting names",
    "a calculator",
    "unit conversion",
    "a queue of print jobs",
    "word frequencies",
    "a library catalogue",
    "a parking garage",
    "a weather station",
    "a recipe book",
    "a movie database",
];

/// The `i`-th prompt of the built-in set: every (task, topic) pair once, in an order where any
/// prefix mixes tasks and topics.
pub fn builtin_prompt(i: usize) -> String {
    let n = builtin_prompts();
    let j = (i % n) * 7919 % n; // 7919 is prime and shares no factor with the set size
    let task = TASKS[j % TASKS.len()];
    let topic = TOPICS[j / TASKS.len()];
    task.replace("{}", topic)
}

/// Size of the built-in prompt set.
pub fn builtin_prompts() -> usize {
    TASKS.len() * TOPICS.len()
}

/// A fingerprint of the built-in prompt set (part of the data cache key).
fn builtin_fingerprint() -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for t in TASKS.iter().chain(TOPICS) {
        for b in t.bytes() {
            h ^= b as u64;
            h = h.wrapping_mul(0x100_0000_01b3);
        }
    }
    h
}

/// Decode `reqs` with continuous batching (16 sequences at a time on the CPU, up to 64 KV slots
/// on a device) and return each request's prompt and output, in request order whatever order
/// they finish in. `what` names the work in errors.
fn decode_all(
    engine: &mut Engine,
    reqs: Vec<GenerateRequest>,
    what: &str,
    progress: &mut dyn FnMut(Progress),
) -> Result<Vec<(Vec<u32>, specula_engine::types::GenerateOutput)>> {
    let batch = engine.device_slots().map_or(16, |s| s.slots().clamp(1, 64));
    let mut queue: Vec<(usize, GenerateRequest)> = reqs.into_iter().enumerate().rev().collect();
    let mut active: Vec<(usize, specula_engine::sequence::Sequence)> = Vec::new();
    let mut done: Vec<(usize, Vec<u32>, specula_engine::types::GenerateOutput)> = Vec::new();
    while !queue.is_empty() || !active.is_empty() {
        while active.len() < batch {
            let Some((i, req)) = queue.pop() else { break };
            let seq = engine
                .start_sequence(&req, None)
                .map_err(|e| anyhow::anyhow!("{what}: request {i}: {e}"))?;
            active.push((i, seq));
        }
        let results = {
            let mut refs: Vec<&mut specula_engine::sequence::Sequence> = active.iter_mut().map(|(_, s)| s).collect();
            engine.step(&mut refs)
        };
        if let Some(Err(e)) = results.into_iter().find(|r| r.is_err()) {
            bail!("{what}: {e}");
        }
        let mut i = 0;
        while i < active.len() {
            if active[i].1.finished().is_some() {
                let (at, seq) = active.swap_remove(i);
                let prompt = seq.request().prompt_tokens.clone();
                done.push((at, prompt, engine.retire(seq, true)));
                progress(Progress::Advance {
                    done: done.len() as u64,
                    loss: None,
                    tokens_per_s: None,
                });
            } else {
                i += 1;
            }
        }
    }
    done.sort_by_key(|d| d.0);
    Ok(done.into_iter().map(|(_, p, o)| (p, o)).collect())
}

/// The target's greedy answers to `prompts` (user turns, each in the chat template), at most
/// `answer_tokens` tokens each: one sequence of prompt + answer per prompt, in order.
pub fn answers_to(
    engine: &mut Engine,
    prompts: &[String],
    answer_tokens: usize,
    progress: &mut dyn FnMut(Progress),
) -> Result<Sequences> {
    progress(Progress::Stage {
        name: "generating target answers",
        total: prompts.len() as u64,
    });
    let mut reqs = Vec::with_capacity(prompts.len());
    for (i, p) in prompts.iter().enumerate() {
        let prompt = engine
            .chat_prompt_tokens(&[ChatMessage::new("user", p)])
            .map_err(|e| anyhow::anyhow!("training prompt {i}: {e}"))?;
        let room = engine.context_length().saturating_sub(prompt.len() + 1);
        reqs.push(GenerateRequest {
            prompt_tokens: prompt,
            sampling: SamplingParams::greedy(),
            max_tokens: Some(answer_tokens.min(room).max(1)),
            stop: vec![],
            logprobs: None,
            ignore_eos: false,
            spec: SpecOptions::default(),
        });
    }
    let mut out = Sequences::default();
    for (prompt, o) in decode_all(engine, reqs, "generating training answers", progress)? {
        out.answer_starts.push(prompt.len());
        let mut tokens = prompt;
        tokens.extend_from_slice(&o.token_ids);
        out.sequences.push(tokens);
    }
    Ok(out)
}

/// The target's greedy answers to the first `n` built-in prompts (prompt + answer per sequence),
/// decoded with continuous batching.
pub fn generate_answers(
    engine: &mut Engine,
    n: usize,
    answer_tokens: usize,
    progress: &mut dyn FnMut(Progress),
) -> Result<Sequences> {
    let n = n.min(builtin_prompts());
    let prompts: Vec<String> = (0..n).map(builtin_prompt).collect();
    let mut out = answers_to(engine, &prompts, answer_tokens, progress)?;
    out.sources.push(format!(
        "greedy answers of the target to {n} built-in prompts (at most {answer_tokens} tokens each): {} tokens with prompts",
        out.tokens()
    ));
    Ok(out)
}

/// Most tokens of a user prompt the target writes for itself ([`self_prompts`]).
const SELF_PROMPT_TOKENS: usize = 96;

/// `n` user prompts written by the target itself (Magpie: Xu et al. 2024, "Magpie: Alignment
/// Data Synthesis from Scratch by Prompting Aligned LLMs with Nothing"): the chat template up to
/// the start of a user turn, sampled at temperature 1 with top-p 0.95 (seed `seed + i` for the
/// `i`-th) until the model ends the turn. Prompts that do not end within
/// [`SELF_PROMPT_TOKENS`] tokens, blank ones and repeats are dropped, so fewer than `n` can
/// come back. Errors: the chat template has no user turn the prompt can be cut from, or
/// decoding fails.
pub fn self_prompts(
    engine: &mut Engine,
    n: usize,
    seed: u64,
    progress: &mut dyn FnMut(Progress),
) -> Result<Vec<String>> {
    // The template around an empty user turn; the turn's end is the last end-of-generation
    // token before the assistant's header.
    let full = engine
        .chat_prompt_tokens(&[ChatMessage::new("user", "")])
        .map_err(|e| anyhow::anyhow!("the chat template: {e}"))?;
    let eos = engine.eos_ids().to_vec();
    let Some(cut) = full.iter().rposition(|t| eos.contains(t)) else {
        bail!("the chat template ends no user turn with an end-of-generation token: --self-prompts cannot cut a user turn from it");
    };
    let prefix = full[..cut].to_vec();
    progress(Progress::Stage {
        name: "the target writing its own prompts",
        total: n as u64,
    });
    let reqs = (0..n)
        .map(|i| GenerateRequest {
            prompt_tokens: prefix.clone(),
            sampling: SamplingParams {
                temperature: 1.0,
                top_p: 0.95,
                seed: Some(seed.wrapping_add(i as u64)),
                ..SamplingParams::default()
            },
            max_tokens: Some(SELF_PROMPT_TOKENS),
            stop: vec![],
            logprobs: None,
            ignore_eos: false,
            spec: SpecOptions::default(),
        })
        .collect();
    let mut seen = std::collections::HashSet::new();
    let mut out = Vec::new();
    for (_, o) in decode_all(engine, reqs, "writing training prompts", progress)? {
        let text = o.text.trim().to_string();
        if o.finish_reason == specula_engine::types::FinishReason::Stop && !text.is_empty() && seen.insert(text.clone())
        {
            out.push(text);
        }
    }
    Ok(out)
}

/// Training sequences made elsewhere (`--sequences`): a `data/sequences.json` of another
/// distill run (for example the target's answers decoded on a GPU), or a bare [`Sequences`]
/// object. Errors name the file: unreadable, not that JSON, a token outside the vocabulary of
/// `vocab` ids, or an answer start past its sequence.
pub fn read_sequences(path: &Path, vocab: usize) -> Result<Sequences> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let v: serde_json::Value = serde_json::from_str(&text).with_context(|| format!("{}: not JSON", path.display()))?;
    let body = v.get("sequences").filter(|s| s.is_object()).cloned().unwrap_or(v);
    let mut s: Sequences = serde_json::from_value(body).with_context(|| {
        format!(
            "{}: not training sequences (a distill run's data/sequences.json, or {{\"sequences\": [[ids]], \"answer_starts\": [..], \"sources\": [..]}})",
            path.display()
        )
    })?;
    for (i, seq) in s.sequences.iter().enumerate() {
        if let Some(&t) = seq.iter().find(|&&t| t as usize >= vocab) {
            bail!(
                "{}: sequence {i} holds token {t}, outside the target's {vocab} ids",
                path.display()
            );
        }
        if s.answer_start(i) > seq.len() {
            bail!(
                "{}: sequence {i} starts its answer past its {} tokens",
                path.display(),
                seq.len()
            );
        }
    }
    if !s.answer_starts.is_empty() && s.answer_starts.len() != s.sequences.len() {
        bail!(
            "{}: {} answer starts for {} sequences",
            path.display(),
            s.answer_starts.len(),
            s.sequences.len()
        );
    }
    s.sources = vec![format!(
        "{} sequences ({} tokens) from {}{}",
        s.sequences.len(),
        s.tokens(),
        path.display(),
        if s.sources.is_empty() {
            String::new()
        } else {
            format!(": {}", s.sources.join("; "))
        }
    )];
    Ok(s)
}

/// The training sequences for `opts`, from the cache in `opts.out` when it was made with the same
/// data options, else built and cached.
pub fn sequences(engine: &mut Engine, opts: &DistillOptions, progress: &mut dyn FnMut(Progress)) -> Result<Sequences> {
    let path = opts.out.join("data").join("sequences.json");
    let key = serde_json::json!({
        "data": opts.data,
        "sequences": opts.sequences,
        "prompts": opts.prompts,
        "self_prompts": opts.self_prompts,
        "answer_tokens": opts.answer_tokens,
        "model": engine.model_id(),
        "builtin_prompts": builtin_fingerprint(),
        // 2: sequences record where each answer starts (`answer_starts`).
        "format": 2,
    });
    if path.exists() && !opts.restart {
        let text = std::fs::read_to_string(&path)?;
        let v: serde_json::Value = serde_json::from_str(&text).with_context(|| format!("{}", path.display()))?;
        if v.get("key") == Some(&key) {
            let s: Sequences = serde_json::from_value(v["sequences"].clone())?;
            progress(Progress::Note(format!(
                "reusing {} training sequences ({} tokens) from {}",
                s.sequences.len(),
                s.tokens(),
                path.display()
            )));
            return Ok(s);
        }
    }
    let mut all = from_files(engine, &opts.data, 1024)?;
    for p in &opts.sequences {
        all.extend(read_sequences(p, engine.config().vocab_size)?);
    }
    if opts.prompts > 0 {
        let gen = generate_answers(engine, opts.prompts, opts.answer_tokens, progress)?;
        all.extend(gen);
    }
    if opts.self_prompts > 0 {
        let prompts = self_prompts(engine, opts.self_prompts, opts.seed, progress)?;
        let mut gen = answers_to(engine, &prompts, opts.answer_tokens, progress)?;
        gen.sources.push(format!(
            "greedy answers of the target to {} prompts it wrote itself (Magpie; {} asked for, at most {} tokens each): {} tokens with prompts",
            prompts.len(),
            opts.self_prompts,
            opts.answer_tokens,
            gen.tokens()
        ));
        all.extend(gen);
    }
    if all.sequences.is_empty() {
        bail!("no training data: give --data files, --sequences files, --prompts N > 0 or --self-prompts N > 0");
    }
    std::fs::create_dir_all(path.parent().unwrap_or(Path::new(".")))?;
    std::fs::write(
        &path,
        serde_json::to_string(&serde_json::json!({"key": key, "sequences": all}))?,
    )?;
    Ok(all)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sequences_from_another_run_are_read_and_checked() {
        let dir = tempfile::tempdir().expect("tempdir");
        let seqs = Sequences {
            sequences: vec![vec![1, 2, 3, 4], vec![5, 6]],
            answer_starts: vec![2, 1],
            sources: vec!["answers decoded elsewhere".into()],
        };
        // A run's cache ({"key", "sequences"}) and a bare object read the same.
        let cache = dir.path().join("cache.json");
        std::fs::write(
            &cache,
            serde_json::json!({"key": {"prompts": 2}, "sequences": seqs}).to_string(),
        )
        .expect("write");
        let bare = dir.path().join("bare.json");
        std::fs::write(&bare, serde_json::to_string(&seqs).expect("json")).expect("write");
        for p in [&cache, &bare] {
            let s = read_sequences(p, 10).expect("read");
            assert_eq!(s.sequences, seqs.sequences);
            assert_eq!((s.answer_start(0), s.answer_start(1)), (2, 1));
            assert!(s.sources[0].contains("answers decoded elsewhere") && s.sources[0].contains("2 sequences"));
        }
        let err = |v: serde_json::Value| {
            let p = dir.path().join("bad.json");
            std::fs::write(&p, v.to_string()).expect("write");
            format!("{:#}", read_sequences(&p, 10).expect_err("refused"))
        };
        let e = err(serde_json::json!({"sequences": [[1, 12]]}));
        assert!(e.contains("bad.json") && e.contains("token 12"), "{e}");
        let e = err(serde_json::json!({"sequences": [[1, 2]], "answer_starts": [3], "sources": []}));
        assert!(e.contains("past its 2 tokens"), "{e}");
        let e = err(serde_json::json!({"tokens": [1, 2]}));
        assert!(e.contains("not training sequences"), "{e}");
    }

    #[test]
    fn builtin_prompts_are_distinct_and_not_benchmark_prompts() {
        let n = builtin_prompts();
        let all: std::collections::HashSet<String> = (0..n).map(builtin_prompt).collect();
        assert_eq!(all.len(), n, "every (task, topic) pair once");
        let bench = include_str!("../../../tests/fixtures/prompts.jsonl");
        for p in &all {
            assert!(!bench.contains(p.as_str()), "{p:?} is a benchmark prompt");
        }
        // A prefix mixes tasks.
        let first: std::collections::HashSet<&str> = (0..40)
            .map(|i| {
                TASKS
                    .iter()
                    .position(|t| builtin_prompt(i).starts_with(&t[..10]))
                    .map_or("", |k| TASKS[k])
            })
            .collect();
        assert!(first.len() > 10, "{first:?}");
    }
}
