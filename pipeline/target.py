"""The frozen target: loading, fingerprinting, capturing the selected layers' outputs, and its frozen head.

Contract:
- Layer id k means the output of decoder layer k, i.e. transformers' `hidden_states[k + 1]` (index 0 of
  `hidden_states` is the embedding output). `capture_features` is tested equal to that on the tiny target.
- Only the layers up to the deepest selected id run (with keep_layers the rest are never built); the final
  norm and lm_head logits are never computed during extraction.
- `load_target` loads like a serving engine (pipeline/checkpoint.py): straight to the device, text model only
  (no vision tower, no mtp weights), and with `keep_layers` only the layers that run. It falls back to
  transformers' `from_pretrained` for trust_remote_code targets and checkpoints without safetensors.
- `target_fingerprint` identifies a target without loading it: hashes of its config and of its weights'
  bytes (`weights_sha256`: the sha256 of each safetensors file, read once per machine and cached by path,
  size, mtime and inode), so a fine-tune or a tensor edited in place is another target.
- `frozen_head_tensors` returns what training needs from the target: the input embedding, the output head
  (the embedding itself when the target ties them) and the final norm weight; `frozen_head_from_checkpoint`
  reads the same tensors straight from the checkpoint files.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from pipeline.config import build_target_layer_ids
from pipeline.errors import ConfigError

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def local_target_dir(path: str) -> Path:
    """A local directory holding the target's config/tokenizer/weights index (downloading metadata if a hub id)."""
    p = Path(path)
    if p.is_dir():
        return p
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(path, allow_patterns=["*.json", "*.jinja", "*.model", "*.txt"]))
    except Exception as e:  # noqa: BLE001
        raise FileNotFoundError(
            f"target {path!r} is neither a local directory nor a reachable hub id ({type(e).__name__}: {e}); "
            "set target.path to the checkpoint directory"
        ) from None


def _sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _weights_fingerprint(path: str, d: Path) -> tuple[str, str]:
    """(sha256 over {weight file name: sha256 of its bytes}, "content"), or the index's hash ("index") when the
    weights are neither local nor listed with their hashes by the hub."""
    from pipeline.checkpoint import content_hashes, weight_files

    files = weight_files(d)
    local = Path(path).is_dir() and files and all(f.exists() for f in files)
    digests = content_hashes(d, log=_log) if local else None
    if digests is None and not Path(path).exists():
        digests = _hub_lfs_hashes(path)  # the hub's LFS oid is the file's sha256: the same digests, no download
    if digests:
        return _sha256_bytes(json.dumps(digests, sort_keys=True).encode()), "content"
    index = d / "model.safetensors.index.json"
    return _sha256_bytes(index.read_bytes() if index.exists() else b""), "index"


def _hub_lfs_hashes(repo: str) -> Optional[dict]:
    try:
        from huggingface_hub import HfApi

        info = HfApi().model_info(repo, files_metadata=True)
        out = {s.rfilename: s.lfs.sha256 for s in info.siblings or [] if s.rfilename.endswith(".safetensors")
               and getattr(s, "lfs", None) is not None}
        return out or None
    except Exception:  # noqa: BLE001 - offline: fall back to the index
        return None


def _log(msg: str) -> None:
    import sys

    print(f"target: {msg}", file=sys.stderr, flush=True)


def target_fingerprint(path: str) -> dict:
    """Hashes of config.json and of the weights' bytes, plus the shape fields the store records.

    weights_sha256 changes when any byte of any safetensors file changes (a fine-tune with the same config and
    sharding, a tensor rewritten in place); weights_hash says how it was computed ("content", or "index" for a
    hub id whose files are neither local nor listed with hashes)."""
    from pipeline.targets import read_target_config

    d = local_target_dir(path)
    tc = read_target_config(d)
    weights_hash, how = _weights_fingerprint(path, d)
    return {
        "config_sha256": _sha256_bytes(json.dumps(tc.raw, sort_keys=True).encode()),
        "weights_sha256": weights_hash,
        "weights_hash": how,
        "model_type": tc.raw.get("model_type"),
        "architectures": tc.raw.get("architectures"),
        "num_hidden_layers": tc.num_hidden_layers,
        "hidden_size": tc.hidden_size,
        "vocab_size": tc.vocab_size,
        "tie_word_embeddings": tc.tie_word_embeddings,
        "rope_theta": tc.rope_theta,
        "layer_types": tc.layer_types,
    }


def resolve_layer_ids(layer_ids: Optional[list[int]], num_layers: int, num_feature_layers: int) -> list[int]:
    ids = list(layer_ids) if layer_ids is not None else build_target_layer_ids(num_layers, num_feature_layers)
    bad = [k for k in ids if not 0 <= k < num_layers]
    if bad:
        raise ConfigError(f"target.layer_ids {bad} out of range for a target with {num_layers} layers: use ids in "
                          f"0..{num_layers - 1}, or leave target.layer_ids unset (target.num_feature_layers picks them)")
    return ids


def load_tokenizer(path: str, trust_remote_code: bool = False):
    """The target's tokenizer; a path that is no target, or a hub id that cannot be loaded, is one line naming
    target.path (pipeline.preflight.check_target_path), not transformers' traceback."""
    from transformers import AutoTokenizer

    from pipeline.preflight import PreflightError, check_target_path

    check_target_path(path)
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as e:  # noqa: BLE001 - transformers and the hub raise many kinds (a config value's type, ...)
        detail = " ".join(x.strip() for x in str(e).strip().splitlines()[:2]) or type(e).__name__
        raise PreflightError(f"target.path {path}: transformers cannot load its config and tokenizer "
                             f"({type(e).__name__}: {detail}); set target.path to an intact checkpoint directory "
                             "(config.json and tokenizer files) or a reachable hub id") from None


