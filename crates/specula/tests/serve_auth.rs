//! `specula serve`'s access controls through the binary, on a tiny random model written by the
//! test (no catalog model needed): API keys from `--api-key`, `--api-key-file` and
//! `SPECULA_API_KEY`; `/metrics` behind the key unless `--metrics-public`; the refusal to serve
//! an address beyond loopback without a key; `--no-auth`; the Host check of a loopback bind.
//! Traffic only ever goes to 127.0.0.1.

mod support;

use std::path::{Path, PathBuf};
use std::time::Duration;

use specula_engine::model::Family;
use specula_engine::testing::{write_tiny_gguf, TinySpec};
use support::{run, specula, HttpResponse, Output, Server};

const TIMEOUT: Duration = Duration::from_secs(60);
const FLAG_KEY: &str = "flag-key-0123456789abcdef";
const FILE_KEYS: [&str; 2] = ["file-key-one-0123456789", "file-key-two-0123456789"];
const ENV_KEY: &str = "env-key-0123456789abcdef";

fn tiny_model(dir: &Path) -> PathBuf {
    let path = dir.join("tiny.gguf");
    write_tiny_gguf(&path, &TinySpec::new(Family::Llama)).expect("write tiny gguf");
    path
}

fn assert_unauthorized(r: &HttpResponse) {
    assert_eq!(r.status, 401, "{}", r.body);
    let e = &r.json()["error"];
    assert_eq!(e["code"], "invalid_api_key", "{}", r.body);
    assert_eq!(e["type"], "authentication_error", "{}", r.body);
    assert_eq!(r.header("www-authenticate"), Some("Bearer"), "{:?}", r.headers);
}

/// `serve` failed before loading anything, saying `says`, without quoting any key.
fn assert_refused(out: &Output, says: &[&str]) {
    assert!(!out.status.success(), "{}", out.describe());
    for s in says {
        assert!(out.stderr.contains(s), "lacks {s:?}: {}", out.describe());
    }
    // The model is never reached.
    assert!(!out.stderr.contains("/nonexistent.gguf"), "{}", out.describe());
    for k in [FLAG_KEY, ENV_KEY, "has space"] {
        assert!(!out.stderr.contains(k), "a key is echoed: {}", out.describe());
    }
}

#[test]
fn an_address_beyond_loopback_needs_a_key_or_no_auth() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cache = dir.path().to_str().expect("utf-8 path");
    let serve = |args: &[&str], envs: &[(&str, &str)]| {
        let mut cmd = specula();
        cmd.env("SPECULA_CACHE", cache)
            .args(["serve", "--port", "0"])
            .args(args);
        cmd.envs(envs.iter().copied());
        run(cmd.arg("/nonexistent.gguf"), TIMEOUT)
    };

    // No key on 0.0.0.0 (and on a name that is not localhost): refused, naming both ways out.
    for host in ["0.0.0.0", "::", "example.invalid"] {
        let out = serve(&["--host", host], &[]);
        assert_refused(&out, &["--api-key", "--no-auth", &format!("--host {host}")]);
    }
    // --no-auth with a key, from the flag or the environment: refused.
    let out = serve(&["--host", "0.0.0.0", "--no-auth", "--api-key", FLAG_KEY], &[]);
    assert_refused(&out, &["--no-auth", "keys were given"]);
    let out = serve(&["--no-auth"], &[("SPECULA_API_KEY", ENV_KEY)]);
    assert_refused(&out, &["--no-auth", "keys were given"]);
    // A key a header cannot carry, an empty key file: refused without quoting the key.
    let out = serve(&["--api-key", "has space"], &[]);
    assert_refused(&out, &["--api-key", "visible ASCII"]);
    let empty = dir.path().join("empty.keys");
    std::fs::write(&empty, "# no keys yet\n\n").expect("write key file");
    let out = serve(&["--api-key-file", empty.to_str().expect("utf-8 path")], &[]);
    assert_refused(&out, &["--api-key-file", "holds no key"]);

    // --no-auth on 0.0.0.0 serves, open, with a warning.
    let model = tiny_model(dir.path());
    let mut server = Server::spawn_with(
        model.to_str().expect("utf-8 path"),
        &["--host", "0.0.0.0", "--no-auth"],
        &[("SPECULA_CACHE", cache)],
    );
    server.wait_ready();
    let r = server.request("GET", "/v1/models", &[]);
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["object"], "list");
    // No Host check beyond loopback.
    let r = server.request("GET", "/v1/models", &[("Host", "evil.example")]);
    assert_eq!(r.status, 200, "{}", r.body);
    let log = server.log();
    assert!(log.contains("--no-auth: serving without API keys"), "{log}");
}

