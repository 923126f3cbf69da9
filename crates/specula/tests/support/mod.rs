//! Helpers for the end-to-end tests: locating cached models, running the `specula` binary with a
//! deadline, spawning a server (killed on drop), and a minimal HTTP/1.1 client over `TcpStream`.

#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use serde_json::Value;
use specula_engine::catalog;
use specula_engine::{ChatMessage, Engine, LoadOptions};

/// The model every test uses.
pub const MODEL: &str = catalog::DEFAULT_MODEL;

/// Threads given to spawned `specula` processes.
pub const THREADS: &str = "2";

/// The repository root (two levels above this crate).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The cached, verified file of catalog model `name`; panics with the command that fetches it
/// when it is missing (the tests never download anything themselves).
pub fn require_model(name: &str) -> PathBuf {
    let entry = catalog::lookup(name).unwrap_or_else(|| panic!("'{name}' is not a catalog model"));
    let path = specula_engine::cache::models_dir().join(entry.file_name);
    let pull = format!("run `specula pull {name}` (or `cargo run --release -p specula -- pull {name}`) first");
    let meta = std::fs::metadata(&path).unwrap_or_else(|_| {
        panic!(
            "model '{name}' is not in the cache (expected {}); {pull}",
            path.display()
        )
    });
    assert_eq!(
        meta.len(),
        entry.size_bytes,
        "model '{name}' at {} has the wrong size (incomplete?); {pull}",
        path.display()
    );
    let mut marker = path.clone().into_os_string();
    marker.push(".sha256");
    let recorded = std::fs::read_to_string(&marker).unwrap_or_default();
    assert!(
        recorded
            .split_whitespace()
            .next()
            .is_some_and(|h| h.eq_ignore_ascii_case(entry.sha256)),
        "model '{name}' at {} has no valid .sha256 marker (unverified); {pull}",
        path.display()
    );
    path
}

/// The default model loaded in this test process, shared by the tests (one generation at a time).
pub fn library_engine() -> MutexGuard<'static, Engine> {
    static ENGINE: OnceLock<Mutex<Engine>> = OnceLock::new();
    ENGINE
        .get_or_init(|| {
            let path = require_model(MODEL);
            let engine = Engine::load(&path, MODEL, LoadOptions::default())
                .unwrap_or_else(|e| panic!("loading {}: {e:#}", path.display()));
            Mutex::new(engine)
        })
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// A prompt from `tests/fixtures/prompts.jsonl`.
#[derive(Debug, Clone)]
pub struct FixturePrompt {
    pub id: String,
    pub kind: String,
    pub messages: Vec<ChatMessage>,
}

pub fn fixture_prompts() -> Vec<FixturePrompt> {
    let path = repo_root().join("tests/fixtures/prompts.jsonl");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let v: Value = serde_json::from_str(l).unwrap_or_else(|e| panic!("bad fixture line ({e}): {l}"));
            let messages = v["messages"]
                .as_array()
                .expect("fixture messages")
                .iter()
                .map(|m| {
                    ChatMessage::new(
                        m["role"].as_str().expect("role"),
                        m["content"].as_str().expect("content"),
                    )
                })
                .collect();
            FixturePrompt {
                id: v["id"].as_str().expect("id").to_string(),
                kind: v["kind"].as_str().expect("kind").to_string(),
                messages,
            }
        })
        .collect()
}

/// A `specula` command with the test environment (few threads, quiet-ish logs, no API key
/// from the caller's environment).
pub fn specula() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_specula"));
    cmd.env("SPECULA_THREADS", THREADS)
        .env_remove("SPECULA_API_KEY")
        .stdin(Stdio::null());
    cmd
}

/// What a finished process printed.
#[derive(Debug)]
pub struct Output {
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
}

impl Output {
    pub fn describe(&self) -> String {
        format!(
            "status: {}\n--- stdout ---\n{}\n--- stderr ---\n{}",
            self.status, self.stdout, self.stderr
        )
    }
}

/// Runs `cmd` to completion, killing it (and failing) after `timeout`.
pub fn run(cmd: &mut Command, timeout: Duration) -> Output {
    let what = format!("{cmd:?}");
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {what}: {e}"));
    let drain = |pipe: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            if let Some(mut p) = pipe {
                let _ = p.read_to_end(&mut buf);
            }
            String::from_utf8_lossy(&buf).into_owned()
        })
    };
    let out = drain(child.stdout.take().map(|p| Box::new(p) as Box<dyn Read + Send>));
    let err = drain(child.stderr.take().map(|p| Box::new(p) as Box<dyn Read + Send>));
    let deadline = Instant::now() + timeout;
    let status = loop {
        if let Some(status) = child.try_wait().expect("waiting for child") {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            let (stdout, stderr) = (out.join().unwrap_or_default(), err.join().unwrap_or_default());
            panic!("{what} did not finish within {timeout:?}\n--- stdout ---\n{stdout}\n--- stderr ---\n{stderr}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    Output {
        status,
        stdout: out.join().unwrap_or_default(),
        stderr: err.join().unwrap_or_default(),
    }
}

/// A port that was free a moment ago.
pub fn free_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind an ephemeral port");
    listener.local_addr().expect("local addr").port()
}

