"""`dflash verify`: read every chunk of a store that its commits cover and report every problem.

Contract: `verify_store` reads every chunk covering committed rows (crc32c checksums are checked by zarr on
decode), and checks: every such chunk exists (zarr would silently read a missing one as zeros), array
lengths cover the commit, sample offsets are contiguous, token ids are in the vocabulary, features are
finite, sample ids are unique, every shard finished; the provenance and every progress record match
their checksums; the frozen head matches its checksum, has the target's shapes and finite values. Each
problem names its shard, array and chunk (with the rows and samples it holds). Notes (not problems):
shards being written now, stale locks, `*.partial` temporary files, a store from before checksums.
Exit 0 when clean, 1 with a report of every problem otherwise. It never modifies the store.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import torch

from pipeline import store as st
from pipeline.encoding import decode, from_storage, part_names
from pipeline.provenance import frozen_head_problem
from pipeline.store_lock import holder
from stages.inspect import _attrs


def verify_store(path: str, out=sys.stdout) -> int:
    attrs = _attrs(path, check=False)  # a provenance that fails its checksum is reported below
    root_attrs = st.root_attributes(path)
    integrity = st.INTEGRITY_ATTR in root_attrs
    problems: list[str] = []
    notes: list[str] = []
    if not integrity:
        notes.append("this store was written before dflash recorded checksums of its provenance, progress records "
                     "and frozen head: those are not checked, and its all-zero loss_mask/split/sample_start chunks "
                     "were not stored (an absent one of those is read as zeros)")
    problem = st.provenance_problem(path, root_attrs)
    if problem:
        problems.append(problem)
    ids_seen: set[int] = set()
    checked_tokens = 0
    for state in st.read_all_progress(path, report=True):  # records that fail their checksum come back named
        i, g = state.index, state.group
        if not state.started:
            problems.append(f"shard {i}: not started")
            continue
        lock = holder(path, i)
        if lock is not None:
            notes.append(f"shard {i}: " + (f"being written now by pid {[p for p, _ in lock['pids']]} on host "
                                           f"{lock['host']}: what is checked is its committed part"
                                           if lock["live"] else "a lock left by a killed run (the next run takes "
                                           "it over by itself)"))
        if state.problem:
            problems.append(f"shard {i}: {state.problem}")
            continue
        p = state.progress
        if not p.done:
            problems.append(f"shard {i}: not finished ({p.committed_samples}/{p.planned_samples} samples committed)")
        checked_tokens += _verify_shard(path, i, g, p, attrs, ids_seen, problems, notes)
    problem = frozen_head_problem(path, deep=True)
    if problem:
        problems.append(f"frozen head: {problem}")
    partial = st.partial_files(path)
    if partial:
        shown = ", ".join(str(f.relative_to(Path(path))) for f in partial[:5])
        notes.append(f"{len(partial)} temporary *.partial file(s) of an unfinished write ({shown}"
                     f"{', ...' if len(partial) > 5 else ''}): left by a killed writer unless one is running now. "
                     "Harmless; a resumed shard deletes its own, others can be deleted by hand")
    for note in notes:
        print(f"verify: note: {note}", file=out)
    if problems:
        print(f"verify: {path} has {len(problems)} problem(s):", file=out)
        for pr in problems:
            print(f"  - {pr}", file=out)
        return 1
    print(f"verify: {path} is valid: {len(ids_seen)} samples, {checked_tokens} tokens, every chunk read and checked", file=out)
    return 0


def _verify_shard(path: str, i: int, g, p: st.Progress, attrs: dict, ids_seen: set, problems: list[str],
                  notes: list[str]) -> int:
    """Check one shard's committed rows, chunk by chunk; append problems; -> tokens checked."""
    enc, vocab = attrs["encoding"], attrs["target"]["vocab_size"]
    n, T = p.committed_samples, p.committed_tokens
    token_arrays = st.token_arrays(enc)
    arrays, bad = {}, 0
    for k in (*token_arrays, *st.SAMPLE_ARRAYS):
        if k not in set(g.array_keys()):
            problems.append(f"shard {i}: array {k} missing")
            bad += 1
            continue
        arrays[k] = g[k]
        rows = T if k in token_arrays else n
        if arrays[k].shape[0] < rows:
            problems.append(f"shard {i}: array {k} has {arrays[k].shape[0]} rows but {rows} are committed (truncated)")
            bad += 1
    if bad:
        return 0
    absent: set[tuple[str, int]] = set()  # (array, chunk) not stored
    for k, a in arrays.items():
        rows = T if k in token_arrays else n
        for c in range(math.ceil(rows / a.chunks[0])):
            if not st.chunk_exists(path, i, k, a, c):
                absent.add((k, c))
    cols: dict = {}

    def damage(k: str, c: int, what: str) -> None:
        R = arrays[k].chunks[0]
        samples = st.samples_in_rows(cols, k, c * R, (c + 1) * R, T if k in token_arrays else n)
        problems.append(f"shard {i}: array {k}, chunk {c} (rows {c * R}..{(c + 1) * R - 1}) {what}; it holds {samples}")

    legacy_zero = sorted({k for k, c in absent if k in st.MAYBE_EMPTY and not p.every_chunk})
    if legacy_zero:
        notes.append(f"shard {i}: {sum(k in legacy_zero for k, _ in absent)} chunk(s) of {legacy_zero} not stored: "
                     "all zeros when written by dflash before every chunk was stored, or deleted since (cannot be told)")
    absent = {(k, c) for k, c in absent if p.every_chunk or k not in st.MAYBE_EMPTY}

    def read(k: str, r0: int, r1: int):
        """Rows of one array, or None after naming each missing or undecodable chunk among them."""
        a, R = arrays[k], arrays[k].chunks[0]
        chunks = range(r0 // R, (r1 - 1) // R + 1)
        missing = [c for c in chunks if (k, c) in absent]
        for c in missing:
            damage(k, c, "is missing (zarr would read it as zeros)")
        try:
            data = a[r0:r1]
        except Exception:  # noqa: BLE001 - name every chunk that fails on its own
            for c in chunks:
                try:
                    a[c * R : min((c + 1) * R, r1)]
                except Exception as e:  # noqa: BLE001 - crc32c mismatch, damaged file
                    damage(k, c, f"cannot be decoded ({st.decode_error(e)})")
            return None
        return None if missing else data

    for k in ("sample_id", "sample_start", "sample_length", "split"):  # ids first: the others' errors name them
        data = read(k, 0, n) if n else arrays[k][0:0]
        if data is not None:
            cols[k] = data
    if len(cols) == 4 and n:
        starts, lengths, sids = cols["sample_start"], cols["sample_length"], cols["sample_id"]
        expected = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])  # [n + 1]
        off = np.flatnonzero(starts != expected[:-1])
        if off.size or expected[-1] != T:
            j = int(off[0]) if off.size else n - 1
            damage("sample_start" if off.size else "sample_length", j // arrays["sample_start"].chunks[0],
                   f"holds offsets that are not contiguous or do not add up to the {T} committed tokens "
                   f"(first at sample position {j})")
        _, first = np.unique(sids, return_index=True)
        dup = sorted(set(range(n)) - set(first.tolist())) or [j for j, x in enumerate(sids.tolist()) if x in ids_seen]
        if dup:
            damage("sample_id", dup[0] // arrays["sample_id"].chunks[0],
                   f"repeats sample id {int(sids[dup[0]]):016x} (at sample position {dup[0]})")
        ids_seen.update(sids.tolist())
    block = math.lcm(*(arrays[k].chunks[0] for k in token_arrays))
    checked, flagged = 0, set()  # each kind of bad value is reported once per shard (its first chunk)
    for t0 in range(0, T, block):
        t1 = min(T, t0 + block)
        data = {k: read(k, t0, t1) for k in token_arrays}
        if any(v is None for v in data.values()):
            continue
        toks = data["tokens"]
        out_of_range = np.flatnonzero((toks < 0) | (toks >= vocab))
        if out_of_range.size and "tokens" not in flagged:
            damage("tokens", (t0 + int(out_of_range[0])) // arrays["tokens"].chunks[0],
                   f"holds token ids outside the vocabulary [0, {vocab}) (first at row {t0 + int(out_of_range[0])})")
            flagged.add("tokens")
        x = decode({k: from_storage(data[k]) for k in part_names(enc)}, enc, torch.float32)
        nonfinite = torch.nonzero(~torch.isfinite(x).flatten(1).all(dim=1)).flatten()
        if nonfinite.numel() and "features" not in flagged:
            row = t0 + int(nonfinite[0])
            damage("features", row // arrays["features"].chunks[0], f"decodes to non-finite values (first at row {row}"
                   + (", with its scales/outliers)" if enc != "bf16" else ")"))
            flagged.add("features")
        checked += t1 - t0
    return checked
