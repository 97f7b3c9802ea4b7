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
from pipeline.store_reader import chunk_exists, decode_error, samples_in_rows
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
    """Check one shard's committed rows, chunk by chunk; append problems; -> tokens checked. The conductor: the
    arrays and their lengths (`_open_arrays`), the chunks not stored (`_absent_chunks`), the per-sample columns
    (`_check_samples`), then the token rows block by block (`_check_tokens`), all read through a `_ShardReader`."""
    enc, vocab = attrs["encoding"], attrs["target"]["vocab_size"]
    n, T = p.committed_samples, p.committed_tokens
    token_arrays = st.token_arrays(enc)
    arrays = _open_arrays(g=g, i=i, token_arrays=token_arrays, n=n, T=T, problems=problems)
    if arrays is None:
        return 0
    absent = _absent_chunks(path=path, i=i, p=p, arrays=arrays, token_arrays=token_arrays, n=n, T=T, notes=notes)
    reader = _ShardReader(i=i, arrays=arrays, token_arrays=token_arrays, n=n, T=T, absent=absent, problems=problems)
    _check_samples(reader=reader, ids_seen=ids_seen)
    return _check_tokens(reader=reader, enc=enc, vocab=vocab)


def _open_arrays(*, g, i: int, token_arrays: tuple, n: int, T: int, problems: list[str]) -> dict | None:
    """The shard's token and sample arrays by name, or None after appending a problem for each one missing or
    shorter than its committed rows (T tokens, n samples)."""
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
    return None if bad else arrays


def _absent_chunks(*, path: str, i: int, p: st.Progress, arrays: dict, token_arrays: tuple, n: int, T: int,
                   notes: list[str]) -> set[tuple[str, int]]:
    """(array, chunk) of every committed chunk not stored that is a problem. A shard written before every chunk
    was stored may lack its all-zero MAYBE_EMPTY chunks: those get a note instead (zeros or deleted, it cannot
    be told)."""
    absent: set[tuple[str, int]] = set()  # (array, chunk) not stored
    for k, a in arrays.items():
        rows = T if k in token_arrays else n
        for c in range(math.ceil(rows / a.chunks[0])):
            if not chunk_exists(path, i, k, a, c):
                absent.add((k, c))
    legacy_zero = sorted({k for k, c in absent if k in st.MAYBE_EMPTY and not p.every_chunk})
    if legacy_zero:
        notes.append(f"shard {i}: {sum(k in legacy_zero for k, _ in absent)} chunk(s) of {legacy_zero} not stored: "
                     "all zeros when written by dflash before every chunk was stored, or deleted since (cannot be told)")
    return {(k, c) for k, c in absent if p.every_chunk or k not in st.MAYBE_EMPTY}


