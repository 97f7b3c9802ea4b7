"""`dflash run`: both stages on one node at once, supervised: extraction on some GPUs, training on the others
following the store as it grows (`dflash train --follow`).

Contract:
- Starts `dflash extract` (one shard per extract GPU) and `dflash train --follow` as child commands, each in
  its own process group, with their output in RUN/logs/run-extract.log and RUN/logs/run-train.log. With
  empty GPU lists (a machine without GPUs) both run as CPU processes (train: `devices` gloo ranks).
- One progress view: extraction's samples, tokens/s and ETA, training's step, steps/s and ETA, and how far
  training is behind extraction; a redrawn line on a terminal, a plain line every 15 s otherwise.
- One Ctrl-C (or SIGTERM) stops both cleanly: each child gets the signal a terminal would have sent it (the
  extraction commits and stops, training stops; checkpoints and commits are kept); a second Ctrl-C forces
  both. If this process dies, the children are sent SIGTERM (PR_SET_PDEATHSIG).
- Resume: the same command. Extraction continues from its commits; training resumes from
  RUN/checkpoints/last.ckpt when there is one. A store that is already complete is trained on directly,
  except by a rerun of a run whose training began following (RUN/logs/train-follows, written when training is
  started with --follow) and was stopped before its first checkpoint: that training follows again (the
  finished store's commit-order stream epoch, which depends only on the store and the seed), so the rerun
  gives the uninterrupted run's result, not a shuffled first epoch.
- Failures: a failed extraction stops the training (it could not finish) and the command exits 1 naming it;
  a failed training lets the extraction finish (its store is kept for the next run) and exits 1.
- The children's command lines come from `child_argv` with the options of `dflash train` and `dflash extract`
  this command forwards (TRAIN_FORWARDED, EXTRACT_FORWARDED); every other option of those commands is listed
  with the reason it is not forwarded (tests/test_run.py holds both lists to the click options, so a new
  option of `dflash train` fails it until it is one or the other). A resumed training child's line is
  `stages.train.resume_argv` of the fresh one, as the resume hint of a stopped `dflash train` is.
- Supervised by `pipeline.lifecycle.Supervisor` (each child in its own process group, signals forwarded).
- Expansion (the default; `--no-expand` keeps the split): when the extraction exits 0, training checkpoints at
  its next optimizer step, stops, and resumes on the union of both GPU lists (on the CPU: its processes plus
  one per extraction shard); stages/run_expand.py holds the protocol and the figures (RUN/logs/handover.jsonl).
  A store complete at the start is trained on the union directly, with no extraction child.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from pipeline import store as st
from pipeline.config import Config
from pipeline.errors import UserError
from pipeline.lifecycle import ExitCode, Outcome, Supervisor, tail
from stages.run_expand import (ENV_DIR, ENV_FIRST, FIRST_STEP, Handover, clear, hold, split_global_batch, union_devices,
                               warn_indivisible, where)


class RunError(UserError, RuntimeError):
    pass


def parse_gpus(text: Optional[str]) -> list[int]:
    """'0-4' / '0,1,2' / '5-7,9' / '' -> GPU indices."""
    out: list[int] = []
    for part in (text or "").replace(" ", "").split(","):
        if not part:
            continue
        try:
            lo, _, hi = part.partition("-")
            out += list(range(int(lo), int(hi) + 1)) if hi else [int(lo)]
        except ValueError:
            raise RunError(f"{text!r}: expected GPU indices such as 0-4 or 0,1,2") from None
    if len(set(out)) != len(out):
        raise RunError(f"{text!r} names a GPU twice")
    return out


# The options of `dflash train` and `dflash extract` (their click parameter names in stages/cli.py, each with the
# flag it is written as) that `dflash run` passes to its children, and every other one with why it does not.
TRAIN_FORWARDED = {"config_path": "--config", "overrides": "--set", "store": "--store", "gpus": "--gpus",
                   "devices": "--devices", "follow": "--follow", "resume": "--resume"}
TRAIN_NOT_FORWARDED = {
    "num_nodes": "`dflash run` runs on one node",
    "no_export": "the run exports its drafter at the end, as `dflash train` does by default",
    "rebuild_compile_cache": "a one-off: run `dflash train --rebuild-compile-cache` by itself for it",
    "init_from": "`--set drafter.init_from=EXPORT_DIR` reaches the training through --set",
    "committed_only": "`dflash run` trains beside its own extraction, which it follows to the end",
}
EXTRACT_FORWARDED = {"config_path": "--config", "overrides": "--set", "store": "--store", "shards": "--shards",
                     "gpus": "--gpus"}
EXTRACT_NOT_FORWARDED = {
    "shard_index": "one node extracts every shard (--extract-gpus, one shard each)",
    "plan": "`dflash extract --plan` by itself says what an extraction takes",
}


def child_argv(command: str, flags: dict, **values) -> list[str]:
    """`python -m stages.cli COMMAND ...` with each value under its flag (`flags`: TRAIN_FORWARDED or
    EXTRACT_FORWARDED; a name it lacks is a KeyError, never a silently dropped option), in the order given:
    True -> the bare flag; a list or tuple -> the flag once per item; None or False -> left out."""
    argv = [sys.executable, "-m", "stages.cli", command]
    for name, value in values.items():
        flag = flags[name]
        if value is None or value is False:
            continue
        if value is True:
            argv.append(flag)
        elif isinstance(value, (list, tuple)):
            argv += [w for v in value for w in (flag, str(v))]
        else:
            argv += [flag, str(value)]
    return argv


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def status_line(store: str, run_dir: Path) -> str:
    """One line: extraction (its own status line), training (step, rate, ETA) and the lag between them."""
    ex = _read_json(Path(store) / "logs" / "extract-status.json")
    tr = _read_json(run_dir / "progress.json")
    parts = [ex.get("line", "extract: starting").split("  [")[0]]
    if tr.get("state") == "running" and tr.get("step") is not None:
        eta = tr.get("eta_s")
        parts.append(f"train: step {tr['step']}/{tr.get('total_steps', '?')} {tr.get('steps_per_s', 0):.2f} steps/s "
                     f"ETA {'?' if eta is None or eta != eta else f'{eta / 60:.1f} min'}")
        d = tr.get("data", {})
        if d.get("stream_epoch") and "readable_samples" in d:
            lag = d["readable_samples"] - d["global_batches_done"] * d["batch_size"]
            parts.append(f"training is {max(0, lag)} samples behind extraction"
                         + (" (waits for it)" if lag < d["batch_size"] else ""))
        elif d:
            parts.append(f"epoch {d.get('epoch')} over the finished store")
    else:
        parts.append(f"train: {tr.get('state', 'starting (waits for the first committed samples)')}")
    return " | ".join(parts)


def run_node(cfg: Config, *, config_path: Optional[str], overrides: list[str], extract_gpus: str = "",
             train_gpus: str = "", devices: Optional[int] = None, store: Optional[str] = None,
             command: str = "dflash run", expand: bool = True) -> int:
    """`dflash run`'s conductor: the plan (devices, resume, follow), the line saying it, both children under one
    supervisor with the progress view, the expanded training when extraction finished, then the last words;
    the exit code (`_report`)."""
    from stages.train import resume_argv

    say = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    plan = _plan(cfg=cfg, config_path=config_path, overrides=overrides, extract_gpus=extract_gpus,
                 train_gpus=train_gpus, devices=devices, store=store, expand=expand, say=say)
    _announce(plan=plan, say=say)
    node = _Node(plan=plan, say=say, resume_argv=resume_argv)
    end = node.start()
    if plan.expanding and not end.stops and end.codes.get("train") == ExitCode.STOPPED and node.handover.stopped():
        end = node.expand()
    elif plan.expanding and node.handover.requested_at is not None and end.codes.get("train") == 0:
        say(f"\nrun: the training was at its last step when asked, so it finished on "
            f"{where(plan.t_gpus, plan.t_cpus)} (no handover)")
    say(("\n" if node.tty else "") + status_line(plan.store_path, plan.run_dir))
    return _report(end, plan.store_path, plan.run_dir, command, say)


@dataclass
class _Plan:
    """What `run_node` decided before starting a child: where the store and the run are, the extraction's GPUs
    and shards, whether training resumes or follows, the devices it starts on and those it ends on (`all_*`)."""

    store_path: str
    run_dir: Path
    logs: Path
    xg: list[int]
    shards: int
    common: dict
    t_sets: list[str]  # the training child's --set values
    resume: bool
    complete: bool
    direct: bool  # nothing to extract: all devices train
    expanding: bool
    follow: bool
    t_gpus: list[int]
    t_cpus: int
    all_gpus: list[int]
    all_cpus: int


def _plan(*, cfg: Config, config_path: Optional[str], overrides: list[str], extract_gpus: str, train_gpus: str,
          devices: Optional[int], store: Optional[str], expand: bool, say: Callable[[str], None]) -> _Plan:
    """Check the GPU lists, create RUN/logs (clearing a killed run's handover files), read whether the store is
    complete and a checkpoint is there, and settle each stage's devices and the training's --set values (saying
    what the global batch becomes across the devices)."""
    xg, tg = _gpu_lists(extract_gpus, train_gpus)
    store_path = store or cfg.store.path
    run_dir = Path(cfg.train.run_dir)
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    clear(logs)  # a killed run's handover files: an old request must not stop this run's training
    common = dict(config_path=config_path, overrides=list(overrides), store=store_path)
    resume = (run_dir / "checkpoints" / "last.ckpt").exists()
    complete = _complete(store_path)
    shards = len(xg) or cfg.extract.shards
    all_gpus, all_cpus = union_devices(xg, tg, devices, shards)
    direct, expanding = expand and complete, expand and not complete  # direct: nothing to extract, all devices train
    t_gpus, t_cpus = (all_gpus, all_cpus) if direct else (tg, devices or 1)
    follow = _follow(run_dir, complete, resume)
    t_sets = list(overrides)
    if direct and not resume:  # the split's global batch, as an expansion keeps it
        t_sets += split_global_batch(cfg, len(tg) or devices or 1, t_gpus, t_cpus, say)
    elif expanding and not resume:
        warn_indivisible(cfg, len(tg) or devices or 1, len(all_gpus) or all_cpus, say)
    return _Plan(store_path=store_path, run_dir=run_dir, logs=logs, xg=xg, shards=shards, common=common,
                 t_sets=t_sets, resume=resume, complete=complete, direct=direct, expanding=expanding, follow=follow,
                 t_gpus=t_gpus, t_cpus=t_cpus, all_gpus=all_gpus, all_cpus=all_cpus)


def _announce(*, plan: _Plan, say: Callable[[str], None]) -> None:
    """The run's first line: where extraction and training run, resume or expansion, where the logs are."""
    p = plan
    x_where = "skipped" if p.direct else "on " + (("GPUs " + ",".join(map(str, p.xg))) if p.xg else "the CPU")
    say(f"run: extraction {x_where} -> {p.store_path}{' (already complete)' if p.complete else ''}; training on "
        f"{where(p.t_gpus, p.t_cpus)} -> {p.run_dir}{' (resuming)' if p.resume else ''}"
        f"{f', moving to {where(p.all_gpus, p.all_cpus)} when extraction finishes' if p.expanding else ''}; "
        f"logs in {p.logs}/run-*.log")


class _Node:
    """The supervision of one `dflash run`: the children (a new `Supervisor` for the relaunched training), the
    handover, and the progress view (a redrawn line on a terminal, a plain one every 15 s, with the expansion's
    note), which `on_failure` and `tick`, the supervisor's callbacks, share."""

    def __init__(self, *, plan: _Plan, say: Callable[[str], None],
                 resume_argv: Callable[[list[str]], list[str]]) -> None:
        self.plan, self.say, self.resume_argv = plan, say, resume_argv
        self.handover = Handover(plan.logs)
        self.children: Optional[Supervisor] = None
        self.tty, self.last, self.note = False, 0.0, ""

    def train_cmd(self, *, gpus: list[int], cpus: int, follow: bool, resume: bool) -> list[str]:
        """The training child's command line on `gpus` (or `cpus` CPU processes), resumed with `resume`."""
        cmd = child_argv("train", TRAIN_FORWARDED, **{**self.plan.common, "overrides": self.plan.t_sets},
                         gpus=",".join(map(str, gpus)) or None, devices=None if gpus else cpus, follow=follow)
        return self.resume_argv(cmd) if resume else cmd

    def on_failure(self, name: str, rc: int) -> None:
        """A failed extraction stops the training; a training stopped for the handover (checkpoint in place) is no
        failure."""
        if name == "extract":
            self.say(f"\nrun: extraction failed (exit {rc}); stopping the training, which cannot finish without it")
            self.children.send("train", signal.SIGINT)
        elif not (rc == ExitCode.STOPPED and self.handover.stopped() is not None):
            self.say(f"\nrun: training failed (exit {rc}); extraction goes on (Ctrl-C stops it)")

    def start(self) -> Outcome:
        """Start the extraction (unless there is nothing to extract) and the training; watch them to the end."""
        p = self.plan
        self.children = _supervisor(self.on_failure, self.say)
        if not p.direct:
            self.children.spawn("extract", child_argv("extract", EXTRACT_FORWARDED, **p.common, shards=p.shards,
                                                      gpus=",".join(map(str, p.xg)) or None),
                                log=p.logs / "run-extract.log", own_group=True)
        env = {**os.environ, ENV_DIR: str(p.logs)} if p.expanding else None
        self.children.spawn("train", self.train_cmd(gpus=p.t_gpus, cpus=p.t_cpus, follow=p.follow, resume=p.resume),
                            log=p.logs / "run-train.log", env=env, own_group=True)
        self.tty = sys.stderr.isatty()
        return self.children.watch(self.tick)

    def tick(self) -> None:
        """Ask for the handover once extraction exited 0, say the handover's line, redraw the progress line."""
        p, handover = self.plan, self.handover
        x = self.children.children.get("extract")
        if p.expanding and handover.requested_at is None and x is not None and x.proc.poll() == 0:
            handover.request()
            self.say(f"\nrun: extraction finished; training checkpoints at its next optimizer step and resumes on "
                     f"{where(p.all_gpus, p.all_cpus)} (--no-expand keeps the split)")
        said = handover.poll()
        if said:
            self.note = f"expanded to {where(p.all_gpus, p.all_cpus)} at step {handover.recorded['step']}"
            self.say("\n" + said)
        if time.time() - self.last >= (1.0 if self.tty else 15.0):
            self.last = time.time()
            line = status_line(p.store_path, p.run_dir) + (f" | {self.note}" if self.note else "")
            print(line.ljust(120 if self.tty else 0), end="\r" if self.tty else "\n", file=sys.stderr, flush=True)

    def expand(self) -> Outcome:
        """The training stopped for the handover: once its processes are gone, resume it on every device; watch it
        to the end and record the handover's figures."""
        p, handover = self.plan, self.handover
        _group_gone(self.children.children["train"].proc.pid)  # its ranks too: the new ones need their devices free
        handover.exited_at = time.time()
        hold("relaunch", p.logs)
        self.children = _supervisor(self.on_failure, self.say)
        handover.relaunched(where(p.t_gpus, p.t_cpus), where(p.all_gpus, p.all_cpus))
        self.children.spawn("train", self.train_cmd(gpus=p.all_gpus, cpus=p.all_cpus, follow=False, resume=True),
                            log=p.logs / "run-train.log", env={**os.environ, ENV_FIRST: str(p.logs / FIRST_STEP)},
                            own_group=True)
        end = self.children.watch(self.tick)
        said = handover.poll(final=True)
        self.say("\n" + said) if said else None
        return end


def _gpu_lists(extract_gpus: str, train_gpus: str) -> tuple[list[int], list[int]]:
    xg, tg = parse_gpus(extract_gpus), parse_gpus(train_gpus)
    if set(xg) & set(tg):
        raise RunError(f"GPU(s) {sorted(set(xg) & set(tg))} are in both --extract-gpus and --train-gpus")
    import torch

    if (xg or tg) and not torch.cuda.is_available():
        raise RunError("--extract-gpus/--train-gpus name GPUs, but this machine has none visible; leave both empty "
                       "to run on the CPU")
    return xg, tg


def _group_gone(pgid: int, timeout: float = 60.0) -> None:
    """Wait until no process of a child's own process group (a training and the ranks Lightning started) is left
    (zombies do not count: a container's init may never reap them); SIGKILL what is still there after `timeout` s."""
    import psutil

    def left() -> list:
        out = []
        for p in psutil.process_iter():
            try:
                if os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                    out.append(p)
            except (psutil.Error, OSError):
                pass
        return out

    deadline = time.time() + timeout
    while (procs := left()) and time.time() < deadline:
        time.sleep(0.05)
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass


def _follow(run_dir: Path, complete: bool, resume: bool) -> bool:
    """Does the training child follow the store? (RUN/logs/train-follows: this run's training began on an
    unfinished store; a resumed one keeps its checkpoint's epochs.)"""
    follows = run_dir / "logs" / "train-follows"
    follow = not complete or (not resume and follows.exists())
    if follow and not complete:
        follows.write_text("training started with --follow: a rerun before its first checkpoint follows too\n")
    return follow


def _supervisor(on_failure, say) -> Supervisor:
    """Each child in its own process group: a terminal's Ctrl-C reaches this process only, which passes it on to
    each child exactly once (and a second one, which forces them); a child's exit is a failure unless 0."""

    def on_stop(n: int, _signum: int) -> None:
        if n == 1:
            say("\nrun: stopping both stages (Ctrl-C again to force)")

    return Supervisor(signals="forward", quiet=(ExitCode.OK,), stop_codes=(ExitCode.STOPPED,), on_failure=on_failure,
                      on_stop=on_stop)


def _report(end, store_path: str, run_dir: Path, command: str, say) -> int:
    """The run's last words and exit code from the children's `Outcome`."""
    if end.failed is not None:
        log = run_dir / "logs" / f"run-{end.failed}.log"
        say(f"run: {end.failed} failed (exit {end.codes[end.failed]}): {tail(log, 3)}\n  log: {log}\n  what is done "
            f"is kept; fix the cause and rerun the same command: {command}")
        return ExitCode.FAILED
    if end.exit_code == ExitCode.STOPPED:
        say(f"run: stopped; store commits and training checkpoints are kept; continue with the same command: {command}")
        return ExitCode.STOPPED
    summary = _read_json(run_dir / "summary.json")
    tau = summary.get("val", {}).get("val/tau")
    say(f"run: done: store {store_path} complete; {summary.get('global_step', '?')} training steps, val tau "
        f"{'n/a' if tau is None else f'{tau:.3f}'}" + (f"; export {summary['export']}" if summary.get("export") else ""))
    return ExitCode.OK


def _complete(store_path: str) -> bool:
    try:
        attrs = st.read_root_attrs(store_path)
    except st.StoreError:
        return False
    return attrs is not None and all(s.done for s in st.read_all_progress(store_path))
