"""Peak host memory of loading the target, per extract worker: dflash's loader against plain from_pretrained.

Writes a random checkpoint of the real Qwen3.5/3.6-27B layout at full width (hidden 5120, FFN 17408, vocab
248,320, the real head counts) but with fewer layers (`--layers 8`: ~11 GB instead of 54 GB, which the GPU
machine's disk and time allow), laid out like the real one: `Qwen3_5ForConditionalGeneration` config, sharded
safetensors (`--shard-gb`) with an index, keys `model.language_model.*`, a `model.visual.*` and `mtp.*` tensor.
Then, each in a fresh process, it loads the text model to the device and reads the process's peak resident
memory growth (VmHWM):
  - dflash: `pipeline.target.load_target(..., keep_layers=N)` (meta build, shards streamed to the device);
  - old: `AutoModelForCausalLM.from_pretrained(dtype=bf16).to(device)`, what load_target did before.
The old way's growth follows the checkpoint (every mapped page is read on the way to the GPU), so at 64 layers
it extrapolates to the whole 54 GB per worker (x5 workers); dflash's is bounded by the shard being read.

    python bench/load_bench.py --layers 8 --dir /tmp/ckpt --out $OUT/load.json
    python bench/load_bench.py --tiny --device cpu        # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

_PROBE = """
import json, sys, time, torch
from pipeline.checkpoint import peak_rss_bytes
import transformers.models.qwen3_5.modeling_qwen3_5  # noqa: imports paid before the baseline
path, how, device, keep = sys.argv[1], sys.argv[2], torch.device(sys.argv[3]), int(sys.argv[4])
if device.type == "cuda":
    torch.zeros(1, device=device)  # the CUDA context is not the loader's memory
before = peak_rss_bytes()
t = time.perf_counter()
if how == "dflash":
    from pipeline.target import load_target
    m = load_target(path, torch.bfloat16, device, keep_layers=keep)
else:
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device)
    if device.type == "cpu":  # on the CPU .to() reads nothing: make the reads a copy to a GPU makes
        sum(float(p.float().sum()) for p in m.parameters())
if device.type == "cuda":
    torch.cuda.synchronize()
print(json.dumps({"growth_bytes": peak_rss_bytes() - before, "seconds": time.perf_counter() - t,
                  "layers": len(m.model.layers)}))
"""


def write_checkpoint(out: Path, layers: int, tiny: bool, device: str, shard_gb: float) -> int:
    """A random checkpoint of the real layout, written shard by shard (host memory stays ~one shard)."""
    from safetensors.torch import save_file
    from transformers import Qwen3_5Config

    from bench.extract_bench import build_model

    out.mkdir(parents=True, exist_ok=True)
    model, text = build_model("qwen3_5", "tiny" if tiny else "real", device=device,
                              dtype=torch.bfloat16, num_hidden_layers=layers)
    state = dict(model.state_dict())
    H = text.hidden_size
    state["model.visual.merger.linear_fc2.weight"] = torch.zeros(H, 16, dtype=torch.bfloat16)
    state["mtp.fc.weight"] = torch.zeros(H, 2 * H, dtype=torch.bfloat16)
    limit, shards, cur, size, total = shard_gb * 1e9, [], {}, 0, 0
    for k in sorted(state):
        v = state[k]
        nbytes = v.numel() * v.element_size()
        if cur and size + nbytes > limit:
            shards.append(cur)
            cur, size = {}, 0
        key = "model.language_model." + k[len("model."):] if k.startswith("model.") and not k.startswith(
            ("model.visual.",)) else k
        cur[key] = v
        size += nbytes
        total += nbytes
    shards.append(cur)
    weight_map = {}
    for i, part in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({k: v.detach().to("cpu").contiguous() for k, v in part.items()}, str(out / name),
                  metadata={"format": "pt"})
        weight_map.update({k: name for k in part})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": weight_map}))
    vis = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=H)
    cfg = Qwen3_5Config(text_config=text.to_dict(), vision_config=vis, tie_word_embeddings=False)
    cfg.architectures = ["Qwen3_5ForConditionalGeneration"]
    cfg.save_pretrained(str(out))
    del model, state, shards, cur
    return total


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shard-gb", type=float, default=4.0)
    ap.add_argument("--dir", default="/tmp/dflash-load-bench")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    d = Path(a.dir)
    t = time.perf_counter()
    total = write_checkpoint(d, a.layers, a.tiny, a.device, a.shard_gb if not a.tiny else 0.001)
    files = sorted(d.glob("*.safetensors"))
    largest = max(f.stat().st_size for f in files)
    print(f"checkpoint: {a.layers} layers, {total / 1e9:.2f} GB in {len(files)} shards (largest "
          f"{largest / 1e9:.2f} GB), written in {time.perf_counter() - t:.0f}s", flush=True)
    res = {"layers": a.layers, "checkpoint_bytes": total, "shards": len(files), "largest_shard_bytes": largest,
           "device": a.device, "loads": {}}
    for how in ("dflash", "old"):
        r = subprocess.run([sys.executable, "-c", _PROBE, str(d), how, a.device, str(a.layers)], cwd=ROOT,
                           capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        if r.returncode != 0:
            print(r.stderr[-3000:], file=sys.stderr)
            raise SystemExit(f"{how} load failed")
        res["loads"][how] = json.loads(r.stdout.strip().splitlines()[-1])
    per_layer = (total - 2 * 248320 * 5120 * 2) / a.layers if not a.tiny else None
    print(f"{'loader':<8}{'peak host growth':>18}{'x checkpoint':>14}{'seconds':>9}")
    for how, r in res["loads"].items():
        print(f"{how:<8}{r['growth_bytes'] / 2**30:>15.2f} GiB{r['growth_bytes'] / total:>14.2f}{r['seconds']:>9.1f}")
    if per_layer:
        full = 2 * 248320 * 5120 * 2 + 64 * per_layer
        res["extrapolated_64_layers"] = {"checkpoint_bytes": full,
                                         "old_growth_bytes": res["loads"]["old"]["growth_bytes"] / total * full,
                                         "dflash_growth_bytes_bound": largest}
        print(f"at 64 layers ({full / 1e9:.0f} GB): old ~{res['loads']['old']['growth_bytes'] / total * full / 2**30:.0f} "
              f"GiB per worker; dflash stays near its measured growth (bounded by one shard, "
              f"{largest / 2**30:.1f} GiB here)")
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
