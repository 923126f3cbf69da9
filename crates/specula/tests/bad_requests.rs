//! The bad-request corpus (`tests/fixtures/bad_requests.jsonl`) against a live `specula serve` on
//! the default catalog model, over real TCP connections: malformed and hostile requests written
//! from the security findings (grammar chains, forced tools, control tokens, draft-model paths,
//! strict fields) and from the OWASP API Security Top 10 (mass assignment, resource consumption,
//! SSRF-shaped values, injection strings, Host headers, path traversal).
//!
//! Every response must be the expected 4xx with an OpenAI error body and the expected `code`, or a
//! correct 200; never a 5xx, a dropped connection, a panic in the log or a server path, error
//! text or backtrace in a body. The server must still answer a greedy request with the same bytes
//! afterwards, and its resident memory after two more passes must stay within 1.1x of what it was
//! after the warm-up (a few valid requests and three passes over the corpus, which fill the caches
//! that legitimately stay; see the notes on glibc's mmap threshold and the prefix cache below).
//!
//! A case (one JSON object a line): `name`, `category`, `method`, `path`, optional `headers`
//! (an object, or a list of `[name, value]` pairs to repeat a name; a `Host` among them replaces
//! the default one), the body as one of `body` (JSON), `raw` (a string sent as it is), `raw_hex`
//! (bytes, for invalid UTF-8 or a chunked body) or `gen` (a generator, [`generate`], for inputs too
//! big to keep in the repository), optional `content_type` (default `application/json` when there
//! is a body; `null` sends none), `status` (a number or a list of allowed numbers), and for a 4xx
//! optional `code` and `param` that the error must carry; `no_content_length: true` sends a body
//! framed by the case itself (`Transfer-Encoding: chunked`), and `note` is a comment.
//! `same_message: "draft_model"` groups cases whose error messages must be identical once the
//! `draft_model` they sent is taken out (the server must not tell which paths exist).
//!
//! The model is expected in the cache (`specula pull smollm2-135m-instruct`); a missing model fails
//! the test with that command, as the other end-to-end tests do.

mod support;

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use serde_json::{json, Map, Value};
use support::{repo_root, require_model, Server, MODEL};

const CORPUS: &str = "tests/fixtures/bad_requests.jsonl";
const TIMEOUT: Duration = Duration::from_secs(180);
/// Passes over the corpus that warm the server up, and passes after them; RSS after the last is
/// compared with RSS after the warm-up.
const WARMUP_PASSES: usize = 3;
const MEASURED_PASSES: usize = 2;
/// More measured passes, for a soak run: `SPECULA_BAD_REQUESTS_PASSES=20 cargo test ...`.
const PASSES_ENV: &str = "SPECULA_BAD_REQUESTS_PASSES";
const RSS_FACTOR: f64 = 1.1;

#[derive(Debug, Clone)]
struct Case {
    name: String,
    category: String,
    method: String,
    path: String,
    headers: Vec<(String, String)>,
    content_type: Option<String>,
    body: Option<Vec<u8>>,
    /// The JSON body, where there is one (given or generated).
    json: Option<Value>,
    gen: Option<Value>,
    status: Vec<u16>,
    code: Option<String>,
    param: Option<String>,
    same_message: Option<String>,
    /// Send `Content-Length` with the body (a case that frames it itself, chunked, says not to).
    content_length: bool,
}

fn load_corpus() -> Vec<Case> {
    let path = repo_root().join(CORPUS);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    let mut names = std::collections::HashSet::new();
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|line| {
            let v: Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("bad corpus line ({e}): {line}"));
            let case = parse_case(&v);
            assert!(names.insert(case.name.clone()), "duplicate case name {}", case.name);
            case
        })
        .collect()
}

