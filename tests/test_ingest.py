"""Tests of data/ingest.py: loss masks pinned on hand-written conversations, inputs, bad rows, determinism."""

from __future__ import annotations

import hashlib
import json
import random
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from data.ingest import (  # noqa: E402
    FIX_HINT,
    ChatTemplateError,
    IngestError,
    dataset_fingerprint,
    ingest,
    read_conversations,
    sample_id_of,
    tokenize_conversation,
)
from helpers_tokenizers import broken_template_tokenizer, llama_style_tokenizer, qwen_style_tokenizer  # noqa: E402
from pipeline.config import DataConfig  # noqa: E402

TINY_TARGET = Path(__file__).resolve().parent.parent / "data" / "assets" / "tiny-target"

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
Q1 = {"role": "user", "content": "Hi"}
A1 = {"role": "assistant", "content": "Hello there!"}
Q2 = {"role": "user", "content": "What is the capital of France?"}
A2 = {"role": "assistant", "content": "Paris."}


@pytest.fixture(scope="module")
def qwen():
    return qwen_style_tokenizer()


@pytest.fixture(scope="module")
def llama():
    return llama_style_tokenizer()


def supervised(tok, ids, mask) -> list[str]:
    """The supervised tokens, in order."""
    return [t for t, m in zip(tok.convert_ids_to_tokens(ids.tolist()), mask) if m]


def runs(tok, ids, mask) -> list[str]:
    """Decoded text of each maximal run of supervised tokens."""
    out, cur = [], []
    for i, m in zip(ids.tolist(), mask.tolist()):
        if m:
            cur.append(i)
        elif cur:
            out.append(tok.decode(cur))
            cur = []
    if cur:
        out.append(tok.decode(cur))
    return out


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def conv(i: int) -> dict:
    """A distinct small conversation per i."""
    words = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]
    return {"messages": [{"role": "user", "content": f"tell me {words[i % 10]} {i}"},
                         {"role": "assistant", "content": f"Sure, {words[(i * 3) % 10]} plus {i}."}]}


# ---------------------------------------------------------------- loss masks, pinned exactly

def test_qwen_single_turn_mask_exact(qwen):
    ids, mask = tokenize_conversation(qwen, [SYSTEM, Q1, A1], 4096, enable_thinking=False)
    toks = qwen.convert_ids_to_tokens(ids.tolist())
    assert qwen.decode(ids.tolist()) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\nHello there!<|im_end|>\n"
    )
    expected_mask = [0] * toks.index("Hello") + [1, 1, 1, 1, 1] + [0]  # Hello, ' ', there, !, <|im_end|> ; '\n'
    assert toks[-7:] == ["\n", "Hello", " ", "there", "!", "<|im_end|>", "\n"]
    assert mask.tolist() == expected_mask
    assert ids.dtype == np.int32 and mask.dtype == np.uint8


def test_qwen_enable_thinking_true_supervises_the_think_block(qwen):
    ids, mask = tokenize_conversation(qwen, [Q1, A1], 4096, enable_thinking=True)
    assert supervised(qwen, ids, mask) == [
        "<think>", "\n", "\n", "</think>", "\n", "\n", "Hello", " ", "there", "!", "<|im_end|>"]
    assert qwen.convert_ids_to_tokens(ids.tolist())[:9] == [
        "<|im_start|>", "user", "\n", "Hi", "<|im_end|>", "\n", "<|im_start|>", "assistant", "\n"]
    assert mask[:9].tolist() == [0] * 9


def test_qwen_multi_turn_history_rewrite(qwen):
    # The template drops the empty think block from earlier turns: the history fallback must find turn 1.
    ids, mask = tokenize_conversation(qwen, [SYSTEM, Q1, A1, Q2, A2], 4096, enable_thinking=False)
    text = qwen.decode(ids.tolist())
    assert "<|im_start|>assistant\nHello there!<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\nParis.<|im_end|>\n")
    assert runs(qwen, ids, mask) == ["Hello there!<|im_end|>", "Paris.<|im_end|>"]
    toks = qwen.convert_ids_to_tokens(ids.tolist())
    exp = np.zeros(len(toks), dtype=np.uint8)
    h = toks.index("Hello")
    exp[h:h + 5] = 1
    p = toks.index("Paris")
    exp[p:p + 3] = 1  # Paris . <|im_end|>
    assert mask.tolist() == exp.tolist()


