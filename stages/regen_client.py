"""The server engine of `dflash regenerate`: an OpenAI-compatible server (vLLM, SGLang) the user runs answers.

Standard library only (urllib, threads): one HTTP request per response, no client dependency. Contract:
- `check_served_model` asks every URL's /v1/models before any prompt is sent and fails with the served ids
  when one does not serve the config's target (a served id equal to target.name or target.path, or with the
  same last path component as target.path, e.g. "Qwen/Qwen3.6-27B" for /models/Qwen3.6-27B).
- Requests use the chat completions API with the run's sampling settings (greedy: temperature 0), max_tokens =
  max_new_tokens, a per-response seed, and chat_template_kwargs.enable_thinking = data.enable_thinking.
  The server's usage.prompt_tokens must equal the length of ingest's render of the same messages: a server
  rendering another template or thinking mode stops the run, naming both counts. A server that sends no
  usage cannot be checked so: the run warns once and counts output tokens with the target's tokenizer. A
  response whose reasoning came back split out (a server started with --reasoning-parser) stops the run too:
  training needs the raw text. `content: null` (a tool call, a refusal, or nothing) fails that conversation,
  naming the cause; an empty string is the model's own empty answer (the conversation ends there).
- Concurrency: regenerate.concurrency conversations in flight per URL, each on its own thread (turns of one
  conversation go in order); the threads spread over the URLs, and a retried request moves to the next URL.
  Connection errors, timeouts and HTTP 408/429/5xx are retried regenerate.retries times with exponential
  backoff (regenerate.retry_backoff, doubling, at most 60 s, jittered). Other 4xx answers (e.g. 400 for a
  prompt over the server's max-model-len) fail that conversation, unless no request has succeeded yet (then
  the run stops).
- One commit-log record (`work/logs/server.jsonl`) per finished conversation, written by the main thread; a
  failed conversation gets none (a rerun retries it) and `run_server` returns it with its reason.
  Ctrl-C/SIGTERM stops at once: requests in flight are abandoned and recomputed on resume (exit 130).
"""

from __future__ import annotations

import http.client
import json
import queue
import random
import signal
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Optional

from stages.regen_records import CommitLog, Prompt, RegenError, Reply, regenerate_batch

RETRY_CODES = {408, 409, 425, 429, 500, 502, 503, 504}
_TOKENIZE = threading.Lock()  # a fast tokenizer shared by the lanes may fail with "Already borrowed" when raced


def base_url(url: str) -> str:
    """http://host:8000, http://host:8000/ or http://host:8000/v1 -> http://host:8000/v1"""
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise RegenError(f"--server {url!r}: expected an http(s) URL such as http://localhost:8000")
    return url if url.endswith("/v1") else url + "/v1"


def _http(url: str, payload: Optional[dict], timeout: float) -> dict:
    data = None if payload is None else json.dumps(payload).encode("utf-8")
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"},
                                 method="GET" if payload is None else "POST")
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read().decode("utf-8"))


def check_served_model(urls: list[str], target_name: str, target_path: str, timeout: float = 30.0) -> str:
    """The model id to request (see the module contract); RegenError when a server serves something else."""
    wanted = {target_name, target_path, Path(target_path).name, Path(target_name).name} - {""}
    chosen = None
    for url in urls:
        try:
            ids = [m["id"] for m in _http(url + "/models", None, timeout).get("data", [])]
        except (urllib.error.URLError, OSError, ValueError, KeyError, http.client.HTTPException) as e:
            raise RegenError(f"cannot ask {url}/models which model it serves ({e}); is the server up?") from None
        match = [i for i in ids if i in wanted or Path(i).name in wanted]
        if not match:
            raise RegenError(f"{url} serves {ids or 'no model'}, not the config's target {target_name!r} "
                             f"({target_path}); point --server at the target's server, or set target.name to the "
                             "served id if it is the same checkpoint")
        chosen = chosen or match[0]
    return chosen


