//! The engine worker: one dedicated OS thread owns the [`Engine`] and runs jobs one at a time, in
//! arrival order. Handlers talk to it through an [`EngineHandle`].
//!
//! Admission: at most one job runs and at most `max_queue` wait; a submission past that is
//! refused with [`SubmitError::QueueFull`] (HTTP 429). A job carries a tokio channel for its
//! [`Event`]s; when the receiver is dropped (the client went away) the generation is cancelled at
//! the next token.

use std::panic::AssertUnwindSafe;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, PoisonError, RwLock};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use specula_engine::constraint::{Constraint, GrammarCompiler, GrammarSpec, OutputControl, ReasoningControl};
use specula_engine::engine::DraftLoader;
use specula_engine::sequence::{Sequence, StepOutcome};
use specula_engine::speculative::{SpecMode, SpecOptions};
use specula_engine::{Engine, GenerateOutput, GenerateRequest, RequestError, StreamDelta};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

use crate::chat_prompt::{self, ChatInfo, ChatPrompt};
use crate::logprobs::TokenBytes;
use crate::metrics::Metrics;
use crate::reasoning::{output_reasoning, THINK_CLOSE, THINK_OPEN};

/// Default number of requests decoded together by `specula serve` (continuous batching).
pub const DEFAULT_MAX_BATCH: usize = 8;

/// Default number of requests allowed to wait (see [`EngineHandle::spawn_with_queue`]).
pub const DEFAULT_MAX_QUEUE: usize = 64;

/// What the model serves, for `/v1/models` and response bodies.
#[derive(Debug, Clone)]
pub struct ModelInfo {
    /// The id clients use.
    pub id: String,
    /// Context window in tokens.
    pub context_length: usize,
    /// Vocabulary size of the model.
    pub vocab_size: usize,
    /// Unix seconds when the engine was handed to the server.
    pub created: u64,
    /// The attached draft model's id, if any.
    pub draft_model: Option<String>,
    /// The attached native drafters (`mtp: PATH`, `block: PATH`).
    pub native_drafters: Vec<String>,
    /// Whether every projection of the model runs on a batch-invariant kernel (speculation is
    /// used only then; otherwise requests decode plain AR).
    pub batch_invariant: bool,
    /// Where the target runs: "cpu", or the GPU's name with `--device cuda:N`.
    pub device: String,
    /// Speculative decoding for requests that do not set the `spec` field.
    pub spec: SpecOptions,
    /// The chat format: tool-call dialect, thinking.
    pub chat: ChatInfo,
    /// What requests without a `spec` field actually run: `{"drafter", "draft_max", "adaptive",
    /// "reason"}` (the tuning choice for `default`, AR when the kernels are not batch-invariant).
    pub effective_spec: serde_json::Value,
    /// The measured choice `default` follows (from a tuning file), if any.
    pub tuned_default: Option<serde_json::Value>,
    /// The bundle report's capability summary (`specula_engine::inspect`), when the server was
    /// started with one.
    pub bundle: Option<serde_json::Value>,
    /// Recent model loads and unloads, oldest first (at most [`crate::admin::MAX_LOAD_LOG`]):
    /// the target's and any draft model's before serving, then those made by
    /// `POST /v1/models/{id}/speculative`.
    pub loads: Vec<crate::admin::LoadEvent>,
}

impl ModelInfo {
    /// What speculative mode `mode` needs that this model lacks: `Some("an MTP head")` for
    /// `mtp` without an attached MTP head, `Some("a block drafter")` for `block` without one;
    /// `None` otherwise (a draft model is checked on its own: it can be attached at run time).
    pub fn missing_native_drafter(&self, mode: SpecMode) -> Option<&'static str> {
        let (kind, what) = match mode {
            SpecMode::Mtp => ("mtp:", "an MTP head"),
            SpecMode::Block => ("block:", "a block drafter"),
            _ => return None,
        };
        (!self.native_drafters.iter().any(|d| d.starts_with(kind))).then_some(what)
    }
}

/// The current [`ModelInfo`] of a handle; a speculation change replaces the whole value.
pub(crate) type ModelCell = Arc<RwLock<Arc<ModelInfo>>>;

/// What requests without a `spec` field run on `engine`, as JSON for `/v1/models`.
pub(crate) fn effective_spec_json(engine: &Engine, spec: &SpecOptions) -> serde_json::Value {
    let eff = engine.effective_spec(*spec);
    let resolved = engine.resolve_spec_mode(spec.mode);
    let tuned = engine
        .tuned_default()
        .filter(|_| spec.mode == specula_engine::speculative::SpecMode::Default);
    let (drafter, reason) = match resolved {
        None => (
            "ar".to_string(),
            match tuned {
                Some(t) => format!("tuning file choice: {}", t.describe()),
                None => "speculation off".to_string(),
            },
        ),
        Some(_) if !engine.batch_invariant() => (
            "ar".to_string(),
            "this model's kernels are not batch-invariant, so speculation would not be exact".to_string(),
        ),
        Some(m) => {
            let mut name = match m {
                specula_engine::speculative::SpecMode::Draft => {
                    format!("draft-model:{}", engine.draft_model_id().unwrap_or("?"))
                }
                other => other.as_str().to_string(),
            };
            // As the requests' decode path says it.
            if specula_engine::sequence::lookup_beside(&eff, resolved) {
                name.push_str("+ngram");
            }
            let why = match tuned {
                Some(t) => format!("tuning file choice: {}", t.describe()),
                // `--spec` at start, or the runtime speculation endpoint since.
                None => format!("the server's spec setting: {}", spec.mode.as_str()),
            };
            (name, why)
        }
    };
    serde_json::json!({
        "drafter": drafter,
        "draft_max": eff.draft_max,
        "adaptive": eff.adaptive,
        "reason": reason,
    })
}