def test_llama_style_multi_turn_mask_exact(llama):
    ids, mask = tokenize_conversation(llama, [SYSTEM, Q1, A1, Q2, A2], 4096, enable_thinking=False)
    toks = llama.convert_ids_to_tokens(ids.tolist())
    assert toks[0] == "<|begin_of_text|>"
    got = list(zip(toks, mask.tolist()))
    tail = [("<|start_header_id|>", 0), ("assistant", 0), ("<|end_header_id|>", 0), ("\n", 0), ("\n", 0),
            ("Paris", 1), (".", 1), ("<|eot_id|>", 1)]
    assert got[-8:] == tail
    first = toks.index("Hello")
    assert got[first - 5:first + 5] == [
        ("<|start_header_id|>", 0), ("assistant", 0), ("<|end_header_id|>", 0), ("\n", 0), ("\n", 0),
        ("Hello", 1), (" ", 1), ("there", 1), ("!", 1), ("<|eot_id|>", 1)]
    assert int(mask.sum()) == 8
    assert runs(llama, ids, mask) == ["Hello there!<|eot_id|>", "Paris.<|eot_id|>"]


def test_multi_turn_every_assistant_turn_supervised(llama):
    msgs = [Q1, A1, Q2, A2, {"role": "user", "content": "thanks"}, {"role": "assistant", "content": "Bye."}]
    ids, mask = tokenize_conversation(llama, msgs, 4096, enable_thinking=False)
    assert runs(llama, ids, mask) == ["Hello there!<|eot_id|>", "Paris.<|eot_id|>", "Bye.<|eot_id|>"]


def test_leading_and_consecutive_assistant_turns(qwen):
    more = {"role": "assistant", "content": "more"}
    ids, mask = tokenize_conversation(qwen, [A1, Q1, more], 4096, enable_thinking=False)
    assert runs(qwen, ids, mask) == ["Hello there!<|im_end|>", "more<|im_end|>"]
    # The last turn is rendered with a think block but its prefix is not (the first turn then was last):
    # the fallback supervises the content and its end token.
    ids, mask = tokenize_conversation(qwen, [Q1, A1, more], 4096, enable_thinking=True)
    assert "<|im_start|>assistant\n<think>\n\n</think>\n\nmore<|im_end|>" in qwen.decode(ids.tolist())
    assert runs(qwen, ids, mask) == ["Hello there!<|im_end|>", "more<|im_end|>"]


def test_broken_template_raises_clear_error(tmp_path):
    tok = broken_template_tokenizer()
    ids, mask = tokenize_conversation(tok, [Q1, A1], 100, False)  # one turn: nothing rewritten
    assert runs(tok, ids, mask) == ["Hello there!<|im_end|>"]
    with pytest.raises(ChatTemplateError, match="cannot locate assistant turn 1.*not a prefix"):
        tokenize_conversation(tok, [Q1, A1, Q2, A2], 100, False)
    f = write_jsonl(tmp_path / "a.jsonl", [conv(0), {"messages": [Q1, A1, Q2, A2]}])
    with pytest.raises(IngestError, match=r"a\.jsonl, line 2: .*not a prefix.*on_bad_row=skip"):
        ingest(DataConfig(train_files=[str(f)]), tok)
    samples, rep = ingest(DataConfig(train_files=[str(f)], on_bad_row="skip"), tok)
    assert len(samples) == 1 and rep.skipped == {"chat template": 1}


