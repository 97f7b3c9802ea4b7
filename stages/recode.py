"""`dflash recode SRC DST --encoding E`: convert a finished store to another feature encoding, without the target.

Contract:
- SRC must be a complete store (every shard done). DST gets SRC's provenance with the new encoding (and
  clevel) plus `recoded_from` (pipeline.provenance.recoded_provenance), the same shards, the same samples in the same order, and a copy of the frozen
  head: training, eval and inspect treat it exactly like a store extracted with that encoding.
- Features are decoded from SRC and re-encoded batch by batch (on CUDA when present), through the same
  ShardWriter commit protocol as extraction, so a killed recode resumes where it stopped when rerun with the
  same arguments, and never touches SRC.
- Recoding from a lossy source (fp8, intN) compounds the errors; it is allowed, with a warning.
- SRC is read only through `StoreReader.read_rows` (checked: a missing or damaged chunk stops the recode
  naming it) and its frozen head is checked against its checksum before it is copied. DST's shards are
  written under their locks, like extraction's.
"""

from __future__ import annotations

import sys
import time
from typing import Optional

import numpy as np
import torch

from pipeline import provenance as prov
from pipeline import store as st
from pipeline.encoding import check, decode, encode, from_storage, part_names, to_storage
from pipeline.store_reader import StoreReader
from pipeline.store_writer import ShardWriter


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_recode(src: str, *, dst: str, encoding: str, clevel: Optional[int] = None, device: Optional[str] = None,
               batch_tokens: int = 65536) -> int:
    attrs = st.read_root_attrs(src)
    if attrs is None:
        raise st.StoreError(f"no store at {src}; pass the path of a finished `dflash extract` store")
    if str(src).rstrip("/") == str(dst).rstrip("/"):
        raise st.StoreError("recode writes a new store: DST must differ from SRC (SRC is never modified)")
    try:
        check(encoding, int(attrs["hidden_size"]))
    except ValueError as e:
        raise st.StoreError(f"--encoding: {e}") from None
    reader = StoreReader(src, require_complete=False)
    unfinished = [i for i, p in reader.progress.items() if not p.done]
    if unfinished:
        raise st.StoreError(f"{src} is not complete (shard(s) {unfinished} unfinished); finish it with `dflash "
                            "extract` first: recode converts finished stores only")
    if attrs["encoding"] != "bf16":
        _log(f"recode: warning: {src} is already lossy ({attrs['encoding']}); re-encoding to {encoding} compounds "
             "the errors. Recode from a bf16 store when you have one.")
    stored = prov.create_or_open_store(dst, prov.recoded_provenance(attrs, src, encoding, clevel))
    problem = prov.recode_source_problem(stored, attrs, dst)
    if problem:
        raise st.StoreError(problem)
    if not st.exists(st.frozen_head_path(dst)):
        prov.copy_frozen_head(src, dst)
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    total = sum(p.committed_tokens for p in reader.progress.values())
    done_tokens, t0, last = 0, time.perf_counter(), 0.0
    _log(f"recode: {src} ({attrs['encoding']}) -> {dst} ({encoding}), {len(reader.samples)} samples, "
         f"{total} tokens, on {dev}")
    for i in sorted(reader.shards):
        prog = reader.progress[i]
        n = prog.committed_samples
        cols = reader.columns(i)
        starts, lengths, ids, splits = (cols[k] for k in ("sample_start", "sample_length", "sample_id", "split"))
        batches = _plan(lengths, batch_tokens)
        with ShardWriter(dst, i, stored) as writer:
            w = writer.start(f"recode:{attrs['encoding']}:{batch_tokens}:{n}", n, prog.committed_tokens)
            done_tokens += w.committed_tokens
            if w.done:
                continue
            for a, b in batches[w.committed_batches:]:
                t_a, t_b = int(starts[a]), int(starts[b - 1] + lengths[b - 1])
                rows = lambda k: reader.read_rows(i, k, t_a, t_b)  # noqa: E731 - checked reads of SRC
                parts = {k: from_storage(rows(k)).to(dev) for k in part_names(attrs["encoding"])}
                x = decode(parts, attrs["encoding"], torch.float32)  # [T, L, H]
                new = {k: to_storage(v.cpu()) for k, v in encode(x, encoding).items()}
                writer.write_batch(ids[a:b], splits[a:b], lengths[a:b].astype(np.int32), rows("tokens"),
                                   rows("loss_mask"), new)
                done_tokens += t_b - t_a
                now = time.perf_counter()
                if now - last > 10 or done_tokens == total:
                    last = now
                    rate = done_tokens / max(1e-9, now - t0)
                    _log(f"recode: {done_tokens}/{total} tokens ({100 * done_tokens / max(1, total):.0f}%), "
                         f"{rate:,.0f} tokens/s")
            writer.finish()
    _log(f"recode: done: {dst} ({encoding}); `dflash inspect {dst}` shows its size")
    return 0


def _plan(lengths: np.ndarray, batch_tokens: int) -> list[tuple[int, int]]:
    """Consecutive sample ranges [a, b) of about batch_tokens tokens each (at least one sample)."""
    out, a, tok = [], 0, 0
    for j, n in enumerate(lengths.tolist()):
        if j > a and tok + n > batch_tokens:
            out.append((a, j))
            a, tok = j, 0
        tok += n
    if a < len(lengths):
        out.append((a, len(lengths)))
    return out
