"""A quiet, useful log (issue 31 item 4): `dflash train` and `dflash demo` print dflash's own lines on stderr and
nothing else; an expected recompile is one dflash line, an unexpected one still prints dynamo's whole dump."""

from __future__ import annotations

import logging
import re
import sys
import time
from pathlib import Path

import pytest

from helpers_cli import FEW_ANCHORS, TINY, dflash

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# the prefixes of dflash's own stderr lines in these commands (anything else is a third-party line: a failure)
OWN = ("train: ", "demo [", "demo: ", "regenerate: ", "ingest: ", "extract: ", "eval: ", "export: ", "online: ",
       "offline: ")


def unexpected_lines(stderr: str) -> list[str]:
    """Lines that are not dflash's; an indented line continues the line before it (and shares its verdict)."""
    bad, own = [], True
    for x in stderr.splitlines():
        if x.strip() and not (x.startswith("  ") and own):
            own = x.startswith(OWN)
            if not own:
                bad.append(x)
    return bad


# a recompile of a drafter layer as torch 2.13 printed it in a CPU run with train.compile=on (2026-12-01)
LAYER_TYPE_DUMP = """Recompiling function forward in /x/pipeline/drafter.py:211
    triggered by the following guard failure(s):
    - 0/4: self.layer_type == 'sliding_attention'                   # mask = masks[layer_type]  # pipeline/masks.py:350 in attend_sdpa
    - User stack trace:
    -   File "/x/pipeline/drafter.py", line 212, in forward
    -     h = h + self.self_attn(self.input_layernorm(h), ctx, cos, sin, attend, self.layer_type)
    - 0/3: GLOBAL_STATE changed: grad_mode 
    - 0/0: GLOBAL_STATE changed: grad_mode """


def test_expected_recompiles_are_named_and_others_are_not():
    from pipeline.quiet_log import expected_recompile

    assert expected_recompile(LAYER_TYPE_DUMP) == ["another layer type", "grad mode (validation runs without gradients)"]
    other = LAYER_TYPE_DUMP.replace("self.layer_type == 'sliding_attention'", "L['step'] == 3")
    assert expected_recompile(other) is None
    assert expected_recompile("Recompiling function f in x.py:1\n    triggered by the following guard failure(s):") is None


# the BlockMask table builder's fourth variant as torch 2.11 printed it on the H200 (2026-12-01, chat-mix run)
TABLES_DUMP = """Recompiling function _all_tables in /work/main/pipeline/masks.py:357
    triggered by the following guard failure(s):
    - 0/2: causal == True                                           # causal = (window is not None) if causal is None else bool(causal)  # ork/main/pipeline/masks.py:299 in block_tables
    - User stack trace:
    -   File "/work/main/pipeline/masks.py", line 360, in _all_tables
    -     partial, full = block_tables(anchors, block_size, ctx_len, seq_lens, window, causal=causal, doc_ids=doc_ids)
    - 0/1: ctx_len == 1024                                          # q_len, kv_len = padded_len(A * block_size, tile), padded_len(ctx_len + A * block_size, tile)  # ork/main/pipeline/masks.py:287 in block_tables
    - User stack trace:
    -   File "/work/main/pipeline/masks.py", line 360, in _all_tables
    -     partial, full = block_tables(anchors, block_size, ctx_len, seq_lens, window, causal=causal, doc_ids=doc_ids)
    - 0/0: causal == True                                           # causal = (window is not None) if causal is None else bool(causal)  # ork/main/pipeline/masks.py:299 in block_tables"""


def test_the_table_builders_recompiles_are_expected():
    from pipeline.quiet_log import expected_recompile

    assert expected_recompile(TABLES_DUMP) == ["the other attention kind (sliding window or full)",
                                               "new shapes (dynamic from now on)"]
    assert expected_recompile(TABLES_DUMP.replace("ctx_len == 1024", "block_size == 16")) is None


def test_inductors_online_softmax_warning_is_filtered_with_its_leading_newline():
    """Inductor's text starts with a newline (torch/_inductor/lowering.py); a filter anchored at the first
    character missed it on the H200. `warnings.filterwarnings(message=...)` matches like this (re.I, match)."""
    import re

    from pipeline.quiet_log import WARNINGS

    def filtered(msg: str) -> bool:
        return any(re.compile(p, re.I).match(msg) for p, _ in WARNINGS)

    assert filtered("\nOnline softmax is disabled on the fly since Inductor decides to\nsplit the reduction.")
    assert not filtered("\nsomething else: Online softmax is disabled")


