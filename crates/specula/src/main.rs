mod distill;
mod inspect_cmd;
mod plot;
mod preflight;
mod pull;
mod tune;

use std::io::Write;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use specula_engine::catalog::{self, DEFAULT_MODEL};
use specula_engine::speculative::{SampledVerify, SpecMode, SpecOptions};
use specula_engine::{ChatMessage, Engine, GenerateRequest, LoadOptions, SamplingParams};

/// Specula: a local LLM inference server with exact speculative decoding.
#[derive(Parser, Debug)]
#[command(name = "specula", version, about, long_about = None)]
struct Cli {
    /// Worker threads for the model's matrix work (default: all cores).
    #[arg(long, global = true, env = "SPECULA_THREADS")]
    threads: Option<usize>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Serve a model over an OpenAI-compatible HTTP API.
    Serve(ServeArgs),
    /// Generate text for one prompt and print it.
    Generate(GenerateArgs),
    /// Download a catalog model into the cache (checked against its pinned sha256).
    Pull {
        /// Catalog name (see `specula list`).
        name: String,
    },
    /// List the catalog models and whether each is in the cache.
    List,
    /// Measure prefill and decode speed (tok/s) of a model on this machine.
    Bench(BenchArgs),
    /// Report what a bundle is and what Specula will do with it, from headers only (no weights
    /// read): family, size, quantization, tokenizer, drafters, memory, tier, effective modes.
    Inspect(inspect_cmd::InspectArgs),
    /// Measure AR and each drafter at k = 1..8 on built-in prompts, check every speculative
    /// output is identical to AR, and write specula_tuning.json (used by `--spec default`).
    Tune(tune::TuneArgs),
    /// Train a native drafter (an MTP head or a block drafter) for a model by distillation from the model
    /// itself, and write it as a sidecar for `--drafter`.
    Distill(distill::DistillArgs),
}

#[derive(Args, Debug)]
struct ServeArgs {
    /// A GGUF file, a Hugging Face bundle directory, or a catalog name (pulled if missing).
    #[arg(default_value = DEFAULT_MODEL)]
    model: String,
    /// The address to listen on: a host name, an IPv4 address, or an IPv6 address with or
    /// without brackets (`::1`, `[::1]`).
    #[arg(long, default_value = "127.0.0.1", value_parser = parse_host)]
    host: String,
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Requests allowed to wait while --max-batch run; more get HTTP 429.
    #[arg(long, default_value_t = 64)]
    max_queue: usize,
    /// Requests decoded together (continuous batching: one batched target forward per step;
    /// each request's output stays byte-identical to running it alone).
    #[arg(long, default_value_t = specula_server::DEFAULT_MAX_BATCH as u16, value_parser = clap::value_parser!(u16).range(1..=256))]
    max_batch: u16,
    /// MiB of KV rows the exact prefix cache may hold (reused across requests and turns;
    /// least recently used blocks are evicted); 0 turns it off.
    #[arg(long, default_value_t = 1024)]
    prefix_cache_mb: usize,
    /// MiB of KV cache running requests may reserve together (each its worst case, prompt +
    /// max_tokens, in whole 64-position blocks); a request that does not fit waits, one that
    /// cannot fit alone is refused. Given, the KV block pool is created for the whole budget at
    /// start (resident memory then stays flat); 0 = half of the memory available after loading,
    /// with blocks created on demand (and recycled).
    #[arg(long, default_value_t = 0)]
    kv_budget_mb: usize,
    /// The model id clients use (default: the catalog name or the file name).
    #[arg(long, value_parser = parse_model_id)]
    served_model_name: Option<String>,
    /// Speculative decoding for requests that do not choose (the `spec` request field).
    #[command(flatten)]
    spec: SpecArgs,
    /// Compare the memory estimate (weights + KV cache + scratch) with available memory before
    /// loading: advisory warns, strict refuses.
    #[arg(long, value_enum, default_value = "advisory")]
    memory_check: preflight::MemoryCheckArg,
    /// Tool-call dialect of the model's output: hermes, qwen3_coder, bracket, llama3_json,
    /// mistral (default: detected from the chat template and the model family).
    #[arg(long, value_parser = parse_tool_parser)]
    tool_parser: Option<specula_server::tools::Dialect>,
    /// An API key clients must send (`Authorization: Bearer KEY` or `x-api-key: KEY`) on every
    /// route but `GET /health`. Repeatable; without the flag, taken from SPECULA_API_KEY.
    #[arg(
        long = "api-key",
        value_name = "KEY",
        env = "SPECULA_API_KEY",
        hide_env_values = true,
        value_parser = api_key
    )]
    api_keys: Vec<ApiKey>,
    /// A file of API keys, one a line (blank lines and lines starting with `#` are skipped).
    /// Repeatable; adds to --api-key.
    #[arg(long, value_name = "PATH")]
    api_key_file: Vec<PathBuf>,
    /// Serve without API keys on an address other than loopback (refused otherwise, so that a
    /// server is never open to the network by accident).
    #[arg(long)]
    no_auth: bool,
    /// A directory whose models (GGUF files, bundle directories) requests may attach as draft
    /// models (`POST /v1/models/{id}/speculative` with `draft_model`). Repeatable. Without it,
    /// requests name pulled catalog models only: no request opens a file the operator did not
    /// allow.
    #[arg(long = "models-dir", value_name = "DIR")]
    models_dirs: Vec<PathBuf>,
    /// Answer `GET /metrics` without an API key (for a scraper that has none).
    #[arg(long)]
    metrics_public: bool,
    /// Connections served at once; more wait until one closes.
    #[arg(long, default_value_t = specula_server::conn::DEFAULT_MAX_CONNECTIONS as u32, value_parser = clap::value_parser!(u32).range(1..=65536))]
    max_connections: u32,
    /// Seconds a client has to send a request's headers (also how long an idle keep-alive
    /// connection stays open); the connection is closed after.
    #[arg(long, value_name = "SECONDS", default_value_t = specula_server::conn::DEFAULT_HEADER_TIMEOUT.as_secs(), value_parser = clap::value_parser!(u64).range(1..=86400))]
    header_timeout: u64,
    /// Seconds a client has to send a request's body once its headers are in; 408 after.
    #[arg(long, value_name = "SECONDS", default_value_t = specula_server::conn::DEFAULT_BODY_TIMEOUT.as_secs(), value_parser = clap::value_parser!(u64).range(1..=86400))]
    body_timeout: u64,
    #[command(flatten)]
    placement: PlacementArgs,
}

/// An API key from the command line or the environment; its `Debug` never shows it.
#[derive(Clone)]
struct ApiKey(String);

impl std::fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ApiKey(..)")
    }
}

/// `--api-key` as given; checked in [`serve_access`], whose errors (unlike clap's) never quote
/// the value.
fn api_key(s: &str) -> Result<ApiKey, std::convert::Infallible> {
    Ok(ApiKey(s.to_string()))
}

#[derive(Args, Debug, Clone)]
#[command(allow_negative_numbers = true)]
struct SamplingArgs {
    /// Sampling temperature; 0 = greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Keep only the k most likely tokens (0 = off).
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Nucleus sampling mass (1 = off).
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// Drop tokens below min_p × the top probability (0 = off).
    #[arg(long, default_value_t = 0.0)]
    min_p: f32,
    /// Repetition penalty (1 = off).
    #[arg(long, default_value_t = 1.0)]
    repetition_penalty: f32,
    /// Presence penalty in [-2, 2].
    #[arg(long, default_value_t = 0.0)]
    presence_penalty: f32,
    /// Frequency penalty in [-2, 2].
    #[arg(long, default_value_t = 0.0)]
    frequency_penalty: f32,
    /// RNG seed (same seed, same output).
    #[arg(long)]
    seed: Option<u64>,
    /// Add BIAS (in [-100, 100]) to token ID's logit before the penalties, as OpenAI's
    /// `logit_bias`: -100 bans the token. Repeatable.
    #[arg(long, value_name = "ID=BIAS", value_parser = parse_logit_bias)]
    logit_bias: Vec<(u32, f32)>,
}

