"""`dflash regenerate` with the embedded engine: prompt reading, batched generation equal to a hand-written greedy
loop token for token (what extraction sees), commit log, resume after kill -9, Ctrl-C, config, demo wiring."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from data.ingest import IngestError, ingest, tokenize_conversation  # noqa: E402
from data.prompts import check_renders, read_prompts, split_segments  # noqa: E402
from helpers_cli import HANG_S, TINY, dflash, must_pass, selected, start  # noqa: E402
from pipeline.config import ConfigError, load_config  # noqa: E402
from regen_helpers import (END, ROOT, greedy_conversation, greedy_loop, read_jsonl,  # noqa: E402
                           tiny_model_and_tokenizer, write_prompts)
from stages.regen_records import CommitLog, read_log, regenerate_batch  # noqa: E402
from stages.regen_worker import EmbeddedEngine, generate_ids  # noqa: E402

U1, U2 = {"role": "user", "content": "a"}, {"role": "user", "content": "b"}
A, S = {"role": "assistant", "content": "x"}, {"role": "system", "content": "s"}


@pytest.fixture(scope="module")
def tiny():
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a 1.6M-parameter model: thread hand-offs cost more than they save (more on a busy machine)
    yield tiny_model_and_tokenizer()
    torch.set_num_threads(threads)


def _settings(**kw) -> dict:
    return {"max_new_tokens": 96, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": 0, "enable_thinking": False,
            "max_prompt_tokens": 256, "keep_truncated": True, **kw}


def test_segments_drop_assistant_turns():
    assert split_segments([U1, A, U2, A]) == [[U1], [U2]]
    assert split_segments([S, U1]) == [[S, U1]]  # a prompt without any answer: one response at the end
    assert split_segments([S, A, U1, U2, A, S]) == [[S, U1, U2]]  # greeting dropped, trailing system dropped
    assert split_segments([U1, A, U2]) == [[U1], [U2]]  # a trailing user turn gets its answer too
    assert split_segments([S, A]) == []


def test_bad_prompt_rows_name_file_and_line(tmp_path):
    good = json.dumps({"messages": [U1]})
    bad = tmp_path / "p.jsonl"
    bad.write_text(f"{good}\n{good}\n{{not json\n")
    with pytest.raises(IngestError, match=r"p\.jsonl, line 3: invalid JSON"):
        read_prompts([str(bad)])
    bad.write_text(f"{good}\n" + json.dumps({"messages": [S, A]}) + "\n")
    with pytest.raises(IngestError, match=r"p\.jsonl, line 2: the conversation has no user turn"):
        read_prompts([str(bad)])
    convs = read_prompts([str(bad)], on_bad_row="skip")
    assert [c.source.rsplit(" ", 1)[-1] for c in convs] == ["1"]
    # ShareGPT rows and rows with empty assistant placeholders are prompts too
    ok = tmp_path / "ok.jsonl"
    ok.write_text(json.dumps({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": ""}]}) + "\n")
    assert read_prompts([str(ok)])[0].segments == [[{"role": "user", "content": "hi"}]]


def test_template_failure_is_named_before_model_work(tmp_path, tiny):
    _, tok = tiny
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"messages": [U1]}) + "\n" + json.dumps({"messages": [{"role": "tool", "content": "t"}]}) + "\n")
    with pytest.raises(IngestError, match=r"p\.jsonl, line 2: turn 0 has role .tool."):
        read_prompts([str(path)])
    tok2 = type(tok).from_pretrained(str(ROOT / "data" / "assets" / "tiny-target"))
    tok2.chat_template = "{{ raise_exception('no system role') if messages[0].role == 'system' else messages[0].content }}"
    path.write_text(json.dumps({"messages": [U1]}) + "\n" + json.dumps({"messages": [S, U1]}) + "\n")
    with pytest.raises(IngestError, match=r"p\.jsonl, line 2: .*no system role"):
        check_renders(tok2, read_prompts([str(path)]), False)


def test_batched_generation_equals_greedy_loop(tiny):
    """Left-padded batch with the KV cache (generate_ids) == a per-prompt full-recompute argmax loop."""
    model, tok = tiny
    from data.prompts import render_prompt_ids

    rows = read_jsonl(ROOT / "data" / "assets" / "tiny-chat" / "validation.jsonl")[:10]
    prompts = [render_prompt_ids(tok, split_segments(r["messages"])[0], False) for r in rows]
    assert len({len(p) for p in prompts}) > 3  # really padded
    live: list[int] = []
    got = generate_ids(model, prompts, 64, {END}, 0, live=live.append)
    for p, (toks, cut) in zip(prompts, got):
        assert toks == greedy_loop(model, p, 64) and toks[-1] == END and not cut
    total = sum(len(t) for t, _ in got)
    assert live and live == sorted(live) and 32 * len(prompts) >= live[-1] > total // 2 and live[-1] <= total
    short = generate_ids(model, prompts[:3], 5, {END}, 0)  # cut at the limit: flagged, no stop token
    assert all(cut and len(t) == 5 and END not in t for t, cut in short)


def test_regenerated_conversations_tokenise_to_the_greedy_continuation(tiny):
    """Multi-turn: each turn answers after the target's own earlier answers, and the supervised tokens that
    ingest (extraction) makes of the written conversation are exactly the target's greedy tokens."""
    model, tok = tiny
    rows = read_jsonl(ROOT / "data" / "assets" / "tiny-chat" / "train.jsonl")[:14]
    assert sum(len(split_segments(r["messages"])) > 1 for r in rows) >= 4
    from data.prompts import Conversation

    convs = [Conversation(i, 0, f"line {i + 1}", split_segments(r["messages"])) for i, r in enumerate(rows)]
    engine = EmbeddedEngine(model, tok, _settings(), token_budget=2000, max_batch_size=5)  # several batches
    out = regenerate_batch(engine, tok, convs, _settings())
    for row, r in zip(out, rows):
        ref_conv, ref_tokens = greedy_conversation(model, tok, r["messages"], 96)
        assert row["messages"] == ref_conv and row["truncated"] is None and row["ended"] is None
        ids, mask = tokenize_conversation(tok, row["messages"], 10_000, False)
        assert ids[mask.astype(bool)].tolist() == ref_tokens
        assert row["tokens"] == len(ref_tokens)


