"""`dflash serve-check` (stages/serve_check.py) against fake vLLM and SGLang servers on loopback
(tests/helpers_engines.py): served against trained τ, per position and by context, the diagnosis of a low τ,
an engine without speculative decoding, frozen counters, a wrong model, HTTP errors midway, a hanging server."""

from __future__ import annotations

import json

import pytest

from helpers_engines import FakeEngine
from pipeline.serve_protocol import ServeCheckError, vllm_counters
from pipeline.tau_record import write_tau
from stages.serve_check import run_serve_check

TRAINED = 5.0


@pytest.fixture
def export(tmp_path):
    """An export directory with what serve-check reads: config.json, dflash_meta.json, dflash_tau.json."""
    d = tmp_path / "export"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"block_size": 16, "layer_types": ["sliding_attention", "full_attention"],
                                               "is_causal": False, "dflash_config": {"target_layer_ids": [1, 3, 5]}}))
    (d / "dflash_meta.json").write_text(json.dumps({"target": "tiny/target"}))
    write_tau(d, {"schema": 1, "evaluated": True, "reason": None, "tau_offline": 5.5, "tau_online": TRAINED,
                  "tokens_per_target_forward": 4.8, "block_size": 16, "temperature": 0.0, "prompt_fingerprint": None,
                  "target_fingerprint": None,
                  "by_context": {"<512": {"tau_offline": 5.5, "tau_online": 5.0, "n": 30}}})
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join([json.dumps({"messages": [{"role": "user", "content": "hi"}]}),
                                  json.dumps({"text": "Once upon a time"}), json.dumps({"text": "2 + 2 ="})]) + "\n")
    return d, str(prompts)


@pytest.fixture
def engine():
    started = []

    def make(kind, **kw):
        e = FakeEngine(kind, **kw).start()
        started.append(e)
        return e

    yield make
    for e in started:
        e.stop()


def check(export, url, **kw):
    """serve-check of the export with the three prompts; SGLang renders the chat one with a Qwen-style template."""
    from helpers_tokenizers import qwen_style_tokenizer

    d, prompts = export
    return run_serve_check(str(d), server=url, prompts=prompts, timeout=kw.pop("timeout", 10),
                           tokenizer=qwen_style_tokenizer(), **kw)


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_good_drafter_passes(export, engine, capsys, kind):
    e = engine(kind, tau=4.6, draft_path=str(export[0]), num_spec=15 if kind == "vllm" else 16)
    assert check(export, e.url) == 0
    out = capsys.readouterr().out
    assert "served tau 4.60" in out and "trained tau 5.00 (tau_online, block 16, temperature 0)" in out
    assert "tau by context: <512 served 4.60 (n 3) trained 5.00" in out and "serve-check passed" in out
    assert e.generations == 3 and all(b.get("temperature", b.get("sampling_params", {}).get("temperature")) == 0.0
                                      for b in e.bodies)
    if kind == "vllm":  # 36 accepted of 10 drafts per request: positions 0-2 always, 3 in 6 of 10
        assert "per-position acceptance: 1.00 1.00 1.00 0.60 0.00" in out
        assert [("messages" in b, "prompt" in b) for b in e.bodies] == [(True, False), (False, True), (False, True)]
    else:
        assert e.bodies[0]["text"].startswith("<|im_start|>user\nhi<|im_end|>") and e.bodies[1]["text"] == "Once upon a time"


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_collapsed_drafter_fails_naming_the_causes_in_order(export, engine, capsys, kind):
    e = engine(kind, tau=1.1, draft_path=str(export[0]), num_spec=15 if kind == "vllm" else 16)
    assert check(export, e.url) == 1
    capsys_out = capsys.readouterr().out
    line = capsys_out.splitlines()[-1]
    assert line.startswith("serve-check FAILED") and "served tau 1.10 < 0.8 x trained tau 5.00" in line
    assert "serve with vLLM:" in capsys_out and "--speculative-draft-attention-backend flashinfer" in capsys_out
    order = [line.index(w) for w in ("1) the chat template", "2) the target layer ids", "[1, 3, 5]",
                                     "3) the attention backend", "flashinfer", "4) a quantized target")]
    assert order == sorted(order) and "wrong model" not in line and "num_speculative_tokens" not in line


