"""How a training run stops: Ctrl-C and SIGTERM, the second Ctrl-C, and what a stopped run exits with.

Contract:
- A stop is recorded when its signal arrives (`StopRequest`; SIGTERM through `SigtermLikeCtrlC`, which raises
  the KeyboardInterrupt Ctrl-C raises, so Lightning's tested Ctrl-C path runs), and whatever `trainer.fit`
  then raises is that stop (`stopped_by_user`), not a failure.
- `ForceOnSecondCtrlC`: a second Ctrl-C while Lightning shuts down exits at once with 130 (a rank Lightning
  started leaves after its launcher, `_exit_after_launcher`, so the job never ends with -9).
- `error_behind`: an error raised while Lightning tears down after an error the user can act on is reported as
  that error (exit 2 and its message, not the teardown's traceback).
- `end_stopped_run`: the stopped run's last words: the error a stop cut short named in one line, the ranks
  Lightning started killed, a checkpoint being written kept whole, the step the resume continues from (the last
  checkpoint's, `resume_from`) and the resume hint; then exit 130
  (`ExitCode.STOPPED`; returned by a rank Lightning started, `os._exit` in the job's own process).
Nothing here prints progress (stages/progress.py) or touches the training math.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import lightning as L

from pipeline.lifecycle import ExitCode


class StopRequest:
    """Whether this process was asked to stop (Ctrl-C or SIGTERM), recorded when the signal arrives.

    A stop's first sign is not always a KeyboardInterrupt out of `trainer.fit`: a rank blocked in a collective
    gets its KeyboardInterrupt only when the collective returns, and it returns with an error once the other rank
    left it (gloo: "Connection closed by peer"); Lightning's DDP teardown after a Ctrl-C can fail the same way; a
    loader worker killed by the same Ctrl-C surfaces as a RuntimeError. `dflash train` then exited 1 with a
    traceback instead of 130 with its resume hint (seen in CI). `install()` (main thread, before fit) makes
    Ctrl-C raise KeyboardInterrupt as Python's own handler does, after recording it; SIGTERM is recorded by
    `SigtermLikeCtrlC`. `reason` is None until a stop was asked for."""

    reason: str | None = None

    @classmethod
    def record(cls, reason: str) -> None:
        if cls.reason is None:
            cls.reason = reason

    @classmethod
    def install(cls) -> None:
        def on_ctrl_c(_signum, _frame):
            cls.record("Ctrl-C")
            raise KeyboardInterrupt

        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not when the shell ignores Ctrl-C
            signal.signal(signal.SIGINT, on_ctrl_c)


def stopped_by_user(exc: BaseException, trainer) -> bool:
    """Did `exc`, out of `trainer.fit`, end a run that Ctrl-C or SIGTERM stopped? (-> exit 130 with the resume
    hint.) Lightning's own stop is a SystemExit/KeyboardInterrupt of an interrupted trainer; any other error
    after a recorded stop request is a consequence of that stop (see `StopRequest`)."""
    if isinstance(exc, (SystemExit, KeyboardInterrupt)) and (
            getattr(trainer, "received_sigterm", False) or trainer.interrupted):
        return True
    return StopRequest.reason is not None


def error_behind(exc: BaseException) -> BaseException:
    """The error a run should report for `exc` out of `trainer.fit`: `exc` itself, unless it was raised while
    Lightning tore down after an error the user can act on (a damaged chunk, a diverged loss: UserError or
    NonFiniteLoss, found on its __context__ chain). Then that error, with the teardown's failure named in one
    line on stderr: a loader worker shut down mid-batch must not turn exit 2 and its message into a traceback."""
    from pipeline.errors import NonFiniteLoss, UserError

    seen, e = set(), exc
    while e is not None and id(e) not in seen:
        if isinstance(e, (UserError, NonFiniteLoss)):
            if e is not exc:
                first = str(exc).splitlines()[0] if str(exc) else ""
                print(f"train: {type(exc).__name__} while stopping on the error below: {first}", file=sys.stderr)
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return exc


class ForceOnSecondCtrlC(L.Callback):
    """After the first Ctrl-C Lightning sets SIGINT to *ignored* while it shuts down (and a DDP teardown can
    wait on a rank for a long time). This puts a handler back, so a second Ctrl-C exits at once with 130;
    ranks started by this process die with it (PR_SET_PDEATHSIG), checkpoints already written are kept.
    A rank that Lightning started (LOCAL_RANK > 0) leaves after its launcher instead (`_exit_after_launcher`)."""

    def __init__(self):
        self.launcher_pid = os.getppid()  # in a rank Lightning started: the launcher

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        if isinstance(exception, KeyboardInterrupt):
            if os.environ.get("LOCAL_RANK", "0") != "0":
                signal.signal(signal.SIGINT, lambda _s, _f: _exit_after_launcher(self.launcher_pid))
                return
            print(f"train: stopping after {StopRequest.reason or 'Ctrl-C'} (press Ctrl-C again to force)",
                  file=sys.stderr, flush=True)
            signal.signal(signal.SIGINT, _force_exit)


def _force_exit(_signum, _frame) -> None:
    print("train: forced stop (second Ctrl-C); checkpoints written before are kept", file=sys.stderr, flush=True)
    os._exit(ExitCode.STOPPED)


def _exit_after_launcher(launcher_pid: int, timeout: float = 60.0) -> None:
    """A second Ctrl-C in a rank the launcher started. The launcher got the same Ctrl-C: it exits with 130, or,
    if the keypress fell into Lightning's ignore window, finishes its graceful stop, which ends the ranks. A rank
    exiting first with 130 made Lightning's process observer in the launcher SIGKILL every process, the
    launcher too: the user's job ended with -9 instead of 130 (seen in CI). So wait for the launcher to go
    (at most `timeout` s), then exit."""
    try:
        deadline = time.time() + timeout
        while os.getppid() == launcher_pid and time.time() < deadline:
            time.sleep(0.05)
    finally:  # also when another signal's handler raises in here
        os._exit(ExitCode.STOPPED)


class SigtermLikeCtrlC(L.Callback):
    """SIGTERM (`kill PID`, a scheduler) stops training the way Ctrl-C does: a KeyboardInterrupt in the main
    thread, so Lightning's tested Ctrl-C path runs (SIGKILL to the ranks the launcher started, exit 130 with a
    resume hint). Lightning 2.6's own SIGTERM handler broadcasts a tensor from inside the signal handler, which
    runs wherever the signal lands: in the step's all-reduce on rank 0 while rank 1 was in the backward's, the
    collectives never matched and the job hung for good (seen in test_ops under load; stacks read with py-spy).
    It also let a following run wait for extraction forever: a flag is read only between batches."""

    def on_train_start(self, trainer, pl_module):
        import threading

        if threading.current_thread() is not threading.main_thread():
            return

        def handler(signum, _frame):
            StopRequest.record("SIGTERM")
            trainer._signal_connector.received_sigterm = True
            raise KeyboardInterrupt(f"signal {signum}")

        signal.signal(signal.SIGTERM, handler)


def resume_from(ckpt_dir, step: int, hint: str) -> str:
    """Where the resume of a run stopped at `step` continues: its last checkpoint's step (the steps after it are
    trained again), or, before the first checkpoint, that there is nothing to resume (`hint` without --resume)."""
    from pipeline.ckpt_io import load_training_checkpoint

    last = os.path.join(str(ckpt_dir), "last.ckpt")
    if not os.path.exists(last):
        return (f"no checkpoint was written before the stop, so nothing to resume; start again with: "
                f"{hint.removesuffix(' --resume')}")
    try:
        saved = int(load_training_checkpoint(last, mmap=True).get("global_step", 0))
    except Exception as e:  # noqa: BLE001  the stop's last words must not fail: the resume names the problem
        return f"its last checkpoint {last} could not be read ({type(e).__name__}); resume with: {hint}"
    again = f" (steps {saved + 1}-{step} are trained again)" if step > saved else ""
    return (f"the resume continues from step {saved}, the last checkpoint's{again}; checkpoints in {ckpt_dir} are "
            f"kept; resume with: {hint}")


def end_stopped_run(exc: BaseException, trainer, *, launcher: bool, ckpt_dir, hint: str) -> int:
    """After `stopped_by_user(exc, trainer)`: say what the stop cut short, keep the checkpoint being written, print
    the resume hint, and exit 130 (`launcher`: the job's own process leaves at once; a rank Lightning started
    returns 130 and its launcher ends it)."""
    from stages.train_ckpt_io import wait_for_checkpoints

    if not isinstance(exc, (SystemExit, KeyboardInterrupt)):  # a collective or loader the stop cut short
        print(f"train: {type(exc).__name__} while stopping after {StopRequest.reason} (a consequence of the "
              f"stop): {str(exc).splitlines()[0] if str(exc) else ''}", file=sys.stderr)
        starter = getattr(trainer.strategy, "launcher", None)  # Lightning's, which started the other ranks
        if hasattr(starter, "kill"):
            starter.kill(signal.SIGKILL)  # the ranks it started, as Lightning's own Ctrl-C path does
    try:
        wait_for_checkpoints(trainer)  # a checkpoint being written when the stop came is kept whole
    except Exception as w:  # noqa: BLE001  its temporary file is gone; the previous checkpoint is kept
        print(f"train: the checkpoint being written when the run stopped failed: {w}", file=sys.stderr)
    print(f"train: stopped at step {trainer.global_step}; {resume_from(ckpt_dir, trainer.global_step, hint)}",
          file=sys.stderr)
    if not launcher:  # a rank Lightning started: the launcher ends it (a rank leaving first had every
        return ExitCode.STOPPED  # process SIGKILLed by the launcher's observer: -9)
    # the job's process: the stop is complete and nothing is left to write, so leave now. Python's
    # finalisation puts SIGINT back to its default, and a second Ctrl-C landing in it ended the job with -2
    # instead of 130 (CI)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(ExitCode.STOPPED)