/// `ID=BIAS` of `--logit-bias`.
fn parse_logit_bias(s: &str) -> Result<(u32, f32), String> {
    let (id, bias) = s
        .split_once('=')
        .ok_or_else(|| format!("expected ID=BIAS (e.g. 1234=-100), got {s:?}"))?;
    let id = id
        .trim()
        .parse::<u32>()
        .map_err(|_| format!("{id:?} is not a token id (a non-negative integer)"))?;
    let bias = bias
        .trim()
        .parse::<f32>()
        .map_err(|_| format!("{bias:?} is not a number"))?;
    Ok((id, bias))
}

impl SamplingArgs {
    /// Errors: a token given twice to `--logit-bias`.
    fn params(&self) -> Result<SamplingParams, specula_engine::RequestError> {
        SamplingParams {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repetition_penalty: self.repetition_penalty,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            seed: self.seed,
            logit_bias: Vec::new(),
        }
        .with_logit_bias(self.logit_bias.clone())
    }
}

#[derive(Args, Debug)]
struct GenerateArgs {
    /// A GGUF file, a Hugging Face bundle directory, or a catalog name (pulled if missing).
    #[arg(long, default_value = DEFAULT_MODEL)]
    model: String,
    /// The prompt text.
    #[arg(long)]
    prompt: String,
    /// Wrap the prompt as one user message in the model's chat template.
    #[arg(long)]
    chat: bool,
    /// Maximum tokens to generate (at least 1).
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u64).range(1..))]
    max_tokens: u64,
    /// Stop string (repeatable).
    #[arg(long)]
    stop: Vec<String>,
    /// Keep generating past end-of-generation tokens.
    #[arg(long)]
    ignore_eos: bool,
    /// Print one JSON object (text, token ids, prompt token ids, finish reason, usage, timings) instead of the text.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    sampling: SamplingArgs,
    #[command(flatten)]
    spec: SpecArgs,
    /// Compare the memory estimate with available memory before loading (advisory warns,
    /// strict refuses).
    #[arg(long, value_enum, default_value = "advisory")]
    memory_check: preflight::MemoryCheckArg,
    #[command(flatten)]
    placement: PlacementArgs,
}

/// Where the target runs and how long its context is (`serve`, `generate`).
#[derive(Args, Debug, Clone)]
struct PlacementArgs {
    /// Where the target runs: cpu, or cuda:N with a build made with `--features cuda`
    /// (docs/gpu.md; weights in bf16, the KV cache in one GPU slot per running request).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Cap the context window (prompt + output tokens of a request) below the model's own; on
    /// a GPU each KV slot then takes less memory, so more requests fit. At least 16 (a chat
    /// template alone takes about 10 tokens).
    #[arg(long, value_parser = clap::value_parser!(u64).range(16..))]
    ctx_size: Option<u64>,
}

impl PlacementArgs {
    /// Before loading: check that `--device` is usable, then run the memory preflight of `model`
    /// (and `draft`) with the KV cache estimated for `--ctx-size` tokens.
    fn preflight(
        &self,
        model: &str,
        draft: Option<&str>,
        check: preflight::MemoryCheckArg,
    ) -> Result<Option<specula_engine::inspect::BundleReport>> {
        check_device(&self.device)?;
        preflight::for_args(model, draft, check, self.ctx_size.map(|n| n as usize))
    }

    /// After loading: cap the context (with a warning when `--ctx-size` is above the model's
    /// own, which then stays the limit), then put the target on `--device` with KV slots for up
    /// to `slots` running requests. Returns whether a device was attached.
    fn apply(&self, engine: &mut Engine, model_path: Option<&std::path::Path>, slots: usize) -> Result<bool> {
        if let Some(n) = self.ctx_size {
            let model = engine.config().context_length;
            if n as usize > model {
                tracing::warn!(
                    ctx_size = n,
                    model_context = model,
                    "--ctx-size is above the model's context window, which stays the limit"
                );
            }
            engine.limit_context(n as usize)?;
        }
        attach_device(engine, &self.device, model_path, slots)
    }
}

#[derive(Args, Debug, Clone)]
struct SpecArgs {
    /// Speculative decoding. off: plain decoding. default (the default): what `specula tune`
    /// measured best for this model, else as on. on: the best drafter attached (MTP head, block
    /// drafter, draft model), else n-gram prompt lookup, with k adapted per step. ngram / draft /
    /// mtp / block: that drafter. Output is byte-identical to plain decoding (greedy, and sampled
    /// with a seed: --sampled-verify) or identically distributed (sampled without a seed); where
    /// that cannot be guaranteed, plain decoding is used and the stats say why.
    #[arg(long, value_enum, default_value = "default")]
    spec: SpecArg,
    /// A draft model (GGUF file, bundle directory or catalog name) with the target's tokenizer.
    #[arg(long)]
    draft_model: Option<String>,
    /// The draft model's vocabulary (FR-Spec): a `draft_vocab.json` written by `specula distill
    /// --kind vocab` (token ids ranked by frequency in the target's text). The draft model then
    /// computes logits for --draft-vocab-size tokens only, which makes each draft token cheaper
    /// and drafts outside that set impossible; the target verifies over the full vocabulary, so
    /// output is unchanged. Default: the full vocabulary.
    #[arg(long)]
    draft_vocab: Option<String>,
    /// Tokens in the draft model's vocabulary (with --draft-vocab).
    #[arg(long, default_value_t = specula_engine::speculative::draft_model::DRAFT_VOCAB_SIZE)]
    draft_vocab_size: usize,
    /// A native drafter for this model: an MTP head (a directory with config.json and
    /// safetensors, or one safetensors file) or a block drafter (a folder whose config.json has
    /// block_size), e.g. written by `specula distill`. Without it, native drafters beside the
    /// model (`<model>.mtp/`, `<model>.drafter/` next to a GGUF file; `mtp/`, `drafter/` in a
    /// bundle directory) are used when present.
    #[arg(long)]
    drafter: Option<PathBuf>,
    /// Maximum draft length k per target step.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u64).range(1..=32))]
    draft_max: u64,
    /// Use a fixed k = --draft-max instead of adapting k to recent acceptance.
    #[arg(long)]
    fixed_k: bool,
    /// How sampled requests (temperature > 0) verify drafts. coupled: each token is the
    /// target's own keyed draw, so a seeded request's output is byte-identical to plain
    /// decoding with that seed, whatever was drafted. rejection: speculative sampling
    /// (Leviathan et al. 2023): the same distribution, more drafts accepted a token, but a
    /// seed's output depends on the drafts.
    #[arg(long, value_enum, default_value = "coupled")]
    sampled_verify: SampledVerifyArg,
}

#[derive(clap::ValueEnum, Debug, Clone, Copy)]
enum SampledVerifyArg {
    Coupled,
    Rejection,
}

/// A decoding mode of `bench --engine`.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
enum EngineBenchMode {
    Off,
    Ngram,
    Mtp,
    Block,
    Draft,
}

