"""`dflash serve-check EXPORT --server URL`: is the τ the drafter was trained to reach the τ a running vLLM or
SGLang server gives (issue 42 item 3)?

Contract:
- Reads EXPORT's τ record (pipeline/tau_record.py `read_tau`): trained τ = its tau_online, else tau_offline, at
  its block size and temperature; an export without an evaluated record is refused (run `dflash eval`).
- Prompts: `--prompts FILE` (JSONL: {"messages": [...]} or {"text": "..."} per line), else the held-out prompts
  of `--config` (stages/eval_online.py `heldout_prompts`, the ones `dflash eval --online` decodes); at most
  `--num-prompts`. They are sent one at a time at the record's temperature, so the engine's counters move for
  one request at a time (vLLM's counters are the server's: run the check on a server no one else is using).
- Engine (`--engine auto`: SGLang when `/get_server_info` answers, else vLLM); the counters are the engines' own
  (pipeline/serve_protocol.py names the source files). vLLM: messages to `/v1/chat/completions`, text to
  `/v1/completions`, `/metrics` read before and after each request. SGLang: text to `/generate` (messages are
  rendered with `--tokenizer`'s chat template, default the config's target), per-request `meta_info`.
- Served τ = 1 + Σaccepted / Σdrafts (vLLM) or Σcompletion_tokens / Σspec_verify_ct (SGLang). It prints served
  against trained τ, per-position acceptance (vLLM), τ by the prompt's context bucket, and the serving commands
  (pipeline/serve_commands.py). Returns 0 when served τ >= min_ratio × trained τ, else 1 with one line naming the
  likely causes, most likely first (pipeline/serve_protocol.py `diagnose`); no speculative decoding at all
  (counters absent, or drafts that never move) is its own exit-1 line. A server that cannot be checked is a
  `ServeCheckError` (exit 2). Every request waits at most `--timeout` s and the whole check `--deadline` s.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from pipeline.serve_commands import describe, export_facts, serve_commands
from pipeline.serve_protocol import (Http, ServeCheckError, counters_delta, diagnose, vllm_counters)
from pipeline.tau_record import CONTEXT_BUCKETS, context_bucket, read_tau


def load_prompts(prompts: Optional[str], cfg, n: int) -> list[dict]:
    """[{"messages": [...]}] or [{"text": ...}], at most n (see the module contract)."""
    if prompts:
        out = []
        for i, line in enumerate(Path(prompts).read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                row = None
            if not isinstance(row, dict) or not (isinstance(row.get("text"), str)
                                                 or isinstance(row.get("messages"), list)):
                raise ServeCheckError(f"{prompts}:{i}: not a {{\"messages\": [...]}} or {{\"text\": \"...\"}} "
                                      "JSON line; fix the prompts file")
            out.append({"text": row["text"]} if isinstance(row.get("text"), str) else {"messages": row["messages"]})
        return out[:n]
    if cfg is None:
        raise ServeCheckError("no prompts: give --prompts FILE (JSONL) or --config CFG (its held-out prompts)")
    from stages.eval_online import heldout_prompts

    return [{"messages": m} for _sid, m in heldout_prompts(cfg, n)]


def _trained(export: str) -> dict:
    record = read_tau(export)
    if record is None or not record["evaluated"]:
        why = "has no dflash_tau.json" if record is None else f"records no τ ({record['reason']})"
        raise ServeCheckError(f"{export} {why}; run `dflash eval {export} --online` first, then serve-check it")
    tau = record["tau_online"] if record["tau_online"] is not None else record["tau_offline"]
    if tau is None:
        raise ServeCheckError(f"{export}/dflash_tau.json has neither tau_online nor tau_offline; run "
                              f"`dflash eval {export} --online`")
    return {**record, "tau": float(tau), "which": "tau_online" if record["tau_online"] is not None else "tau_offline"}


def _same_name(a: str, b: str) -> bool:
    return Path(str(a).rstrip("/")).name.lower() == Path(str(b).rstrip("/")).name.lower()


def _render(prompt: dict, tokenizer) -> str:
    if "text" in prompt:
        return prompt["text"]
    if tokenizer is None:
        raise ServeCheckError("SGLang's /generate takes text: give --tokenizer (the target's) to render the chat "
                              "prompts with its template, or --prompts FILE with {\"text\": ...} lines")
    return tokenizer.apply_chat_template(prompt["messages"], tokenize=False, add_generation_prompt=True)


def _vllm(http: Http, prompts: list[dict], temperature: float, max_tokens: int, facts: dict, target) -> dict:
    models = [m.get("id") for m in (http.json("/v1/models") or {}).get("data") or []]
    want = target or facts["target"]
    seen = {"engine": "vllm", "model_mismatch": None, "spec_tokens": None}
    if want and models and not any(_same_name(m, want) for m in models):
        seen["model_mismatch"] = f"the server serves {models}, the drafter was trained on {want}"
    before = vllm_counters(http.get_text("/metrics") or "")
    if before is None:
        raise _NoSpec("vLLM's /metrics has no vllm:spec_decode_* counters: the server runs without a speculative "
                       "config")
    seen["spec_tokens"] = len(before["per_pos"]) or None
    steps = []
    for p in prompts:
        body = {"model": models[0] if models else want, "max_tokens": max_tokens, "temperature": temperature}
        path = "/v1/chat/completions" if "messages" in p else "/v1/completions"
        body.update({"messages": p["messages"]} if "messages" in p else {"prompt": p["text"]})
        usage = (http.json(path, body) or {}).get("usage") or {}
        after = vllm_counters(http.get_text("/metrics") or "")
        if after is None:
            raise ServeCheckError("vLLM's spec-decode counters vanished from /metrics midway (was the server "
                                  "restarted?); run the check again")
        d = counters_delta(before, after)
        before = after
        steps.append({"context": int(usage.get("prompt_tokens") or 0), "drafts": d["drafts"],
                      "tokens": d["drafts"] + d["accepted"], "accepted": d["accepted"], "per_pos": d["per_pos"],
                      "completion": int(usage.get("completion_tokens") or 0)})
    return {"seen": seen, "steps": steps}


def _sglang(http: Http, info: dict, prompts, temperature, max_tokens, export, tokenizer) -> dict:
    seen = {"engine": "sglang", "model_mismatch": None, "spec_tokens": info.get("speculative_num_draft_tokens")}
    if not info.get("speculative_algorithm"):
        raise _NoSpec("SGLang's /get_server_info has no speculative_algorithm: the server runs without "
                       "--speculative-algorithm DFLASH")
    draft = info.get("speculative_draft_model_path")
    if draft and not _same_name(draft, export):
        seen["model_mismatch"] = f"the server drafts with {draft}, not the export {export}"
    steps = []
    for p in prompts:
        body = {"text": _render(p, tokenizer), "sampling_params": {"temperature": temperature,
                                                                    "max_new_tokens": max_tokens}}
        meta = (http.json("/generate", body) or {}).get("meta_info") or {}
        if "spec_verify_ct" not in meta:
            raise _NoSpec("SGLang's responses carry no meta_info.spec_verify_ct: the server is not decoding "
                           "speculatively")
        verify, done = int(meta["spec_verify_ct"]), int(meta.get("completion_tokens") or 0)
        steps.append({"context": int(meta.get("prompt_tokens") or 0), "drafts": verify, "tokens": done,
                      "accepted": done - verify, "per_pos": [], "completion": done})
    return {"seen": seen, "steps": steps}


class _NoSpec(Exception):
    """The server runs no speculative decoding (an exit-1 finding, not an error)."""


def _taus(steps: list[dict]) -> dict:
    drafts = sum(s["drafts"] for s in steps)
    out = {"tau": sum(s["tokens"] for s in steps) / drafts if drafts else None, "drafts": drafts, "by_context": {}}
    n = max((len(s["per_pos"]) for s in steps), default=0)
    out["per_pos"] = [sum(s["per_pos"][i] for s in steps if i < len(s["per_pos"])) / drafts
                      for i in range(n)] if drafts else []
    for label, _lo, _hi in CONTEXT_BUCKETS:
        mine = [s for s in steps if context_bucket(s["context"]) == label]
        d = sum(s["drafts"] for s in mine)
        if d:
            out["by_context"][label] = {"tau": sum(s["tokens"] for s in mine) / d, "n": len(mine)}
    return out


def _tokenizer(path: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ServeCheckError(f"cannot load the tokenizer {path} to render the chat prompts for SGLang "
                              f"({str(e).splitlines()[0][:120]}); give --tokenizer PATH (the target's)") from None


def _detect(http: Http, engine: str) -> tuple[str, dict]:
    if engine in ("auto", "sglang"):
        info = http.json("/get_server_info", missing_ok=True)
        if isinstance(info, dict):
            return "sglang", info
        if engine == "sglang":
            raise ServeCheckError(f"{http.base}/get_server_info is not found: not an SGLang server (try --engine vllm)")
    return "vllm", {}


def run_serve_check(export: str, *, server: str, prompts: Optional[str] = None, cfg=None, engine: str = "auto",
                    min_ratio: float = 0.8, num_prompts: int = 16, max_tokens: int = 256, timeout: float = 60.0,
                    deadline: float = 900.0, target: Optional[str] = None, tokenizer=None) -> int:
    """The check (see the module contract): 0 pass, 1 served τ too low or no speculative decoding."""
    trained, facts = _trained(export), export_facts(export)
    chosen = load_prompts(prompts, cfg, num_prompts)
    if not chosen:
        raise ServeCheckError("no prompts to send: the prompts file is empty")
    http = Http(server, timeout, deadline)
    kind, info = _detect(http, engine)
    temp = float(trained["temperature"])
    try:
        if kind == "vllm":
            got = _vllm(http, chosen, temp, max_tokens, facts, target)
        else:
            tok = tokenizer or (cfg.target.path if cfg is not None and not prompts else None)
            if isinstance(tok, str):  # a path or hub name; tests hand a tokenizer object
                tok = _tokenizer(tok)
            got = _sglang(http, info, chosen, temp, max_tokens, export, tok)
    except _NoSpec as e:
        print(f"serve-check FAILED: no speculative decoding: {e}; serve with the commands below\n"
              + describe(serve_commands(export, target)))
        return 1
    return _report(got, trained, facts, kind, min_ratio, export, target)


def _report(got: dict, trained: dict, facts: dict, kind: str, min_ratio: float, export: str, target) -> int:
    served = _taus(got["steps"])
    if not served["drafts"]:
        print(f"serve-check FAILED: no speculative decoding: the {kind} server's speculative counters never moved "
              f"over {len(got['steps'])} request(s) ({sum(s['completion'] for s in got['steps'])} tokens "
              "generated); the drafter is not being run: check the server's speculative config and log")
        return 1
    print(f"served tau {served['tau']:.2f} ({kind}, {len(got['steps'])} prompts, {served['drafts']:.0f} verify steps)"
          f" vs trained tau {trained['tau']:.2f} ({trained['which']}, block {trained['block_size']}, "
          f"temperature {trained['temperature']:g})")
    if served["per_pos"]:
        print("per-position acceptance: " + " ".join(f"{r:.2f}" for r in served["per_pos"]))
    trained_ctx = trained.get("by_context") or {}
    print("tau by context: " + "; ".join(
        f"{k} served {v['tau']:.2f} (n {v['n']}) trained "
        + ("-" if (trained_ctx.get(k) or {}).get(trained["which"]) is None
           else f"{trained_ctx[k][trained['which']]:.2f}") for k, v in served["by_context"].items()))
    if served["tau"] >= min_ratio * trained["tau"]:
        print(f"serve-check passed: served tau {served['tau']:.2f} >= {min_ratio:g} x trained tau {trained['tau']:.2f}")
        return 0
    seen = {**got["seen"], "expected_tokens": trained["block_size"] - 1 if kind == "vllm" else trained["block_size"],
            "non_causal_sliding": facts["is_causal"] is False and "sliding_attention" in facts["layer_types"],
            "layer_ids": _layer_ids(export)}
    causes = diagnose(seen)
    print(describe(serve_commands(export, target)))
    print(f"serve-check FAILED: served tau {served['tau']:.2f} < {min_ratio:g} x trained tau {trained['tau']:.2f}; "
          "likely causes, most likely first: " + "; ".join(f"{i}) {c}" for i, c in enumerate(causes, 1)))
    return 1


def _layer_ids(export: str) -> list:
    try:
        return json.loads((Path(export) / "config.json").read_text())["dflash_config"]["target_layer_ids"]
    except (OSError, ValueError, KeyError, TypeError):
        return []
