"""One extract shard: run the frozen target over this shard's samples and append their features to the store.

Started by `dflash extract` (one process per shard, only its GPU visible) or by hand/scheduler through
`dflash extract --shard-index I`. Contract:
- The shard's samples are `ingest(...)[I::N]` (pipeline.store.shard_rows, the one sharding rule), batched by a
  deterministic plan (length-sorted, padded tokens <= extract.token_budget), so a resumed shard recomputes
  exactly the batches it had not committed.
- Overlap (stages/extract_loop.py): the main thread runs forward passes and queues each batch's encoded features
  (GPU -> pinned host copy on a side stream); a writer thread waits for the copy, writes and commits. Bounded by
  queue_depth. The shard's log ends with how busy the writer was and how long the GPU side waited for it.
- Samples with NaN/Inf features are not written; their count is committed with the shard's progress.
- The worker writes under the shard's lock (pipeline/store_lock.py): the one its parent took (`--lock-token`)
  or, started alone, its own. On resume it deletes the shard's stale `*.partial` files (logged).
- A finished store whose frozen head is missing gets it written again (the target is loaded for that only).
- Progress goes to stdout as JSON lines (`{"event": "progress", ...}`), read by the parent.
- SIGTERM: stop producing, commit what is computed, exit 143. If the parent dies the worker gets SIGTERM
  (Linux PR_SET_PDEATHSIG) and stops the same way, so no orphan keeps a GPU.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import sys
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from pipeline import store as st
from pipeline.config import Config
from pipeline.lifecycle import ExitCode, StopFlag, die_with_parent
from pipeline.store_writer import ShardWriter
from pipeline.target import DTYPES, FeatureCapture, frozen_head_from_checkpoint, load_target, load_tokenizer
from stages.extract_loop import pipelined_extract


def emit(event: str, **fields) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


@dataclass
class Batch:
    index: int
    members: list[int]  # indices into the shard's sample list


def plan_batches(lengths: list[int], token_budget: int, max_batch_size: int) -> list[Batch]:
    """Longest first; each batch holds samples of similar length with count x max_len <= token_budget."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches, cur = [], []
    for i in order:
        if cur and (len(cur) + 1) * lengths[cur[0]] > token_budget or len(cur) >= max_batch_size:
            batches.append(Batch(len(batches), cur))
            cur = []
        cur.append(i)
    if cur:
        batches.append(Batch(len(batches), cur))
    return batches


def extraction_plan(lengths: list[int], validation: list[bool], token_budget: int,
                    max_batch_size: int) -> tuple[list[Batch], int]:
    """The shard's batch plan and how many of its leading batches hold the validation samples.

    Validation samples come first, so a training run that follows the growing store (`dflash train --follow`)
    has its whole validation split early. Then the training samples: the longest batch first (a memory problem
    shows at once) and the others in a fixed pseudo-random order, so a run following the store sees a mix of
    lengths rather than longest to shortest. Batches stay length-grouped (`plan_batches`)."""
    def pack(members: list[int]) -> list[list[int]]:
        return [[members[i] for i in b.members] for b in plan_batches([lengths[m] for m in members], token_budget,
                                                                    max_batch_size)]

    val = pack([i for i, v in enumerate(validation) if v])
    train = pack([i for i, v in enumerate(validation) if not v])
    rest = train[1:]
    random.Random(0).shuffle(rest)
    return [Batch(k, m) for k, m in enumerate(val + train[:1] + rest)], len(val)


def plan_fingerprint(batches: list[Batch], sample_ids: list[str]) -> str:
    h = hashlib.sha256()
    for b in batches:
        h.update((",".join(sample_ids[i] for i in b.members) + ";").encode())
    return h.hexdigest()[:16]