#[derive(clap::ValueEnum, Debug, Clone, Copy)]
enum SpecArg {
    Off,
    Default,
    On,
    Ngram,
    Draft,
    Mtp,
    Block,
}

impl SpecArgs {
    fn options(&self) -> SpecOptions {
        SpecOptions {
            mode: match self.spec {
                SpecArg::Off => SpecMode::Off,
                SpecArg::Default => SpecMode::Default,
                SpecArg::On => SpecMode::On,
                SpecArg::Ngram => SpecMode::Ngram,
                SpecArg::Draft => SpecMode::Draft,
                SpecArg::Mtp => SpecMode::Mtp,
                SpecArg::Block => SpecMode::Block,
            },
            draft_max: self.draft_max as usize,
            adaptive: !self.fixed_k,
            sampled_verify: match self.sampled_verify {
                SampledVerifyArg::Rejection => SampledVerify::Rejection,
                SampledVerifyArg::Coupled => SampledVerify::Coupled,
            },
        }
    }

    /// Apply --draft-vocab to the attached draft model.
    fn reduce_draft_vocab(&self, engine: &mut Engine) -> Result<()> {
        let Some(file) = self.draft_vocab.as_deref() else {
            return Ok(());
        };
        let text = std::fs::read_to_string(file).with_context(|| format!("reading --draft-vocab {file}"))?;
        let ranked = specula_engine::speculative::draft_model::parse_draft_vocab(&text, file)?;
        let n = engine.reduce_draft_vocab(&ranked, self.draft_vocab_size)?;
        tracing::info!(tokens = n, file, "draft model vocabulary reduced");
        Ok(())
    }

    /// Attach the draft model and the MTP head, if given (or found beside `model_path`);
    /// `--spec draft` / `--spec mtp` without one is an error. Returns why native drafters found
    /// beside the model were left out (one does not load, or the device does not run native
    /// drafters), for [`specula_engine::inspect::BundleReport::not_attached`].
    fn attach(&self, engine: &mut Engine, model_path: Option<&std::path::Path>) -> Result<LeftOut> {
        match &self.draft_model {
            Some(m) => {
                let path: PathBuf = pull::resolve_model(m, true)?;
                let t = std::time::Instant::now();
                engine
                    .attach_draft_model(&path, &draft_model_id(m))
                    .with_context(|| format!("loading draft model {}", path.display()))?;
                tracing::info!(draft_model = %m, "draft model loaded in {:.2}s", t.elapsed().as_secs_f64());
                self.reduce_draft_vocab(engine)?;
            }
            None if matches!(self.spec, SpecArg::Draft) => bail!("--spec draft needs --draft-model"),
            None if self.draft_vocab.is_some() => bail!("--draft-vocab needs --draft-model"),
            None => {}
        }
        // A named --drafter that does not load is an error; one found beside the model is
        // skipped with a warning (the model serves without it, as it did before it was there).
        let found_beside = self.drafter.is_none();
        let mut left_out = LeftOut::default();
        let drafters: Vec<PathBuf> = match &self.drafter {
            Some(p) => vec![p.clone()],
            None => {
                let found = model_path.map(native_sidecars).unwrap_or_default();
                match engine.device_name() {
                    // Native drafters read hidden-state taps, which the device path does not
                    // return yet: the ones found beside the model are left out (a named
                    // --drafter is refused by the engine, with the reason).
                    Some(d) if !found.is_empty() => {
                        tracing::warn!(
                            device = d,
                            "native drafters beside the model are not used on this device"
                        );
                        let why = format!("native drafters are not used on {d}");
                        left_out = LeftOut {
                            mtp: Some(why.clone()),
                            block: Some(why),
                        };
                        Vec::new()
                    }
                    _ => found,
                }
            }
        };
        for p in &drafters {
            let block = is_block_drafter(p);
            let (kind, loaded) = if block {
                ("block drafter", engine.attach_block_drafter(p))
            } else {
                ("MTP head", engine.attach_mtp_head(p))
            };
            match loaded {
                Ok(_) => tracing::info!(drafter = %p.display(), "{kind} attached"),
                Err(e) if found_beside => {
                    tracing::warn!(
                        "the {kind} found beside the model, {}, does not load, so it is not used \
                         (repair or remove it; after removing it, `specula pull` of a catalog model \
                         writes the drafter this build ships): {e:#}",
                        p.display()
                    );
                    let slot = if block { &mut left_out.block } else { &mut left_out.mtp };
                    slot.get_or_insert(format!("it does not load: {e:#}"));
                }
                Err(e) => return Err(e).with_context(|| format!("loading the {kind} {}", p.display())),
            }
        }
        if matches!(self.spec, SpecArg::Mtp) && engine.mtp_head().is_none() {
            bail!(
                "--spec mtp needs an MTP head: --drafter PATH (train one with `specula distill`; \
                 `specula pull NAME` writes the one this build ships beside the model, for {})",
                pull::bundled_drafter_models().join(", ")
            );
        }
        if matches!(self.spec, SpecArg::Block) && engine.block_drafter().is_none() {
            bail!("--spec block needs a block drafter: --drafter DIR (train one with `specula distill --kind block`)");
        }
        Ok(left_out)
    }
}

/// Why the native drafters found beside a model were left out, per kind (`None`: not left out).
#[derive(Debug, Default)]
struct LeftOut {
    mtp: Option<String>,
    block: Option<String>,
}

/// Native drafters beside a model
/// ([`sidecar_paths`](specula_engine::inspect::sidecar_paths)): the first MTP head place that
/// exists, and the block drafter's folder when it is one.
fn native_sidecars(model: &std::path::Path) -> Vec<PathBuf> {
    let Some((mtp, block)) = specula_engine::inspect::sidecar_paths(model) else {
        return Vec::new();
    };
    let mut found: Vec<PathBuf> = mtp.into_iter().filter(|p| p.exists()).take(1).collect();
    if block.is_dir() {
        found.push(block);
    }
    found
}

/// Is `p` a block-drafter folder ([`specula_engine::speculative::block::is_block_drafter_config`])?
fn is_block_drafter(p: &std::path::Path) -> bool {
    std::fs::read_to_string(p.join("config.json"))
        .ok()
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
        .is_some_and(|j| specula_engine::speculative::block::is_block_drafter_config(&j))
}