/// A running `specula serve`, killed when dropped (also when the test panics).
pub struct Server {
    child: Child,
    pub port: u16,
    model: String,
    /// More arguments and environment variables of `specula serve`.
    args: Vec<String>,
    envs: Vec<(String, String)>,
    log: tempfile::NamedTempFile,
}

/// Spawns `specula serve MODEL --port PORT ARGS...` with `envs`, stdout and stderr appended to
/// `log`.
fn spawn_serve(model: &str, port: u16, args: &[String], envs: &[(String, String)], log: &Path) -> Child {
    let open = || {
        std::fs::OpenOptions::new()
            .append(true)
            .open(log)
            .expect("server log file")
    };
    specula()
        .args(["serve", model, "--port", &port.to_string()])
        .args(args)
        .envs(envs.iter().map(|(k, v)| (k, v)))
        .stdout(open())
        .stderr(open())
        .spawn()
        .expect("spawning specula serve")
}

impl Server {
    /// Spawns `specula serve MODEL --port P` on a free port; it loads the model in the background
    /// (see [`Server::wait_ready`]).
    pub fn spawn(model: &str) -> Server {
        Self::spawn_with(model, &[], &[])
    }

    /// [`Server::spawn`] with more arguments and environment variables.
    pub fn spawn_with(model: &str, args: &[&str], envs: &[(&str, &str)]) -> Server {
        let log = tempfile::NamedTempFile::new().expect("server log file");
        let port = free_port();
        let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        let envs: Vec<(String, String)> = envs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        let child = spawn_serve(model, port, &args, &envs, log.path());
        Server {
            child,
            port,
            model: model.to_string(),
            args,
            envs,
            log,
        }
    }

    /// The `--host` the server was given (127.0.0.1 by default).
    fn host(&self) -> &str {
        let at = self.args.iter().position(|a| a == "--host");
        at.and_then(|i| self.args.get(i + 1))
            .map_or("127.0.0.1", |h| h.as_str())
    }

    /// Waits until `GET /health` answers 200 (up to 60 s); panics with the server's log otherwise.
    pub fn wait_ready(&mut self) -> &mut Self {
        if let Err(e) = self.try_wait_ready() {
            panic!("{e}");
        }
        self
    }

    /// Like [`Server::wait_ready`], but returns the failure (with the server's log) instead.
    /// If the port was taken by someone else in the meantime, retries on another one.
    pub fn try_wait_ready(&mut self) -> Result<(), String> {
        let t0 = Instant::now();
        let mut retries = 3;
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                let log = self.log();
                if retries > 0 && log.contains(&format!("binding {}:{}", self.host(), self.port)) {
                    retries -= 1;
                    eprintln!("port {} was taken; retrying on another port", self.port);
                    self.port = free_port();
                    self.child = spawn_serve(&self.model, self.port, &self.args, &self.envs, self.log.path());
                    continue;
                }
                return Err(format!("specula serve exited early ({status}):\n{log}"));
            }
            if let Ok(resp) = try_request(self.port, "GET", "/health", None, Duration::from_secs(5)) {
                if resp.status != 200 {
                    return Err(format!("GET /health answered {}: {}", resp.status, resp.body));
                }
                eprintln!(
                    "server on port {} ready after {:.1}s",
                    self.port,
                    t0.elapsed().as_secs_f64()
                );
                return Ok(());
            }
            if t0.elapsed() > Duration::from_secs(60) {
                return Err(format!(
                    "specula serve did not answer GET /health within 60 s:\n{}",
                    self.log()
                ));
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    pub fn base_url(&self) -> String {
        format!("http://127.0.0.1:{}/v1", self.port)
    }

    /// The server process's id (for reading `/proc/PID/status`).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// What the server printed so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log.path()).unwrap_or_default()
    }

    pub fn post(&self, path: &str, body: &Value) -> HttpResponse {
        try_request(self.port, "POST", path, Some(body), Duration::from_secs(120))
            .unwrap_or_else(|e| panic!("POST {path}: {e}\nserver log:\n{}", self.log()))
    }

    /// `method path` with `headers` (a `Host` among them replaces the default one).
    pub fn request(&self, method: &str, path: &str, headers: &[(&str, &str)]) -> HttpResponse {
        request_with(self.port, method, path, headers, None, Duration::from_secs(60))
            .unwrap_or_else(|e| panic!("{method} {path}: {e}\nserver log:\n{}", self.log()))
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[derive(Debug)]
pub struct HttpResponse {
    pub status: u16,
    /// Header names lowercased.
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl HttpResponse {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
    }

    pub fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("body is not JSON ({e}): {}", self.body))
    }
}

/// One HTTP/1.1 request with `Connection: close`; the body is read to EOF and decoded whether
/// it is sent with `Content-Length` or chunked.
pub fn try_request(
    port: u16,
    method: &str,
    path: &str,
    body: Option<&Value>,
    timeout: Duration,
) -> Result<HttpResponse, String> {
    request_with(port, method, path, &[], body, timeout)
}

