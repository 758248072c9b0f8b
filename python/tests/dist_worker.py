"""One rank of the Python GPU tests, under torchrun (test_gpu.py starts it with 1, 2 and 4
processes; where there is one GPU they share it). Each case builds the same random problem on
every rank from one seed, runs dispatch and combine through epcomm's Python API on torch
tensors, and checks this rank's results against the C++ reference model (epcomm.reference):
dispatch outputs bit for bit (codes and scales in every format), the expert-side combine bit
for bit, the token-side combine within the reference's bf16 bounds, the un-reduced combine
exactly. Outputs are poisoned before every call so unwritten rows show. Prints one line per
case and "PASS <n> cases" at the end; exits 1 on the first failure.

    torchrun --nproc-per-node 2 python/tests/dist_worker.py [--cases all|graph|...]
"""

import argparse
import os

import numpy as np
import torch
import torch.distributed as dist

import epcomm

R = epcomm.reference


def bits(t):
    """A bf16 / fp8 / uint8 tensor's bit patterns as a numpy array (uint16 or uint8)."""
    t = t.detach().contiguous()
    if t.element_size() == 2:
        return t.view(torch.int16).cpu().numpy().view(np.uint16)
    if t.element_size() == 1:
        return t.view(torch.uint8).cpu().numpy()
    return t.cpu().numpy()


def random_bf16(rng, shape):
    v = (rng.uniform(0.5, 2.0, size=shape) * rng.choice([-1, 1], size=shape)).astype(np.float32)
    return (v.view(np.uint32) >> np.uint32(16)).astype(np.uint16)


def to_dev(a, device, dtype=None):
    t = torch.from_numpy(np.ascontiguousarray(a)).to(device)
    if dtype == torch.bfloat16:
        t = t.view(torch.bfloat16)
    return t


class Failure(Exception):
    pass


def expect(msg, what):
    if msg:
        raise Failure(f"{what}: {msg}")


def poison(d):
    for t in (d.tokens, d.scales, d.row_offsets, d.expert_ids, d.src_info, d.scales_offsets):
        if t is not None:
            t.view(torch.uint8).fill_(0xFF)


def check_dispatch(g, p, d, fmt, rank, H):
    """Checks dispatch output d against the reference; returns every rank's combine layout."""
    s = g.sizes
    if fmt == "bf16":
        refs = [R.dispatch(p, r) for r in range(p.n_ranks)]
        expect(R.compare_dispatch(refs[rank], bits(d.row_offsets).view(np.int32),
                                  d.expert_ids.cpu().numpy(), d.src_info.cpu().numpy(),
                                  bits(d.tokens), H), f"rank {rank} dispatch")
        return refs
    q = [R.dispatch_quantized(p, r, fmt, g.config.nvfp4_global_scale, s.max_routed_rows)
         for r in range(p.n_ranks)]
    offs = d.scales_offsets.cpu().numpy() if d.scales_offsets is not None else np.zeros(0, np.int32)
    expect(R.compare_dispatch_quantized(
        q[rank], s.max_recv_rows, s.token_bytes, d.row_offsets.cpu().numpy(),
        d.expert_ids.cpu().numpy(), d.src_info.cpu().numpy(), bits(d.tokens),
        d.scales.contiguous().view(torch.uint8).reshape(-1).cpu().numpy(), offs),
        f"rank {rank} dispatch ({fmt})")
    return [x.layout() for x in q]


def expert_outputs(layouts, seed, H):
    """Every rank's expert outputs (any rank can recompute every rank's from the seed)."""
    return [random_bf16(np.random.default_rng([seed, r]), (lay.rows, H))
            for r, lay in enumerate(layouts)]


def make_inputs(p, rank, device):
    return (to_dev(p.tokens(rank), device, torch.bfloat16),
            to_dev(p.topk_ids(rank), device),
            to_dev(p.weights(rank), device))