/// The prompt of a job, before templating and tokenization (done on the worker thread).
#[derive(Debug, Clone)]
pub enum Prompt {
    /// Rendered with the model's chat template (generation prompt added; tools, tool_choice
    /// and keyword arguments passed), then tokenized.
    Chat(ChatPrompt),
    /// A text prompt: control-token strings in it are text unless `parse_special`.
    Text { text: String, parse_special: bool },
    /// Token ids, used as is.
    Tokens(Vec<u32>),
}

/// One generation to run.
#[derive(Debug, Clone)]
pub struct Submission {
    pub prompt: Prompt,
    /// The request; its `prompt_tokens` are replaced by the tokenized `prompt`.
    pub request: GenerateRequest,
    /// When `request.max_tokens` is `None`: this many tokens, capped by the room left in the
    /// context (OpenAI's legacy completions default of 16). `None` = until EOS or context full.
    pub default_max_tokens: Option<usize>,
    /// Send [`Event::Delta`]s (streaming); otherwise only the final event is sent.
    pub stream: bool,
    /// Endpoint name for logs.
    pub endpoint: &'static str,
    /// Structured output (`response_format`): the answer is constrained to this grammar.
    pub grammar: Option<GrammarSpec>,
    /// Chat: bounds on the model's reasoning (`None` for completions).
    pub reasoning: Option<ReasoningLimits>,
}

/// What a chat request bounds a thinking model's reasoning with (see
/// `params::reasoning_limits`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReasoningLimits {
    /// Tokens of reasoning before `</think>` is forced (`max_reasoning_tokens`).
    pub max_tokens: Option<usize>,
    /// Characters of reasoning before a structured answer (`think_prelude_chars`); applies only
    /// with a grammar.
    pub prelude_chars: usize,
    /// The model may think even when the prompt does not open `<think>`.
    pub thinking: bool,
}

impl ReasoningLimits {
    /// The engine's reasoning control for a prompt ending in `prompt_tail`, with or without a
    /// grammar for the answer; `None` when no reasoning follows the prompt
    /// ([`output_reasoning`]: among others, a prompt that already closed an empty block, where
    /// a control in its "may open `<think>`" phase could read the answer's first piece, a forced
    /// tool call's `<`, as the start of the open marker) or nothing is bounded.
    pub fn control(&self, prompt_tail: &str, grammar: bool) -> Option<ReasoningControl> {
        let opens = output_reasoning(prompt_tail, self.thinking)?;
        let max_chars = grammar.then_some(self.prelude_chars);
        (self.max_tokens.is_some() || max_chars.is_some()).then(|| ReasoningControl {
            open: THINK_OPEN.to_string(),
            close: THINK_CLOSE.to_string(),
            starts_open: opens,
            max_tokens: self.max_tokens,
            max_chars,
        })
    }
}

/// What the worker reports about a job, in order: `Started`, then (streaming) `Delta`s, then
/// `Done`; or `Failed` at any point.
#[derive(Debug)]
pub enum Event {
    /// The prompt was tokenized and validated; generation begins. `prompt_tail` is the end of
    /// the rendered chat prompt (empty for other prompts).
    /// `cached_tokens` of the prompt came from the prefix cache.
    Started {
        prompt_tokens: usize,
        cached_tokens: usize,
        prompt_tail: String,
    },
    /// Output that became final.
    Delta(StreamDelta),
    /// The finished generation.
    Done(Box<GenerateOutput>),
    /// The request was rejected or failed.
    Failed(RequestError),
}

/// Why a submission was not accepted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SubmitError {
    /// One job is running and `max_queue` are waiting.
    QueueFull,
    /// The worker thread is gone.
    WorkerGone,
}

enum Work {
    Job(Box<Job>),
    Hold(mpsc::Receiver<()>, Slot),
    /// A change of the speculation default (between jobs; takes no queue place).
    Control(Box<crate::admin::Control>),
    /// Render and tokenize a prompt, answering its token count (between jobs; takes no queue
    /// place).
    Count(Prompt, tokio::sync::oneshot::Sender<Result<usize, RequestError>>),
}

struct Job {
    sub: Submission,
    /// `sub.grammar` compiled off the worker thread ([`EngineHandle::compile_grammar`]); `None`
    /// with a grammar: the worker compiles it.
    compiled: Option<Box<dyn Constraint>>,
    events: UnboundedSender<Event>,
    enqueued: Instant,
    slot: Slot,
}

