#!/usr/bin/env python3
"""Exercise a running Specula server with the official OpenAI Python client, unmodified.

Usage:
    python3 tests/openai_client.py --base-url http://127.0.0.1:8000/v1 [--expect FILE]

Checks (greedy, temperature 0):
  * a chat completion (max_tokens 32);
  * the same request streamed with stream_options={"include_usage": True}: the collected deltas
    equal the non-streamed content, the last chunk with a choice carries the finish_reason, and
    the final chunk carries the usage (no choices);
  * the same request streamed without include_usage: same content, no usage chunk;
  * the same request with Specula's extension `extra_body={"spec": "ngram"}` (speculative
    decoding), non-streamed and streamed: the same content and usage, plus a `spec_stats` object
    (on the response; on the finish_reason chunk of the stream);
  * a legacy completion (max_tokens 16).

With `--only json` (and a "json" section in --expect: a list of {"id", "messages", "max_tokens",
"schema"}), it checks structured output: for each prompt, `response_format` json_schema (strict)
gives content that parses and validates against the schema, the same content streamed and with
`extra_body={"spec": "ngram"}`; then `json_object` gives a JSON object.

With `--only reasoning` (and a "reasoning" section: {"messages", "max_tokens", "reasoning_content",
"content"}), on a model whose template opens `<think>`: `message.reasoning_content` and `content`
are the expected split, and the streamed `delta.reasoning_content` pieces concatenate to it.

With `--only tools` (and a "tools" section in --expect), it checks tool calls instead, on a model
that makes them (the Rust test uses Qwen2.5-Coder-0.5B):
  * a tool call: finish_reason "tool_calls", one call with the expected name and arguments;
  * the same request streamed: the call's id, type and name come first, its argument deltas
    concatenate to the non-streamed arguments (same string, same JSON);
  * the round trip: the assistant message and a `role: "tool"` result are sent back (with
    tool_choice "none"), and the answer contains the expected text;
  * max_tokens cutting the call: finish_reason "length" and no tool_calls.

--expect FILE is a JSON file written by the Rust end-to-end test (crates/specula/tests/e2e.rs)
with the inputs and the expected results computed with the library and the model's tokenizer:

    {"model": "...",
     "chat": {"messages": [...], "max_tokens": 32, "text": "...", "finish_reason": "...",
              "prompt_tokens": N, "completion_tokens": N},
     "completion": {"prompt": "...", "max_tokens": 16, "text": "...", "finish_reason": "...",
                    "prompt_tokens": N, "completion_tokens": N},
     "spec": {"mode": "ngram", "decode_path": "ngram", "plain_decode_path": "mtp+ngram"},
     "tools": {"messages": [...], "tools": [...], "name": "...", "arguments": {...},
               "result": "...", "answer_contains": "...", "cut_max_tokens": N}}

Any key may be left out; what is given is asserted. Without --expect only the server's
self-consistency is checked. Prints one "OK ..." line per passed check; exits 1 with a message
on the first mismatch, 2 when the `openai` package is missing.
"""

import argparse
import json
import sys
import traceback

try:
    from openai import OpenAI
except ImportError as e:  # pragma: no cover - depends on the environment
    print(f"error: cannot import the openai package ({e}); run `pip install openai`", file=sys.stderr)
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


def check_expected(what, exp, text, finish_reason, usage):
    """Compare a result with the expected values from --expect (keys that are present)."""
    if "text" in exp:
        check_eq(f"{what} text", text, exp["text"])
    if "finish_reason" in exp:
        check_eq(f"{what} finish_reason", finish_reason, exp["finish_reason"])
    if "prompt_tokens" in exp:
        check_eq(f"{what} usage.prompt_tokens", usage.prompt_tokens, exp["prompt_tokens"])
    if "completion_tokens" in exp:
        check_eq(f"{what} usage.completion_tokens", usage.completion_tokens, exp["completion_tokens"])


def check_usage(what, usage):
    check(usage is not None, f"{what}: no usage")
    check(usage.prompt_tokens > 0, f"{what}: usage.prompt_tokens = {usage.prompt_tokens}")
    check(usage.completion_tokens > 0, f"{what}: usage.completion_tokens = {usage.completion_tokens}")
    check_eq(f"{what} usage.total_tokens", usage.total_tokens, usage.prompt_tokens + usage.completion_tokens)