def run_shard(cfg: Config, shard_index: int, num_shards: int, store_path: str, lock_token: Optional[str] = None,
              samples_file: Optional[str] = None) -> int:
    """Extract one shard; returns the process exit code (0 done, 143 stopped by a signal).

    lock_token: the shard lock `dflash extract` took for this worker; without it the worker takes the lock.
    samples_file: this shard's tokenised samples as the parent wrote them (`save_shard_samples`); without it
    the worker ingests the data itself (a shard run alone by hand)."""
    from data.ingest import dataset_fingerprint, ingest, load_shard_samples

    die_with_parent()
    stop = StopFlag()
    root_attrs = st.read_root_attrs(store_path)
    if root_attrs is None:
        raise st.StoreError(f"no store at {store_path}: start extraction with `dflash extract` (it creates the store)")
    if root_attrs["num_shards"] != num_shards:
        raise st.StoreError(f"the store was created for {root_attrs['num_shards']} shards, not {num_shards}; use --shards {root_attrs['num_shards']}")
    tokenizer = load_tokenizer(cfg.target.path, cfg.target.trust_remote_code)
    if samples_file:  # tokenised once by the parent: no second read of the data
        mine, meta = load_shard_samples(samples_file)
        fingerprint = meta["dataset_fingerprint"]
        if (meta["shard"], meta["num_shards"]) != (shard_index, num_shards):
            raise st.StoreError(f"{samples_file} holds shard {meta['shard']} of {meta['num_shards']}, not "
                                f"{shard_index} of {num_shards}; rerun `dflash extract`")
    else:
        samples, _ = ingest(cfg.data, tokenizer)
        fingerprint, mine = dataset_fingerprint(samples), st.shard_rows(samples, shard_index, num_shards)
    if fingerprint != root_attrs["dataset"]["fingerprint"]:
        raise st.StoreError("the dataset differs from the one this store was created from; use the same data files and config")
    lengths = [len(s.input_ids) for s in mine]
    ids = [s.sample_id for s in mine]
    plan, val_batches = extraction_plan(lengths, [s.split == "validation" for s in mine], cfg.extract.token_budget,
                                        cfg.extract.max_batch_size)
    writer = ShardWriter(store_path, shard_index, root_attrs, lock_token=lock_token)
    try:
        if writer.removed_partials:
            print(f"shard {shard_index}: removed {writer.removed_partials} stale temporary file(s) (*.partial) "
                  "left by a killed writer", file=sys.stderr, flush=True)
        started = writer.progress.plan_fingerprint
        if started and started != plan_fingerprint(plan, ids):  # begun by a dflash that planned longest first: keep it
            legacy = plan_batches(lengths, cfg.extract.token_budget, cfg.extract.max_batch_size)
            if plan_fingerprint(legacy, ids) == started:
                plan, val_batches = legacy, -1
        return _extract(cfg, writer, plan, val_batches, mine, lengths, tokenizer, stop, root_attrs)
    finally:
        writer.close()


def _extract(cfg: Config, writer: ShardWriter, plan: list[Batch], val_batches: int, mine, lengths: list[int],
             tokenizer, stop: StopFlag, root_attrs: dict) -> int:
    """The conductor of one shard's extraction, its phases in order: start (or resume) the shard's progress, load
    the target (`_load_target`), write a missing frozen head (`_write_frozen_head`), run the loop over the batches
    not yet committed (`_run_loop`), then finish the shard (`_finish`). -> the exit code."""
    shard_index, store_path = writer.index, writer.path
    prog = writer.start(plan_fingerprint(plan, [s.sample_id for s in mine]), len(mine), int(sum(lengths)), val_batches)
    report = _reporter(shard_index=shard_index, total_batches=len(plan))
    report(prog)
    head_path = st.frozen_head_path(store_path)
    if prog.done and st.exists(head_path):
        emit("done", shard=shard_index, already=True)
        return 0
    model, device, dtype = _load_target(cfg=cfg, root_attrs=root_attrs)
    if not st.exists(head_path):
        _write_frozen_head(cfg=cfg, store_path=store_path, model=model, dtype=dtype, root_attrs=root_attrs)
    if prog.done:  # the head was all a finished shard needed
        emit("done", shard=shard_index, already=True)
        return 0
    capture = FeatureCapture(model, root_attrs["layer_ids"])
    encoding = root_attrs["encoding"]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    delay = float(os.environ.get("DFLASH_TEST_EXTRACT_DELAY", "0") or 0)  # tests: a slow extraction to follow
    feed = _batches(plan=plan, prog=prog, mine=mine, lengths=lengths, pad_id=pad_id, delay=delay)
    on_batch = _committer(writer=writer, mine=mine, lengths=lengths, report=report)
    _run_loop(cfg=cfg, model=model, capture=capture, encoding=encoding, device=device, feed=feed, on_batch=on_batch,
              stop=stop, shard_index=shard_index, store_path=store_path)
    return _finish(cfg=cfg, writer=writer, stop=stop, shard_index=shard_index, report=report)


