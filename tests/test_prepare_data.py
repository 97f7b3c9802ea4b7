"""Tests of `dflash prepare-data` (data/prepare.py, stages/prepare_data.py): every input format on small fixture
files written here, bad rows counted by reason, the split, and the files the 27B configs name."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from data.conversations import read_conversations  # noqa: E402
from data.ingest import is_validation, sample_id_of  # noqa: E402
from data.prepare import PrepareError  # noqa: E402
from data.prompts import output_names, read_prompts  # noqa: E402
from click.testing import CliRunner  # noqa: E402
from helpers_cli import ROOT  # noqa: E402
from pipeline.config import load_config  # noqa: E402
from stages.cli import main  # noqa: E402
from stages.prepare_data import run_prepare_data  # noqa: E402


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _read(out: Path) -> tuple[list, list, dict]:
    rows = {s: [json.loads(x)["messages"] for x in (out / f"{s}.jsonl").read_text().splitlines()]
            for s in ("train", "validation")}
    return rows["train"], rows["validation"], json.loads((out / "prepare.json").read_text())


def _user(q: str, a: str | None = None) -> list:
    return [{"role": "user", "content": q}] + ([{"role": "assistant", "content": a}] if a else [])


def test_sharegpt_jsonl_and_json_array_with_bad_rows_counted(tmp_path, capsys):
    good = {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi?"},
                              {"from": "gpt", "value": "Hello."}, {"from": "human", "value": "Bye?"}]}
    jsonl = _jsonl(tmp_path / "share.jsonl", [
        good, "{not json", {"conversations": [{"from": "wizard", "value": "x"}]},
        {"conversations": [{"from": "human", "value": "  "}]}, {"conversations": [{"from": "gpt", "value": "only"}]},
        {"conversations": [{"from": "human", "value": "bad \ud800 text"}]}, [1, 2], {"text": "no layout"},
        good])  # the last one is a duplicate
    jsonl.write_text("[1, 2]\n" + jsonl.read_text())  # a JSONL file starting with an array row: still one bad row
    array = tmp_path / "share.json"
    array.write_text(json.dumps([{"conversations": [{"from": "human", "value": f"q{k}"}, {"from": "gpt", "value": "a"}]}
                                 for k in range(30)]))
    assert run_prepare_data([str(jsonl), str(array)], out=str(tmp_path / "out"), validation_fraction=0.2) == 0
    train, val, rec = _read(tmp_path / "out")
    assert len(train) + len(val) == 31 and rec["rows_read"] == 40 and rec["duplicates"] == 1
    assert rec["skipped"] == {"invalid JSON": 1, "unknown role": 1, "empty content": 1, "no user turn": 1,
                              "invalid text": 1, "not an object": 2, "unknown layout": 1}
    assert rec["first_bad_row"]["invalid JSON"].startswith(f"{jsonl}, line 3: invalid JSON")
    first = _user("Hi?", "Hello.") + [{"role": "user", "content": "Bye?"}]
    assert [{"role": "system", "content": "Be brief."}] + first in train + val
    err = capsys.readouterr().err
    assert "40 rows read from 2 input(s) -> 31 conversations" in err and "skipped 8 bad rows" in err
    assert "first unknown role: " in err and "dflash regenerate" in err


def test_openai_messages_with_content_parts_and_tool_turns(tmp_path):
    rows = [
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "Part one, "}, {"type": "text", "text": "two"}]},
                      {"role": "assistant", "content": "Answer"}]},
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        {"messages": [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": None,
                                                              "tool_calls": [{"id": "1"}]}]},
        {"messages": [{"role": "user", "content": "q"}, {"role": "tool", "content": "42"}]},
        {"messages": [{"role": "user", "content": "ends with an empty answer"}, {"role": "assistant", "content": ""}]},
    ]
    run_prepare_data([str(_jsonl(tmp_path / "oa.jsonl", rows))], out=str(tmp_path / "out"))
    train, val, rec = _read(tmp_path / "out")
    assert sorted(map(json.dumps, train + val)) == sorted(map(json.dumps, [
        _user("Part one, two", "Answer"), _user("ends with an empty answer")]))
    assert rec["skipped"] == {"non-text content": 1, "tool turn": 2} and rec["with_response"] == 1


def test_split_is_the_ingest_hash_of_the_prompt_and_outputs_read_back(tmp_path):
    rows = [{"messages": _user(f"question {k}", f"answer {k}")} for k in range(200)]
    src = _jsonl(tmp_path / "chats.jsonl", rows)
    run_prepare_data([str(src)], out=str(tmp_path / "a"), validation_fraction=0.1)
    train, val, rec = _read(tmp_path / "a")
    expect_val = [r["messages"] for r in rows if is_validation(sample_id_of(r["messages"][:1]), 0.1)]
    assert val == expect_val and len(train) == 200 - len(val) and 5 < len(val) < 40
    assert rec["conversations"] == {"train": len(train), "validation": len(val)}
    _jsonl(src, rows[::-1])  # another order: the same split
    run_prepare_data([str(src)], out=str(tmp_path / "b"), validation_fraction=0.1)
    assert sorted(map(json.dumps, _read(tmp_path / "b")[1])) == sorted(map(json.dumps, val))
    files = [str(tmp_path / "a" / "train.jsonl"), str(tmp_path / "a" / "validation.jsonl")]
    assert len(read_prompts(files)) == 200  # what regenerate reads
    assert sum(1 for _ in read_conversations(files[1])) == len(val)  # and what ingest reads


def test_a_small_input_still_gets_a_validation_conversation(tmp_path, capsys):
    src = _jsonl(tmp_path / "few.jsonl", [{"messages": _user(f"q{k}", "a")} for k in range(3)])
    run_prepare_data([str(src)], out=str(tmp_path / "out"), validation_fraction=0.001)
    train, val, rec = _read(tmp_path / "out")
    assert (len(train), len(val)) == (2, 1) and rec["conversations"] == {"train": 2, "validation": 1}
    assert "moved to validation" in capsys.readouterr().err


def test_instruction_response_columns_by_name_and_auto(tmp_path):
    rows = [{"q": "Sum 1+1", "a": "2"}, {"q": "Sum 2+2"}, {"instruction": "Sort", "input": "3 1 2", "output": "1 2 3"}]
    src = _jsonl(tmp_path / "cols.jsonl", rows)
    run_prepare_data([str(src)], out=str(tmp_path / "named"), prompt_col="q", response_col="a")
    train, val, rec = _read(tmp_path / "named")
    assert sorted(map(json.dumps, train + val)) == [json.dumps(_user("Sum 1+1", "2"))]
    assert rec["skipped"] == {"missing column": 2}
    run_prepare_data([str(src)], out=str(tmp_path / "auto"))  # instruction/output found by name; q/a is not known
    train, val, rec = _read(tmp_path / "auto")
    assert train + val == [_user("Sort\n\n3 1 2", "1 2 3")] and rec["skipped"] == {"unknown layout": 2}


def test_parquet_with_evol_codealpaca_and_ultrachat_layouts(tmp_path):
    import pyarrow as pa  # a dependency of datasets (the dev and hf extras)
    import pyarrow.parquet as pq

    snap = tmp_path / "snapshot" / "data"
    snap.mkdir(parents=True)
    pq.write_table(pa.table({"instruction": ["Write a loop", ""], "output": ["for x in y: pass", "empty prompt"]}),
                   snap / "train-00000-of-00002.parquet")
    pq.write_table(pa.table({"prompt": ["Tell a joke"], "prompt_id": ["p1"],
                             "messages": [[{"role": "user", "content": "Tell a joke"},
                                           {"role": "assistant", "content": "Knock knock."}]]}),
                   snap / "train-00001-of-00002.parquet")
    run_prepare_data([str(tmp_path / "snapshot")], out=str(tmp_path / "out"))
    train, val, rec = _read(tmp_path / "out")
    assert sorted(map(json.dumps, train + val)) == sorted(map(json.dumps, [
        _user("Write a loop", "for x in y: pass"), _user("Tell a joke", "Knock knock.")]))
    assert rec["skipped"] == {"empty content": 1}
    assert f"{snap / 'train-00000-of-00002.parquet'}, row 1" in rec["first_bad_row"]["empty content"]


def test_parquet_without_pyarrow_is_one_line_naming_the_install(tmp_path, monkeypatch):
    f = tmp_path / "x.parquet"
    f.write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(PrepareError, match=r"needs pyarrow, which is not installed: pip install pyarrow") as e:
        run_prepare_data([str(f)], out=str(tmp_path / "out"))
    assert "\n" not in str(e.value) and not (tmp_path / "out" / "train.jsonl").exists()


def test_saved_datasetdict_nemotron_layout_and_split_choice(tmp_path):
    import datasets  # the dev and hf extras

    msgs = lambda k: [{"role": "user", "content": f"solve {k}"}, {"role": "assistant", "content": f"{k}"}]  # noqa: E731
    dd = datasets.DatasetDict({
        "math": datasets.Dataset.from_list([{"uuid": str(k), "category": "math", "messages": msgs(k)} for k in range(4)]),
        "code": datasets.Dataset.from_list([{"uuid": "c", "category": "code", "messages": msgs(99)}])})
    dd.save_to_disk(str(tmp_path / "nemotron"))
    run_prepare_data([str(tmp_path / "nemotron")], out=str(tmp_path / "all"))  # no train split: every split
    assert len(sum(_read(tmp_path / "all")[:2], [])) == 5
    run_prepare_data([str(tmp_path / "nemotron")], out=str(tmp_path / "code"), splits=["code"])
    assert sum(_read(tmp_path / "code")[:2], []) == [msgs(99)]
    with pytest.raises(PrepareError, match=r"no split chat \(it has code, math\); pass --split"):
        run_prepare_data([str(tmp_path / "nemotron")], out=str(tmp_path / "x"), splits=["chat"])


def dflash(*args, check=True):
    r = CliRunner().invoke(main, list(args))  # in process: the CLI's parsing, _run's exit codes and error line
    assert not check or r.exit_code == 0, r.output
    r.returncode = r.exit_code
    return r


def test_cli_writes_the_files_the_27b_configs_name_and_refuses_in_one_line(tmp_path):
    src = _jsonl(tmp_path / "chats.jsonl", [{"messages": _user(f"q{k}", "a")} for k in range(20)] + ["oops"])
    r = dflash("prepare-data", str(src), "--out", str(tmp_path / "prompts"))
    assert "skipped 1 bad rows: invalid JSON 1" in r.stderr
    made = sorted(p.name for p in (tmp_path / "prompts").iterdir())
    assert made == ["prepare.json", "train.jsonl", "validation.jsonl"]
    regen = output_names([str(tmp_path / "prompts" / n) for n in ("train.jsonl", "validation.jsonl")])
    for name in ("qwen3.6-27b.yaml", "qwen3.5-27b.yaml", "qwen3.8-27b-dflash2.yaml"):
        data = load_config(ROOT / "configs" / name).data
        assert [Path(p).name for p in (*data.train_files, *data.validation_files)] == regen
        assert all(Path(p).parent.name == "regen" for p in (*data.train_files, *data.validation_files))
    bad = dflash("prepare-data", str(src), str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "o"), check=False)
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0
    assert bad.stderr.startswith(f"error: input {tmp_path / 'missing.jsonl'} does not exist")
    assert not (tmp_path / "o").exists()  # refused before any work
    none = dflash("prepare-data", str(_jsonl(tmp_path / "junk.jsonl", ["x", "[1]"])), "--out", str(tmp_path / "j"),
                  check=False)
    assert none.returncode == 2 and "no usable conversation" in none.stderr and "invalid JSON 1" in none.stderr


@pytest.mark.slow
def test_the_readme_data_path_reaches_a_plan_with_the_files_the_commands_write(tmp_path):
    """README step 1 then 2 on the tiny target: prepare-data -> regenerate (the README's --prompts pair) ->
    extract --plan reading data/regen/{train,validation}.jsonl, every file made by the project's own commands."""
    from helpers_cli import TINY, dflash as dflash_subprocess

    rows = [json.loads(x) for x in (ROOT / "data/assets/tiny-chat/train.jsonl").read_text().splitlines()[:20]]
    share = [{"conversations": [{"from": "human" if m["role"] == "user" else "gpt", "value": m["content"]}
                                for m in r["messages"]]} for r in rows]
    src = tmp_path / "chats.json"
    src.write_text(json.dumps(share))  # a ShareGPT array dump
    prompts, regen = tmp_path / "data" / "prompts", tmp_path / "data" / "regen"
    run_prepare_data([str(src)], out=str(prompts), validation_fraction=0.1)
    n_train, n_val = (len((prompts / f"{s}.jsonl").read_text().splitlines()) for s in ("train", "validation"))
    assert n_train + n_val == 20 and n_val >= 1
    dflash_subprocess("regenerate", "--config", TINY, "--out", str(regen), "--prompts",
                      f"{prompts / 'train.jsonl'},{prompts / 'validation.jsonl'}",
                      "--set", "regenerate.max_batch_size=8", "--set", "regenerate.max_new_tokens=48")
    assert sorted(p.name for p in regen.glob("*.jsonl")) == ["train.jsonl", "validation.jsonl"]
    plan = dflash_subprocess("extract", "--config", TINY, "--store", str(tmp_path / "s.zarr"), "--plan",
                             "--set", f"data.train_files=[{regen / 'train.jsonl'}]",
                             "--set", f"data.validation_files=[{regen / 'validation.jsonl'}]")
    assert re.search(rf"plan: {n_train} train samples \([0-9,]+ tokens\), {n_val} validation samples", plan.stdout), \
        plan.stdout
    assert not (tmp_path / "s.zarr").exists()