def test_sampling_is_seeded_and_recorded_in_requests(tiny):
    model, tok = tiny
    from data.prompts import render_prompt_ids
    from stages.regen_client import ServerEngine

    rows = read_jsonl(ROOT / "data" / "assets" / "tiny-chat" / "validation.jsonl")[:6]
    prompts = [render_prompt_ids(tok, split_segments(r["messages"])[0], False) for r in rows]
    kw = dict(temperature=3.0, top_p=0.95, top_k=50)  # flat enough to sample away from greedy
    a = generate_ids(model, prompts, 20, {END}, 0, seed=1, **kw)
    assert a == generate_ids(model, prompts, 20, {END}, 0, seed=1, **kw)  # seeded: reproducible
    assert a != generate_ids(model, prompts, 20, {END}, 0, seed=2, **kw)
    assert a != generate_ids(model, prompts, 20, {END}, 0)  # not greedy
    from stages.regen_records import Prompt

    engine = ServerEngine(["http://x/v1"], "m", _settings(temperature=0.6, top_p=0.95, top_k=20), 0, {}, 1.0, 0, 0.0, None)
    body = engine._payload(Prompt([U1], [1, 2], seed=7))
    assert (body["temperature"], body["top_p"], body["top_k"], body["seed"], body["max_tokens"]) == (0.6, 0.95, 20, 7, 96)
    greedy = ServerEngine(["http://x/v1"], "m", _settings(), 0, {}, 1.0, 0, 0.0, None)._payload(Prompt([U1], [1], 7))
    assert greedy["temperature"] == 0 and "top_k" not in greedy and greedy["chat_template_kwargs"] == {"enable_thinking": False}


def test_limits_truncation_and_prompt_length(tiny):
    model, tok = tiny
    from data.prompts import Conversation

    two_turns = [[U1 | {"content": "count from 1 to 30 ."}], [U2 | {"content": "now count the other way ."}]]
    conv = Conversation(0, 0, "line 1", two_turns)
    cut = regenerate_batch(EmbeddedEngine(model, tok, _settings(max_new_tokens=6), 4096, 8), tok, [conv],
                           _settings(max_new_tokens=6))[0]
    assert cut["truncated"] == 0 and len(cut["messages"]) == 2  # cut turn kept, the conversation ends there
    dropped = regenerate_batch(EmbeddedEngine(model, tok, _settings(max_new_tokens=6), 4096, 8), tok, [conv],
                               _settings(max_new_tokens=6, keep_truncated=False))[0]
    assert dropped["messages"] is None and "dropped" in dropped["ended"]
    long2 = regenerate_batch(EmbeddedEngine(model, tok, _settings(), 4096, 8), tok, [conv], _settings(max_prompt_tokens=30))[0]
    assert len(long2["messages"]) == 2 and "turn 1: prompt of" in long2["ended"]