fn parse_case(v: &Value) -> Case {
    let s = |k: &str| v[k].as_str().map(str::to_string);
    let name = s("name").expect("case name");
    let known = [
        "name",
        "category",
        "method",
        "path",
        "headers",
        "content_type",
        "body",
        "raw",
        "raw_hex",
        "gen",
        "status",
        "code",
        "param",
        "same_message",
        "no_content_length",
        "note",
    ];
    for k in v.as_object().expect("a case is an object").keys() {
        assert!(known.contains(&k.as_str()), "case {name}: unknown key {k:?}");
    }
    let mut path = s("path").expect("path");
    let (mut body, mut json_body) = (None, None);
    let mut headers: Vec<(String, String)> = match v.get("headers") {
        None => Vec::new(),
        Some(Value::Object(h)) => h
            .iter()
            .map(|(k, v)| (k.clone(), v.as_str().expect("header value").to_string()))
            .collect(),
        Some(Value::Array(pairs)) => pairs
            .iter()
            .map(|p| {
                let s = |i: usize| p[i].as_str().expect("a header is a [name, value] pair").to_string();
                (s(0), s(1))
            })
            .collect(),
        Some(h) => panic!("case {name}: headers {h}"),
    };
    if let Some(b) = v.get("body") {
        body = Some(b.to_string().into_bytes());
        json_body = Some(b.clone());
    } else if let Some(raw) = v.get("raw") {
        body = Some(raw.as_str().expect("raw is a string").as_bytes().to_vec());
    } else if let Some(hex) = v.get("raw_hex") {
        body = Some(from_hex(hex.as_str().expect("raw_hex is a string")));
    } else if let Some(g) = v.get("gen") {
        match generate(g) {
            Generated::Json(b) => {
                body = Some(b.to_string().into_bytes());
                json_body = Some(b);
            }
            Generated::Raw(b) => body = Some(b),
            Generated::PathSuffix(p) => path.push_str(&p),
            Generated::Header(k, v) => headers.push((k, v)),
        }
    }
    let content_type = match v.get("content_type") {
        None => body.as_ref().map(|_| "application/json".to_string()),
        Some(Value::Null) => None,
        Some(c) => Some(c.as_str().expect("content_type is a string").to_string()),
    };
    let status = match &v["status"] {
        Value::Array(a) => a.iter().map(|s| s.as_u64().expect("status") as u16).collect(),
        s => vec![s.as_u64().unwrap_or_else(|| panic!("case {name}: no status")) as u16],
    };
    Case {
        category: s("category").unwrap_or_default(),
        method: s("method").unwrap_or_else(|| "POST".to_string()),
        path,
        headers,
        content_type,
        body,
        json: json_body,
        gen: v.get("gen").cloned(),
        status,
        code: s("code"),
        param: s("param"),
        same_message: s("same_message"),
        content_length: !v["no_content_length"].as_bool().unwrap_or(false),
        name,
    }
}

fn from_hex(h: &str) -> Vec<u8> {
    assert!(h.len().is_multiple_of(2), "odd hex length");
    (0..h.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&h[i..i + 2], 16).expect("hex byte"))
        .collect()
}

enum Generated {
    Json(Value),
    Raw(Vec<u8>),
    PathSuffix(String),
    Header(String, String),
}

