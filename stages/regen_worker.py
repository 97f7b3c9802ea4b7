"""The embedded regeneration engine and one shard of it: the target answers this shard's prompts in batches.

Started by `dflash regenerate` (one process per shard, only its GPU visible; on CPU the shards share the
cores). Contract:
- `generate_ids` is the batched generation: prompts left-padded into one batch, transformers' `generate` with
  its KV cache and an explicit, neutral GenerationConfig (the checkpoint's own sampling defaults never apply),
  each row stopping at its first stop token (the tokenizer's and generation config's EOS ids). Greedy unless
  temperature > 0; sampling seeds torch once per batch. `min_new_tokens` (benchmarks only) forces a length.
  It returns per row the generated ids (stop token included) and whether the row was cut at max_new_tokens.
- `EmbeddedEngine.generate` splits the prompts of one round into batches by `plan_batches` (longest first,
  rows x (prompt + max_new_tokens) <= regenerate.token_budget, at most regenerate.max_batch_size rows).
- The shard's conversations are positions k % N of the work plan (`work/prompts.jsonl`, written by the parent)
  that no log has committed yet, planned by first-turn length the same way. One batch of conversations is one
  commit record in `work/logs/shard-NNNNN.jsonl`. A resumed shard's remaining conversations pack into exactly
  the batches an uninterrupted run would have made (committed batches are a prefix of the length order), so
  its output is the same.
- The target runs dflash's fast forward of the hybrid where it applies (`regenerate.fast_forward`, on by default:
  CUDA with flash-linear-attention; pipeline/fast_forward.py), else transformers' forward; the shard's log says
  which and why (`load_engine_target`).
- SIGTERM/SIGINT (or the parent dying) stops generation at the next decode step; the batch in progress is
  dropped (recomputed on resume) and the worker exits 143. Progress goes to stdout as JSON lines.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path
from typing import Callable, Optional

import torch

from data.prompts import Conversation
from pipeline import store as st
from pipeline.config import Config
from pipeline.lifecycle import ExitCode, StopFlag, die_with_parent
from pipeline.target import DTYPES, load_target, load_tokenizer
from stages.extract_worker import emit, plan_batches
from stages.regen_records import CommitLog, Prompt, Reply, committed_rows, regenerate_batch


class _Watch:
    """A stopping criterion: ends generate() for every row once the flag is raised, and every `every` steps
    reports the tokens generated so far (each row up to its first stop token) to `live`."""

    def __init__(self, should_stop: Callable[[], bool], live: Optional[Callable[[int], None]], width: int,
                 stop_ids: set[int], every: int = 32):
        self.should_stop, self.live, self.width, self.every, self.steps = should_stop, live, width, every, 0
        self.stops = torch.tensor(sorted(stop_ids))

    def __call__(self, input_ids, scores, **kwargs):
        self.steps += 1
        if self.live is not None and self.steps % self.every == 0:
            new = input_ids[:, self.width:]
            hit = torch.isin(new, self.stops.to(new.device))
            first = torch.where(hit.any(1), hit.int().argmax(1) + 1, new.shape[1])
            self.live(int(first.sum()))
        return torch.full((input_ids.shape[0],), bool(self.should_stop()), dtype=torch.bool, device=input_ids.device)


def neutral_generation_config(stop_ids: set[int], pad_id: int):
    """transformers' defaults plus our stop and pad ids: no checkpoint sampling defaults, penalties or limits."""
    from transformers import GenerationConfig

    return GenerationConfig(eos_token_id=sorted(stop_ids), pad_token_id=pad_id)


