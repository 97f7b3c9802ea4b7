"""Multi-node training (issue 32): where this process sits in the job, and the start-up check of every rank.

Contract:
- Lightning's own multi-node DDP does the work (no launcher of ours): `dflash train --num-nodes N` (or
  `train.num_nodes`) passes `num_nodes` to the Trainer; `--gpus`/`--devices` are the ranks *per node*.
- `Topology.detect` says which rank this process is, from the variables of the environment Lightning itself
  picks, in Lightning's order (`lightning.pytorch.trainer.connectors.accelerator_connector`): torchrun
  (RANK, GROUP_RANK, LOCAL_RANK, LOCAL_WORLD_SIZE, WORLD_SIZE), SLURM's srun (SLURM_NTASKS and SLURM_PROCID,
  SLURM_LOCALID, SLURM_NODEID, unless the job is named bash/interactive), else Lightning's plain variables
  (NODE_RANK with MASTER_ADDR/MASTER_PORT, `dflash train` started once per node; LOCAL_RANK in the ranks
  Lightning's launcher started). It imports nothing heavy (it runs before the store is opened). A world size
  the environment states that is not nodes x ranks per node, a node rank out of range, or a multi-node job of
  plain variables without MASTER_ADDR/MASTER_PORT/NODE_RANK is a `TrainError` before any work.
- `NodesCheck` (a callback; its `setup` is Lightning's first hook after the process group formed): every rank
  all-gathers its host, topology and digests of its config, its store (provenance; the committed progress of a
  finished store), its data plan and the checkpoint it resumes from; global rank 0 then writes
  RUN/logs/nodes.json, and every rank says whether it sees that file with rank 0's token (the run directory
  is shared). Any difference stops every rank with one error naming the ranks, hosts and what differs. The
  group forms under `train.rendezvous_timeout_s` (a node that cannot reach the master, or that never comes,
  fails within it); after the check its timeout becomes `train.collective_timeout_s`.
- `lost_peer(exc)`: whether `fit` ended because another rank went away (a killed node: gloo's closed
  connection, NCCL's watchdog timeout or remote error); `exit_lost_peer` then leaves with exit 1 and the
  resume hint, after rank 0 pointed last.ckpt at the newest complete step checkpoint (`link_newest_step`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import signal
import socket
import sys
import uuid
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Optional

from pipeline import store as st
from pipeline.errors import UserError


class NodesError(UserError, RuntimeError):
    pass


@dataclass(frozen=True)
class Topology:
    num_nodes: int
    per_node: int  # ranks per node: --gpus entries or --devices
    node: int
    local: int
    rank: int  # global rank
    env: str  # torchrun | slurm | lightning
    external: bool  # the environment started every rank (torchrun, srun, a user's own launcher)

    @property
    def world(self) -> int:
        return self.num_nodes * self.per_node

    @property
    def where(self) -> str:
        return f"rank {self.rank} (node {self.node}, local rank {self.local}) on {socket.gethostname()}"

    @classmethod
    def detect(cls, num_nodes: int, per_node: int, env: Optional[dict] = None) -> "Topology":
        e = os.environ if env is None else env
        world = num_nodes * per_node
        shape = f"--num-nodes {num_nodes} x {per_node} rank(s) per node (--gpus/--devices) = {world} rank(s)"

        def num(key: str) -> int:
            try:
                return int(e[key])
            except ValueError:
                raise NodesError(f"{key}={e[key]!r} is not an integer (set by the launcher of this process)") from None

        def require(stated: int, what: str) -> None:
            if stated != world:
                raise NodesError(f"{shape}, but {what}: start every node with the same --num-nodes and "
                                 f"--gpus/--devices as the job has ranks")

        port = e.get("MASTER_PORT")
        if port is not None and not (port.strip().isdigit() and 1 <= int(port) <= 65535):  # before anything is made
            raise NodesError(f"MASTER_PORT={port!r} is not a TCP port: set it to a free port in 1..65535 (node 0's, "
                             "the same on every node), or unset it for a one-node run")
        if all(k in e for k in ("RANK", "GROUP_RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")):  # torchrun
            if num("LOCAL_WORLD_SIZE") != per_node:
                raise NodesError(f"torchrun --nproc-per-node {num('LOCAL_WORLD_SIZE')} but dflash train has {per_node} "
                                 "rank(s) per node (--gpus/--devices): give both the same number")
            require(num("WORLD_SIZE") if "WORLD_SIZE" in e else -1, f"torchrun started WORLD_SIZE={e.get('WORLD_SIZE')}")
            top = cls(num_nodes, per_node, num("GROUP_RANK"), num("LOCAL_RANK"), num("RANK"), "torchrun", True)
        elif "SLURM_NTASKS" in e and e.get("SLURM_JOB_NAME") not in ("bash", "interactive"):  # srun
            require(num("SLURM_NTASKS"), f"SLURM started {e['SLURM_NTASKS']} task(s) (SLURM_NTASKS; one task per rank: "
                    "--ntasks-per-node = ranks per node; or, to have Lightning start this node's ranks itself "
                    "inside an allocation, run without srun as SLURM_JOB_NAME=interactive dflash train ...)")
            if "SLURM_NNODES" in e and num("SLURM_NNODES") != num_nodes:
                raise NodesError(f"{shape}, but the SLURM job has {e['SLURM_NNODES']} node(s) (SLURM_NNODES): pass "
                                 f"--num-nodes {e['SLURM_NNODES']}")
            top = cls(num_nodes, per_node, num("SLURM_NODEID") if "SLURM_NODEID" in e else 0,
                      num("SLURM_LOCALID") if "SLURM_LOCALID" in e else 0, num("SLURM_PROCID"), "slurm", True)
        else:  # Lightning's environment: NODE_RANK per node; LOCAL_RANK in the ranks Lightning's launcher started
            missing = [k for k in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK") if k not in e]
            if num_nodes > 1 and missing:
                raise NodesError(f"--num-nodes {num_nodes} outside SLURM and torchrun needs MASTER_ADDR, MASTER_PORT "
                                 f"and NODE_RANK on every node ({', '.join(missing)} not set): MASTER_ADDR:MASTER_PORT "
                                 "is node 0's address and a free port, NODE_RANK this node's index 0..N-1")
            node = num("NODE_RANK") if "NODE_RANK" in e else num("GROUP_RANK") if "GROUP_RANK" in e else 0
            local = num("LOCAL_RANK") if "LOCAL_RANK" in e else 0
            if "WORLD_SIZE" in e:
                require(num("WORLD_SIZE"), f"WORLD_SIZE={e['WORLD_SIZE']} is set")
            top = cls(num_nodes, per_node, node, local, node * per_node + local, "lightning", "LOCAL_RANK" in e)
        if not 0 <= top.node < num_nodes:
            raise NodesError(f"this process is node {top.node} (NODE_RANK/GROUP_RANK/SLURM_NODEID) of a job of "
                             f"--num-nodes {num_nodes}: node ranks are 0..{num_nodes - 1}")
        if not 0 <= top.local < per_node or not 0 <= top.rank < world:
            raise NodesError(f"{shape}, but this process is local rank {top.local}, global rank {top.rank} "
                             f"({top.env}): start every node with the same --num-nodes and --gpus/--devices")
        return top


def store_facts(store_path: str, attrs: dict, reader) -> dict:
    """What every node must see alike of the store: its provenance, and a finished store's commit records."""
    from data.follow import GrowingStore

    if isinstance(reader, GrowingStore):  # still growing: the commits differ by the moment each node looked
        return {"provenance": st.digest(attrs)}
    return {"provenance": st.digest(attrs),
            "progress": [dataclasses.asdict(s.progress or st.Progress()) for s in st.read_all_progress(store_path)]}