fn base_chat() -> Value {
    json!({"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4, "temperature": 0})
}

fn base_completion() -> Value {
    json!({"prompt": "The hen", "max_tokens": 4, "temperature": 0})
}

/// `$defs` d0 -> d1 -> ... -> d(n-1) = `last`.
fn ref_chain(n: usize, last: Value) -> Value {
    let mut defs = Map::new();
    for i in 0..n - 1 {
        defs.insert(format!("d{i}"), json!({"$ref": format!("#/$defs/d{}", i + 1)}));
    }
    defs.insert(format!("d{}", n - 1), last);
    Value::Object(defs)
}

fn nested(open: &str, inner: &str, close: &str, n: usize) -> String {
    let mut s = String::with_capacity(n * (open.len() + close.len()) + inner.len());
    for _ in 0..n {
        s.push_str(open);
    }
    s.push_str(inner);
    for _ in 0..n {
        s.push_str(close);
    }
    s
}

/// The generators named by a case's `gen: {"kind", "n", "completions"?, "extra"?, "bias"?}`:
/// the body of a chat request (a completion with `"completions": true`) carrying a big input;
/// `extra` is merged into the body's top level.
fn generate(g: &Value) -> Generated {
    let kind = g["kind"].as_str().expect("gen.kind");
    let n = g["n"].as_u64().expect("gen.n") as usize;
    let completions = g["completions"].as_bool().unwrap_or(false);
    let mut b = if completions { base_completion() } else { base_chat() };
    let text_body = |b: &mut Value, text: String| {
        if completions {
            b["prompt"] = json!(text);
        } else {
            b["messages"] = json!([{"role": "user", "content": text}]);
        }
    };
    match kind {
        "lark_chain" => {
            let mut s = String::from("start: r0\n");
            for i in 0..n - 1 {
                s.push_str(&format!("r{i}: \"x{i}\" r{}\n", i + 1));
            }
            s.push_str(&format!("r{}: \"x{}\"\n", n - 1, n - 1));
            b["response_format"] = json!({"type": "lark", "lark": s});
        }
        "lark_alternatives" => {
            let alts: Vec<String> = (0..n).map(|i| format!("\"a{i}\"")).collect();
            b["response_format"] = json!({"type": "lark", "lark": format!("start: {}\n", alts.join(" | "))});
        }
        "lark_big" => {
            b["response_format"] = json!({"type": "lark", "lark": format!("start: \"{}\"\n", "a".repeat(n))});
        }
        "schema_ref_chain" => {
            let schema = json!({"$defs": ref_chain(n, json!({"type": "integer"})), "$ref": "#/$defs/d0"});
            b["response_format"] = json!({"type": "json_schema", "json_schema": {"name": "chain", "schema": schema}});
        }
        "schema_anyof" => {
            let alts: Vec<Value> = (0..n).map(|i| json!({"const": format!("v{i}")})).collect();
            b["response_format"] =
                json!({"type": "json_schema", "json_schema": {"name": "alts", "schema": {"anyOf": alts}}});
        }
        "schema_enum" => {
            let alts: Vec<Value> = (0..n).map(|i| json!(format!("v{i}"))).collect();
            b["response_format"] =
                json!({"type": "json_schema", "json_schema": {"name": "alts", "schema": {"enum": alts}}});
        }
        "tool_ref_chain" => {
            let params = json!({
                "type": "object",
                "properties": {"a": {"$ref": "#/$defs/d0"}},
                "required": ["a"],
                "$defs": ref_chain(n, json!({"type": "integer"})),
            });
            b["tools"] = json!([{"type": "function", "function": {"name": "f", "parameters": params}}]);
            b["tool_choice"] = json!("required");
        }
        "many_tools" => {
            let tools: Vec<Value> = (0..n)
                .map(|i| {
                    json!({"type": "function", "function": {"name": format!("tool_{i}"),
                        "parameters": {"type": "object", "properties": {}}}})
                })
                .collect();
            b["tools"] = Value::Array(tools);
            b["tool_choice"] = json!("required");
        }
        "long_field_name" => b["k".repeat(n)] = json!(1),
        "many_fields" => {
            for i in 0..n {
                b[format!("field_{i}")] = json!(i);
            }
        }
        "stop_list" => b["stop"] = json!((0..n).map(|i| format!("stop{i}")).collect::<Vec<_>>()),
        "stop_long" => b["stop"] = json!(["z".repeat(n)]),
        "logit_bias_map" => {
            let bias = g.get("bias").cloned().unwrap_or(json!(0));
            let map: Map<String, Value> = (0..n).map(|i| (i.to_string(), bias.clone())).collect();
            b["logit_bias"] = Value::Object(map);
        }
        "many_messages" => b["messages"] = json!(vec![json!({"role": "user", "content": "hi"}); n]),
        "long_content" => {
            let text: String = "the thin hen ".repeat(n / 13 + 1).chars().take(n).collect();
            text_body(&mut b, text);
        }
        "prompt_ids" => b["prompt"] = json!(vec![1u32; n]),
        "nested_arrays" => {
            return Generated::Raw(
                format!("{{\"messages\": {}, \"max_tokens\": 4}}", nested("[", "", "]", n)).into_bytes(),
            )
        }
        "nested_objects" => {
            return Generated::Raw(
                format!(
                    "{{\"messages\": {}, \"max_tokens\": 4}}",
                    nested("{\"a\":", "1", "}", n)
                )
                .into_bytes(),
            )
        }
        "nested_unclosed" => return Generated::Raw(format!("{{\"messages\": {}", "[".repeat(n)).into_bytes()),
        "nested_metadata" => {
            let s = base_chat().to_string();
            let body = format!("{}, \"metadata\": {}}}", &s[..s.len() - 1], nested("[", "", "]", n));
            return Generated::Raw(body.into_bytes());
        }
        "big_body" => {
            return Generated::Raw(format!("{{\"messages\": [], \"x\": \"{}\"}}", "a".repeat(n)).into_bytes())
        }
        "long_path" => return Generated::PathSuffix("a".repeat(n)),
        "big_header" => return Generated::Header("X-Big".to_string(), "a".repeat(n)),
        other => panic!("unknown generator {other:?}"),
    }
    if let Some(extra) = g.get("extra").and_then(Value::as_object) {
        for (k, v) in extra {
            b[k] = v.clone();
        }
    }
    Generated::Json(b)
}

#[derive(Debug)]
struct Reply {
    status: u16,
    headers: Vec<(String, String)>,
    body: String,
}

impl Reply {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
    }
}

/// One request over a fresh connection (`Connection: close`), read to EOF. A write the server
/// cuts short (it answers a too-large body before reading it all) still reads the answer.
fn send(port: u16, c: &Case) -> Result<Reply, String> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).map_err(|e| format!("connect: {e}"))?;
    stream.set_read_timeout(Some(TIMEOUT)).map_err(|e| e.to_string())?;
    stream.set_write_timeout(Some(TIMEOUT)).map_err(|e| e.to_string())?;
    let mut head = format!(
        "{} {} HTTP/1.1\r\nConnection: close\r\nAccept: */*\r\n",
        c.method, c.path
    );
    if !c.headers.iter().any(|(k, _)| k.eq_ignore_ascii_case("host")) {
        head.push_str(&format!("Host: 127.0.0.1:{port}\r\n"));
    }
    for (k, v) in &c.headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    if let Some(ct) = &c.content_type {
        head.push_str(&format!("Content-Type: {ct}\r\n"));
    }
    if let Some(b) = c.body.as_ref().filter(|_| c.content_length) {
        head.push_str(&format!("Content-Length: {}\r\n", b.len()));
    }
    head.push_str("\r\n");
    let mut req = head.into_bytes();
    if let Some(b) = &c.body {
        req.extend_from_slice(b);
    }
    let write_err = stream.write_all(&req).err();
    let mut raw = Vec::new();
    let read = stream.read_to_end(&mut raw);
    if raw.is_empty() {
        return Err(format!("no response (write: {write_err:?}, read: {:?})", read.err()));
    }
    parse_reply(&raw)
}

