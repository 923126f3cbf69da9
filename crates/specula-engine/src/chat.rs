//! Chat templates: the Jinja template shipped with the model (`tokenizer.chat_template` in GGUF,
//! `chat_template` in `tokenizer_config.json` or `chat_template.jinja` in HF bundles), rendered
//! with minijinja in the environment transformers uses (`trim_blocks`, `lstrip_blocks`,
//! Python string/dict methods via minijinja-contrib's pycompat, `raise_exception`,
//! `strftime_now`, and transformers' `tojson`: `json.dumps` with `ensure_ascii=False`, Python's
//! `", "` / `": "` separators and no HTML escaping).
//!
//! Besides `messages` and `add_generation_prompt`, a render may pass what tool-calling and
//! reasoning templates read ([`ChatExtras`]): `tools` (the OpenAI tool objects, as transformers'
//! `apply_chat_template(tools=...)` passes them), `tool_choice`, and extra keyword arguments
//! (`enable_thinking`, `reasoning_effort`, ...). Messages carry `tool_calls` (with `arguments`
//! as a JSON object, as templates expect), `tool_call_id`, `name` and `reasoning_content` when set.

use minijinja::value::Kwargs;
use minijinja::{Environment, ErrorKind, Value};
use serde::{Deserialize, Serialize};

/// One chat message as the template sees it. Optional fields are left out of the template
/// context when unset (so `message.tool_calls is defined` and `if message.tool_calls` behave as
/// with transformers).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    /// The author's name (`name` of OpenAI messages), when given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// For `role: "tool"`: the id of the call this message answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// For `role: "assistant"`: the tool calls it made.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ChatToolCall>>,
    /// For `role: "assistant"`: its reasoning (templates of thinking models may render it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
}

/// A tool call of an assistant message, in OpenAI's shape.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatToolCall {
    pub id: String,
    #[serde(rename = "type")]
    pub kind: String,
    pub function: ChatFunctionCall,
}

/// The function of a [`ChatToolCall`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatFunctionCall {
    pub name: String,
    /// The arguments: a JSON object when the client's argument string parsed as one (templates
    /// print it with `tojson` or iterate over it), else the string as given.
    pub arguments: serde_json::Value,
}

impl ChatMessage {
    pub fn new(role: &str, content: &str) -> Self {
        Self {
            role: role.to_string(),
            content: content.to_string(),
            ..Default::default()
        }
    }
}

/// What a render passes to the template besides the messages.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ChatExtras {
    /// `tools`: the tool objects (`{"type": "function", "function": {...}}`); `None` leaves
    /// `tools` undefined.
    pub tools: Option<Vec<serde_json::Value>>,
    /// `tool_choice` as the client gave it (`"auto"`, `"required"`, `{"type": "function", ...}`).
    pub tool_choice: Option<serde_json::Value>,
    /// Further top-level variables (`enable_thinking`, `reasoning_effort`, ...). Keys that name
    /// the variables above, `messages`, `add_generation_prompt`, `bos_token` or `eos_token` are
    /// ignored.
    pub kwargs: serde_json::Map<String, serde_json::Value>,
}

/// Template variables a render sets itself (kwargs cannot override them).
pub const RESERVED_TEMPLATE_VARIABLES: &[&str] = &[
    "messages",
    "add_generation_prompt",
    "bos_token",
    "eos_token",
    "tools",
    "tool_choice",
];

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    bos_token: String,
    eos_token: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate").finish_non_exhaustive()
    }
}