def test_tiny_target_tokenizer_masks_assistant_and_end():
    """The embedded tiny target's own tokenizer and template (<|user|>...<|end|><|assistant|>...<|end|>)."""
    from transformers import AutoTokenizer

    assert TINY_TARGET.is_dir(), f"{TINY_TARGET} is missing: the embedded tiny target must ship its tokenizer"
    tok = AutoTokenizer.from_pretrained(str(TINY_TARGET))
    msgs = [{"role": "user", "content": "count from 3 to 9 ."}, {"role": "assistant", "content": "3 4 5 6 7 8 9 ."},
            {"role": "user", "content": "thank you ."}, {"role": "assistant", "content": "sure ."}]
    for thinking in (False, True):
        ids, mask = tokenize_conversation(tok, msgs, 4096, enable_thinking=thinking)
        text = tok.apply_chat_template(msgs, tokenize=False, enable_thinking=thinking)
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        assert enc["input_ids"] == ids.tolist()
        pieces, cur = [], None  # text of each run of supervised tokens
        for (s, e), m in zip(enc["offset_mapping"], mask.tolist()):
            if m:
                cur = (cur[0], e) if cur else (s, e)
            elif cur:
                pieces.append(text[cur[0]:cur[1]])
                cur = None
        if cur:
            pieces.append(text[cur[0]:cur[1]])
        assert pieces == ["3 4 5 6 7 8 9 .<|end|>", "sure .<|end|>"]
        end_id = tok.convert_tokens_to_ids("<|end|>")
        assert [int(m) for t, m in zip(ids.tolist(), mask) if t == end_id] == [0, 1, 0, 1]
        toks = tok.convert_ids_to_tokens(ids.tolist())
        assert all(m == 0 for t, m in zip(toks, mask) if t in ("<|bos|>", "<|assistant|>", "<think>", "</think>"))
        assert ("<think>" in toks) == (not thinking)


# ---------------------------------------------------------------- truncation, drop rule

def test_truncation_and_drop_rule(tmp_path, qwen):
    ids, mask = tokenize_conversation(qwen, [Q1, A1], 4096, False)
    h = qwen.convert_ids_to_tokens(ids.tolist()).index("Hello")
    t_ids, t_mask = tokenize_conversation(qwen, [Q1, A1], h + 2, False)
    assert len(t_ids) == h + 2 and t_mask.tolist() == mask[: h + 2].tolist()
    f = write_jsonl(tmp_path / "a.jsonl", [{"messages": [Q1, A1]}])
    samples, rep = ingest(DataConfig(train_files=[str(f)], max_length=h + 2, validation_fraction=0.0), qwen)
    assert len(samples) == 1 and rep.truncated == 1 and len(samples[0].input_ids) == h + 2
    assert f"1 samples truncated to max_length={h + 2}" in rep.summary()
    assert rep.supervised_tokens == 2
    # Only one supervised token left: no anchor, dropped -> nothing left -> error naming the cause.
    with pytest.raises(IngestError, match="(?s)no samples.*dropped 1 samples with no two consecutive"):
        ingest(DataConfig(train_files=[str(f)], max_length=h + 1), qwen)
    # A longer question pushes the whole answer past max_length: dropped, counted, the other sample kept.
    g = write_jsonl(tmp_path / "b.jsonl", [{"messages": [Q1, A1]}, {"messages": [Q2, A2]}])
    samples, rep = ingest(DataConfig(train_files=[str(g)], max_length=h + 2, validation_fraction=0.0), qwen)
    assert rep.dropped == 1 and len(samples) == 1 and rep.truncated == 1
    assert samples[0].sample_id == sample_id_of([Q1, A1])
    assert "dropped 1 samples with no two consecutive supervised tokens" in rep.summary()


# ---------------------------------------------------------------- input formats

def test_sharegpt_equals_messages(tmp_path, qwen):
    share = {"conversations": [{"from": "system", "value": SYSTEM["content"]}, {"from": "human", "value": "Hi"},
                               {"from": "gpt", "value": "Hello there!"}]}
    both = {"conversations": [{"from": "user", "value": "Hi"}, {"from": "assistant", "value": "Paris."}]}
    f = write_jsonl(tmp_path / "s.jsonl", [share, both])
    got = list(read_conversations(f, "error"))
    assert got[0] == (str(f), 1, [SYSTEM, Q1, A1])
    assert got[1][2] == [Q1, {"role": "assistant", "content": "Paris."}]
    g = write_jsonl(tmp_path / "m.jsonl", [{"messages": [SYSTEM, Q1, A1]}])
    samples, rep = ingest(DataConfig(train_files=[str(f), str(g)], validation_fraction=0.0), qwen)
    assert rep.duplicates == 1 and len(samples) == 2 and rep.rows_read == 3
    assert sample_id_of([SYSTEM, Q1, A1]) in {s.sample_id for s in samples}


