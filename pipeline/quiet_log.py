"""Third-party lines in what `dflash train` and `dflash demo` print: each one is fixed at its cause or filtered
here, with its reason next to it (issue 31 item 4).

Contract: `quiet_third_party()` is idempotent and changes no math. It filters only the messages listed in
WARNINGS (six), Lightning's info lines (the logger level) and dynamo's recompile dumps of the recompiles that are
expected (RECOMPILES): each of those becomes one `train: recompiling ...` line. Any other warning, and any other
recompile, still prints everything. Dynamo names each compiled variant's first failing guard only, so a
recompile counts as expected when every variant failed on an expected guard; the recompile limit
(pipeline/compile_setup.py) still stops a storm of them. Fixed at their cause elsewhere: the model-summary precision warning (no
Lightning summary: `train:` prints the parameter count), "`weights_only` was not set" (our saves say it).
"""

from __future__ import annotations

import logging
import re
import sys
import warnings

# (message regex, reason it is filtered); matched from the start of the warning's text
WARNINGS: list[tuple[str, str]] = [
    # a store without a validation split trains without validation; `train:` says so itself
    (r"You defined a `validation_step` but have no `val_dataloader`", "no validation split"),
    # Lightning's own tree helper calls torch's deprecated LeafSpec check: harmless, Lightning's to update
    (r"`isinstance\(treespec, LeafSpec\)` is deprecated", "Lightning uses a deprecated torch API"),
    # Inductor's choice of a two-pass softmax where its online-softmax kernel does not apply (it has them only for
    # Triton, i.e. not on the CPU, and not for every shape): a kernel choice, the same math
    # (its text starts with a newline: the pattern allows leading whitespace)
    (r"\s*Online softmax is disabled", "an Inductor kernel choice"),
    # validation metrics are all-reduced by the task itself before they are logged (train_task's
    # on_validation_epoch_end), which Lightning cannot see: its advice to sync them again does not apply
    (r"It is recommended to use `self.log\('val/", "val metrics are all-reduced already"),
    # an epoch with fewer batches than Trainer(log_every_n_steps) (a small store on several ranks) writes its CSV
    # rows less often; the progress lines (train.log_every) are dflash's own
    (r"The number of training batches \(\d+\) is smaller than the logging interval", "a short epoch"),
]

# (guard-failure regex, what it means) of the recompiles a drafter layer legitimately has (stages/train_task.py
# counts them: input requires_grad x layer type x grad mode x static then dynamic shapes, up to 16), and those of
# the compiled BlockMask table builder (pipeline/masks.py `_all_tables`: one variant per window kind, sliding
# (causal) and full, each static then dynamic in the context length; seen on the H200 in a chat-mix run)
RECOMPILES: list[tuple[str, str]] = [
    (r"\bcausal == (True|False)\b", "the other attention kind (sliding window or full)"),
    (r"\bctx_len == \d+", "new shapes (dynamic from now on)"),
    (r"requires_grad mismatch", "the input's requires_grad (the first layer's input needs no gradient)"),
    (r"layer_type ==", "another layer type"),
    (r"GLOBAL_STATE changed: grad_mode", "grad mode (validation runs without gradients)"),
    (r"size mismatch at index|stride mismatch at index", "new shapes (dynamic from now on)"),
]

_RECOMPILE_LOGGER = "torch._dynamo.guards.__recompiles"
_installed = False


def expected_recompile(message: str) -> list[str] | None:
    """What each guard failure of a dynamo recompile message means, when every one is expected; else None."""
    reasons = re.findall(r"^\s*- (\d+/\d+: .*)$", message, re.M)  # one per earlier compiled variant
    if not reasons:
        return None
    kinds = []
    for r in reasons:
        kind = next((k for pat, k in RECOMPILES if re.search(pat, r)), None)
        if kind is None:
            return None
        if kind not in kinds:
            kinds.append(kind)
    if re.search(r"^\s*- (?!\d+/\d+: |User stack trace:|\s)", message, re.M):  # (a stack trace's lines: indented)
        return None  # anything else in the dump (a guard we do not know the shape of) prints in full
    return kinds


class RecompileLines(logging.Filter):
    """An expected recompile: one dflash line instead of dynamo's dump; any other passes through unchanged."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        kinds = expected_recompile(msg)
        if kinds is None:
            return True
        head = msg.splitlines()[0].removeprefix("Recompiling function ")
        print(f"train: recompiling {head} for {'; '.join(kinds)} (expected)", file=sys.stderr, flush=True)
        return False


def quiet_third_party() -> None:
    """Install the filters above for this process (the launcher and every rank call it)."""
    global _installed
    if _installed:
        return
    _installed = True
    import lightning.pytorch  # noqa: F401  its import sets its logger's level: ours comes after
    for pattern, _reason in WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)
    # Lightning's info lines repeat what dflash prints itself ("GPU available", "`Trainer.fit` stopped"), give
    # advice that does not apply (the float32 matmul-precision hint: the step's matmuls run in bf16 under
    # autocast, and TF32 would change the 32-true results the tests compare) or advertise (the litlogger tip).
    # Its warnings are Python warnings, not log records: they still print, bar the ones in WARNINGS
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)
    logging.getLogger(_RECOMPILE_LOGGER).addFilter(RecompileLines())
