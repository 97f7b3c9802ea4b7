"""Multi-node training (issue 32) on one machine: each "node" is a `dflash train` process started as SLURM's srun,
torchrun or the plain MASTER_ADDR/MASTER_PORT/NODE_RANK variables would start it, with its own node rank and
one CPU rank, over gloo on 127.0.0.1 (a free port found by binding port 0).

- `--num-nodes 2 --devices 1` ends with weights bit-identical to `--devices 2` on one node (same seed; every
  process runs one OpenMP thread, so the CPU reductions are the same);
- kill -9 one node mid-run: the other leaves at once with exit 1 and the resume hint, and a resume on one node
  (`--devices 2`) continues from the last checkpoint to the same weights as the uninterrupted run;
- a node that cannot reach the master fails within the rendezvous timeout with one error line;
- the start-up check's comparison and the reading of each launcher's variables (unit tests, no processes).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from helpers_cli import HANG_S, TINY, must_pass, selected, start

ROOT = Path(__file__).resolve().parent.parent
LAUNCH_VARS = ("RANK", "LOCAL_RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE", "WORLD_SIZE", "NODE_RANK", "MASTER_ADDR",
               "MASTER_PORT")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra) -> dict:
    """The test's environment without any launcher's variables, GPUs hidden, one thread per process."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS and not k.startswith(("SLURM_", "TORCHELASTIC"))}
    return {**env, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", **{k: str(v) for k, v in extra.items()}}


def node_env(how: str, node: int, nodes: int, port: int) -> dict:
    """The variables each launcher gives the one rank of node `node` (one rank per node)."""
    master = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    if how == "torchrun":  # torchrun --nnodes N --nproc-per-node 1 --node-rank i
        return _env(**master, RANK=node, LOCAL_RANK=0, GROUP_RANK=node, LOCAL_WORLD_SIZE=1, WORLD_SIZE=nodes,
                    TORCHELASTIC_RUN_ID="test")
    if how == "slurm":  # srun --nodes N --ntasks-per-node 1 (MASTER_ADDR would default to the first node)
        return _env(**master, SLURM_NTASKS=nodes, SLURM_NTASKS_PER_NODE=1, SLURM_NNODES=nodes, SLURM_PROCID=node,
                    SLURM_LOCALID=0, SLURM_NODEID=node, SLURM_JOB_NAME="dflash-test", SLURM_JOB_ID="4242")
    return _env(**master, NODE_RANK=node)  # plain: dflash train started once per node


def _args(store: str, run: Path, *extra) -> list[str]:
    return ["train", "--config", TINY, "--store", store, "--set", f"train.run_dir={run}", "--set", "train.num_workers=0",
            "--set", "train.epochs=1", "--set", "train.checkpoint_every=2", "--set", "train.val_every=4",
            "--set", "train.log_every=1", "--set", "train.rendezvous_timeout_s=600", "--no-export", *extra]


def _start(args, env) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "stages.cli", *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _two_nodes(how: str, store: str, run: Path, *extra) -> list[subprocess.Popen]:
    port = free_port()
    return [_start(_args(store, run, "--num-nodes", "2", "--devices", "1", *extra), node_env(how, n, 2, port))
            for n in range(2)]


def _finish(procs) -> list[tuple[int, str]]:
    out = [p.communicate(timeout=HANG_S)[0] for p in procs]
    return [(p.returncode, o) for p, o in zip(procs, out)]


def _weights(run: Path) -> dict:
    return torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)


def _assert_same_weights(a: dict, b: dict, what: str) -> None:
    assert a["global_step"] == b["global_step"], (what, a["global_step"], b["global_step"])
    for k, v in a["state_dict"].items():
        assert torch.equal(v, b["state_dict"][k]), f"{what}: {k} differs"
    for sa, sb in zip(a["optimizer_states"][0]["state"].values(), b["optimizer_states"][0]["state"].values()):
        assert all(torch.equal(sa[n], sb[n]) for n in sa), what


