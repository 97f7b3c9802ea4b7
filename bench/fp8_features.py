"""Issue 30 item 4: how far the features of an FP8 target are from its bf16 original, per tap layer.

Users who serve Qwen's FP8 release should train on the features of that target. dflash reads its format (block-
wise scaled FP8: pipeline/fp8_weights.py) and dequantizes while loading, so extraction runs the served weights
with bf16 GEMMs. This bench writes an FP8 copy of a bf16 checkpoint the way that release is made (every 2-D
projection weight of the decoder layers, 128 x 128 blocks, scale = amax / 448; embeddings, head, norms and the
GDN's conv, A_log and dt_bias left bf16), loads both with dflash's loader and compares the features of the
target's tap layers (`build_target_layer_ids`) on the same tokens: cosine and ||fp8 - bf16|| / ||bf16|| per
token, mean and worst.

    python bench/fp8_features.py --out $OUT/fp8_features.json           # the tiny replica and a random hybrid
    python bench/fp8_features.py --tiny                                  # smoke run (fewer tokens)
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

KEEP_BF16 = ("embed_tokens", "lm_head", "norm", "conv1d", "A_log", "dt_bias", "visual", "mtp")


def quantized_name(name: str, t: torch.Tensor) -> bool:
    """Whether the FP8 release stores this tensor in FP8: a 2-D projection weight of a decoder layer."""
    return t.dim() == 2 and name.endswith(".weight") and ".layers." in name and not any(k in name for k in KEEP_BF16)


def write_fp8_checkpoint(src: Path, dst: Path, block: tuple[int, int] = (128, 128), dtype=None) -> int:
    """An FP8 copy of the bf16 checkpoint `src` at `dst` (the other files copied), its weights in `dtype` (None:
    float8_e4m3fn; the config's `fmt` follows it); returns how many tensors."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from pipeline.checkpoint import weight_files
    from pipeline.fp8_weights import quantize, scale_key

    src, dst = Path(src), Path(dst)
    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir(parents=True)
    scales: dict[str, str] = {}  # scale key -> its shard (the weight's)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.is_file():
            shutil.copy(f, dst / f.name)
    for f in weight_files(src):
        out = {}
        with safe_open(str(f), "pt") as fh:
            for k in fh.keys():
                t = fh.get_tensor(k)
                if quantized_name(k, t):
                    out[k], out[scale_key(k)] = quantize(t, block, **({"dtype": dtype} if dtype else {}))
                    scales[scale_key(k)] = f.name
                else:
                    out[k] = t
        save_file(out, str(dst / f.name), metadata={"format": "pt"})
    index = dst / "model.safetensors.index.json"
    if index.exists():  # the scales live in their weight's shard
        idx = json.loads(index.read_text())
        idx["weight_map"].update(scales)
        index.write_text(json.dumps(idx))
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e5m2" if "e5m2" in str(dtype) else "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": list(block), "modules_to_not_convert": list(KEEP_BF16)}
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))
    return len(scales)


@torch.inference_mode()
def tap_features(path: Path, ids: torch.Tensor, layer_ids: list[int]) -> torch.Tensor:
    """[B, S, L, H] fp32 features of the tap layers, loaded by dflash's loader (fp32 on the CPU)."""
    from pipeline.target import FeatureCapture, capture_features, load_target

    model = load_target(str(path), torch.float32, torch.device("cpu"), keep_layers=max(layer_ids) + 1)
    cap = FeatureCapture(model, layer_ids)
    return capture_features(model, cap, ids, torch.ones_like(ids)).float()


def compare(bf16: Path, fp8: Path, ids: torch.Tensor, num_layers: int) -> dict:
    from pipeline.target import resolve_layer_ids

    layer_ids = resolve_layer_ids(None, num_layers, min(5, num_layers - 1))
    a, b = tap_features(fp8, ids, layer_ids), tap_features(bf16, ids, layer_ids)
    rows = {}
    for j, layer in enumerate(layer_ids):
        x, y = a[:, :, j].reshape(-1, a.shape[-1]), b[:, :, j].reshape(-1, b.shape[-1])  # [tokens, H]
        cos = torch.nn.functional.cosine_similarity(x, y, dim=-1)
        rel = (x - y).norm(dim=-1) / y.norm(dim=-1).clamp_min(1e-12)
        rows[layer] = {"cos_mean": float(cos.mean()), "cos_min": float(cos.min()), "rel_mean": float(rel.mean()),
                       "rel_max": float(rel.max())}
    return {"layer_ids": layer_ids, "tokens": int(ids.numel()), "per_layer": rows}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", default="/tmp/dflash-fp8")
    ap.add_argument("--out", default=None)
    ap.add_argument("--tiny", action="store_true", help="smoke run: fewer tokens")
    a = ap.parse_args(argv)
    root = Path(a.root)
    root.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    seq, rows = (32, 1) if a.tiny else (256, 4)
    res = {}

    # the tiny replica the project ships (dense Qwen3 layout), on text of its own corpus
    from pipeline.config import load_config
    from pipeline.target import load_tokenizer

    cfg = load_config(str(ROOT / "configs" / "tiny.yaml"))
    replica = Path(cfg.target.path)
    tok = load_tokenizer(str(replica))
    text = " ".join(json.loads(line)["messages"][1]["content"]
                    for line in open(cfg.data.train_files[0]).read().splitlines()[:400])
    ids = torch.tensor(tok(text)["input_ids"][: seq * rows]).view(rows, seq)
    n = write_fp8_checkpoint(replica, root / "replica-fp8")
    layers = json.loads((replica / "config.json").read_text())["num_hidden_layers"]
    res["tiny replica"] = {"fp8_tensors": n, **compare(replica, root / "replica-fp8", ids, layers)}

    # a random-weight model of the hybrid layout (Qwen3_5ForConditionalGeneration files), random tokens
    from bench.load_bench import write_checkpoint

    hybrid = root / "hybrid"
    if not (hybrid / "config.json").exists():
        write_checkpoint(hybrid, 8, True, "cpu", shard_gb=1.0)
    n = write_fp8_checkpoint(hybrid, root / "hybrid-fp8")
    ids = torch.randint(10, 1000, (rows, seq))
    res["random hybrid (tiny width)"] = {"fp8_tensors": n, **compare(hybrid, root / "hybrid-fp8", ids, 8)}

    for name, r in res.items():
        print(f"{name}: {r['fp8_tensors']} FP8 tensors, {r['tokens']} tokens")
        print("| tap layer | cos mean | cos min | rel err mean | rel err max |\n| --- | --- | --- | --- | --- |")
        for layer, x in r["per_layer"].items():
            print(f"| {layer} | {x['cos_mean']:.5f} | {x['cos_min']:.5f} | {x['rel_mean']:.4f} | {x['rel_max']:.4f} |")
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