def test_datasets_save_to_disk(tmp_path, qwen):
    datasets = pytest.importorskip("datasets")
    rows = [conv(i) for i in range(4)]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "plain"))
    share = [{"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": f"Hello {i}"}]}
             for i in range(2)]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:2]),
                          "test": datasets.Dataset.from_list(share)}).save_to_disk(str(tmp_path / "dd"))
    samples, rep = ingest(DataConfig(train_files=[str(tmp_path / "plain")], validation_fraction=0.0), qwen)
    assert len(samples) == 4 and rep.rows_read == 4
    cfg = DataConfig(train_files=[str(tmp_path / "dd")], validation_files=[str(tmp_path / "dd")])
    samples, rep = ingest(cfg, qwen)
    assert rep.samples == {"train": 2, "validation": 2}
    val_ids = {sample_id_of([Q1, {"role": "assistant", "content": f"Hello {i}"}]) for i in range(2)}
    assert {s.sample_id for s in samples if s.split == "validation"} == val_ids
    bad = datasets.Dataset.from_list([{"messages": [Q1, {"role": "tool", "content": "x"}]}])
    bad.save_to_disk(str(tmp_path / "bad"))
    with pytest.raises(IngestError, match=r"bad \[split train\], row 0: .*role 'tool'"):
        ingest(DataConfig(train_files=[str(tmp_path / "bad")]), qwen)


def test_datasets_missing_is_a_clear_error(tmp_path, qwen, monkeypatch):
    (tmp_path / "dir").mkdir()
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(IngestError, match="`datasets` package is not installed"):
        ingest(DataConfig(train_files=[str(tmp_path / "dir")]), qwen)


def test_missing_file(tmp_path, qwen):
    with pytest.raises(IngestError, match="nope.jsonl does not exist"):
        ingest(DataConfig(train_files=[str(tmp_path / "nope.jsonl")]), qwen)


# ---------------------------------------------------------------- bad rows, both modes

BAD_ROWS = {
    "invalid JSON": ('{"messages": [', "invalid JSON"),
    "missing messages/conversations": ({"text": "hello"}, "no 'messages' or 'conversations'"),
    "unknown role": ({"messages": [Q1, {"role": "robot", "content": "x"}]}, "role 'robot'"),
    "empty content": ({"messages": [Q1, {"role": "assistant", "content": "  "}]}, "empty content"),
    "non-string content": ({"messages": [Q1, {"role": "assistant", "content": 5}]}, "not a string"),
    "no assistant turn": ({"messages": [Q1]}, "no assistant turn"),
}


@pytest.mark.parametrize("reason", sorted(BAD_ROWS))
def test_bad_row_error_and_skip(tmp_path, qwen, reason):
    row, text = BAD_ROWS[reason]
    f = write_jsonl(tmp_path / "d.jsonl", [conv(0), conv(1), row, conv(2)])
    with pytest.raises(IngestError) as err:
        ingest(DataConfig(train_files=[str(f)]), qwen)
    msg = str(err.value)
    assert f"{f}, line 3:" in msg and text in msg and FIX_HINT in msg
    samples, rep = ingest(DataConfig(train_files=[str(f)], on_bad_row="skip"), qwen)
    assert len(samples) == 3 and rep.skipped == {reason: 1} and rep.rows_read == 4
    assert f"skipped 1 bad rows: {reason} 1" in rep.summary()


def test_empty_file_both_modes(tmp_path, qwen):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    good = write_jsonl(tmp_path / "good.jsonl", [conv(0)])
    with pytest.raises(IngestError, match=r"empty\.jsonl: the file is empty.*on_bad_row=skip"):
        ingest(DataConfig(train_files=[str(good), str(empty)]), qwen)
    samples, rep = ingest(DataConfig(train_files=[str(good), str(empty)], on_bad_row="skip"), qwen)
    assert len(samples) == 1 and rep.skipped == {"empty file": 1}