class _ShardReader:
    """Reads one shard's rows chunk-aware and names each damaged chunk as a problem, with its rows and the samples
    it holds (from `cols`, the per-sample columns read so far)."""

    def __init__(self, *, i: int, arrays: dict, token_arrays: tuple, n: int, T: int, absent: set[tuple[str, int]],
                 problems: list[str]) -> None:
        self.i, self.arrays, self.token_arrays, self.n, self.T = i, arrays, token_arrays, n, T
        self.absent, self.problems = absent, problems
        self.cols: dict = {}

    def damage(self, k: str, c: int, what: str) -> None:
        """Append the problem of chunk c of array k: `what` is wrong with it."""
        R = self.arrays[k].chunks[0]
        samples = samples_in_rows(self.cols, k, c * R, (c + 1) * R, self.T if k in self.token_arrays else self.n)
        self.problems.append(f"shard {self.i}: array {k}, chunk {c} (rows {c * R}..{(c + 1) * R - 1}) {what}; "
                             f"it holds {samples}")

    def read(self, k: str, r0: int, r1: int):
        """Rows of one array, or None after naming each missing or undecodable chunk among them."""
        a, R = self.arrays[k], self.arrays[k].chunks[0]
        chunks = range(r0 // R, (r1 - 1) // R + 1)
        missing = [c for c in chunks if (k, c) in self.absent]
        for c in missing:
            self.damage(k, c, "is missing (zarr would read it as zeros)")
        try:
            data = a[r0:r1]
        except Exception:  # noqa: BLE001 - name every chunk that fails on its own
            for c in chunks:
                try:
                    a[c * R : min((c + 1) * R, r1)]
                except Exception as e:  # noqa: BLE001 - crc32c mismatch, damaged file
                    self.damage(k, c, f"cannot be decoded ({decode_error(e)})")
            return None
        return None if missing else data


def _check_samples(*, reader: _ShardReader, ids_seen: set) -> None:
    """Read the per-sample columns into `reader.cols` (ids first: the others' errors name them); when all four
    read, check the offsets are contiguous and add up to the committed tokens, and the ids are unique in the
    shard and across the shards seen so far (`ids_seen`, which gets this shard's ids)."""
    n, T, arrays, cols = reader.n, reader.T, reader.arrays, reader.cols
    for k in ("sample_id", "sample_start", "sample_length", "split"):  # ids first: the others' errors name them
        data = reader.read(k, 0, n) if n else arrays[k][0:0]
        if data is not None:
            cols[k] = data
    if len(cols) == 4 and n:
        starts, lengths, sids = cols["sample_start"], cols["sample_length"], cols["sample_id"]
        expected = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])  # [n + 1]
        off = np.flatnonzero(starts != expected[:-1])
        if off.size or expected[-1] != T:
            j = int(off[0]) if off.size else n - 1
            reader.damage("sample_start" if off.size else "sample_length", j // arrays["sample_start"].chunks[0],
                          f"holds offsets that are not contiguous or do not add up to the {T} committed tokens "
                          f"(first at sample position {j})")
        _, first = np.unique(sids, return_index=True)
        dup = sorted(set(range(n)) - set(first.tolist())) or [j for j, x in enumerate(sids.tolist()) if x in ids_seen]
        if dup:
            reader.damage("sample_id", dup[0] // arrays["sample_id"].chunks[0],
                          f"repeats sample id {int(sids[dup[0]]):016x} (at sample position {dup[0]})")
        ids_seen.update(sids.tolist())


def _check_tokens(*, reader: _ShardReader, enc: str, vocab: int) -> int:
    """Read the token rows in blocks aligned to every token array's chunks; in each readable block check the token
    ids are in [0, vocab) and the features decode to finite values (each kind reported once per shard, at its
    first chunk). -> the tokens checked."""
    T, arrays, token_arrays = reader.T, reader.arrays, reader.token_arrays
    block = math.lcm(*(arrays[k].chunks[0] for k in token_arrays))
    checked, flagged = 0, set()  # each kind of bad value is reported once per shard (its first chunk)
    for t0 in range(0, T, block):
        t1 = min(T, t0 + block)
        data = {k: reader.read(k, t0, t1) for k in token_arrays}
        if any(v is None for v in data.values()):
            continue
        toks = data["tokens"]
        out_of_range = np.flatnonzero((toks < 0) | (toks >= vocab))
        if out_of_range.size and "tokens" not in flagged:
            row = t0 + int(out_of_range[0])
            reader.damage("tokens", row // arrays["tokens"].chunks[0],
                          f"holds token ids outside the vocabulary [0, {vocab}) (first at row {row})")
            flagged.add("tokens")
        x = decode({k: from_storage(data[k]) for k in part_names(enc)}, enc, torch.float32)
        nonfinite = torch.nonzero(~torch.isfinite(x).flatten(1).all(dim=1)).flatten()
        if nonfinite.numel() and "features" not in flagged:
            row = t0 + int(nonfinite[0])
            reader.damage("features", row // arrays["features"].chunks[0],
                          f"decodes to non-finite values (first at row {row}"
                          + (", with its scales/outliers)" if enc != "bf16" else ")"))
            flagged.add("features")
        checked += t1 - t0
    return checked