def link_newest_step(ckpt_dir: Path) -> Optional[Path]:
    """Point last.ckpt at the newest complete step checkpoint when it points at an older one or is missing.

    A node lost while rank 0 saved a checkpoint leaves the step file complete (written to a temporary file and
    renamed) but the link not made: Lightning links after the barrier that follows the save, which fails. The
    resume would start from the checkpoint before it, or find no last.ckpt at all after the first one."""
    steps = [(int(f.stem[4:]), f) for f in ckpt_dir.glob("step*.ckpt") if f.stem[4:].isdigit()]
    if not steps:
        return None
    step, newest = max(steps)
    last = ckpt_dir / "last.ckpt"
    if last.exists() and not last.is_symlink():
        return None  # a full final checkpoint (save_final): never replaced by a link
    if last.is_symlink() and last.resolve() == newest.resolve():
        return None
    tmp = ckpt_dir / f".last.ckpt.{os.getpid()}"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(newest.name)
    os.replace(tmp, last)  # atomic: last.ckpt is never missing
    return newest


def exit_lost_peer(e: BaseException, trainer, top: Topology, ckpt_dir: Path, hint: str) -> None:
    """Another rank went away mid-run (a killed or failed node): say so with the resume hint and leave at once
    (exit 1), ending the ranks Lightning started here; the checkpoints written so far are kept, and last.ckpt
    made to point at the newest of them (`link_newest_step`)."""
    starter = getattr(trainer.strategy, "launcher", None)
    if hasattr(starter, "kill"):  # (a rank Lightning started has none of its own)
        starter.kill(signal.SIGKILL)
    if top.rank == 0:
        linked = link_newest_step(ckpt_dir)
        if linked is not None:
            print(f"train: {ckpt_dir / 'last.ckpt'} now points at {linked.name}, the newest complete checkpoint "
                  "(its link was not made: the save's barrier failed)", file=sys.stderr)
    first = (str(e).strip().splitlines() or [""])[0][:300]
    print(f"train: {top.where} lost contact with another rank ({type(e).__name__}: {first}); a node failed or "
          f"was stopped. Stopped at step {trainer.global_step}; checkpoints in {ckpt_dir} are kept; resume (on "
          f"any number of nodes) with: {hint}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)  # not Python's finalisation: destroying a process group with a dead peer can wait on it


def digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def nodes_check(top: Topology, facts: dict, run_dir: Path, collective_s: float):
    """The start-up check as a Lightning callback; `.passed` once every rank agreed. `facts`: name -> a JSON-able
    value that every rank must agree on (config, store, data plan, resume checkpoint), compared by digest."""
    import lightning as L

    class NodesCheck(L.Callback):
        passed = False

        def setup(self, trainer, pl_module, stage: str) -> None:
            import torch.distributed as dist

            if not (dist.is_available() and dist.is_initialized()):
                self.passed = True
                return
            mine = {"rank": top.rank, "node": top.node, "local": top.local, "host": socket.gethostname(),
                    "pid": os.getpid(), "env": top.env, "shape": [top.num_nodes, top.per_node, top.world],
                    "world": dist.get_world_size(), "digests": {k: digest(v) for k, v in facts.items()},
                    "token": uuid.uuid4().hex if top.rank == 0 else None}
            every: list = [None] * dist.get_world_size()
            dist.all_gather_object(every, mine)
            problems = _differences(every)
            if not problems and top.rank == 0:  # a shared run directory: every rank must see this file
                path = run_dir / "logs" / "nodes.json"
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_name(f".nodes.json.{os.getpid()}")
                tmp.write_text(json.dumps({"token": mine["token"], "ranks": every}, indent=1))
                tmp.replace(path)
            dist.barrier()  # written before anyone looks
            seen: list = [None] * dist.get_world_size()
            dist.all_gather_object(seen, None if problems else _sees_token(run_dir, every[0]["token"]))
            if not problems:
                blind = [every[r] for r, ok in enumerate(seen) if not ok]
                if blind:
                    problems.append(f"the run directory {run_dir} is not shared: {_names(blind)} cannot see "
                                    f"{run_dir / 'logs' / 'nodes.json'} that rank 0 on {every[0]['host']} wrote; put "
                                    "train.run_dir (and the store) on storage every node mounts at the same path")
            if problems:
                raise NodesError("the nodes of this job do not agree, nothing was trained:\n  " + "\n  ".join(problems))
            dist.distributed_c10d._set_pg_timeout(timedelta(seconds=collective_s))  # the rendezvous' was short
            self.passed = True

    return NodesCheck()


def rendezvous_error(top: Topology, exc: BaseException, timeout_s: float) -> NodesError:
    """The one line for a process group that did not form (a node that cannot reach the master, or never came)."""
    addr = f"{os.environ.get('MASTER_ADDR', '127.0.0.1')}:{os.environ.get('MASTER_PORT', '?')}"
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
    return NodesError(f"{top.where}: the {top.world} ranks of --num-nodes {top.num_nodes} x {top.per_node} did not all "
                      f"join the process group at {addr} within train.rendezvous_timeout_s={timeout_s:g} s "
                      f"({type(exc).__name__}: {first}). Start `dflash train` on every node with the same "
                      "--num-nodes and --gpus/--devices, check that MASTER_ADDR is node 0's address reachable "
                      "from every node and MASTER_PORT free there; nothing was trained")


def _sees_token(run_dir: Path, token: str) -> bool:
    try:
        return json.loads((run_dir / "logs" / "nodes.json").read_text()).get("token") == token
    except (OSError, ValueError):
        return False


def _names(ranks: list[dict]) -> str:
    return ", ".join(f"rank {r['rank']} on {r['host']}" for r in ranks)


WHAT = {"config": "the config (the same --config and --set on every node)",
        "store": "the store (its provenance and committed progress: the same --store, on shared storage)",
        "plan": "the data plan (follow or not, batches per epoch: a store that was still being written when the nodes "
                "started; start them again)",
        "resume": "the checkpoint it resumes from (RUN/checkpoints/last.ckpt on shared storage)"}


def _differences(every: list[dict]) -> list[str]:
    ref = every[0]
    out = []
    shapes = {tuple(r["shape"]) for r in every}
    if len(shapes) > 1 or ref["shape"][2] != ref["world"]:
        out.append("the world size: " + "; ".join(f"rank {r['rank']} on {r['host']} has --num-nodes {r['shape'][0]} x "
                                                   f"{r['shape'][1]} per node" for r in every)
                   + f"; the process group has {ref['world']} ranks")
    for key in ref["digests"]:
        odd = [r for r in every if r["digests"].get(key) != ref["digests"][key]]
        if odd:
            out.append(f"{WHAT.get(key, key)}: {_names(odd)} differ(s) from rank 0 on {ref['host']}")
    ranks = sorted(r["rank"] for r in every)
    if ranks != list(range(len(every))):
        out.append(f"global ranks {ranks} are not 0..{len(every) - 1}: a rank started twice")
    return out


DIST_SIGNS = ("connection closed by peer", "connection reset by peer", "broken pipe", "connection refused",
              "timed out", "timeout", "watchdog", "nccl communicator was aborted", "remote process exited",
              "ncclremoteerror", "socket", "gloo")


def lost_peer(exc: BaseException) -> bool:
    """Did `fit` end because another rank went away (or never came)? torch's distributed errors, or a gloo/NCCL
    RuntimeError naming a closed connection or a timeout, anywhere in the exception's chain."""
    try:
        from torch.distributed import DistError
    except ImportError:  # pragma: no cover
        DistError = ()  # noqa: N806
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, DistError):
            return True
        if isinstance(exc, RuntimeError) and not isinstance(exc, UserError):
            text = str(exc).lower()
            if any(s in text for s in DIST_SIGNS):
                return True
        exc = exc.__cause__ or exc.__context__
    return False
