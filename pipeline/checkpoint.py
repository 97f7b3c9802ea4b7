"""The target's checkpoint on disk: its weight files, their content hashes, and loading like a serving engine.

Contract:
- `weight_files(d)` lists a checkpoint's safetensors files (the index's, else every `*.safetensors`).
- `text_key(name)` maps a checkpoint key to the text-only causal LM's key by the target families' prefixes
  (`pipeline/targets/`: a VLM's text part -> the causal LM's), dense keys unchanged; None for what a text-only
  target never uses (a family's `skip_prefixes`: vision tower, multi-token-prediction head).
- `content_hashes(d)` is the sha256 of each weight file's bytes. A file is read once per machine: the digests are
  kept in `~/.cache/dflash/weights-sha256.json` ($DFLASH_HASH_CACHE) keyed by real path, size, mtime and inode,
  so only new or changed files are read again (54 GB at ~1 GB/s the first time, milliseconds after).
- `load_text_model(d, dtype, device, keep_layers)` builds the text causal LM on the meta device with only the
  first `keep_layers` decoder layers, then streams each needed tensor from the shards straight to `device`
  (`safe_open(device=...)`, one shard mapped at a time): no full host copy, no vision tower, no MTP head,
  no layer past the deepest one used. Every parameter must come from the checkpoint (a tied head is the
  embedding); non-persistent buffers (rotary tables) are rebuilt from the config.
- `read_frozen_head(d, dtype)` reads embed_tokens / lm_head / final norm straight from the checkpoint.
- A block-wise FP8 checkpoint (Qwen's FP8 releases: pipeline/fp8_weights.py) loads as its real weights: every
  FP8 tensor is dequantized with its `weight_scale_inv` on the way, in the target's dtype; any other
  quantization is refused by name. With `fp8_block=True` (extract.target_precision fp8-block) an FP8 linear
  weight of 128 x 128 blocks keeps its bytes and scale instead, its nn.Linear replaced by pipeline/fp8_block.py's
  BlockFP8Linear (the served numerics); the rest loads as above.
- `peak_rss_bytes()` is this process's peak resident set (VmHWM), for the loading measurements.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from pipeline.errors import CheckpointError
from pipeline.fp8_weights import dequantize

from pipeline.targets import SKIP_PREFIXES, TEXT_PREFIXES
from pipeline.targets import transformers_text_config


def weight_files(d: Path) -> list[Path]:
    from pipeline.ckpt_io import require_regular

    d = Path(d)
    index = d / "model.safetensors.index.json"
    if index.exists():
        require_regular(index, "checkpoint's weight index")
        files = [d / n for n in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    else:
        files = sorted(d.glob("*.safetensors"))
    for f in files:  # every file a loader opens, refused unopened when it is a FIFO or a device
        require_regular(f, "checkpoint's weights file")
    return files


def text_key(name: str) -> Optional[str]:
    if name.startswith(SKIP_PREFIXES):
        return None
    for old, new in TEXT_PREFIXES:
        if name.startswith(old):
            return new + name[len(old):]
    return name


def _tensor_names(d: Path) -> dict[str, Path]:
    """checkpoint key -> file holding it."""
    d = Path(d)
    index = d / "model.safetensors.index.json"
    if index.exists():
        return {k: d / v for k, v in json.loads(index.read_text())["weight_map"].items()}
    from safetensors import safe_open

    out = {}
    for f in weight_files(d):
        with safe_open(str(f), "pt") as fh:
            out.update({k: f for k in fh.keys()})
    return out


# ---- content hashes ----------------------------------------------------------------------------------------

def hash_cache_path() -> Path:
    if os.environ.get("DFLASH_HASH_CACHE"):
        return Path(os.environ["DFLASH_HASH_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dflash" / "weights-sha256.json"


def _file_key(f: Path) -> str:
    s = f.stat()
    return f"{os.path.realpath(f)}|{s.st_size}|{s.st_mtime_ns}|{s.st_ino}"


def sha256_file(f: Path, chunk: int = 8 << 20) -> str:
    from pipeline.ckpt_io import require_regular

    require_regular(f, "file to hash")
    h = hashlib.sha256()
    with open(f, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def content_hashes(d: Path, log=None) -> dict[str, str]:
    """{file name: sha256 of its bytes} for the checkpoint's weight files, reading only files not seen before
    (or changed since: another size, mtime or inode)."""
    cache_file = hash_cache_path()
    try:
        cache = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        cache = {}
    out, changed = {}, False
    for f in weight_files(d):
        key = _file_key(f)
        if key not in cache:
            if log and f.stat().st_size > 100e6:
                log(f"hashing {f.name} ({f.stat().st_size / 1e9:.1f} GB; once per file, cached in {cache_file})")
            cache[key] = sha256_file(f)
            changed = True
        out[f.name] = cache[key]
    if changed:
        try:
            cache_file.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache_file.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(cache, indent=0, sort_keys=True))
            os.replace(tmp, cache_file)
        except OSError:
            pass  # a read-only home: hash again next time, still correct
    return out


# ---- loading -----------------------------------------------------------------------------------------------

def _device_arg(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda:{device.index if device.index is not None else torch.cuda.current_device()}"
    return str(device)


def _rebuild_buffers(model: nn.Module, device: torch.device) -> None:
    """Non-persistent buffers are not in the checkpoint and were made on the meta device: rebuild the modules
    that own them (rotary embeddings) from their config, on the CPU, and move the buffers over."""
    for name, mod in model.named_modules():
        lost = [b for b, t in mod._buffers.items() if t is not None and t.is_meta]
        if not lost:
            continue
        if not hasattr(mod, "config"):
            raise CheckpointError(f"cannot rebuild buffers {lost} of {name} ({type(mod).__name__}): no config")
        fresh = type(mod)(mod.config)
        for b in lost:
            mod._buffers[b] = fresh._buffers[b].to(device)


def load_text_model(d: Path, dtype: torch.dtype, device: torch.device, keep_layers: Optional[int] = None,
                    attn_implementation: str = "sdpa", fp8_block: bool = False) -> nn.Module:
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, GenerationConfig

    from pipeline import fp8_block as fb
    from pipeline.fp8_weights import quantization

    d = Path(d)
    block = quantization(d)  # block-wise FP8 (Qwen's FP8 release): dequantized while streaming, or kept (fp8_block)
    kept: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # fp8_block: linear name -> (FP8 weight, its scale)
    cfg = transformers_text_config(d, keep_layers)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation=attn_implementation)
    params = dict(model.named_parameters())  # a tied head appears once, as the embedding
    persistent = {k for k in model.state_dict() if k not in params}
    by_file: dict[Path, list[tuple[str, str]]] = {}
    names = _tensor_names(d)
    for key, f in names.items():
        mk = text_key(key)
        if mk in params or mk in persistent:
            by_file.setdefault(f, []).append((key, mk))
    dev = _device_arg(device)
    for f, pairs in sorted(by_file.items()):
        with safe_open(str(f), "pt", device=dev) as fh:  # one shard mapped at a time
            for key, mk in pairs:
                owner, _, attr = mk.rpartition(".")
                mod = model.get_submodule(owner)
                if mk in params:
                    t, scale = _stored_weight(fh, key, names, dev, block, d)
                    if scale is not None and fp8_block and attr == "weight" and fb.takes(mod, t, block):
                        kept[owner] = (t, scale)  # runs as the engines' block-FP8 linear (pipeline/fp8_block.py)
                        continue
                    if scale is not None:
                        t = dequantize(t, scale, block, name=f"{d}: {key}")  # refusals name the tensor
                    mod._parameters[attr] = nn.Parameter(t.to(params[mk].dtype), requires_grad=False)
                else:
                    mod._buffers[attr] = fh.get_tensor(key).to(mod._buffers[attr].dtype)
    fb.adopt(model, kept)
    missing = sorted(k for k, p in model.named_parameters() if p.is_meta)
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    out_emb = model.get_output_embeddings()
    if tied and out_emb is not None:
        out_emb.weight = model.get_input_embeddings().weight
        missing = sorted(k for k, p in model.named_parameters() if p.is_meta)
    if missing:
        raise CheckpointError(f"{d} has no tensors for {len(missing)} parameter(s) of {type(model).__name__}, e.g. "
                              f"{missing[:4]}; is it a checkpoint of this architecture?")
    _rebuild_buffers(model, device)
    if (d / "generation_config.json").exists():
        model.generation_config = GenerationConfig.from_pretrained(str(d))
    return model.requires_grad_(False).eval()


def _stored_weight(fh, key: str, names: dict[str, Path], dev: str, block, d: Path):
    """(tensor `key` of the open shard `fh`, None), or for an FP8 tensor (its FP8 bytes, its `_scale_inv` checked:
    pipeline/fp8_weights.py), the scale read from whichever shard holds it."""
    from pipeline.fp8_weights import checked, is_fp8, scale_key

    t = fh.get_tensor(key)
    if not is_fp8(t):  # every float8 dtype (e4m3, e5m2, fnuz) is read with its scale
        return t, None
    sk = scale_key(key)
    if block is None or sk not in names:
        raise CheckpointError(f"{d}: {key} is stored in FP8 without {'its ' + sk if block else 'a quantization_config'}"
                              "; dflash reads block-wise scaled FP8 checkpoints (config quantization_config with "
                              "quant_method fp8, a weight_scale_inv per weight), as Qwen's FP8 releases are")
    from safetensors import safe_open

    if names[sk] == names[key]:
        scale = fh.get_tensor(sk)
    else:
        with safe_open(str(names[sk]), "pt", device=dev) as other:
            scale = other.get_tensor(sk)
    checked(t, scale, block, name=f"{d}: {key}")  # refusals name the tensor
    return t, scale


def _real_weight(fh, key: str, names: dict[str, Path], dev: str, block, d: Path) -> torch.Tensor:
    """Tensor `key` as its real weight: an FP8 one dequantized with its scale."""
    t, scale = _stored_weight(fh, key, names, dev, block, d)
    return t if scale is None else dequantize(t, scale, block, name=f"{d}: {key}")


def read_frozen_head(d: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """embed_tokens.weight [V, H], lm_head.weight [V, H] (the embedding when tied) and norm.weight [H] from the
    checkpoint, as contiguous CPU tensors of `dtype`. Only these tensors are read."""
    from safetensors import safe_open

    from pipeline.fp8_weights import quantization

    cfg = transformers_text_config(d)
    block = quantization(Path(d))
    names = _tensor_names(d)
    want = {"model.embed_tokens.weight": "embed_tokens.weight", "lm_head.weight": "lm_head.weight",
            "model.norm.weight": "norm.weight"}
    out = {}
    for key, f in names.items():
        mk = text_key(key)
        if mk in want:
            with safe_open(str(f), "pt") as fh:
                out[want[mk]] = _real_weight(fh, key, names, "cpu", block, Path(d)).to(dtype).contiguous()
    if "embed_tokens.weight" not in out:
        raise CheckpointError(f"{d} has no embed_tokens weight")
    if bool(getattr(cfg, "tie_word_embeddings", False)):
        out["lm_head.weight"] = out["embed_tokens.weight"]  # a tied head is the embedding, never a fresh matrix
    elif "lm_head.weight" not in out:
        raise CheckpointError(f"{d} has no lm_head weight and its config does not tie it to the embedding")
    return out


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (Linux VmHWM), 0 where unknown."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
