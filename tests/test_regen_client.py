"""`dflash regenerate --server`: the OpenAI-compatible client against a small server this test starts on
127.0.0.1, which answers with the tiny target (greedy, per-prompt `model.generate`): same output as the
embedded engine's greedy reference, a retry on injected 503s, spreading over two URLs, and the clear errors
(another model served, another chat template, reasoning split out)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from helpers_cli import HANG_S, TINY, dflash  # noqa: E402
from pipeline.config import load_config  # noqa: E402
from regen_helpers import (END, ROOT, greedy_conversation, read_jsonl, tiny_model_and_tokenizer,  # noqa: E402
                           write_prompts)
from stages.regen_client import base_url, no_text_cause  # noqa: E402
from stages.regen_records import RegenError, read_log  # noqa: E402
from stages.regenerate import run_regenerate  # noqa: E402


class TinyServer:
    """/v1/models and /v1/chat/completions answered by the tiny target; `fail` 503s before the next answers;
    `refuse_after` answers HTTP 400 once that many requests succeeded (a server with a short max-model-len);
    `message` replaces the answer's message (e.g. content null with a tool call); `usage=False` leaves it out."""

    def __init__(self, model, tokenizer, model_id="dflash-tiny-target", fail=0, force_thinking=None, reasoning=False,
                 delay=0.0, refuse_after=None, message=None, usage=True):
        self.model, self.tok, self.model_id = model, tokenizer, model_id
        self.fail, self.force_thinking, self.reasoning, self.delay = fail, force_thinking, reasoning, delay
        self.refuse_after, self.message, self.usage, self.answered = refuse_after, message, usage, 0
        self.requests, self.lock = [], threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, code, body):
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path == "/v1/models":
                    self._send(200, {"object": "list", "data": [{"id": server.model_id, "object": "model"}]})
                else:
                    self._send(404, {"error": "not found"})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                time.sleep(server.delay)  # a slower server, so that a test can stop a run midway
                with server.lock:
                    server.requests.append(body)
                    if server.fail:
                        server.fail -= 1
                        return self._send(503, {"error": "overloaded, try again"})
                    if server.refuse_after is not None and server.answered >= server.refuse_after:
                        return self._send(400, {"object": "error", "message": "This model's maximum context length "
                                                "is 16 tokens", "code": 400})
                    server.answered += 1
                    self._send(200, server.answer(body))

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    @torch.inference_mode()
    def answer(self, body: dict) -> dict:
        think = (body.get("chat_template_kwargs") or {}).get("enable_thinking", True)
        think = think if self.force_thinking is None else self.force_thinking
        ids = self.tok.apply_chat_template(body["messages"], add_generation_prompt=True, enable_thinking=think,
                                           tokenize=True, return_dict=True)["input_ids"]
        assert body["temperature"] == 0
        out = self.model.generate(torch.tensor([ids]), max_new_tokens=body["max_tokens"], do_sample=False,
                                  eos_token_id=END, pad_token_id=0)[0, len(ids):].tolist()
        text = self.tok.decode([t for t in out if t != END], skip_special_tokens=True)
        message = {"role": "assistant", "content": text}
        if self.reasoning:
            message["reasoning_content"] = "thought"
        if self.message is not None:
            message = {"role": "assistant", **self.message}
        body = {"choices": [{"index": 0, "message": message, "finish_reason": "stop" if END in out else "length"}]}
        if self.usage:
            body["usage"] = {"prompt_tokens": len(ids), "completion_tokens": len(out)}
        return body

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def tiny():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield tiny_model_and_tokenizer()
    torch.set_num_threads(threads)


FAST = ["regenerate.retry_backoff=0.01", "regenerate.concurrency=3", "regenerate.max_new_tokens=96"]


def _run(tmp_path, urls, n=10, extra=(), name="o"):
    prompts = write_prompts(tmp_path / "chat.jsonl", n, start=40)
    cfg = load_config(TINY, [*FAST, *extra])
    rc = run_regenerate(cfg, prompts=[str(prompts)], out=str(tmp_path / name), servers=tuple(urls))
    return rc, prompts, tmp_path / name