/// Admission counters shared by the handles and the worker.
struct Queue {
    max_queue: usize,
    /// Requests decoded together (continuous batching); read by the worker at each admission.
    max_batch: AtomicUsize,
    /// Bytes of KV cache the running requests may reserve together (worst case: prompt +
    /// max_tokens positions each); read by the worker at each admission.
    kv_budget: AtomicUsize,
    /// Admitted and not finished (running + waiting).
    pending: AtomicUsize,
    /// Admitted and not yet taken by the worker.
    waiting: AtomicUsize,
    metrics: Metrics,
}

impl Queue {
    /// Reserve a place: at most `max_batch` running plus `max_queue` waiting.
    fn admit(self: &Arc<Self>) -> Result<Slot, SubmitError> {
        let limit = self
            .max_queue
            .saturating_add(self.max_batch.load(Ordering::SeqCst).max(1));
        self.pending
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |p| (p < limit).then_some(p + 1))
            .map_err(|_| SubmitError::QueueFull)?;
        let w = self.waiting.fetch_add(1, Ordering::SeqCst) + 1;
        self.metrics.queue_depth.set(w as i64);
        Ok(Slot {
            queue: self.clone(),
            taken: false,
        })
    }
}

/// A place in the queue; released when dropped (job finished or discarded).
struct Slot {
    queue: Arc<Queue>,
    /// The worker took the job (it no longer counts as waiting).
    taken: bool,
}

impl Slot {
    fn take(&mut self) {
        if !self.taken {
            self.taken = true;
            let w = self.queue.waiting.fetch_sub(1, Ordering::SeqCst) - 1;
            self.queue.metrics.queue_depth.set(w as i64);
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.take();
        self.queue.pending.fetch_sub(1, Ordering::SeqCst);
    }
}

#[derive(Clone)]
struct Shared {
    jobs: mpsc::Sender<Work>,
    queue: Arc<Queue>,
    model: ModelCell,
    token_bytes: TokenBytes,
    /// The directories a request's `draft_model` may name files in (`--models-dir`); empty:
    /// catalog names only ([`crate::admin::resolve_draft_model`]).
    models_dirs: Arc<RwLock<Vec<PathBuf>>>,
    /// The model's grammar compiler, for compiling requests' grammars off the worker thread;
    /// `None` when the model cannot end a grammar (the worker then reports why).
    grammar: Option<Arc<GrammarCompiler>>,
    /// Grammar compilations running at once (one per core): more wait.
    compiles: Arc<tokio::sync::Semaphore>,
    /// Reads draft models off the worker thread ([`crate::admin`]).
    draft_loader: Arc<DraftLoader>,
}

/// A cheap, cloneable handle to the engine worker. The worker thread ends when the last handle
/// is dropped (after its current job).
#[derive(Clone)]
pub struct EngineHandle {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for EngineHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineHandle")
            .field("model", &self.model().id)
            .field("max_queue", &self.shared.queue.max_queue)
            .finish_non_exhaustive()
    }
}

/// Keeps the worker busy until dropped (see [`EngineHandle::hold`]).
#[derive(Debug)]
pub struct HoldGuard {
    _release: mpsc::Sender<()>,
}

impl EngineHandle {
    /// Start the worker thread with the default queue size ([`DEFAULT_MAX_QUEUE`]).
    pub fn spawn(engine: Engine) -> Self {
        Self::spawn_with_queue(engine, DEFAULT_MAX_QUEUE)
    }

    /// Start the worker thread; at most `max_queue` requests wait while one runs. Requests
    /// without a `spec` field decode plain AR.
    pub fn spawn_with_queue(engine: Engine, max_queue: usize) -> Self {
        Self::spawn_with_spec(engine, max_queue, SpecOptions::default())
    }

    /// Start the worker thread; at most `max_queue` requests wait while one runs, and requests
    /// without a `spec` field use `spec` (see [`check_spec_default`] for a default the engine
    /// cannot serve).
    pub fn spawn_with_spec(engine: Engine, max_queue: usize, spec: SpecOptions) -> Self {
        Self::spawn_with_bundle(engine, max_queue, spec, None)
    }

