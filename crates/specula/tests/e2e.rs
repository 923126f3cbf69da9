//! End-to-end tests of the `specula` binary against the real, cached SmolLM2 model: the library,
//! the CLI and the HTTP server must produce byte-identical greedy output; the official OpenAI and
//! Anthropic Python clients must work against the server; CLI errors must be helpful; `bench`
//! must run.
//!
//! The models are expected in the cache (`specula pull NAME`); a missing model fails the test
//! with that command rather than skipping it.

mod support;

use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use specula_engine::catalog;
use specula_engine::{ChatMessage, Engine, GenerateRequest, SamplingParams};
use support::{library_engine, require_model, run, specula, FixturePrompt, Server, MODEL};

const CLI_TIMEOUT: Duration = Duration::from_secs(120);

/// One greedy generation, as seen through one interface.
#[derive(Debug, Clone, PartialEq)]
struct Gen {
    text: String,
    token_ids: Option<Vec<u32>>,
    prompt_tokens: u64,
    completion_tokens: u64,
    finish_reason: String,
}

fn library_generate(engine: &mut Engine, prompt_tokens: Vec<u32>, max_tokens: usize) -> Gen {
    let req = GenerateRequest {
        prompt_tokens,
        sampling: SamplingParams::greedy(),
        max_tokens: Some(max_tokens),
        stop: vec![],
        logprobs: None,
        ignore_eos: false,
        spec: Default::default(),
    };
    let out = engine.generate(&req, &mut |_| true).expect("library generate");
    Gen {
        text: out.text,
        token_ids: Some(out.token_ids),
        prompt_tokens: out.stats.prompt_tokens as u64,
        completion_tokens: out.stats.completion_tokens as u64,
        finish_reason: out.finish_reason.as_str().to_string(),
    }
}

fn library_chat(engine: &mut Engine, messages: &[ChatMessage], max_tokens: usize) -> Gen {
    let tokens = engine.chat_prompt_tokens(messages).expect("chat_prompt_tokens");
    library_generate(engine, tokens, max_tokens)
}

fn messages_json(messages: &[ChatMessage]) -> Value {
    Value::Array(
        messages
            .iter()
            .map(|m| json!({"role": m.role, "content": m.content}))
            .collect(),
    )
}

fn u64_at(v: &Value, ptr: &str) -> u64 {
    v.pointer(ptr)
        .and_then(Value::as_u64)
        .unwrap_or_else(|| panic!("no integer at {ptr} in {v}"))
}

fn str_at<'a>(v: &'a Value, ptr: &str) -> &'a str {
    v.pointer(ptr)
        .and_then(Value::as_str)
        .unwrap_or_else(|| panic!("no string at {ptr} in {v}"))
}

/// The first fixture prompt of each of three kinds (prose, qa, code).
fn three_prompts() -> Vec<FixturePrompt> {
    let all = support::fixture_prompts();
    let picked: Vec<FixturePrompt> = ["prose", "qa", "code"]
        .iter()
        .map(|kind| {
            all.iter()
                .find(|p| p.kind == *kind)
                .cloned()
                .unwrap_or_else(|| panic!("no '{kind}' prompt in the fixtures"))
        })
        .collect();
    for p in &picked {
        assert!(
            p.messages.len() == 1 && p.messages[0].role == "user",
            "prompt {} must be one user message (the CLI's --chat sends exactly that)",
            p.id
        );
    }
    picked
}

fn assert_same(what: &str, id: &str, got: &Gen, want: &Gen) {
    assert_eq!(
        got.text.as_bytes(),
        want.text.as_bytes(),
        "prompt {id}: {what} text differs from the library's\n{what}: {:?}\nlibrary: {:?}",
        got.text,
        want.text
    );
    assert_eq!(
        got.prompt_tokens, want.prompt_tokens,
        "prompt {id}: {what} prompt_tokens"
    );
    assert_eq!(
        got.completion_tokens, want.completion_tokens,
        "prompt {id}: {what} completion_tokens"
    );
    assert_eq!(
        got.finish_reason, want.finish_reason,
        "prompt {id}: {what} finish_reason"
    );
    if let (Some(a), Some(b)) = (&got.token_ids, &want.token_ids) {
        assert_eq!(a, b, "prompt {id}: {what} token ids");
    }
}