def test_no_samples_raises(tmp_path, qwen):
    f = write_jsonl(tmp_path / "d.jsonl", [{"messages": [Q1]}])
    with pytest.raises(IngestError, match="(?s)no samples.*no assistant turn 1"):
        ingest(DataConfig(train_files=[str(f)], on_bad_row="skip"), qwen)


# ---------------------------------------------------------------- determinism, split, cap, summary

def test_determinism_order_split_and_fingerprint(tmp_path, llama):
    rows = [conv(i) for i in range(40)]
    write_jsonl(tmp_path / "a.jsonl", rows[:25]), write_jsonl(tmp_path / "b.jsonl", rows[25:])
    shuffled = rows[:]
    random.Random(1).shuffle(shuffled)
    write_jsonl(tmp_path / "c.jsonl", shuffled[:10]), write_jsonl(tmp_path / "d.jsonl", shuffled[10:] + shuffled[:3])
    cfg1 = DataConfig(train_files=[str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")], validation_fraction=0.3)
    cfg2 = DataConfig(train_files=[str(tmp_path / "d.jsonl"), str(tmp_path / "c.jsonl")], validation_fraction=0.3)
    s1, r1 = ingest(cfg1, llama)
    s2, r2 = ingest(cfg2, llama)
    assert r2.duplicates == 3 and r1.duplicates == 0
    assert [s.sample_id for s in s1] == sorted(s.sample_id for s in s1) == [s.sample_id for s in s2]
    assert [s.split for s in s1] == [s.split for s in s2]
    for a, b in zip(s1, s2):
        assert np.array_equal(a.input_ids, b.input_ids) and np.array_equal(a.loss_mask, b.loss_mask)
    assert dataset_fingerprint(s1) == dataset_fingerprint(s2)
    for s in s1:  # the split rule, computed independently
        frac = int(hashlib.sha256(s.sample_id.encode()).hexdigest()[:8], 16) / 2**32
        assert s.split == ("validation" if frac < 0.3 else "train")
    assert 0 < r1.samples["validation"] < 40
    assert {s.sample_id for s in s1} == {sample_id_of(r["messages"]) for r in rows}
    canonical = json.dumps(rows[0]["messages"], sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    assert sample_id_of(rows[0]["messages"]) == hashlib.sha256(canonical.encode()).hexdigest()[:16]
    capped, rc = ingest(DataConfig(train_files=cfg1.train_files, validation_fraction=0.3, max_samples=7), llama)
    assert [s.sample_id for s in capped] == [s.sample_id for s in s1[:7]] and rc.capped == 33
    assert "33 conversations left out by data.max_samples" in rc.summary()
    assert dataset_fingerprint(capped) != dataset_fingerprint(s1)


def test_validation_files_and_priority(tmp_path, qwen):
    tr = write_jsonl(tmp_path / "t.jsonl", [conv(i) for i in range(5)])
    va = write_jsonl(tmp_path / "v.jsonl", [conv(4), conv(5)])
    samples, rep = ingest(DataConfig(train_files=[str(tr)], validation_files=[str(va)], validation_fraction=0.9), qwen)
    assert rep.samples == {"train": 4, "validation": 2} and rep.duplicates == 1
    val = {s.sample_id for s in samples if s.split == "validation"}
    assert val == {sample_id_of(conv(4)["messages"]), sample_id_of(conv(5)["messages"])}


def test_summary_text(tmp_path, qwen):
    f = write_jsonl(tmp_path / "d.jsonl", [conv(0), conv(0), conv(1), "not json", {"messages": [Q1]}])
    samples, rep = ingest(DataConfig(train_files=[str(f)], on_bad_row="skip", validation_fraction=0.0), qwen)
    text = rep.summary()
    tokens = sum(len(s.input_ids) for s in samples)
    sup = sum(int(s.loss_mask.sum()) for s in samples)
    assert rep.tokens == tokens and rep.supervised_tokens == sup
    assert text.splitlines()[0] == (
        f"ingest: 5 rows read -> 2 samples (2 train, 0 validation), {tokens} tokens, "
        f"{sup} supervised ({100 * sup / tokens:.1f}%)")
    assert "skipped 2 bad rows: invalid JSON 1, no assistant turn 1" in text
    assert "1 duplicate conversations kept once" in text