class ServerEngine:
    """Chat-completions requests for one thread (`lane`); `shared` holds the state all lanes see."""

    def __init__(self, urls: list[str], model: str, settings: dict, lane: int, shared: dict, timeout: float,
                 retries: int, backoff: float, stop: threading.Event, tokenizer=None, warn=None):
        self.urls, self.model, self.s, self.lane, self.shared = urls, model, settings, lane, shared
        self.timeout, self.retries, self.backoff, self.stop = timeout, retries, backoff, stop
        self.tokenizer, self.warn = tokenizer, warn or (lambda _msg: None)

    def generate(self, prompts: list[Prompt]) -> Optional[list[Reply]]:
        replies = []
        for p in prompts:
            r = self._one(p)
            if r is None:
                return None
            replies.append(r)
        return replies

    def _payload(self, p: Prompt) -> dict:
        s = self.s
        body = {"model": self.model, "messages": p.messages, "max_tokens": s["max_new_tokens"],
                "temperature": s["temperature"], "top_p": s["top_p"] if s["temperature"] > 0 else 1.0, "seed": p.seed,
                "chat_template_kwargs": {"enable_thinking": s["enable_thinking"]}}
        if s["temperature"] > 0 and s["top_k"]:
            body["top_k"] = s["top_k"]
        return body

    def _one(self, p: Prompt) -> Optional[Reply]:
        last = ""
        for attempt in range(self.retries + 1):
            url = self.urls[(self.lane + attempt) % len(self.urls)]
            try:
                return self._parse(_http(url + "/chat/completions", self._payload(p), self.timeout), p, url)
            except urllib.error.HTTPError as e:
                detail = e.read()[:300].decode("utf-8", "replace")
                if e.code not in RETRY_CODES:
                    if not self.shared.get("succeeded"):
                        raise RegenError(f"{url} refused the first request (HTTP {e.code}: {detail})") from None
                    return Reply(error=f"server refused the prompt (HTTP {e.code}: {detail})")
                last = f"HTTP {e.code} from {url}: {detail}"
            except (urllib.error.URLError, OSError, http.client.HTTPException, ValueError) as e:
                last = f"{type(e).__name__} from {url}: {e}"
            if attempt < self.retries:
                delay = min(60.0, self.backoff * 2 ** attempt) * (0.5 + random.random() / 2)
                if self.stop.wait(delay):
                    return None
        raise RegenError(f"no answer after {self.retries + 1} attempts (last: {last}); check the server(s), then "
                         "rerun the same command to resume")

    def _parse(self, body: dict, p: Prompt, url: str) -> Reply:
        try:
            choice = body["choices"][0]
            message = choice["message"]
        except (KeyError, IndexError, TypeError):
            raise RegenError(f"{url} answered without choices[0].message: {str(body)[:300]}") from None
        if message.get("reasoning_content") or message.get("reasoning"):
            raise RegenError(f"{url} returns the reasoning apart from the answer (a --reasoning-parser is on); "
                             "restart the server without it so responses are the target's raw text")
        usage = body.get("usage") if isinstance(body.get("usage"), dict) else {}
        served = usage.get("prompt_tokens")
        if served is None and not self.shared.get("warned_usage"):
            self.shared["warned_usage"] = True
            self.warn(f"regenerate: warning: {url} sends no usage.prompt_tokens, so the check that it renders prompts "
                      "with the target's chat template is skipped (first seen on this run); output tokens are counted "
                      "with the target's tokenizer")
        if served is not None and served != len(p.ids):
            raise RegenError(
                f"{url} rendered the prompt as {served} tokens but the target's chat template with enable_thinking="
                f"{self.s['enable_thinking']} renders {len(p.ids)}: the server uses another chat template or "
                "thinking mode than training will; serve the target with its own template (and check "
                "data.enable_thinking)")
        self.shared["succeeded"] = True
        content, finish = message.get("content"), choice.get("finish_reason")
        tokens = usage.get("completion_tokens")
        if tokens is None:  # no usage: our count, plus the stop token when it stopped
            text = content if isinstance(content, str) else ""
            with _TOKENIZE:
                tokens = len(self.tokenizer(text, add_special_tokens=False)["input_ids"]) + (finish == "stop")
        if not isinstance(content, str):
            cause = no_text_cause(message, finish)
            return Reply(tokens=int(tokens), error=f"the server answered with no text ({cause})")
        return Reply(text=content, tokens=int(tokens), truncated=finish == "length")


