#!/usr/bin/env python3
"""Exercise a running Specula server with the official Anthropic Python client, unmodified.

Usage:
    python3 tests/anthropic_client.py --base-url http://127.0.0.1:8000 [--expect FILE] [--api-key KEY]

The base URL is the server's root (the client adds /v1/messages itself); a trailing /v1 is
dropped. The client sends the key as `x-api-key`.

Checks (greedy: `extra_body={"temperature": 0}`, the client's `create` has no `temperature`):
  * `models.list()` names the model;
  * a message (max_tokens 32): one text block with the expected text, `stop_reason` "end_turn" or
    "max_tokens" as expected, `usage.input_tokens + usage.cache_read_input_tokens` the expected
    prompt tokens, `usage.output_tokens` the expected completion tokens;
  * the same request through `client.messages.stream(...)`: `text_stream` joined is the same text,
    `get_final_message()` has the same content, stop_reason and usage;
  * the same with Specula's extension `extra_body={"spec": "ngram"}`, plain and streamed: the same
    text, and a `spec_stats` object on the message;
  * a stop sequence cut from the middle of the expected text, plain and streamed:
    `stop_reason` "stop_sequence", `stop_sequence` that string, the text before it;
  * `client.messages.count_tokens(...)` equals the expected prompt tokens;
  * errors: an unknown model raises `anthropic.NotFoundError` (404, `not_found_error`),
    `max_tokens=0` raises `anthropic.BadRequestError` (400, `invalid_request_error`), and (with
    --api-key, on a server started with that key) a wrong key raises
    `anthropic.AuthenticationError` (401, `authentication_error`);
  * (with a "tools" section in --expect) a tool forced with `tool_choice={"type": "tool", ...}`
    (the server's grammar makes even a model that was never shown the tool call it): one
    `tool_use` block whose parsed `input` validates against the tool's `input_schema`,
    `stop_reason` "tool_use"; the same streamed (the `input_json_delta` pieces concatenate to JSON
    equal to the input); then the round trip: the assistant content and a `tool_result` sent back
    give a message with a text block, its prompt counted the same by `count_tokens`.

--expect FILE is a JSON file written by the Rust end-to-end test (crates/specula/tests/e2e.rs)
with the inputs and the expected results computed with the library and the model's tokenizer
(the chat section is the one tests/openai_client.py gets: same messages, same greedy output):

    {"model": "...",
     "chat": {"messages": [...], "max_tokens": 32, "text": "...", "finish_reason": "stop|length",
              "prompt_tokens": N, "completion_tokens": N},
     "spec": {"mode": "ngram", "decode_path": "ngram"},
     "tools": {"messages": [...], "tools": [{"name", "description", "input_schema"}], "name": "...",
               "input": {...}, "result": "...", "max_tokens": N}}

Any key may be left out; what is given is asserted. Without --expect only the server's
self-consistency is checked. Prints one "OK ..." line per passed check; exits 1 with a message
on the first mismatch, 2 when the `anthropic` package is missing.
"""

import argparse
import json
import sys
import traceback

try:
    import anthropic
except ImportError as e:  # pragma: no cover - depends on the environment
    print(f"error: cannot import the anthropic package ({e}); run `pip install anthropic`", file=sys.stderr)
    sys.exit(2)


class Mismatch(Exception):
    pass


def check(cond, message):
    if not cond:
        raise Mismatch(message)


def check_eq(what, got, want):
    check(got == want, f"{what}: got {got!r}, expected {want!r}")


def ok(message):
    print(f"OK {message}", flush=True)


# The chat section's finish_reason (the library's) as Anthropic's stop_reason.
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens"}

GREEDY = {"temperature": 0}


def to_anthropic(messages):
    """OpenAI-style [{"role", "content"}] messages as Anthropic's (system, messages)."""
    system = "\n".join(m["content"] for m in messages if m["role"] == "system")
    rest = [{"role": m["role"], "content": m["content"]} for m in messages if m["role"] != "system"]
    return system or None, rest


def prompt_tokens(usage):
    """All the prompt's tokens: Anthropic counts those read from the cache apart."""
    return usage.input_tokens + (usage.cache_read_input_tokens or 0) + (usage.cache_creation_input_tokens or 0)


def only_text(what, message):
    """The text of a message that must be one text block."""
    check_eq(f"{what} type", message.type, "message")
    check_eq(f"{what} role", message.role, "assistant")
    kinds = [b.type for b in message.content]
    check_eq(f"{what} content block types", kinds, ["text"])
    return message.content[0].text