#[test]
fn greedy_same_bytes_everywhere() {
    const MAX_TOKENS: usize = 48;
    let t0 = Instant::now();
    require_model(MODEL);
    let prompts = three_prompts();
    // Start the server first so it loads while the library and the CLI run.
    let mut server = Server::spawn(MODEL);

    // (a) the library
    let lib: Vec<Gen> = {
        let mut engine = library_engine();
        prompts
            .iter()
            .map(|p| library_chat(&mut engine, &p.messages, MAX_TOKENS))
            .collect()
    };
    for (p, g) in prompts.iter().zip(&lib) {
        assert!(
            !g.text.is_empty() && g.completion_tokens > 0,
            "prompt {}: empty library output {g:?}",
            p.id
        );
        assert!(g.completion_tokens <= MAX_TOKENS as u64, "prompt {}: {g:?}", p.id);
    }
    let t_lib = t0.elapsed();

    // (b) the CLI
    for (p, want) in prompts.iter().zip(&lib) {
        let out = run(
            specula().args([
                "generate",
                "--model",
                MODEL,
                "--chat",
                "--prompt",
                &p.messages[0].content,
                "--max-tokens",
                &MAX_TOKENS.to_string(),
                "--temperature",
                "0",
                "--json",
            ]),
            CLI_TIMEOUT,
        );
        assert!(
            out.status.success(),
            "specula generate failed for {}:\n{}",
            p.id,
            out.describe()
        );
        let v: Value = serde_json::from_str(out.stdout.trim())
            .unwrap_or_else(|e| panic!("generate --json printed no JSON ({e}):\n{}", out.describe()));
        let token_ids = v["token_ids"]
            .as_array()
            .unwrap_or_else(|| panic!("no token_ids in {v}"))
            .iter()
            .map(|t| t.as_u64().expect("token id") as u32)
            .collect();
        let got = Gen {
            text: str_at(&v, "/text").to_string(),
            token_ids: Some(token_ids),
            prompt_tokens: u64_at(&v, "/usage/prompt_tokens"),
            completion_tokens: u64_at(&v, "/usage/completion_tokens"),
            finish_reason: str_at(&v, "/finish_reason").to_string(),
        };
        assert_same("CLI", &p.id, &got, want);
    }
    let t_cli = t0.elapsed();

    // (c) the server
    server.wait_ready();
    for (p, want) in prompts.iter().zip(&lib) {
        let body = json!({
            "model": MODEL,
            "messages": messages_json(&p.messages),
            "temperature": 0,
            "max_tokens": MAX_TOKENS,
        });
        let resp = server.post("/v1/chat/completions", &body);
        assert_eq!(resp.status, 200, "prompt {}: {}", p.id, resp.body);
        let v = resp.json();
        assert_eq!(str_at(&v, "/object"), "chat.completion", "{v}");
        assert_eq!(str_at(&v, "/model"), MODEL, "{v}");
        assert_eq!(str_at(&v, "/choices/0/message/role"), "assistant", "{v}");
        let got = Gen {
            text: str_at(&v, "/choices/0/message/content").to_string(),
            token_ids: None,
            prompt_tokens: u64_at(&v, "/usage/prompt_tokens"),
            completion_tokens: u64_at(&v, "/usage/completion_tokens"),
            finish_reason: str_at(&v, "/choices/0/finish_reason").to_string(),
        };
        assert_eq!(
            u64_at(&v, "/usage/total_tokens"),
            got.prompt_tokens + got.completion_tokens,
            "{v}"
        );
        assert_same("server", &p.id, &got, want);
    }
    drop(server);
    eprintln!(
        "greedy_same_bytes_everywhere: library {:.1}s, CLI {:.1}s, server {:.1}s (cumulative)",
        t_lib.as_secs_f64(),
        t_cli.as_secs_f64(),
        t0.elapsed().as_secs_f64()
    );
}

