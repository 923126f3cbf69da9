//! Unit tests per dialect and the chunk-invariance property tests.

use super::*;
use ToolEvent::*;

pub(crate) fn cfg() -> ParserConfig {
    let f = |v: serde_json::Value| ToolSpec::from_function(&v).unwrap();
    ParserConfig {
        tools: vec![
            f(
                serde_json::json!({"name": "get_weather", "parameters": {"type": "object",
                "properties": {"city": {"type": "string"}}}}),
            ),
            f(serde_json::json!({"name": "add", "parameters": {"type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": ["number", "null"]}}}})),
            f(serde_json::json!({"name": "run_code", "parameters": {"type": "object",
                "properties": {"code": {"type": "string"}}}})),
        ],
        id_prefix: "call_".to_string(),
    }
}

fn parse(d: Dialect, text: &str) -> Vec<ToolEvent> {
    let whole = parse_all(d, &cfg(), text);
    assert_chunk_invariant(d, text, &whole, &mut Rng(0x5eed));
    whole
}

fn start(index: usize, name: &str) -> ToolEvent {
    Start {
        index,
        id: format!("call_{index}"),
        name: name.to_string(),
    }
}

fn args(index: usize, fragment: &str) -> ToolEvent {
    Args {
        index,
        fragment: fragment.to_string(),
    }
}

fn content(s: &str) -> ToolEvent {
    Content(s.to_string())
}

fn unfinished(index: Option<usize>, raw: &str) -> ToolEvent {
    Unfinished {
        index,
        raw: raw.to_string(),
    }
}

/// A complete call, as merged events.
fn call(index: usize, name: &str, arguments: &str) -> Vec<ToolEvent> {
    vec![start(index, name), args(index, arguments), End { index }]
}

fn cat(parts: Vec<Vec<ToolEvent>>) -> Vec<ToolEvent> {
    parts.concat()
}

// --- a seeded RNG (SplitMix64), so the property tests need no dependency ----------------------

pub(crate) struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// Pieces of one char each.
fn by_char(text: &str) -> Vec<&str> {
    text.char_indices().map(|(i, c)| &text[i..i + c.len_utf8()]).collect()
}

/// Markers of every dialect, kept whole when splitting "by token".
const SPECIAL: &[&str] = &[
    "<tool_call>",
    "</tool_call>",
    "<think>",
    "</think>",
    "<|python_tag|>",
    "[TOOL_CALLS]",
    "[ARGS]",
];

/// Token-like pieces: special markers whole, runs of letters, runs of digits, runs of
/// whitespace, and single other chars (a rough picture of BPE pieces).
pub(crate) fn by_token(text: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut i = 0;
    let b = text.as_bytes();
    while i < text.len() {
        if let Some(m) = SPECIAL.iter().find(|m| text[i..].starts_with(**m)) {
            out.push(&text[i..i + m.len()]);
            i += m.len();
            continue;
        }
        let c = text[i..].chars().next().unwrap_or(' ');
        let class = |c: char| {
            if c.is_alphabetic() {
                0
            } else if c.is_ascii_digit() {
                1
            } else if c.is_whitespace() {
                2
            } else {
                3
            }
        };
        let k = class(c);
        let mut j = i + c.len_utf8();
        if k != 3 {
            while j < text.len() {
                let d = text[j..].chars().next().unwrap_or(' ');
                if class(d) != k || (b[j] == b'<' || b[j] == b'[') {
                    break;
                }
                j += d.len_utf8();
            }
        }
        out.push(&text[i..j]);
        i = j;
    }
    out
}

/// Random pieces of 1..=max_k chars.
pub(crate) fn random_split<'a>(text: &'a str, rng: &mut Rng, max_k: usize) -> Vec<&'a str> {
    let idx: Vec<usize> = text.char_indices().map(|(i, _)| i).chain([text.len()]).collect();
    let mut out = Vec::new();
    let mut at = 0;
    while at + 1 < idx.len() {
        let k = 1 + rng.below(max_k);
        let end = (at + k).min(idx.len() - 1);
        out.push(&text[idx[at]..idx[end]]);
        at = end;
    }
    out
}

