"""The `dflash` command line: parses arguments, loads the config, calls a stage. Nothing else lives here.

Every command takes `--config FILE` (default: the embedded tiny config) and repeatable `--set key=value`
overrides validated like the file. Errors the user can fix print one clear message and exit 2.
"""

from __future__ import annotations

import shlex
import sys
from typing import Optional

import click

from pipeline.config import CONFIGS_DIR, ConfigError, load_config
from pipeline.encoding import ENCODINGS
from pipeline.lifecycle import ExitCode

DEFAULT_CONFIG = str(CONFIGS_DIR / "tiny.yaml")


def _gpu_list(value: Optional[str]) -> Optional[list[int]]:
    """--gpus as indices; an error for a malformed list, and for GPUs this machine does not have (saying
    what it has): asking for a GPU never silently runs on the CPU."""
    if value is None or value == "":
        return None
    from stages.run import RunError, parse_gpus  # one reader of GPU lists: 0,1,2 and ranges such as 0-7

    try:
        gpus = parse_gpus(value)
    except RunError as e:
        raise click.BadParameter(str(e), param_hint="'--gpus'") from None
    if any(g < 0 for g in gpus):
        raise click.BadParameter(f"{value!r}: GPU indices are 0 or more", param_hint="'--gpus'")
    import os

    import torch

    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    where = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
    if not found:
        raise click.BadParameter(f"{value!r}: this machine has no usable CUDA GPU (torch {torch.__version__} finds "
                                 f"none{where}); leave --gpus out to run on the CPU", param_hint="'--gpus'")
    if max(gpus) >= found:
        raise click.BadParameter(f"{value!r}: torch finds {found} GPU(s) here, indices 0..{found - 1}{where}",
                                 param_hint="'--gpus'")
    return gpus


class ShardSet(click.ParamType):
    """--shard-index: one shard or a set (3, 0-4, 0,2,4, 0-2,5); checked against --shards by the stage."""

    name = "SET"

    def convert(self, value, param, ctx):
        text = str(value).strip()
        if text.startswith("-") and text[1:].isdigit():
            self.fail(f"{text} is not in the range x>=0", param, ctx)
        if not text or any(c not in "0123456789,- " for c in text):
            self.fail(f"{value!r}: expected shard indices such as 3, 0-4, 0,2,4 or 0-2,5", param, ctx)
        return int(text) if text.isdigit() else text


def _command_line() -> str:
    return shlex.join(["dflash", *sys.argv[1:]])


def _run(fn, *args, **kwargs) -> None:
    """Call a stage; turn the errors a user can fix (`UserError`, a missing file) into one message and exit 2."""
    from pipeline.errors import NonFiniteLoss, UserError

    try:
        code = fn(*args, **kwargs)
    except (UserError, FileNotFoundError) as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(ExitCode.USAGE)
    except NonFiniteLoss as e:  # training diverged: not a usage error, but no traceback helps either
        click.echo(f"error: {e}", err=True)
        sys.exit(ExitCode.FAILED)
    sys.exit(code or ExitCode.OK)


config_option = click.option("--config", "config_path", default=None, show_default="configs/tiny.yaml",
                             type=click.Path(dir_okay=False), help="Run config (YAML).")
set_option = click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
                          help="Override a config field, e.g. --set train.lr=3e-4 (repeatable).")


def _load(config_path: Optional[str], overrides) -> "object":
    """The stage's config (the tiny one only when no --config is given), then its start-up line (pipeline.config.startup_line)."""
    try:
        cfg = load_config(config_path or DEFAULT_CONFIG, list(overrides))
    except ConfigError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(ExitCode.USAGE)
    import os

    ctx = click.get_current_context(silent=True)
    if ctx is not None and "LOCAL_RANK" not in os.environ:  # once per command, not once per rank Lightning starts
        from pipeline.config import startup_line

        click.echo(startup_line(ctx.info_name, cfg, config_path, ctx.params.get("store")), err=True)
    return cfg


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="dflash")
def main() -> None:
    """dflash: train DFlash speculative-decoding drafters from a cached hidden-state store.

    Stage one (`extract`) runs the frozen target once and writes the selected layers' hidden states to a
    compressed Zarr store; stage two (`train`) trains the drafter from that store alone.
    """


