"""Sequence packing (`train.packing`): which samples share a row, and how a row of several documents is built.

Contract:
- The plan: `pack_rows` puts documents into rows of at most `pack_tokens` tokens by best fit in the order given
  (each into the fullest row it still fits, ties to the older row; a new row when none fits): a pure function of
  the lengths in that order, so the same documents always give the same rows. Not decreasing: sorting a window
  longest first (best-fit *decreasing*) fills rows best, but makes rows of alike documents (three long ones, or
  fourteen short ones), and with the loss normalised per step that weighs long documents up, as length-grouped
  batches did (docs/benchmarks.md: grouping cost tau; a seeded pair with the decreasing order lost 17-21% tau
  after 1 epoch on the tiny target). In the shuffled order a row is a random mix. `packed_plan` is an epoch's plan for a finished
  store: the seeded shuffle of data/sampler.py's `window_plan`, cut into windows of `PACK_WINDOW` documents,
  each window packed, the rows cut into global batches of `batch_size` rows, the batches shuffled. Windows keep
  the epoch random (a row's documents come from one stretch of the shuffled order, not from all lengths sorted
  at once) while leaving enough choice to fill rows. Best fit with a sorted list of free space is O(n log n), so a million-sample epoch plans in seconds. The plan depends on seed, epoch and
  the store only (never on the number of ranks), so data/sampler.py's rounds, resume and rank-count changes hold.
- A following run's stream epoch (data/follow.py) knows a batch's samples only when a loader worker resolves
  them: `collate_packed` then packs that batch's documents itself with the same `pack_rows`.
- `collate_packed`: one row per planned row (items carry their row index) or per `pack_rows` group; each
  document's tokens, loss mask and encoded features are concatenated; its anchors (drawn per document by
  data/store_dataset.py, under train.anchor_rule) are shifted by its start; `doc_ids` [B, S] names each
  position's document (0, 1, ... in the row, -1 on padding), which is all pipeline/masks.py needs for the mask,
  the positions and the labels. The anchor width is rounded up to a multiple of `anchor_multiple` (the
  unpacked width: few distinct shapes for the compiled step).
"""

from __future__ import annotations

import bisect
import math
import random
from typing import Optional, Sequence

import torch

PACK_WINDOW = 512  # documents per packing window


def pack_rows(lengths: Sequence[int], pack_tokens: int) -> list[list[int]]:
    """Best fit in the given order: positions into `lengths` grouped in rows of total length <= pack_tokens (a
    longer document gets a row of its own). Rows in order of creation, documents in each row in the given order."""
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, row index), ascending
    for i in range(len(lengths)):
        n = lengths[i]
        k = bisect.bisect_left(free, (n, -1))  # the row with the least room that still fits n
        if k < len(free):
            room, r = free.pop(k)
        else:
            room, r = pack_tokens, len(rows)
            rows.append([])
        rows[r].append(i)
        if room - n > 0:
            bisect.insort(free, (room - n, r))
    return rows


def packed_plan(lengths: Sequence[int], batch_size: int, seed: int, epoch: int, pack_tokens: int,
                shuffle: bool = True) -> list[list[list[int]]]:
    """An epoch's global batches of rows of positions into `lengths` (see the module docstring)."""
    n = len(lengths)
    order = list(range(n))
    if shuffle:
        random.Random(seed * 1_000_003 + epoch).shuffle(order)  # the same shuffle as window_plan's
    rows: list[list[int]] = []
    for w0 in range(0, n, PACK_WINDOW):
        window = order[w0 : w0 + PACK_WINDOW]
        rows += [[window[j] for j in row] for row in pack_rows([lengths[i] for i in window], pack_tokens)]
    batches = [rows[i : i + batch_size] for i in range(0, len(rows), batch_size)]
    if shuffle:
        random.Random(seed * 7_919 + epoch).shuffle(batches)
    return batches


def collate_packed(items: list[Optional[dict]], pack_tokens: int, pad_multiple: int = 1,
                   anchor_multiple: int = 1) -> dict:
    """Documents -> packed rows: tokens/loss_mask/doc_ids [B, S], anchors [B, A] (-1 padding), seq_lens [B]
    (tokens in the row), docs_per_row [B], sample_ids (every document, row by row; -1 for a filler) and the
    encoding's parts [B, S, ...]. None items (empty stream slots) are left out."""
    items = [it for it in items if it is not None]
    if all("row" in it for it in items):
        groups: dict[int, list[dict]] = {}
        for it in items:
            groups.setdefault(int(it["row"]), []).append(it)
        rows = [groups[r] for r in sorted(groups)]
    else:  # a stream batch (or a filler): packed here, by the plan's own rule
        rows = [[items[i] for i in row] for row in pack_rows([len(it["tokens"]) for it in items], pack_tokens)]
    B = len(rows)
    lens = [sum(len(it["tokens"]) for it in row) for row in rows]
    S = int(math.ceil(max(lens) / pad_multiple) * pad_multiple)
    n_anchor = max(1, max(sum(len(it["anchors"]) for it in row) for row in rows))
    A = int(math.ceil(n_anchor / anchor_multiple) * anchor_multiple)
    out = {
        "tokens": torch.zeros(B, S, dtype=torch.long),
        "loss_mask": torch.zeros(B, S, dtype=torch.bool),
        "anchors": torch.full((B, A), -1, dtype=torch.long),
        "seq_lens": torch.tensor(lens, dtype=torch.long),
        "doc_ids": torch.full((B, S), -1, dtype=torch.long),
        "docs_per_row": torch.tensor([len(row) for row in rows], dtype=torch.long),
        "sample_ids": [int(it.get("sample_id", -1)) for row in rows for it in row],
    }
    parts = [k for k in items[0] if k not in ("tokens", "loss_mask", "anchors", "sample_id", "row")]
    for k in parts:  # padding tokens decode to finite values (scales 1, codes 0) and are masked out
        t = items[0][k]
        out[k] = (torch.ones if k == "scales" else torch.zeros)(B, S, *t.shape[1:], dtype=t.dtype)
    for b, row in enumerate(rows):
        start, a0 = 0, 0
        for d, it in enumerate(row):
            n, na = len(it["tokens"]), len(it["anchors"])
            out["tokens"][b, start : start + n] = it["tokens"]
            out["loss_mask"][b, start : start + n] = it["loss_mask"]
            out["doc_ids"][b, start : start + n] = d
            out["anchors"][b, a0 : a0 + na] = it["anchors"] + start  # sorted: documents in row order
            for k in parts:
                out[k][b, start : start + n] = it[k]
            start, a0 = start + n, a0 + na
    return out


def padding_stats(batch: dict) -> tuple[float, float]:
    """(padding fraction of the batch's B x S token slots, documents per row) of a collated batch."""
    B, S = batch["tokens"].shape
    docs = batch.get("docs_per_row")
    per_row = float(docs.float().mean()) if docs is not None else 1.0
    return 1.0 - float(batch["seq_lens"].sum()) / max(1, B * S), per_row