impl ChatTemplate {
    /// Compile `source`. Errors are template syntax errors, with minijinja's line information.
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<Self, minijinja::Error> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> Result<Value, minijinja::Error> {
            Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
        });
        env.add_function("strftime_now", |fmt: String| -> String { strftime_now(&fmt) });
        env.add_filter("tojson", tojson_filter);
        env.add_template_owned("chat", source.to_string())?;
        Ok(Self {
            env,
            source: source.to_string(),
            bos_token: bos_token.to_string(),
            eos_token: eos_token.to_string(),
        })
    }

    /// The template's source text.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Render `messages`; `add_generation_prompt` opens the assistant turn. Template errors
    /// (including `raise_exception` calls, e.g. for an unsupported role order) are returned
    /// with their message.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String, minijinja::Error> {
        self.render_with(messages, add_generation_prompt, &ChatExtras::default())
    }

    /// [`ChatTemplate::render`] with `tools`, `tool_choice` and extra variables.
    pub fn render_with(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        extras: &ChatExtras,
    ) -> Result<String, minijinja::Error> {
        let tmpl = self.env.get_template("chat")?;
        let mut kwargs = extras.kwargs.clone();
        kwargs.retain(|k, _| !RESERVED_TEMPLATE_VARIABLES.contains(&k.as_str()));
        let base = Value::from_serialize(&kwargs);
        let tools = extras.tools.as_ref().map(Value::from_serialize);
        let tool_choice = extras.tool_choice.as_ref().map(Value::from_serialize);
        let mut ctx = minijinja::context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token,
            eos_token => self.eos_token,
            ..base
        };
        if let Some(tools) = tools {
            ctx = minijinja::context! { tools => tools, ..ctx };
        }
        if let Some(tc) = tool_choice {
            ctx = minijinja::context! { tool_choice => tc, ..ctx };
        }
        tmpl.render(ctx)
    }
}

/// A stand-in for the `k`-th marked field in [`ChatTemplate::render_marked`]: private-use
/// characters around the index, so no template markup or special token contains it.
fn sentinel(k: usize) -> String {
    format!("\u{F0000}{k}\u{F0001}")
}

/// Replace each string in `v` (object keys too) for which `marked` is true by a sentinel,
/// recording it with `origin` in `fields`.
fn mark_json(
    v: &mut serde_json::Value,
    origin: &str,
    marked: &dyn Fn(&str) -> bool,
    fields: &mut Vec<(String, String)>,
) {
    use serde_json::Value as J;
    match v {
        J::String(s) => mark_str(s, origin, marked, fields),
        J::Array(items) => items.iter_mut().for_each(|x| mark_json(x, origin, marked, fields)),
        J::Object(map) => {
            let entries = std::mem::take(map);
            for (mut k, mut x) in entries {
                mark_str(&mut k, origin, marked, fields);
                mark_json(&mut x, origin, marked, fields);
                map.insert(k, x);
            }
        }
        _ => {}
    }
}

/// Replace `f` by a sentinel if `marked` says so, recording it with `origin` in `fields`.
fn mark_str(f: &mut String, origin: &str, marked: &dyn Fn(&str) -> bool, fields: &mut Vec<(String, String)>) {
    if marked(f) {
        let real = std::mem::replace(f, sentinel(fields.len()));
        fields.push((origin.to_string(), real));
    }
}