    /// As [`EngineHandle::spawn_with_spec`], with the bundle's capability summary (from
    /// `specula_engine::inspect`) shown in `/v1/models`.
    pub fn spawn_with_bundle(
        mut engine: Engine,
        max_queue: usize,
        spec: SpecOptions,
        bundle: Option<serde_json::Value>,
    ) -> Self {
        let metrics = Metrics::new();
        // The KV pool as the server starts (a preallocated pool shows at once; the worker sets
        // the gauges again after every step).
        let pool = engine.model().kv_pool_stats();
        metrics.kv_pool_blocks_in_use.set(pool.in_use as i64);
        metrics.kv_pool_bytes.set((pool.allocated * pool.block_bytes) as i64);
        let model = ModelInfo {
            loads: crate::admin::startup_loads(&engine, &metrics),
            effective_spec: effective_spec_json(&engine, &spec),
            tuned_default: engine.tuned_default().and_then(|t| serde_json::to_value(t).ok()),
            bundle,
            id: engine.model_id().to_string(),
            context_length: engine.context_length(),
            vocab_size: engine.config().vocab_size,
            created: unix_now(),
            draft_model: engine.draft_model_id().map(str::to_string),
            native_drafters: engine.native_drafters(),
            batch_invariant: engine.batch_invariant(),
            device: engine.device_name().unwrap_or("cpu").to_string(),
            spec,
            chat: ChatInfo::of(&engine),
        };
        let token_bytes = TokenBytes::new(engine.tokenizer().clone());
        let grammar = engine.shared_grammar_compiler().ok();
        let draft_loader = Arc::new(engine.draft_loader());
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let queue = Arc::new(Queue {
            max_queue,
            max_batch: AtomicUsize::new(1),
            kv_budget: AtomicUsize::new(usize::MAX),
            pending: AtomicUsize::new(0),
            waiting: AtomicUsize::new(0),
            metrics: metrics.clone(),
        });
        let (tx, rx) = mpsc::channel::<Work>();
        let worker_metrics = metrics;
        std::thread::Builder::new()
            .name("specula-engine".to_string())
            .stack_size(16 << 20)
            .spawn({
                let queue = queue.clone();
                move || {
                    let drafts = crate::admin::DraftState::new(&engine);
                    worker_loop(engine, drafts, rx, worker_metrics, queue)
                }
            })
            .expect("spawning the engine thread");
        Self {
            shared: Arc::new(Shared {
                jobs: tx,
                queue,
                model: Arc::new(RwLock::new(Arc::new(model))),
                token_bytes,
                models_dirs: Arc::new(RwLock::new(Vec::new())),
                grammar,
                compiles: Arc::new(tokio::sync::Semaphore::new(cores)),
                draft_loader,
            }),
        }
    }

    /// Compile a request's grammar on a blocking thread (the compile itself on a deep stack),
    /// at most one per core at once, so the worker thread never waits for one. `None`: the
    /// worker compiles it (this model's compiler could not be built; the worker says why).
    /// Dropping the future gives up waiting; a compile already running finishes unseen.
    pub async fn compile_grammar(&self, spec: &GrammarSpec) -> Option<Result<Box<dyn Constraint>, RequestError>> {
        let compiler = self.shared.grammar.clone()?;
        let _permit = self.shared.compiles.acquire().await.ok()?;
        let spec = spec.clone();
        let compiled =
            tokio::task::spawn_blocking(move || specula_engine::engine::compile_request_grammar(&compiler, &spec))
                .await;
        Some(compiled.unwrap_or_else(|_| Err(RequestError::Internal("the grammar compilation failed".into()))))
    }

    /// Reads draft models for this model off the worker thread.
    pub(crate) fn draft_loader(&self) -> Arc<DraftLoader> {
        self.shared.draft_loader.clone()
    }

    /// Allow requests to name draft models in `dirs` (`--models-dir`): a file or bundle
    /// directory inside one of them. Without, a request names pulled catalog models only.
    pub fn with_models_dirs(self, dirs: Vec<PathBuf>) -> Self {
        *self.shared.models_dirs.write().unwrap_or_else(PoisonError::into_inner) = dirs;
        self
    }