pub(crate) use super::fuzz::check_events;

/// Whole, by char, by token and random splits give the same merged events.
pub(crate) fn assert_chunk_invariant(d: Dialect, text: &str, whole: &[ToolEvent], rng: &mut Rng) {
    let c = cfg();
    check_events(d, text, whole);
    assert_eq!(parse_pieces(d, &c, by_char(text)), whole, "{d}: char by char: {text:?}");
    assert_eq!(parse_pieces(d, &c, by_token(text)), whole, "{d}: by token: {text:?}");
    for max_k in [2, 3, 5, 8, 16] {
        let pieces = random_split(text, rng, max_k);
        assert_eq!(parse_pieces(d, &c, pieces.clone()), whole, "{d}: pieces {pieces:?}");
    }
}

// --- Hermes ------------------------------------------------------------------------------------

#[test]
fn hermes_single_call_with_prose() {
    let text =
        "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
    assert_eq!(
        parse(Dialect::Hermes, text),
        cat(vec![
            vec![content("Let me check.")],
            call(0, "get_weather", "{\"city\": \"Paris\"}")
        ])
    );
}

#[test]
fn hermes_parallel_calls_and_content_after() {
    let text = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n\
                <tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1, \"b\": 2}}\n</tool_call>\nDone.";
    assert_eq!(
        parse(Dialect::Hermes, text),
        cat(vec![
            call(0, "get_weather", "{\"city\": \"Paris\"}"),
            call(1, "add", "{\"a\": 1, \"b\": 2}"),
            vec![content("Done.")],
        ])
    );
    // Two objects in one block, and a block without its closing tag.
    let text = "<tool_call>{\"name\": \"add\", \"arguments\": {}} {\"name\": \"add\"}<tool_call>{\"name\": \"x\"}";
    assert_eq!(
        parse(Dialect::Hermes, text),
        cat(vec![call(0, "add", "{}"), call(1, "add", "{}"), call(2, "x", "{}")])
    );
}

#[test]
fn hermes_escapes_and_brackets_inside_strings() {
    let arguments = r#"{"code": "print(\"})]</tool_call>\")\n\\", "n": [1, {"x": "}"}]}"#;
    let text = format!("<tool_call>{{\"name\": \"run_code\", \"arguments\": {arguments}}}</tool_call>");
    let events = parse(Dialect::Hermes, &text);
    assert_eq!(events, call(0, "run_code", arguments));
    let v: serde_json::Value = serde_json::from_str(arguments).unwrap();
    assert_eq!(v["code"], "print(\"})]</tool_call>\")\n\\");
}

#[test]
fn hermes_unknown_names_pass_through_in_tags() {
    let text = "<tool_call>{\"name\": \"launch_rockets\", \"arguments\": {\"n\": 3}}</tool_call>";
    assert_eq!(parse(Dialect::Hermes, text), call(0, "launch_rockets", "{\"n\": 3}"));
}

#[test]
fn hermes_argument_forms() {
    // Arguments first (held until the name), as a JSON string (decoded), missing ("{}").
    let text = "<tool_call>{\"arguments\": {\"city\": \"Oslo\"}, \"name\": \"get_weather\"}</tool_call>";
    assert_eq!(
        parse(Dialect::Hermes, text),
        call(0, "get_weather", "{\"city\": \"Oslo\"}")
    );
    let text = r#"<tool_call>{"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}</tool_call>"#;
    assert_eq!(
        parse(Dialect::Hermes, text),
        call(0, "get_weather", "{\"city\": \"Oslo\"}")
    );
    let text = "<tool_call>{\"type\": \"function\", \"name\": \"add\", \"id\": 7}</tool_call>";
    assert_eq!(parse(Dialect::Hermes, text), call(0, "add", "{}"));
    let text = "<tool_call>{\"name\": \"add\", \"parameters\": {\"a\": 1}}</tool_call>";
    assert_eq!(parse(Dialect::Hermes, text), call(0, "add", "{\"a\": 1}"));
}