def test_multi_turn_kept_only_as_far_as_ingest_can_place_it():
    """A template that rewrites earlier turns (BROKEN_TEMPLATE abbreviates them, as Qwen3 strips reasoning) makes
    the later turns of a regenerated conversation unplaceable for ingest: the output keeps the first turn and
    says why, so `dflash extract` reads every written row."""
    from data.prompts import Conversation
    from helpers_tokenizers import broken_template_tokenizer, qwen_style_tokenizer
    from stages.regen_records import Reply

    class Canned:
        def generate(self, prompts):
            return [Reply(text="Hello there", tokens=3) for _ in prompts]

    conv = Conversation(0, 0, "line 1", [[U1 | {"content": "Hi"}], [U2 | {"content": "Good"}]])
    for tok, turns in ((qwen_style_tokenizer(), 2), (broken_template_tokenizer(), 1)):
        row = regenerate_batch(Canned(), tok, [conv], _settings(max_prompt_tokens=10_000))[0]
        assert sum(m["role"] == "assistant" for m in row["messages"]) == turns
        tokenize_conversation(tok, row["messages"], 10_000, False)  # ingest places every kept turn
        assert (row["ended"] is None) == (turns == 2)
        assert turns == 2 or "rewrites earlier turns" in row["ended"]


def test_commit_log_cuts_a_torn_tail(tmp_path):
    path = tmp_path / "log.jsonl"
    log = CommitLog(path)
    log.append({"rows": [{"index": 0}]})
    log.append({"rows": [{"index": 1}]})
    log.close()
    with open(path, "ab") as f:
        f.write(b'{"rows": [{"index": 2')  # kill -9 in the middle of a write
    assert [r["rows"][0]["index"] for r in read_log(path)[0]] == [0, 1]
    assert path.read_bytes().endswith(b'{"index": 2')  # readers leave it alone
    log = CommitLog(path)  # the writer cuts it and appends after the last commit
    log.append({"rows": [{"index": 2}]})
    log.close()
    assert [r["rows"][0]["index"] for r in read_log(path)[0]] == [0, 1, 2]
    assert read_log(path)[1] == path.stat().st_size


def test_regenerate_config_section_is_validated(tmp_path):
    cfg = load_config(TINY)
    assert cfg.regenerate.temperature == 0.0 and cfg.regenerate.max_new_tokens > 48
    for bad, msg in [("regenerate.top_p=0", "top_p"), ("regenerate.temperature=-1", "temperature"),
                     ("regenerate.max_new_tokens=0", "max_new_tokens"), ("regenerate.bogus=1", "unknown key")]:
        with pytest.raises(ConfigError, match=msg):
            load_config(TINY, [bad])


def test_bad_line_fails_before_any_model_work(tmp_path):
    from stages.regenerate import run_regenerate

    prompts = write_prompts(tmp_path / "p.jsonl", 5)
    with open(prompts, "a") as f:
        f.write('{"messages": [{"role": "user", "content": ""}]}\n')
    with pytest.raises(IngestError, match=r"p\.jsonl, line 6: turn 0 \(user\) has empty content"):
        run_regenerate(load_config(TINY), prompts=[str(prompts)], out=str(tmp_path / "o"))
    assert not (tmp_path / "o").exists()  # nothing written, no worker started


def _start_reference(d: Path) -> tuple:
    """(prompts, out, the run): an uninterrupted CLI run over 48 conversations, 2 shards, small batches, started in
    the background (helpers_cli.start)."""
    prompts = write_prompts(d / "chat.jsonl", 48)
    out = d / "ref"
    run = start([sys.executable, "-m", "stages.cli", "regenerate", "--prompts", str(prompts), "--out", str(out),
                 "--shards", "2", *SMALL])
    return prompts, out, run