    /// The directories of [`EngineHandle::with_models_dirs`].
    pub fn models_dirs(&self) -> Vec<PathBuf> {
        self.shared
            .models_dirs
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// What the model serves now. A speculation change (`POST /v1/models/{id}/speculative`)
    /// replaces it: the returned snapshot stays as it was, call again for the current state.
    pub fn model(&self) -> Arc<ModelInfo> {
        self.shared.model.read().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// This handle with the seconds the loads before serving took (the target's, the draft
    /// model's) shown in `/v1/models` (`specula.loads`); unknown ones stay `null`.
    pub fn with_load_seconds(self, target: Option<f64>, draft: Option<f64>) -> Self {
        {
            let mut cell = self.shared.model.write().unwrap_or_else(PoisonError::into_inner);
            let mut m = (**cell).clone();
            crate::admin::set_startup_seconds(&mut m.loads, target, draft);
            *cell = Arc::new(m);
        }
        self
    }

    /// Queue a speculation change for the worker (after the jobs already queued); its outcome
    /// is sent on `reply`. Takes no queue place.
    pub(crate) fn control(
        &self,
        change: crate::admin::SpecChange,
        loaded: Option<specula_engine::engine::LoadedDraft>,
        reply: tokio::sync::oneshot::Sender<Result<crate::admin::Outcome, crate::error::ApiError>>,
    ) -> Result<(), SubmitError> {
        let ctl = crate::admin::Control {
            change,
            loaded,
            cell: self.shared.model.clone(),
            reply,
        };
        self.shared
            .jobs
            .send(Work::Control(Box::new(ctl)))
            .map_err(|_| SubmitError::WorkerGone)
    }

    /// This handle with the tool-call dialect set (`--tool-parser`) instead of detected; `None`
    /// keeps the detected one. Other handles keep what they had (and the returned one gets its
    /// own [`ModelInfo`]: speculation changes made through the others are not shown by it).
    pub fn with_tool_parser(self, dialect: Option<crate::tools::Dialect>) -> Self {
        let Some(d) = dialect else {
            return self;
        };
        let mut shared = (*self.shared).clone();
        let mut model = (*self.model()).clone();
        model.chat = model.chat.with_dialect(d);
        shared.model = Arc::new(RwLock::new(Arc::new(model)));
        Self {
            shared: Arc::new(shared),
        }
    }

    pub fn metrics(&self) -> &Metrics {
        &self.shared.queue.metrics
    }

    /// Decode up to `n` requests together (continuous batching: one batched target forward per
    /// step for all of them; each request's output stays byte-identical to running it alone on
    /// batch-invariant kernels). Default 1 (one request at a time). Applies from the next
    /// admission.
    pub fn with_max_batch(self, n: usize) -> Self {
        self.shared.queue.max_batch.store(n.max(1), Ordering::SeqCst);
        self
    }

    /// Let running requests reserve at most `bytes` of KV cache together. A request reserves
    /// its worst case, (prompt + max_tokens) positions, when it starts; one that would not fit
    /// next to the running ones waits (in order) until enough of them finish, and one that
    /// cannot fit even alone is refused with a 400 naming the numbers. Default: no limit.
    pub fn with_kv_budget(self, bytes: usize) -> Self {
        self.shared.queue.kv_budget.store(bytes.max(1), Ordering::SeqCst);
        self
    }

    /// Requests decoded together at most.
    pub fn max_batch(&self) -> usize {
        self.shared.queue.max_batch.load(Ordering::SeqCst)
    }

    pub fn max_queue(&self) -> usize {
        self.shared.queue.max_queue
    }

    /// Requests admitted and not finished (the running one included).
    pub fn pending(&self) -> usize {
        self.shared.queue.pending.load(Ordering::SeqCst)
    }

    /// Requests admitted and not yet taken by the worker.
    pub fn waiting(&self) -> usize {
        self.shared.queue.waiting.load(Ordering::SeqCst)
    }

    pub(crate) fn token_bytes(&self) -> &TokenBytes {
        &self.shared.token_bytes
    }

    /// Queue a generation. Events arrive on the returned receiver; dropping it cancels the job.
    pub fn submit(&self, sub: Submission) -> Result<UnboundedReceiver<Event>, SubmitError> {
        self.submit_compiled(sub, None)
    }

    /// As [`EngineHandle::submit`], with `sub.grammar` already compiled
    /// ([`EngineHandle::compile_grammar`]).
    pub fn submit_compiled(
        &self,
        sub: Submission,
        compiled: Option<Box<dyn Constraint>>,
    ) -> Result<UnboundedReceiver<Event>, SubmitError> {
        let slot = self.shared.queue.admit()?;
        let (tx, rx) = unbounded_channel();
        let job = Job {
            sub,
            compiled,
            events: tx,
            enqueued: Instant::now(),
            slot,
        };
        self.shared
            .jobs
            .send(Work::Job(Box::new(job)))
            .map_err(|_| SubmitError::WorkerGone)?;
        Ok(rx)
    }

    /// The token count of `prompt` as a generation would render and tokenize it (on the worker,
    /// between jobs).
    pub async fn count_prompt_tokens(&self, prompt: Prompt) -> Result<usize, RequestError> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.shared
            .jobs
            .send(Work::Count(prompt, tx))
            .map_err(|_| RequestError::Internal("the engine worker is not running".into()))?;
        rx.await
            .unwrap_or_else(|_| Err(RequestError::Internal("the engine worker stopped".into())))
    }

    /// Occupy the engine (a queue place, then the worker) until the guard is dropped: for tests
    /// of queueing and for maintenance.
    pub fn hold(&self) -> Result<HoldGuard, SubmitError> {
        let slot = self.shared.queue.admit()?;
        let (tx, rx) = mpsc::channel();
        self.shared
            .jobs
            .send(Work::Hold(rx, slot))
            .map_err(|_| SubmitError::WorkerGone)?;
        Ok(HoldGuard { _release: tx })
    }
}

/// Check that `engine` can serve the server-wide speculation default `spec`: `draft_max` within
/// `1..=MAX_DRAFT`, and a draft model attached for mode `draft`.
pub fn check_spec_default(engine: &Engine, spec: &SpecOptions) -> Result<(), String> {
    use specula_engine::engine::MAX_DRAFT;
    use specula_engine::speculative::SpecMode;
    if spec.draft_max == 0 || spec.draft_max > MAX_DRAFT {
        return Err(format!(
            "draft_max must be between 1 and {MAX_DRAFT}, got {}",
            spec.draft_max
        ));
    }
    if spec.mode == SpecMode::Draft && engine.draft_model_id().is_none() {
        return Err(format!(
            "speculative mode `draft` needs a draft model, and {} has none attached",
            engine.model_id()
        ));
    }
    Ok(())
}

pub(crate) fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// A request being decoded by the worker.
struct Running {
    seq: Sequence,
    /// KV bytes reserved for it (its worst case).
    reserved: usize,
    events: UnboundedSender<Event>,
    stream: bool,
    endpoint: &'static str,
    slot: Slot,
}

fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "unknown panic".to_string())
}