#[test]
fn hermes_prose_mentioning_tags_stays_prose() {
    for text in [
        "Wrap calls in <tool_call> tags.",
        "The tool_call format: <tool_call>name</tool_call>",
        "a <tool_call", // a marker prefix at the end
        "x </tool_call> y",
        "<tool_call>{\"arguments\": {}}</tool_call>", // no name: not a call
        "<tool_call>{\"name\": 5}</tool_call>",
        "Use function=foo or <function=bar>.",
        "{\"name\": \"John\", \"age\": 3}", // a bare object naming no offered tool
        "Here: {\"name\": \"get_weather\", \"arguments\": {}}", // bare, but not at the start
        "```json\n{\"city\": \"Paris\"}\n```",
        "<tool_call><tool_call",
    ] {
        let events = parse(Dialect::Hermes, text);
        let got: String = events
            .iter()
            .map(|e| match e {
                Content(t) | Unfinished { raw: t, .. } => t.as_str(),
                _ => panic!("no call expected in {text:?}: {events:?}"),
            })
            .collect();
        assert_eq!(got, text);
    }
    assert_eq!(
        parse(Dialect::Hermes, "See <tool_call> x</tool_call>\n"),
        vec![content("See <tool_call> x</tool_call>\n")]
    );
}

#[test]
fn hermes_unterminated_calls() {
    let text = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Par";
    assert_eq!(
        parse(Dialect::Hermes, text),
        vec![
            start(0, "get_weather"),
            args(0, "{\"city\": \"Par"),
            unfinished(Some(0), text)
        ]
    );
    let text = "Sure. <tool_call>\n{\"na";
    assert_eq!(
        parse(Dialect::Hermes, text),
        vec![content("Sure."), unfinished(None, " <tool_call>\n{\"na")]
    );
    // A complete object without its closing tag is a complete call.
    let text = "<tool_call>{\"name\": \"add\", \"arguments\": {\"a\": 1}}\n</tool_";
    assert_eq!(parse(Dialect::Hermes, text), call(0, "add", "{\"a\": 1}"));
}

#[test]
fn hermes_bare_fallback_for_offered_tools() {
    // Qwen2.5-Coder 0.5B's habit: no tags.
    let text = "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}";
    assert_eq!(
        parse(Dialect::Hermes, text),
        call(0, "get_weather", "{\"city\": \"Paris\"}")
    );
    let text = "\n```json\n{\n  \"name\": \"get_weather\",\n  \"arguments\": {\n    \"city\": \"Paris\"\n  }\n}\n```\n";
    assert_eq!(
        parse(Dialect::Hermes, text),
        call(0, "get_weather", "{\n    \"city\": \"Paris\"\n  }")
    );
    let text =
        "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n{\"name\": \"add\", \"arguments\": {}}";
    assert_eq!(
        parse(Dialect::Hermes, text),
        cat(vec![
            call(0, "get_weather", "{\"city\": \"Paris\"}"),
            call(1, "add", "{}")
        ])
    );
    // Not offered: content.
    let text = "{\"name\": \"launch_rockets\", \"arguments\": {}}";
    assert_eq!(parse(Dialect::Hermes, text), vec![content(text)]);
    // Cut before the name is known: content (bare objects are not calls until named).
    let text = "{\"name\": \"get_wea";
    assert_eq!(parse(Dialect::Hermes, text), vec![content(text)]);
}

// --- Qwen3-Coder XML ---------------------------------------------------------------------------

#[test]
fn qwen3_coder_call_with_typed_parameters() {
    let text = "I'll add them.\n<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n<parameter=b>\n2.5\n</parameter>\n</function>\n</tool_call>";
    assert_eq!(
        parse(Dialect::Qwen3Coder, text),
        cat(vec![
            vec![content("I'll add them.")],
            call(0, "add", "{\"a\": 1, \"b\": 2.5}")
        ])
    );
}