def collect_stream(stream, what):
    """Returns (content, finish_reason, usage, chunks) of a streamed chat completion."""
    chunks = list(stream)
    check(len(chunks) >= 2, f"{what}: only {len(chunks)} chunks")
    parts = []
    finish_reason = None
    finish_index = None
    for i, chunk in enumerate(chunks):
        check_eq(f"{what} chunk {i} object", chunk.object, "chat.completion.chunk")
        for choice in chunk.choices:
            check_eq(f"{what} chunk {i} choice index", choice.index, 0)
            check(finish_reason is None, f"{what}: chunk {i} has a choice after the finish_reason chunk")
            if choice.delta is not None and choice.delta.content:
                parts.append(choice.delta.content)
            if choice.finish_reason is not None:
                finish_reason = choice.finish_reason
                finish_index = i
    check(finish_reason is not None, f"{what}: no chunk carries a finish_reason")
    ids = {c.id for c in chunks}
    check(len(ids) == 1, f"{what}: chunks have different ids {ids}")
    return "".join(parts), finish_reason, finish_index, chunks


def run_tools(client, model, exp):
    """Tool calls through the client: call, streamed call, round trip, cut call."""
    params = dict(model=model, messages=exp["messages"], tools=exp["tools"], temperature=0, max_tokens=60)

    resp = client.chat.completions.create(**params)
    choice = resp.choices[0]
    check_eq("tools finish_reason", choice.finish_reason, "tool_calls")
    calls = choice.message.tool_calls or []
    check_eq("tools: number of calls", len(calls), 1)
    call = calls[0]
    check_eq("tools call type", call.type, "function")
    check(call.id.startswith("call_"), f"tools: call id {call.id!r}")
    check_eq("tools call name", call.function.name, exp["name"])
    check_eq("tools call arguments", json.loads(call.function.arguments), exp["arguments"])
    ok(f"tool call: {call.function.name}({call.function.arguments}), finish_reason=tool_calls")

    stream = client.chat.completions.create(**params, stream=True)
    ids, names, arguments, content, finish = {}, {}, {}, [], None
    for chunk in stream:
        for c in chunk.choices:
            if c.delta.content:
                content.append(c.delta.content)
            for tc in c.delta.tool_calls or []:
                if tc.id is not None:
                    check(tc.index not in ids, f"streamed call {tc.index} started twice")
                    ids[tc.index] = tc.id
                    names[tc.index] = tc.function.name
                    check_eq("streamed call type", tc.type, "function")
                else:
                    check(tc.index in ids, f"arguments of streamed call {tc.index} before its start")
                arguments[tc.index] = arguments.get(tc.index, "") + (tc.function.arguments or "")
            if c.finish_reason is not None:
                finish = c.finish_reason
    check_eq("streamed finish_reason", finish, "tool_calls")
    check_eq("streamed content", "".join(content), "")
    check_eq("streamed calls", sorted(ids), [0])
    check_eq("streamed call name", names[0], call.function.name)
    check_eq("streamed arguments (text)", arguments[0], call.function.arguments)
    check_eq("streamed arguments (JSON)", json.loads(arguments[0]), json.loads(call.function.arguments))
    ok(f"streamed tool call: argument deltas concatenate to {arguments[0]!r}")

    messages = list(exp["messages"]) + [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": exp["result"]},
    ]
    answer = client.chat.completions.create(
        model=model, messages=messages, tools=exp["tools"], tool_choice="none", temperature=0, max_tokens=60
    )
    a = answer.choices[0]
    check(not a.message.tool_calls, f"round trip: tool_calls in the answer {a.message.tool_calls}")
    check(
        exp["answer_contains"] in (a.message.content or ""),
        f"round trip: answer {a.message.content!r} lacks {exp['answer_contains']!r}",
    )
    ok(f"tool round trip: answer {a.message.content!r}")

    cut = client.chat.completions.create(**dict(params, max_tokens=exp["cut_max_tokens"]))
    c = cut.choices[0]
    check_eq("cut call finish_reason", c.finish_reason, "length")
    check(not c.message.tool_calls, f"cut call presented as a call: {c.message.tool_calls}")
    ok(f"max_tokens={exp['cut_max_tokens']} cutting the call: finish_reason=length, no tool_calls")