#[test]
fn openai_python_client() {
    const CHAT_MAX_TOKENS: usize = 32;
    const COMPLETION_MAX_TOKENS: usize = 16;
    const COMPLETION_PROMPT: &str = "The three primary colours are";
    let t0 = Instant::now();
    require_model(MODEL);
    let mut server = Server::spawn(MODEL);

    // Expected numbers (and texts) from the library, with the same greedy parameters.
    let chat_prompt = support::fixture_prompts()
        .into_iter()
        .find(|p| p.kind == "qa")
        .expect("a 'qa' prompt in the fixtures");
    let (chat, completion, batch_invariant) = {
        let mut engine = library_engine();
        let chat = library_chat(&mut engine, &chat_prompt.messages, CHAT_MAX_TOKENS);
        let tokens = engine.tokenize(COMPLETION_PROMPT).expect("tokenize");
        let completion = library_generate(&mut engine, tokens, COMPLETION_MAX_TOKENS);
        (chat, completion, engine.model().batch_invariant())
    };
    // `spec: "ngram"` speculates where that is exact (batch-invariant kernels), else decodes AR
    // and says why; the output is the plain output either way.
    let spec_decode_path = if batch_invariant { "ngram" } else { "ar" };
    // A request without `spec` runs the server's default, `--spec default`: the MTP head the
    // default model ships with, n-gram lookup beside it.
    let plain_decode_path = if batch_invariant { "mtp+ngram" } else { "ar" };
    let expect = json!({
        "model": MODEL,
        "chat": {
            "messages": messages_json(&chat_prompt.messages),
            "max_tokens": CHAT_MAX_TOKENS,
            "text": chat.text,
            "finish_reason": chat.finish_reason,
            "prompt_tokens": chat.prompt_tokens,
            "completion_tokens": chat.completion_tokens,
        },
        "completion": {
            "prompt": COMPLETION_PROMPT,
            "max_tokens": COMPLETION_MAX_TOKENS,
            "text": completion.text,
            "finish_reason": completion.finish_reason,
            "prompt_tokens": completion.prompt_tokens,
            "completion_tokens": completion.completion_tokens,
        },
        "spec": {"mode": "ngram", "decode_path": spec_decode_path, "plain_decode_path": plain_decode_path},
    });

    server.wait_ready();
    run_openai_client(&server, &expect, &[], 5);
    drop(server);
    eprintln!("openai_python_client: {:.1}s", t0.elapsed().as_secs_f64());
}

/// Run `tests/openai_client.py` against `server` with `expect` (and `args`); it must pass with
/// at least `min_oks` "OK" lines.
fn run_openai_client(server: &Server, expect: &Value, args: &[&str], min_oks: usize) {
    run_python_client("openai", &server.base_url(), server, expect, args, min_oks);
}

/// Run `tests/{package}_client.py --base-url BASE_URL --expect FILE ARGS...` against `server`; it
/// must pass with at least `min_oks` "OK" lines. A missing Python package (the script exits 2)
/// fails the test, saying what to install.
fn run_python_client(package: &str, base_url: &str, server: &Server, expect: &Value, args: &[&str], min_oks: usize) {
    let expect_file = tempfile::Builder::new().suffix(".json").tempfile().expect("temp file");
    std::fs::write(expect_file.path(), serde_json::to_vec_pretty(expect).expect("json")).expect("write expect file");
    let script = support::repo_root().join(format!("tests/{package}_client.py"));
    let mut cmd = Command::new("python3");
    cmd.arg(&script)
        .arg("--base-url")
        .arg(base_url)
        .arg("--expect")
        .arg(expect_file.path())
        .args(args);
    // Talk to 127.0.0.1 directly, whatever proxy the environment configures.
    for var in [
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "ALL_PROXY",
        "http_proxy",
        "https_proxy",
        "all_proxy",
    ] {
        cmd.env_remove(var);
    }
    cmd.env("NO_PROXY", "127.0.0.1,localhost")
        .env("no_proxy", "127.0.0.1,localhost");
    let out = run(&mut cmd, CLI_TIMEOUT);
    if out.status.code() == Some(2) && out.stderr.contains(&format!("pip install {package}")) {
        panic!(
            "the Python `{package}` package is not installed: run `pip install {package}`\n{}",
            out.describe()
        );
    }
    assert!(
        out.status.success(),
        "tests/{package}_client.py failed:\n{}\n--- server log ---\n{}",
        out.describe(),
        server.log()
    );
    let oks = out.stdout.lines().filter(|l| l.starts_with("OK")).count();
    assert!(oks >= min_oks, "expected OK lines from the script:\n{}", out.describe());
    eprint!("{}", out.stdout);
}