def test_server_engine_matches_greedy_with_retries_over_two_servers(tmp_path, tiny):
    model, tok = tiny
    a, b = TinyServer(model, tok, fail=2), TinyServer(model, tok, model_id="some/path/dflash-tiny-target")
    try:
        rc, prompts, out = _run(tmp_path, [a.url, b.url + "/v1/"])
    finally:
        a.close(), b.close()
    assert rc == 0
    rows, src = read_jsonl(out / "chat.jsonl"), read_jsonl(prompts)
    assert len(rows) == len(src) == 10
    for row, s in zip(rows, src):
        assert row["messages"] == greedy_conversation(model, tok, s["messages"], 96)[0]
    answered = len(a.requests) + len(b.requests) - 2  # two 503s were retried
    assert answered == sum(m["role"] == "assistant" for r in rows for m in r["messages"])
    assert len(b.requests) > 0 and len(a.requests) > 2  # both servers answered
    req = a.requests[-1]
    assert req["model"] == "dflash-tiny-target" and req["chat_template_kwargs"] == {"enable_thinking": False}
    assert req["max_tokens"] == 96 and req["temperature"] == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["engines"] == ["server"] and manifest["responses"] == answered
    # resuming a finished run does nothing; another sampling setting on the same OUT is refused, named
    rc2, _, _ = _run(tmp_path, [a.url])
    assert rc2 == 0
    with pytest.raises(RegenError, match=r"settings\.temperature: 0\.0 -> 0\.5"):
        _run(tmp_path, [a.url], extra=["regenerate.temperature=0.5"])


def test_manifest_lists_cut_responses_and_skipped_prompts(tmp_path, tiny):
    model, tok = tiny
    server = TinyServer(model, tok)
    try:
        rc, prompts, out = _run(tmp_path, [server.url], n=6, extra=["regenerate.max_new_tokens=6",
                                                                     "regenerate.max_prompt_tokens=20"])
        rc2, _, dropped = _run(tmp_path, [server.url], n=6, name="d", extra=[
            "regenerate.max_new_tokens=6", "regenerate.max_prompt_tokens=20", "regenerate.keep_truncated=false"])
    finally:
        server.close()
    assert rc == rc2 == 0
    m = json.loads((out / "manifest.json").read_text())
    rows = read_jsonl(out / "chat.jsonl")
    assert m["sampling"]["max_new_tokens"] == 6 and m["max_prompt_tokens"] == 20
    assert 0 < len(m["skipped_prompts"]) < 6 and all(x["prompt_tokens"] > 20 for x in m["skipped_prompts"])
    assert len(rows) == 6 - len(m["skipped_prompts"]) == len(m["truncated"])
    for k, (cut, row) in enumerate(zip(m["truncated"], rows)):  # every answer was cut at 6 tokens, turn 0
        assert (cut["output"], cut["line"], cut["turn"]) == ("chat.jsonl", k + 1, 0) and "chat.jsonl, line" in cut["source"]
        assert [x["role"] for x in row["messages"]][-1] == "assistant" and len(tok(row["messages"][-1]["content"],
                                                                                   add_special_tokens=False)["input_ids"]) == 6
    d = json.loads((dropped / "manifest.json").read_text())
    assert (dropped / "chat.jsonl").read_text() == "" and len(d["dropped"]) == len(rows)
    assert all("keep_truncated=false" in x["reason"] for x in d["dropped"])
    over = len(m["skipped_prompts"])
    assert m["accounting"] == {"input": 6, "written": 6 - over, "failed": 0, "skipped": {
        "bad rows": 0, "prompt over max_prompt_tokens": over, "no response kept": 0}} and m["complete"]
    assert d["accounting"] == {"input": 6, "written": 0, "failed": 0, "skipped": {
        "bad rows": 0, "prompt over max_prompt_tokens": over, "no response kept": 6 - over}}


def test_wrong_model_template_and_reasoning_are_clear_errors(tmp_path, tiny):
    model, tok = tiny
    other = TinyServer(model, tok, model_id="meta-llama/Llama-3.1-8B")
    thinking = TinyServer(model, tok, force_thinking=True)  # renders without the empty think block
    split = TinyServer(model, tok, reasoning=True)
    try:
        with pytest.raises(RegenError, match=r"serves \['meta-llama/Llama-3.1-8B'\], not the config's target"):
            _run(tmp_path, [other.url], name="a")
        assert other.requests == []  # nothing was sent
        with pytest.raises(RegenError, match=r"rendered the prompt as \d+ tokens but .* renders \d+"):
            _run(tmp_path, [thinking.url], name="b")
        with pytest.raises(RegenError, match="reasoning-parser"):
            _run(tmp_path, [split.url], name="c")
    finally:
        other.close(), thinking.close(), split.close()


def test_retries_run_out_with_a_resume_hint(tmp_path, tiny):
    model, tok = tiny
    down = TinyServer(model, tok, fail=10_000)
    try:
        with pytest.raises(RegenError, match=r"no answer after 3 attempts .*HTTP 503.*rerun the same command"):
            _run(tmp_path, [down.url], n=1, extra=["regenerate.retries=2"])
    finally:
        down.close()
    assert len(down.requests) == 3  # the first try and two retries


def test_base_url():
    assert base_url("http://h:8000") == base_url("http://h:8000/") == base_url("http://h:8000/v1") == "http://h:8000/v1"
    with pytest.raises(RegenError, match="http"):
        base_url("h:8000")


