"""The GPU tests of the Python package: dist_worker.py under torchrun with 1, 2 and 4
processes (sharing the GPUs there are: one is enough), and one process driving several ranks.
Skipped, with the reason, without PyTorch or a CUDA GPU."""

import os
import subprocess
import sys

import numpy as np
import launch  # python/tests/launch.py
import pytest

import epcomm

torch = pytest.importorskip("torch", reason="the GPU tests need PyTorch")
pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU visible", allow_module_level=True)

HERE = os.path.dirname(os.path.abspath(__file__))


def torchrun(nproc, *args, timeout=500):
    launch.torchrun("dist_worker.py", nproc, *args, timeout=timeout)


@pytest.mark.parametrize("nproc", [1, 2, 4])
def test_torchrun_every_format_and_mode(nproc):
    torchrun(nproc, "--cases", "formats,shared,errors")


@pytest.mark.skipif(not epcomm.spans_nodes_supported(),
                    reason="this package was built without the NVSHMEM component "
                           "(-C cmake.define.EPCOMM_WITH_NVSHMEM=ON)")
@pytest.mark.parametrize("split", ["2x2", "4x1"])
def test_torchrun_across_declared_nodes(split):
    """4 processes declared as nodes (2 of 2, 4 of 1): every transfer between them through
    NVSHMEM, every format and the shared expert, checked as in one node."""
    nodes, per_node = (int(v) for v in split.split("x"))
    torchrun(nodes * per_node, "--cases", "formats,shared", "--ranks-per-node", str(per_node))


@pytest.mark.parametrize("nproc", [1, 2])
def test_torchrun_graph_capture(nproc):
    torchrun(nproc, "--cases", "graph")


def padded_rows(rows, row_offsets, capacity):
    """Dispatch-ordered rows [N, H] laid out as the padded per-expert layout [G, capacity, H]
    (group g's rows at [g, 0 .. count)); NaN in every slot no row reaches."""
    ro = row_offsets.cpu().tolist()
    out = torch.full((len(ro) - 1, capacity, rows.size(1)), float("nan"), dtype=rows.dtype,
                     device=rows.device)
    for g in range(len(ro) - 1):
        out[g, :ro[g + 1] - ro[g]] = rows[ro[g]:ro[g + 1]]
    return out


@pytest.mark.parametrize("padded", [False, True])
def test_one_process_several_ranks(padded):
    """create_local: two ranks in this process (on GPU 0 twice where there is one GPU). padded:
    combine takes the expert outputs as [G, capacity, H] (the padded per-expert layout)."""
    n = 2
    ngpu = torch.cuda.device_count()
    devices = [r % ngpu for r in range(n)]
    H, K, E, T = 256, 2, 8, 24
    groups = epcomm.Group.create_local(devices, hidden=H, top_k=K, n_experts=E,
                                       max_tokens_per_rank=T, share_gpus=ngpu < n, num_sms=8)
    p = epcomm.reference.make_problem(n, H, K, E, [T, 11], seed=4)
    # One stream per rank: ranks on one stream would wait on each other's queued kernels.
    streams = [torch.cuda.Stream(g.device) for g in groups]
    outs = []
    for r, g in enumerate(groups):  # every rank's call before any synchronisation
        with torch.cuda.device(g.device):
            x = torch.from_numpy(p.tokens(r)).to(g.device).view(torch.bfloat16)
            ids = torch.from_numpy(p.topk_ids(r)).to(g.device)
            w = torch.from_numpy(p.weights(r)).to(g.device)
            streams[r].wait_stream(torch.cuda.current_stream(g.device))
            outs.append((x, ids, w, g.dispatch(x, ids, w, stream=streams[r])))
    for r, g in enumerate(groups):
        g.synchronize(streams[r])
    layouts = [epcomm.reference.dispatch(p, r) for r in range(n)]
    for r, g in enumerate(groups):
        d = outs[r][3]
        msg = epcomm.reference.compare_dispatch(
            layouts[r], d.row_offsets.cpu().numpy(), d.expert_ids.cpu().numpy(),
            d.src_info.cpu().numpy(), d.tokens.view(torch.int16).cpu().numpy().view(np.uint16), H)
        assert msg == "", msg
    expert_out = []
    for r, g in enumerate(groups):
        with torch.cuda.device(g.device):
            d = outs[r][3]
            expert_out.append(padded_rows(d.tokens, d.row_offsets, n * T + 3) if padded
                              else d.tokens)
            streams[r].wait_stream(torch.cuda.current_stream(g.device))
    results = [g.combine(expert_out[r], stream=streams[r]) for r, g in enumerate(groups)]
    for r, g in enumerate(groups):
        g.synchronize(streams[r])
    for r in range(n):
        ref = epcomm.reference.combine_expert_side(p, layouts, [l.tokens for l in layouts], r)
        got = results[r].view(torch.int16).cpu().numpy().view(np.uint16)
        assert epcomm.reference.compare_combine_expert_side(ref, got) == ""


