#!/usr/bin/env python3
"""`tiller engine --openai-port`: the OpenAI-compatible endpoint, driven by the `openai` client and
by raw HTTP, against a live engine (the qwen2-chat fixture, CPU):
- no key or a wrong key: 401 (the engine has a token); /health needs none;
- chat, greedy: the prompt's token ids are the chat template's (transformers' reference), and the
  completion's tokens, text and log-probs are what `tiller generate --engine` (the gRPC path)
  gets for the same conversation;
- completions from token ids, seeded, n = 3: repeatable, one choice per sample, a log-prob per
  token; streaming sends token by token, and its deltas join into the plain response's choices;
- a stop string cuts the text before it and ends the choice with "stop";
- 28 streamed requests at once are all served together (more than 16 server threads);
- hostile or unsupported requests get a 4xx naming the field, never a crash;
- with tools (--tool-call-parser hermes, Qwen2.5's template): a conversation with a tool call and
  its answer renders to transformers' chat template's text, tokenized as the tokenizer.json says;
- TLS: HTTPS with the engine's certificate for a client that trusts it; plaintext gets nothing.

  check_openai.py TILLER_BINARY FIXTURES_DIR SCRATCH_DIR
"""
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from openai import OpenAI, AuthenticationError

tiller, fixtures, scratch = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
scratch.mkdir(parents=True, exist_ok=True)
model = fixtures / "models" / "qwen2-chat"
ref = json.loads((fixtures / "models" / "reference.json").read_text())["qwen2-chat"]
failures = []
TOKEN = "openai-test-secret"


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what, flush=True)
    if not ok:
        failures.append(what)


env = dict(os.environ, TILLER_ENGINE_TOKEN=TOKEN)


def start(model_dir, name, *extra):
    """`tiller engine` on CPU with its OpenAI endpoint; returns the process and its serving line."""
    p = subprocess.Popen([tiller, "engine", "--model", str(model_dir), "--port", "0", "--openai-port", "0", "--device",
                          "cpu", "--num-blocks", "512", "--block-size", "8", "--served-model-name", name, *extra],
                         stdout=subprocess.PIPE, text=True, env=env)
    return p, json.loads(p.stdout.readline())


def stop(p, serving):
    """SIGTERM to the engine; its exit code (None if it had to be killed)."""
    os.kill(serving["pid"], signal.SIGTERM)
    try:
        return p.wait(timeout=60)
    except subprocess.TimeoutExpired:
        p.kill()
        return None


proc, info = start(model, "tiny")
base = f"http://127.0.0.1:{info['openai_port']}"
client = OpenAI(base_url=base + "/v1", api_key=TOKEN, max_retries=0, timeout=120)


def http(method, path, body=None, key=TOKEN, raw=None):
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(base + path, data=data, method=method)
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