#[test]
fn qwen3_coder_string_values_stream_escaped() {
    let code = "def f(x):\n    return \"})]\" + x  # </param\n";
    let text =
        format!("<tool_call>\n<function=run_code>\n<parameter=code>\n{code}\n</parameter>\n</function>\n</tool_call>");
    let events = parse(Dialect::Qwen3Coder, &text);
    let want = serde_json::json!({ "code": code })
        .to_string()
        .replace("\":\"", "\": \"");
    assert_eq!(events, call(0, "run_code", &want));
    let v: serde_json::Value = serde_json::from_str(&want).unwrap();
    assert_eq!(v["code"], code);
}

#[test]
fn qwen3_coder_parallel_unknown_and_untyped() {
    let text = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>\n\
                <tool_call>\n<function=mystery>\n<parameter=n>\n3\n</parameter>\n<parameter=flag>true</function>\n</tool_call>";
    assert_eq!(
        parse(Dialect::Qwen3Coder, text),
        cat(vec![
            call(0, "get_weather", "{\"city\": \"Paris\"}"),
            // Unknown tool: values stay strings; a missing </parameter> is tolerated.
            call(1, "mystery", "{\"n\": \"3\", \"flag\": \"true\"}"),
        ])
    );
    // Two functions in one block, one without parameters.
    let text = "<tool_call>\n<function=add>\n</function>\n<function=add>\n<parameter=a>\nx\n</parameter>\n</function>\n</tool_call>";
    assert_eq!(
        parse(Dialect::Qwen3Coder, text),
        cat(vec![call(0, "add", "{}"), call(1, "add", "{\"a\": \"x\"}")])
    );
}

#[test]
fn qwen3_coder_prose_and_unterminated() {
    for text in [
        "Set function=main and <function=x> without a block.",
        "<tool_call> then prose",
        "<tool_call>\n<function=\n>",
        "<tool_call><tool_call",
    ] {
        let events = parse(Dialect::Qwen3Coder, text);
        assert!(
            events
                .iter()
                .all(|e| matches!(e, Content(_) | Unfinished { index: None, .. })),
            "{text:?}: {events:?}"
        );
    }
    let text = "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar";
    assert_eq!(
        parse(Dialect::Qwen3Coder, text),
        vec![
            start(0, "get_weather"),
            args(0, "{\"city\": \"Par"),
            unfinished(Some(0), text)
        ]
    );
    // A held trailing newline and a marker prefix are not sent before they are known.
    let text = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</param";
    assert_eq!(
        parse(Dialect::Qwen3Coder, text),
        vec![
            start(0, "get_weather"),
            args(0, "{\"city\": \"Paris"),
            unfinished(Some(0), text)
        ]
    );
}

// --- bracket -------------------------------------------------------------------------------------

#[test]
fn bracket_arguments_with_closing_chars_in_strings() {
    let arguments = r#"{"code": "g = f({\"a\": [1]})]\n# [Calling tool: x({})]", "q": "\\"}"#;
    let text = format!("Running it. [Calling tool: run_code({arguments})] Then more.");
    assert_eq!(
        parse(Dialect::Bracket, &text),
        cat(vec![
            vec![content("Running it.")],
            call(0, "run_code", arguments),
            vec![content("Then more.")],
        ])
    );
}

#[test]
fn bracket_parallel_unknown_empty_and_prose() {
    let text = "[Calling tool: get_weather({\"city\": \"Paris\"})]\n[Calling tool: ping()]\n[Calling tool: x.y-z({})]";
    assert_eq!(
        parse(Dialect::Bracket, text),
        cat(vec![
            call(0, "get_weather", "{\"city\": \"Paris\"}"),
            call(1, "ping", "{}"),
            call(2, "x.y-z", "{}"),
        ])
    );
    for text in [
        "[Calling tool: but no call]",
        "[Calling tool: f(not json)]",
        "Calling tool: f({})",
        "[Calling tool:f({})]",
    ] {
        assert_eq!(parse(Dialect::Bracket, text), vec![content(text)], "{text:?}");
    }
    let text = "[Calling tool: run_code({\"code\": \"x})]";
    assert_eq!(
        parse(Dialect::Bracket, text),
        vec![
            start(0, "run_code"),
            args(0, "{\"code\": \"x})]"),
            unfinished(Some(0), text)
        ]
    );
}