@pytest.mark.parametrize("side", ["expert", "token"])
def test_combine_of_fewer_columns(side):
    """Combine of expert outputs narrower than the dispatched rows (CombineInput::hidden): the
    result equals the first columns of the full-width combine of the same rows, bit for bit
    (each column is summed on its own, in the same order); it needs out=."""
    n = 2
    ngpu = torch.cuda.device_count()
    H, K, E, T, h = 256, 2, 8, 24, 72
    groups = epcomm.Group.create_local([r % ngpu for r in range(n)], hidden=H, top_k=K,
                                       n_experts=E, max_tokens_per_rank=T,
                                       share_gpus=ngpu < n, num_sms=8)
    p = epcomm.reference.make_problem(n, H, K, E, [T, 11], seed=5)
    streams = [torch.cuda.Stream(g.device) for g in groups]
    inputs = []
    for r, g in enumerate(groups):
        with torch.cuda.device(g.device):
            inputs.append((torch.from_numpy(p.tokens(r)).to(g.device).view(torch.bfloat16),
                           torch.from_numpy(p.topk_ids(r)).to(g.device),
                           torch.from_numpy(p.weights(r)).to(g.device)))
            streams[r].wait_stream(torch.cuda.current_stream(g.device))

    def round_trip(cols):
        outs = []
        for r, g in enumerate(groups):  # every rank's dispatch before any synchronisation
            x, ids, w = inputs[r]
            outs.append(g.dispatch(x, ids, w if side == "expert" else None, stream=streams[r]))
        results, ys = [], []
        for r, g in enumerate(groups):
            with torch.cuda.device(g.device):
                torch.cuda.current_stream(g.device).wait_stream(streams[r])  # the dispatch's rows
                y = outs[r].tokens[:, :cols].contiguous()  # expert outputs: the rows' columns
                # Kept alive until the combines are done: y was allocated on the current stream
                # and is read on streams[r], so once freed the next rank's torch.full could take
                # its memory while this rank's combine still reads it (the fused token side
                # reads its own rows in place, late in the kernel).
                ys.append(y)
                out = torch.full((inputs[r][0].size(0), cols), float("nan"),
                                 dtype=torch.bfloat16, device=g.device)
                streams[r].wait_stream(torch.cuda.current_stream(g.device))
                w = inputs[r][2] if side == "token" else None
                results.append(g.combine(y, w, out=out, stream=streams[r]))
        for r, g in enumerate(groups):
            g.synchronize(streams[r])
        return [t.cpu() for t in results]

    full = round_trip(H)
    narrow = round_trip(h)
    for r in range(n):
        assert torch.equal(narrow[r].view(torch.int16), full[r][:, :h].view(torch.int16))
    # Without out= a narrower combine is refused (the group's buffer is the group's width).
    for r, g in enumerate(groups):
        x, ids, w = inputs[r]
        g.dispatch(x, ids, w, stream=streams[r])
    with pytest.raises(epcomm.InvalidArgument, match="needs out="):
        groups[0].combine(torch.zeros((groups[0].sizes.max_recv_rows, h), dtype=torch.bfloat16,
                                      device=groups[0].device), stream=streams[0])


def test_cupy_tensors_in_and_out():
    cupy = pytest.importorskip("cupy", reason="CuPy is not installed")
    H, K, E, T = 256, 2, 4, 16
    (g,) = epcomm.Group.create_local([0], hidden=H, top_k=K, n_experts=E, max_tokens_per_rank=T,
                                     num_sms=8)
    p = epcomm.reference.make_problem(1, H, K, E, [T], seed=8)
    x = cupy.asarray(p.tokens(0))  # uint16 bf16 bits: CuPy has no bfloat16
    d = g.dispatch(x, cupy.asarray(p.topk_ids(0)), cupy.asarray(p.weights(0)))
    assert isinstance(d.tokens, cupy.ndarray) and d.tokens.dtype == cupy.uint16
    out = g.combine(d.tokens)
    g.synchronize()
    ref = epcomm.reference.dispatch(p, 0)
    assert epcomm.reference.compare_dispatch(
        ref, cupy.asnumpy(d.row_offsets), cupy.asnumpy(d.expert_ids), cupy.asnumpy(d.src_info),
        cupy.asnumpy(d.tokens), H) == ""
    want = epcomm.reference.combine_expert_side(p, [ref], [ref.tokens], 0)
    assert epcomm.reference.compare_combine_expert_side(want, cupy.asnumpy(out)) == ""


