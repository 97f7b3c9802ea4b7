"""Fake vLLM and SGLang servers on loopback for `dflash serve-check` tests (tests/test_serve_check.py): the
endpoints serve-check reads, with the engines' own names (pipeline/serve_protocol.py cites the sources).

`FakeEngine(kind, tau=..., **knobs).start()` serves in a thread until `stop()`; knobs: spec (False: no
speculative decoding), move (False: counters present but frozen), models (vLLM /v1/models ids), draft_path
(SGLang's speculative_draft_model_path), num_spec (vLLM positions / SGLang num draft tokens), fail_at (the
n-th generation request, 1-based, answers HTTP 500), hang (every request blocks until stop())."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FakeEngine:
    def __init__(self, kind: str, tau: float = 5.0, *, spec: bool = True, move: bool = True, models=("tiny/target",),
                 draft_path: str = "/srv/export", num_spec: int = 15, fail_at: int = 0, hang: bool = False,
                 prompt_tokens: int = 40):
        self.kind, self.tau, self.spec, self.move = kind, tau, spec, move
        self.models, self.draft_path, self.num_spec = list(models), draft_path, num_spec
        self.fail_at, self.hang, self.prompt_tokens = fail_at, hang, prompt_tokens
        self.generations, self.drafts, self.accepted = 0, 0, 0
        self.per_pos = [0] * num_spec
        self.bodies: list[dict] = []
        self.release = threading.Event()

    # the counters one request moves: 10 drafts, accepting tau - 1 tokens each (the first positions first)
    def _generate(self) -> tuple[int, int]:
        drafts = 10
        acc = round(drafts * (self.tau - 1))
        if self.move:
            self.drafts += drafts
            self.accepted += acc
            for i in range(acc):
                self.per_pos[(i // drafts) % max(1, self.num_spec)] += 1
        return drafts, acc + drafts

    def metrics(self) -> str:
        lab = f'engine="0",model_name="{self.models[0]}"'
        lines = ["# HELP vllm:num_requests_running Number of requests.", f"vllm:num_requests_running{{{lab}}} 0.0"]
        if self.spec:
            lines += ["# TYPE vllm:spec_decode_num_drafts_total counter",
                      f"vllm:spec_decode_num_drafts_total{{{lab}}} {float(self.drafts)}",
                      f"vllm:spec_decode_num_draft_tokens_total{{{lab}}} {float(self.drafts * self.num_spec)}",
                      f"vllm:spec_decode_num_accepted_tokens_total{{{lab}}} {float(self.accepted)}"]
            lines += [f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{lab},position="{i}"}} {float(v)}'
                      for i, v in enumerate(self.per_pos)]
        return "\n".join(lines) + "\n"

    def start(self) -> "FakeEngine":
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, code: int, payload, ctype="application/json"):
                data = payload.encode() if isinstance(payload, str) else json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if engine.hang:
                    engine.release.wait()
                    return
                if self.path == "/metrics" and engine.kind == "vllm":
                    return self._send(200, engine.metrics(), "text/plain; version=0.0.4")
                if self.path == "/v1/models":
                    return self._send(200, {"object": "list", "data": [{"id": m, "object": "model"}
                                                                      for m in engine.models]})
                if self.path == "/get_server_info" and engine.kind == "sglang":
                    return self._send(200, {"speculative_algorithm": "DFLASH" if engine.spec else None,
                                            "speculative_draft_model_path": engine.draft_path,
                                            "speculative_num_draft_tokens": engine.num_spec})
                self._send(404, {"detail": "Not Found"})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                if engine.hang:
                    engine.release.wait()
                    return
                engine.generations += 1
                engine.bodies.append(body)
                if engine.generations == engine.fail_at:
                    return self._send(500, {"error": "CUDA error: an illegal memory access"})
                drafts, tokens = engine._generate()
                if engine.kind == "sglang" and self.path == "/generate":
                    meta = {"prompt_tokens": engine.prompt_tokens, "completion_tokens": tokens}
                    if engine.spec:
                        meta["spec_verify_ct"] = drafts if engine.move else 0
                    return self._send(200, {"text": "x", "meta_info": meta})
                if engine.kind == "vllm" and self.path in ("/v1/chat/completions", "/v1/completions"):
                    return self._send(200, {"choices": [{"index": 0}], "usage": {
                        "prompt_tokens": engine.prompt_tokens, "completion_tokens": tokens}})
                self._send(404, {"detail": "Not Found"})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.02},
                                       daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        return self

    def stop(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)