/// Continuous batching: admit what is waiting (up to `max_batch` running), run one batched
/// step for every running request, hand out their deltas, retire the finished ones; block for
/// work only when nothing runs.
fn worker_loop(
    mut engine: Engine,
    mut drafts: crate::admin::DraftState,
    rx: mpsc::Receiver<Work>,
    metrics: Metrics,
    queue: Arc<Queue>,
) {
    let mut running: Vec<Running> = Vec::new();
    // A job that waits for KV memory (it goes first once enough is free).
    let mut blocked: Option<Box<Job>> = None;
    let mut open = true;
    while open || !running.is_empty() {
        // Admission.
        while open || blocked.is_some() {
            let max_batch = queue.max_batch.load(Ordering::SeqCst).max(1);
            let work = if let Some(job) = blocked.take() {
                if running.len() < max_batch {
                    Work::Job(job)
                } else {
                    blocked = Some(job);
                    break;
                }
            } else if running.is_empty() {
                match rx.recv() {
                    Ok(w) => w,
                    Err(_) => {
                        open = false;
                        break;
                    }
                }
            } else if running.len() < max_batch {
                match rx.try_recv() {
                    Ok(w) => w,
                    Err(mpsc::TryRecvError::Empty) => break,
                    Err(mpsc::TryRecvError::Disconnected) => {
                        open = false;
                        break;
                    }
                }
            } else {
                break;
            };
            match work {
                Work::Control(ctl) => crate::admin::apply(&mut engine, &mut drafts, *ctl, &metrics),
                Work::Count(prompt, reply) => {
                    if !reply.is_closed() {
                        let n = prompt_tokens(&engine, &prompt).map(|(t, _)| t.len());
                        let _ = reply.send(n);
                    }
                }
                Work::Hold(release, mut slot) => {
                    slot.take();
                    metrics.running.inc();
                    let _ = release.recv();
                    metrics.running.dec();
                }
                Work::Job(mut job) => {
                    job.slot.take();
                    if job.events.is_closed() {
                        tracing::info!(endpoint = job.sub.endpoint, "client went away while queued");
                        continue;
                    }
                    let budget = queue.kv_budget.load(Ordering::SeqCst);
                    let free = budget.saturating_sub(running.iter().map(|r| r.reserved).sum());
                    let started = std::panic::catch_unwind(AssertUnwindSafe(|| {
                        start_job(&mut engine, &job.sub, &mut job.compiled, &job.events, free, budget)
                    }));
                    let failure = match started {
                        Ok(Ok(Some((seq, reserved)))) => {
                            let Job {
                                sub,
                                events,
                                enqueued,
                                slot,
                                ..
                            } = *job;
                            metrics.queue_seconds.observe(enqueued.elapsed().as_secs_f64());
                            metrics.running.inc();
                            running.push(Running {
                                seq,
                                reserved,
                                events,
                                stream: sub.stream,
                                endpoint: sub.endpoint,
                                slot,
                            });
                            continue;
                        }
                        Ok(Ok(None)) => {
                            // Not enough KV memory next to the running requests: wait for them.
                            blocked = Some(job);
                            break;
                        }
                        Ok(Err(e)) => {
                            tracing::info!(endpoint = job.sub.endpoint, "request rejected: {e}");
                            e
                        }
                        Err(panic) => {
                            let msg = panic_message(panic.as_ref());
                            tracing::error!(endpoint = job.sub.endpoint, "engine panicked: {msg}");
                            RequestError::Internal(format!("engine panicked: {msg}"))
                        }
                    };
                    drop(job.slot);
                    let _ = job.events.send(Event::Failed(failure));
                }
            }
        }
        if running.is_empty() {
            continue;
        }
        // One batched step for every running request.
        metrics.batch_sequences.observe(running.len() as f64);
        let results = {
            let mut seqs: Vec<&mut Sequence> = running.iter_mut().map(|r| &mut r.seq).collect();
            std::panic::catch_unwind(AssertUnwindSafe(|| engine.step(&mut seqs)))
        };
        let results: Vec<Result<Option<StepOutcome>, RequestError>> = match results {
            Ok(r) => r,
            Err(panic) => {
                let msg = panic_message(panic.as_ref());
                tracing::error!("engine panicked: {msg}");
                (0..running.len())
                    .map(|_| Err(RequestError::Internal(format!("engine panicked: {msg}"))))
                    .collect()
            }
        };
        let mut done = Vec::new();
        for (i, (r, res)) in running.iter_mut().zip(results).enumerate() {
            match res {
                Ok(Some(outcome)) => {
                    let d = &outcome.delta;
                    let has_output = !d.text.is_empty() || !d.token_ids.is_empty();
                    let alive = if r.stream && has_output {
                        r.events.send(Event::Delta(outcome.delta)).is_ok()
                    } else {
                        !r.events.is_closed()
                    };
                    if !alive {
                        r.seq.cancel();
                    }
                    if outcome.finished || !alive {
                        done.push((i, None));
                    }
                }
                Ok(None) => done.push((i, None)),
                Err(e) => done.push((i, Some(e))),
            }
        }
        // Retire the finished requests (from the back, so the indices stay valid).
        for (i, err) in done.into_iter().rev() {
            let r = running.swap_remove(i);
            metrics.running.dec();
            let out = engine.retire(r.seq, err.is_none());
            if let Some(pc) = engine.prefix_cache_stats() {
                let cached = out.stats.cached_prompt_tokens;
                if cached > 0 {
                    metrics.prefix_cache_hits.inc();
                    metrics.prefix_cache_hit_tokens.inc_by(cached as u64);
                } else {
                    metrics.prefix_cache_misses.inc();
                }
                metrics.prefix_cache_bytes.set(pc.bytes as i64);
            }
            let event = match err {
                None => {
                    record_done(&metrics, r.endpoint, &out);
                    Event::Done(Box::new(out))
                }
                Some(e) => {
                    tracing::error!(endpoint = r.endpoint, "request failed: {e}");
                    Event::Failed(e)
                }
            };
            // Free the queue place first: a client that sends its next request as soon as
            // this one answers must find it free.
            drop(r.slot);
            let _ = r.events.send(event);
        }
        let held: usize = running.iter().map(|r| r.seq.kv().bytes()).sum();
        metrics.kv_bytes.set(held as i64);
        let pool = engine.model().kv_pool_stats();
        metrics.kv_pool_blocks_in_use.set(pool.in_use as i64);
        metrics.kv_pool_bytes.set((pool.allocated * pool.block_bytes) as i64);
        if let Some(slots) = engine.device_slots() {
            metrics.device_slots.set(slots.slots() as i64);
            metrics.device_slots_in_use.set(slots.in_use() as i64);
        }
    }
    tracing::debug!("engine worker stopped");
}