def check_message(what, message, exp, model, text=None):
    """A plain text answer against the expected values (keys that are present)."""
    check_eq(f"{what} model", message.model, model)
    check(message.id.startswith("msg_"), f"{what}: id {message.id!r} does not start with msg_")
    got = only_text(what, message)
    if text is not None:
        check_eq(f"{what} text", got, text)
    elif "text" in exp:
        check_eq(f"{what} text", got, exp["text"])
    check(message.stop_reason in ("end_turn", "max_tokens"), f"{what}: stop_reason {message.stop_reason!r}")
    if text is None and "finish_reason" in exp:
        check_eq(f"{what} stop_reason", message.stop_reason, STOP_REASONS.get(exp["finish_reason"]))
    check_eq(f"{what} stop_sequence", message.stop_sequence, None)
    u = message.usage
    check(u.output_tokens > 0, f"{what}: usage.output_tokens = {u.output_tokens}")
    check(prompt_tokens(u) > 0, f"{what}: no prompt tokens in {u}")
    if "prompt_tokens" in exp:
        check_eq(f"{what} usage.input_tokens + cache_read_input_tokens", prompt_tokens(u), exp["prompt_tokens"])
    if text is None and "completion_tokens" in exp:
        check_eq(f"{what} usage.output_tokens", u.output_tokens, exp["completion_tokens"])
    return got


def stream_message(client, params):
    """Returns (text joined from text_stream, final message) of a streamed request."""
    with client.messages.stream(**params) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    return text, final


def check_error(what, call, exc, status, kind):
    try:
        r = call()
    except exc as e:
        check_eq(f"{what} status", e.status_code, status)
        body = e.body if isinstance(e.body, dict) else {}
        check_eq(f"{what} body type", body.get("type"), "error")
        check_eq(f"{what} error.type", (body.get("error") or {}).get("type"), kind)
        return (body.get("error") or {}).get("message", "")
    except anthropic.APIStatusError as e:
        raise Mismatch(f"{what}: {type(e).__name__} ({e.status_code}) instead of {exc.__name__}: {e.body}")
    raise Mismatch(f"{what}: no error, got {r!r}")


def schema_errors(value, schema, path="$"):
    """Validate `value` against the JSON Schema subset a tool's input_schema uses here (type,
    properties, required, additionalProperties, items, enum). Returns a list of errors."""
    types = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}
    t = schema.get("type")
    if t == "integer":
        if not (isinstance(value, int) and not isinstance(value, bool)):
            return [f"{path}: expected integer, got {value!r}"]
    elif t == "number":
        if not (isinstance(value, (int, float)) and not isinstance(value, bool)):
            return [f"{path}: expected number, got {value!r}"]
    elif t is not None and not isinstance(value, types[t]):
        return [f"{path}: expected {t}, got {value!r}"]
    errs = []
    if "enum" in schema and value not in schema["enum"]:
        errs.append(f"{path}: {value!r} not in {schema['enum']}")
    if isinstance(value, dict):
        props = schema.get("properties", {})
        for k in schema.get("required", []):
            if k not in value:
                errs.append(f"{path}: missing required {k!r}")
        for k, v in value.items():
            if k in props:
                errs += schema_errors(v, props[k], f"{path}.{k}")
            elif schema.get("additionalProperties") is False:
                errs.append(f"{path}: unexpected property {k!r}")
    if isinstance(value, list):
        for i, v in enumerate(value):
            errs += schema_errors(v, schema.get("items", {}), f"{path}[{i}]")
    return errs