@pytest.fixture(scope="module")
def one_node(tiny_store, tmp_path_factory):
    """The reference: `dflash train --devices 2` on one node, started in the background at the first test that
    needs it, so that test's own nodes run beside it; calling it waits for it (exit 0) and gives its run dir."""
    run = tmp_path_factory.mktemp("one-node") / "run"
    ref, done = start([sys.executable, "-m", "stages.cli", *_args(tiny_store, run, "--devices", "2")], _env()), []

    def finished() -> Path:
        if not done:
            done.append(must_pass(ref.result()))
        return run
    yield finished
    finished()  # (not left running past the module)


@pytest.mark.slow
def test_two_nodes_train_the_same_weights_as_one_node_of_two_ranks(tiny_store, one_node, tmp_path):
    run = tmp_path / "run"
    results = _finish(_two_nodes("torchrun", tiny_store, run))
    for n, (rc, out) in enumerate(results):
        assert rc == 0, f"node {n} exited {rc}\n{out[-3000:]}"
    ref = _weights(one_node())
    assert ref["global_step"] > 2
    _assert_same_weights(ref, _weights(run), "2 nodes x 1 rank vs 1 node x 2 ranks")
    assert "train: step" in results[0][1] and "train: step" not in results[1][1]  # only global rank 0 reports
    assert sorted(p.name for p in (run / "logs").glob("rank*.log")) == ["rank0.log", "rank1.log"]  # global ranks
    nodes = (run / "logs" / "nodes.json").read_text()
    assert '"env": "torchrun"' in nodes and '"node": 1' in nodes


@pytest.mark.slow
def test_a_killed_node_stops_the_other_with_the_resume_hint_and_one_node_resumes(tiny_store, one_node, tmp_path):
    run = tmp_path / "run"
    procs = _two_nodes("slurm", tiny_store, run)
    deadline = time.time() + HANG_S  # a hang guard only
    while time.time() < deadline and all(p.poll() is None for p in procs):
        # the first step file: killed at once, node 0 may still be in the save's barrier, before Lightning links
        # last.ckpt to it (the survivor then links it: stages/train.py link_newest_step)
        if list((run / "checkpoints").glob("step*.ckpt")):
            break
        time.sleep(0.05)
    assert all(p.poll() is None for p in procs), _finish(procs)
    procs[1].send_signal(signal.SIGKILL)  # node 1 dies mid-run (a checkpoint exists, the epoch is not over)
    killed = time.time()
    out0 = procs[0].communicate(timeout=HANG_S)[0]
    waited = time.time() - killed
    procs[1].wait()
    assert procs[1].returncode == -signal.SIGKILL
    # bounded: far inside the collective timeout (30 min by default) that a hang would have run into
    assert procs[0].returncode == 1 and waited < 300, (procs[0].returncode, waited, out0[-3000:])
    assert "lost contact with another rank" in out0 and "resume (on any number of nodes) with:" in out0, out0[-3000:]
    hint = out0.rsplit("with: ", 1)[1].splitlines()[0]
    assert hint.startswith("dflash train ") and hint.endswith("--resume"), hint
    step = _weights(run)["global_step"]
    assert 2 <= step < _weights(one_node())["global_step"]
    r = subprocess.run([sys.executable, "-m", "stages.cli", *_args(tiny_store, run, "--devices", "2", "--resume")],
                       cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=HANG_S)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"train: step {step + 1}/" in r.stderr  # continued from the last checkpoint
    _assert_same_weights(_weights(one_node()), _weights(run), f"killed after step {step}, resumed on one node")


LONE_TEST = "test_a_node_that_cannot_reach_the_master_fails_within_the_rendezvous_timeout"


