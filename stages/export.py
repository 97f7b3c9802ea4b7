"""`dflash export CKPT OUT`: turn a training checkpoint into the serving directory (see pipeline/export.py).

Contract: reads only the checkpoint (which records the drafter's arch, the target's layer count, vocabulary
and tie flag); writes OUT/config.json, OUT/model.safetensors and the modeling file for transformers'
trust_remote_code. `for_sglang=True` leaves out `auto_map`. Also loads a checkpoint's drafter for eval.
Given a run directory, `dflash export` takes its best checkpoint by val tau (or the last: `--which last`)
and says which (stages/best_checkpoint.py). OUT/dflash_meta.json records the checkpoint, its step, best or
last, and its val tau, which `dflash eval` reports. OUT/dflash_tau.json records what the run's eval measured of
that checkpoint, or `evaluated: false` and why (stages/eval_record.py).
"""

from __future__ import annotations

from pathlib import Path

import torch

from pipeline.archs import drafter_from_arch_dict
from pipeline.acceptance import checkpoint_val_tau
from pipeline.drafter import DFlashDrafter
from pipeline.export import export_drafter


def load_checkpoint_drafter(ckpt_path: str, device: str | torch.device = "cpu") -> tuple[DFlashDrafter, dict]:
    """(drafter in eval mode, the checkpoint's dflash metadata: config, layer ids, target, store)."""
    from pipeline.ckpt_io import load_training_checkpoint

    ckpt = load_training_checkpoint(ckpt_path)  # weights_only: never runs code from the file
    meta = ckpt.get("dflash")
    if meta is None:
        raise FileNotFoundError(f"{ckpt_path} is not a dflash training checkpoint (no 'dflash' metadata)")
    meta.setdefault("step", int(ckpt.get("global_step", 0)))  # checkpoints written before the key existed
    state = {k.removeprefix("drafter."): v for k, v in ckpt["state_dict"].items() if k.startswith("drafter.")}
    # of the arch recorded (pipeline/archs.py), its sizes checked against the weights before anything is built
    drafter = drafter_from_arch_dict(meta["arch"], state, where=str(ckpt_path))
    drafter.load_state_dict(state)
    return drafter.to(device).eval(), meta


def export_checkpoint(ckpt_path: str, out_dir: str, for_sglang: bool = False, dtype: str = "bfloat16",
                      choice=None) -> Path:
    """`choice` (stages.best_checkpoint.Choice): why this checkpoint, recorded in OUT/dflash_meta.json."""
    drafter, meta = load_checkpoint_drafter(ckpt_path)
    target = meta["target"]
    from stages.eval_record import record_for_export

    picked = choice.as_dict() if choice is not None else {
        "selected": checkpoint_kind(Path(ckpt_path)), "step": meta["step"],
        "val_tau": checkpoint_val_tau(meta.get("val"), meta["step"])}
    return export_drafter(
        drafter, drafter.arch, out_dir, vocab_size=int(meta["vocab_size"]),
        num_target_layers=int(target["num_hidden_layers"]), tie_word_embeddings=bool(target.get("tie_word_embeddings")),
        dtype=dtype, for_sglang=for_sglang, tau=record_for_export(ckpt_path, meta["step"], drafter.arch.block_size),
        extra_metadata={"target": target.get("name"), "store": meta.get("store"), **picked, "checkpoint": str(ckpt_path)},
    )


def checkpoint_kind(path: Path) -> str:
    """best | last | step: what a checkpoint file is within its run (by name; last.ckpt may link a step file)."""
    from stages.best_checkpoint import BEST_RE

    if BEST_RE.match(path.name):
        return "best"
    last = path.parent / "last.ckpt"
    if path.name == "last.ckpt" or (last.exists() and last.resolve() == path.resolve()):
        return "last"
    return "step"


def run_export(path: str, *, out: str, which: str | None = None, for_sglang: bool = False,
               dtype: str = "bfloat16") -> int:
    """`dflash export PATH OUT`: PATH is a checkpoint file, or a run directory (its best checkpoint by val tau
    unless which="last"); prints which checkpoint was exported and why."""
    from stages.best_checkpoint import resolve_checkpoint

    picked = resolve_checkpoint(path, which)
    choice = None if isinstance(picked, Path) else picked
    ckpt = picked if choice is None else choice.path
    done = export_checkpoint(str(ckpt), out, for_sglang=for_sglang, dtype=dtype, choice=choice)
    why = choice.reason if choice is not None else f"{ckpt}"
    print(f"exported {why} to {done}" + (f" (checkpoint {ckpt})" if choice is not None else ""))
    print(serve_commands_text(done))
    return 0


def serve_commands_text(export_dir) -> str:
    """The vLLM and SGLang command lines that serve the export (pipeline/serve_commands.py), as printed."""
    from pipeline.serve_commands import describe, serve_commands

    return describe(serve_commands(export_dir))