impl ChatTemplate {
    /// [`ChatTemplate::render_with`], with the byte ranges of the rendered text that hold a
    /// client-written string for which `marked` is true (one holding control-token text, which
    /// must be tokenized as the text it spells, not as markup): a message's `content`,
    /// `reasoning_content`, `name`, `tool_call_id`, its tool calls' names and arguments, and
    /// every string (and key) of the `tools` and `tool_choice` objects. A string the template
    /// prints through `tojson` is located in its JSON-escaped form.
    ///
    /// The template is rendered twice, once with each marked field replaced by a sentinel; the
    /// spans are where the sentinels land, and the second render with the fields put back must
    /// equal the first. Errors: the template's own errors; a template that rewrites a marked
    /// field (its spans cannot be known), naming the message or `tools`.
    pub fn render_marked(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        extras: &ChatExtras,
        marked: &dyn Fn(&str) -> bool,
    ) -> Result<(String, Vec<std::ops::Range<usize>>), minijinja::Error> {
        let rendered = self.render_with(messages, add_generation_prompt, extras)?;
        let mut fields: Vec<(String, String)> = Vec::new();
        let mut masked = messages.to_vec();
        for (i, m) in masked.iter_mut().enumerate() {
            let origin = format!("message {i}");
            mark_str(&mut m.content, &origin, marked, &mut fields);
            for f in [&mut m.reasoning_content, &mut m.name, &mut m.tool_call_id]
                .into_iter()
                .flatten()
            {
                mark_str(f, &origin, marked, &mut fields);
            }
            for call in m.tool_calls.iter_mut().flatten() {
                mark_str(&mut call.function.name, &origin, marked, &mut fields);
                mark_json(&mut call.function.arguments, &origin, marked, &mut fields);
            }
        }
        let mut masked_extras = extras.clone();
        for tool in masked_extras.tools.iter_mut().flatten() {
            mark_json(tool, "tools", marked, &mut fields);
        }
        if let Some(choice) = masked_extras.tool_choice.as_mut() {
            mark_json(choice, "tool_choice", marked, &mut fields);
        }
        if fields.is_empty() {
            return Ok((rendered, Vec::new()));
        }
        let stand_in = self.render_with(&masked, add_generation_prompt, &masked_extras)?;
        let mut rebuilt = String::with_capacity(rendered.len());
        let mut spans = Vec::new();
        let mut rest = stand_in.as_str();
        while let Some(at) = rest.find('\u{F0000}') {
            rebuilt.push_str(&rest[..at]);
            let after = &rest[at + '\u{F0000}'.len_utf8()..];
            let field = after
                .find('\u{F0001}')
                .and_then(|end| Some((after[..end].parse::<usize>().ok()?, end)));
            match field.and_then(|(k, end)| Some((fields.get(k)?, end))) {
                Some(((_, real), end)) => {
                    // As written, or as `tojson` escapes it inside a JSON string.
                    let quoted = serde_json::to_string(real).unwrap_or_default();
                    let escaped = quoted.get(1..quoted.len().saturating_sub(1)).unwrap_or("");
                    let ahead = rendered.get(rebuilt.len()..).unwrap_or("");
                    let text = if ahead.starts_with(real.as_str()) {
                        real.as_str()
                    } else {
                        escaped
                    };
                    spans.push(rebuilt.len()..rebuilt.len() + text.len());
                    rebuilt.push_str(text);
                    rest = &after[end + '\u{F0001}'.len_utf8()..];
                }
                None => {
                    rebuilt.push('\u{F0000}');
                    rest = after;
                }
            }
        }
        rebuilt.push_str(rest);
        if rebuilt != rendered {
            let origin = fields.first().map_or("message 0", |f| f.0.as_str());
            return Err(minijinja::Error::new(
                ErrorKind::InvalidOperation,
                format!(
                    "{origin} holds control-token text in a field this chat template rewrites, so it cannot be \
                     passed as plain text; remove the control-token text"
                ),
            ));
        }
        Ok((rendered, spans))
    }
}

/// transformers' `tojson` filter: `json.dumps(x, ensure_ascii=False, indent=indent,
/// separators=separators, sort_keys=sort_keys)`.
fn tojson_filter(value: &Value, indent: Option<Value>, kwargs: Kwargs) -> Result<Value, minijinja::Error> {
    let indent = match indent {
        Some(i) => Some(i),
        None => kwargs.get::<Option<Value>>("indent")?,
    };
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() || v.is_undefined() => None,
        Some(v) => match v.as_i64() {
            Some(n) if n >= 0 => Some(" ".repeat(n as usize)),
            Some(_) => Some(String::new()),
            None => v.as_str().map(str::to_string),
        },
    };
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    kwargs.assert_all_used()?;
    let (item_sep, key_sep) = match separators.as_deref() {
        Some([a, b]) => (a.clone(), b.clone()),
        Some(_) => {
            return Err(minijinja::Error::new(
                ErrorKind::InvalidOperation,
                "tojson: separators must be a pair of strings",
            ))
        }
        None if indent.is_some() => (",".to_string(), ": ".to_string()),
        None => (", ".to_string(), ": ".to_string()),
    };
    let json = serde_json::to_value(value)
        .map_err(|e| minijinja::Error::new(ErrorKind::InvalidOperation, "tojson: cannot serialize").with_source(e))?;
    let opts = PyJson {
        indent,
        item_sep,
        key_sep,
        sort_keys: sort_keys.unwrap_or(false),
        ensure_ascii: ensure_ascii.unwrap_or(false),
    };
    let mut out = String::new();
    opts.write(&json, 0, &mut out);
    Ok(Value::from_safe_string(out))
}

