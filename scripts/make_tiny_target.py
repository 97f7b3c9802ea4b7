"""Build the embedded tiny target model and its bundled conversation set (data/assets/).

dflash's default config runs the whole pipeline (extract -> train -> eval) on a real, if tiny, target so
that the pipeline can be exercised end to end on 2 CPU cores. This script makes that target from nothing:

1. a synthetic dialogue corpus from scripts/tiny_corpus.py (arithmetic, counting, list operations,
   spelling, fictional facts; some two-turn), deterministic for a given seed;
2. a word-level tokenizer over the corpus' lexicon with its own chat template
   (`<|user|> ... <|end|><|assistant|> ... <|end|>`), saved as a PreTrainedTokenizerFast;
3. a small Qwen3ForCausalLM (8 layers, hidden 128, tied embeddings) trained on the corpus with a plain
   AdamW loop on CPU, loss on the assistant tokens (answer + `<|end|>`);
4. held-out accuracy per task type (greedy answers to prompts the model never saw);
5. data/assets/tiny-chat/{train,validation}.jsonl: prompts from other seeds, answered by the trained
   model itself (greedy, chat template with enable_thinking=False), so a drafter trained on them imitates
   exactly this target.

Run from the repo root:  python scripts/make_tiny_target.py      (~10-15 min on 2 CPU cores)
It rewrites data/assets/tiny-target/, data/assets/tiny-chat/ and the measured numbers in
data/assets/tiny-target/build_report.json.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make `scripts` importable
    sys.path.insert(0, str(ROOT))
from scripts import tiny_corpus  # noqa: E402

TARGET_DIR = ROOT / "data" / "assets" / "tiny-target"
CHAT_DIR = ROOT / "data" / "assets" / "tiny-chat"

# Fixed ids: the DFlash pipeline and its tests rely on pad=0, bos=1, end(eos)=2, mask=3.
SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|end|>", "<|mask|>", "<|unk|>",
                  "<|system|>", "<|user|>", "<|assistant|>", "<think>", "</think>"]
PAD_ID, BOS_ID, END_ID, MASK_ID = 0, 1, 2, 3

# Own chat style. With enable_thinking=false every assistant turn (and the generation prompt) starts with
# an empty "<think></think>", as Qwen3 does; otherwise (true or unset) nothing is inserted. The model was
# trained on both renderings and answers the same way in both, but the token streams differ, so a drafter
# must be trained with the same setting it is served with.
CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- set no_think = enable_thinking is defined and enable_thinking is false -%}"
    "{%- for message in messages -%}"
    "{%- if message.role == 'system' -%}<|system|>{{ message.content }}<|end|>"
    "{%- elif message.role == 'user' -%}<|user|>{{ message.content }}<|end|>"
    "{%- elif message.role == 'assistant' -%}<|assistant|>{%- if no_think -%}<think></think>{%- endif -%}"
    "{{ message.content }}<|end|>"
    "{%- else -%}{{ raise_exception('unknown role: ' + message.role) }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- if no_think -%}<think></think>{%- endif -%}{%- endif -%}"
)


# --- tokenizer ------------------------------------------------------------------------------------------------

def build_tokenizer(words: list[str]):
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    for w in words:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|unk|>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()  # decode joins words with single spaces
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in SPECIAL_TOKENS if not t.endswith("think>")])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<think>", "</think>")])
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|end|>", pad_token="<|pad|>",
        unk_token="<|unk|>", mask_token="<|mask|>",
        additional_special_tokens=["<|system|>", "<|user|>", "<|assistant|>"],
        clean_up_tokenization_spaces=False, model_max_length=512,
    )
    hf.chat_template = CHAT_TEMPLATE
    assert [hf.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS[:4]] == [PAD_ID, BOS_ID, END_ID, MASK_ID]
    return hf


def save_tokenizer(tokenizer, out_dir: Path) -> None:
    """save_pretrained, plus the class name PreTrainedTokenizerFast and a special_tokens_map.json for loaders
    that look for them (transformers 5 writes neither by itself)."""
    tokenizer.save_pretrained(out_dir)
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    special = {k: cfg[k] for k in ("bos_token", "eos_token", "pad_token", "unk_token", "mask_token")}
    special["additional_special_tokens"] = ["<|system|>", "<|user|>", "<|assistant|>"]
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


def encode_conversation(vocab: dict, messages: list[dict], enable_thinking: bool):
    """Token ids and loss mask of a rendered conversation, built directly from the vocab (the same ids as
    apply_chat_template; checked in main). The mask covers every assistant answer and its <|end|>."""
    role_id = {"system": vocab["<|system|>"], "user": vocab["<|user|>"], "assistant": vocab["<|assistant|>"]}
    ids, mask = [BOS_ID], [0]
    for m in messages:
        ids.append(role_id[m["role"]])
        mask.append(0)
        if m["role"] == "assistant" and not enable_thinking:
            ids += [vocab["<think>"], vocab["</think>"]]
            mask += [0, 0]
        content = [vocab[w] for w in m["content"].split()]
        ids += content + [END_ID]
        mask += [int(m["role"] == "assistant")] * (len(content) + 1)
    return ids, mask


# --- model ----------------------------------------------------------------------------------------------------

def build_model(vocab_size: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=(vocab_size + 63) // 64 * 64,
        hidden_size=128, intermediate_size=384, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        max_position_embeddings=512, rope_theta=10000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=True, attention_dropout=0.0,
        pad_token_id=PAD_ID, bos_token_id=BOS_ID, eos_token_id=END_ID,
    )
    return Qwen3ForCausalLM(config)


def make_batches(samples, batch_size: int, rng: random.Random):
    """Length-bucketed batches: shuffle, sort chunks of 32 batches by length, shuffle the batches."""
    order = list(range(len(samples)))
    rng.shuffle(order)
    batches = []
    chunk = batch_size * 32
    for i in range(0, len(order), chunk):
        part = sorted(order[i:i + chunk], key=lambda j: len(samples[j][0]))
        batches += [part[k:k + batch_size] for k in range(0, len(part), batch_size)]
    rng.shuffle(batches)
    return batches


def collate(samples, idx):
    T = max(len(samples[j][0]) for j in idx)
    x = torch.full((len(idx), T), PAD_ID, dtype=torch.long)
    y = torch.full((len(idx), T), -100, dtype=torch.long)
    for r, j in enumerate(idx):
        ids, mask = samples[j]
        x[r, :len(ids)] = torch.tensor(ids)
        labels = torch.tensor([t if m else -100 for t, m in zip(ids[1:], mask[1:])])
        y[r, :len(ids) - 1] = labels  # y[t] is the label for the prediction made at position t
    return x, y


def train(model, samples, steps: int, batch_size: int, lr: float, seed: int, log_every: int = 50):
    rng = random.Random(seed)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95))
    warmup = max(1, steps // 25)
    batches, step, t0, tokens = [], 0, time.time(), 0
    model.train()
    while step < steps:
        if not batches:
            batches = make_batches(samples, batch_size, rng)
        x, y = collate(samples, batches.pop())
        x, y = x.to(model.device), y.to(model.device)
        # right padding: pads come after every real token, so plain causal attention needs no mask
        logits = model(input_ids=x).logits
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1), ignore_index=-100)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        frac = step / steps
        scale = (step + 1) / warmup if step < warmup else 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * frac))
        for g in opt.param_groups:
            g["lr"] = lr * scale
        opt.step()
        opt.zero_grad(set_to_none=True)
        tokens += x.numel()
        step += 1
        if step % log_every == 0 or step == steps:
            dt = time.time() - t0
            print(f"step {step}/{steps} loss {loss.item():.4f} lr {lr * scale:.2e} "
                  f"{tokens / dt:.0f} tok/s {dt:.0f}s", flush=True)
    model.eval()


# --- generation -----------------------------------------------------------------------------------------------

@torch.no_grad()
def generate_responses(model, tokenizer, conversations: list[list[dict]], enable_thinking: bool = False,
                       batch_size: int = 64, max_new_tokens: int = 96, require_end: bool = False) -> list[str]:
    """Greedy response of the model to each conversation (ending in a user turn), decoded up to <|end|>
    with special tokens skipped. Batched with left padding. With require_end, a response that never
    reached <|end|> within max_new_tokens comes back as ""."""
    tokenizer.padding_side = "left"
    out = [None] * len(conversations)
    order = sorted(range(len(conversations)), key=lambda i: sum(len(m["content"]) for m in conversations[i]))
    for s in range(0, len(order), batch_size):
        idx = order[s:s + batch_size]
        texts = [tokenizer.apply_chat_template(conversations[i], tokenize=False, add_generation_prompt=True,
                                               enable_thinking=enable_thinking) for i in idx]
        enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
        gen = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=END_ID, pad_token_id=PAD_ID)
        for r, i in enumerate(idx):
            new = gen[r, enc["input_ids"].shape[1]:].tolist()
            if END_ID in new:
                new = new[:new.index(END_ID)]
            elif require_end:
                new = []
            out[i] = tokenizer.decode(new, skip_special_tokens=True)
    return out


def heldout_accuracy(model, tokenizer, n_per_task: int, seed: int) -> dict:
    """Exact-match accuracy of greedy answers to held-out first-turn prompts, per task type, plus the second
    turn of held-out two-turn conversations (given the reference first answer) as "follow_up"."""
    rng = random.Random(seed)
    convs, tasks = [], []
    for task in tiny_corpus.TASKS:
        for _ in range(n_per_task):
            c = tiny_corpus.sample_conversation(rng, task=task, split="heldout", two_turn_prob=0.0)
            convs.append(c["messages"])
            tasks.append(task)
    n_follow = 0
    while n_follow < n_per_task * 2:
        c = tiny_corpus.sample_conversation(rng, split="heldout", two_turn_prob=1.0)
        convs.append(c["messages"])
        tasks.append("follow_up")
        n_follow += 1
    prompts = [m[:-1] for m in convs]
    answers = generate_responses(model, tokenizer, prompts)
    stats = {}
    for task, msgs, ans in zip(tasks, convs, answers):
        ok, n = stats.get(task, (0, 0))
        stats[task] = (ok + int(ans == msgs[-1]["content"]), n + 1)
    return {t: round(ok / n, 4) for t, (ok, n) in stats.items()}


def build_chat_set(model, tokenizer, n: int, seed: int, exclude: set[str]) -> tuple[list[dict], float]:
    """n conversations with prompts from the generator (seed) whose assistant turns are the model's own
    greedy answers (enable_thinking=False). First prompts in `exclude` are skipped; conversations with an
    empty (or unfinished) answer are dropped."""
    rng = random.Random(seed)
    convs = []
    while len(convs) < n:
        c = tiny_corpus.sample_conversation(rng, split="any")
        first = next(m["content"] for m in c["messages"] if m["role"] == "user")
        if first not in exclude:
            convs.append(c["messages"])
    # Turn by turn: the model's own earlier answers are the history of its later ones.
    result = [[] for _ in convs]
    alive = list(range(len(convs)))
    turn = 0
    while alive:
        todo = []
        for i in alive:
            users = [k for k, m in enumerate(convs[i]) if m["role"] == "user"]
            if turn < len(users):
                k = users[turn]
                start = users[turn - 1] + 2 if turn else 0
                result[i] += convs[i][start:k + 1]
                todo.append(i)
        if not todo:
            break
        answers = generate_responses(model, tokenizer, [result[i] for i in todo], require_end=True)
        alive = []
        for i, a in zip(todo, answers):
            if a.strip():
                result[i].append({"role": "assistant", "content": a})
                alive.append(i)
            else:
                result[i] = None  # dropped: empty response
        turn += 1
    kept = [{"messages": r} for r in result if r]
    # how often the model's first answer is the generator's rule answer (informative only: the set keeps
    # the model's answers, right or wrong, since a drafter must imitate the target, not the rules)
    first = [next(m["content"] for m in r if m["role"] == "assistant") == next(
        m["content"] for m in c if m["role"] == "assistant") for r, c in zip(result, convs) if r]
    print(f"chat set (seed {seed}): kept {len(kept)} of {n} conversations; "
          f"first answers equal to the rule answer: {sum(first) / max(1, len(first)):.3f}", flush=True)
    return kept, round(sum(first) / max(1, len(first)), 4)


def dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=3400)
    ap.add_argument("--batch-size", type=int, default=24)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--corpus-size", type=int, default=120_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n-train-chat", type=int, default=3000)
    ap.add_argument("--n-val-chat", type=int, default=300)
    ap.add_argument("--eval-per-task", type=int, default=50)
    ap.add_argument("--target-dir", type=Path, default=TARGET_DIR)
    ap.add_argument("--chat-dir", type=Path, default=CHAT_DIR)
    ap.add_argument("--skip-chat", action="store_true", help="train and evaluate only")
    ap.add_argument("--device", default="cpu", help="for experiments only; the shipped assets are built on cpu")
    args = ap.parse_args(argv)

    t_start = time.time()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    tokenizer = build_tokenizer(tiny_corpus.lexicon())
    vocab = tokenizer.get_vocab()
    print(f"tokenizer: {len(vocab)} tokens", flush=True)

    corpus = tiny_corpus.generate(args.corpus_size, seed=args.seed, split="train")
    samples = [encode_conversation(vocab, c["messages"], enable_thinking=bool(i % 2)) for i, c in enumerate(corpus)]
    for i in range(0, 400, 7):  # the fast encoder must agree with the chat template
        ids = tokenizer.apply_chat_template(corpus[i]["messages"], tokenize=False, enable_thinking=bool(i % 2))
        assert tokenizer(ids, add_special_tokens=False)["input_ids"] == samples[i][0], corpus[i]
    assert all(vocab["<|unk|>"] not in s[0] for s in samples)
    n_tok = sum(len(s[0]) for s in samples)
    print(f"corpus: {len(samples)} conversations, {n_tok} tokens, "
          f"{sum(sum(s[1]) for s in samples)} supervised", flush=True)

    model = build_model(len(vocab)).to(args.device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params} parameters, vocab_size {model.config.vocab_size}", flush=True)
    train(model, samples, args.steps, args.batch_size, args.lr, args.seed)
    t_train = time.time() - t_start

    acc = heldout_accuracy(model, tokenizer, args.eval_per_task, seed=args.seed + 7)
    print("held-out accuracy:", json.dumps(acc), flush=True)

    # Everything is written to staging folders first and swapped in at the end, so the assets on disk are
    # never a half-written mix of an old model and a new conversation set.
    stage_target = args.target_dir.with_name(args.target_dir.name + ".building")
    stage_chat = args.chat_dir.with_name(args.chat_dir.name + ".building")
    for d in (stage_target, stage_chat):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
    model.generation_config.do_sample = False
    model.generation_config.pad_token_id = PAD_ID
    model.generation_config.eos_token_id = END_ID
    model.generation_config.bos_token_id = BOS_ID
    model.to("cpu").save_pretrained(stage_target)  # float32 (~6.6 MB); the directory must stay <= 10 MB
    tokenizer.padding_side = "right"
    save_tokenizer(tokenizer, stage_target)

    report = {
        "command": " ".join(["python scripts/make_tiny_target.py"] + (argv if argv is not None else sys.argv[1:])),
        "tokenizer_vocab": len(vocab), "config_vocab_size": model.config.vocab_size,
        "parameters": n_params, "corpus_conversations": len(samples), "corpus_tokens": n_tok,
        "train_steps": args.steps, "batch_size": args.batch_size, "lr": args.lr,
        "heldout_accuracy": acc, "train_seconds": round(t_train, 1),
    }
    if not args.skip_chat:
        train_convs, train_agree = build_chat_set(model, tokenizer, args.n_train_chat, seed=args.seed + 1001,
                                                  exclude=set())
        seen = {next(m["content"] for m in c["messages"] if m["role"] == "user") for c in train_convs}
        val_convs, val_agree = build_chat_set(model, tokenizer, args.n_val_chat, seed=args.seed + 2002, exclude=seen)
        for name, convs in (("train", train_convs), ("validation", val_convs)):
            with open(stage_chat / f"{name}.jsonl", "w") as f:
                for c in convs:
                    f.write(json.dumps(c) + "\n")
        lens = [len(encode_conversation(vocab, c["messages"], enable_thinking=False)[0])
                for c in train_convs + val_convs]
        report.update(chat_train=len(train_convs), chat_validation=len(val_convs),
                      chat_two_turn=sum(sum(m["role"] == "user" for m in c["messages"]) > 1
                                        for c in train_convs + val_convs),
                      chat_first_answer_rule_agreement={"train": train_agree, "validation": val_agree},
                      chat_mean_tokens=round(sum(lens) / max(1, len(lens)), 1), chat_max_tokens=max(lens, default=0))
    report["total_seconds"] = round(time.time() - t_start, 1)
    with open(stage_target / "build_report.json", "w") as f:
        json.dump(report, f, indent=2)
    report["asset_bytes"] = dir_size(stage_target)
    with open(stage_target / "build_report.json", "w") as f:
        json.dump(report, f, indent=2)
    assert report["asset_bytes"] <= 10 * 1024 * 1024, report["asset_bytes"]

    swaps = [(stage_target, args.target_dir)] + ([] if args.skip_chat else [(stage_chat, args.chat_dir)])
    for stage, final in swaps:
        shutil.rmtree(final, ignore_errors=True)
        stage.rename(final)
    shutil.rmtree(stage_chat, ignore_errors=True)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
