//! Prometheus metrics, one registry per [`crate::EngineHandle`].

use prometheus::{Encoder, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, Opts, Registry, TextEncoder};

/// The server's metrics.
#[derive(Clone)]
pub struct Metrics {
    registry: Registry,
    /// HTTP requests by endpoint (route pattern) and status code.
    pub requests: IntCounterVec,
    /// Prompt tokens prefilled.
    pub prompt_tokens: IntCounter,
    /// Completion tokens generated.
    pub completion_tokens: IntCounter,
    /// Requests admitted and waiting for the engine.
    pub queue_depth: IntGauge,
    /// Requests the engine is working on (up to the batch size).
    pub running: IntGauge,
    /// Generations finished, by finish reason.
    pub finished: IntCounterVec,
    /// Seconds per generation (prefill + decode).
    pub generation_seconds: Histogram,
    /// Seconds of prefill per generation.
    pub prefill_seconds: Histogram,
    /// Seconds a request waited in the queue before the engine took it.
    pub queue_seconds: Histogram,
    /// Requests in each batched target step (continuous batching).
    pub batch_sequences: Histogram,
    /// Finished generations by decode path (`ar`, `ngram`, `draft-model`).
    pub spec_requests: IntCounterVec,
    /// Draft tokens proposed (speculative requests).
    pub spec_drafted: IntCounter,
    /// Draft tokens accepted by the target (speculative requests).
    pub spec_accepted: IntCounter,
    /// Draft tokens proposed but trimmed before verification by the batch draft budget (not
    /// counted in `spec_drafted`).
    pub spec_trimmed: IntCounter,
    /// Target forward passes after prefill in speculative requests.
    pub spec_target_steps: IntCounter,
    /// Tokens committed by those target steps (tau = committed / target steps).
    pub spec_committed: IntCounter,
    /// Model loads by kind (`target`, `draft`): the target's load before serving counts once,
    /// plus every draft model loaded at startup or by `POST /v1/models/{id}/speculative`.
    pub model_loads: IntCounterVec,
    /// Model unloads by kind (`draft`).
    pub model_unloads: IntCounterVec,
    /// Requests whose prompt reused cached KV rows (prefix cache on).
    pub prefix_cache_hits: IntCounter,
    /// Requests that reused nothing (prefix cache on).
    pub prefix_cache_misses: IntCounter,
    /// Prompt tokens served from the prefix cache.
    pub prefix_cache_hit_tokens: IntCounter,
    /// Bytes the prefix cache holds.
    pub prefix_cache_bytes: IntGauge,
    /// Bytes of KV cache held by running requests (0 when idle: nothing leaks).
    pub kv_bytes: IntGauge,
    /// KV blocks of the target's pool held by sequences (0 when idle: nothing leaked).
    pub kv_pool_blocks_in_use: IntGauge,
    /// Bytes of KV blocks the target's pool has created (resident: blocks are recycled).
    pub kv_pool_bytes: IntGauge,
    /// With `--device cuda:N`: KV slots on the device, and those held by running requests.
    pub device_slots: IntGauge,
    pub device_slots_in_use: IntGauge,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

const SECONDS_BUCKETS: &[f64] = &[
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
];

impl Metrics {
    pub fn new() -> Self {
        let registry = Registry::new();
        let requests = IntCounterVec::new(
            Opts::new("specula_requests_total", "HTTP requests by endpoint and status code."),
            &["endpoint", "status"],
        )
        .expect("valid metric");
        let prompt_tokens =
            IntCounter::new("specula_prompt_tokens_total", "Prompt tokens prefilled.").expect("valid metric");
        let completion_tokens =
            IntCounter::new("specula_completion_tokens_total", "Completion tokens generated.").expect("valid metric");
        let queue_depth =
            IntGauge::new("specula_queue_depth", "Requests waiting for the engine.").expect("valid metric");
        let running =
            IntGauge::new("specula_requests_running", "Requests the engine is working on.").expect("valid metric");
        let finished = IntCounterVec::new(
            Opts::new("specula_generations_total", "Finished generations by finish reason."),
            &["finish_reason"],
        )
        .expect("valid metric");
        let hist = |name: &str, help: &str| {
            Histogram::with_opts(HistogramOpts::new(name, help).buckets(SECONDS_BUCKETS.to_vec()))
                .expect("valid metric")
        };
        let generation_seconds = hist(
            "specula_generation_seconds",
            "Seconds per generation (prefill + decode).",
        );
        let prefill_seconds = hist("specula_prefill_seconds", "Seconds of prefill per generation.");
        let queue_seconds = hist("specula_queue_seconds", "Seconds a request waited for the engine.");
        let batch_sequences = Histogram::with_opts(
            HistogramOpts::new(
                "specula_batch_sequences",
                "Requests decoded together in one target step (continuous batching).",
            )
            .buckets(vec![1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0]),
        )
        .expect("valid metric");
        let spec_requests = IntCounterVec::new(
            Opts::new(
                "specula_spec_requests_total",
                "Finished generations by decode path (ar, ngram, draft-model).",
            ),
            &["decode_path"],
        )
        .expect("valid metric");
        let counter = |name: &str, help: &str| IntCounter::new(name, help).expect("valid metric");
        let spec_drafted = counter(
            "specula_spec_draft_tokens_total",
            "Draft tokens proposed in speculative requests.",
        );
        let spec_accepted = counter(
            "specula_spec_accepted_tokens_total",
            "Draft tokens accepted in speculative requests (acceptance rate = accepted / draft).",
        );
        let spec_trimmed = counter(
            "specula_spec_trimmed_tokens_total",
            "Draft tokens trimmed before verification by the batch draft budget (continuous batching under load).",
        );
        let spec_target_steps = counter(
            "specula_spec_target_steps_total",
            "Target decode steps (forward passes after prefill) in speculative requests.",
        );
        let spec_committed = counter(
            "specula_spec_committed_tokens_total",
            "Tokens committed by target decode steps in speculative requests (tau = committed / target steps).",
        );
        let model_loads = IntCounterVec::new(
            Opts::new("specula_model_loads_total", "Model loads by kind (target, draft)."),
            &["kind"],
        )
        .expect("valid metric");
        let model_unloads = IntCounterVec::new(
            Opts::new("specula_model_unloads_total", "Model unloads by kind (draft)."),
            &["kind"],
        )
        .expect("valid metric");
        let prefix_cache_hits = IntCounter::new(
            "specula_prefix_cache_hits_total",
            "Requests whose prompt reused cached KV rows.",
        )
        .expect("valid metric");
        let prefix_cache_misses = IntCounter::new(
            "specula_prefix_cache_misses_total",
            "Requests that reused no cached KV rows (prefix cache on).",
        )
        .expect("valid metric");
        let prefix_cache_hit_tokens = IntCounter::new(
            "specula_prefix_cache_hit_tokens_total",
            "Prompt tokens served from the prefix cache.",
        )
        .expect("valid metric");
        let prefix_cache_bytes =
            IntGauge::new("specula_prefix_cache_bytes", "Bytes of KV rows the prefix cache holds.")
                .expect("valid metric");
        let kv_bytes = IntGauge::new(
            "specula_kv_bytes",
            "Bytes of KV cache held by running requests (0 when idle).",
        )
        .expect("valid metric");
        let kv_pool_blocks_in_use = IntGauge::new(
            "specula_kv_pool_blocks_in_use",
            "KV blocks of the target model's pool held by sequences (running requests and the current step).",
        )
        .expect("valid metric");
        let kv_pool_bytes = IntGauge::new(
            "specula_kv_pool_bytes",
            "Bytes of KV blocks the target model's pool has created (in use plus free for reuse).",
        )
        .expect("valid metric");
        let device_slots = IntGauge::new(
            "specula_device_slots",
            "KV slots of the device the target runs on (0 on the CPU): the most requests that run at once.",
        )
        .expect("valid metric");
        let device_slots_in_use = IntGauge::new(
            "specula_device_slots_in_use",
            "Device KV slots held by running requests.",
        )
        .expect("valid metric");
        for c in [
            Box::new(requests.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(device_slots.clone()),
            Box::new(device_slots_in_use.clone()),
            Box::new(kv_bytes.clone()),
            Box::new(kv_pool_blocks_in_use.clone()),
            Box::new(kv_pool_bytes.clone()),
            Box::new(prefix_cache_hits.clone()),
            Box::new(prefix_cache_misses.clone()),
            Box::new(prefix_cache_hit_tokens.clone()),
            Box::new(prefix_cache_bytes.clone()),
            Box::new(prompt_tokens.clone()),
            Box::new(completion_tokens.clone()),
            Box::new(queue_depth.clone()),
            Box::new(running.clone()),
            Box::new(finished.clone()),
            Box::new(generation_seconds.clone()),
            Box::new(prefill_seconds.clone()),
            Box::new(queue_seconds.clone()),
            Box::new(batch_sequences.clone()),
            Box::new(spec_requests.clone()),
            Box::new(spec_drafted.clone()),
            Box::new(spec_accepted.clone()),
            Box::new(spec_trimmed.clone()),
            Box::new(spec_target_steps.clone()),
            Box::new(spec_committed.clone()),
            Box::new(model_loads.clone()),
            Box::new(model_unloads.clone()),
        ] {
            registry.register(c).expect("metric names are unique");
        }
        Self {
            registry,
            requests,
            prompt_tokens,
            completion_tokens,
            queue_depth,
            running,
            finished,
            generation_seconds,
            prefill_seconds,
            queue_seconds,
            batch_sequences,
            spec_requests,
            spec_drafted,
            spec_accepted,
            spec_trimmed,
            spec_target_steps,
            spec_committed,
            model_loads,
            model_unloads,
            prefix_cache_hits,
            prefix_cache_misses,
            prefix_cache_hit_tokens,
            prefix_cache_bytes,
            kv_bytes,
            kv_pool_blocks_in_use,
            kv_pool_bytes,
            device_slots,
            device_slots_in_use,
        }
    }

    /// The Prometheus text exposition of every metric.
    pub fn render(&self) -> String {
        let mut buf = Vec::new();
        if let Err(e) = TextEncoder::new().encode(&self.registry.gather(), &mut buf) {
            tracing::warn!("encoding metrics: {e}");
        }
        String::from_utf8(buf).unwrap_or_default()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}
