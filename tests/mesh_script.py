"""The process group and its mesh as the trainer builds them, run by test_mesh.py through
`hputrain launch` (Gloo on the CPU). Every rank writes what it sees to OUTPUT_DIR/rank-R.json.

    mesh_script.py OUTPUT_DIR CP [DP_SHARD]
"""
import json
import os
import sys

import torch
import torch.distributed as dist

from hputrain.distributed import ProcessGroup


def timeout_of(process_group) -> float:
    """The timeout of `process_group`'s backend on the CPU (Gloo's), in seconds."""
    return process_group._get_backend(torch.device("cpu")).options._timeout.total_seconds()


def main(output_dir: str, cp: int, dp_shard: int = 1) -> None:
    group = ProcessGroup.from_env(dist.Backend.GLOO)
    group.set_context_parallel(cp)
    group.set_dp_shard(dp_shard)
    group.init(60, "cpu")
    mesh = group.mesh
    values = torch.tensor([float(group.rank + 1), 10.0 * (group.rank + 1)])
    facts = {
        "names": list(mesh.mesh_dim_names),
        "shape": list(mesh.shape),
        "coordinate": list(mesh.get_coordinate()),
        "dims_coordinate": list(group.dims.coordinate(group.rank)),
        "dp": [group.dp_rank, group.dp_size],
        "cp": [group.cp_rank, group.cp_size],
        "cp_group": dist.get_process_group_ranks(group.cp_group),
        "cp_local_rank": mesh.get_local_rank("cp"),
        "replicate_by_shard": mesh["dp_replicate", "dp_shard"].mesh.tolist(),
        "mean": group.all_reduce_mean(values.clone()).tolist(),
        "cp_mean": group.all_reduce_mean(values.clone(), group.cp_group).tolist(),
        "host_sum": group.host_sum([group.rank, 1]),
        # every group the job made, and the seconds its collectives wait (group.init's 60)
        "timeouts": {name: timeout_of(mesh[name].get_group()) for name in mesh.mesh_dim_names}
                    | {"default": timeout_of(dist.group.WORLD), "host": timeout_of(group.host_group)},
    }
    with open(os.path.join(output_dir, f"rank-{group.rank}.json"), "w") as f:
        json.dump(facts, f)
    group.barrier()
    dist.destroy_process_group()  # leave together: gloo can abort at exit with groups alive


if __name__ == "__main__":
    main(sys.argv[1], *map(int, sys.argv[2:]))