def _start_lone_node(store: str, tmp: Path) -> tuple:
    """Node 1 of 2 whose master never comes, in the background: (its port, the held socket, its run dir, the
    process). The port is bound here and never listened on: a connection is refused as if nobody were there,
    and no other process (the other tests' nodes) can take the port meanwhile."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port, run = sock.getsockname()[1], tmp / "run"
    args = _args(store, run, "--num-nodes", "2", "--devices", "1", "--set", "train.rendezvous_timeout_s=5")
    return port, sock, run, start([sys.executable, "-m", "stages.cli", *args], node_env("plain", 1, 2, port))


@pytest.fixture(scope="module", autouse=True)
def lone_node(request, tmp_path_factory):
    """_start_lone_node's node, started at this module's first test when the session runs its test: it mostly
    waits (its imports, then the rendezvous timeout), beside the other tests' runs; None otherwise."""
    if not selected(request, LONE_TEST):
        yield None
        return
    lone = _start_lone_node(request.getfixturevalue("tiny_store"), tmp_path_factory.mktemp("lone-node"))
    yield lone
    lone[3].result()  # (not left running past the module)
    lone[1].close()


@pytest.mark.slow
def test_a_node_that_cannot_reach_the_master_fails_within_the_rendezvous_timeout(tiny_store, lone_node, tmp_path):
    port, sock, run, p = lone_node or _start_lone_node(tiny_store, tmp_path)  # nobody listens: node 0 never came
    r = p.result()
    sock.close()
    out = r.stdout + r.stderr
    assert r.returncode == 2, out[-3000:]
    line = [ln for ln in out.splitlines() if ln.startswith("error:")]
    assert line and f"did not all join the process group at 127.0.0.1:{port} within train.rendezvous_timeout_s=5 s" \
        in line[0] and "nothing was trained" in line[0], out[-3000:]
    assert not (run / "checkpoints").exists()


@pytest.mark.slow
def test_nodes_with_different_configs_stop_before_training_with_one_error(tiny_store, tmp_path):
    run, port = tmp_path / "run", free_port()
    procs = [_start(_args(tiny_store, run, "--num-nodes", "2", "--devices", "1", "--set", f"train.lr={lr}"),
                    node_env("plain", n, 2, port)) for n, lr in enumerate(("6e-4", "3e-4"))]
    for n, (rc, out) in enumerate(_finish(procs)):
        errors = [ln for ln in out.splitlines() if ln.startswith("error:")]
        assert rc == 2 and errors == ["error: the nodes of this job do not agree, nothing was trained:"], (n, out[-3000:])
        assert "  the config (the same --config and --set on every node): rank 1 on " in out, out[-3000:]
    assert not (run / "checkpoints").exists()


# -- no processes ------------------------------------------------------------------------------------------------

def _lightning_env(env: dict):
    """The cluster environment Lightning picks for these variables, as its accelerator connector does."""
    from lightning.fabric.plugins.environments import LightningEnvironment, SLURMEnvironment, TorchElasticEnvironment

    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        for cls in (TorchElasticEnvironment, SLURMEnvironment):
            if cls.detect():
                e = cls()
                return e.global_rank(), e.local_rank(), e.node_rank(), e.creates_processes_externally
        e = LightningEnvironment()
        return None, e.local_rank(), e.node_rank(), e.creates_processes_externally
    finally:
        os.environ.clear()
        os.environ.update(saved)


@pytest.mark.parametrize("how", ["torchrun", "slurm", "plain"])
@pytest.mark.parametrize("node", [0, 1, 2])
def test_topology_reads_each_launcher_as_lightning_does(how, node):
    from stages.train_nodes import Topology

    env = {k: str(v) for k, v in node_env(how, node, 3, 1234).items() if k in LAUNCH_VARS or k.startswith("SLURM_")}
    top = Topology.detect(3, 1, env)
    rank, local, node_rank, external = _lightning_env(env)
    assert (top.rank, top.local, top.node, top.world) == (node, 0, node, 3)
    assert (local, node_rank, external) == (top.local, top.node, top.external)
    assert rank in (None, top.rank)  # (Lightning's own environment computes the global rank in the strategy)