@pytest.fixture(scope="module", autouse=True)
def _reference_ahead(request, tmp_path_factory):
    """The reference run (reference_run), started at this module's first test when the session runs a test that
    needs it: the in-process tests before those run on one thread (`tiny`), which leaves it the other core."""
    if not selected(request, "test_cli_output_is_what_extract_reads",
                    "test_resume_after_kill9_and_ctrl_c_equals_uninterrupted"):
        yield None
        return
    prompts, out, run = _start_reference(tmp_path_factory.mktemp("regen"))
    yield prompts, out, run
    run.result()  # (not left running past the module)


@pytest.fixture(scope="module")
def reference_run(_reference_ahead, tmp_path_factory):
    """An uninterrupted CLI run over 48 conversations, 2 shards, small batches: (prompts, out), once it ended."""
    prompts, out, run = _reference_ahead or _start_reference(tmp_path_factory.mktemp("regen"))
    must_pass(run.result())
    return prompts, out


SMALL = ["--set", "regenerate.max_batch_size=4", "--set", "regenerate.max_new_tokens=96"]


def test_workers_get_the_config_resolved_once_and_no_set_strings(tmp_path, monkeypatch):
    """Each embedded worker is started on OUT/work/regenerate-config.yaml, written once by the parent, which
    `load_config` reads back as the parent's config: no `--config` + `--set` strings to re-parse per worker."""
    import stages.regenerate as rg
    from pipeline.lifecycle import Outcome

    cfg = load_config(TINY, ["regenerate.max_batch_size=3", "regenerate.temperature=0.7"])
    spawned = []

    class Recorder:  # the supervisor, recording what it would start
        def __init__(self, **_kw):
            pass

        def spawn(self, name, cmd, **_kw):
            spawned.append(cmd)

        def watch(self, tick=None):
            return Outcome({i: 0 for i in range(len(spawned))})

        def stop_all(self):
            pass

    monkeypatch.setattr(rg, "Supervisor", Recorder)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    (tmp_path / "work" / "logs").mkdir(parents=True)
    assert rg._run_workers(cfg, str(tmp_path), 2, None, rg.Progress(4)) == 0
    assert len(spawned) == 2 and not any("--set" in cmd for cmd in spawned), spawned
    paths = {cmd[cmd.index("--config") + 1] for cmd in spawned}
    assert paths == {str(tmp_path / "work" / "regenerate-config.yaml")}
    assert load_config(paths.pop()).to_dict() == cfg.to_dict()


@pytest.mark.slow
def test_cli_output_is_what_extract_reads(reference_run, tiny):
    prompts, out = reference_run
    model, tok = tiny
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["conversations"] == 48 and manifest["truncated"] == [] and manifest["engines"] == ["embedded"]
    assert manifest["complete"] and manifest["failed"] == [] and manifest["accounting"] == {
        "input": 48, "written": 48, "failed": 0,
        "skipped": {"bad rows": 0, "prompt over max_prompt_tokens": 0, "no response kept": 0}}
    assert manifest["sampling"]["temperature"] == 0.0 and manifest["tokenizer"]["enable_thinking"] is False
    rows = read_jsonl(out / "chat.jsonl")
    for row, src in zip(rows[::7], read_jsonl(prompts)[::7]):  # a sample against the hand-written greedy loop
        assert row["messages"] == greedy_conversation(model, tok, src["messages"], 96)[0]
    cfg = load_config(TINY, [f"data.train_files=[{out / 'chat.jsonl'}]", "data.validation_files=[]"])
    samples, _ = ingest(cfg.data, tok)
    assert len(samples) == 48
    cfg = load_config(TINY, [f"data.train_files=[{out / 'chat.jsonl'}]", "data.enable_thinking=true"])
    with pytest.raises(IngestError, match="regenerated with enable_thinking=False"):
        ingest(cfg.data, tok)
    r = dflash("regenerate", "--prompts", str(prompts), "--out", str(out), *SMALL, "--set", "regenerate.seed=3",
               check=False)  # another run's directory: one line, exit 2, nothing touched
    assert r.returncode == 2 and "settings.seed: 0 -> 3" in r.stderr and "another --out" in r.stderr


def _log_lines(out: Path) -> int:
    return sum(len(read_log(p)[0]) for p in (out / "work" / "logs").glob("*.jsonl"))