/// Python's `json.dumps` layout.
struct PyJson {
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
    ensure_ascii: bool,
}

impl PyJson {
    fn newline(&self, depth: usize, out: &mut String) {
        if let Some(ind) = &self.indent {
            out.push('\n');
            for _ in 0..depth {
                out.push_str(ind);
            }
        }
    }

    fn string(&self, s: &str, out: &mut String) {
        out.push('"');
        for c in s.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                '\u{08}' => out.push_str("\\b"),
                '\u{0c}' => out.push_str("\\f"),
                c if (c as u32) < 0x20 || (self.ensure_ascii && (c as u32) > 0x7f) => {
                    let mut buf = [0u16; 2];
                    for unit in c.encode_utf16(&mut buf) {
                        out.push_str(&format!("\\u{unit:04x}"));
                    }
                }
                c => out.push(c),
            }
        }
        out.push('"');
    }

    fn write(&self, v: &serde_json::Value, depth: usize, out: &mut String) {
        use serde_json::Value as J;
        match v {
            J::Null => out.push_str("null"),
            J::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            J::Number(n) => out.push_str(&n.to_string()),
            J::String(s) => self.string(s, out),
            J::Array(items) => {
                if items.is_empty() {
                    out.push_str("[]");
                    return;
                }
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push_str(&self.item_sep);
                    }
                    self.newline(depth + 1, out);
                    self.write(item, depth + 1, out);
                }
                self.newline(depth, out);
                out.push(']');
            }
            J::Object(map) => {
                if map.is_empty() {
                    out.push_str("{}");
                    return;
                }
                let mut entries: Vec<(&String, &serde_json::Value)> = map.iter().collect();
                if self.sort_keys {
                    entries.sort_by(|a, b| a.0.cmp(b.0));
                }
                out.push('{');
                for (i, (k, item)) in entries.into_iter().enumerate() {
                    if i > 0 {
                        out.push_str(&self.item_sep);
                    }
                    self.newline(depth + 1, out);
                    self.string(k, out);
                    out.push_str(&self.key_sep);
                    self.write(item, depth + 1, out);
                }
                self.newline(depth, out);
                out.push('}');
            }
        }
    }
}

/// A minimal `strftime` for templates that print today's date (`%d %b %Y`, `%Y-%m-%d`, ...).
fn strftime_now(fmt: &str) -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    let days = secs.div_euclid(86_400);
    // Civil-from-days (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    let month = MONTHS[(m - 1) as usize];
    let mut out = String::new();
    let mut chars = fmt.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('d') => out.push_str(&format!("{d:02}")),
            Some('m') => out.push_str(&format!("{m:02}")),
            Some('Y') => out.push_str(&y.to_string()),
            Some('y') => out.push_str(&format!("{:02}", y % 100)),
            Some('b') => out.push_str(&month[..3]),
            Some('B') => out.push_str(month),
            Some('%') => out.push('%'),
            Some(o) => {
                out.push('%');
                out.push(o);
            }
            None => out.push('%'),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const CHATML: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    #[test]
    fn renders_chatml() {
        let t = ChatTemplate::new(CHATML, "", "<|im_end|>").unwrap();
        let s = t.render(&[ChatMessage::new("user", "hi")], true).unwrap();
        assert_eq!(s, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n");
    }

    #[test]
    fn raise_exception_is_an_error() {
        let t = ChatTemplate::new("{{ raise_exception('no system role') }}", "", "").unwrap();
        let e = t.render(&[], false).unwrap_err();
        assert!(e.to_string().contains("no system role"), "{e}");
    }

    #[test]
    fn pycompat_methods_work() {
        let t = ChatTemplate::new("{{ messages[0]['content'].strip().upper() }}", "", "").unwrap();
        assert_eq!(t.render(&[ChatMessage::new("user", "  ab ")], false).unwrap(), "AB");
    }

    #[test]
    fn strftime_formats() {
        let s = strftime_now("%Y-%m-%d");
        assert_eq!(s.len(), 10);
        assert!(s.starts_with("20"));
    }
}