/// Template, tokenize, validate a job and compile its constraint; answer "started"; return its
/// sequence (on the worker thread).
/// `Ok(None)`: the request's worst-case KV (prompt + max_tokens positions) does not fit in the
/// `free` bytes left next to the running requests (it fits the whole `budget`: it can wait).
fn start_job(
    engine: &mut Engine,
    sub: &Submission,
    compiled: &mut Option<Box<dyn Constraint>>,
    events: &UnboundedSender<Event>,
    free: usize,
    budget: usize,
) -> Result<Option<(Sequence, usize)>, RequestError> {
    let (tokens, prompt_tail) = prompt_tokens(engine, &sub.prompt)?;
    let mut req = sub.request.clone();
    req.prompt_tokens = tokens;
    if req.max_tokens.is_none() {
        if let Some(d) = sub.default_max_tokens {
            let room = engine.context_length().saturating_sub(req.prompt_tokens.len());
            req.max_tokens = Some(d.min(room));
        }
    }
    engine.validate(&req)?;
    let prompt = req.prompt_tokens.len();
    let room = engine.context_length().saturating_sub(prompt);
    let positions = prompt + req.max_tokens.unwrap_or(room).min(room);
    let per_token = engine.kv_bytes_per_token();
    // KV is held in whole blocks: reserve the last one in full.
    let need = positions
        .next_multiple_of(specula_engine::kv_cache::KV_BLOCK)
        .saturating_mul(per_token);
    if need > budget {
        return Err(RequestError::InvalidParameter(format!(
            "max_tokens too large for the KV budget: this request may need {:.1} MiB of KV cache ({positions} positions: {prompt} prompt \
             tokens + up to {} generated, {:.1} KiB each), more than the server's KV budget of {:.1} MiB \
             (--kv-budget-mb); lower max_tokens or shorten the prompt",
            need as f64 / 1048576.0,
            positions - prompt,
            per_token as f64 / 1024.0,
            budget as f64 / 1048576.0
        )));
    }
    if need > free {
        return Ok(None);
    }
    // Compile the constraint before answering "started": a bad schema or grammar is a 400.
    let reasoning = sub
        .reasoning
        .and_then(|r| r.control(&prompt_tail, sub.grammar.is_some()));
    let constraint = match compiled.take() {
        Some(grammar) => engine.constrain(Some(grammar), reasoning.as_ref())?,
        None => engine.compile_output_control(&OutputControl {
            grammar: sub.grammar.clone(),
            reasoning,
        })?,
    };
    let seq = engine.start_sequence(&req, constraint)?;
    if events
        .send(Event::Started {
            prompt_tokens: req.prompt_tokens.len(),
            cached_tokens: seq.cached_prompt_tokens(),
            prompt_tail,
        })
        .is_err()
    {
        return Err(RequestError::Internal("client went away".to_string()));
    }
    Ok(Some((seq, need)))
}