/// The response as the corpus checks it: bytes that are not UTF-8 replaced, so a bad body is
/// reported, not a parse failure.
fn parse_reply(raw: &[u8]) -> Result<Reply, String> {
    let (status, headers, body) = support::parse_raw_response(raw)?;
    Ok(Reply {
        status,
        headers,
        body: String::from_utf8_lossy(&body).into_owned(),
    })
}

/// Text no response may contain: a panic or backtrace, a home or build path, the model cache.
fn forbidden_strings() -> Vec<String> {
    let mut v: Vec<String> = [
        "panicked",
        "backtrace",
        "RUST_BACKTRACE",
        "/root/",
        "/home/",
        ".cargo/registry",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let cache = specula_engine::cache::models_dir();
    v.push(cache.display().to_string());
    if let Some(parent) = cache.parent() {
        v.push(parent.display().to_string());
    }
    v
}

/// The error object of an OpenAI error body, checked for shape.
fn error_object(r: &Reply) -> Result<Map<String, Value>, String> {
    let v: Value = serde_json::from_str(&r.body).map_err(|e| format!("error body is not JSON ({e})"))?;
    let e = v
        .get("error")
        .and_then(Value::as_object)
        .ok_or("no \"error\" object")?
        .clone();
    if v.as_object().map_or(0, Map::len) != 1 {
        return Err("the body has more than the \"error\" key".into());
    }
    if e.get("message").and_then(Value::as_str).is_none_or(str::is_empty) {
        return Err("error.message is not a non-empty string".into());
    }
    if !e.get("type").is_some_and(Value::is_string) {
        return Err("error.type is not a string".into());
    }
    for k in ["param", "code"] {
        if !e.get(k).is_some_and(|p| p.is_string() || p.is_null()) {
            return Err(format!("error.{k} is missing or neither a string nor null"));
        }
    }
    if r.header("content-type")
        .is_none_or(|ct| !ct.starts_with("application/json"))
    {
        return Err(format!("error content-type is {:?}", r.header("content-type")));
    }
    Ok(e)
}

/// The text a 200 chat or completion carries (streamed: the deltas joined), checked for shape.
fn completion_text(c: &Case, r: &Reply) -> Result<Option<String>, String> {
    let body = c.json.as_ref();
    let chat = c.path.starts_with("/v1/chat/completions");
    let completion = c.path.starts_with("/v1/completions");
    if !(chat || completion) || c.method != "POST" {
        return Ok(None);
    }
    let stream = body.is_some_and(|b| b["stream"] == json!(true));
    let max_tokens = body
        .and_then(|b| b.get("max_completion_tokens").or(b.get("max_tokens")))
        .and_then(Value::as_u64);
    if stream {
        if r.header("content-type")
            .is_none_or(|ct| !ct.starts_with("text/event-stream"))
        {
            return Err(format!("stream content-type is {:?}", r.header("content-type")));
        }
        let events: Vec<&str> = r.body.lines().filter_map(|l| l.strip_prefix("data: ")).collect();
        if events.last() != Some(&"[DONE]") {
            return Err("the stream does not end with [DONE]".into());
        }
        let mut text = String::new();
        let want = if chat {
            "chat.completion.chunk"
        } else {
            "text_completion"
        };
        for ev in &events[..events.len() - 1] {
            let v: Value = serde_json::from_str(ev).map_err(|e| format!("event is not JSON ({e}): {ev}"))?;
            if v.get("error").is_some() {
                return Err(format!("an error event inside a 200 stream: {ev}"));
            }
            if v["object"] != want {
                return Err(format!("event object is not {want}: {ev}"));
            }
            for ch in v["choices"].as_array().into_iter().flatten() {
                let t = if chat { &ch["delta"]["content"] } else { &ch["text"] };
                text.push_str(t.as_str().unwrap_or_default());
            }
        }
        return Ok(Some(text));
    }
    let v: Value = serde_json::from_str(&r.body).map_err(|e| format!("200 body is not JSON ({e})"))?;
    let want = if chat { "chat.completion" } else { "text_completion" };
    if v["object"] != want {
        return Err(format!("object is not {want}"));
    }
    if v["model"] != MODEL {
        return Err("model is not the served one".into());
    }
    let ch = &v["choices"][0];
    if !["stop", "length", "tool_calls"].contains(&ch["finish_reason"].as_str().unwrap_or_default()) {
        return Err(format!("finish_reason {}", ch["finish_reason"]));
    }
    let u = &v["usage"];
    let (p, k, t) = (
        u["prompt_tokens"].as_u64(),
        u["completion_tokens"].as_u64(),
        u["total_tokens"].as_u64(),
    );
    match (p, k, t) {
        (Some(p), Some(k), Some(t)) if p + k == t => {
            if let Some(m) = max_tokens {
                if k > m {
                    return Err(format!("{k} completion tokens past max_tokens {m}"));
                }
            }
        }
        _ => return Err(format!("bad usage {u}")),
    }
    let text = if chat {
        let m = &ch["message"];
        if m["role"] != "assistant" {
            return Err("message.role is not assistant".into());
        }
        if !(m["content"].is_string() || m["tool_calls"].is_array()) {
            return Err("neither content nor tool_calls".into());
        }
        m["content"].as_str().unwrap_or_default().to_string()
    } else {
        ch["text"]
            .as_str()
            .ok_or("choices[0].text is not a string")?
            .to_string()
    };
    Ok(Some(text))
}

/// A grammar-constrained answer (cut at max_tokens) must be a prefix of a string the grammar
/// admits.
fn check_constrained(c: &Case, text: &str) -> Result<(), String> {
    let Some(g) = &c.gen else { return Ok(()) };
    let n = g["n"].as_u64().unwrap_or(0);
    let ok = match g["kind"].as_str().unwrap_or_default() {
        "lark_chain" => {
            let full: String = (0..n.min(64)).map(|i| format!("x{i}")).collect();
            full.starts_with(text)
        }
        "schema_ref_chain" => {
            let t = text.strip_prefix('-').unwrap_or(text);
            t.chars().all(|ch| ch.is_ascii_digit())
        }
        "lark_alternatives" => (0..n).any(|i| format!("a{i}").starts_with(text)),
        "schema_enum" | "schema_anyof" => (0..n).any(|i| format!("\"v{i}\"").starts_with(text)),
        _ => true,
    };
    if ok {
        Ok(())
    } else {
        Err(format!("the answer {text:?} is outside the requested grammar"))
    }
}

/// What went wrong with one case's reply, if anything.
fn check(c: &Case, r: &Reply, forbidden: &[String]) -> Result<Option<String>, String> {
    for f in forbidden {
        if r.body.contains(f.as_str()) {
            return Err(format!("the body contains {f:?}"));
        }
    }
    if !c.status.contains(&r.status) {
        return Err(format!("status {} (expected {:?})", r.status, c.status));
    }
    if r.status >= 400 {
        let e = error_object(r)?;
        if let Some(code) = &c.code {
            if e["code"] != json!(code) {
                return Err(format!("code {} (expected {code:?})", e["code"]));
            }
        }
        if let Some(param) = &c.param {
            if e["param"] != json!(param) {
                return Err(format!("param {} (expected {param:?})", e["param"]));
            }
        }
        return Ok(Some(e["message"].as_str().unwrap_or_default().to_string()));
    }
    if r.status == 200 {
        if let Some(text) = completion_text(c, r)? {
            check_constrained(c, &text)?;
        } else if c.method == "GET" && c.path.starts_with("/v1/models") {
            let v: Value = serde_json::from_str(&r.body).map_err(|e| format!("200 body is not JSON ({e})"))?;
            if v["object"] != "list" && v["id"] != MODEL {
                return Err("neither the model list nor the model".into());
            }
        }
    }
    Ok(None)
}

fn vm_rss_kb(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("reading /proc/PID/status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS in /proc/PID/status")
}

/// The greedy reference request: its text, finish reason and token counts.
fn reference(server: &Server) -> Value {
    let body = json!({
        "model": MODEL,
        "messages": [{"role": "system", "content": "You are brief."},
                     {"role": "user", "content": "Name three colours of hens."}],
        "max_tokens": 8,
        "temperature": 0,
    });
    let r = server.post("/v1/chat/completions", &body);
    assert_eq!(r.status, 200, "the reference request: {}", r.body);
    let v = r.json();
    json!({
        "choices": v["choices"],
        "prompt_tokens": v["usage"]["prompt_tokens"],
        "completion_tokens": v["usage"]["completion_tokens"],
    })
}

#[test]
fn bad_request_corpus_gets_4xx_or_correct_200() {
    let t0 = Instant::now();
    require_model(MODEL);
    let cases = load_corpus();
    assert!(cases.len() >= 200, "the corpus has {} cases", cases.len());
    let models_dir = tempfile::tempdir().expect("tempdir");
    std::fs::create_dir(models_dir.path().join("a-directory")).expect("mkdir");
    // glibc's malloc raises its mmap threshold (up to 32 MiB) each time a big mmapped block is
    // freed, after which the buffers of big requests (a 32 MiB body, 1 MB strings, grammars)
    // come from the heap and leave it fragmented: with the defaults RSS creeps from ~440 MB to
    // ~700 MB over a dozen passes over this corpus and would hide a real leak in that noise. A
    // fixed threshold keeps big buffers mmapped (given back when freed), and RSS then tracks
    // what the server holds (~330 MB, flat). Grammars compile on the blocking pool's threads,
    // and glibc gives each new thread an arena of its own (up to 8 per core), so RSS also steps
    // up whenever the pool grows: two arenas (`MALLOC_ARENA_MAX`) keep that out of the
    // measurement too. The KV budget is preallocated (`--kv-budget-mb`), so the KV pool does not
    // grow with how many requests happened to run at once. A one-time step of 45-50 MB still
    // shows at a random pass in some runs (not yet explained; it does not repeat, as a leak
    // would): over the ~700 MB base it stays inside the bound. The prefix cache is kept small (8 MiB, full after
    // the warm-up, evicting from then on): by default it may grow to 1 GiB with the outputs of
    // the sampled requests, which differ from pass to pass, and that growth would look like a
    // leak here.
    let mut server = Server::spawn_with(
        MODEL,
        &[
            "--models-dir",
            models_dir.path().to_str().expect("utf-8 path"),
            "--prefix-cache-mb",
            "8",
            "--kv-budget-mb",
            "400",
        ],
        &[("MALLOC_MMAP_THRESHOLD_", "131072"), ("MALLOC_ARENA_MAX", "2")],
    );
    server.wait_ready();
    let pid = server.pid();
    let forbidden = forbidden_strings();

    // Warm-up: a few valid requests, then the reference answer.
    for q in ["Hello!", "What is a hen?", "Count to three."] {
        let r = server.post(
            "/v1/chat/completions",
            &json!({"messages": [{"role": "user", "content": q}], "max_tokens": 8, "temperature": 0}),
        );
        assert_eq!(r.status, 200, "warm-up: {}", r.body);
        let r = server.post(
            "/v1/completions",
            &json!({"prompt": q, "max_tokens": 8, "temperature": 0}),
        );
        assert_eq!(r.status, 200, "warm-up: {}", r.body);
    }
    let want = reference(&server);
    let rss_valid = vm_rss_kb(pid);

    let mut failures: BTreeMap<String, String> = BTreeMap::new();
    let mut rss_after_pass = Vec::new();
    let mut pass_seconds = Vec::new();
    let mut by_category: BTreeMap<String, usize> = BTreeMap::new();
    for c in &cases {
        *by_category.entry(c.category.clone()).or_default() += 1;
    }
    let mut messages: BTreeMap<String, Vec<(String, String)>> = BTreeMap::new();
    let measured = std::env::var(PASSES_ENV)
        .ok()
        .map(|v| {
            v.parse::<usize>()
                .unwrap_or_else(|_| panic!("{PASSES_ENV}={v:?} is not a count"))
        })
        .unwrap_or(MEASURED_PASSES)
        .max(1);
    for pass in 0..WARMUP_PASSES + measured {
        let tp = Instant::now();
        for c in &cases {
            let t = Instant::now();
            let outcome = send(server.port, c).and_then(|r| {
                check(c, &r, &forbidden).map_err(|e| (e, r)).map_err(|(e, r)| {
                    let body: String = r.body.chars().take(600).collect();
                    format!("{e}\n      response: {} {body}", r.status)
                })
            });
            let secs = t.elapsed().as_secs_f64();
            if secs > 10.0 {
                eprintln!("slow case {} ({secs:.1}s)", c.name);
            }
            match outcome {
                Ok(Some(message)) if pass == 0 => {
                    if let (Some(group), Some(b)) = (&c.same_message, &c.json) {
                        let sent = b[group.as_str()].as_str().unwrap_or_default().to_string();
                        messages
                            .entry(group.clone())
                            .or_default()
                            .push((c.name.clone(), message.replace(&sent, "{}")));
                    }
                }
                Ok(_) => {}
                Err(e) => {
                    let shown: String = c.body.as_ref().map_or(String::new(), |b| {
                        String::from_utf8_lossy(&b[..b.len().min(300)]).into_owned()
                    });
                    failures.entry(c.name.clone()).or_insert_with(|| {
                        format!(
                            "[{}] pass {pass}: {} {} {shown}\n      {e}",
                            c.category,
                            c.method,
                            &c.path[..c.path.len().min(120)]
                        )
                    });
                }
            }
        }
        pass_seconds.push(tp.elapsed().as_secs_f64());
        rss_after_pass.push(vm_rss_kb(pid));
    }

    // The draft-model refusals say the same whatever path was sent.
    for (group, msgs) in &messages {
        let first = &msgs[0].1;
        for (name, m) in msgs {
            if m != first {
                failures.insert(
                    name.clone(),
                    format!("[{group}] the message differs from {}'s: {m:?} vs {first:?}", msgs[0].0),
                );
            }
        }
    }

    // Still alive, and the same greedy answer as before.
    let r = server.request("GET", "/health", &[]);
    assert_eq!(r.status, 200, "{}", r.body);
    let got = reference(&server);
    let log = server.log();
    let panics: Vec<&str> = log.lines().filter(|l| l.contains("panicked")).collect();

    // RSS after the warm-up: its highest reading (glibc gives memory back unevenly, so one
    // pass's reading can sit tens of MB below the next; a leak grows past the peak pass after
    // pass).
    let rss_warm = *rss_after_pass[..WARMUP_PASSES].iter().max().expect("warm-up passes");
    let rss_end = *rss_after_pass.last().expect("passes");
    eprintln!(
        "bad_requests: {} cases x {} passes ({:?} s each); categories {by_category:?}",
        cases.len(),
        WARMUP_PASSES + measured,
        pass_seconds
            .iter()
            .map(|s| (s * 10.0).round() / 10.0)
            .collect::<Vec<_>>()
    );
    eprintln!(
        "bad_requests: VmRSS after the valid requests {rss_valid} kB, after each pass {rss_after_pass:?} kB: \
         {rss_end} kB after the run against {rss_warm} kB after the warm-up ({:.3}x); {:.1}s in all",
        rss_end as f64 / rss_warm as f64,
        t0.elapsed().as_secs_f64()
    );
    let mut problems = Vec::new();
    if !failures.is_empty() {
        problems.push(format!(
            "{} of {} cases failed:\n  {}",
            failures.len(),
            cases.len(),
            failures
                .iter()
                .map(|(k, v)| format!("{k}: {v}"))
                .collect::<Vec<_>>()
                .join("\n  ")
        ));
    }
    if got != want {
        problems.push(format!("the reference answer changed: {want} before, {got} after"));
    }
    if rss_end as f64 > RSS_FACTOR * rss_warm as f64 {
        problems.push(format!(
            "VmRSS grew from {rss_warm} kB after the warm-up to {rss_end} kB (more than {RSS_FACTOR}x)"
        ));
    }
    if !panics.is_empty() {
        problems.push(format!("the server log shows panics:\n{}", panics.join("\n")));
    }
    assert!(problems.is_empty(), "{}", problems.join("\n\n"));
}