def run_round(g, p, fmt, rank, device, seed, *, side, form, own_out=False, ids64=False):
    """side: 'expert' (weights to dispatch), 'token' (weights to combine), 'none' (un-reduced).
    form: 'fused' or 'async'. ids64: the top-k ids as int64 (torch.topk's dtype)."""
    H = p.hidden
    x, ids, w = make_inputs(p, rank, device)
    if ids64:
        ids = ids.long()
    out = g.empty_dispatch_output(x) if own_out else None
    # Poison what dispatch writes: the caller's outputs, or the group's own buffers.
    poison(out if out is not None else g._dispatch_result("torch", None, 0))
    wd = w if side == "expert" else None
    if form == "fused":
        d = g.dispatch(x, ids, wd, out=out)
    else:
        h = g.dispatch_async(x, ids, wd)
        busy = torch.randn(256, 256, device=device) @ torch.randn(256, 256, device=device)
        d = h.wait(out=out)
        del busy
    torch.cuda.synchronize()
    g.check()
    layouts = check_dispatch(g, p, d, fmt, rank, H)
    ys = expert_outputs(layouts, seed, H)
    y = g.empty_expert_out(x)
    y.view(torch.int16).fill_(-1)
    y[: layouts[rank].rows] = to_dev(ys[rank], device, torch.bfloat16)
    layout = d if own_out else None
    wc = w if side == "token" else None
    if form == "fused":
        o = g.combine(y, wc, layout=layout)
    else:
        h = g.combine_async(y, layout=layout)
        o = h.wait(wc)
    torch.cuda.synchronize()
    g.check()
    T = p.num_tokens(rank)
    if side == "expert":
        assert tuple(o.shape) == (T, H), o.shape
        expect(R.compare_combine_expert_side(R.combine_expert_side(p, layouts, ys, rank), bits(o)),
               f"rank {rank} expert-side combine")
    elif side == "token":
        assert tuple(o.shape) == (T, H), o.shape
        expect(R.compare_combine_bf16(R.combine(p, layouts, ys, rank, True), bits(o)),
               f"rank {rank} token-side combine")
    else:
        assert tuple(o.shape) == (T, p.top_k, H), o.shape
        expect(R.compare_exact_bf16(R.combine(p, layouts, ys, rank, False), bits(o)),
               f"rank {rank} un-reduced combine")
    o.view(torch.int16).fill_(-1)  # poison the combine buffer for the next round


def problem(n, H, K, E, max_tokens, seed, *, counts=None, shared=False):
    rng = np.random.default_rng(seed)
    if counts is None:
        counts = [int(c) for c in rng.integers(0, max_tokens + 1, size=n)]
        counts[int(rng.integers(0, n))] = max_tokens
    p = R.make_problem(n, H, K, E, counts, seed, mask_prob=0.1)
    p.shared_expert = shared
    return p


def case_formats(rank, n, device, ctx):
    """Every format, fused and async + wait (its ids int64), each reduction side; caller-owned
    outputs once."""
    H, K, E, T = 512, 4, 8 * n, 48
    done = 0
    for fi, fmt in enumerate(epcomm.FORMATS):
        g = epcomm.Group.from_torch(hidden=H, top_k=K, n_experts=E, max_tokens_per_rank=T,
                                    format=fmt, nvfp4_global_scale=0.75, **ctx)
        sides = ("expert", "token", "none")
        for si, side in enumerate(sides):
            for form in ("fused", "async"):
                seed = 1000 + 100 * fi + 10 * si + (form == "async")
                # One round per side with the last rank holding no token (T = 0 arrays).
                zero = [T] * (n - 1) + [0] if (n > 1 and form == "fused") else None
                p = problem(n, H, K, E, T, seed, counts=zero)
                run_round(g, p, fmt, rank, device, seed, side=side, form=form,
                          own_out=(side == "token" and form == "async"), ids64=(form == "async"))
                done += 1
        g.close()  # collective
        print(f"[rank {rank}] formats: {fmt} ok", flush=True)
    return done


def case_shared_expert(rank, n, device, ctx):
    H, K, E, T = 256, 3, 4 * n, 40
    g = epcomm.Group.from_torch(hidden=H, top_k=K, n_experts=E, max_tokens_per_rank=T,
                                shared_expert=True, **ctx)
    for i, side in enumerate(("expert", "token", "expert")):
        p = problem(n, H, K, E, T, 77 + i, shared=True)
        run_round(g, p, "bf16", rank, device, 77 + i, side=side, form="fused")
    d = g.dispatch(*make_inputs(problem(n, H, K, E, T, 5, shared=True), rank, device))
    assert int(d.expert_ids[0]) == epcomm.SHARED_EXPERT_ID
    torch.cuda.synchronize()
    g.close()
    print(f"[rank {rank}] shared expert ok", flush=True)
    return 4


def case_graph(rank, n, device, ctx):
    """A dispatch + combine captured in torch.cuda.graph, replayed on new inputs copied into the
    captured tensors; the expert is the identity (combine reads the dispatched rows)."""
    H, K, E, T = 256, 4, 4 * n, 32
    g = epcomm.Group.from_torch(hidden=H, top_k=K, n_experts=E, max_tokens_per_rank=T, **ctx)
    counts = [T - 3 * r for r in range(n)]
    p0 = problem(n, H, K, E, T, 900, counts=counts)
    x, ids, w = make_inputs(p0, rank, device)
    s = torch.cuda.Stream(device)
    s.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(s):  # warm-up outside capture (loads the kernels)
        d = g.dispatch(x, ids, w)
        g.combine(d.tokens)
    torch.cuda.current_stream(device).wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        d = g.dispatch(x, ids, w)
        out = g.combine(d.tokens)
    for it in range(3):
        seed = 901 + it
        p = problem(n, H, K, E, T, seed, counts=counts)
        nx, nids, nw = make_inputs(p, rank, device)
        x.copy_(nx), ids.copy_(nids), w.copy_(nw)
        d.tokens.view(torch.int16).fill_(-1)
        out.view(torch.int16).fill_(-1)
        torch.cuda.synchronize()
        dist.barrier()  # every rank's inputs are in place before any replay sends
        graph.replay()
        torch.cuda.synchronize()
        g.check()
        layouts = [R.dispatch(p, r) for r in range(n)]
        expect(R.compare_dispatch(layouts[rank], d.row_offsets.cpu().numpy(),
                                  d.expert_ids.cpu().numpy(), d.src_info.cpu().numpy(),
                                  bits(d.tokens), H), f"rank {rank} graph replay {it} dispatch")
        ys = [lay.tokens for lay in layouts]  # the identity expert
        expect(R.compare_combine_expert_side(R.combine_expert_side(p, layouts, ys, rank),
                                             bits(out)), f"rank {rank} graph replay {it} combine")
    del graph  # the graph's kernels use the group's windows
    g.close()
    print(f"[rank {rank}] graph capture ok (3 replays)", flush=True)
    return 3