def test_a_real_dynamo_recompile_is_one_line_when_expected_and_the_whole_dump_when_not(capsys):
    """Through dynamo itself (eager backend): requires_grad, shape and grad-mode recompiles become one `train:`
    line each; a recompile on a changed Python value reaches torch's handlers unchanged."""
    import torch

    from pipeline.compile_setup import loud_recompiles
    from pipeline.quiet_log import quiet_third_party

    loud_recompiles()
    quiet_third_party()
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())
    log = logging.getLogger("torch._dynamo.guards.__recompiles")
    keep = Keep()
    log.addHandler(keep)
    try:
        class Layer(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.w, self.act = torch.nn.Linear(4, 4), "relu"

            def forward(self, x):
                return self.w(x).relu() if self.act == "relu" else self.w(x)

        m = Layer()
        m.compile(backend="eager")
        m(torch.randn(2, 4))
        m(torch.randn(2, 4, requires_grad=True))
        m(torch.randn(3, 4, requires_grad=True))
        with torch.no_grad():
            m(torch.randn(3, 4))
        assert seen == []  # every one so far was expected: none reached a handler
        err = capsys.readouterr().err
        lines = [x for x in err.splitlines() if x.startswith("train: recompiling forward in ")]
        assert len(lines) == 3 and all(x.endswith("(expected)") for x in lines), err
        assert "requires_grad" in lines[0] and "new shapes" in lines[1] and "grad mode" in lines[2], lines
        m.act = "none"  # a Python value the graph baked in: not one of the layer's variants (the call is
        m(torch.randn(5, 4, requires_grad=True))  # otherwise the third one's variant: its entry fails on `act`)
        assert len(seen) == 1 and "triggered by the following guard failure(s)" in seen[0], seen
        assert "recompiling" not in capsys.readouterr().err
    finally:
        log.removeHandler(keep)
        torch._dynamo.reset()


def test_the_first_batchs_compiles_are_summed_from_dynamos_timers():
    """compile_summary: dynamo's own timers (compile_times), named; nested ones reported as they are."""
    import torch

    from stages.train_startup import StartupPhases, compile_summary, dynamo_times

    times = {"_compile.compile_inner": [2.0, 1.5], "bytecode_tracing": [0.5, 0.25], "build_guards": [0.1],
             "gc": [0.01]}
    assert compile_summary(times, 3) == "train: compiles so far (3 frames): dynamo in all 3.5, tracing 0.8, guards 0.1"
    assert compile_summary({}, None, " on rank 1") == "train: compiles so far on rank 1: none"
    torch._dynamo.reset()
    before = dynamo_times()[1] or 0  # the process's count (other tests may have compiled before)
    f = torch.compile(lambda x: x * 2 + 1, backend="eager")
    f(torch.ones(3))
    t, frames = dynamo_times()
    assert sum(t["_compile.compile_inner"]) > 0 and frames == before + 1
    assert compile_summary(t, frames).startswith(f"train: compiles so far ({frames} frames): dynamo in all ")
    torch._dynamo.reset()
    sub = StartupPhases(0.0)
    sub.phases = [("a b", 1.25), ("c", 0.5)]
    assert sub.line(" on rank 0", "fit set-up") == "train: fit set-up on rank 0 1.8 s: a b 1.2, c 0.5"
    sub.t = time.time() - 3.0  # 3 s since the last mark, 2 of them in a part timed elsewhere
    sub.took("inner", 2.0)
    sub.mark("rest")
    assert sub.phases[2] == ("inner", 2.0) and 0.9 < sub.phases[3][1] < 1.5


@pytest.mark.slow
def test_train_prints_only_its_own_lines(tiny_store, tmp_path):
    """Validation, step checkpoints, loader workers, the final checkpoint and the export: Lightning's banner,
    tips, summary and warnings are gone; what is left is dflash's."""
    run = tmp_path / "run"
    r = dflash("train", "--config", TINY, "--store", tiny_store, "--set", f"train.run_dir={run}", "--set",
               "train.max_steps=8", "--set", "train.val_every=4", "--set", "train.checkpoint_every=4", "--set",
               "train.log_every=4", "--set", "train.num_workers=1", *FEW_ANCHORS)
    assert unexpected_lines(r.stderr) == [], r.stderr
    assert "train: drafter 0.44M parameters (dflash), on 1 CPU process(es), precision 32-true" in r.stderr
    assert re.search(r"train: first batch done .* s after start", r.stderr) and (run / "export").is_dir()
    # the warm first batch's remaining causes (issue 46): fit set-up's parts and the compiles by the first batch
    parts = re.search(r"^train: fit set-up ([0-9.]+) s: environment and setup hooks [0-9.]+, model optimizer and "
                      r"restore [0-9.]+, frozen head to the device [0-9.]+, compile set-up [0-9.]+, (sanity check "
                      r"[0-9.]+, )?loops and loaders [0-9.]+$", r.stderr, re.M)
    startup = re.search(r"^train: start-up [0-9.]+ s: .*fit set-up ([0-9.]+), first batch", r.stderr, re.M)
    assert parts and startup and abs(float(parts.group(1)) - float(startup.group(1))) <= 0.11, r.stderr
    assert re.search(r"^train: compiles so far( \(\d+ frames\))?: (none|dynamo in all [0-9.]+)", r.stderr, re.M), r.stderr
    # what the frozen head's thread did beside the start-up (no GPU here: no CUDA start), and the end's phases
    # from the last step to the process's exit handlers (issue 46: what keeps a finished run alive)
    assert re.search(r"^train: frozen-head thread [0-9.]+ s: began [0-9.]+, checksum [0-9.]+, load [0-9.]+$",
                     r.stderr, re.M), r.stderr
    assert re.search(r"^train: end [0-9.]+ s: final checkpoint [0-9.]+, Lightning teardown [0-9.]+, loaders [0-9.]+, "
                     r"checkpoint wait [0-9.]+, export [0-9.]+, summary [0-9.]+$", r.stderr, re.M), r.stderr
    assert "exit handlers" not in r.stderr  # a bench's line (DFLASH_EXIT_STACKS), not the user's
    assert r.stdout.strip() == ""  # Lightning's model summary table is gone too
    # checkpoints are written behind training, each saying how long training waited for it
    assert re.search(r"train: checkpoint step4\.ckpt written: training waited [0-9.]+ s", r.stderr), r.stderr


@pytest.mark.slow
def test_demo_prints_only_its_own_lines(tmp_path):
    """`dflash demo`, every stage, on a slice of tiny-chat (the full demo takes ~5 minutes): 48 training and 12
    validation conversations, one epoch of 6 steps (the demo's batch of 8) with a validation in the middle and
    one at the end, 4 online prompts."""
    chat = ROOT / "data" / "assets" / "tiny-chat"
    for name, n in (("train.jsonl", 48), ("validation.jsonl", 12)):
        (tmp_path / name).write_text("".join((chat / name).read_text().splitlines(True)[:n]))
    r = dflash("demo", "--out", str(tmp_path / "demo"), "--set", f"data.train_files=[{tmp_path / 'train.jsonl'}]",
               "--set", f"data.validation_files=[{tmp_path / 'validation.jsonl'}]", "--set", "train.epochs=1",
               "--set", "train.val_every=3", "--set", "eval.num_prompts=4")
    assert unexpected_lines(r.stderr) == [], r.stderr
    assert "dflash demo: done in" in r.stdout and (tmp_path / "demo" / "demo.json").is_file()


@pytest.mark.slow
def test_ddp_train_prints_only_its_own_lines(tiny_store, tmp_path):
    """Two gloo ranks, a step checkpoint at the last step (written behind training, its last.ckpt link after it):
    no rank trips in a collective the other skipped (rank 1's traceback would show here), nothing third-party."""
    run = tmp_path / "run"
    r = dflash("train", "--config", TINY, "--store", tiny_store, "--devices", "2", "--no-export", "--set",
               f"train.run_dir={run}", "--set", "train.max_steps=4", "--set", "train.checkpoint_every=2", "--set",
               "train.val_every=100000", "--set", "train.num_workers=0")
    assert unexpected_lines(r.stderr) == [], r.stderr
    assert sorted(re.findall(r"^train: first batch done [0-9.]+ s after start on rank ([01])", r.stderr, re.M)) == \
        ["0", "1"], r.stderr
    assert (run / "checkpoints" / "last.ckpt").resolve().name == "step4.ckpt"