// --- Llama 3 -------------------------------------------------------------------------------------

#[test]
fn llama3_bare_and_tagged_calls() {
    let text = "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}";
    assert_eq!(
        parse(Dialect::Llama3, text),
        call(0, "get_weather", "{\"city\": \"Paris\"}")
    );
    let text = "{\"type\": \"function\", \"name\": \"add\", \"parameters\": {\"a\": 1}}; {\"name\": \"get_weather\", \"parameters\": {}}";
    assert_eq!(
        parse(Dialect::Llama3, text),
        cat(vec![call(0, "add", "{\"a\": 1}"), call(1, "get_weather", "{}")])
    );
    let text = "<|python_tag|>{\"name\": \"brave_search\", \"parameters\": {\"query\": \"x\"}}";
    assert_eq!(
        parse(Dialect::Llama3, text),
        call(0, "brave_search", "{\"query\": \"x\"}")
    );
    for text in [
        "{\"city\": \"Paris\"}",
        "{\"name\": \"Bob\"}",
        "The JSON is {\"name\": \"add\"}",
        "<|python_tag|>print(1)",
    ] {
        assert_eq!(parse(Dialect::Llama3, text), vec![content(text)], "{text:?}");
    }
}

// --- Mistral -------------------------------------------------------------------------------------

#[test]
fn mistral_forms() {
    let text = "[TOOL_CALLS][{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}, \"id\": \"abc123xyz\"}, {\"name\": \"add\", \"arguments\": {\"a\": 1}}]";
    assert_eq!(
        parse(Dialect::Mistral, text),
        cat(vec![
            call(0, "get_weather", "{\"city\": \"Paris\"}"),
            call(1, "add", "{\"a\": 1}")
        ])
    );
    // Without the (control-token) marker, at the start, for offered tools.
    let text = "[{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}]";
    assert_eq!(
        parse(Dialect::Mistral, text),
        call(0, "get_weather", "{\"city\": \"Paris\"}")
    );
    let text = "[TOOL_CALLS]get_weather[ARGS]{\"city\": \"Paris\"}[TOOL_CALLS]unknown_tool[ARGS]{}";
    assert_eq!(
        parse(Dialect::Mistral, text),
        cat(vec![
            call(0, "get_weather", "{\"city\": \"Paris\"}"),
            call(1, "unknown_tool", "{}")
        ])
    );
    for text in [
        "[1, 2, 3]",
        "[{\"name\": \"Bob\"}]",
        "See [TOOL_CALLS] docs",
        "x [{\"name\": \"add\"}]",
    ] {
        let events = parse(Dialect::Mistral, text);
        assert!(
            events
                .iter()
                .all(|e| matches!(e, Content(_) | Unfinished { index: None, .. })),
            "{text:?}: {events:?}"
        );
    }
    let text = "[TOOL_CALLS][{\"name\": \"add\", \"arguments\": {\"a\": ";
    assert_eq!(
        parse(Dialect::Mistral, text),
        vec![start(0, "add"), args(0, "{\"a\": "), unfinished(Some(0), text)]
    );
}

// --- selection -----------------------------------------------------------------------------------