#[derive(Args, Debug)]
struct BenchArgs {
    /// A GGUF file, a Hugging Face bundle directory, or a catalog name (pulled if missing).
    #[arg(long, default_value = DEFAULT_MODEL)]
    model: String,
    /// Prompt length for the prefill measurement.
    #[arg(long, default_value_t = 512)]
    prompt_tokens: usize,
    /// Tokens generated for the decode measurement.
    #[arg(long, default_value_t = 128)]
    gen_tokens: usize,
    /// Repetitions (the median is reported).
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Also measure the cost of an r-row target forward (a verify of k = r - 1 drafts) relative to a
    /// one-row decode step, for r = 1..=N, at a context of --prompt-tokens positions.
    #[arg(long, value_name = "N")]
    verify_rows: Option<usize>,
    /// Print the result as JSON.
    #[arg(long)]
    json: bool,
    /// `cpu`, or `cuda:N` (a build with `--features cuda`): on the GPU, bench runs the exactness
    /// checks and the timings of docs/gpu.md and writes a JSON receipt.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Benchmark the serving engine on --model and --device: aggregate decode tok/s of
    /// --streams concurrent greedy requests stepped together (continuous batching, no HTTP), with
    /// each of --modes (plain decoding, n-gram speculation, a native drafter or a draft model). On the GPU this runs the real model instead of
    /// synthetic weights.
    #[arg(long)]
    engine: bool,
    /// With `--device cuda:N`: benchmark synthetic weights of this architecture shape,
    /// generated on the device (qwen3-0.6b, qwen3-1.7b, qwen3-8b, llama-3.1-8b).
    #[arg(long, default_value = "qwen3-8b")]
    shape: String,
    /// With `--device cuda:N` or `--engine`: concurrency levels of the aggregate decode
    /// measurement.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8,16,32,64")]
    streams: Vec<usize>,
    /// With `--engine`: the decoding modes run at each level, alternating run by run (`off`:
    /// plain decoding; `ngram`: n-gram speculation; `mtp` / `block`: the native drafter of
    /// --drafter; `draft`: the draft model of --draft-model; all adaptive k).
    #[arg(long, value_delimiter = ',', default_value = "off,ngram")]
    modes: Vec<EngineBenchMode>,
    /// With `--engine` and mode `mtp` or `block`: the native drafter's folder.
    #[arg(long)]
    drafter: Option<PathBuf>,
    /// With `--engine` and mode `draft`: the draft model (same tokenizer as --model).
    #[arg(long)]
    draft_model: Option<String>,
    /// With `--device cuda:N`: prompt lengths of the prefill measurement.
    #[arg(long, value_delimiter = ',', default_value = "512,8192")]
    prefill_lens: Vec<usize>,
    /// With `--device cuda:N`: write the JSON receipt here (it is printed too).
    #[arg(long)]
    receipt: Option<PathBuf>,
    /// With `--device cuda:N`: storage of the synthetic projection weights, bf16 or q8_0.
    #[arg(long, default_value = "bf16")]
    dtype: String,
    /// With `--device cuda:N` and bf16: also time the reference FMA GEMV kernels in the same
    /// call (a side-by-side ratio for the tensor-core GEMM).
    #[arg(long)]
    compare_gemv: bool,
    /// Also draw the result as SVG charts in this directory (tok/s, verify cost by rows,
    /// aggregate tok/s by streams per mode, acceptance rate, prefill by prompt length: those
    /// the result holds).
    #[arg(long, value_name = "DIR")]
    plot: Option<PathBuf>,
    /// With --plot: chart this saved JSON result (of `bench --json`, `bench --engine` or a GPU
    /// receipt) instead of running a benchmark.
    #[arg(long, value_name = "FILE", requires = "plot")]
    from: Option<PathBuf>,
}

/// `--plot DIR`: the charts of `result`, each file named on stderr.
fn plot_result(a: &BenchArgs, result: &serde_json::Value) -> Result<()> {
    if let Some(dir) = &a.plot {
        for f in plot::write_charts(result, dir)? {
            eprintln!("wrote {}", f.display());
        }
    }
    Ok(())
}

/// `--served-model-name`: clients name the model by it in every request and in URLs
/// (`/v1/models/{id}`), so it is not empty, has no leading or trailing whitespace or control
/// characters, and does not end in `/speculative` (`/v1/models/{id}/speculative`).
fn parse_model_id(s: &str) -> std::result::Result<String, String> {
    if s.is_empty() {
        return Err("the model id must not be empty".into());
    }
    if s.trim() != s || s.chars().any(char::is_control) {
        return Err("the model id must not have leading or trailing whitespace or control characters".into());
    }
    if s.ends_with("/speculative") {
        return Err("the model id must not end in /speculative (the runtime speculation endpoint's path)".into());
    }
    Ok(s.to_string())
}