def schema_errors(value, schema, path="$"):
    """Validate `value` against the JSON Schema subset the tests use (type, properties, required,
    additionalProperties, items, minItems, maxItems, enum, pattern). Returns a list of errors."""
    import re

    errs = []
    types = {
        "object": dict,
        "array": list,
        "string": str,
        "boolean": bool,
        "null": type(None),
    }
    t = schema.get("type")
    if t == "integer":
        if not (isinstance(value, int) and not isinstance(value, bool)):
            return [f"{path}: expected integer, got {value!r}"]
    elif t == "number":
        if not (isinstance(value, (int, float)) and not isinstance(value, bool)):
            return [f"{path}: expected number, got {value!r}"]
    elif t is not None and not isinstance(value, types[t]):
        return [f"{path}: expected {t}, got {value!r}"]
    if "enum" in schema and value not in schema["enum"]:
        errs.append(f"{path}: {value!r} not in {schema['enum']}")
    if "pattern" in schema and isinstance(value, str) and not re.search(schema["pattern"], value):
        errs.append(f"{path}: {value!r} does not match {schema['pattern']!r}")
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
        if "minItems" in schema and len(value) < schema["minItems"]:
            errs.append(f"{path}: {len(value)} < minItems {schema['minItems']}")
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            errs.append(f"{path}: {len(value)} > maxItems {schema['maxItems']}")
        for i, v in enumerate(value):
            errs += schema_errors(v, schema.get("items", {}), f"{path}[{i}]")
    return errs


def run_json(client, model, cases):
    """Structured output through the client: json_schema per prompt (plain, streamed, spec),
    then json_object."""
    for case in cases:
        rf = {"type": "json_schema", "json_schema": {"name": case["id"], "schema": case["schema"], "strict": True}}
        params = dict(model=model, messages=case["messages"], temperature=0, max_tokens=case["max_tokens"],
                      response_format=rf)
        resp = client.chat.completions.create(**params)
        choice = resp.choices[0]
        content = choice.message.content
        check_eq(f"{case['id']} json_schema finish_reason", choice.finish_reason, "stop")
        try:
            value = json.loads(content)
        except ValueError as e:
            raise Mismatch(f"{case['id']}: json_schema content is not JSON ({e}): {content!r}")
        errs = schema_errors(value, case["schema"])
        check(not errs, f"{case['id']}: content does not validate: {errs}: {content!r}")
        s_content, s_finish, _, _ = collect_stream(client.chat.completions.create(**params, stream=True),
                                                  f"{case['id']} stream")
        check_eq(f"{case['id']} streamed content", s_content, content)
        check_eq(f"{case['id']} streamed finish_reason", s_finish, "stop")
        sp = client.chat.completions.create(**params, extra_body={"spec": "ngram"})
        check_eq(f"{case['id']} spec=ngram content", sp.choices[0].message.content, content)
        stats = getattr(sp, "spec_stats", None) or {}
        ok(
            f"{case['id']}: json_schema content validates ({len(content)} bytes, {resp.usage.completion_tokens} "
            f"tokens); streamed and spec=ngram identical (drafted={stats.get('drafted')}, "
            f"accepted={stats.get('accepted')}): {content!r}"
        )
    # json_object bounds nothing, so take the prompt whose greedy answer does not loop (p38; the
    # first, p32, repeats a genre until max_tokens, and an unbounded array never closes).
    case = cases[-1]
    resp = client.chat.completions.create(model=model, messages=case["messages"], temperature=0,
                                          max_tokens=case["max_tokens"], response_format={"type": "json_object"})
    content = resp.choices[0].message.content
    try:
        value = json.loads(content)
    except ValueError as e:
        raise Mismatch(f"json_object content is not JSON ({e}): {content!r}")
    check(isinstance(value, dict), f"json_object: not an object: {content!r}")
    ok(f"json_object: {content!r}")


def run_reasoning(client, model, exp):
    """reasoning_content through the client, plain and streamed."""
    params = dict(model=model, messages=exp["messages"], temperature=0, max_tokens=exp["max_tokens"],
                  extra_body={"ignore_eos": True})
    resp = client.chat.completions.create(**params)
    msg = resp.choices[0].message
    got = getattr(msg, "reasoning_content", None)
    check_eq("reasoning_content", got, exp["reasoning_content"])
    check_eq("content after the reasoning", msg.content or "", exp["content"])
    ok(f"reasoning_content ({len(got)} chars) and content ({len(msg.content or '')} chars) as expected")
    pieces, content = [], []
    for chunk in client.chat.completions.create(**params, stream=True):
        for c in chunk.choices:
            r = getattr(c.delta, "reasoning_content", None)
            if r:
                pieces.append(r)
            if c.delta.content:
                content.append(c.delta.content)
    check_eq("streamed reasoning_content", "".join(pieces), exp["reasoning_content"])
    check_eq("streamed content", "".join(content), exp["content"])
    ok(f"streamed reasoning_content in {len(pieces)} deltas equals the non-streamed one")


