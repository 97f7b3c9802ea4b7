"""Shared by the regeneration tests: the tiny target, a hand-written greedy reference, prompt files."""

from __future__ import annotations

import json
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
TINY_TARGET = ROOT / "data" / "assets" / "tiny-target"
TINY_TRAIN = ROOT / "data" / "assets" / "tiny-chat" / "train.jsonl"
END = 2  # <|end|>, the tiny target's EOS


def tiny_model_and_tokenizer():
    from pipeline.target import load_target, load_tokenizer

    return load_target(str(TINY_TARGET), torch.float32, torch.device("cpu")), load_tokenizer(str(TINY_TARGET))


@torch.inference_mode()
def greedy_loop(model, ids: list[int], max_new: int, stop: int = END) -> list[int]:
    """Greedy decoding by hand: the whole sequence forwarded at every step (no cache, no padding, no generate)."""
    seq, out = list(ids), []
    for _ in range(max_new):
        t = int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax())
        out.append(t)
        seq.append(t)
        if t == stop:
            break
    return out


def greedy_conversation(model, tokenizer, messages: list[dict], max_new: int, thinking: bool = False):
    """Answer every assistant position of `messages` greedily by hand, each turn after the earlier greedy answers;
    returns (the conversation, the greedy tokens of every turn concatenated, stop tokens included)."""
    from data.prompts import render_prompt_ids, split_segments

    history, tokens = [], []
    for segment in split_segments(messages):
        history += segment
        new = greedy_loop(model, render_prompt_ids(tokenizer, history, thinking), max_new)
        tokens += new
        body = new[:-1] if new and new[-1] == END else new
        history.append({"role": "assistant", "content": tokenizer.decode(body, skip_special_tokens=True)})
    return history, tokens


def write_prompts(path: Path, n: int, start: int = 0) -> Path:
    """The first n tiny-chat conversations (answers included: regenerate drops them) as a prompt file."""
    lines = TINY_TRAIN.read_text().splitlines()[start:start + n]
    path.write_text("\n".join(lines) + "\n")
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