#[test]
fn dialect_names_and_detection() {
    for d in Dialect::ALL {
        assert_eq!(Dialect::parse(d.name()), Some(d));
    }
    assert_eq!(Dialect::parse("Qwen3-Coder"), Some(Dialect::Qwen3Coder));
    assert_eq!(Dialect::parse("nope"), None);
    assert_eq!(Dialect::detect(Some("qwen2"), None), Dialect::Hermes);
    assert_eq!(Dialect::detect(Some("qwen3"), Some("plain")), Dialect::Hermes);
    assert_eq!(Dialect::detect(Some("llama"), None), Dialect::Llama3);
    assert_eq!(
        Dialect::detect(Some("qwen3"), Some("<tool_call>\n<function=x>\n<parameter=y>")),
        Dialect::Qwen3Coder
    );
    assert_eq!(Dialect::detect(Some("llama"), Some("[TOOL_CALLS] [")), Dialect::Mistral);
    assert_eq!(
        Dialect::detect(Some("llama"), Some("... <tool_call> ...")),
        Dialect::Hermes
    );
}

// --- property tests ------------------------------------------------------------------------------

/// Fragments random texts are built from: every dialect's markers and their prefixes, JSON
/// syntax, strings with escapes, names, whitespace and non-ASCII text.
pub(crate) const FRAGMENTS: &[&str] = &[
    "<tool_call>",
    "</tool_call>",
    "<tool_",
    "{",
    "}",
    "[",
    "]",
    "\"",
    "\\",
    "\\\"",
    ":",
    ",",
    " ",
    "\n",
    "name",
    "\"name\"",
    "\"arguments\"",
    "\"parameters\"",
    "\"type\": \"function\", ",
    "get_weather",
    "\"get_weather\"",
    "{\"name\": \"get_weather\", \"arguments\": ",
    "{\"name\": \"add\", \"parameters\": {\"a\": 1}}",
    "{\"city\": \"Paris\"}",
    "\"})]\\\"\"",
    "})]",
    "é",
    "😀",
    "<think>",
    "```json",
    "```",
    "(",
    ")",
    ")]",
    "[Calling tool: ",
    "[Calling tool: run_code(",
    "<function=",
    "<function=add>",
    "</function>",
    "<parameter=",
    "<parameter=a>",
    "</parameter>",
    "[TOOL_CALLS]",
    "[ARGS]",
    "<|python_tag|>",
    ";",
    "x",
    "12",
    "true",
    "null",
    "<tool_call>\n<function=add>\n",
    "<parameter=a>\n1\n</parameter>\n",
    "</function>\n</tool_call>",
    "[TOOL_CALLS][",
    "[TOOL_CALLS]add[ARGS]",
    "[{\"name\": \"add\", \"arguments\": ",
];

/// A random text of up to `max` fragments.
pub(crate) fn random_text(rng: &mut Rng, max: usize) -> String {
    let n = rng.below(max + 1);
    let mut s = String::new();
    for _ in 0..n {
        s.push_str(FRAGMENTS[rng.below(FRAGMENTS.len())]);
    }
    s
}

/// Well-formed outputs of each dialect, mixed with prose, that random splits are tried on.
fn corpus(d: Dialect) -> Vec<String> {
    let mut v: Vec<String> = vec!["Plain prose, no calls at all.\n".into(), "".into(), "  \n ".into()];
    v.extend(
        match d {
            Dialect::Hermes => vec![
                "Checking.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"run_code\", \"arguments\": {\"code\": \"print(\\\"})]\\\")\"}}\n</tool_call>",
                "```json\n{\"name\": \"add\", \"arguments\": {\"a\": 1}}\n```",
                "<tool_call>{\"name\": \"add\", \"arguments\": {\"a\": [1, {\"b\": \"]}\"}]}",
            ],
            Dialect::Qwen3Coder => vec![
                "<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n<parameter=b>\nx\n</parameter>\n</function>\n</tool_call>\nok",
                "<tool_call>\n<function=run_code>\n<parameter=code>\nif a < b:\n    print(\"</par\")\n</parameter>\n</function>\n</tool_call>",
            ],
            Dialect::Bracket => vec![
                "Ok. [Calling tool: run_code({\"code\": \"f({\\\"a\\\": 1})]\"})] [Calling tool: ping()]",
                "[Calling tool: get_weather({\"city\": \"Paris\"",
            ],
            Dialect::Llama3 => vec![
                "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}; {\"name\": \"add\", \"parameters\": {}}",
                "<|python_tag|>{\"name\": \"x\", \"parameters\": {\"q\": \"\\\"}\"}}",
            ],
            Dialect::Mistral => vec![
                "[TOOL_CALLS][{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}, {\"name\": \"add\", \"arguments\": {}}]",
                "[TOOL_CALLS]run_code[ARGS]{\"code\": \"}]\"}",
            ],
        }
        .into_iter()
        .map(String::from),
    );
    v
}