TOOL_CALL = {"content": None, "tool_calls": [{"id": "call-0", "type": "function",
                                              "function": {"name": "web_search", "arguments": "{}"}}]}
NO_SKIPS = {"bad rows": 0, "prompt over max_prompt_tokens": 0, "no response kept": 0}


def test_content_null_fails_every_conversation_and_a_rerun_retries_them(tmp_path, tiny, capfd):
    """Issue 27: a server answering tool calls (content null) ended every conversation as "empty response", exit 0,
    and a rerun said "complete". Now each one fails with its cause, nothing is committed, the run exits 1 with the
    counts, and a rerun against a working server answers all of them."""
    model, tok = tiny
    tools, good = TinyServer(model, tok, message=TOOL_CALL), TinyServer(model, tok)
    try:
        rc, prompts, out = _run(tmp_path, [tools.url], n=4)
        err = capfd.readouterr().err
        m = json.loads((out / "manifest.json").read_text())
        assert rc == 1 and len(tools.requests) == 4
        assert m["complete"] is False and m["conversations"] == 0 and (out / "chat.jsonl").read_text() == ""
        assert m["accounting"] == {"input": 4, "written": 0, "skipped": NO_SKIPS, "failed": 4}
        assert [f["source"] for f in m["failed"]] == [f"{prompts}, line {k}" for k in range(1, 5)]
        cause = "turn 0: the server answered with no text (a tool call (web_search)"
        assert all(cause in f["reason"] for f in m["failed"])
        assert "regenerate: 4 input conversation(s): 0 written, 0 skipped, 4 failed" in err
        assert "tool call (web_search)" in err and "rerun the same command to retry only them" in err
        assert read_log(out / "work" / "logs" / "server.jsonl")[0] == []  # nothing committed as done
        rc2, _, _ = _run(tmp_path, [good.url], n=4)
    finally:
        tools.close(), good.close()
    assert rc2 == 0
    m2 = json.loads((out / "manifest.json").read_text())
    assert m2["complete"] is True and m2["failed"] == [] and m2["accounting"]["written"] == 4
    for row, s in zip(read_jsonl(out / "chat.jsonl"), read_jsonl(prompts)):
        assert row["messages"] == greedy_conversation(model, tok, s["messages"], 96)[0]


def test_http_400_mid_run_fails_those_conversations_and_a_rerun_retries_them(tmp_path, tiny, capfd):
    """Issue 27: a server with a shorter max-model-len answered 400 after 5 successes; 35 of 40 conversations were
    dropped with exit 0 and a rerun said "nothing to do". Now they fail (counted, named), and a rerun against a
    working server retries exactly them: the outputs equal an uninterrupted run's."""
    model, tok = tiny
    short, good = TinyServer(model, tok, refuse_after=5), TinyServer(model, tok)
    try:
        rc_ref, _, ref = _run(tmp_path, [good.url], n=10, name="ref")
        rc, _, out = _run(tmp_path, [short.url], n=10)
        err = capfd.readouterr().err
        m = json.loads((out / "manifest.json").read_text())
        committed = [row["index"] for rec in read_log(out / "work" / "logs" / "server.jsonl")[0] for row in rec["rows"]]
        assert rc_ref == 0 and rc == 1
        acc = m["accounting"]
        assert acc["input"] == 10 and acc["written"] == len(committed) <= 5 and acc["failed"] == 10 - len(committed)
        assert acc["written"] + sum(acc["skipped"].values()) + acc["failed"] == 10
        assert all("HTTP 400" in f["reason"] and "maximum context length" in f["reason"] for f in m["failed"])
        assert f"{acc['written']} written, 0 skipped, {acc['failed']} failed" in err and "HTTP 400" in err
        ref_rows = read_jsonl(ref / "chat.jsonl")
        written = read_jsonl(out / "chat.jsonl")
        assert all(row in ref_rows for row in written) and len(written) == acc["written"]
        before = len(good.requests)
        rc2, _, _ = _run(tmp_path, [good.url], n=10)
    finally:
        short.close(), good.close()
    assert rc2 == 0 and len(good.requests) > before
    assert (out / "chat.jsonl").read_bytes() == (ref / "chat.jsonl").read_bytes()
    m2 = json.loads((out / "manifest.json").read_text())
    assert m2["complete"] and m2["accounting"] == {"input": 10, "written": 10, "skipped": NO_SKIPS, "failed": 0}