fn main() {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    if let Err(e) = run(cli) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn run(cli: Cli) -> Result<()> {
    if let Some(n) = cli.threads {
        if n == 0 {
            bail!("--threads must be at least 1");
        }
        // The kernel pool spins its workers: more than the hardware runs at once only makes
        // them wait for each other, and a huge count exhausts memory for their stacks.
        let hw = std::thread::available_parallelism().map_or(256, |n| n.get());
        let limit = (4 * hw).max(8);
        if n > limit {
            bail!(
                "--threads {n} is too many: this machine gives the process {hw} hardware threads \
                 (at most {limit} are accepted; more than {hw} is slower)"
            );
        }
        if n > hw {
            tracing::warn!(
                "--threads {n} is more than the {hw} hardware threads: the kernel workers will wait for each other"
            );
        }
        // candle's CPU kernels size their pools from RAYON_NUM_THREADS; set it before any runs.
        std::env::set_var("RAYON_NUM_THREADS", n.to_string());
    }
    match cli.command {
        Command::Serve(a) => serve(a),
        Command::Generate(a) => generate(a),
        Command::Pull { name } => {
            let entry = catalog::lookup(&name).with_context(|| {
                format!(
                    "'{name}' is not a catalog model (known: {})",
                    catalog::names().join(", ")
                )
            })?;
            let path = pull::pull(&entry, true)?;
            println!("{}", path.display());
            Ok(())
        }
        Command::List => {
            for (entry, path) in pull::list_models() {
                let state = match path {
                    Some(p) => format!("pulled: {}", p.display()),
                    None => "not pulled".to_string(),
                };
                let default = if entry.is_default() { " (default)" } else { "" };
                let drafter = if pull::bundled_drafter_models().contains(&entry.name) {
                    "; ships with an MTP head (written beside the model by pull)"
                } else {
                    ""
                };
                println!(
                    "{}{default}\n  {}\n  {} MB, {}, {}{drafter}; {}",
                    entry.name,
                    entry.description,
                    entry.size_bytes / 1_000_000,
                    entry.arch,
                    entry.license,
                    state
                );
            }
            println!("cache: {}", pull::cache_dir().display());
            Ok(())
        }
        Command::Bench(a) => bench(a),
        Command::Inspect(a) => inspect_cmd::run(a),
        Command::Tune(a) => tune::run(a),
        Command::Distill(a) => distill::run(a),
    }
}

/// Resolve and load a model; the id is the catalog name or the file/dir name.
fn load(spec: &str, id: Option<String>) -> Result<Engine> {
    load_with(spec, id, LoadOptions::default())
}

/// [`load`] with load options (e.g. a prefix cache for `serve`).
fn load_with(spec: &str, id: Option<String>, opts: LoadOptions) -> Result<Engine> {
    let path: PathBuf = pull::resolve_model(spec, true)?;
    let id = id.unwrap_or_else(|| {
        if catalog::lookup(spec).is_some() {
            spec.to_string()
        } else {
            path.file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_else(|| spec.to_string())
        }
    });
    let t = std::time::Instant::now();
    let engine = Engine::load(&path, &id, opts).with_context(|| format!("loading {}", path.display()))?;
    tracing::info!(
        model = %id,
        path = %path.display(),
        weights = %engine.bundle().quantization,
        context = engine.context_length(),
        "loaded in {:.2}s",
        t.elapsed().as_secs_f64()
    );
    Ok(engine)
}

fn parse_tool_parser(s: &str) -> Result<specula_server::tools::Dialect, String> {
    specula_server::tools::Dialect::parse(s).ok_or_else(|| {
        format!(
            "unknown tool parser '{s}' (expected one of: {})",
            specula_server::tools::Dialect::names()
        )
    })
}

/// `--host`: an IPv6 address may come in brackets, as URLs write it (`[::1]`); the socket
/// address takes it without them.
fn parse_host(s: &str) -> Result<String, String> {
    match s.strip_prefix('[').and_then(|r| r.strip_suffix(']')) {
        Some(inner) if inner.contains(':') => Ok(inner.to_string()),
        Some(_) => Err(format!("'{s}': only an IPv6 address goes in brackets")),
        None if s.starts_with('[') || s.ends_with(']') => Err(format!("'{s}': a bracket is not closed")),
        None if s.is_empty() => Err("the host is empty".to_string()),
        None => Ok(s.to_string()),
    }
}

/// The API keys of `serve`, decided before anything loads: a server bound beyond loopback
/// needs a key, unless `--no-auth` says it is meant to be open. Errors name the flag or the
/// file and line, never a key.
fn serve_access(a: &ServeArgs) -> Result<specula_server::Access> {
    use specula_server::auth::{check_key, is_loopback_host, parse_key_file};
    let mut keys = Vec::new();
    for k in &a.api_keys {
        check_key(&k.0).map_err(|e| anyhow::anyhow!("--api-key (or SPECULA_API_KEY): {e}"))?;
        keys.push(k.0.clone());
    }
    for path in &a.api_key_file {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading --api-key-file {}", path.display()))?;
        let found = parse_key_file(&text).map_err(|e| anyhow::anyhow!("--api-key-file {}: {e}", path.display()))?;
        if found.is_empty() {
            bail!("--api-key-file {} holds no key", path.display());
        }
        keys.extend(found);
    }
    if a.no_auth && !keys.is_empty() {
        bail!(
            "--no-auth serves without API keys, but keys were given (--api-key, --api-key-file or \
             SPECULA_API_KEY): pass one or the other"
        );
    }
    let loopback = is_loopback_host(&a.host);
    if !loopback && keys.is_empty() && !a.no_auth {
        bail!(
            "--host {} is reachable from other machines and no API key is set, so anyone who can \
             reach it could use the server. Pass --api-key KEY (or --api-key-file PATH, or set \
             SPECULA_API_KEY), or pass --no-auth to serve it open on purpose",
            a.host
        );
    }
    if a.no_auth && !loopback {
        tracing::warn!(
            host = %a.host,
            "--no-auth: serving without API keys on an address other than loopback; anyone who can reach it can use the server"
        );
    }
    if keys.iter().any(|k| k.len() < 16) {
        tracing::warn!("an API key is shorter than 16 characters and could be guessed; prefer long random keys");
    }
    Ok(specula_server::Access::with_keys(keys).metrics_public(a.metrics_public))
}

fn serve(a: ServeArgs) -> Result<()> {
    // Who may use the server is settled first: a misconfiguration fails at once.
    let access = serve_access(&a)?;
    for d in &a.models_dirs {
        if !d.is_dir() {
            anyhow::bail!("--models-dir {}: not a directory", d.display());
        }
    }
    let models_dirs = a.models_dirs.clone();
    // Fail before the model loads (seconds to minutes) when the address is taken or not ours:
    // a probe bind, released at once; the server binds it again once the model is ready.
    if a.port != 0 {
        std::net::TcpListener::bind((a.host.as_str(), a.port))
            .with_context(|| format!("binding {}", specula_server::authority(&a.host, a.port)))?;
    }
    let report = a
        .placement
        .preflight(&a.model, a.spec.draft_model.as_deref(), a.memory_check)?;
    let t = std::time::Instant::now();
    let opts = LoadOptions {
        prefix_cache_bytes: a.prefix_cache_mb.saturating_mul(1 << 20),
        ..LoadOptions::default()
    };
    let mut engine = load_with(&a.model, a.served_model_name.clone(), opts)?;
    let model_path = pull::resolve_model(&a.model, false).ok();
    let on_device = a
        .placement
        .apply(&mut engine, model_path.as_deref(), a.max_batch as usize)?;
    let target_load_s = t.elapsed().as_secs_f64();
    let t = std::time::Instant::now();
    let left_out = a.spec.attach(&mut engine, model_path.as_deref())?;
    let draft_load_s = a.spec.draft_model.is_some().then(|| t.elapsed().as_secs_f64());
    // `/v1/models` shows the report: a sidecar it found that is not attached must not show as
    // a capability (nor resolve the modes).
    let mut report = report;
    if let Some(r) = report.as_mut() {
        let mtp = left_out.mtp.filter(|_| engine.mtp_head().is_none());
        let block = left_out.block.filter(|_| engine.block_drafter().is_none());
        r.not_attached(mtp.as_deref(), block.as_deref());
    }
    preflight::apply_tuning(&mut engine, report.as_ref(), &a.spec.options());
    // On a device, running requests are bounded by its KV slots (the KV cache lives there).
    let max_batch = match engine.device_slots() {
        Some(s) => s.slots().min(a.max_batch as usize),
        None => a.max_batch as usize,
    };
    let available = specula_engine::inspect::memory::available_memory();
    let kv_budget = if on_device {
        usize::MAX
    } else if a.kv_budget_mb > 0 {
        a.kv_budget_mb.saturating_mul(1 << 20)
    } else {
        // Half of what is left after loading (the prefix cache has its own budget).
        available.map(|b| (b / 2) as usize).unwrap_or(usize::MAX)
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(specula_server::serve(
        engine,
        specula_server::ServeOptions {
            host: a.host,
            port: a.port,
            max_queue: a.max_queue,
            max_batch,
            kv_budget_bytes: (!on_device).then_some(kv_budget),
            // Preallocating more than the machine has would end the server before it serves.
            kv_preallocate: !on_device && a.kv_budget_mb > 0 && {
                let fits = available.is_none_or(|b| kv_budget as u64 <= b);
                if !fits {
                    tracing::warn!(
                        kv_budget_mib = a.kv_budget_mb,
                        available_mib = available.map(|b| b >> 20),
                        "--kv-budget-mb is more than the memory available: KV blocks are created on demand instead of at start"
                    );
                }
                fits
            },
            spec: a.spec.options(),
            bundle: report.map(|r| r.capabilities_json()),
            tool_parser: a.tool_parser,
            target_load_s: Some(target_load_s),
            draft_load_s,
            access,
            models_dirs,
            limits: specula_server::ConnLimits {
                header_timeout: std::time::Duration::from_secs(a.header_timeout),
                body_timeout: std::time::Duration::from_secs(a.body_timeout),
                max_connections: a.max_connections as usize,
            },
        },
    ))
}

fn generate(a: GenerateArgs) -> Result<()> {
    let report = a
        .placement
        .preflight(&a.model, a.spec.draft_model.as_deref(), a.memory_check)?;
    let mut engine = load(&a.model, None)?;
    let model_path = pull::resolve_model(&a.model, false).ok();
    a.placement.apply(&mut engine, model_path.as_deref(), 1)?;
    a.spec.attach(&mut engine, model_path.as_deref())?;
    preflight::apply_tuning(&mut engine, report.as_ref(), &a.spec.options());
    let prompt_tokens = if a.chat {
        engine.chat_prompt_tokens(&[ChatMessage::new("user", &a.prompt)])?
    } else {
        engine.tokenize_prompt(&a.prompt)?
    };
    let prompt_token_ids = prompt_tokens.clone();
    let req = GenerateRequest {
        prompt_tokens,
        sampling: a.sampling.params()?,
        max_tokens: Some(a.max_tokens as usize),
        stop: a.stop.clone(),
        logprobs: None,
        ignore_eos: a.ignore_eos,
        spec: a.spec.options(),
    };
    let json = a.json;
    let mut stdout = std::io::stdout();
    let out = engine.generate(&req, &mut |d| {
        if !json {
            let _ = stdout.write_all(d.text.as_bytes());
            let _ = stdout.flush();
        }
        true
    })?;
    let s = &out.stats;
    if json {
        let v = serde_json::json!({
            "text": out.text,
            "token_ids": out.token_ids,
            "prompt_token_ids": prompt_token_ids,
            "finish_reason": out.finish_reason.as_str(),
            "device": engine.device_name().unwrap_or("cpu"),
            "usage": {"prompt_tokens": s.prompt_tokens, "completion_tokens": s.completion_tokens},
            "timings": {"prefill_s": s.prefill_s, "decode_s": s.decode_s, "decode_steps": s.decode_steps},
            "speculative": s.spec.to_json(),
        });
        println!("{v}");
    } else {
        println!();
        eprintln!(
            "[{} prompt tokens, {} generated, finish: {}; prefill {:.1} tok/s, decode {:.1} tok/s; path {}, tau {:.2}, acceptance {:.2}]",
            s.prompt_tokens,
            s.completion_tokens,
            out.finish_reason.as_str(),
            s.prompt_tokens as f64 / s.prefill_s.max(1e-9),
            s.completion_tokens.saturating_sub(1) as f64 / s.decode_s.max(1e-9),
            s.spec.decode_path,
            s.spec.tau(),
            s.spec.acceptance_rate()
        );
    }
    Ok(())
}

/// The median of `v` (non-empty): the middle value, or the mean of the two middle values for an
/// even count.
fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n.is_multiple_of(2) {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    } else {
        v[n / 2]
    }
}

/// One `bench --engine` run of a concurrency level.
#[derive(Debug, Clone)]
struct EngineRun {
    /// Tokens emitted once no stream is prefilling, over that time.
    tok_s: f64,
    /// The same over the steps in which every stream decodes.
    full_tok_s: f64,
    steps: usize,
    prefill_s: f64,
    drafted: usize,
    accepted: usize,
    trimmed: usize,
}

/// Start `n` requests (`request(i)` for stream i) together and step them with
/// [`Engine::step`] until all finish.
fn engine_run(engine: &mut Engine, n: usize, request: &dyn Fn(usize) -> GenerateRequest) -> Result<EngineRun> {
    let mut seqs = (0..n)
        .map(|i| engine.start_sequence(&request(i), None))
        .collect::<Result<Vec<_>, _>>()?;
    let t0 = std::time::Instant::now();
    let (mut decode_t0, mut tokens, mut steps) = (None, 0usize, 0usize);
    // Steps in which all n streams decode (before the first one finishes).
    let (mut full_tokens, mut full_s) = (0usize, 0f64);
    while seqs.iter().any(|s| s.finished().is_none()) {
        let prefilling = seqs.iter().any(|s| s.is_prefilling());
        if !prefilling && decode_t0.is_none() {
            decode_t0 = Some(std::time::Instant::now());
        }
        let full = decode_t0.is_some() && seqs.iter().all(|s| s.finished().is_none());
        let ts = std::time::Instant::now();
        let mut refs: Vec<_> = seqs.iter_mut().collect();
        let mut emitted = 0;
        for r in engine.step(&mut refs) {
            if let Some(o) = r? {
                if decode_t0.is_some() {
                    emitted += o.delta.token_ids.len();
                }
            }
        }
        tokens += emitted;
        if full {
            full_tokens += emitted;
            full_s += ts.elapsed().as_secs_f64();
        }
        steps += decode_t0.is_some() as usize;
    }
    let end = std::time::Instant::now();
    let (mut drafted, mut accepted, mut trimmed) = (0, 0, 0);
    for s in seqs {
        let sp = engine.retire(s, true).stats.spec;
        drafted += sp.drafted;
        accepted += sp.accepted;
        trimmed += sp.trimmed;
    }
    let start = decode_t0.unwrap_or(end);
    Ok(EngineRun {
        tok_s: tokens as f64 / (end - start).as_secs_f64().max(1e-9),
        full_tok_s: full_tokens as f64 / full_s.max(1e-9),
        steps,
        prefill_s: (start - t0).as_secs_f64(),
        drafted,
        accepted,
        trimmed,
    })
}

/// `specula bench --engine`: for each mode (plain, n-gram) and each --streams level N, N greedy
/// requests of --gen-tokens tokens (prompts: a fixed text, each stream starting at another
/// offset) are started together and stepped with [`Engine::step`] until all finish. Reported per
/// level: aggregate decode tok/s (tokens emitted once no stream is prefilling, over that time,
/// so with speculation it includes the drain, when streams that finished early leave a smaller
/// batch), the same over the steps in which all N streams decode (throughput at concurrency N),
/// target steps, the prefill time of the burst, and the drafted, accepted and trimmed (by the batch draft budget) tokens. The
/// modes alternate run by run (--runs rounds of every mode), and each mode after the first
/// reports the median of its paired ratios to the first mode's run of the same round. Median of
/// --runs.
fn bench_engine(a: &BenchArgs) -> Result<()> {
    check_device(&a.device)?;
    if a.runs == 0
        || a.modes.is_empty()
        || a.streams.is_empty()
        || a.streams.contains(&0)
        || a.streams.iter().any(|&s| s > 256)
    {
        bail!("--runs must be >= 1, --modes non-empty and every --streams level between 1 and 256");
    }
    if a.gen_tokens < 2 {
        bail!("--gen-tokens must be >= 2 with --engine (decode is timed after each stream's first token)");
    }
    if a.prompt_tokens == 0 || a.prompt_tokens > 4096 {
        bail!("--prompt-tokens must be between 1 and 4096 with --engine");
    }
    let slots = a.streams.iter().copied().max().unwrap_or(1);
    let mut engine = load(&a.model, None)?;
    let model_path = pull::resolve_model(&a.model, false).ok();
    attach_device(&mut engine, &a.device, model_path.as_deref(), slots)?;
    for m in &a.modes {
        match (m, &a.drafter, &a.draft_model) {
            (EngineBenchMode::Mtp, None, _) | (EngineBenchMode::Block, None, _) => {
                bail!("--modes mtp / block need --drafter DIR")
            }
            (EngineBenchMode::Draft, _, None) => bail!("--modes draft needs --draft-model M"),
            _ => {}
        }
    }
    if let Some(m) = &a.draft_model {
        let path: PathBuf = pull::resolve_model(m, true)?;
        engine
            .attach_draft_model(&path, &draft_model_id(m))
            .with_context(|| format!("loading draft model {}", path.display()))?;
    }
    if let Some(p) = &a.drafter {
        if is_block_drafter(p) {
            engine
                .attach_block_drafter(p)
                .with_context(|| format!("loading the block drafter {}", p.display()))?;
        } else {
            engine
                .attach_mtp_head(p)
                .with_context(|| format!("loading the MTP head {}", p.display()))?;
        }
    }
    if let Some(s) = engine.device_slots() {
        if s.slots() < slots {
            bail!("{} KV slots fit on the device, --streams asks for {slots}", s.slots());
        }
    }
    let base = engine.tokenize(
        "The harbour town woke slowly under a grey sky. Fishing boats rocked at their moorings while gulls \
         argued over the nets, and the baker on the corner opened his shutters to the smell of rain. \
         Down by the quay, an old man mended a sail while two children raced paper boats along the gutter.",
    )?;
    let prompt_len = a.prompt_tokens;
    let request = |i: usize, mode: specula_engine::speculative::SpecMode| GenerateRequest {
        prompt_tokens: base.iter().copied().cycle().skip(i * 7).take(prompt_len).collect(),
        sampling: SamplingParams::greedy(),
        max_tokens: Some(a.gen_tokens),
        stop: vec![],
        logprobs: None,
        ignore_eos: true,
        spec: specula_engine::speculative::SpecOptions {
            mode,
            ..Default::default()
        },
    };
    let mut rows = Vec::new();
    // Levels outside, rounds of the modes inside (see below).
    let modes: Vec<specula_engine::speculative::SpecMode> = a
        .modes
        .iter()
        .map(|m| match m {
            EngineBenchMode::Off => specula_engine::speculative::SpecMode::Off,
            EngineBenchMode::Ngram => specula_engine::speculative::SpecMode::Ngram,
            EngineBenchMode::Mtp => specula_engine::speculative::SpecMode::Mtp,
            EngineBenchMode::Block => specula_engine::speculative::SpecMode::Block,
            EngineBenchMode::Draft => specula_engine::speculative::SpecMode::Draft,
        })
        .collect();
    for &n in &a.streams {
        // Round r runs every mode once, back to back: the paired ratios compare runs a few
        // seconds apart.
        let mut runs: Vec<Vec<EngineRun>> = vec![Vec::new(); modes.len()];
        for _ in 0..a.runs {
            for (m, &mode) in modes.iter().enumerate() {
                runs[m].push(engine_run(&mut engine, n, &|i| request(i, mode))?);
            }
        }
        for (m, &mode) in modes.iter().enumerate() {
            let paired = (m > 0).then(|| {
                median(
                    runs[m]
                        .iter()
                        .zip(&runs[0])
                        .map(|(x, y)| x.tok_s / y.tok_s.max(1e-9))
                        .collect(),
                )
            });
            let mut sorted = runs[m].clone();
            sorted.sort_by(|x, y| x.tok_s.total_cmp(&y.tok_s));
            let r = &sorted[sorted.len() / 2];
            let full_tok_s = median(runs[m].iter().map(|r| r.full_tok_s).collect());
            eprintln!(
                "{:5} {n:3} streams: aggregate decode {:8.1} tok/s ({full_tok_s:.1} with all {n} decoding){}, {} steps, prefill of the burst {:.1} ms, drafted {}, accepted {}, trimmed by the batch budget {}",
                mode.as_str(),
                r.tok_s,
                paired.map_or(String::new(), |p| format!(", {p:.3}x {} (median of paired runs)", modes[0].as_str())),
                r.steps,
                r.prefill_s * 1e3,
                r.drafted,
                r.accepted,
                r.trimmed,
            );
            rows.push(serde_json::json!({
                "mode": mode.as_str(), "streams": n, "aggregate_decode_tok_s": r.tok_s,
                "full_batch_decode_tok_s": full_tok_s,
                "paired_ratio_to_first_mode": paired,
                "decode_steps": r.steps, "burst_prefill_ms": r.prefill_s * 1e3,
                "drafted": r.drafted, "accepted": r.accepted, "trimmed": r.trimmed,
            }));
        }
    }
    let single = rows
        .iter()
        .find(|r| r["mode"] == "off" && r["streams"] == 1)
        .and_then(|r| r["aggregate_decode_tok_s"].as_f64());
    if let Some(one) = single {
        let ratios: Vec<String> = rows
            .iter()
            .map(|r| {
                let v = r["aggregate_decode_tok_s"].as_f64().unwrap_or(0.0);
                format!(
                    "{}@{}: {:.2}x",
                    r["mode"].as_str().unwrap_or("?"),
                    r["streams"],
                    v / one
                )
            })
            .collect();
        eprintln!("aggregate / single-stream plain: {}", ratios.join(", "));
    }
    let v = serde_json::json!({
        "model": engine.model_id(),
        "weights": engine.bundle().quantization,
        "device": engine.device_name().unwrap_or("cpu"),
        "prompt_tokens": prompt_len,
        "gen_tokens": a.gen_tokens,
        "runs": a.runs,
        "build_commit": tune::build_commit(),
        "levels": rows,
    });
    plot_result(a, &v)?;
    println!("{}", serde_json::to_string_pretty(&v)?);
    Ok(())
}

/// Median milliseconds of an r-row forward after `prompt` for r = 1..=n, and each relative to
/// r = 1. Row counts are interleaved within each repetition so machine noise hits them alike.
fn verify_costs(engine: &Engine, prompt: &[u32], n: usize, runs: usize) -> Result<Vec<(usize, f64, f64)>> {
    use specula_engine::model::LogitsRows;
    let model = engine.model();
    let mut kv = model.new_kv_cache();
    if prompt.len() + n > engine.context_length() {
        bail!("--prompt-tokens + --verify-rows exceeds the context window");
    }
    model.forward(prompt, &mut kv, LogitsRows::None, &[])?;
    let base = kv.len();
    let reps = (runs * 5).max(5);
    let mut times = vec![Vec::with_capacity(reps); n];
    for rep in 0..reps + 1 {
        for r in 1..=n {
            let tokens: Vec<u32> = prompt.iter().copied().cycle().skip(rep + r).take(r).collect();
            let rows = if r == 1 { LogitsRows::Last } else { LogitsRows::All };
            let t = std::time::Instant::now();
            model.forward(&tokens, &mut kv, rows, &[])?;
            let ms = 1e3 * t.elapsed().as_secs_f64();
            kv.truncate(base);
            if rep > 0 {
                // The first repetition warms caches and is not counted.
                times[r - 1].push(ms);
            }
        }
    }
    let med: Vec<f64> = times.into_iter().map(median).collect();
    Ok(med
        .iter()
        .enumerate()
        .map(|(i, &ms)| (i + 1, ms, ms / med[0]))
        .collect())
}

fn bench(a: BenchArgs) -> Result<()> {
    if let Some(f) = &a.from {
        let text = std::fs::read_to_string(f).with_context(|| format!("reading {}", f.display()))?;
        let v: serde_json::Value =
            serde_json::from_str(&text).with_context(|| format!("{} is not a JSON bench result", f.display()))?;
        return plot_result(&a, &v);
    }
    if a.engine {
        return bench_engine(&a);
    }
    if a.device != "cpu" {
        return bench_gpu(&a);
    }
    if a.runs == 0 || a.prompt_tokens == 0 || a.gen_tokens == 0 {
        bail!("--runs, --prompt-tokens and --gen-tokens must be >= 1");
    }
    let mut engine = load(&a.model, None)?;
    // A deterministic prompt of exactly `prompt_tokens` tokens: a fixed text repeated.
    let base = engine.tokenize(
        "The harbour town woke slowly under a grey sky. Fishing boats rocked at their moorings while gulls \
         argued over the nets, and the baker on the corner opened his shutters to the smell of rain. ",
    )?;
    let prompt: Vec<u32> = base.iter().copied().cycle().take(a.prompt_tokens).collect();
    let mut prefill = Vec::new();
    let mut decode = Vec::new();
    // As llama-bench measures: pp = one prefill of `prompt_tokens` tokens into an empty cache;
    // tg = `gen_tokens` decode steps from a one-token prompt.
    let request = |prompt_tokens: Vec<u32>, max_tokens: usize| GenerateRequest {
        prompt_tokens,
        sampling: SamplingParams::greedy(),
        max_tokens: Some(max_tokens),
        stop: vec![],
        logprobs: None,
        ignore_eos: true,
        spec: Default::default(),
    };
    for run in 0..a.runs {
        let pp = engine.generate(&request(prompt.clone(), 1), &mut |_| true)?.stats;
        let tg = engine
            .generate(&request(prompt[..1].to_vec(), a.gen_tokens + 1), &mut |_| true)?
            .stats;
        let pp_rate = pp.prompt_tokens as f64 / pp.prefill_s;
        let tg_rate = tg.decode_steps as f64 / tg.decode_s;
        eprintln!(
            "run {run}: prefill {pp_rate:.1} tok/s ({} tokens), decode {tg_rate:.1} tok/s ({} steps)",
            pp.prompt_tokens, tg.decode_steps
        );
        prefill.push(pp_rate);
        decode.push(tg_rate);
    }
    let threads = specula_engine::kernels::pool::configured_threads();
    let (pp, tg) = (median(prefill), median(decode));
    let verify = match a.verify_rows {
        Some(n) => verify_costs(&engine, &prompt, n, a.runs)?,
        None => Vec::new(),
    };
    let result = serde_json::json!({
        "model": engine.model_id(),
        "weights": engine.bundle().quantization,
        "threads": threads,
        "prompt_tokens": a.prompt_tokens,
        "gen_tokens": a.gen_tokens,
        "runs": a.runs,
        "prefill_tok_s": pp,
        "decode_tok_s": tg,
        "verify_cost": verify.iter().map(|&(r, ms, rel)| serde_json::json!({
            "rows": r, "k": r - 1, "ms": ms, "relative_to_one_row": rel
        })).collect::<Vec<_>>(),
    });
    plot_result(&a, &result)?;
    if a.json {
        println!("{result}");
    } else {
        for &(r, ms, rel) in &verify {
            println!(
                "verify k={:2} ({r:2} rows): {ms:7.2} ms = {rel:.2} x one decode step",
                r - 1
            );
        }
        println!(
            "{}: pp{} {:.1} tok/s | tg{} {:.1} tok/s (median of {}, {} threads)",
            engine.model_id(),
            a.prompt_tokens,
            pp,
            a.gen_tokens,
            tg,
            a.runs,
            threads
        );
    }
    Ok(())
}

/// The ordinal N of `cuda:N`. Errors: any other device name.
fn cuda_ordinal(device: &str) -> Result<usize> {
    device
        .strip_prefix("cuda:")
        .and_then(|n| n.parse().ok())
        .or_else(|| (device == "cuda").then_some(0))
        .ok_or_else(|| anyhow::anyhow!("unknown device '{device}': use cpu or cuda:N"))
}

/// `--device`: for cuda:N, load the target onto that GPU with KV slots for up to `slots`
/// running requests and attach it to `engine` ([`Engine::attach_device`]). Returns whether a
/// device was attached. Errors: an unknown device, a build without CUDA, a GPU or bundle the
/// CUDA path cannot use.
fn attach_device(
    engine: &mut Engine,
    device: &str,
    model_path: Option<&std::path::Path>,
    slots: usize,
) -> Result<bool> {
    if device == "cpu" {
        return Ok(false);
    }
    let ordinal = cuda_ordinal(device)?;
    let path = model_path.ok_or_else(|| anyhow::anyhow!("--device {device}: the model's path is unknown"))?;
    attach_cuda(engine, ordinal, path, slots)?;
    Ok(true)
}

/// `--device` before anything loads: a known device name this build can use.
fn check_device(device: &str) -> Result<()> {
    if device == "cpu" {
        return Ok(());
    }
    let ordinal = cuda_ordinal(device)?;
    #[cfg(feature = "cuda-backend")]
    {
        let _ = ordinal;
        specula_engine::cuda::check_available()
    }
    #[cfg(not(feature = "cuda-backend"))]
    bail!("this specula was built without CUDA: build with `cargo build --release --features cuda` (docs/gpu.md) for --device cuda:{ordinal}")
}

#[cfg(feature = "cuda-backend")]
fn attach_cuda(engine: &mut Engine, ordinal: usize, path: &std::path::Path, slots: usize) -> Result<()> {
    let t = std::time::Instant::now();
    let m = specula_engine::cuda::load::engine_target(ordinal, path, engine.config(), slots, engine.context_length())
        .with_context(|| format!("loading {} onto cuda:{ordinal}", path.display()))?;
    tracing::info!(
        device = %m.gpu.name(),
        weights_mib = m.weight_bytes() >> 20,
        kv_mib = m.kv_bytes() >> 20,
        slots = m.slots(),
        context = m.max_ctx(),
        "target on cuda:{ordinal} in {:.2}s",
        t.elapsed().as_secs_f64()
    );
    engine.attach_device(Box::new(m))
}

#[cfg(not(feature = "cuda-backend"))]
fn attach_cuda(_: &mut Engine, ordinal: usize, _: &std::path::Path, _: usize) -> Result<()> {
    check_device(&format!("cuda:{ordinal}"))
}

#[cfg(feature = "cuda-backend")]
fn bench_gpu(a: &BenchArgs) -> Result<()> {
    use specula_engine::cuda::{bench, load};
    let ordinal = cuda_ordinal(&a.device)?;
    if a.streams.is_empty() || a.streams.contains(&0) || a.streams.iter().any(|&s| s > 256) {
        bail!("--streams takes levels between 1 and 256");
    }
    if a.prefill_lens.is_empty() || a.prefill_lens.iter().any(|&n| n == 0 || n > 131_072) {
        bail!("--prefill-lens takes prompt lengths between 1 and 131072");
    }
    let verify_rows = a.verify_rows.unwrap_or(16);
    if !(2..=64).contains(&verify_rows) {
        bail!("--verify-rows must be between 2 and 64 on the GPU");
    }
    let opts = bench::BenchOptions {
        ordinal,
        shape: load::shape(&a.shape)?,
        seed: 0x5eed,
        streams: a.streams.clone(),
        max_verify_rows: verify_rows,
        decode_steps: a.gen_tokens.max(16),
        prefill_lens: a.prefill_lens.clone(),
        // The context of the decode, verify and aggregate timings: 128 tokens, as the PyTorch
        // baseline (scripts/gpu_torch_baseline.py) uses.
        context: 128,
        build_commit: tune::build_commit(),
        dtype: a.dtype.parse()?,
        compare_gemv: a.compare_gemv,
    };
    let receipt = bench::run(&opts, &|s| eprintln!("[bench] {s}"))?;
    plot_result(a, &receipt)?;
    let text = serde_json::to_string_pretty(&receipt)?;
    if let Some(p) = &a.receipt {
        std::fs::write(p, &text).with_context(|| format!("writing {}", p.display()))?;
    }
    println!("{text}");
    if receipt["exactness"]["all_pass"] != true {
        bail!("an exactness check failed on the GPU (see exactness in the receipt)");
    }
    Ok(())
}

#[cfg(not(feature = "cuda-backend"))]
fn bench_gpu(a: &BenchArgs) -> Result<()> {
    cuda_ordinal(&a.device)?;
    bail!(
        "this specula was built without CUDA: build with `cargo build --release --features cuda` (docs/gpu.md) for --device {}",
        a.device
    )
}

/// The id a `--draft-model` argument is known by (in `/v1/models`, `decode_path`, stats): a
/// catalog name as given, a path by its file name, so no server path reaches a client.
fn draft_model_id(arg: &str) -> String {
    let p = std::path::Path::new(arg);
    match p.file_name() {
        Some(name) if p.components().count() > 1 => name.to_string_lossy().into_owned(),
        _ => arg.to_string(),
    }
}

#[cfg(test)]
mod median_tests {
    #[test]
    fn median_of_odd_and_even_counts() {
        assert_eq!(super::median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(super::median(vec![4.0, 1.0]), 2.5);
        assert_eq!(super::median(vec![5.0]), 5.0);
        assert_eq!(super::median(vec![1.0, 9.0, 3.0, 7.0]), 5.0);
    }
}