try:
    # --- keys ---
    code, _ = http("GET", "/v1/models", key=None)
    check(code == 401, f"no key: 401 (got {code})")
    code, body = http("GET", "/v1/models", key="wrong")
    check(code == 401 and "authentication_error" in body, f"a wrong key: 401 (got {code})")
    check(http("GET", "/health", key=None)[0] == 200, "/health needs no key")
    try:
        OpenAI(base_url=base + "/v1", api_key="nope", max_retries=0).models.list()
        check(False, "the openai client with a wrong key is refused")
    except AuthenticationError:
        check(True, "the openai client with a wrong key gets AuthenticationError")
    models = client.models.list()
    check([m.id for m in models.data] == ["tiny"], f"/v1/models lists the served name ({[m.id for m in models.data]})")

    # --- /tokenize (vLLM's): the served tokenizer's ids, as transformers gives them ---
    from transformers import AutoTokenizer
    hf = AutoTokenizer.from_pretrained(str(model))
    text = "Hello, tokenizer! 123 \u00e9t\u00e9"
    code, body = http("POST", "/tokenize", {"prompt": text, "add_special_tokens": False})
    check(code == 200 and json.loads(body)["tokens"] == hf.encode(text, add_special_tokens=False),
          f"/tokenize gives transformers' ids ({code}: {body[:200]})")
    check(http("POST", "/tokenize", {"prompt": 5})[0] == 400, "/tokenize refuses a prompt that is not text (400)")
    check(http("POST", "/tokenize", {"prompt": "x"}, key=None)[0] == 401, "/tokenize needs the key (401)")

    # --- chat, greedy, against the gRPC path ---
    prompts = scratch / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"question": p}) + "\n" for p in ref["prompts"]), encoding="utf-8")
    out = scratch / "grpc.jsonl"
    subprocess.run([tiller, "generate", "--model", str(model), "--prompts", str(prompts), "--input-key", "question",
                    "--chat-template", "auto", "--max-new-tokens", "12", "--greedy", "--engine",
                    f"127.0.0.1:{info['port']}", "--out", str(out)], check=True, timeout=300, env=env)
    grpc_rows = [json.loads(l) for l in out.read_text(encoding="utf-8").split("\n") if l]
    for i, question in enumerate(ref["prompts"]):
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": question}],
                                           max_tokens=12, temperature=0, logprobs=True,
                                           extra_body={"return_token_ids": True, "ignore_eos": True})
        c = r.choices[0].model_dump()
        check(c["prompt_token_ids"] == ref["prompt_ids"][i],
              f"chat {i}: the prompt is the chat template's tokens (transformers' apply_chat_template)")
        check(c["token_ids"] == grpc_rows[i]["response_ids"],
              f"chat {i}: greedy tokens equal the gRPC path's ({c['token_ids']} vs {grpc_rows[i]['response_ids']})")
        lps = [x["logprob"] for x in c["logprobs"]["content"]]
        check(len(lps) == len(c["token_ids"]) and
              all(abs(a - b) < 1e-5 for a, b in zip(lps, grpc_rows[i]["logprobs"])),
              f"chat {i}: one log-prob per token, the gRPC path's")
        check(r.choices[0].message.content == grpc_rows[i]["response"],
              f"chat {i}: the text is the tokens' decoding ({r.choices[0].message.content!r})")
        check(r.usage.prompt_tokens == len(ref["prompt_ids"][i]) and r.usage.completion_tokens == len(c["token_ids"]),
              f"chat {i}: usage counts the tokens")

    # --- completions from token ids, seeded, n = 3 ---
    ids = ref["prompt_ids"][0]
    ask = dict(model="tiny", prompt=ids, max_tokens=8, temperature=1.0, seed=11, n=3, logprobs=0,
               extra_body={"return_token_ids": True, "ignore_eos": True})
    a, b = client.completions.create(**ask), client.completions.create(**ask)
    ca, cb = [c.model_dump() for c in a.choices], [c.model_dump() for c in b.choices]
    check([c["index"] for c in ca] == [0, 1, 2], "completions: n = 3 gives choices 0, 1, 2")
    check([c["token_ids"] for c in ca] == [c["token_ids"] for c in cb], "completions: a seeded request repeats")
    check(len({tuple(c["token_ids"]) for c in ca}) > 1, "completions: the samples differ")
    check(all(len(c["logprobs"]["token_logprobs"]) == len(c["token_ids"]) == 8 for c in ca),
          "completions: a log-prob per token, max_tokens of them")
    check(all(c["prompt_token_ids"] == ids for c in ca), "completions: the prompt's ids come back")
    def collect(stream):
        """Per choice: the deltas' text and token ids joined, the finish reason, and the chunk count."""
        got = {}
        for chunk in stream:
            for c in chunk.choices:
                d = c.model_dump()
                text, ids, finish, chunks = got.get(d["index"], ("", [], None, 0))
                got[d["index"]] = (text + (d.get("text") or (d.get("delta") or {}).get("content") or ""),
                                   ids + (d.get("token_ids") or []), d["finish_reason"] or finish, chunks + 1)
        return got

    streamed = collect(client.completions.create(**ask, stream=True))
    check({k: v[:3] for k, v in streamed.items()} ==
          {c["index"]: (c["text"], c["token_ids"], c["finish_reason"]) for c in ca},
          "completions: the streamed deltas join into the same choices")
    check(all(v[3] >= 8 for v in streamed.values()), f"completions: token by token ({[v[3] for v in streamed.values()]} "
          "chunks per choice of 8 tokens)")
    chat_stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                                 seed=3, stream=True, stream_options={"include_usage": True})
    text, usage, chunks, roles = "", None, 0, []
    for chunk in chat_stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            roles.append(chunk.choices[0].delta.role)
            chunks += 1
        if chunk.usage:
            usage = chunk.usage
    plain = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                           seed=3)
    check(text == plain.choices[0].message.content and usage is not None and usage.completion_tokens ==
          plain.usage.completion_tokens, "chat: streaming gives the plain response's text and usage")
    check(chunks > 2 and roles[0] == "assistant" and all(r is None for r in roles[1:]),
          f"chat: streamed token by token, the role once ({chunks} chunks)")

    # --- stop strings ---
    greedy = client.completions.create(model="tiny", prompt=ids, max_tokens=12, temperature=0,
                                       extra_body={"ignore_eos": True, "return_token_ids": True}).choices[0].model_dump()
    cut = greedy["text"][3:6]
    stopped = client.completions.create(model="tiny", prompt=ids, max_tokens=12, temperature=0, stop=[cut],
                                        extra_body={"ignore_eos": True, "return_token_ids": True}).choices[0].model_dump()
    check(cut != "" and stopped["text"] == greedy["text"][:greedy["text"].find(cut)] and
          stopped["finish_reason"] == "stop" and stopped["token_ids"] == greedy["token_ids"][:len(stopped["token_ids"])]
          and len(stopped["token_ids"]) < len(greedy["token_ids"]),
          f"a stop string {cut!r} ends the text before it ({stopped['text']!r} of {greedy['text']!r})")
    s2 = collect(client.completions.create(model="tiny", prompt=ids, max_tokens=12, temperature=0, stop=[cut],
                                           stream=True, extra_body={"ignore_eos": True, "return_token_ids": True}))
    check(s2[0][:3] == (stopped["text"], stopped["token_ids"], "stop"),
          f"streamed with the stop string: the same cut ({s2[0][:3]})")

    # --- concurrency: more streamed requests than cpp-httplib's default 16 threads are in the engine at once ---
    # A request holds a server thread from its first chunk to its last, so the peak of requests
    # between the two is at most the thread count (16 would hold an engine's batch at 16).
    import threading
    clients, marks, gate = 28, [], threading.Barrier(28)
    lock = threading.Lock()

    def one_stream(i):
        # 96 tokens: long enough that the streams overlap on a loaded machine (28 x 13 blocks fit).
        body = json.dumps({"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 96, "ignore_eos": True, "seed": i,
                           "stream": True}).encode()
        req = urllib.request.Request(base + "/v1/completions", data=body, method="POST",
                                     headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
        gate.wait(timeout=60)
        with urllib.request.urlopen(req, timeout=120) as r:
            first = True
            for line in r:
                if first and line.startswith(b"data: {"):
                    with lock:
                        marks.append((time.monotonic(), 1))
                    first = False
        with lock:
            marks.append((time.monotonic(), -1))

    # Up to three rounds (a loaded machine may start its threads late): 16 threads never pass 16.
    peak, complete = 0, True
    for _ in range(3):
        marks.clear()
        gate.reset()
        workers = [threading.Thread(target=one_stream, args=(i,)) for i in range(clients)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(timeout=180)
        complete = complete and len(marks) == 2 * clients
        level = 0
        for _, d in sorted(marks):
            level += d
            peak = max(peak, level)
        if peak > 16:
            break
    check(complete and peak > 16,
          f"{clients} streamed requests at once: {peak} of them open in the engine together (> 16)")

    # --- hostile and unsupported requests ---
    bad = [
        ("not JSON", "/v1/completions", None, b"{nope"),
        ("n over the bound", "/v1/completions", {"prompt": "a", "n": 100000}, None),
        ("negative max_tokens", "/v1/completions", {"prompt": "a", "max_tokens": -1}, None),
        ("max_tokens past the context", "/v1/completions", {"prompt": "a", "max_tokens": 10 ** 9}, None),
        ("a token id outside the vocabulary", "/v1/completions", {"prompt": [10 ** 9]}, None),
        ("a float token id", "/v1/completions", {"prompt": [1.5]}, None),
        ("an empty prompt list", "/v1/completions", {"prompt": []}, None),
        ("a prompt of the wrong type", "/v1/completions", {"prompt": {"a": 1}}, None),
        ("temperature as text", "/v1/completions", {"prompt": "a", "temperature": "hot"}, None),
        ("top_p 0", "/v1/completions", {"prompt": "a", "top_p": 0}, None),
        ("top-k alternatives", "/v1/completions", {"prompt": "a", "logprobs": 5}, None),
        ("echo", "/v1/completions", {"prompt": "a", "echo": True}, None),
        ("17 stop strings", "/v1/completions", {"prompt": "a", "stop": ["x"] * 17}, None),
        ("a stop token outside the vocabulary", "/v1/completions", {"prompt": "a", "stop_token_ids": [-1]}, None),
        ("no messages", "/v1/chat/completions", {"messages": []}, None),
        ("an unknown role", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, None),
        ("image content", "/v1/chat/completions",
         {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, None),
        ("top_logprobs", "/v1/chat/completions",
         {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 2}, None),
        ("a forced tool choice", "/v1/chat/completions",
         {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, None),
        ("a body over the limit", "/v1/completions", None, b'{"prompt": "' + b"a" * (33 << 20) + b'"}'),
    ]
    for what, path, body, raw in bad:
        code, text = http("POST", path, body, raw=raw)
        ok = code in (400, 413) and "error" in json.loads(text)
        check(ok, f"{what}: {code} {text[:160]}")
    code, text = http("POST", "/v1/completions", {"model": "gpt-4", "prompt": "a"})
    check(code == 404 and "does not exist" in text, f"another model's name: 404 ({code})")
    code, _ = http("POST", "/v1/nothing", {})
    check(code == 404, f"an unknown route: 404 ({code})")
    # A request the HTTP server cannot read (here a malformed request line) gets a JSON error that
    # says so, not a bare "HTTP 400".
    import socket
    with socket.create_connection(("127.0.0.1", info["openai_port"]), timeout=30) as sock:
        sock.sendall(b"NOT A REQUEST\r\n\r\n")
        answer = b""
        try:
            while chunk := sock.recv(65536):
                answer += chunk
        except ConnectionResetError:  # a server may close with a reset once it has answered
            pass
    head, _, text = answer.decode(errors="replace").partition("\r\n\r\n")
    check(head.startswith("HTTP/1.1 400") and "could not be read" in json.loads(text)["error"]["message"],
          f"an unreadable request: 400 naming why ({answer[:200]!r})")
    # The server still serves after all that.
    r = client.completions.create(model="tiny", prompt="hello", max_tokens=3, temperature=0)
    check(len(r.choices) == 1 and r.choices[0].finish_reason in ("length", "stop"), "the endpoint still serves")
finally:
    code = stop(proc, info)
    check(code == 0, f"SIGTERM stops the engine and its endpoint with exit 0 (got {code})")

# Tools (--tool-call-parser hermes): the chat fixture's weights with Qwen2.5's chat template and
# tokenizer (700 ids, within the model's 1200). A conversation with a tool call (its arguments a
# JSON string, as OpenAI clients send them), a tool's answer and `tools` renders to the token ids
# transformers' apply_chat_template gives (the arguments as the object the model wrote).
import shutil
from tokenizers import Tokenizer
from transformers import AutoTokenizer

tool_model = scratch / "tool_model"
shutil.rmtree(tool_model, ignore_errors=True)
tool_model.mkdir()
for f in ["config.json", "model.safetensors", "generation_config.json"]:
    if (model / f).exists():
        shutil.copy(model / f, tool_model / f)
for f in ["tokenizer.json", "tokenizer_config.json"]:
    shutil.copy(fixtures / "chat_templates" / "qwen2.5" / f, tool_model / f)
cfg = json.loads((tool_model / "config.json").read_text())
cfg["max_position_embeddings"] = 1024  # the tools' system prompt is longer than the fixture's 256
(tool_model / "config.json").write_text(json.dumps(cfg))
proc, info = start(tool_model, "tools", "--tool-call-parser", "hermes")
client = OpenAI(base_url=f"http://127.0.0.1:{info['openai_port']}/v1", api_key=TOKEN, max_retries=0, timeout=120)
tools = [{"type": "function", "function": {"name": "add", "description": "Add two integers.",
                                            "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                                                           "b": {"type": "integer"}},
                                                           "required": ["a", "b"]}}}]
messages = [{"role": "user", "content": "What is 2+3?"},
            {"role": "assistant", "content": None,
             "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "5"}]
try:
    r = client.chat.completions.create(model="tools", messages=messages, tools=tools, max_tokens=8, temperature=1,
                                       seed=1, extra_body={"return_token_ids": True})
    want_messages = json.loads(json.dumps(messages))
    want_messages[1]["tool_calls"][0]["function"]["arguments"] = {"a": 2, "b": 3}
    # transformers renders the text; the tokenizer.json encodes it (transformers 5's Qwen2 class
    # would split digits by its own regex, not this fixture's tokenizer.json's).
    text = AutoTokenizer.from_pretrained(str(tool_model)).apply_chat_template(
        want_messages, tools=tools, add_generation_prompt=True, tokenize=False)
    want = Tokenizer.from_file(str(tool_model / "tokenizer.json")).encode(text, add_special_tokens=False).ids
    got = r.choices[0].model_dump()["prompt_token_ids"]
    check(got == list(want), f"tools: the conversation renders to transformers' chat template, tokenized as the "
          f"tokenizer.json says ({len(got)} vs {len(want)} ids)")
    check(r.choices[0].finish_reason in ("stop", "length") and not r.choices[0].message.tool_calls,
          "tools: a reply without <tool_call> blocks is plain content")
finally:
    stop(proc, info)
    try:
        code = proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = None
    check(code == 0, f"SIGTERM stops the engine and its endpoint with exit 0 (got {code})")

# TLS: the endpoint serves HTTPS with the engine's certificate (--tls-cert/--tls-key); a client that
# trusts the certificate is served, plaintext gets nothing.
import httpx

cert, key = scratch / "cert.pem", scratch / "key.pem"
subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=engine",
                "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
               check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
proc, info = start(model, "tls", "--tls-cert", str(cert), "--tls-key", str(key))
try:
    tls = OpenAI(base_url=f"https://127.0.0.1:{info['openai_port']}/v1", api_key=TOKEN, max_retries=0, timeout=60,
                 http_client=httpx.Client(verify=str(cert)))
    r = tls.completions.create(model="tls", prompt="hello", max_tokens=3, temperature=0)
    check(len(r.choices) == 1, "TLS: a client trusting the certificate is served over HTTPS")
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{info['openai_port']}/v1/models", timeout=10)
        check(False, "TLS: plaintext HTTP is refused")
    except Exception:
        check(True, "TLS: plaintext HTTP gets no answer")
finally:
    stop(proc, info)

if failures:
    print(f"{len(failures)} failure(s)", file=sys.stderr)
    sys.exit(1)
print("openai endpoint: all checks passed")