#[test]
fn chunk_invariance_on_the_corpus() {
    let mut rng = Rng(1);
    for d in Dialect::ALL {
        for text in corpus(d) {
            let whole = parse_all(d, &cfg(), &text);
            for _ in 0..50 {
                assert_chunk_invariant(d, &text, &whole, &mut rng);
            }
        }
    }
}

#[test]
fn chunk_invariance_on_random_texts() {
    let mut rng = Rng(42);
    for d in Dialect::ALL {
        for _ in 0..3000 {
            let text = random_text(&mut rng, 24);
            let whole = parse_all(d, &cfg(), &text);
            assert_chunk_invariant(d, &text, &whole, &mut rng);
        }
    }
}

/// 10^6 random inputs per parser (and for the reasoning splitter): no panic, structurally sound
/// events, and the same events for a random split as for the whole text. Run with
/// `cargo test --release -p specula-server --lib stress_million -- --ignored --nocapture`
/// (`SPECULA_STRESS_N` changes the count; the `cargo fuzz` targets under `fuzz/` run the same
/// checks coverage-guided).
#[test]
#[ignore]
fn stress_million_inputs_per_parser() {
    let n: usize = std::env::var("SPECULA_STRESS_N")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1_000_000);
    let c = cfg();
    for d in Dialect::ALL {
        let mut rng = Rng(0xf00d ^ d as u64);
        let t0 = std::time::Instant::now();
        let mut calls = 0usize;
        let mut unfinished = 0usize;
        for i in 0..n {
            let text = random_text(&mut rng, 32);
            let whole = parse_all(d, &c, &text);
            check_events(d, &text, &whole);
            calls += whole.iter().filter(|e| matches!(e, End { .. })).count();
            unfinished += whole.iter().filter(|e| matches!(e, Unfinished { .. })).count();
            let max_k = 1 + rng.below(8);
            let pieces = random_split(&text, &mut rng, max_k);
            assert_eq!(parse_pieces(d, &c, pieces.clone()), whole, "{d}: pieces {pieces:?}");
            // Every 16th input is raw random bytes instead (lossy UTF-8), through the fuzz check.
            if i % 16 == 0 {
                let bytes: Vec<u8> = (0..rng.below(64)).map(|_| rng.next() as u8).collect();
                super::fuzz::tool_parser(d, &bytes);
            }
        }
        eprintln!(
            "{d}: {n} random inputs, {calls} complete calls, {unfinished} unfinished, no panic, chunk-invariant ({:.1}s)",
            t0.elapsed().as_secs_f64()
        );
    }
    let mut rng = Rng(0x7e1);
    let t0 = std::time::Instant::now();
    for _ in 0..n {
        let mut bytes = vec![rng.next() as u8];
        bytes.extend(random_text(&mut rng, 16).into_bytes());
        super::fuzz::reasoning(&bytes);
    }
    eprintln!(
        "reasoning: {n} random inputs, no panic, chunk-invariant ({:.1}s)",
        t0.elapsed().as_secs_f64()
    );
}

#[test]
fn fuzz_checks_run_on_plain_inputs() {
    let mut rng = Rng(3);
    for d in Dialect::ALL {
        for _ in 0..200 {
            let bytes: Vec<u8> = (0..rng.below(48)).map(|_| rng.next() as u8).collect();
            super::fuzz::tool_parser(d, &bytes);
            let mut t = vec![rng.next() as u8];
            t.extend(random_text(&mut rng, 12).into_bytes());
            super::fuzz::tool_parser(d, &t);
            super::fuzz::reasoning(&t);
        }
    }
}
