"""What `dflash serve-check` (stages/serve_check.py) says to a serving engine and reads back: bounded HTTP, the
engines' speculative-decoding counters, and the diagnosis of a low served τ.

Contract:
- `Http(base, timeout, deadline_s)`: every request waits at most min(timeout, time left before the deadline);
  an HTTP error, a refused connection, a timeout or a body that is not JSON is one `ServeCheckError` line naming
  the URL and what to check. `get(path, missing_ok=True)` returns None for a 404 (an endpoint the engine lacks).
- vLLM (vllm/v1/spec_decode/metrics.py `SpecDecodingProm`, exported by vllm/v1/metrics/loggers.py on `/metrics`):
  Prometheus counters `vllm:spec_decode_num_drafts`, `vllm:spec_decode_num_draft_tokens`,
  `vllm:spec_decode_num_accepted_tokens` and `vllm:spec_decode_num_accepted_tokens_per_pos{position="i"}` (one
  per speculative token, i < num_speculative_tokens), each with the client's `_total` suffix and summed over
  engines. `vllm_counters` reads them (None when the engine registers none: no speculative config); the mean
  acceptance length, the bonus token included, is 1 + accepted / drafts (metrics.py `SpecDecodingLogging.log`),
  per position accepted_per_pos[i] / drafts.
- SGLang (python/sglang/srt/managers/tokenizer_manager.py, the `meta_info` of `/generate` responses;
  python/sglang/srt/server_args.py for `/get_server_info`): `spec_verify_ct` (verify steps of the request),
  `completion_tokens`, `prompt_tokens`; its acceptance length is completion_tokens / spec_verify_ct (the
  bonus token included, as tokenizer_manager's `spec_accept_length`). `/get_server_info` gives
  `speculative_algorithm`, `speculative_draft_model_path`, `speculative_num_draft_tokens`.
- `diagnose(seen)`: the usual causes of a low served τ, most likely first for what was seen (mismatches the check
  observed come before the ones it cannot observe).
"""

from __future__ import annotations

import json
import re
import socket
import time
import urllib.error
import urllib.request
from typing import Optional

from .errors import UserError