def tokenizer_fingerprint(tokenizer) -> dict:
    vocab = tokenizer.get_vocab()
    vocab_hash = _sha256_bytes(json.dumps(sorted(vocab.items()), separators=(",", ":")).encode())
    template = tokenizer.chat_template or ""
    if isinstance(template, dict):
        template = json.dumps(template, sort_keys=True)
    return {"sha256": vocab_hash, "chat_template_sha256": _sha256_bytes(template.encode()), "name": tokenizer.name_or_path}


def local_checkpoint_dir(path: str) -> Path:
    """A local directory with the target's weights: the directory itself, or the hub snapshot of a hub id (its
    safetensors and metadata only, no *.bin duplicates)."""
    p = Path(path)
    if p.is_dir():
        return p
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(path, allow_patterns=["*.json", "*.safetensors", "*.jinja", "*.model", "*.txt"]))


def load_target(path: str, dtype: torch.dtype, device: torch.device, attn_implementation: str = "sdpa",
                trust_remote_code: bool = False, keep_layers: Optional[int] = None,
                precision: str = "bf16") -> nn.Module:
    """The target's text causal LM on `device` in eval mode; with keep_layers only its first keep_layers decoder
    layers exist (extraction: max(layer_ids) + 1); `precision` is a resolved extract.target_precision
    (pipeline/fp8_block.py: bf16, fp8-block, fp8-block-from-bf16). See the module contract."""
    from pipeline.checkpoint import load_text_model, weight_files

    d = local_checkpoint_dir(path)
    if not trust_remote_code and weight_files(d):
        model = load_text_model(d, dtype, device, keep_layers, attn_implementation, fp8_block=precision == "fp8-block")
        if precision == "fp8-block-from-bf16":
            from pipeline.fp8_block import quantize_linears

            quantize_linears(decoder_layers(model))
        return model
    if precision != "bf16":
        raise ConfigError(f"extract.target_precision = {precision} reads the checkpoint's safetensors with dflash's "
                          f"loader; {path} is loaded through transformers (target.trust_remote_code, or no "
                          "safetensors): set extract.target_precision=bf16")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(d), dtype=dtype, attn_implementation=attn_implementation, trust_remote_code=trust_remote_code
    )
    model.requires_grad_(False)
    if keep_layers is not None:
        truncate_layers(model, keep_layers)
    return model.to(device).eval()


def frozen_head_from_checkpoint(path: str, dtype: torch.dtype, model: Optional[nn.Module] = None,
                                trust_remote_code: bool = False) -> dict[str, torch.Tensor]:
    """frozen_head_tensors' result read from the checkpoint files, without the model. A trust_remote_code
    target (its key names are its own) or a checkpoint without safetensors takes them from `model` instead."""
    from pipeline.checkpoint import read_frozen_head, weight_files

    d = local_checkpoint_dir(path)
    if not trust_remote_code and weight_files(d):
        return read_frozen_head(d, dtype)
    if model is None:
        raise ValueError(f"{path}: the frozen head of this target can only be taken from the loaded model")
    return frozen_head_tensors(model)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder's list of layers, wherever the architecture keeps it."""
    owner = _layers_owner(model)
    if owner is None:
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__}")
    return owner.layers


def _layers_owner(model: nn.Module) -> Optional[nn.Module]:
    """The module whose `layers` is the decoder's ModuleList: the base model, a VLM's text model (the families'
    `text_model_attr`), or `model.model`."""
    from pipeline.targets import TEXT_MODEL_ATTRS

    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    texts = [getattr(base, a, None) for a in TEXT_MODEL_ATTRS]
    for owner in (base, *texts, getattr(model, "model", None)):
        if owner is not None and isinstance(getattr(owner, "layers", None), nn.ModuleList):
            return owner
    return None


def truncate_layers(model: nn.Module, keep: int) -> None:
    """Drop the decoder layers after the first `keep` (they never run during extraction). A model loaded with
    keep_layers already has no more."""
    owner = _layers_owner(model)
    if owner is None:
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__}")
    owner.layers = nn.ModuleList(list(owner.layers)[:keep])


class FeatureCapture:
    """Forward hooks that keep the outputs of the selected decoder layers of one forward pass."""

    def __init__(self, model: nn.Module, layer_ids: list[int]):
        self.layer_ids = list(layer_ids)
        self.outputs: dict[int, torch.Tensor] = {}
        layers = decoder_layers(model)
        self.handles = [layers[k].register_forward_hook(self._hook(k)) for k in self.layer_ids]

    def _hook(self, k: int):
        def hook(_module, _inputs, output):
            self.outputs[k] = output[0] if isinstance(output, tuple) else output

        return hook

    def pop(self) -> torch.Tensor:
        """[B, S, L, H] in layer-id order."""
        out = torch.stack([self.outputs[k] for k in self.layer_ids], dim=2)
        self.outputs.clear()
        return out

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


@torch.inference_mode()
def capture_features(model: nn.Module, capture: FeatureCapture, input_ids: torch.Tensor,
                     attention_mask: torch.Tensor) -> torch.Tensor:
    """Run the (truncated) decoder on a right-padded batch; returns [B, S, L, H] from the selected layers."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    return capture.pop()


def frozen_head_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """embed_tokens.weight [V, H], lm_head.weight [V, H] and norm.weight [H] as contiguous CPU tensors."""
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    owner = _layers_owner(model)
    norm = getattr(owner, "norm", None) if owner is not None else None
    out = {"embed_tokens.weight": embed, "lm_head.weight": head}
    if norm is not None:
        out["norm.weight"] = norm.weight
    return {k: v.detach().to("cpu").contiguous().clone() for k, v in out.items()}