@main.command()
@config_option
@set_option
@click.option("--shards", type=click.IntRange(min=1), default=None,
              help="Number of data-parallel shards (default: extract.shards).")
@click.option("--gpus", default=None, help="GPUs for the shards, e.g. 0,1,2,3,4 (default: shard i on GPU i).")
@click.option("--shard-index", type=ShardSet(), default=None,
              help="Run only these shards of --shards: 3, 0-4, 0,2,4 (one call per node or scheduler task, the "
              "same --shards everywhere; the j-th shard on the j-th GPU or --gpus entry).")
@click.option("--store", default=None, help="Store path or fsspec URL (default: store.path).")
@click.option("--plan", is_flag=True, help="Only print what the extraction would take (samples and tokens, store "
              "size, free disk, time on the GPUs) and exit without writing anything.")
def extract(config_path, overrides, shards, gpus, shard_index, store, plan):
    """Stage one: run the target over the data and write hidden states to the store.

    One worker process per shard, shard i on GPU i (only that GPU visible), so `--shards 5` uses GPUs 0-4;
    `--gpus` picks others. With no GPU the workers run on the CPU. Resumable: rerun the same command after
    a crash or Ctrl-C and every shard continues from its last commit. Running on a finished store does nothing.
    """
    cfg = _load(config_path, overrides)
    if plan:  # before any GPU work; --gpus only counts (the plan may be made on another machine)
        from stages.plan import run_plan

        if shards is None and gpus:
            from stages.run import parse_gpus

            shards = len(parse_gpus(gpus))
        _run(run_plan, cfg, store=store, shards=shards, shard_index=shard_index)
    from stages.extract import run_extract

    _run(run_extract, cfg, shards=shards, gpus=_gpu_list(gpus), shard_index=shard_index, store=store,
         command=_command_line())


@main.command("prepare-data")
@click.argument("inputs", nargs=-1, required=True)
@click.option("--out", default="data/prompts", show_default=True, type=click.Path(file_okay=False),
              help="Writes OUT/train.jsonl, OUT/validation.jsonl (the prompts regenerate reads) and OUT/prepare.json.")
@click.option("--validation-fraction", type=float, default=0.01, show_default=True,
              help="Share of conversations in validation.jsonl, split by a hash of the prompt.")
@click.option("--split", "splits", default=None, help="Saved DatasetDict: splits to read, comma-separated "
              "(default: train, else all).")
@click.option("--prompt-col", default=None, help="Column holding the user turn (instruction/response layouts).")
@click.option("--response-col", default=None, help="Column holding the assistant turn (optional).")
def prepare_data(inputs, out, validation_fraction, splits, prompt_col, response_col):
    """Turn chat data (ShareGPT or OpenAI-messages JSON/JSONL, a saved Hugging Face dataset, parquet, or
    instruction/response columns) into the recipe's prompt files with a train/validation split.
    Bad rows are counted by reason and skipped."""
    from stages.prepare_data import run_prepare_data

    _run(run_prepare_data, list(inputs), out=out, validation_fraction=validation_fraction,
         splits=[s for s in (splits or "").split(",") if s.strip()] or None, prompt_col=prompt_col,
         response_col=response_col, command=_command_line())


@main.command()
@config_option
@set_option
@click.option("--prompts", "prompts", multiple=True, required=True, metavar="FILE",
              help="Prompt file (JSONL messages/conversations or a datasets dir; assistant turns are dropped). "
                   "Repeatable, or comma-separated.")
@click.option("--out", required=True, type=click.Path(file_okay=False),
              help="Output directory: one JSONL per prompt file + manifest.json (point data.train_files at them).")
@click.option("--shards", type=click.IntRange(min=1), default=None,
              help="Embedded engine: worker processes (default: one per visible "
              "GPU, 1 on CPU).")
@click.option("--gpus", default=None, help="Embedded engine: GPUs for the shards, e.g. 0,1,2 (default: shard i on GPU i).")
@click.option("--server", "servers", multiple=True, metavar="URL",
              help="Use an OpenAI-compatible server (vLLM, SGLang) instead of the embedded engine, e.g. "
                   "http://localhost:8000. Repeat to spread the load over several servers.")