VLLM_DRAFTS = "vllm:spec_decode_num_drafts"
VLLM_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
VLLM_ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
VLLM_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
_SAMPLE = re.compile(r'^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


class ServeCheckError(UserError, RuntimeError):
    """The server could not be checked (unreachable, an HTTP error, no answer in time, a malformed answer)."""


class Http:
    """Bounded JSON/text requests to one server (see the module contract)."""

    def __init__(self, base: str, timeout: float, deadline_s: float):
        self.base, self.timeout = base.rstrip("/"), float(timeout)
        self.deadline = time.monotonic() + float(deadline_s)
        self.deadline_s = float(deadline_s)

    def _wait(self, url: str) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise ServeCheckError(f"serve-check ran past its deadline ({self.deadline_s:g} s) before {url}; "
                                  "raise --deadline or send fewer prompts (--num-prompts)")
        return min(self.timeout, left)

    def request(self, path: str, body: Optional[dict] = None, missing_ok: bool = False) -> Optional[bytes]:
        url = self.base + path
        wait = self._wait(url)
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"} if data else {})
        try:
            with urllib.request.urlopen(req, timeout=wait) as r:
                return r.read()
        except urllib.error.HTTPError as e:
            if missing_ok and e.code == 404:
                return None
            detail = e.read(300).decode(errors="replace").replace("\n", " ").strip()
            raise ServeCheckError(f"{url} answered HTTP {e.code} {e.reason}"
                                  + (f" ({detail})" if detail else "") + "; check the server's log") from None
        except (socket.timeout, TimeoutError):
            raise ServeCheckError(f"{url} did not answer within {wait:g} s; the server is hung or overloaded: "
                                  "check its log, or raise --timeout") from None
        except urllib.error.URLError as e:
            if isinstance(e.reason, (socket.timeout, TimeoutError)):
                raise ServeCheckError(f"{url} did not answer within {wait:g} s; the server is hung or "
                                      "overloaded: check its log, or raise --timeout") from None
            raise ServeCheckError(f"cannot reach {url} ({e.reason}); is the server running at --server "
                                  f"{self.base}?") from None
        except (ConnectionError, OSError) as e:
            raise ServeCheckError(f"{url}: the connection failed ({e}); check the server's log") from None

    def get_text(self, path: str, missing_ok: bool = False) -> Optional[str]:
        raw = self.request(path, missing_ok=missing_ok)
        return None if raw is None else raw.decode(errors="replace")

    def json(self, path: str, body: Optional[dict] = None, missing_ok: bool = False):
        raw = self.request(path, body, missing_ok=missing_ok)
        if raw is None:
            return None
        try:
            return json.loads(raw)
        except ValueError:
            raise ServeCheckError(f"{self.base + path} answered something that is not JSON ({raw[:80]!r}); "
                                  "is --server an OpenAI-compatible vLLM or SGLang server?") from None


def parse_prometheus(text: str) -> list[tuple[str, dict, float]]:
    """(name, labels, value) of every sample line of a Prometheus text exposition."""
    out = []
    for line in text.splitlines():
        m = _SAMPLE.match(line.strip())
        if not m or line.startswith("#"):
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        out.append((m.group(1), dict(_LABEL.findall(m.group(2) or "")), value))
    return out


def vllm_counters(text: str) -> Optional[dict]:
    """{"drafts", "draft_tokens", "accepted", "per_pos": [...], "models": {model_name label}} summed over
    engines, or None when the exposition has no spec-decode counters."""
    got = {"drafts": 0.0, "draft_tokens": 0.0, "accepted": 0.0}
    names = {VLLM_DRAFTS: "drafts", VLLM_DRAFT_TOKENS: "draft_tokens", VLLM_ACCEPTED: "accepted"}
    per_pos: dict[int, float] = {}
    seen, models = False, set()
    for name, labels, value in parse_prometheus(text):
        base = name.removesuffix("_total")
        if base in names:
            got[names[base]] += value
            seen = True
            if "model_name" in labels:
                models.add(labels["model_name"])
        elif base == VLLM_PER_POS and labels.get("position", "").isdigit():
            per_pos[int(labels["position"])] = per_pos.get(int(labels["position"]), 0.0) + value
    if not seen:
        return None
    return {**got, "per_pos": [per_pos.get(i, 0.0) for i in range(max(per_pos) + 1)] if per_pos else [],
            "models": models}


def counters_delta(before: dict, after: dict) -> dict:
    """What the counters gained between two reads."""
    n = max(len(before["per_pos"]), len(after["per_pos"]))
    pad = lambda v: v + [0.0] * (n - len(v))  # noqa: E731
    return {**{k: after[k] - before[k] for k in ("drafts", "draft_tokens", "accepted")},
            "per_pos": [a - b for a, b in zip(pad(after["per_pos"]), pad(before["per_pos"]))],
            "models": after["models"]}


def diagnose(seen: dict) -> list[str]:
    """The likely causes of a low served τ, most likely first. `seen`: engine, model_mismatch (str or None),
    spec_tokens / expected_tokens (ints or None), non_causal_sliding (bool), layer_ids (list)."""
    causes = []
    if seen.get("model_mismatch"):
        causes.append(f"wrong model: {seen['model_mismatch']}")
    if seen.get("spec_tokens") is not None and seen["spec_tokens"] != seen.get("expected_tokens"):
        what = "num_speculative_tokens" if seen.get("engine") == "vllm" else "--speculative-num-draft-tokens"
        causes.append(f"{what} is {seen['spec_tokens']}, the drafter's block size needs {seen['expected_tokens']}: "
                      "serve with the commands `dflash export` prints")
    causes.append("the chat template: the server's template must be the one the store was extracted with "
                  "(the target's tokenizer_config.json; no --chat-template override)")
    causes.append(f"the target layer ids: the engine must read the target layers {seen.get('layer_ids')} "
                  "(the export's dflash_config.target_layer_ids) from the same target")
    if seen.get("non_causal_sliding"):
        causes.append("the attention backend: this drafter is is_causal false with sliding layers; on SGLang serve "
                      "it with --speculative-draft-attention-backend flashinfer (FA3's window makes it causal)")
    causes.append("a quantized target (FP8/INT4): its hidden states differ from the bf16 target the drafter was "
                  "trained on; serve that target")
    return causes
