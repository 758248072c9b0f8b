"""A small MoE layer in PyTorch over epcomm, one process per GPU under torchrun (processes share
the GPUs where there are fewer GPUs than processes), checked against the same layer computed
densely, without epcomm, on each rank's GPU.

    torchrun --nproc-per-node 4 examples/torch_moe.py [--format fp8-blockwise] [--tokens 256]

The layer: router logits x @ Wr, top-k with softmax weights; each expert e computes
silu(x @ W1g[e]) * (x @ W1u[e]) @ W2[e]; the output of token t is sum_k w[t,k] * expert_k(x_t).
Over epcomm: dispatch (with the router weights, so combine reduces on the expert side), a GEMM
per local expert over its rows [row_offsets[e], row_offsets[e+1]), the fused SiLU kernel over
every row at once, the second GEMM, combine. Exits 1 if any rank's output is off.
"""

import argparse
import sys

import torch
import torch.distributed as dist

import epcomm


def expert_weights(E, H, inter, device):
    """Every expert's weights, the same on every rank (one seed)."""
    gen = torch.Generator(device="cpu").manual_seed(1234)
    w1 = torch.randn(E, H, 2 * inter, generator=gen) / H ** 0.5
    w2 = torch.randn(E, inter, H, generator=gen) / inter ** 0.5
    wr = torch.randn(H, E, generator=gen) / H ** 0.5
    return (w1.to(device, torch.bfloat16), w2.to(device, torch.bfloat16),
            wr.to(device, torch.bfloat16))


def route(x, wr, k):
    logits = (x @ wr).float()
    top, ids = logits.topk(k, dim=-1)
    return ids, torch.softmax(top, dim=-1)  # int64 ids: dispatch reads them as they are


def dense_layer(x, ids, w, w1, w2, inter):
    """The reference: every (token, slot) through its expert, in fp32 from the bf16 weights."""
    xf = x.float()
    out = torch.zeros_like(xf)
    for k in range(ids.shape[1]):
        for e in ids[:, k].unique().tolist():
            sel = (ids[:, k] == e).nonzero().squeeze(1)
            h = xf[sel] @ w1[e].float()
            z = torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]
            out[sel] += w[sel, k:k + 1] * (z @ w2[e].float())
    return out


def dequantize(d, fmt, H):
    """The dispatched rows as bf16 for the GEMMs (FP8: codes times their block scales)."""
    if fmt == "bf16":
        return d.tokens
    scales = d.scales.t().repeat_interleave(128, dim=1)  # [rows, H]
    return (d.tokens.float() * scales).to(torch.bfloat16)


def moe_layer(g, x, ids, w, w1, w2, inter, fmt, timings=None):
    H = x.shape[1]
    n_local = g.sizes.n_local_experts
    first = g.rank * n_local
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
    ev[0].record()
    d = g.dispatch(x, ids, w)
    ev[1].record()
    rows = dequantize(d, fmt, H)
    offs = d.row_offsets.tolist()  # the GEMM loop needs the counts on the host
    h = torch.empty(rows.shape[0], 2 * inter, device=x.device, dtype=torch.bfloat16)
    for e in range(n_local):
        a, b = offs[e], offs[e + 1]
        if b > a:
            torch.matmul(rows[a:b], w1[first + e], out=h[a:b])
    z = epcomm.silu(h, d.row_offsets)  # reads row_offsets on the device
    y = g.empty_expert_out(x)
    for e in range(n_local):
        a, b = offs[e], offs[e + 1]
        if b > a:
            torch.matmul(z[a:b], w2[first + e], out=y[a:b])
    ev[2].record()
    out = g.combine(y)
    ev[3].record()
    if timings is not None:
        torch.cuda.synchronize()
        timings.append((ev[0].elapsed_time(ev[1]), ev[1].elapsed_time(ev[2]),
                        ev[2].elapsed_time(ev[3])))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=256, help="tokens per rank")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--inter", type=int, default=512)
    ap.add_argument("--experts", type=int, default=0, help="default: 4 per rank")
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--format", default="bf16", choices=["bf16", "fp8-blockwise"])
    ap.add_argument("--iters", type=int, default=5)
    a = ap.parse_args()

    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    device, sharing = epcomm.torch_device()
    torch.cuda.set_device(device)
    E = a.experts or 4 * n
    g = epcomm.Group.from_torch(hidden=a.hidden, top_k=a.topk, n_experts=E,
                                max_tokens_per_rank=a.tokens, format=a.format,
                                share_gpus=sharing > 1, num_sms=max(4, 64 // sharing))
    w1, w2, wr = expert_weights(E, a.hidden, a.inter, device)
    gen = torch.Generator(device="cpu").manual_seed(100 + rank)
    x = torch.randn(a.tokens, a.hidden, generator=gen).to(device, torch.bfloat16)
    ids, w = route(x, wr, a.topk)

    timings = []
    for _ in range(a.iters):
        out = moe_layer(g, x, ids, w, w1, w2, a.inter, a.format, timings)
    g.synchronize()
    ref = dense_layer(x, ids, w, w1, w2, a.inter)
    err = ((out.float() - ref).norm() / ref.norm()).item()
    bound = 1 / 64 if a.format == "bf16" else 1 / 16  # FP8 rounds the inputs to 4 bits
    ok = err <= bound and bool(torch.isfinite(out.float()).all())
    worst = torch.tensor([err if ok else float("inf")])
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    t = torch.tensor(timings[1:] or timings).mean(0).tolist()
    print(f"[rank {rank}] relative L2 error {err:.2e} (bound {bound:.2e}); dispatch {t[0]*1e3:.0f} us, "
          f"experts {t[1]*1e3:.0f} us, combine {t[2]*1e3:.0f} us", flush=True)
    g.close()  # collective, like every set-up and teardown
    if rank == 0:
        shared = f", {sharing} ranks per GPU: times are not link times" if sharing > 1 else ""
        print(f"{n} ranks, T {a.tokens}, H {a.hidden}, I {a.inter}, E {E}, top-{a.topk}, "
              f"{a.format}{shared}")
        print("check: every rank's output matches the dense layer" if worst.item() <= bound
              else "check FAILED: some rank's output differs from the dense layer")
    dist.destroy_process_group()
    sys.exit(0 if worst.item() <= bound else 1)


if __name__ == "__main__":
    main()