def test_a_server_without_usage_is_warned_about_once_and_counted_with_our_tokenizer(tmp_path, tiny, capfd):
    model, tok = tiny
    plain, full = TinyServer(model, tok, usage=False), TinyServer(model, tok)
    try:
        rc_ref, _, ref = _run(tmp_path, [full.url], n=4, name="ref")
        capfd.readouterr()
        rc, _, out = _run(tmp_path, [plain.url], n=4)
        err = capfd.readouterr().err
    finally:
        plain.close(), full.close()
    assert rc == rc_ref == 0 and len(plain.requests) >= 4
    assert err.count("sends no usage.prompt_tokens") == 1 and "chat template is skipped" in err
    assert (out / "chat.jsonl").read_bytes() == (ref / "chat.jsonl").read_bytes()
    m, m_ref = (json.loads((d / "manifest.json").read_text()) for d in (out, ref))
    assert m["output_tokens"] == m_ref["output_tokens"] > 0  # the target's tokenizer counts what the server did


def test_skipped_bad_rows_are_counted_in_the_accounting(tmp_path, tiny, capfd):
    """data.on_bad_row=skip: the malformed rows are skipped with their reason, and input = written + skipped."""
    model, tok = tiny
    server = TinyServer(model, tok)
    prompts = write_prompts(tmp_path / "chat.jsonl", 3, start=40)
    with open(prompts, "a") as f:
        f.write('{"messages": ' + "[" * 100_000 + "]" * 100_000 + "}\n" + '{"messages": [{"role": "user", "content": '
                '"\\udfff"}]}\n{"messages": [{"role": "assistant", "content": "no user turn"}]}\n')
    try:
        rc = run_regenerate(load_config(TINY, [*FAST, "data.on_bad_row=skip"]), prompts=[str(prompts)],
                            out=str(tmp_path / "o"), servers=(server.url,))
    finally:
        server.close()
    err = capfd.readouterr().err
    m = json.loads((tmp_path / "o" / "manifest.json").read_text())
    assert rc == 0 and m["prompts"]["bad_rows_skipped"] == {"invalid JSON": 1, "invalid text": 1, "no user turn": 1}
    assert m["accounting"] == {"input": 6, "written": 3, "failed": 0, "skipped": {**NO_SKIPS, "bad rows": 3}}
    assert "6 input conversation(s): 3 written, 3 skipped (bad rows 3), 0 failed" in err


def test_no_text_cause_names_tool_calls_refusals_and_empty_content():
    assert "a tool call (web_search)" in no_text_cause(TOOL_CALL, "tool_calls")
    assert "--tool-call-parser" in no_text_cause(TOOL_CALL, "tool_calls")
    assert no_text_cause({"content": None, "refusal": "I can't help with that."}, "stop") == \
        "a refusal, content null: \"I can't help with that.\""
    assert no_text_cause({"content": None}, "stop") == "empty: content null, finish_reason 'stop'"
    assert no_text_cause({"content": [{"type": "text"}]}, None) == \
        "empty: content is a list, not a string, finish_reason None"


@pytest.mark.slow
def test_server_run_resumes_after_kill9_and_ctrl_c(tmp_path, tiny):
    """The CLI with --server in a subprocess: kill -9 mid-run, then Ctrl-C mid-run, then finish: every conversation
    committed once, and the output equals an uninterrupted run's."""
    model, tok = tiny
    server = TinyServer(model, tok, delay=0.1)
    try:
        rc, prompts, ref = _run(tmp_path, [server.url], n=24, name="ref")
        assert rc == 0
        out = tmp_path / "k"
        args = [sys.executable, "-m", "stages.cli", "regenerate", "--prompts", str(prompts), "--out", str(out),
                "--server", server.url, *[x for f in FAST for x in ("--set", f)], "--set", "regenerate.concurrency=2"]
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
        log = out / "work" / "logs" / "server.jsonl"
        for round_, sig in enumerate([signal.SIGKILL, signal.SIGINT]):
            p = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            deadline = time.time() + HANG_S  # a hang guard only: no correctness depends on speed
            while time.time() < deadline and p.poll() is None and len(read_log(log)[0]) < 4 + 6 * round_:
                time.sleep(0.05)
            assert p.poll() is None, p.stderr.read()
            p.send_signal(sig)
            rc = p.wait(timeout=HANG_S)
            if sig == signal.SIGINT:
                assert rc == 130 and "resume with the same command" in p.stderr.read()
        done_before = len(read_log(log)[0])
        assert 10 <= done_before < 24
        dflash("regenerate", "--prompts", str(prompts), "--out", str(out), "--server", server.url,
               *[x for f in FAST for x in ("--set", f)], "--set", "regenerate.concurrency=2")
    finally:
        server.close()
    indices = [row["index"] for rec in read_log(log)[0] for row in rec["rows"]]
    assert sorted(indices) == list(range(24))  # nothing lost, nothing committed twice
    assert (out / "chat.jsonl").read_bytes() == (ref / "chat.jsonl").read_bytes()