def no_text_cause(message: dict, finish: Optional[str]) -> str:
    """Why a chat completion carries no text: a tool call, a refusal, or an empty (null) content."""
    if message.get("tool_calls") or message.get("function_call"):
        names = [((c or {}).get("function") or {}).get("name") for c in message.get("tool_calls") or []]
        names = ", ".join(n for n in names if n) or (message.get("function_call") or {}).get("name") or "?"
        return (f"a tool call ({names}) instead of text, content null; serve the target without tool calling "
                "(e.g. no --enable-auto-tool-choice / --tool-call-parser)")
    if message.get("refusal"):
        return f"a refusal, content null: {str(message['refusal'])[:200]!r}"
    content = message.get("content")
    what = "content null" if content is None else f"content is a {type(content).__name__}, not a string"
    return f"empty: {what}, finish_reason {finish!r}"


def run_server(cfg, urls: list[str], work: Path, tokenizer, settings: dict, todo: list, progress,
               already: int) -> tuple[int, dict[int, str]]:
    """Answer `todo` through the servers (see the module contract): (0 done or 130 stopped, the failed
    conversations' reasons by index). Errors that stop the run raise."""
    r = cfg.regenerate
    urls = [base_url(u) for u in urls]
    model = check_served_model(urls, cfg.target.name, cfg.target.path, min(r.request_timeout, 60.0))
    stop, shared = threading.Event(), {}

    def warn(msg: str) -> None:
        print(msg, file=progress.out, flush=True)

    pending: queue.Queue = queue.Queue()
    for conv in todo:
        pending.put(conv)
    results: queue.Queue = queue.Queue()

    def lane(i: int) -> None:
        engine = ServerEngine(urls, model, settings, i, shared, r.request_timeout, r.retries, r.retry_backoff, stop,
                              tokenizer, warn)
        while not stop.is_set():
            try:
                conv = pending.get_nowait()
            except queue.Empty:
                return
            try:
                rows = regenerate_batch(engine, tokenizer, [conv], settings, stop.is_set)
            except BaseException as e:  # noqa: BLE001 - handed to the main thread, which stops the run
                results.put(("error", e))
                return
            if rows is not None:
                results.put(("rows", rows))

    lanes = [threading.Thread(target=lane, args=(i,), daemon=True) for i in range(r.concurrency * len(urls))]
    print(f"regenerate: {len(todo)} conversations to {len(urls)} server(s) serving {model!r}, "
          f"{len(lanes)} requests in flight at most", flush=True, file=progress.out)
    for t in lanes:
        t.start()
    old = {s: signal.signal(s, lambda _s, _f: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    log = CommitLog(work / "logs" / "server.jsonl")
    done = tokens = 0
    failed: dict[int, str] = {}
    failure: Optional[BaseException] = None
    try:
        while done < len(todo) and not stop.is_set():
            try:
                kind, value = results.get(timeout=0.5)
            except queue.Empty:
                if not any(t.is_alive() for t in lanes) and results.empty():
                    break
                progress.maybe_print()
                continue
            if kind == "error":
                failure = value
                stop.set()
                break
            ok = [row for row in value if not row.get("failed")]
            failed.update({row["index"]: row["failed"] for row in value if row.get("failed")})
            if ok:
                log.append({"engine": "server", "rows": ok})
            done += 1
            tokens += sum(row["tokens"] for row in value)
            progress.update("server", already + done, tokens)
            progress.maybe_print()
    finally:
        stop.set()
        log.close()
        for s, h in old.items():
            signal.signal(s, h)
    progress.maybe_print(force=True)
    if failure is not None:
        raise failure
    return (0 if done == len(todo) else 130), failed