/// [`try_request`] with more headers; a `Host` among them replaces `Host: 127.0.0.1:PORT`.
/// The request always goes to 127.0.0.1.
pub fn request_with(
    port: u16,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&Value>,
    timeout: Duration,
) -> Result<HttpResponse, String> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).map_err(|e| format!("connect: {e}"))?;
    stream.set_read_timeout(Some(timeout)).map_err(|e| e.to_string())?;
    stream.set_write_timeout(Some(timeout)).map_err(|e| e.to_string())?;
    let payload = body.map(|b| b.to_string()).unwrap_or_default();
    let mut req = format!("{method} {path} HTTP/1.1\r\nConnection: close\r\nAccept: */*\r\n");
    if !headers.iter().any(|(k, _)| k.eq_ignore_ascii_case("host")) {
        req.push_str(&format!("Host: 127.0.0.1:{port}\r\n"));
    }
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    if body.is_some() {
        req.push_str(&format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n",
            payload.len()
        ));
    }
    req.push_str("\r\n");
    req.push_str(&payload);
    stream.write_all(req.as_bytes()).map_err(|e| format!("write: {e}"))?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).map_err(|e| format!("read: {e}"))?;
    parse_response(&raw)
}

fn parse_response(raw: &[u8]) -> Result<HttpResponse, String> {
    let (head, _) = split_head(raw)?;
    std::str::from_utf8(head).map_err(|e| format!("headers are not UTF-8: {e}"))?;
    let (status, headers, body) = parse_raw_response(raw)?;
    let body = String::from_utf8(body).map_err(|e| format!("body is not UTF-8: {e}"))?;
    Ok(HttpResponse { status, headers, body })
}

/// The head (status line and headers) and the rest of a raw HTTP/1.1 response.
fn split_head(raw: &[u8]) -> Result<(&[u8], &[u8]), String> {
    let split = raw.windows(4).position(|w| w == b"\r\n\r\n").ok_or_else(|| {
        format!(
            "no end of headers in {:?}",
            String::from_utf8_lossy(&raw[..raw.len().min(500)])
        )
    })?;
    Ok((&raw[..split], &raw[split + 4..]))
}

/// A response's status, headers and body bytes.
pub type RawResponse = (u16, Vec<(String, String)>, Vec<u8>);

/// A raw HTTP/1.1 response as status, headers (names lowercased; bytes that are not UTF-8
/// replaced) and body bytes (de-chunked, cut at `content-length`).
pub fn parse_raw_response(raw: &[u8]) -> Result<RawResponse, String> {
    let (head, rest) = split_head(raw)?;
    let head = String::from_utf8_lossy(head);
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let status = status_line
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse::<u16>().ok())
        .ok_or_else(|| format!("bad status line {status_line:?}"))?;
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    let find = |name: &str| headers.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone());
    let body = if find("transfer-encoding").is_some_and(|te| te.to_ascii_lowercase().contains("chunked")) {
        dechunk(rest)?
    } else if let Some(len) = find("content-length") {
        let len: usize = len.parse().map_err(|_| format!("bad content-length {len:?}"))?;
        if rest.len() < len {
            return Err(format!("body truncated: {} of {len} bytes", rest.len()));
        }
        rest[..len].to_vec()
    } else {
        rest.to_vec()
    };
    Ok((status, headers, body))
}

fn dechunk(mut data: &[u8]) -> Result<Vec<u8>, String> {
    let mut out = Vec::new();
    loop {
        let eol = data
            .windows(2)
            .position(|w| w == b"\r\n")
            .ok_or("chunk size line not terminated")?;
        let line = std::str::from_utf8(&data[..eol]).map_err(|_| "chunk size is not UTF-8")?;
        let size_hex = line.split(';').next().unwrap_or_default().trim();
        let size = usize::from_str_radix(size_hex, 16).map_err(|_| format!("bad chunk size {line:?}"))?;
        data = &data[eol + 2..];
        if size == 0 {
            return Ok(out);
        }
        if data.len() < size + 2 {
            return Err(format!("chunk truncated: want {size} bytes, have {}", data.len()));
        }
        out.extend_from_slice(&data[..size]);
        data = &data[size + 2..];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_chunked_and_sized_bodies() {
        let r = parse_response(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello").unwrap();
        assert_eq!((r.status, r.body.as_str()), (200, "hello"));
        let r = parse_response(
            b"HTTP/1.1 404 Not Found\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nhel\r\n2;x=y\r\nlo\r\n0\r\n\r\n",
        )
        .unwrap();
        assert_eq!((r.status, r.body.as_str()), (404, "hello"));
        let r = parse_response(b"HTTP/1.1 200 OK\r\nX-A: b\r\n\r\nto eof").unwrap();
        assert_eq!((r.header("x-a"), r.body.as_str()), (Some("b"), "to eof"));
    }
}
