"""Starts a test worker under torchrun and checks that every rank passed (the GPU tests)."""

import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def torchrun(worker, nproc, *args, timeout=500):
    """Runs python/tests/<worker> under torchrun with nproc processes; asserts a zero exit and
    one "PASS [rank" line a process."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", NCCL_NVLS_ENABLE="0",
               TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", os.path.join(HERE, worker), *args]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    out = r.stdout + r.stderr
    print(out)
    assert r.returncode == 0, out[-4000:]
    assert out.count("PASS [rank") == nproc, out[-4000:]
