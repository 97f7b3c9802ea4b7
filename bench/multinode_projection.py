"""The multi-node time table of docs/guides/multi-node.md (issue 32): a projection, not a measurement.

Inputs (docs/benchmarks.md): extraction 8,977 tokens/s per H200 (the 27B hybrid layout with flash-linear-attention,
the rate `dflash extract --plan` uses); training 12,245 tokens/s on one H200 at the 27B-shape drafter (batch 1 x
accumulation 4 of 3,072-token samples: one optimizer step = 12,288 tokens, ~1.0 s); 91% DDP scaling inside a node
(measured on 2 H200s over NVLink, assumed to hold at 8); across nodes one all-reduce of the 6.9 GB of fp32
gradients per optimizer step, a ring costing 2 (W-1)/W x 6.9 GB at the stated per-GPU link speed, counted as not
overlapping the backward (the pessimistic end: DDP overlaps buckets with the backward in practice).

    python bench/multinode_projection.py [--link-gbps 400] [--tokens 1.2e9] [--epochs 6]
"""

from __future__ import annotations

import argparse

EXTRACT_TOK_S = 8977.0  # per GPU
TRAIN_TOK_S = 12245.0  # per GPU, one GPU alone
STEP_TOKENS = 4 * 3072  # one optimizer step per GPU (batch 1 x accumulation 4)
INTRA_NODE = 0.91  # DDP scaling inside a node (2 H200s, NVLink)
GRAD_BYTES = 6.9e9  # fp32 gradients of the 27B-shape drafter


def project(nodes: int, gpus: int, tokens: float, epochs: int, link_gbps: float) -> dict:
    world = nodes * gpus
    extract_s = tokens / (EXTRACT_TOK_S * world)
    step_s = STEP_TOKENS / TRAIN_TOK_S
    if nodes == 1:
        eff, allreduce_s = INTRA_NODE, step_s * (1 / INTRA_NODE - 1)
    else:  # the inter-node ring bounds the all-reduce; NVLink inside the node is ~10x faster
        allreduce_s = 2 * (world - 1) / world * GRAD_BYTES / (link_gbps / 8 * 1e9)
        eff = step_s / (step_s + allreduce_s)
    train_s = tokens * epochs / (TRAIN_TOK_S * world * eff)
    return {"nodes": nodes, "gpus": world, "extract_h": extract_s / 3600, "allreduce_ms": allreduce_s * 1000,
            "scaling": eff, "train_h": train_s / 3600, "total_h": (extract_s + train_s) / 3600}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--link-gbps", type=float, default=400.0, help="inter-node bandwidth per GPU, Gbit/s")
    ap.add_argument("--tokens", type=float, default=1.2e9)
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--nodes", default="1,2,4")
    a = ap.parse_args()
    print("| nodes | GPUs | extraction (all GPUs) | all-reduce per step | training scaling | training, "
          f"{a.epochs} epochs | total |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for n in (int(x) for x in a.nodes.split(",")):
        p = project(n, a.gpus_per_node, a.tokens, a.epochs, a.link_gbps)
        print(f"| {n} | {p['gpus']} | {p['extract_h']:.1f} h | {p['allreduce_ms']:.0f} ms | {100 * p['scaling']:.0f}% "
              f"| {p['train_h']:.1f} h | {p['total_h']:.1f} h |")


if __name__ == "__main__":
    main()