def regenerate(config_path, overrides, prompts, out, shards, gpus, servers):
    """Let the target write its own responses to PROMPTS, as training data for its drafter.

    Every assistant turn is regenerated in order, each conditioned on the target's own earlier answers, with
    the target's chat template and data.enable_thinking, and the sampling settings of the `regenerate:`
    section (greedy by default). Rerun the same command to resume after a crash or Ctrl-C.
    """
    from stages.regenerate import run_regenerate

    cfg = _load(config_path, overrides)
    servers = tuple(u for s in servers for u in s.split(",") if u.strip())
    _run(run_regenerate, cfg, prompts=list(prompts), out=out, shards=shards, gpus=_gpu_list(gpus), servers=servers,
         command=_command_line())


@main.command()
@config_option
@set_option
@click.option("--gpus", default=None, help="GPUs for the DDP ranks, e.g. 5,6,7 or 0-7 (one process per GPU).")
@click.option("--devices", type=click.IntRange(min=1), default=None,
              help="Without GPUs: number of CPU processes (gloo DDP).")
@click.option("--num-nodes", type=click.IntRange(min=1), default=None,
              help="Nodes of the job (default: train.num_nodes, 1); --gpus/--devices are the ranks per node. Start "
              "`dflash train` once per node under srun, torchrun or MASTER_ADDR/MASTER_PORT/NODE_RANK.")
@click.option("--store", default=None, help="Store path or URL (default: store.path).")
@click.option("--resume", is_flag=True, help="Continue from RUN/checkpoints/last.ckpt (step, optimiser, data position).")
@click.option("--no-export", is_flag=True, help="Skip exporting the drafter at the end.")
@click.option("--rebuild-compile-cache", is_flag=True, help="Empty the torch.compile cache of this drafter shape before starting "
              "(kept in $DFLASH_COMPILE_CACHE or ~/.cache/dflash/compile, shared by runs).")
@click.option("--follow", is_flag=True, help="Train while `dflash extract` still writes the store (waits for it to "
              "appear); an unfinished store is followed anyway.")
@click.option("--committed-only", "committed_only", is_flag=True, help="Train on the samples an unfinished store "
              "has committed now, as on a finished store, instead of following its extraction (stopped for good).")
@click.option("--init-from", "init_from", default=None, type=click.Path(exists=True, file_okay=False),
              metavar="EXPORT_DIR", help="Start a new run from an exported drafter's weights (RUN/export or a published "
              "DFlash checkpoint) with a fresh optimizer and schedule; unlike --resume, which continues this run.")
def train(config_path, overrides, gpus, no_export, **options):
    """Stage two: train the drafter from the store alone (Lightning DDP), then export it.

    `--gpus 5,6,7` runs one process per named GPU; with no GPU, `--devices N` runs N CPU processes over gloo.
    `--num-nodes N`: Lightning's multi-node DDP, started once per node (MASTER_ADDR/MASTER_PORT/NODE_RANK) or
    per rank (srun, torchrun); --gpus/--devices are then the ranks per node. The target checkpoint is never loaded: rerun with other hyperparameters on the same store for free.
    On a store still being written, training follows the extraction: it starts once one optimizer step's
    samples are committed, waits when it has caught up, and ends after train.epochs over the final store.
    """
    from stages.train import run_train

    cfg = _load(config_path, overrides)
    # every other option reaches run_train under its own name: a new flag is its option here and run_train's
    # parameter (and, for `dflash run`, a line in stages/run.py's TRAIN_FORWARDED or TRAIN_NOT_FORWARDED)
    _run(run_train, cfg, gpus=_gpu_list(gpus), export=not no_export, command=_command_line(), **options)


@main.command("run")
@config_option
@set_option
@click.option("--plan", is_flag=True, help="Only print what the run would take (store size, disk, the hours of the split, "
              "the split with expansion and both stages on all GPUs one after the other) and exit, writing nothing.")
@click.option("--extract-gpus", default="", help="GPUs for extraction, one shard each, e.g. 0-4 (empty: CPU workers, "
              "extract.shards of them).")
