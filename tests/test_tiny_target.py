"""The embedded tiny target (data/assets/tiny-target) and its conversation set (data/assets/tiny-chat).

Built by scripts/make_tiny_target.py. These tests pin what the rest of dflash relies on: the Auto classes
load it offline, the architecture and special ids are the documented ones (tied embeddings on purpose),
the chat template is its own style with an enable_thinking switch and the prefix property, the model
really answers held-out prompts by the corpus rules and stops with <|end|>, and every assistant turn of
the bundled JSONL is the model's own greedy answer.
"""

import json
import random
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from scripts import tiny_corpus  # noqa: E402
from scripts.make_tiny_target import generate_responses  # noqa: E402

TARGET = ROOT / "data" / "assets" / "tiny-target"
CHAT = ROOT / "data" / "assets" / "tiny-chat"

pytestmark = pytest.mark.skipif(not (TARGET / "config.json").exists(), reason="tiny target not built")


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(TARGET))


@pytest.fixture(scope="module")
def model():
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(TARGET), dtype=torch.float32)
    return m.eval()


def read_jsonl(name):
    with open(CHAT / name) as f:
        return [json.loads(line) for line in f]


def test_config_and_tied_embeddings(model):
    c = model.config
    assert type(model).__name__ == "Qwen3ForCausalLM" and c.model_type == "qwen3"
    assert (c.num_hidden_layers, c.hidden_size, c.intermediate_size) == (8, 128, 384)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (4, 2, 32)
    assert c.max_position_embeddings == 512 and c.vocab_size % 64 == 0 and c.vocab_size <= 1024
    assert c.tie_word_embeddings is True
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert (c.pad_token_id, c.bos_token_id, c.eos_token_id) == (0, 1, 2)
    assert not hasattr(c, "partial_rotary_factor") or c.partial_rotary_factor in (None, 1.0)


def test_special_token_ids(tok, model):
    ids = {t: tok.convert_tokens_to_ids(t) for t in ("<|pad|>", "<|bos|>", "<|end|>", "<|mask|>")}
    assert ids == {"<|pad|>": 0, "<|bos|>": 1, "<|end|>": 2, "<|mask|>": 3}
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.mask_token_id) == (0, 1, 2, 3)
    assert len(tok) <= model.config.vocab_size


def test_asset_size():
    size = sum(p.stat().st_size for p in TARGET.rglob("*") if p.is_file())
    assert size <= 10 * 1024 * 1024, size


def test_chat_template(tok):
    msgs = [{"role": "system", "content": "answer carefully and step by step ."},
            {"role": "user", "content": "count from 3 to 9 ."},
            {"role": "assistant", "content": "sure ."},
            {"role": "user", "content": "thank you ."}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert text == ("<|bos|><|system|>answer carefully and step by step .<|end|><|user|>count from 3 to 9 .<|end|>"
                    "<|assistant|><think></think>sure .<|end|><|user|>thank you .<|end|><|assistant|><think></think>")
    assert "<|im_start|>" not in tok.chat_template
    thinking = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, enable_thinking=True)
    assert thinking == tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert "<think>" not in thinking and thinking.endswith("<|end|><|assistant|>")
    # prefix property: generation prompt + answer + <|end|> == the rendered longer conversation
    for think in (False, True):
        prompt = tok.apply_chat_template(msgs[:2], tokenize=False, add_generation_prompt=True, enable_thinking=think)
        full = tok.apply_chat_template(msgs[:3], tokenize=False, enable_thinking=think)
        assert full == prompt + "sure .<|end|>"
    # word-level round trip of corpus text
    text = tiny_corpus.add_answer(47, 38)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.unk_token_id not in ids and tok.decode(ids) == text


def _heldout(task, n, seed=123, max_words=40):
    """n held-out single-turn conversations of one task whose answers are at most max_words long."""
    rng, out = random.Random(seed), []
    while len(out) < n:
        c = tiny_corpus.sample_conversation(rng, task=task, split="heldout", two_turn_prob=0.0, system_prob=0.0)
        if len(c["messages"][-1]["content"].split()) <= max_words:
            out.append(c)
    return out