@torch.inference_mode()
def generate_ids(model, prompts: list[list[int]], max_new_tokens: int, stop_ids: set[int], pad_id: int,
                 temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int = 0, min_new_tokens: int = 0,
                 should_stop: Callable[[], bool] = lambda: False, live: Optional[Callable[[int], None]] = None,
                 ) -> Optional[list[tuple[list[int], bool]]]:
    """Batched generation (see the module contract); None when should_stop() became true. `live(n)` hears the
    tokens generated so far every 32 steps (progress of long batches)."""
    from transformers import StoppingCriteriaList

    device = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, p in enumerate(prompts):  # left padding: every row's next token is at the same column
        ids[r, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[r, width - len(p):] = 1
    cfg = neutral_generation_config(stop_ids, pad_id)
    cfg.max_new_tokens, cfg.min_new_tokens, cfg.do_sample = max_new_tokens, min_new_tokens or None, temperature > 0
    if temperature > 0:
        cfg.temperature, cfg.top_p, cfg.top_k = temperature, top_p, (top_k or None)
        torch.manual_seed(seed)
    criteria = StoppingCriteriaList([_Watch(should_stop, live, width, stop_ids)])
    out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=cfg,
                         stopping_criteria=criteria)
    if should_stop():
        return None
    result = []
    for row in out[:, width:].tolist():
        end = next((k for k, t in enumerate(row) if t in stop_ids), None)
        result.append((row[: end + 1], False) if end is not None else (row, len(row) >= max_new_tokens))
    return result


class EmbeddedEngine:
    """The regeneration engine on a local transformers model (see the module contract)."""

    def __init__(self, model, tokenizer, settings: dict, token_budget: int, max_batch_size: int,
                 should_stop: Callable[[], bool] = lambda: False, on_tokens: Callable[[int, bool], None] = lambda n, f: None):
        from stages.eval_online import stop_token_ids

        self.model, self.tokenizer, self.settings = model, tokenizer, settings
        self.budget, self.max_batch = token_budget, max_batch_size
        self.should_stop, self.on_tokens = should_stop, on_tokens
        self.stops = stop_token_ids(tokenizer, model)
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(self.stops)
        model.generation_config = neutral_generation_config(self.stops, self.pad)

    def generate(self, prompts: list[Prompt]) -> Optional[list[Reply]]:
        s = self.settings
        replies: list[Optional[Reply]] = [None] * len(prompts)
        lengths = [len(p.ids) + s["max_new_tokens"] for p in prompts]
        for batch in plan_batches(lengths, self.budget, self.max_batch):
            got = generate_ids(self.model, [prompts[m].ids for m in batch.members], s["max_new_tokens"], self.stops,
                               self.pad, s["temperature"], s["top_p"], s["top_k"], prompts[batch.members[0]].seed,
                               should_stop=self.should_stop, live=lambda n: self.on_tokens(n, False))
            if got is None:
                return None
            for m, (toks, cut) in zip(batch.members, got):
                body = toks[:-1] if toks and toks[-1] in self.stops else toks
                replies[m] = Reply(self.tokenizer.decode(body, skip_special_tokens=True), len(toks), cut, None, toks)
            self.on_tokens(sum(len(t) for t, _ in got), True)
        return replies


def load_engine_target(cfg: Config):
    """(model, device): the embedded engine's target, on CUDA when present, with dflash's fast forward where it
    applies (`regenerate.fast_forward`, pipeline/fast_forward.py: prefill and decode steps with the KV cache);
    the line saying which forward runs, or why the reference does, goes to stderr (the shard's log)."""
    from pipeline.fast_forward import enable

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = DTYPES[cfg.target.dtype if cuda else cfg.target.cpu_dtype]
    if cuda:
        from pipeline.kernels import use_kernel_cache

        use_kernel_cache()  # before the kernels are imported: their autotuning is kept for later shards and runs
    model = load_target(cfg.target.path, dtype, device, cfg.target.attn_implementation, cfg.target.trust_remote_code)
    print(enable(model, device, cfg.regenerate.fast_forward, key="regenerate.fast_forward"), file=sys.stderr,
          flush=True)
    return model, device


def shard_conversations(work: Path, shard_index: int, num_shards: int) -> tuple[list[Conversation], int]:
    """(this shard's conversations that no log has committed, committed ones of this shard)."""
    with open(work / "prompts.jsonl", encoding="utf-8") as f:
        mine = [Conversation.from_json(line) for line in st.shard_rows(f, shard_index, num_shards)]
    done = committed_rows(work)
    return [c for c in mine if c.index not in done], sum(c.index in done for c in mine)