/// The official Anthropic Python client against `/v1/messages` of `specula serve` on the default
/// model, started with an API key (which the client sends as `x-api-key`): the greedy text, stop
/// reason and usage of the chat request the OpenAI test makes (same messages, same max_tokens),
/// plain, streamed and with `spec: "ngram"`; a stop sequence; `count_tokens`; the errors the
/// client raises (unknown model, `max_tokens` 0, a wrong key); a tool call forced with
/// `tool_choice` (SmolLM2's template shows no tools; the server's grammar makes the call), streamed
/// too, and its round trip with a `tool_result`.
#[test]
fn anthropic_python_client() {
    const CHAT_MAX_TOKENS: usize = 32;
    const KEY: &str = "specula-e2e-anthropic-key";
    let t0 = Instant::now();
    require_model(MODEL);
    let mut server = Server::spawn_with(MODEL, &["--api-key", KEY], &[]);
    let chat_prompt = support::fixture_prompts()
        .into_iter()
        .find(|p| p.kind == "qa")
        .expect("a 'qa' prompt in the fixtures");
    let (chat, batch_invariant) = {
        let mut engine = library_engine();
        let chat = library_chat(&mut engine, &chat_prompt.messages, CHAT_MAX_TOKENS);
        (chat, engine.model().batch_invariant())
    };
    let spec_decode_path = if batch_invariant { "ngram" } else { "ar" };
    let expect = json!({
        "model": MODEL,
        "chat": {
            "messages": messages_json(&chat_prompt.messages),
            "max_tokens": CHAT_MAX_TOKENS,
            "text": chat.text,
            "finish_reason": chat.finish_reason,
            "prompt_tokens": chat.prompt_tokens,
            "completion_tokens": chat.completion_tokens,
        },
        "spec": {"mode": "ngram", "decode_path": spec_decode_path},
        "tools": {
            "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
            "tools": [{"name": "get_weather", "description": "Get the current weather for a city",
                "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                                 "required": ["city"], "additionalProperties": false}}],
            "name": "get_weather",
            "input": {"city": "Paris"},
            "result": "Sunny, 22 C",
            "max_tokens": 64,
        },
    });
    server.wait_ready();
    // The client's base URL is the server's root: it adds /v1/messages itself.
    let root = server.base_url().trim_end_matches("/v1").to_string();
    run_python_client(
        "anthropic",
        &root,
        &server,
        &expect,
        &["--api-key", KEY, "--api-key-required"],
        11,
    );
    drop(server);
    eprintln!("anthropic_python_client: {:.1}s", t0.elapsed().as_secs_f64());
}

/// Tool calls through the official client, on Qwen2.5-Coder-0.5B (whose greedy answer to a tool
/// prompt is a call): a call, the same call streamed, the round trip, a call cut by max_tokens.
#[test]
fn openai_python_client_tool_calls() {
    const QWEN: &str = "qwen2.5-coder-0.5b-instruct";
    let t0 = Instant::now();
    require_model(QWEN);
    let mut server = Server::spawn(QWEN);
    let expect = json!({
        "model": QWEN,
        "tools": {
            "messages": [{"role": "user", "content": "What is 37 * 91?"}],
            "tools": [{"type": "function", "function": {"name": "calculator",
                "description": "Evaluate an arithmetic expression",
                "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                               "required": ["expression"]}}}],
            "name": "calculator",
            "arguments": {"expression": "37 * 91"},
            "result": "3367",
            "answer_contains": "3367",
            "cut_max_tokens": 12,
        },
    });
    server.wait_ready();
    run_openai_client(&server, &expect, &["--only", "tools"], 5);
    drop(server);
    eprintln!("openai_python_client_tool_calls: {:.1}s", t0.elapsed().as_secs_f64());
}

/// `reasoning_content` through the official client: a tiny random model whose chat template
/// opens `<think>` in the generation prompt (Qwen3-style); the expected split comes from the
/// library's generation and the server's splitter.
#[test]
fn openai_python_client_reasoning_content() {
    use specula_engine::testing::{write_tiny_gguf_with_template, TinySpec};
    use specula_server::reasoning::{ReasoningEvent, ReasoningSplitter};
    const THINK_TEMPLATE: &str = "{%- for message in messages %}<|im_start|>{{ message.role }}\n\
        {{ message.content }}<|im_end|>\n{% endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n\
        <think>\n{% endif %}";
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("tiny-think.gguf");
    let spec = TinySpec::new(specula_engine::model::Family::Qwen2);
    write_tiny_gguf_with_template(&path, &spec, THINK_TEMPLATE).expect("write tiny model");
    let messages = vec![ChatMessage::new("user", "the hen")];
    let max_tokens = 24;
    let text = {
        let mut engine = Engine::load(&path, "tiny-think", specula_engine::LoadOptions::default()).expect("load");
        let prompt = engine.chat_prompt_tokens(&messages).expect("prompt");
        let req = GenerateRequest {
            prompt_tokens: prompt,
            sampling: SamplingParams::greedy(),
            max_tokens: Some(max_tokens),
            stop: vec![],
            logprobs: None,
            ignore_eos: true,
            spec: Default::default(),
        };
        engine.generate(&req, &mut |_| true).expect("generate").text
    };
    let mut splitter = ReasoningSplitter::new(true);
    let mut events = Vec::new();
    splitter.feed(&text, &mut events);
    splitter.finish(&mut events);
    let (mut reasoning, mut content) = (String::new(), String::new());
    for e in events {
        match e {
            ReasoningEvent::Reasoning(t) => reasoning.push_str(&t),
            ReasoningEvent::Content(t) => content.push_str(&t),
        }
    }
    assert!(!reasoning.is_empty(), "the tiny model's output is reasoning: {text:?}");
    let mut server = Server::spawn(path.to_str().expect("utf-8 path"));
    let expect = json!({"reasoning": {"messages": messages_json(&messages), "max_tokens": max_tokens,
        "reasoning_content": reasoning, "content": content}});
    server.wait_ready();
    run_openai_client(&server, &expect, &["--only", "reasoning"], 2);
    drop(server);
}

/// The JSON Schema each `json` fixture prompt is answered under (what the prompt asks for). Free
/// text is bounded (`maxLength`, `maxItems`, enforced by the grammar): SmolLM2's greedy answers
/// can fall into a loop that a near-tie decides ("Fantasy", "Fantasy", ... in p32; "Sunny,
/// Sunny, ..." inside p34's `conditions`), and an unbounded string or array then never closes
/// before `max_tokens`.
fn json_prompt_schema(id: &str) -> Value {
    let text = json!({"type": "string", "maxLength": 40});
    let strings = json!({"type": "array", "items": text, "maxItems": 4});
    match id {
        "p32" => json!({"type": "object", "additionalProperties": false,
            "properties": {"title": text, "author": text,
                           "year": {"type": "integer"}, "genres": strings},
            "required": ["title", "author", "year", "genres"]}),
        "p34" => json!({"type": "object", "additionalProperties": false,
            "properties": {"city": text, "temperature_c": {"type": "number"},
                           "humidity_percent": {"type": "number"}, "conditions": text},
            "required": ["city", "temperature_c", "humidity_percent", "conditions"]}),
        "p36" => json!({"type": "object", "additionalProperties": false,
            "properties": {"title": text,
                           "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
                           "location": text,
                           "attendees": {"type": "array", "items": text, "minItems": 3, "maxItems": 3}},
            "required": ["title", "date", "location", "attendees"]}),
        "p38" => json!({"type": "object", "additionalProperties": false,
            "properties": {"host": text, "port": {"type": "integer"}, "tls": {"type": "boolean"},
                           "max_connections": {"type": "integer"},
                           "log_level": {"type": "string", "enum": ["debug", "info", "warning", "error"]}},
            "required": ["host", "port", "tls", "max_connections", "log_level"]}),
        other => panic!("no schema for json prompt {other}: add one"),
    }
}

/// Structured output through the official client on every `json` fixture prompt: `json_schema`
/// content validates against the schema, streamed and speculative (n-gram) output are the same
/// bytes; `json_object` gives an object.
#[test]
fn openai_python_client_json_schema() {
    let t0 = Instant::now();
    require_model(MODEL);
    let mut server = Server::spawn(MODEL);
    let cases: Vec<Value> = support::fixture_prompts()
        .into_iter()
        .filter(|p| p.kind == "json")
        .map(|p| {
            json!({"id": p.id, "messages": messages_json(&p.messages), "max_tokens": 128,
                   "schema": json_prompt_schema(&p.id)})
        })
        .collect();
    assert_eq!(cases.len(), 4, "the fixtures have four json prompts");
    let expect = json!({"model": MODEL, "json": cases});
    server.wait_ready();
    run_openai_client(&server, &expect, &["--only", "json"], 5);
    drop(server);
    eprintln!("openai_python_client_json_schema: {:.1}s", t0.elapsed().as_secs_f64());
}

#[test]
fn cli_errors() {
    let t0 = Instant::now();
    let names = catalog::names();
    assert_eq!(names.len(), 4, "catalog: {names:?}");

    // A path that does not exist is named in the error.
    let out = run(
        specula().args(["generate", "--model", "/nonexistent.gguf", "--prompt", "hi"]),
        CLI_TIMEOUT,
    );
    assert!(!out.status.success(), "{}", out.describe());
    assert!(out.stderr.contains("/nonexistent.gguf"), "{}", out.describe());
    assert!(out.stdout.trim().is_empty(), "{}", out.describe());

    // An unknown name mentions the catalog and lists its names.
    let out = run(
        specula().args(["generate", "--model", "nonexistent-name", "--prompt", "hi"]),
        CLI_TIMEOUT,
    );
    assert!(!out.status.success(), "{}", out.describe());
    assert!(out.stderr.contains("nonexistent-name"), "{}", out.describe());
    assert!(out.stderr.contains("catalog"), "{}", out.describe());
    for name in &names {
        assert!(out.stderr.contains(name), "missing {name}:\n{}", out.describe());
    }

    // `serve` of a missing file exits at once, naming it (and the server helper reports that).
    let mut server = Server::spawn("/nonexistent.gguf");
    let err = server.try_wait_ready().expect_err("serve /nonexistent.gguf must fail");
    assert!(
        err.contains("exited early") && err.contains("/nonexistent.gguf"),
        "{err}"
    );
    drop(server);

    // `serve` on a port that is taken fails before it loads the model, naming the address.
    let taken = std::net::TcpListener::bind(("127.0.0.1", 0)).expect("bind");
    let port = taken.local_addr().expect("addr").port().to_string();
    let out = run(
        specula().args(["serve", "--host", "127.0.0.1", "--port", &port, "/nonexistent.gguf"]),
        CLI_TIMEOUT,
    );
    assert!(!out.status.success(), "{}", out.describe());
    assert!(out.stderr.contains(&format!("127.0.0.1:{port}")), "{}", out.describe());
    // The address is checked first: the missing model is never reached.
    assert!(!out.stderr.contains("/nonexistent.gguf"), "{}", out.describe());
    drop(taken);
    // An IPv6 host, given in brackets as URLs write it, is named in brackets (where this machine
    // has IPv6 loopback); brackets around anything else are refused.
    if let Ok(taken) = std::net::TcpListener::bind(("::1", 0)) {
        let port = taken.local_addr().expect("addr").port().to_string();
        let out = run(
            specula().args(["serve", "--host", "[::1]", "--port", &port, "/nonexistent.gguf"]),
            CLI_TIMEOUT,
        );
        assert!(!out.status.success(), "{}", out.describe());
        assert!(
            out.stderr.contains(&format!("binding [::1]:{port}")),
            "{}",
            out.describe()
        );
    }
    let out = run(
        specula().args(["serve", "--host", "[localhost]", "/nonexistent.gguf"]),
        CLI_TIMEOUT,
    );
    assert!(!out.status.success(), "{}", out.describe());
    assert!(
        out.stderr.contains("only an IPv6 address goes in brackets"),
        "{}",
        out.describe()
    );

    // Values no run could use are refused before anything loads, naming the flag.
    for (args, says) in [
        (&["--threads", "100000", "list"][..], "--threads 100000 is too many"),
        (
            &["serve", "--served-model-name", "", "/nonexistent.gguf"][..],
            "--served-model-name",
        ),
        (&["serve", "--ctx-size", "8", "/nonexistent.gguf"][..], "--ctx-size"),
        (
            &[
                "distill",
                "--target",
                "/nonexistent.gguf",
                "--kind",
                "mtp",
                "--out",
                "/tmp/x",
                "--steps",
                "0",
            ][..],
            "--steps",
        ),
    ] {
        let out = run(specula().args(args), CLI_TIMEOUT);
        assert!(!out.status.success(), "{args:?}: {}", out.describe());
        assert!(out.stderr.contains(says), "{args:?}: {}", out.describe());
        assert!(
            !out.stderr.contains("/nonexistent.gguf"),
            "{args:?}: {}",
            out.describe()
        );
        assert!(!out.stderr.contains("panicked"), "{args:?}: {}", out.describe());
    }

    // `pull` of an unknown name lists the known names (and downloads nothing).
    let out = run(specula().args(["pull", "nope"]), CLI_TIMEOUT);
    assert!(!out.status.success(), "{}", out.describe());
    assert!(out.stderr.contains("nope"), "{}", out.describe());
    for name in &names {
        assert!(out.stderr.contains(name), "missing {name}:\n{}", out.describe());
    }

    // `list` shows the three catalog models.
    let out = run(specula().arg("list"), CLI_TIMEOUT);
    assert!(out.status.success(), "{}", out.describe());
    for name in &names {
        assert!(out.stdout.contains(name), "missing {name}:\n{}", out.describe());
    }
    for name in [
        "smollm2-135m-instruct",
        "qwen2.5-coder-0.5b-instruct",
        "qwen2.5-coder-1.5b-instruct",
    ] {
        assert!(out.stdout.contains(name), "missing {name}:\n{}", out.describe());
    }

    // `--help` lists the subcommands.
    let out = run(specula().arg("--help"), CLI_TIMEOUT);
    assert!(out.status.success(), "{}", out.describe());
    for sub in ["serve", "generate", "pull", "list", "bench"] {
        assert!(
            out.stdout.lines().any(|l| l.trim_start().starts_with(sub)),
            "--help does not list {sub}:\n{}",
            out.describe()
        );
    }
    eprintln!("cli_errors: {:.1}s", t0.elapsed().as_secs_f64());
}

#[test]
fn bench_runs() {
    let t0 = Instant::now();
    require_model(MODEL);
    let out = run(
        specula().args([
            "bench",
            "--prompt-tokens",
            "32",
            "--gen-tokens",
            "8",
            "--runs",
            "1",
            "--json",
        ]),
        CLI_TIMEOUT,
    );
    assert!(out.status.success(), "{}", out.describe());
    let v: Value = serde_json::from_str(out.stdout.trim())
        .unwrap_or_else(|e| panic!("bench --json printed no JSON ({e}):\n{}", out.describe()));
    for key in ["prefill_tok_s", "decode_tok_s"] {
        let x = v[key].as_f64().unwrap_or_else(|| panic!("no number {key} in {v}"));
        assert!(x.is_finite() && x > 0.0, "{key} = {x} in {v}");
    }
    assert_eq!(str_at(&v, "/model"), MODEL, "{v}");
    assert_eq!(u64_at(&v, "/prompt_tokens"), 32, "{v}");
    assert_eq!(u64_at(&v, "/gen_tokens"), 8, "{v}");
    assert_eq!(u64_at(&v, "/runs"), 1, "{v}");
    assert_eq!(u64_at(&v, "/threads"), support::THREADS.parse::<u64>().unwrap(), "{v}");
    eprintln!("bench_runs: {:.1}s: {v}", t0.elapsed().as_secs_f64());
}

/// A sidecar MTP head whose headers look right but which does not load (its config names a
/// layer the target lacks) is left out with a warning, and `/v1/models` says so: the bundle
/// report marks it `not_loaded` with a diagnostic, and neither the report's modes nor the
/// effective drafter claim it.
#[test]
fn a_sidecar_head_that_does_not_load_is_not_reported_as_attached() {
    let model = require_model(MODEL);
    let dir = tempfile::tempdir().expect("tempdir");
    let linked = dir.path().join(model.file_name().expect("file name"));
    std::os::unix::fs::symlink(&model, &linked).expect("symlink the model");
    let stem = linked.file_stem().expect("stem").to_string_lossy().to_string();
    let head = dir.path().join(format!("{stem}.mtp"));
    std::fs::create_dir(&head).expect("head dir");
    let shipped = support::repo_root().join("heads/smollm2-135m-instruct.mtp");
    std::fs::copy(shipped.join("model.safetensors"), head.join("model.safetensors")).expect("copy tensors");
    let mut config: Value =
        serde_json::from_str(&std::fs::read_to_string(shipped.join("config.json")).expect("config")).expect("json");
    config["target_layer_ids"] = json!([1, 15, 99]);
    std::fs::write(head.join("config.json"), config.to_string()).expect("write config");

    let mut server = Server::spawn(linked.to_str().expect("utf-8 path"));
    server.wait_ready();
    let log = server.log();
    assert!(log.contains("does not load"), "{log}");
    let resp =
        support::try_request(server.port, "GET", "/v1/models", None, Duration::from_secs(30)).expect("GET /v1/models");
    assert_eq!(resp.status, 200, "{}", resp.body);
    // Files are named, server paths are not shown (the log keeps them).
    for p in [dir.path(), model.parent().expect("cache dir")] {
        let p = p.display().to_string();
        assert!(!resp.body.contains(&p), "/v1/models shows the path {p}: {}", resp.body);
    }
    let v = resp.json();
    let m = &v["data"][0]["specula"];
    let bundle = &m["bundle"];
    assert_eq!(bundle["mtp"]["status"], "not_loaded", "{m:#}");
    assert_eq!(bundle["mtp"]["location"], format!("{stem}.mtp"), "{m:#}");
    let diags = bundle["diagnostics"].as_array().expect("diagnostics");
    assert!(
        diags.iter().any(|d| d
            .as_str()
            .is_some_and(|s| s.contains("not attached") && s.contains("layer 99"))),
        "{m:#}"
    );
    for mode in ["default", "on"] {
        assert_eq!(bundle["effective_modes"][mode]["drafter"], "ngram", "{mode}: {m:#}");
    }
    // What a request would run with `spec: on`.
    let body = json!({"model": v["data"][0]["id"], "messages": [{"role": "user", "content": "Count to five."}],
        "max_tokens": 8, "temperature": 0, "spec": {"mode": "on"}});
    let r = server.post("/v1/chat/completions", &body).json();
    assert_eq!(r["spec_stats"]["decode_path"], "ngram", "{r:#}");
}

/// `specula serve gemma-3-270m` (a base model without a chat template) answers the official
/// OpenAI Python client's completions with the library's greedy text and usage, streamed and
/// not, and refuses its chat requests with a 400 that says to use completions.
#[test]
fn gemma_base_model_serves_completions_to_the_openai_client() {
    const GEMMA: &str = "gemma-3-270m";
    const PROMPT: &str = "The three primary colours are";
    let t0 = Instant::now();
    let path = require_model(GEMMA);
    let want = {
        let mut engine = Engine::load(&path, GEMMA, Default::default()).expect("load");
        let tokens = engine.tokenize(PROMPT).expect("tokenize");
        library_generate(&mut engine, tokens, 24)
    };
    let mut server = Server::spawn(GEMMA);
    server.wait_ready();
    let script = r#"
import json, sys, openai
base, model, want = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
c = openai.OpenAI(base_url=base, api_key="unused")
r = c.completions.create(model=model, prompt=want["prompt"], max_tokens=24, temperature=0)
assert r.choices[0].text == want["text"], (r.choices[0].text, want["text"])
assert r.usage.prompt_tokens == want["prompt_tokens"], r.usage
assert r.usage.completion_tokens == want["completion_tokens"], r.usage
s = "".join(ch.choices[0].text for ch in c.completions.create(
    model=model, prompt=want["prompt"], max_tokens=24, temperature=0, stream=True) if ch.choices)
assert s == want["text"], (s, want["text"])
try:
    c.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    raise SystemExit("chat was not refused")
except openai.BadRequestError as e:
    assert "no chat template" in str(e) and "/v1/completions" in str(e), str(e)
print("OK")
"#;
    let want_json = json!({
        "prompt": PROMPT,
        "text": want.text,
        "prompt_tokens": want.prompt_tokens,
        "completion_tokens": want.completion_tokens,
    });
    let out = run(
        Command::new("python3")
            .arg("-c")
            .arg(script)
            .arg(server.base_url())
            .arg(GEMMA)
            .arg(want_json.to_string()),
        CLI_TIMEOUT,
    );
    assert!(
        out.status.success() && out.stdout.contains("OK"),
        "{}\nserver log:\n{}",
        out.describe(),
        server.log()
    );
    drop(server);
    eprintln!("gemma openai client: {:.1}s", t0.elapsed().as_secs_f64());
}