@pytest.mark.slow
def test_resume_after_kill9_and_ctrl_c_equals_uninterrupted(reference_run, tmp_path):
    prompts, ref = reference_run
    out = tmp_path / "k"
    args = [sys.executable, "-m", "stages.cli", "regenerate", "--prompts", str(prompts), "--out", str(out),
            "--shards", "2", *SMALL]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    for round_, how in enumerate(["kill9-worker", "ctrl-c"]):
        p = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.time() + HANG_S  # a hang guard only: no correctness depends on speed
        while time.time() < deadline and p.poll() is None and _log_lines(out) < 3 + 3 * round_:
            time.sleep(0.1)
        assert p.poll() is None, p.stderr.read()
        if how == "kill9-worker":
            pids = subprocess.run(["pgrep", "-f", f"regen_worker.*--out {out} "], capture_output=True, text=True).stdout.split()
            assert pids
            os.kill(int(pids[0]), signal.SIGKILL)
            assert p.wait(timeout=HANG_S) == 1 and "resume with the same command" in p.stderr.read()
        else:
            p.send_signal(signal.SIGINT)
            assert p.wait(timeout=HANG_S) == 130
            err = p.stderr.read()
            assert "stopped" in err and "resume with the same command" in err
    done_before = _log_lines(out)
    r = dflash("regenerate", "--prompts", str(prompts), "--out", str(out), "--shards", "2", *SMALL)
    assert (out / "chat.jsonl").read_bytes() == (ref / "chat.jsonl").read_bytes()  # == the uninterrupted run
    rows = [row["index"] for q in (out / "work" / "logs").glob("*.jsonl") for rec in read_log(q)[0] for row in rec["rows"]]
    assert sorted(rows) == list(range(48))  # every conversation committed exactly once, nothing lost
    assert _log_lines(out) > done_before and "already done" in r.stderr
    again = dflash("regenerate", "--prompts", str(prompts), "--out", str(out), *SMALL)
    assert "nothing to do" in again.stderr


def test_shipped_configs_show_regenerate_before_extract():
    text = (ROOT / "configs" / "qwen3.6-27b.yaml").read_text()
    assert text.index("dflash regenerate") < text.index("dflash extract") < text.index("dflash train")
    from stages.regenerate import run_settings

    cfg = load_config(ROOT / "configs" / "qwen3.6-27b.yaml")
    assert cfg.data.train_files[0].endswith("data/regen/train.jsonl")
    assert run_settings(cfg)["max_new_tokens"] == cfg.data.max_length == 3072


@pytest.mark.slow
def test_regen_bench_runs_at_a_tiny_size(tmp_path):
    """The regen part (bench/regen_bench.py, the GPU throughput run) as `bash bench/device_run.sh smoke` runs it, at
    its tiny size on the CPU, so it does not crash on the GPU (tests/test_bench_parts.py leaves it to this test)."""
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "bench.parts", "run", "--tiny", "regen"], cwd=ROOT, capture_output=True,
                       text=True, timeout=HANG_S, env={**os.environ, "OUT": str(out), "CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads((out / "regen.json").read_text())
    assert res["batched"]["prompts"] == 4 and res["loop"]["prompts"] == 2 and res["new_tokens"] == 8
    assert res["batched"]["tok_s"] > 0 and res["loop"]["tok_s"] > 0 and res["speedup"] > 0
    log = (out / "regen.log").read_text()
    assert "linear attention via" in log and "batched / loop" in log
    if not res["kernels"]["fla"]:  # this machine: the hybrid layers ran on transformers' torch fallbacks
        assert "chunk_gated_delta_rule" in res["torch_fallbacks_called"]


def test_batched_generation_equals_greedy_loop_on_the_hybrid_layout():
    """The real target's layout (Gated DeltaNet + gated attention, transformers' torch path): left padding in a
    batch changes no greedy token against one prompt at a time (fp32, random weights, tiny sizes)."""
    import torch

    sys.path.insert(0, str(ROOT / "bench"))
    from regen_bench import build_qwen3_5

    torch.manual_seed(0)
    model = build_qwen3_5(layers=4, hidden=64, ffn=128, vocab=256, heads=(4, 2), linear_heads=(2, 4), head_dim=16,
                          device="cpu", dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (5, 17, 9, 30)]
    got = generate_ids(model, prompts, 12, {255}, 0)
    for p, (toks, cut) in zip(prompts, got):
        assert toks == greedy_loop(model, p, 12, stop=255) and cut == (255 not in toks)