def _reporter(*, shard_index: int, total_batches: int):
    """-> report(progress): emits one `progress` event (the parent reads it) with the shard's committed figures."""
    return lambda p: emit("progress", shard=shard_index, batches=p.committed_batches, total_batches=total_batches,
                          samples=p.committed_samples, tokens=p.committed_tokens, planned_samples=p.planned_samples,
                          planned_tokens=p.planned_tokens, nonfinite=p.nonfinite_skipped, t=time.time())


def _load_target(*, cfg: Config, root_attrs: dict) -> tuple:
    """Load the frozen target on the GPU (or the CPU without one): the kernel cache first on CUDA, then the text
    model's layers 0..max(layer_ids) only; log its kernels and memory, and whether the fast forward is on (or why
    not). -> (model, device, dtype)."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = DTYPES[cfg.target.dtype if cuda else cfg.target.cpu_dtype]
    layer_ids = root_attrs["layer_ids"]
    if cuda:
        from pipeline.kernels import use_kernel_cache

        use_kernel_cache()  # before the kernels are imported: autotuning is kept for later batches and runs
    # straight to the device, text model only, layers 0..max(layer_ids) (pipeline/checkpoint.py)
    precision = root_attrs["target"].get("precision", "bf16")  # resolved once, in the store's root record
    model = load_target(cfg.target.path, dtype, device, cfg.target.attn_implementation, cfg.target.trust_remote_code,
                        keep_layers=max(layer_ids) + 1, precision=precision)
    if precision != "bf16":
        from pipeline.fp8_block import describe

        print(f"extract: target precision {precision}: {describe(model)}", file=sys.stderr, flush=True)
    _log_kernels(root_attrs)
    from pipeline.fast_forward import enable

    print(enable(model, device, cfg.extract.fast_forward), file=sys.stderr, flush=True)  # or the reason it is off
    return model, device, dtype


def _write_frozen_head(*, cfg: Config, store_path: str, model, dtype: torch.dtype, root_attrs: dict) -> None:
    """Write the store's frozen head (embeddings, final norm, lm_head unless tied to the embeddings), read from the
    target's checkpoint files (a trust_remote_code target: from the loaded model)."""
    from safetensors.torch import save

    from pipeline.provenance import write_frozen_head

    tensors = frozen_head_from_checkpoint(cfg.target.path, dtype, model, cfg.target.trust_remote_code)
    tied = root_attrs["target"]["tie_word_embeddings"]
    if tied:
        tensors.pop("lm_head.weight")
    write_frozen_head(store_path, save(tensors, metadata={"tie_word_embeddings": str(tied).lower()}))


def _batches(*, plan: list[Batch], prog, mine, lengths: list[int], pad_id: int, delay: float):
    """Yield (members, input_ids [B, S] right-padded with pad_id, lengths) for each planned batch from the first
    one not committed (`prog.committed_batches`, read when the first batch is asked for); `delay` seconds before
    each (tests)."""
    for batch in plan[prog.committed_batches:]:
        if delay:
            time.sleep(delay)
        members = batch.members
        S = max(lengths[m] for m in members)
        ids = torch.full((len(members), S), pad_id, dtype=torch.long)
        for r, m in enumerate(members):
            ids[r, : lengths[m]] = torch.from_numpy(mine[m].input_ids.astype(np.int64))
        yield members, ids, [lengths[m] for m in members]


def _committer(*, writer: ShardWriter, mine, lengths: list[int], report):
    """-> on_batch(members, parts, bad) for the loop's writer thread: write and commit a batch's finite samples
    (their ids, splits, lengths, tokens, loss masks and feature parts; the skipped ones counted), then report."""
    def on_batch(members, parts, bad):
        sel = [m for m, b in zip(members, bad) if not b]
        toks = np.concatenate([mine[m].input_ids for m in sel]) if sel else np.zeros(0, np.int32)
        mask = np.concatenate([mine[m].loss_mask for m in sel]) if sel else np.zeros(0, np.uint8)
        p = writer.write_batch(
            np.array([st.sample_id_to_int(mine[m].sample_id) for m in sel], dtype=np.uint64),
            np.array([st.SPLITS[mine[m].split] for m in sel], dtype=np.uint8),
            np.array([lengths[m] for m in sel], dtype=np.int32), toks.astype(np.int32),
            mask.astype(np.uint8), parts, nonfinite_skipped=int(bad.sum()))
        report(p)

    return on_batch