#[cfg(test)]
mod tool_tests {
    use super::*;
    use serde_json::json;

    /// Qwen2.5's template, as shipped in its GGUF files (tools, tool calls, tool results).
    const QWEN25: &str = r#"{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools><|im_end|>\n" }}
{%- else %}
    {{- '<|im_start|>system\nYou are Qwen.<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}"#;

    /// Tools print as transformers prints them: the client's key order, `", "` / `": "`
    /// separators, no HTML escaping.
    #[test]
    fn tools_tool_calls_and_tool_results_render() {
        let t = ChatTemplate::new(QWEN25, "", "<|im_end|>").unwrap();
        let tools = vec![json!({"type": "function", "function": {"name": "get_weather",
            "description": "Weather <now> & 'then'", "parameters": {"type": "object"}}})];
        let messages = vec![
            ChatMessage::new("user", "Paris?"),
            ChatMessage {
                role: "assistant".into(),
                tool_calls: Some(vec![ChatToolCall {
                    id: "call_1".into(),
                    kind: "function".into(),
                    function: ChatFunctionCall {
                        name: "get_weather".into(),
                        arguments: json!({"city": "Paris", "note": "é\n"}),
                    },
                }]),
                ..Default::default()
            },
            ChatMessage {
                tool_call_id: Some("call_1".into()),
                ..ChatMessage::new("tool", "{\"t\": 18}")
            },
        ];
        let extras = ChatExtras {
            tools: Some(tools),
            ..Default::default()
        };
        let s = t.render_with(&messages, true, &extras).unwrap();
        assert_eq!(
            s,
            "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.\n\n# Tools\n\n<tools>\n\
             {\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"description\": \"Weather <now> & 'then'\", \"parameters\": {\"type\": \"object\"}}}\n\
             </tools><|im_end|>\n<|im_start|>user\nParis?<|im_end|>\n<|im_start|>assistant\n<tool_call>\n\
             {\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"note\": \"é\\n\"}}\n</tool_call><|im_end|>\n\
             <|im_start|>user\n<tool_response>\n{\"t\": 18}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
        );
        // Without tools the template takes its other branch; plain render is unchanged.
        let plain = t.render(&[ChatMessage::new("user", "hi")], true).unwrap();
        assert_eq!(
            plain,
            "<|im_start|>system\nYou are Qwen.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn kwargs_and_tool_choice_reach_the_template() {
        let src = "{{ enable_thinking }}|{{ tool_choice }}|{{ reasoning_effort }}|{{ messages | length }}";
        let t = ChatTemplate::new(src, "", "").unwrap();
        let mut kwargs = serde_json::Map::new();
        kwargs.insert("enable_thinking".into(), json!(false));
        kwargs.insert("reasoning_effort".into(), json!("low"));
        kwargs.insert("messages".into(), json!("ignored"));
        let extras = ChatExtras {
            tool_choice: Some(json!("required")),
            kwargs,
            ..Default::default()
        };
        let s = t.render_with(&[ChatMessage::new("user", "x")], true, &extras).unwrap();
        assert_eq!(s, "False|required|low|1", "pycompat prints booleans as Python does");
    }

    #[test]
    fn tojson_is_pythons_json_dumps() {
        let t = ChatTemplate::new(
            "{{ x | tojson }}|{{ x | tojson(indent=2) }}|{{ x | tojson(separators=[',', ':']) }}|{{ y | tojson(ensure_ascii=true) }}",
            "",
            "",
        )
        .unwrap();
        let tmpl = t.env.get_template("chat").unwrap();
        let s = tmpl
            .render(minijinja::context! { x => json!({"a": [1, 2.5, null], "b": {}}), y => "é😀" })
            .unwrap();
        assert_eq!(
            s,
            "{\"a\": [1, 2.5, null], \"b\": {}}|{\n  \"a\": [\n    1,\n    2.5,\n    null\n  ],\n  \"b\": {}\n}|{\"a\":[1,2.5,null],\"b\":{}}|\"\\u00e9\\ud83d\\ude00\""
        );
    }
}