def test_silu_kernels_against_the_reference_formula():
    rows, inter, G = 64, 256, 3
    x = (torch.randn(rows, 2 * inter, device="cuda") * 2).to(torch.bfloat16)
    ro = torch.tensor([0, 20, 20, 52], dtype=torch.int32, device="cuda")
    z = torch.nn.functional.silu(x[:, :inter].float()) * x[:, inter:].float()
    out = epcomm.silu(x, ro)
    torch.cuda.synchronize()
    torch.testing.assert_close(out[:52].float(), z[:52], rtol=2 ** -7, atol=1e-6)
    codes, scales = epcomm.silu(x, ro, format="fp8-blockwise")
    torch.cuda.synchronize()
    assert codes.dtype == torch.float8_e4m3fn and tuple(scales.shape) == (inter // 128, rows)
    deq = codes[:52].float().view(52, inter // 128, 128) * scales[:, :52].t().unsqueeze(-1)
    torch.testing.assert_close(deq.view(52, inter), z[:52], rtol=2 ** -3, atol=1e-2)
    c4, s4 = epcomm.silu(x, ro, format="mxfp4", clamp=(7.0, 1.702))
    c4n, s4n, off = epcomm.silu(x, ro, format="nvfp4",
                                global_scales=torch.ones(G, device="cuda"))
    torch.cuda.synchronize()
    assert tuple(c4.shape) == (rows, inter // 2) and tuple(s4.shape) == (rows, inter // 32)
    assert tuple(c4n.shape) == (rows, inter // 2) and tuple(off.shape) == (G,)
    assert int(c4[:52].ne(0).sum()) > 0 and int(c4n[:52].ne(0).sum()) > 0


@pytest.mark.parametrize("fmt", ["bf16", "fp8-blockwise"])
def test_example_torch_moe(fmt):
    """examples/torch_moe.py under torchrun with 2 processes: the layer matches the dense one."""
    example = os.path.join(HERE, "..", "..", "examples", "torch_moe.py")
    env = dict(os.environ, PYTHONUNBUFFERED="1", NCCL_NVLS_ENABLE="0",
               TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc-per-node=2", example, "--format", fmt, "--iters", "3"],
                       env=env, capture_output=True, text=True, timeout=300)
    print(r.stdout + r.stderr)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert "check: every rank's output matches the dense layer" in r.stdout


def test_torch_ops_compile_fullgraph():
    """epcomm.torch_ops: a MoE step (dispatch, a stand-in for the experts, combine reduced with
    the router weights) compiled with torch.compile(fullgraph=True), one rank: the dispatch
    matches the reference and the combine is the eager API's, bit for bit."""
    import epcomm.torch_ops as ops

    H, K, E, T = 256, 4, 16, 32
    (g,) = epcomm.Group.create_local([0], hidden=H, top_k=K, n_experts=E, max_tokens_per_rank=T,
                                     num_sms=8)
    gid = ops.register(g)
    p = epcomm.reference.make_problem(1, H, K, E, [T], seed=7)
    x = torch.from_numpy(p.tokens(0)).cuda().view(torch.bfloat16)
    ids = torch.from_numpy(p.topk_ids(0)).cuda()
    w = torch.from_numpy(p.weights(0)).cuda()

    def step(x, ids, w):
        d = ops.dispatch(gid, x, ids, w)
        y = (d.tokens.float() * 0.5).to(torch.bfloat16)
        out = ops.combine(gid, y, d, num_tokens=x.shape[0], reduced=True)
        return d.tokens, d.row_offsets, d.expert_ids, d.src_info, out

    tokens, row_offsets, expert_ids, src_info, out = torch.compile(step, fullgraph=True)(x, ids, w)
    torch.cuda.synchronize()
    layout = epcomm.reference.dispatch(p, 0)
    msg = epcomm.reference.compare_dispatch(
        layout, row_offsets.cpu().numpy(), expert_ids.cpu().numpy(), src_info.cpu().numpy(),
        tokens.view(torch.int16).cpu().numpy().view(np.uint16), H)
    assert msg == "", msg
    d0 = g.dispatch(x, ids, w)  # the eager API on the same inputs
    y0 = (d0.tokens.float() * 0.5).to(torch.bfloat16)
    out0 = g.combine(y0)
    torch.cuda.synchronize()
    assert torch.equal(out.view(torch.int16), out0.view(torch.int16))
    ops.unregister(gid)
    g.close()