def _run_loop(*, cfg: Config, model, capture: FeatureCapture, encoding: str, device: torch.device, feed, on_batch,
              stop: StopFlag, shard_index: int, store_path: str) -> None:
    """Run `pipelined_extract` over the feed until done or stopped and log its figures; a write failure (OSError)
    becomes a StoreError that says the committed part is intact. The capture hooks are removed in any case."""
    try:
        loop = pipelined_extract(model, capture, encoding, device, feed, on_batch, cfg.extract.queue_depth,
                                 lambda: stop.stop)
        print(f"shard {shard_index}: {loop.batches} batches in {loop.wall_s:.1f} s; the writer was busy "
              f"{loop.writer_busy_s:.1f} s, the forward waited {loop.queue_wait_s:.1f} s for it (a full queue)",
              file=sys.stderr, flush=True)
    except OSError as e:  # disk full, unwritable path, lost mount: the committed part stays valid
        raise st.StoreError(f"writing shard {shard_index} to {store_path} failed: {e}. Everything committed before "
                            "is intact; free space or fix the path, then rerun the same command to resume") from e
    finally:
        capture.remove()


def _finish(*, cfg: Config, writer: ShardWriter, stop: StopFlag, shard_index: int, report) -> int:
    """After the loop: a stopped shard says so and exits WORKER_STOPPED; otherwise, unless it committed nothing
    (`_refuse_an_empty_shard`), it is marked finished, reported and done (0)."""
    if stop.stop:
        emit("stopped", shard=shard_index, samples=writer.progress.committed_samples)
        return ExitCode.WORKER_STOPPED
    _refuse_an_empty_shard(writer.progress, shard_index, cfg.target.path)  # never a "complete" 0-sample shard
    writer.finish()
    report(writer.progress)
    emit("done", shard=shard_index, already=False)
    return 0


def _refuse_an_empty_shard(p, shard_index: int, target_path: str) -> None:
    """A shard that planned samples and committed none (every one had NaN/Inf features: a broken target) is a
    failure, left unfinished, never marked done: a StoreError, one line."""
    if p.planned_samples and not p.committed_samples:
        raise st.StoreError(f"shard {shard_index}: none of its {p.planned_samples} sample(s) was written "
                            f"({p.nonfinite_skipped} had NaN/Inf features): the target at {target_path} computes "
                            "non-finite hidden states; check its weights (a damaged download, an FP8 checkpoint's "
                            "scales) and target.dtype, then rerun; the shard is not marked complete")


def _log_kernels(root_attrs: dict) -> None:
    """The shard log names the kernels transformers bound for a hybrid target, and the peak host memory so far."""
    from pipeline.checkpoint import peak_rss_bytes

    from pipeline.targets import family_named

    family = family_named(root_attrs["target"].get("model_type"))
    if family.linear_layers(root_attrs["target"].get("layer_types")):
        from pipeline.kernels import resolved_kernels

        print(f"target kernels: {resolved_kernels(family.modeling_module)}", file=sys.stderr, flush=True)
    print(f"target loaded; peak host memory {peak_rss_bytes() / 2**30:.2f} GiB", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    import argparse

    from pipeline.config import load_config

    ap = argparse.ArgumentParser(description="one dflash extract shard (normally started by `dflash extract`)")
    ap.add_argument("--config", default=None, help="a run config (with --set), or the parent's resolved one")
    ap.add_argument("--samples", default=None, help="this shard's tokenised samples, written by `dflash extract`")
    ap.add_argument("--shard-index", type=int, required=True)
    ap.add_argument("--shards", type=int, required=True)
    ap.add_argument("--store", required=True)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--lock-token", default=None, help="the shard lock the parent took for this worker")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    cfg = load_config(a.config, a.overrides)
    try:
        return run_shard(cfg, a.shard_index, a.shards, a.store, a.lock_token, a.samples)
    except Exception as e:  # noqa: BLE001 - reported to the parent as one line, traceback to the log
        import traceback

        traceback.print_exc(file=sys.stderr)
        emit("error", shard=a.shard_index, error=f"{type(e).__name__}: {e}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