def run_tools(client, model, exp):
    """A forced tool call, plain and streamed, then the round trip with a tool_result."""
    tools = exp["tools"]
    name = exp.get("name") or tools[0]["name"]
    schema = next(t for t in tools if t["name"] == name)["input_schema"]
    max_tokens = exp.get("max_tokens", 64)
    params = dict(model=model, max_tokens=max_tokens, messages=exp["messages"], tools=tools,
                  tool_choice={"type": "tool", "name": name}, extra_body=GREEDY)

    msg = client.messages.create(**params)
    check_eq("tool_use stop_reason", msg.stop_reason, "tool_use")
    uses = [b for b in msg.content if b.type == "tool_use"]
    check_eq("tool_use: number of tool_use blocks", len(uses), 1)
    check(all(b.type in ("tool_use", "text") for b in msg.content), f"tool_use: content {msg.content}")
    use = uses[0]
    check_eq("tool_use name", use.name, name)
    check(isinstance(use.id, str) and use.id, f"tool_use: id {use.id!r}")
    check(isinstance(use.input, dict), f"tool_use: input is not an object: {use.input!r}")
    errs = schema_errors(use.input, schema)
    check(not errs, f"tool_use: input {use.input!r} does not validate against {schema}: {errs}")
    if "input" in exp:
        check_eq("tool_use input", use.input, exp["input"])
    ok(f"messages.create with tool_choice tool: tool_use {use.name}({json.dumps(use.input)}), stop_reason=tool_use")

    partial = []
    with client.messages.stream(**params) as stream:
        for event in stream:
            if event.type == "content_block_delta" and event.delta.type == "input_json_delta":
                partial.append(event.delta.partial_json)
        final = stream.get_final_message()
    check_eq("streamed tool_use stop_reason", final.stop_reason, "tool_use")
    s_uses = [b for b in final.content if b.type == "tool_use"]
    check_eq("streamed tool_use blocks", len(s_uses), 1)
    check_eq("streamed tool_use name", s_uses[0].name, name)
    check_eq("streamed tool_use input", s_uses[0].input, use.input)
    check(partial, "streamed tool_use: no input_json_delta events")
    check_eq("streamed input_json_delta pieces (JSON)", json.loads("".join(partial)), use.input)
    ok(f"streamed tool_use: {len(partial)} input_json_delta pieces concatenate to {''.join(partial)!r}")

    result = exp.get("result", "ok")
    turn = list(exp["messages"]) + [
        {"role": "assistant", "content": msg.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": result}]},
    ]
    answer = client.messages.create(model=model, max_tokens=max_tokens, messages=turn, tools=tools,
                                    extra_body=GREEDY)
    text = only_text("tool round trip", answer)
    check(text.strip(), f"tool round trip: empty text {text!r}")
    check(answer.stop_reason in ("end_turn", "max_tokens"), f"tool round trip: stop_reason {answer.stop_reason!r}")
    counted = client.messages.count_tokens(model=model, messages=turn, tools=tools).input_tokens
    check_eq("tool round trip: count_tokens vs usage", counted, prompt_tokens(answer.usage))
    without = client.messages.count_tokens(model=model, messages=exp["messages"], tools=tools).input_tokens
    check(counted > without, f"tool round trip: {counted} prompt tokens, not more than the first turn's {without}")
    ok(f"tool round trip (tool_result {result!r}): {counted} prompt tokens, stop_reason={answer.stop_reason}, "
       f"text={text!r}")


def run(args, expect):
    base_url = args.base_url.rstrip("/")
    if base_url.endswith("/v1"):
        base_url = base_url[: -len("/v1")]
    client = anthropic.Anthropic(base_url=base_url, api_key=args.api_key, max_retries=0, timeout=args.timeout)
    # Specula's /v1/models is OpenAI's list; the client reads the ids from it all the same.
    models = [m.id for m in client.models.list()]
    model = expect.get("model") or (models[0] if models else None)
    check(model in models, f"models.list(): {model!r} not in {models}")
    ok(f"models.list() -> {models}")

    # --- a message ---------------------------------------------------------------------------
    exp = expect.get("chat", {})
    system, messages = to_anthropic(
        exp.get("messages") or [{"role": "user", "content": "What is the capital city of Australia?"}]
    )
    max_tokens = exp.get("max_tokens", 32)
    params = dict(model=model, max_tokens=max_tokens, messages=messages, extra_body=GREEDY)
    if system is not None:
        params["system"] = system

    msg = client.messages.create(**params)
    text = check_message("message", msg, exp, model)
    check(text, f"message: empty text {text!r}")
    check(msg.usage.output_tokens <= max_tokens, f"message: {msg.usage.output_tokens} > {max_tokens} tokens")
    ok(
        f"messages.create: {prompt_tokens(msg.usage)} prompt tokens (input_tokens={msg.usage.input_tokens}, "
        f"cache_read_input_tokens={msg.usage.cache_read_input_tokens}) + {msg.usage.output_tokens} output, "
        f"stop_reason={msg.stop_reason}, text={text!r}"
    )

    # --- streamed ----------------------------------------------------------------------------
    s_text, final = stream_message(client, params)
    check_eq("stream: text_stream joined vs non-streamed text", s_text, text)
    f_text = check_message("stream final message", final, exp, model, text=text)
    check_eq("stream final message text", f_text, text)
    check_eq("stream final message stop_reason", final.stop_reason, msg.stop_reason)
    check_eq("stream final message output_tokens", final.usage.output_tokens, msg.usage.output_tokens)
    check_eq("stream final message prompt tokens", prompt_tokens(final.usage), prompt_tokens(msg.usage))
    ok(f"messages.stream: text_stream and get_final_message() equal the non-streamed message "
       f"(stop_reason={final.stop_reason})")

    # --- speculative decoding (Specula's `spec` extension) ------------------------------------
    exp_spec = expect.get("spec", {})
    mode = exp_spec.get("mode", "ngram")
    sp_params = dict(params, extra_body=dict(GREEDY, spec=mode))
    sp = client.messages.create(**sp_params)
    check_eq(f"spec={mode} text", only_text(f"spec={mode}", sp), text)
    check_eq(f"spec={mode} stop_reason", sp.stop_reason, msg.stop_reason)
    check_eq(f"spec={mode} output_tokens", sp.usage.output_tokens, msg.usage.output_tokens)
    check_eq(f"spec={mode} prompt tokens", prompt_tokens(sp.usage), prompt_tokens(msg.usage))
    stats = getattr(sp, "spec_stats", None)
    check(isinstance(stats, dict), f"spec={mode}: no spec_stats object on the message ({stats!r})")
    if "decode_path" in exp_spec:
        check(
            str(stats.get("decode_path", "")).split(" ")[0] == exp_spec["decode_path"],
            f"spec={mode}: decode_path {stats.get('decode_path')!r}, expected {exp_spec['decode_path']!r}",
        )
    sp_text, sp_final = stream_message(client, sp_params)
    check_eq(f"stream(spec={mode}) text", sp_text, text)
    check_eq(f"stream(spec={mode}) stop_reason", sp_final.stop_reason, msg.stop_reason)
    ok(
        f"messages with extra_body={{'spec': {mode!r}}} (also streamed) equal the plain text: "
        f"decode_path={stats.get('decode_path')!r}, drafted={stats.get('drafted')}, accepted={stats.get('accepted')}"
    )

    # --- a stop sequence ---------------------------------------------------------------------
    # A piece of the text from its middle, whitespace trimmed (Anthropic refuses blank ones): the
    # answer is the text before its first occurrence.
    mid = len(text) // 2
    stop = text[mid : mid + 6].strip()
    check(stop, f"no stop sequence can be cut from the middle of {text!r}")
    before = text[: text.index(stop)]
    st_params = dict(params, stop_sequences=[stop])
    st = client.messages.create(**st_params)
    check_eq("stop_sequences stop_reason", st.stop_reason, "stop_sequence")
    check_eq("stop_sequences stop_sequence", st.stop_sequence, stop)
    check_eq("stop_sequences text", "".join(b.text for b in st.content if b.type == "text"), before)
    st_text, st_final = stream_message(client, st_params)
    check_eq("stream(stop_sequences) text", st_text, before)
    check_eq("stream(stop_sequences) stop_reason", st_final.stop_reason, "stop_sequence")
    check_eq("stream(stop_sequences) stop_sequence", st_final.stop_sequence, stop)
    ok(f"stop_sequences=[{stop!r}] (also streamed): stop_reason=stop_sequence, text={before!r}")

    # --- count_tokens ------------------------------------------------------------------------
    count_params = dict(model=model, messages=messages)
    if system is not None:
        count_params["system"] = system
    counted = client.messages.count_tokens(**count_params).input_tokens
    check_eq("count_tokens vs the message's prompt tokens", counted, prompt_tokens(msg.usage))
    if "prompt_tokens" in exp:
        check_eq("count_tokens", counted, exp["prompt_tokens"])
    ok(f"messages.count_tokens: input_tokens={counted}")

    # --- errors ------------------------------------------------------------------------------
    m = check_error(
        "unknown model",
        lambda: client.messages.create(**dict(params, model="no-such-model")),
        anthropic.NotFoundError,
        404,
        "not_found_error",
    )
    m0 = check_error(
        "max_tokens=0",
        lambda: client.messages.create(**dict(params, max_tokens=0)),
        anthropic.BadRequestError,
        400,
        "invalid_request_error",
    )
    ok(f"errors: unknown model -> NotFoundError ({m!r}); max_tokens=0 -> BadRequestError ({m0!r})")
    if args.api_key_required:
        wrong = anthropic.Anthropic(base_url=base_url, api_key=args.api_key + "-wrong", max_retries=0,
                                    timeout=args.timeout)
        m = check_error("wrong key", lambda: wrong.messages.create(**params), anthropic.AuthenticationError, 401,
                        "authentication_error")
        ok(f"x-api-key: the right key is accepted, a wrong one -> AuthenticationError ({m!r})")

    # --- tools -------------------------------------------------------------------------------
    if "tools" in expect:
        run_tools(client, model, expect["tools"])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", required=True, help="the server's root, e.g. http://127.0.0.1:8000")
    ap.add_argument("--expect", help="JSON file with inputs and expected results (see the module docstring)")
    ap.add_argument("--api-key", default="specula-test", help="sent as x-api-key")
    ap.add_argument(
        "--api-key-required",
        action="store_true",
        help="the server was started with --api-key: check that a wrong key is refused",
    )
    ap.add_argument("--timeout", type=float, default=120.0, help="per-request timeout in seconds")
    args = ap.parse_args()
    expect = {}
    if args.expect:
        with open(args.expect, encoding="utf-8") as f:
            expect = json.load(f)
    try:
        run(args, expect)
    except Mismatch as e:
        print(f"FAIL {e}", file=sys.stderr)
        return 1
    except Exception as e:  # connection errors, API errors, bad response shapes
        traceback.print_exc()
        print(f"FAIL {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print("OK all checks passed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