def test_topology_refuses_a_world_that_is_not_nodes_times_ranks():
    from stages.train_nodes import NodesError, Topology

    env = {k: str(v) for k, v in node_env("torchrun", 0, 4, 1234).items() if k in LAUNCH_VARS}
    with pytest.raises(NodesError, match=r"--num-nodes 2 x 1 .* = 2 rank\(s\), but torchrun started WORLD_SIZE=4"):
        Topology.detect(2, 1, env)
    slurm = {k: str(v) for k, v in node_env("slurm", 0, 2, 1234).items() if k.startswith("SLURM_")}
    with pytest.raises(NodesError, match="SLURM started 2 task"):
        Topology.detect(1, 4, slurm)
    with pytest.raises(NodesError, match="needs MASTER_ADDR, MASTER_PORT and NODE_RANK.*NODE_RANK not set"):
        Topology.detect(2, 1, {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"})
    with pytest.raises(NodesError, match="node 2 .* node ranks are 0..1"):
        Topology.detect(2, 1, {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "NODE_RANK": "2"})
    assert Topology.detect(1, 2, {}).world == 2  # one node, no variables: Lightning starts the ranks


def test_start_up_check_names_the_ranks_that_differ():
    from stages.train_nodes import _differences

    def rank(r, host, **digests):
        d = {"config": "c", "store": "s", "plan": "p", "resume": "r", **digests}
        return {"rank": r, "host": host, "shape": [2, 1, 2], "world": 2, "digests": d}

    assert _differences([rank(0, "a"), rank(1, "b")]) == []
    (msg,) = _differences([rank(0, "a"), rank(1, "b", store="other")])
    assert msg.startswith("the store (its provenance") and "rank 1 on b differ(s) from rank 0 on a" in msg
    (msg,) = _differences([rank(0, "a"), rank(1, "b", config="x")])
    assert msg.startswith("the config") and "rank 1 on b" in msg
    odd = rank(1, "b")
    odd["shape"] = [2, 2, 4]
    assert _differences([rank(0, "a"), odd])[0].startswith("the world size: rank 0 on a has --num-nodes 2 x 1")


def test_projection_counts_the_inter_node_all_reduce():
    """bench/multinode_projection.py (the README's table): a ring all-reduce of 6.9 GB at 400 Gbit/s per GPU."""
    from bench.multinode_projection import project

    one, two = project(1, 8, 1.2e9, 6, 400), project(2, 8, 1.2e9, 6, 400)
    assert two["allreduce_ms"] == pytest.approx(2 * 15 / 16 * 6.9e9 / 50e9 * 1000)
    assert one["scaling"] == 0.91 and one["extract_h"] == pytest.approx(1.2e9 / (8977 * 8) / 3600)
    assert two["extract_h"] == pytest.approx(one["extract_h"] / 2)
    assert two["train_h"] == pytest.approx(1.2e9 * 6 / (12245 * 16 * two["scaling"]) / 3600)
    assert 0.5 < two["scaling"] < one["scaling"]


def test_last_ckpt_is_pointed_at_the_newest_complete_step_file(tmp_path):
    """A node lost during rank 0's save: the step file is complete but Lightning's link (after the save's
    barrier) never came; the survivor links it, atomically, and never replaces a real final checkpoint."""
    from stages.train_nodes import link_newest_step

    ck = tmp_path / "checkpoints"
    ck.mkdir()
    assert link_newest_step(ck) is None and not (ck / "last.ckpt").exists()
    (ck / "step2.ckpt").write_text("2")
    assert link_newest_step(ck) == ck / "step2.ckpt" and (ck / "last.ckpt").read_text() == "2"  # none before
    (ck / "step10.ckpt").write_text("10")  # numeric order, not text order
    assert link_newest_step(ck) == ck / "step10.ckpt" and (ck / "last.ckpt").read_text() == "10"
    assert link_newest_step(ck) is None and os.readlink(ck / "last.ckpt") == "step10.ckpt"
    (ck / "last.ckpt").unlink()
    (ck / "last.ckpt").write_text("final")  # save_final's full file
    (ck / "step12.ckpt").write_text("12")
    assert link_newest_step(ck) is None and (ck / "last.ckpt").read_text() == "final"
    assert [f.name for f in ck.iterdir() if f.name.startswith(".")] == []
