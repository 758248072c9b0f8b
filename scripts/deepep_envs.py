"""`deep_ep.utils.envs` for DeepEP's own test programs run against epcomm.deep_ep with several
processes sharing one GPU (scripts/device_deepep_tests.sh puts it into its shim package in
place of DeepEP's, which needs DeepEP's compiled extension). The tests take `init_dist` from it.

It differs from DeepEP's in what one GPU needs, and nothing else:
  - the process group is gloo (NCCL refuses two ranks on one GPU);
  - each process takes GPU local_rank modulo the GPUs there are;
  - all_gather_into_tensor hands gloo its output as one flat concatenation ([world * n, ...]):
    gloo checks the output's shape, NCCL only its size, and the tests pass [world, n, ...].
"""

import os
import random

import torch
import torch.distributed as dist


def init_seed(global_seed: int) -> None:
    """Seeds torch and random with global_seed + this process's rank."""
    seed = global_seed + dist.get_rank()
    torch.manual_seed(seed)
    random.seed(seed)


def _flat_all_gather_into_tensor(gather):
    def call(output, input, group=None, async_op=False):
        if input.dim() > 0 and output.dim() == input.dim() + 1:
            output = output.view(-1, *input.shape[1:])
        return gather(output, input, group=group, async_op=async_op)

    return call


def init_dist(local_rank: int, num_local_ranks: int, seed: int = 0):
    """(rank, world size, a group of every rank), as DeepEP's init_dist returns them."""
    ip = os.getenv("MASTER_ADDR", "127.0.0.1")
    port = int(os.getenv("MASTER_PORT", "8361"))
    num_nodes = int(os.getenv("WORLD_SIZE", 1))
    node_rank = int(os.getenv("RANK", 0))
    backend = os.getenv("EPCOMM_DEEPEP_TEST_BACKEND", "gloo")
    dist.init_process_group(backend=backend, init_method=f"tcp://{ip}:{port}",
                            world_size=num_nodes * num_local_ranks,
                            rank=node_rank * num_local_ranks + local_rank)
    torch.set_default_dtype(torch.bfloat16)
    torch.set_default_device("cuda")
    torch.cuda.set_device(local_rank % torch.cuda.device_count())
    if backend == "gloo":
        dist.all_gather_into_tensor = _flat_all_gather_into_tensor(dist.all_gather_into_tensor)
    init_seed(seed)
    world = num_nodes * num_local_ranks
    return dist.get_rank(), dist.get_world_size(), dist.new_group(list(range(world)))