def case_errors(rank, n, device, ctx):
    """Bad arguments get the library's message and the group stays usable."""
    H, K, E, T = 256, 2, 2 * n, 16
    g = epcomm.Group.from_torch(hidden=H, top_k=K, n_experts=E, max_tokens_per_rank=T, **ctx)
    x = torch.randn(8, H, device=device).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(8)]).to(device, torch.int32)
    checks = [
        (lambda: g.dispatch(x.float(), ids), "tokens must be bfloat16"),
        (lambda: g.dispatch(x, ids.short()), "topk_ids must be int32 or int64"),
        (lambda: g.dispatch(x, ids.double()), "topk_ids must be int32 or int64"),
        (lambda: g.dispatch(x, ids[:4]), "topk_ids must have shape [T, top_k]"),
        (lambda: g.dispatch(x.cpu(), ids), "tokens must be a CUDA tensor"),
        (lambda: g.dispatch(x.t().contiguous().t(), ids), "tokens must be contiguous"),
        (lambda: g.dispatch(torch.zeros(T + 1, H, device=device, dtype=torch.bfloat16),
                            torch.zeros(T + 1, K, device=device, dtype=torch.int32)),
         f"max_tokens_per_rank = {T}"),
        (lambda: g.combine(g.empty_expert_out(x)), "no dispatch has completed"),
        (lambda: g.combine(torch.zeros(4, H, device=device, dtype=torch.bfloat16)),
         "expert_out has 4 rows; it needs the dispatch output's"),
    ]
    for fn, msg in checks:
        try:
            fn()
        except epcomm.InvalidArgument as e:
            if msg not in str(e) or f"(rank {rank})" not in str(e):
                raise Failure(f"expected '{msg}' with the rank; got: {e}")
        else:
            raise Failure(f"no error for the call expected to fail with '{msg}'")
    # A device-detected bad expert id: reported by check(), and the group stays usable.
    bad = ids.clone()
    if rank == 0:
        bad[3, 1] = E + 5
    g.dispatch(x, bad)
    try:
        g.synchronize()
        if rank == 0:
            raise Failure("rank 0 sent an expert id out of range and got no error")
    except epcomm.Error as e:
        if rank != 0 or e.code != epcomm.ErrorCode.bad_expert_id:
            raise
    p = problem(n, H, K, E, T, 31)
    run_round(g, p, "bf16", rank, device, 31, side="expert", form="fused")
    g.close()
    try:
        g.dispatch(x, ids)
        raise Failure("a closed group accepted a dispatch")
    except epcomm.InvalidArgument as e:
        if "closed" not in str(e):
            raise
    print(f"[rank {rank}] errors ok", flush=True)
    return len(checks) + 2


CASES = {"formats": case_formats, "shared": case_shared_expert, "graph": case_graph,
         "errors": case_errors}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="all")
    ap.add_argument("--num-sms", type=int, default=0)
    ap.add_argument("--ranks-per-node", type=int, default=0,
                    help="declare nodes of this many ranks: traffic between them through NVSHMEM")
    a = ap.parse_args()
    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    device, sharing = epcomm.torch_device()
    torch.cuda.set_device(device)
    # Every rank sharing a GPU needs its blocks resident with the others'.
    num_sms = a.num_sms or max(2, min(16, 128 // (2 * sharing)))
    ctx = dict(share_gpus=sharing > 1, num_sms=num_sms, timeout_seconds=20.0,
               ranks_per_node=a.ranks_per_node)
    if rank == 0:
        nodes = f", nodes of {a.ranks_per_node}" if a.ranks_per_node else ""
        print(f"{n} ranks, {sharing} per GPU, num_sms {num_sms}{nodes}", flush=True)
    names = list(CASES) if a.cases == "all" else a.cases.split(",")
    total = 0
    try:
        for name in names:
            total += CASES[name](rank, n, device, ctx)
            dist.barrier()
    except Exception as e:  # noqa: BLE001
        # Fail fast: the peers will time out and report this rank as the one missing.
        print(f"FAIL [rank {rank}] {type(e).__name__}: {e}", flush=True)
        os._exit(1)
    print(f"PASS [rank {rank}] {total} checks", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