def test_wrong_model_and_token_count_come_first(export, engine, capsys):
    e = engine("vllm", tau=1.2, models=["Qwen/Qwen3-8B"], num_spec=7)
    assert check(export, e.url) == 1
    line = capsys.readouterr().out.splitlines()[-1]
    assert "1) wrong model: the server serves ['Qwen/Qwen3-8B'], the drafter was trained on tiny/target" in line
    assert "2) num_speculative_tokens is 7, the drafter's block size needs 15" in line
    s = engine("sglang", tau=1.2, draft_path="/models/other-drafter", num_spec=8)
    assert check(export, s.url) == 1
    line = capsys.readouterr().out.splitlines()[-1]
    assert "1) wrong model: the server drafts with /models/other-drafter" in line
    assert "2) --speculative-num-draft-tokens is 8, the drafter's block size needs 16" in line


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_engine_without_speculative_decoding(export, engine, capsys, kind):
    e = engine(kind, spec=False)
    assert check(export, e.url) == 1
    out = capsys.readouterr().out
    assert out.startswith("serve-check FAILED: no speculative decoding: ")
    assert ("no vllm:spec_decode_* counters" if kind == "vllm" else "no speculative_algorithm") in out
    assert "--speculative-num-draft-tokens 16" in out  # the commands that would serve it


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_counters_that_never_move(export, engine, capsys, kind):
    e = engine(kind, move=False, draft_path=str(export[0]), num_spec=15 if kind == "vllm" else 16)
    assert check(export, e.url) == 1
    out = capsys.readouterr().out
    assert out.startswith(f"serve-check FAILED: no speculative decoding: the {kind} server's speculative counters "
                          "never moved over 3 request(s)") and e.generations == 3


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_http_error_midway_is_one_line(export, engine, kind):
    e = engine(kind, fail_at=2, draft_path=str(export[0]))
    with pytest.raises(ServeCheckError) as err:
        check(export, e.url)
    msg = str(err.value)
    assert "HTTP 500" in msg and "illegal memory access" in msg and "check the server's log" in msg
    assert "\n" not in msg and e.generations == 2


def test_hanging_server_is_bounded(export, engine):
    e = engine("vllm", hang=True)
    with pytest.raises(ServeCheckError, match=r"did not answer within 0.3 s; the server is hung") as err:
        check(export, e.url, timeout=0.3)
    assert "\n" not in str(err.value)
    with pytest.raises(ServeCheckError, match=r"ran past its deadline \(0 s\)"):
        check(export, e.url, deadline=0)


def test_unreachable_server_and_unevaluated_export(export, tmp_path):
    with pytest.raises(ServeCheckError, match="cannot reach http://127.0.0.1:9/v1/models"):
        check(export, "http://127.0.0.1:9", engine="vllm")
    write_tau(export[0], {"schema": 1, "evaluated": False, "reason": "no eval yet", "tau_offline": None,
                          "tau_online": None, "tokens_per_target_forward": None, "block_size": 16,
                          "temperature": 0.0, "prompt_fingerprint": None, "target_fingerprint": None,
                          "by_context": {}})
    with pytest.raises(ServeCheckError, match=r"records no τ \(no eval yet\); run `dflash eval .* --online` first"):
        check(export, "http://127.0.0.1:9")


def test_vllm_counters_sum_engines_and_read_positions():
    text = ('vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 4.0\n'
            'vllm:spec_decode_num_drafts_total{engine="1",model_name="m"} 6.0\n'
            'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 12.0\n'
            'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 3.0\n'
            '# HELP vllm:spec_decode_num_drafts_created 1.7e9\n')
    c = vllm_counters(text)
    assert (c["drafts"], c["accepted"], c["per_pos"], c["models"]) == (10.0, 12.0, [0.0, 3.0], {"m"})
    assert vllm_counters("vllm:num_requests_running 0\n") is None


def test_cli_exit_codes(export, engine):
    from helpers_cli import dflash

    d, prompts = export
    bad = engine("vllm", tau=1.1)
    r = dflash("serve-check", str(d), "--server", bad.url, "--prompts", prompts, "--min-ratio", "0.5", check=False)
    assert r.returncode == 1 and "serve-check FAILED: served tau 1.10 < 0.5 x trained tau 5.00" in r.stdout
    r = dflash("serve-check", str(d), "--server", "http://127.0.0.1:9", "--prompts", prompts, "--engine", "vllm",
               check=False)
    assert r.returncode == 2 and r.stderr.strip().startswith("error: cannot reach http://127.0.0.1:9/v1/models")
    assert len(r.stderr.strip().splitlines()) == 1


def test_validation_prompts_of_the_config_are_sent(export, engine, capsys):
    from helpers_cli import TINY
    from pipeline.config import load_config
    from stages.eval_online import heldout_prompts

    cfg = load_config(TINY)
    e = engine("vllm", tau=4.5)
    assert run_serve_check(str(export[0]), server=e.url, cfg=cfg, num_prompts=2, timeout=10) == 0
    assert [b["messages"] for b in e.bodies] == [m for _sid, m in heldout_prompts(cfg, 2)]
    with pytest.raises(ServeCheckError, match="no prompts: give --prompts FILE"):
        run_serve_check(str(export[0]), server=e.url)
    s = engine("sglang", draft_path=str(export[0]))
    with pytest.raises(ServeCheckError, match=r"cannot load the tokenizer .*no-such-tokenizer.*give --tokenizer PATH"):
        run_serve_check(str(export[0]), server=s.url, cfg=cfg, num_prompts=2, tokenizer=str(export[0] / "no-such-tokenizer"))