@click.option("--train-gpus", default="", help="GPUs for the training ranks, e.g. 5-7 (empty: CPU processes).")
@click.option("--devices", type=click.IntRange(min=1), default=None,
              help="Without --train-gpus: number of CPU training processes.")
@click.option("--store", default=None, help="Store path or URL (default: store.path).")
@click.option("--no-expand", is_flag=True, help="Keep training on --train-gpus after extraction ends (default: it "
              "checkpoints and resumes on the extraction's GPUs too).")
def run_(config_path, overrides, extract_gpus, train_gpus, devices, store, plan, no_expand):
    """Both stages on one node at once: extract on some GPUs while training follows the growing store on others.

    One progress view, one Ctrl-C stops both cleanly, and the same command resumes both (extraction from its
    commits, training from its last checkpoint). E.g. `dflash run --config C --extract-gpus 0-4 --train-gpus 5-7`.
    """
    from stages.run import run_node

    cfg = _load(config_path, overrides)
    if plan:  # before any child starts; the GPU lists only count (the plan may be made on another machine)
        from stages.plan import run_node_plan

        _run(run_node_plan, cfg, store=store, extract_gpus=extract_gpus, train_gpus=train_gpus, devices=devices)
    _run(run_node, cfg, config_path=config_path, overrides=list(overrides), extract_gpus=extract_gpus,
         train_gpus=train_gpus, devices=devices, store=store, command=_command_line(), expand=not no_expand)


@main.command()
@click.argument("checkpoint", type=click.Path(exists=True))
@click.argument("out", type=click.Path(file_okay=False))
@click.option("--sglang", is_flag=True, help="Leave out auto_map (SGLang rejects it).")
@click.option("--dtype", type=click.Choice(["bfloat16", "float32"]), default="bfloat16", show_default=True)
@click.option("--which", type=click.Choice(["best", "last"]), default=None,
              help="CHECKPOINT is a run directory: export its best checkpoint by val tau (default) or the last.")
def export(checkpoint, out, sglang, dtype, which):
    """Export a training checkpoint (a .ckpt file, or a run directory: its best checkpoint by val tau) to the
    directory SGLang, vLLM and transformers load."""
    from stages.export import run_export

    _run(run_export, checkpoint, out=out, which=which, for_sglang=sglang, dtype=dtype)


@main.command()
@click.argument("path")
@click.option("--json", "as_json", is_flag=True, help="Print the state as one JSON object.")
def status(path, as_json):
    """State, progress, throughput and ETA of an extraction (STORE) or a training run (RUN dir)."""
    from stages.status import show_status

    _run(show_status, path, as_json=as_json)


@main.command()
@click.argument("store")
@click.option("--json", "as_json", is_flag=True, help="Print the figures as one JSON object (the provenance whole).")
def inspect(store, as_json):
    """Show a store: samples, tokens, bytes on disk and per token, compression per array, provenance, shards."""
    from stages.inspect import inspect_store

    _run(inspect_store, store, as_json=as_json)


@main.command()
@click.argument("store")
def verify(store):
    """Read every chunk of a store and check checksums, offsets, token ids, finite features, completeness."""
    from stages.verify import verify_store

    _run(verify_store, store)


@main.command()
@click.argument("src")
@click.argument("dst")
@click.option("--encoding", required=True, type=click.Choice(list(ENCODINGS)),
              help="Feature encoding of DST (see pipeline/encoding.py; int5 is the studied default trade-off).")
@click.option("--clevel", type=click.IntRange(0, 9), default=None, help="zstd level of DST (default: SRC's).")
@click.option("--device", default=None, help="cpu or cuda[:i] for decoding/encoding (default: cuda when available).")
def recode(src, dst, encoding, clevel, device):
    """Convert a finished store SRC to another feature encoding in DST, without the target. Resumable."""
    from stages.recode import run_recode

    _run(run_recode, src, dst=dst, encoding=encoding, clevel=clevel, device=device)