/// A job's prompt as tokens, with the end of its rendered text (chat prompts; empty otherwise).
fn prompt_tokens(engine: &Engine, prompt: &Prompt) -> Result<(Vec<u32>, String), RequestError> {
    Ok(match prompt {
        Prompt::Chat(p) => chat_prompt::render_tokens(engine, p)?,
        Prompt::Text { text, parse_special } => (engine.tokenize_prompt_text(text, *parse_special)?, String::new()),
        Prompt::Tokens(ids) => (ids.clone(), String::new()),
    })
}

/// The drafter family of a decode path, for metric labels: `ar` (plain decoding, also when
/// speculation was asked for but could not be used), `ngram`, `draft-model`, `mtp`, ..., with
/// `+ngram` when n-gram lookup ran beside the model drafter (`draft-model+ngram`, `mtp+ngram`).
pub(crate) fn decode_path_label(path: &str) -> String {
    let head = path.split([' ', ':']).next().unwrap_or("");
    match head {
        "" => "ar".to_string(),
        _ if path.ends_with("+ngram") && !head.ends_with("+ngram") => format!("{head}+ngram"),
        _ => head.to_string(),
    }
}

/// Metrics and the per-request log line.
fn record_done(metrics: &Metrics, endpoint: &str, out: &GenerateOutput) {
    let s = &out.stats;
    let sp = &s.spec;
    metrics.prompt_tokens.inc_by(s.prompt_tokens as u64);
    metrics.completion_tokens.inc_by(s.completion_tokens as u64);
    metrics.generation_seconds.observe(s.prefill_s + s.decode_s);
    metrics.prefill_seconds.observe(s.prefill_s);
    metrics.finished.with_label_values(&[out.finish_reason.as_str()]).inc();
    let path = decode_path_label(&sp.decode_path);
    metrics.spec_requests.with_label_values(&[path.as_str()]).inc();
    if path != "ar" {
        metrics.spec_drafted.inc_by(sp.drafted as u64);
        metrics.spec_accepted.inc_by(sp.accepted as u64);
        metrics.spec_trimmed.inc_by(sp.trimmed as u64);
        metrics.spec_target_steps.inc_by(sp.target_steps as u64);
        metrics.spec_committed.inc_by(sp.committed as u64);
    }
    let rate = |n: usize, secs: f64| if secs > 0.0 { n as f64 / secs } else { 0.0 };
    tracing::info!(
        endpoint,
        prompt_tokens = s.prompt_tokens,
        completion_tokens = s.completion_tokens,
        finish_reason = out.finish_reason.as_str(),
        prefill_tok_s = format_args!("{:.1}", rate(s.prompt_tokens, s.prefill_s)),
        decode_tok_s = format_args!("{:.1}", rate(s.completion_tokens, s.decode_s)),
        decode_path = %sp.decode_path,
        drafted = sp.drafted,
        accepted = sp.accepted,
        tau = format_args!("{:.2}", sp.tau()),
        "request finished in {:.3}s",
        s.prefill_s + s.decode_s
    );
}

#[cfg(test)]
mod tests {
    use super::{decode_path_label, ReasoningLimits};

    /// A prompt that opens `<think>` starts the control inside the reasoning; one that closed an
    /// empty block (thinking turned off) gets no control; a thinking model's plain prompt gets
    /// one that may open the block; nothing bounded is no control.
    #[test]
    fn reasoning_control_follows_the_prompt_tail() {
        let limits = ReasoningLimits {
            max_tokens: Some(8),
            prelude_chars: 64,
            thinking: true,
        };
        let opened = limits
            .control("<|im_start|>assistant\n<think>\n", false)
            .expect("control");
        assert!(opened.starts_open);
        assert_eq!(opened.max_tokens, Some(8));
        assert_eq!(opened.max_chars, None);
        assert_eq!(
            limits.control("<|im_start|>assistant\n<think>\n\n</think>\n\n", true),
            None
        );
        let may_open = limits.control("<|im_start|>assistant\n", true).expect("control");
        assert!(!may_open.starts_open);
        assert_eq!(may_open.max_chars, Some(64));
        let unbounded = ReasoningLimits {
            max_tokens: None,
            ..limits
        };
        assert_eq!(unbounded.control("<|im_start|>assistant\n", false), None);
        let not_thinking = ReasoningLimits {
            thinking: false,
            ..limits
        };
        assert_eq!(not_thinking.control("<|im_start|>assistant\n", true), None);
    }

    #[test]
    fn decode_path_labels() {
        assert_eq!(decode_path_label("ar"), "ar");
        assert_eq!(
            decode_path_label("ar (this model's kernels are not batch-invariant)"),
            "ar"
        );
        assert_eq!(decode_path_label("ngram"), "ngram");
        assert_eq!(decode_path_label("draft-model:smollm2"), "draft-model");
        assert_eq!(decode_path_label("draft-model:smollm2+ngram"), "draft-model+ngram");
        assert_eq!(decode_path_label("mtp+ngram"), "mtp+ngram");
        assert_eq!(decode_path_label(""), "ar");
    }
}
