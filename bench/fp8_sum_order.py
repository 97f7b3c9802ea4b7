"""How far two correct block-FP8 forwards of the same model drift apart when only their GEMMs' fp32 summation
order differs (issue 45: the yardstick for comparing the GPU kernel's tap features with the reference's).

Both forwards run `pipeline.fp8_block.reference_linear`'s numerics on the same weights and inputs. One takes each
linear's fp32 sum as one matmul (the reference), the other K-block by K-block, as a block-scaled kernel does
(`--order blocked`), or even and odd channels apart (`--order strided`: where the CPU's BLAS itself sums K in
blocks of 128, as MKL on an AMD EPYC does, "blocked" equals one matmul bit for bit). The
bf16 outputs then differ in the last bit here and there. The next linear quantizes its input to FP8 again, where
such a bit can move an element across a rounding boundary, one FP8 step of 12.5%. So the difference grows layer by
layer, far above bf16 rounding. A whole-model feature comparison of two FP8 paths therefore cannot show a kernel's
equality; a per-linear comparison on the same inputs can (tests/test_fp8_block.py's GPU test).

    python bench/fp8_sum_order.py --seq 300 --out runs/fp8-sum-order.json     # hidden 1024, 8 layers, bf16 (~45 s)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


ORDERS = ("blocked", "strided")  # the second summation order measure() compares with one matmul


def fp32_sum(xa: torch.Tensor, w: torch.Tensor, order: str) -> torch.Tensor:
    """xa [..., K] @ w [N, K].T in fp32, summed in one of three orders:
    - "one": one matmul (the reference; the CPU BLAS picks its own K blocking);
    - "blocked": 128 channels at a time, as a block-scaled kernel sums. A BLAS that itself sums K in blocks of
      128, front to back (MKL on an AMD EPYC does), gives this bit for bit, so there it is no second order;
    - "strided": the even channels' sum plus the odd channels' sum, a split of K no BLAS makes (every one sums
      contiguous runs of K), so it differs from "one" in the last bits on any machine."""
    if order == "one":
        return xa @ w.t()
    if order == "strided":
        return xa[..., 0::2] @ w[:, 0::2].t() + xa[..., 1::2] @ w[:, 1::2].t()
    y = torch.zeros(*xa.shape[:-1], w.shape[0], device=xa.device)
    for j in range(0, xa.shape[-1], 128):
        y += xa[..., j:j + 128] @ w[:, j:j + 128].t()
    return y


def _fp8_linear(order: str):
    """BlockFP8Linear.forward on reference_linear's operands, the fp32 sum taken in `order`."""
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _fp8_forward(self, x, order)
    return forward


def _fp8_forward(self, x: torch.Tensor, order: str) -> torch.Tensor:
    from pipeline import fp8_block as fb
    from pipeline.fp8_weights import dequantize

    lead, k = x.shape[:-1], x.shape[-1]
    x8, sx = fb.quantize_act(x.reshape(-1, k))
    w = dequantize(self.weight, self.weight_scale_inv, fb.BLOCK).to(x.device)  # [N, K] fp32
    y = fp32_sum(fb.dequantize_act(x8, sx), w, order).to(x.dtype)  # [M, N]
    return (y if self.bias is None else y + self.bias).reshape(*lead, w.shape[0])


def _bf16_linear(order: str):
    """nn.Linear.forward without FP8: the bf16 operands' fp32 sum in `order`."""
    def forward(self, x):
        y = fp32_sum(x.float(), self.weight.float(), order).to(x.dtype)
        return y if self.bias is None else y + self.bias
    return forward


def features(model, ids, layers: int) -> torch.Tensor:
    from pipeline.target import FeatureCapture, capture_features

    cap = FeatureCapture(model, list(range(layers)))
    try:
        return capture_features(model, cap, ids, torch.ones_like(ids))  # [B, S, L, H]
    finally:
        cap.remove()


def measure(hidden: int, intermediate: int, layers: int, seq: int, batch: int, seed: int, order: str = "blocked") -> dict:
    if order not in ORDERS:
        raise ValueError(f"order {order!r}: choose from {', '.join(ORDERS)}")
    import pipeline.fast_forward as ff
    from bench.extract_bench import build_model
    from pipeline import fp8_block as fb

    torch.manual_seed(seed)
    model, _ = build_model("qwen3_5", "real", device="cpu", dtype=torch.bfloat16, vocab_size=4096,
                           hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers)
    with torch.no_grad():  # non-zero zero-centred norm weights, as tests/test_fast_forward.py's hybrid
        for name, p in model.named_parameters():
            if name.endswith(("layernorm.weight", "q_norm.weight", "k_norm.weight")):
                p.copy_(0.1 * torch.randn_like(p))
    ff.install(model, ff.torch_ops())
    ids = torch.randint(4, 4000, (batch, seq), generator=torch.Generator().manual_seed(seed + 3))
    with torch.no_grad():
        plain = features(model, ids, layers)
        saved = torch.nn.Linear.forward
        try:  # the control: the same change of summation order without FP8 in between
            torch.nn.Linear.forward = _bf16_linear("one")
            bf_one = features(model, ids, layers)
            torch.nn.Linear.forward = _bf16_linear(order)
            bf_second = features(model, ids, layers)
        finally:
            torch.nn.Linear.forward = saved
        fb.quantize_linears(model.get_decoder().layers)
        one = features(model, ids, layers)
        rerun = torch.equal(one, features(model, ids, layers))  # the reference is deterministic
        saved = fb.BlockFP8Linear.forward
        fb.BlockFP8Linear.forward = _fp8_linear(order)
        try:
            second = features(model, ids, layers)
        finally:
            fb.BlockFP8Linear.forward = saved
    rows = []
    for i in range(layers):
        b, r, p, cb, cr = (t[:, :, i].float() for t in (second, one, plain, bf_second, bf_one))
        rows.append({"layer": i, "order": float((b - r).norm() / r.norm()), "fp8_drift": float((p - r).norm() / r.norm()),
                     "order_without_fp8": float((cb - cr).norm() / cr.norm())})
    return {"shape": f"hidden {hidden}, intermediate {intermediate}, {layers} layers, real head counts, bf16",
            "order": order,
            "tokens": batch * seq, "reference_rerun_equal": rerun, "layers": rows}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=3072)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seq", type=int, default=300)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--order", choices=ORDERS, default="blocked", help="the second fp32 summation order (fp32_sum)")
    ap.add_argument("--out", default=None, help="the figures as JSON")
    a = ap.parse_args(argv)
    t0 = time.time()
    res = measure(a.hidden, a.intermediate, a.layers, a.seq, a.batch, a.seed, a.order)
    print(f"{res['shape']}, {res['tokens']} tokens, second order {res['order']}, {time.time() - t0:.0f} s; the reference run twice is bit-equal: "
          f"{res['reference_rerun_equal']}")
    for r in res["layers"]:
        print(f"layer {r['layer']}: FP8, summation order alone {r['order']:.2e} (bf16 GEMMs: {r['order_without_fp8']:.2e}); "
              f"FP8 against bf16 GEMMs {r['fp8_drift']:.2e}")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