def run(args, expect):
    client = OpenAI(base_url=args.base_url, api_key="specula-test", max_retries=0, timeout=args.timeout)

    models = [m.id for m in client.models.list().data]
    model = expect.get("model") or (models[0] if models else None)
    check(model in models, f"models.list(): {model!r} not in {models}")
    ok(f"models.list() -> {models}")

    if args.only == "reasoning":
        check("reasoning" in expect, "--only reasoning needs a 'reasoning' section in --expect")
        run_reasoning(client, model, expect["reasoning"])
        return

    if args.only == "json":
        check("json" in expect, "--only json needs a 'json' section in --expect")
        run_json(client, model, expect["json"])
        return

    if args.only == "tools":
        check("tools" in expect, "--only tools needs a 'tools' section in --expect")
        run_tools(client, model, expect["tools"])
        return

    # --- chat completion ---------------------------------------------------------------------
    exp = expect.get("chat", {})
    messages = exp.get("messages") or [{"role": "user", "content": "What is the capital city of Australia?"}]
    max_tokens = exp.get("max_tokens", 32)
    params = dict(model=model, messages=messages, temperature=0, max_tokens=max_tokens)

    resp = client.chat.completions.create(**params)
    check_eq("chat object", resp.object, "chat.completion")
    check_eq("chat model", resp.model, model)
    check_eq("chat choices", len(resp.choices), 1)
    choice = resp.choices[0]
    check_eq("chat message.role", choice.message.role, "assistant")
    content = choice.message.content
    check(isinstance(content, str) and content, f"chat: empty content {content!r}")
    check(choice.finish_reason in ("stop", "length"), f"chat: finish_reason {choice.finish_reason!r}")
    check_usage("chat", resp.usage)
    check(resp.usage.completion_tokens <= max_tokens, f"chat: {resp.usage.completion_tokens} > {max_tokens} tokens")
    check_expected("chat", exp, content, choice.finish_reason, resp.usage)
    ok(
        f"chat.completions.create: {resp.usage.prompt_tokens} prompt + {resp.usage.completion_tokens} completion "
        f"tokens, finish_reason={choice.finish_reason}, content={content!r}"
    )

    # --- streamed, with usage ----------------------------------------------------------------
    stream = client.chat.completions.create(**params, stream=True, stream_options={"include_usage": True})
    s_content, s_finish, s_finish_index, chunks = collect_stream(stream, "stream(include_usage)")
    check_eq("stream content vs non-stream content", s_content, content)
    check_eq("stream finish_reason vs non-stream", s_finish, choice.finish_reason)
    last = chunks[-1]
    check_eq("stream: choices of the last (usage) chunk", last.choices, [])
    check_eq("stream: the finish_reason chunk is the one before the usage chunk", s_finish_index, len(chunks) - 2)
    check_usage("stream last chunk", last.usage)
    check_eq("stream usage.prompt_tokens", last.usage.prompt_tokens, resp.usage.prompt_tokens)
    check_eq("stream usage.completion_tokens", last.usage.completion_tokens, resp.usage.completion_tokens)
    check_expected("stream", exp, s_content, s_finish, last.usage)
    for i, c in enumerate(chunks[:-1]):
        check(getattr(c, "usage", None) is None, f"stream: chunk {i} (not the last) has usage {c.usage}")
    ok(f"streamed chat ({len(chunks)} chunks) equals the non-streamed content; last chunk usage matches")

    # --- streamed, without usage -------------------------------------------------------------
    stream = client.chat.completions.create(**params, stream=True)
    p_content, p_finish, p_finish_index, chunks = collect_stream(stream, "stream")
    check_eq("plain stream content vs non-stream content", p_content, content)
    check_eq("plain stream finish_reason", p_finish, choice.finish_reason)
    check_eq("plain stream: the last chunk carries the finish_reason", p_finish_index, len(chunks) - 1)
    for i, c in enumerate(chunks):
        check(getattr(c, "usage", None) is None, f"plain stream: chunk {i} has usage {c.usage} (not asked for)")
    ok(f"streamed chat without include_usage ({len(chunks)} chunks): same content, no usage chunk")

    # --- speculative decoding (Specula's `spec` extension) ------------------------------------
    exp_spec = expect.get("spec", {})
    mode = exp_spec.get("mode", "ngram")
    sp = client.chat.completions.create(**params, extra_body={"spec": mode})
    check_eq(f"spec={mode} content vs plain content", sp.choices[0].message.content, content)
    check_eq(f"spec={mode} finish_reason", sp.choices[0].finish_reason, choice.finish_reason)
    check_eq(f"spec={mode} usage.prompt_tokens", sp.usage.prompt_tokens, resp.usage.prompt_tokens)
    check_eq(f"spec={mode} usage.completion_tokens", sp.usage.completion_tokens, resp.usage.completion_tokens)
    stats = getattr(sp, "spec_stats", None)
    check(isinstance(stats, dict), f"spec={mode}: no spec_stats object ({stats!r})")
    for key in ("decode_path", "drafted", "accepted", "target_steps", "committed", "tau"):
        check(key in stats, f"spec={mode}: spec_stats lacks {key!r}: {stats}")
    if "decode_path" in exp_spec:
        check(
            stats["decode_path"].split(" ")[0] == exp_spec["decode_path"],
            f"spec={mode}: decode_path {stats['decode_path']!r}, expected {exp_spec['decode_path']!r}",
        )
    # A request without `spec` runs the server's default (`serve --spec default` unless set).
    plain_stats = getattr(resp, "spec_stats", None)
    plain_path = exp_spec.get("plain_decode_path", "ar")
    check(
        isinstance(plain_stats, dict) and str(plain_stats.get("decode_path", "")).split(" ")[0] == plain_path,
        f"plain request: spec_stats {plain_stats!r}, expected decode_path {plain_path!r}",
    )
    stream = client.chat.completions.create(**params, stream=True, extra_body={"spec": mode})
    sp_content, sp_finish, sp_finish_index, chunks = collect_stream(stream, f"stream(spec={mode})")
    check_eq(f"stream(spec={mode}) content", sp_content, content)
    check_eq(f"stream(spec={mode}) finish_reason", sp_finish, choice.finish_reason)
    s_stats = getattr(chunks[sp_finish_index], "spec_stats", None)
    check(isinstance(s_stats, dict), f"stream(spec={mode}): the finish_reason chunk has no spec_stats")
    check_eq(f"stream(spec={mode}) spec_stats.decode_path", s_stats.get("decode_path"), stats["decode_path"])
    ok(
        f"chat with extra_body={{'spec': {mode!r}}} (also streamed) equals the plain content: "
        f"decode_path={stats['decode_path']!r}, drafted={stats['drafted']}, accepted={stats['accepted']}, "
        f"tau={stats['tau']:.2f}"
    )

    # --- legacy completion -------------------------------------------------------------------
    exp = expect.get("completion", {})
    prompt = exp.get("prompt", "The three primary colours are")
    max_tokens = exp.get("max_tokens", 16)
    resp = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0)
    check_eq("completion object", resp.object, "text_completion")
    check_eq("completion model", resp.model, model)
    check_eq("completion choices", len(resp.choices), 1)
    choice = resp.choices[0]
    check(isinstance(choice.text, str) and choice.text, f"completion: empty text {choice.text!r}")
    check(choice.finish_reason in ("stop", "length"), f"completion: finish_reason {choice.finish_reason!r}")
    check_usage("completion", resp.usage)
    check(resp.usage.completion_tokens <= max_tokens, f"completion: {resp.usage.completion_tokens} > {max_tokens}")
    check_expected("completion", exp, choice.text, choice.finish_reason, resp.usage)
    ok(
        f"completions.create: {resp.usage.prompt_tokens} prompt + {resp.usage.completion_tokens} completion "
        f"tokens, finish_reason={choice.finish_reason}, text={choice.text!r}"
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000/v1")
    ap.add_argument("--expect", help="JSON file with inputs and expected results (see the module docstring)")
    ap.add_argument("--timeout", type=float, default=120.0, help="per-request timeout in seconds")
    ap.add_argument("--only", choices=["tools", "json", "reasoning"], help="run only these checks")
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