@main.command("serve-check")
@click.argument("export_dir", metavar="EXPORT", type=click.Path(exists=True, file_okay=False))
@click.option("--server", required=True, help="Base URL of the vLLM or SGLang server, e.g. http://localhost:8000.")
@click.option("--prompts", type=click.Path(exists=True, dir_okay=False), default=None,
              help="JSONL prompts ({\"messages\": [...]} or {\"text\": ...}); default: --config's held-out prompts.")
@config_option
@set_option
@click.option("--engine", type=click.Choice(["auto", "vllm", "sglang"]), default="auto", show_default=True)
@click.option("--min-ratio", type=float, default=0.8, show_default=True, help="Fail below this x the trained tau.")
@click.option("--num-prompts", type=click.IntRange(min=1), default=16, show_default=True,
              help="Held-out prompts sent to the server.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=256, show_default=True, help="Tokens generated per prompt.")
@click.option("--timeout", type=float, default=60.0, show_default=True, help="Seconds one request may take.")
@click.option("--deadline", type=float, default=900.0, show_default=True, help="Seconds the whole check may take.")
@click.option("--model", "target", default=None, help="The target's served name (default: the export's target).")
@click.option("--tokenizer", default=None, help="SGLang: the tokenizer whose chat template renders the prompts.")
def serve_check(export_dir, server, prompts, config_path, overrides, **options):
    """Check a running vLLM or SGLang server that serves the target with this drafter: served tau against the
    tau `dflash eval` recorded in EXPORT; exits 1 below --min-ratio of it, naming the likely causes."""
    from stages.serve_check import run_serve_check

    cfg = _load(config_path, overrides) if config_path and not prompts else None
    _run(run_serve_check, export_dir, server=server, prompts=prompts, cfg=cfg, **options)


@main.command("eval")
@click.argument("drafter", type=click.Path(exists=True))
@click.option("--config", "config_path", default=None, type=click.Path(dir_okay=False),
              help="Run config (default: the drafter's run config.yaml, else the checkpoint's, else configs/tiny.yaml).")
@set_option
@click.option("--store", default=None, help="Store for the offline eval (default: the store the drafter was trained on).")
@click.option("--online", is_flag=True, help="Also decode held-out prompts with the target: tau, speedup, losslessness.")
@click.option("--out", default=None, type=click.Path(file_okay=False),
              help="Report directory (default: RUN/eval for a drafter inside a run, else runs/eval).")
@click.option("--device", default=None, help="cpu or cuda[:i] (default: cuda when available).")
@click.option("--cache", type=click.Choice(["auto", "kv", "recompute"]), default="auto", show_default=True,
              help="Target KV-cache policy of both greedy and speculative decoding (online).")
@click.option("--max-samples", type=click.IntRange(min=1), default=1000, show_default=True,
              help="Offline: at most this many validation samples of the store.")
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="Online on CPU: torch threads while decoding (default: 1 for targets under 100M parameters).")
@click.option("--json", "as_json", is_flag=True, help="Print the whole report as JSON on stdout instead of the headline tau.")
def eval_(drafter, config_path, overrides, store, online, out, device, cache, max_samples, threads, as_json):
    """Measure a drafter (exported directory or training checkpoint): acceptance length tau offline from the
    store (no target compute) and, with --online, real speculative decoding against plain greedy decoding.

    Writes OUT/report.json and PNG plots. Exits 1 if speculative output ever differs from greedy.
    """
    from stages.eval import run_eval

    _run(run_eval, drafter, config_path=config_path, overrides=list(overrides), store=store, online=online, out=out,
         device=device, cache=cache, max_samples=max_samples, threads=threads, as_json=as_json)


@main.command()
@click.option("--out", default="runs/demo", show_default=True, type=click.Path(file_okay=False),
              help="Where the store, the run, the export and the eval report go.")
@set_option
@click.option("--fresh", is_flag=True, help="Delete OUT first (else finished stages are reused).")
def demo(out, overrides, fresh):
    """The whole pipeline on the embedded tiny target in a few minutes on CPU: ingest -> extract (2 shards) ->
    train -> export -> offline and online eval. Prints where everything went and the tau reached."""
    from stages.demo import run_demo

    _run(run_demo, out, overrides=list(overrides), fresh=fresh, command=_command_line())


if __name__ == "__main__":
    main()
