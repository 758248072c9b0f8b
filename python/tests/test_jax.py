"""JAX arrays through the generic DLPack path: one process drives two ranks (on one GPU where
there is one), dispatch and combine take JAX arrays and return the library's DLPack arrays,
which jax.dlpack.from_dlpack takes; both are checked against the CPU reference. Skipped, with
the reason, without JAX or a GPU JAX can use.

The generic path has no stream to order the library's outputs with JAX's work, so the call
that returns them synchronises. One process driving several ranks therefore uses the async /
wait forms: every rank's send half first, then each rank's wait (which synchronises) — a fused
call would wait for ranks whose calls were not yet issued."""

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave the GPU to the ranks

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import epcomm  # noqa: E402

jax = pytest.importorskip("jax", reason="the JAX test needs JAX")
jnp = jax.numpy
pytestmark = pytest.mark.gpu
try:
    GPUS = jax.devices("gpu")
except RuntimeError:
    GPUS = []
if not GPUS:
    pytest.skip("JAX sees no GPU", allow_module_level=True)


def to_numpy(a, dtype=None):
    """A library output (a DLPack array on the GPU) as numpy, through JAX."""
    x = np.asarray(jax.dlpack.from_dlpack(a))
    return x.view(dtype) if dtype is not None else x


def as_bf16(bits):
    """uint16 bf16 bit patterns (numpy) as a JAX bfloat16 array."""
    return jax.lax.bitcast_convert_type(jnp.asarray(bits), jnp.bfloat16)


def test_jax_arrays_two_ranks_one_process():
    n, H, K, E, T = 2, 256, 2, 8, 24
    groups = epcomm.Group.create_local([0] * n, hidden=H, top_k=K, n_experts=E,
                                       max_tokens_per_rank=T, share_gpus=True, num_sms=8,
                                       timeout_seconds=30.0)
    p = epcomm.reference.make_problem(n, H, K, E, [T, 11], seed=12)
    dev = GPUS[0]
    sends = []
    for r, g in enumerate(groups):  # every rank's send half before any wait
        x = jax.device_put(as_bf16(p.tokens(r)), dev)
        ids = jax.device_put(jnp.asarray(p.topk_ids(r)), dev)
        w = jax.device_put(jnp.asarray(p.weights(r)), dev)
        sends.append(g.dispatch_async(x, ids, w))
    outs = [h.wait() for h in sends]
    layouts = [epcomm.reference.dispatch(p, r) for r in range(n)]
    for r in range(n):
        d = outs[r]
        msg = epcomm.reference.compare_dispatch(
            layouts[r], to_numpy(d.row_offsets, np.int32), to_numpy(d.expert_ids, np.int32),
            to_numpy(d.src_info, np.int32), to_numpy(d.tokens, np.uint16), H)
        assert msg == "", f"rank {r}: {msg}"
    # The expert outputs as JAX arrays (the received rows themselves), combined back.
    sends = []
    for r, g in enumerate(groups):
        y = jax.device_put(as_bf16(to_numpy(outs[r].tokens, np.uint16)), dev)
        sends.append(g.combine_async(y))
    results = [h.wait() for h in sends]
    for r in range(n):
        want = epcomm.reference.combine_expert_side(p, layouts, [l.tokens for l in layouts], r)
        got = to_numpy(results[r], np.uint16)[: p.num_tokens(r)]
        msg = epcomm.reference.compare_combine_expert_side(want, np.ascontiguousarray(got))
        assert msg == "", f"rank {r}: {msg}"
    for g in groups:
        g.close()
