"""Workers started by mpirun (Open MPI, Hydra) or srun read their place in the job from the
launcher's variables (distributed/launchers.py): unit tests of the mapping, and two processes
started by hand with Open MPI's (or srun's) variables, which train to the same losses as
`--devices 2`."""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from hputrain.distributed.launchers import adopt_launcher_env, first_host
from hputrain.errors import InputError

ROOT = Path(__file__).parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "HPUTRAIN_CONFIG_FILE": "/nonexistent/hputrain.json",
       "OMP_NUM_THREADS": "1"}


def ompi(rank, size, local_rank, local_size, **more):
    return {"OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": str(size),
            "OMPI_COMM_WORLD_LOCAL_RANK": str(local_rank),
            "OMPI_COMM_WORLD_LOCAL_SIZE": str(local_size), "OMP_NUM_THREADS": "1", **more}


def srun(rank, size, local_rank, node, tasks_per_node, nodelist="gaudi[07-09]", **more):
    return {"SLURM_PROCID": str(rank), "SLURM_STEP_NUM_TASKS": str(size), "SLURM_LOCALID": str(local_rank),
            "SLURM_NODEID": str(node), "SLURM_STEP_TASKS_PER_NODE": tasks_per_node,
            "SLURM_STEP_NODELIST": nodelist, "SLURM_JOB_ID": "123456", "OMP_NUM_THREADS": "1", **more}


def test_open_mpi_on_one_node_becomes_torchrun_names():
    env = ompi(3, 4, 3, 4)
    assert adopt_launcher_env(4, 1, env) == "mpirun (Open MPI)"
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == ("3", "4", "3", "4")
    assert (env["NODE_RANK"], env["MASTER_ADDR"], env["MASTER_PORT"]) == ("0", "127.0.0.1", "29500")


def test_open_mpi_across_nodes_needs_master_addr_and_takes_node_from_rank():
    with pytest.raises(InputError, match="MASTER_ADDR is not set.*mpirun -x MASTER_ADDR"):
        adopt_launcher_env(8, 2, ompi(9, 16, 1, 8))
    env = ompi(9, 16, 1, 8, MASTER_ADDR="10.0.0.1", MASTER_PORT="12345")
    adopt_launcher_env(8, 2, env)
    assert (env["RANK"], env["LOCAL_RANK"], env["NODE_RANK"]) == ("9", "1", "1")
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("10.0.0.1", "12345")  # the user's win