def run_shard(cfg: Config, out: str, shard_index: int, num_shards: int) -> int:
    """Regenerate one shard; returns the exit code (0 done, 143 stopped by a signal)."""
    die_with_parent()
    stop = StopFlag()
    work = Path(out) / "work"
    settings = json.loads((work / "run.json").read_text())["identity"]["settings"]
    todo, already = shard_conversations(work, shard_index, num_shards)
    planned = len(todo) + already
    plan = plan_batches([c.length + settings["max_new_tokens"] for c in todo], cfg.regenerate.token_budget,
                        cfg.regenerate.max_batch_size)
    counts = {"done": already, "tokens": 0, "live": 0, "at": 0.0}  # live: tokens of the batch being generated

    def report() -> None:
        counts["at"] = time.time()
        emit("progress", shard=shard_index, done=counts["done"], planned=planned,
             tokens=counts["tokens"] + counts["live"], t=counts["at"])

    report()
    if not plan:
        emit("done", shard=shard_index, already=True)
        return 0
    tokenizer = load_tokenizer(cfg.target.path, cfg.target.trust_remote_code)
    model, device = load_engine_target(cfg)
    if device.type == "cpu" and sum(p.numel() for p in model.parameters()) < 100_000_000:
        torch.set_num_threads(1)  # as eval does: small matmuls do not split well, and far worse on a busy machine

    def on_tokens(n: int, finished: bool) -> None:
        if finished:
            counts["tokens"], counts["live"] = counts["tokens"] + n, 0
        else:
            counts["live"] = n
            if time.time() - counts["at"] < 2.0:  # a long batch: a line every 2 s is enough
                return
        report()

    engine = EmbeddedEngine(model, tokenizer, settings, cfg.regenerate.token_budget, cfg.regenerate.max_batch_size,
                            lambda: stop.stop, on_tokens)
    log = CommitLog(work / "logs" / f"shard-{shard_index:05d}.jsonl")
    try:
        for batch in plan:
            try:
                rows = regenerate_batch(engine, tokenizer, [todo[m] for m in batch.members], settings, lambda: stop.stop)
            except torch.cuda.OutOfMemoryError as e:
                raise RuntimeError(
                    f"out of GPU memory on a batch of {len(batch.members)} conversations (prompts up to "
                    f"{todo[batch.members[0]].length} tokens, max_new_tokens {settings['max_new_tokens']}); lower "
                    f"regenerate.token_budget (now {cfg.regenerate.token_budget}) or regenerate.max_batch_size and "
                    "rerun: committed work is kept, and both may change between attempts") from e
            if rows is None:
                break
            log.append({"engine": "embedded", "shard": shard_index, "rows": rows})
            counts["done"] += len(rows)
            report()
    finally:
        log.close()
    if stop.stop:
        emit("stopped", shard=shard_index, done=counts["done"])
        return ExitCode.WORKER_STOPPED
    emit("done", shard=shard_index, already=False)
    return 0


def main(argv: list[str] | None = None) -> int:
    import argparse

    from pipeline.config import load_config

    ap = argparse.ArgumentParser(description="one dflash regenerate shard (normally started by `dflash regenerate`)")
    ap.add_argument("--config", required=True, help="the parent's resolved config (OUT/work/regenerate-config.yaml)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--shard-index", type=int, required=True)
    ap.add_argument("--shards", type=int, required=True)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="(a worker started by hand)")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    try:
        return run_shard(load_config(a.config or None, a.overrides), a.out, a.shard_index, a.shards)
    except Exception as e:  # noqa: BLE001 - one line for the parent, the traceback for the shard's log
        traceback.print_exception(e, file=sys.stderr)
        return emit("error", shard=a.shard_index, error=f"{type(e).__name__}: {e}") or 1


if __name__ == "__main__":
    sys.exit(main())