#[test]
fn keys_from_flag_file_and_environment() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cache = dir.path().to_str().expect("utf-8 path");
    let model = tiny_model(dir.path());
    let model = model.to_str().expect("utf-8 path");
    let keys = dir.path().join("api.keys");
    std::fs::write(
        &keys,
        format!(
            "# clients\n\n  {}  \n# retired: old-key\n{}\n",
            FILE_KEYS[0], FILE_KEYS[1]
        ),
    )
    .expect("write key file");

    let mut server = Server::spawn_with(
        model,
        &[
            "--api-key",
            FLAG_KEY,
            "--api-key-file",
            keys.to_str().expect("utf-8 path"),
        ],
        &[("SPECULA_CACHE", cache)],
    );
    server.wait_ready();
    let port = server.port.to_string();

    // /health is open; everything else needs a key.
    let r = server.request("GET", "/health", &[]);
    assert_eq!((r.status, r.body.as_str()), (200, r#"{"status":"ok"}"#));
    assert_unauthorized(&server.request("GET", "/v1/models", &[]));
    assert_unauthorized(&server.request("GET", "/v1/models", &[("Authorization", "Bearer old-key")]));
    assert_unauthorized(&server.request("GET", "/v1/models", &[("x-api-key", "# clients")]));
    assert_unauthorized(&server.request("GET", "/metrics", &[]));

    // Each key, in each header form.
    let bearer = |k: &str| format!("Bearer {k}");
    for key in [FLAG_KEY, FILE_KEYS[0], FILE_KEYS[1]] {
        let r = server.request("GET", "/v1/models", &[("Authorization", bearer(key).as_str())]);
        assert_eq!(r.status, 200, "{key}: {}", r.body);
        assert_eq!(r.json()["object"], "list");
        let r = server.request("GET", "/v1/models", &[("x-api-key", key)]);
        assert_eq!(r.status, 200, "{key}: {}", r.body);
    }
    let r = server.request("GET", "/metrics", &[("x-api-key", FLAG_KEY)]);
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(r.body.contains("specula_requests_total"), "{}", r.body);

    // Bound to loopback: a foreign Host is refused, a loopback one with a port served.
    let r = server.request(
        "GET",
        "/v1/models",
        &[("Host", "evil.example"), ("x-api-key", FLAG_KEY)],
    );
    assert_eq!(r.status, 403, "{}", r.body);
    assert_eq!(r.json()["error"]["code"], "invalid_host");
    let host = format!("localhost:{port}");
    let r = server.request("GET", "/v1/models", &[("Host", host.as_str()), ("x-api-key", FLAG_KEY)]);
    assert_eq!(r.status, 200, "{}", r.body);

    let log = server.log();
    assert!(log.contains("api_keys=3"), "{log}");
    for k in [FLAG_KEY, FILE_KEYS[0], FILE_KEYS[1]] {
        assert!(!log.contains(k), "the log shows a key: {log}");
    }
    drop(server);

    // SPECULA_API_KEY, and --metrics-public.
    let mut server = Server::spawn_with(
        model,
        &["--metrics-public"],
        &[("SPECULA_CACHE", cache), ("SPECULA_API_KEY", ENV_KEY)],
    );
    server.wait_ready();
    let r = server.request("GET", "/metrics", &[]);
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(r.body.contains("specula_requests_total"), "{}", r.body);
    assert_unauthorized(&server.request("GET", "/v1/models", &[]));
    assert_unauthorized(&server.request("GET", "/v1/models", &[("x-api-key", FLAG_KEY)]));
    let r = server.request("GET", "/v1/models", &[("Authorization", bearer(ENV_KEY).as_str())]);
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(!server.log().contains(ENV_KEY), "{}", server.log());

    // --help names the environment variable but never shows its value.
    let out = run(
        specula().args(["serve", "--help"]).env("SPECULA_API_KEY", ENV_KEY),
        TIMEOUT,
    );
    assert!(out.status.success(), "{}", out.describe());
    assert!(out.stdout.contains("SPECULA_API_KEY"), "{}", out.describe());
    assert!(!out.stdout.contains(ENV_KEY), "{}", out.describe());
}