@pytest.fixture(scope="module")
def cases():
    """(history, expected answer, kind): held-out prompts answered by the corpus rules, and assistant turns
    sampled from the bundled JSONL (the model's own answers when the set was built)."""
    out = []
    convs = (_heldout("count_up", 2, max_words=24) + _heldout("add", 2) + _heldout("count_down", 1, max_words=24)
             + _heldout("sub", 1) + _heldout("fact", 1))
    for c in convs:
        out.append((c["messages"][:-1], c["messages"][-1]["content"], "heldout"))
    rows = read_jsonl("train.jsonl")
    rng = random.Random(0)
    picked = rng.sample([r for r in rows if len(r["messages"]) <= 3], 4)
    picked += rng.sample([r for r in rows if len(r["messages"]) >= 4], 2) + read_jsonl("validation.jsonl")[:2]
    for r in picked:
        for k, m in enumerate(r["messages"]):
            if m["role"] == "assistant":
                out.append((r["messages"][:k], m["content"], "jsonl"))
    return out


@pytest.fixture(scope="module")
def greedy(model, tok, cases):
    """All greedy answers in one left-padded batch (generation dominates this file's run time)."""
    return generate_responses(model, tok, [h for h, _, _ in cases], enable_thinking=False)


def test_heldout_greedy_answers_follow_the_corpus(cases, greedy):
    got = [(g, e) for (h, e, kind), g in zip(cases, greedy) if kind == "heldout"]
    assert len(got) == 7
    for (h, _, kind) in cases:  # the prompts are ones the model was never trained on
        if kind == "heldout":
            assert tiny_corpus.is_heldout(h[0]["content"])
    assert [g for g, _ in got] == [e for _, e in got]


def test_thinking_mode_gives_the_same_answers(model, tok, cases):
    """The model was trained on both renderings (with and without the empty think block)."""
    hist = [h for h, _, kind in cases if kind == "heldout"][:2]
    exp = [e for h, e, kind in cases if kind == "heldout"][:2]
    assert generate_responses(model, tok, hist, enable_thinking=True) == exp


def test_generation_stops_with_end_token(model, tok):
    msgs = [{"role": "user", "content": "count from 10 to 17 ."}]
    enc = tok.apply_chat_template(msgs, add_generation_prompt=True, enable_thinking=False, return_tensors="pt",
                                  return_dict=True)
    out = model.generate(**enc, max_new_tokens=40, do_sample=False)
    new = out[0, enc["input_ids"].shape[1]:].tolist()
    assert new[-1] == tok.eos_token_id == 2 and new.count(2) == 1
    assert tok.decode(new, skip_special_tokens=True) == "sure . counting up from 10 to 17 : 10 11 12 13 14 15 16 17 . done ."


def test_jsonl_sets(tok):
    train, val = read_jsonl("train.jsonl"), read_jsonl("validation.jsonl")
    assert 2700 <= len(train) <= 3000 and 270 <= len(val) <= 300
    firsts = {}
    for name, rows in (("train", train), ("validation", val)):
        firsts[name] = set()
        for row in rows:
            msgs = row["messages"]
            roles = [m["role"] for m in msgs if m["role"] != "system"]
            assert roles == ["user", "assistant"] * (len(roles) // 2) and roles, row
            assert all(m["content"].strip() for m in msgs)
            firsts[name].add(next(m["content"] for m in msgs if m["role"] == "user"))
    assert not firsts["train"] & firsts["validation"]
    assert any(len(r["messages"]) >= 4 for r in train)  # some two-turn conversations
    # everything tokenizes to known words, and the DFlash mask token never appears
    for row in train[:300] + val[:100]:
        ids = tok.apply_chat_template(row["messages"], enable_thinking=False, return_dict=True)["input_ids"]
        assert tok.unk_token_id not in ids and tok.mask_token_id not in ids


def test_jsonl_assistant_turns_are_the_models_greedy_answers(cases, greedy):
    got = [(g, e) for (h, e, kind), g in zip(cases, greedy) if kind == "jsonl"]
    assert len(got) >= 10
    assert [g for g, _ in got] == [e for _, e in got]
