//! Hostile grammars: a request's grammar, schema or tool set can be huge or deeply chained; it
//! gets a clear request error (never a process abort from a stack overflow, never a 500 for a
//! grammar limit, never a backtrace in the message), and the engine goes on serving.

use candle_core::quantized::GgmlDType;
use specula_engine::constraint::GrammarSpec;
use specula_engine::model::Family;
use specula_engine::testing::{write_tiny_gguf, TinySpec};
use specula_engine::{Engine, GenerateRequest, LoadOptions, SamplingParams};

fn engine() -> (tempfile::TempDir, Engine) {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("t.gguf");
    write_tiny_gguf(
        &path,
        &TinySpec {
            dtype: GgmlDType::Q8_0,
            ..TinySpec::new(Family::Qwen2)
        },
    )
    .expect("write");
    let e = Engine::load(&path, "tiny", LoadOptions::default()).expect("load");
    (dir, e)
}

fn req(e: &Engine) -> GenerateRequest {
    GenerateRequest {
        prompt_tokens: e.tokenize("the then").expect("tokenize"),
        sampling: SamplingParams::greedy(),
        max_tokens: Some(8),
        stop: vec![],
        logprobs: None,
        ignore_eos: true,
        spec: Default::default(),
    }
}

/// A Lark chain of `n` rules: `start: r0`, `rI: "xI" rI+1`, the last a literal.
fn lark_chain(n: usize) -> String {
    let mut g = String::from("start: r0\n");
    for i in 0..n {
        if i + 1 < n {
            g += &format!("r{i}: \"x{i}\" r{}\n", i + 1);
        } else {
            g += &format!("r{i}: \"x{i}\"\n");
        }
    }
    g
}

/// A JSON schema `$ref` chain of `n` definitions.
fn ref_chain(n: usize) -> serde_json::Value {
    let mut defs = serde_json::Map::new();
    for i in 0..n {
        let v = if i + 1 < n {
            serde_json::json!({"type": "object", "properties": {"a": {"$ref": format!("#/$defs/d{}", i + 1)}}, "required": ["a"]})
        } else {
            serde_json::json!({"type": "integer"})
        };
        defs.insert(format!("d{i}"), v);
    }
    serde_json::json!({"$ref": "#/$defs/d0", "$defs": defs})
}

/// A Lark rule of `n` alternatives.
fn alternatives(n: usize) -> String {
    let alts: Vec<String> = (0..n).map(|i| format!("\"w{i}\"")).collect();
    format!("start: {}\n", alts.join(" | "))
}

/// `start: ((((...("a")...))))`, `depth` groups deep.
fn nested(depth: usize) -> String {
    format!("start: {}\"a\"{}\n", "(".repeat(depth), ")".repeat(depth))
}

/// Each case: the grammar, and the error's text (None: it must compile and generate).
#[test]
fn hostile_grammars_are_request_errors_and_the_engine_serves_on() {
    use specula_engine::types::RequestError;
    let (_d, mut e) = engine();
    let r = req(&e);
    let cases: Vec<(&str, GrammarSpec, Option<&str>)> = vec![
        // Deep recursion in the grammar library's compiler: within the size bound, compiled
        // on its own deep stack.
        ("7,000-rule chain", GrammarSpec::Lark(lark_chain(7000)), None),
        (
            "20,000-rule chain (near the size bound)",
            GrammarSpec::Lark(lark_chain(20_000)),
            None,
        ),
        ("5,000-$ref chain", GrammarSpec::JsonSchema(ref_chain(5000)), None),
        ("groups 200,000 deep", GrammarSpec::Lark(nested(200_000)), Some("")),
        // Past the size bound.
        (
            "7,000-$ref chain",
            GrammarSpec::JsonSchema(ref_chain(7000)),
            Some("at most 524288"),
        ),
        (
            "30,000-rule chain",
            GrammarSpec::Lark(lark_chain(30_000)),
            Some("at most 524288"),
        ),
        // The grammar library's row limit, hit after the first token: a request error.
        (
            "2,001 alternatives",
            GrammarSpec::Lark(alternatives(2001)),
            Some("max is 2000"),
        ),
        (
            "20,000 alternatives",
            GrammarSpec::Lark(alternatives(20_000)),
            Some("max is 2000"),
        ),
    ];
    for (what, g, want) in cases {
        let out = e.generate_constrained(&r, Some(&g), &mut |_| true);
        match (out, want) {
            (Ok(o), None) => assert!(!o.token_ids.is_empty(), "{what}"),
            (Ok(o), Some("")) => eprintln!("{what}: compiled, {:?}", o.text),
            (Ok(o), Some(w)) => panic!("{what}: generated {:?}, expected an error with '{w}'", o.text),
            (Err(err), want) => {
                let msg = err.to_string();
                eprintln!("{what}: {msg}");
                assert!(
                    matches!(err, RequestError::InvalidParameter(_)),
                    "{what}: not a request error: {msg}"
                );
                assert!(
                    msg.len() < 400 && !msg.contains("backtrace") && !msg.contains(".rs:"),
                    "{what}: {msg}"
                );
                match want {
                    Some(w) => assert!(msg.contains(w), "{what}: {msg}"),
                    None => panic!("{what}: {msg}"),
                }
            }
        }
    }
    let o = e.generate(&r, &mut |_| true).expect("the engine serves on");
    assert!(!o.token_ids.is_empty());
}