def placements(nodes: int, per_node: int, round_robin: bool) -> list[tuple[int, int, int]]:
    """(rank, local rank, node) of every process, as mpirun places them: in blocks (--map-by slot)
    or round-robin over the nodes (--map-by node); local ranks in rank order on each node."""
    size = nodes * per_node
    node_of = [r % nodes if round_robin else r // per_node for r in range(size)]
    return [(r, node_of[:r].count(node_of[r]), node_of[r]) for r in range(size)]


@pytest.mark.parametrize("round_robin", [False, True], ids=["blocks", "round-robin"])
@pytest.mark.parametrize("nodes, per_node", [(2, 2), (3, 2), (2, 4), (4, 3)])
def test_mpi_node_rank_is_right_or_unset_in_blocks_and_round_robin(nodes, per_node, round_robin):
    """Issue 39 item 12: NODE_RANK was rank // local size, wrong for ranks placed round-robin
    (mpirun --map-by node): rank 1 is on node 1. Now every NODE_RANK set is the process's node,
    under Open MPI's and Hydra's variables, and it is left unset only where both placements fit
    the variables and disagree."""
    size, unset = nodes * per_node, 0
    for rank, local, node in placements(nodes, per_node, round_robin):
        for env in (ompi(rank, size, local, per_node, MASTER_ADDR="10.0.0.1"),
                    {"PMI_RANK": str(rank), "PMI_SIZE": str(size), "MPI_LOCALRANKID": str(local),
                     "MPI_LOCALNRANKS": str(per_node), "OMP_NUM_THREADS": "1", "MASTER_ADDR": "h"}):
            adopt_launcher_env(environ=env)
            assert env.get("NODE_RANK", str(node)) == str(node), (rank, local, env.get("NODE_RANK"))
            assert env["LOCAL_RANK"] == str(local)
            unset += "NODE_RANK" not in env
    assert unset < size  # most ranks are decided (rank 0 and 1 always)
    if round_robin:  # rank 1: local rank 0 of node 1, where blocks would say local rank 1 of node 0
        env = ompi(1, size, 0, per_node, MASTER_ADDR="10.0.0.1")
        adopt_launcher_env(environ=env)
        assert env["NODE_RANK"] == "1"


def test_hybrid_shard_refuses_ranks_not_placed_in_blocks(monkeypatch):
    """hybrid_shard's node groups are blocks of consecutive ranks: round-robin ranks would shard
    across nodes. Rank 1 of a round-robin placement (local rank 0) says so in one line; in blocks
    it passes."""
    from hputrain import TrainingArguments
    from hputrain.config.sections import ParallelismSettings
    from hputrain.distributed.fsdp import dp_shard_size

    settings = ParallelismSettings.of(TrainingArguments(fsdp="hybrid_shard", num_nodes=2))
    env = ompi(1, 4, 0, 2, MASTER_ADDR="10.0.0.1")
    adopt_launcher_env(environ=env)
    for name in ("RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.setenv(name, env[name])
    with pytest.raises(InputError, match="round-robin over the nodes; place them in blocks"):
        dp_shard_size(settings, 4)
    monkeypatch.setenv("LOCAL_RANK", "1")  # rank 1 in blocks
    assert dp_shard_size(settings, 4) == 2


def test_hydra_variables():
    env = {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2",
           "OMP_NUM_THREADS": "1"}
    assert adopt_launcher_env(environ=env) == "mpirun (MPICH / Intel MPI)"
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"]) == ("1", "2", "1")


def test_srun_step_variables_node_list_and_job_port():
    env = srun(5, 8, 1, 1, "4(x2)")
    assert adopt_launcher_env(4, 2, env) == "srun (SLURM)"
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == ("5", "8", "1", "4")
    assert (env["NODE_RANK"], env["MASTER_ADDR"]) == ("1", "gaudi07")
    assert env["MASTER_PORT"] == str(20000 + 123456 % 10000)
    uneven = srun(8, 11, 0, 2, "4(x2),3")
    adopt_launcher_env(environ=uneven)
    assert uneven["LOCAL_WORLD_SIZE"] == "3"


@pytest.mark.parametrize("nodelist, first", [("gaudi07", "gaudi07"), ("gaudi[07-09,12]", "gaudi07"),
                                             ("a1,b2", "a1"), ("rack[3,5]-n[01-04]", "rack3-n01")])
def test_first_host_of_a_slurm_node_list(nodelist, first):
    assert first_host(nodelist) == first


def test_torchrun_variables_win_and_a_batch_script_is_one_process():
    env = {**ompi(1, 2, 1, 2), "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    assert adopt_launcher_env(environ=env) is None and env["RANK"] == "0"
    # sbatch's own shell: SLURM_PROCID and the allocation's SLURM_NTASKS, but no srun step
    batch = {"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_LOCALID": "0", "SLURM_JOB_ID": "7"}
    assert adopt_launcher_env(environ=batch) is None and "RANK" not in batch


def test_one_task_per_node_launches_its_node():
    env = srun(1, 2, 0, 1, "1(x2)", nodelist="n[1-2]")
    adopt_launcher_env(8, 2, env)
    assert "RANK" not in env and "LOCAL_RANK" not in env  # --devices 8 starts this node's processes
    assert (env["NODE_RANK"], env["MASTER_ADDR"]) == ("1", "n1")


def test_mismatches_are_one_line():
    with pytest.raises(InputError, match="started 2 process.*--devices is 4"):
        adopt_launcher_env(4, 1, ompi(0, 2, 0, 2))
    with pytest.raises(InputError, match="rank 2 of 2"):
        adopt_launcher_env(environ=ompi(2, 2, 0, 2))
    with pytest.raises(InputError, match="OMPI_COMM_WORLD_SIZE must be a whole number"):
        adopt_launcher_env(environ=ompi(0, "two", 0, 1))
    with pytest.raises(InputError, match="not a list of task counts"):
        adopt_launcher_env(environ=srun(0, 2, 0, 0, "two"))


# -- two processes, started as mpirun or srun would start them ------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train_args(corpus: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "hputrain.cli", "train", "--corpus", str(corpus), "--cpu", "--output-dir",
            str(out), "--max-steps", "3", "--seq-len", "32", "--logging-steps", "1",
            "--per-device-train-batch-size", "2", "--disable-tqdm"]


def _losses(out: Path) -> list[float]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if "loss" in r]


def _by_hand(variables, args: list[str], port: int) -> list[subprocess.CompletedProcess]:
    """Both ranks at once, each with its launcher's variables and nothing of torchrun's."""
    base = {k: v for k, v in ENV.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    procs = [subprocess.Popen(args, cwd=ROOT, env={**base, **variables(rank), "MASTER_PORT": str(port)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    done = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return done


@pytest.fixture(scope="module")
def devices_2_losses(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("devices2")
    corpus = tmp / "corpus"
    corpus.mkdir()
    (corpus / "a.py").write_bytes(Path(os.__file__).read_bytes()[:60_000])
    out = tmp / "run"
    proc = subprocess.run(_train_args(corpus, out) + ["--devices", "2"], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return corpus, _losses(out)


def test_mpirun_ranks_train_as_devices_2(devices_2_losses, tmp_path):
    corpus, expected = devices_2_losses
    out = tmp_path / "mpi"
    procs = _by_hand(lambda rank: ompi(rank, 2, rank, 2), _train_args(corpus, out) + ["--devices", "2"],
                     _free_port())
    for proc in procs:
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(expected) == 3 and _losses(out) == pytest.approx(expected, rel=1e-5)
    assert (out / "checkpoint-3" / "rng_state_1.pt").exists()  # one job of two ranks, not two jobs
    assert "checkpoint:" in procs[0].stdout and "checkpoint:" not in procs[1].stdout  # rank 0 reports


@pytest.mark.slow
def test_srun_tasks_train_as_devices_2(devices_2_losses, tmp_path):
    corpus, expected = devices_2_losses
    out = tmp_path / "srun"
    procs = _by_hand(lambda rank: srun(rank, 2, rank, 0, "2", nodelist="localhost"),
                     _train_args(corpus, out), _free_port())
    for proc in procs:
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert _losses(out) == pytest.approx(expected, rel=1e-5)


@pytest.mark.slow
def test_mpirun_ranks_failing_alike_say_it_once(devices_2_losses, tmp_path):
    """No launcher of ours gathers the lines under mpirun: of two ranks refusing the same step
    alike, the first to say the line says it (exit 2), the other ends quietly (exit 75)."""
    corpus, _ = devices_2_losses
    script = str(ROOT / "tests" / "rank_failure_script.py")
    args = [sys.executable, script, "all", "host_sum", "3", *_train_args(corpus, tmp_path / "run")[3:],
            "--devices", "2"]
    procs = _by_hand(lambda rank: ompi(rank, 2, rank, 2), args, _free_port())
    line = "hputrain: error: every rank refused its host_sum call 3 on purpose"
    said = [text for proc in procs for text in proc.stderr.splitlines() if text.strip()]
    assert said == [line], [proc.stderr[-2000:] for proc in procs]
    assert sorted(proc.returncode for proc in procs) == [2, 75]
