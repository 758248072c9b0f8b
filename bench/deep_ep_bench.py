"""What the DeepEP layer (epcomm.deep_ep) costs over epcomm's own calls, for the benchmark's
`decode` (also with UE8M0 scales, `decode-ue8m0`) and `prefill` workloads, under torchrun:

    torchrun --nproc-per-node N bench/deep_ep_bench.py [--sms 24] [--iters 50] [--profile 20]
                                                       [--host-profile 50]

For each workload and each side (dispatch, combine) it times, with CUDA events around each call
after a warm-up, over three rotating input sets, and prints median (min, max) in µs, then
[host h / H]: h the median host time of rank 0's calls (from the call to its return; a call
that synchronises, as the layer's prefill dispatch does, counts its wait) and H the largest
such median over the ranks (every call waits in its kernel for the slowest rank's launch):
  layer    the DeepEP calls: decode = low_latency_dispatch / low_latency_combine (FP8),
           prefill = get_dispatch_layout + dispatch / combine (bf16, top-k and weights)
  epcomm   epcomm.Group.dispatch / combine of the same tokens, routing and format from Python
and their difference, the layer's cost, with its ratio [layer / epcomm; whether within the
layer's goal of 1.1 × epcomm's call + 5 µs, else by how much over]. Decode also times epcomm's own call writing the layer's
padded per-expert layout (`epcomm padded`: Config.padded_capacity, UE8M0 words for
decode-ue8m0; combine reading [E_l, R * T, H] expert outputs), checked against what the layer
returns, so the layer's cost over it is its host work alone; and the dispatch + combine pair of
the layer and of that padded call, each captured in a CUDA graph once and replayed on new
inputs, as serving engines run decode (`graph`: no host work left in either). Each layer result
is checked once against the epcomm
result of the same inputs (decode: every combined row; prefill: every received and combined
row). Processes sharing one GPU measure fixed costs, not links: the script says so.
--profile CALLS also runs that many calls of each layer side under torch.profiler and prints
the kernels and operators the time goes to; --host-profile CALLS runs that many calls of each
side with the GPU busy ahead of them under cProfile and prints the host time a call and the
Python functions it goes to.
"""

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import epcomm
from epcomm.deep_ep import Buffer

WORKLOADS = {  # name: (tokens per rank, hidden, top-k, experts, format)
    "decode": (128, 7168, 8, 256, "fp8-blockwise"),
    # decode with DeepGEMM's scales: round_scale=True, use_ue8m0=True (epcomm: fp8_pow2_scales)
    "decode-ue8m0": (128, 7168, 8, 256, "fp8-blockwise"),
    "prefill": (4096, 7168, 8, 256, "bf16"),
}


def ue8m0_scales(words):
    """UE8M0 words [..., H / 512] int32 (four exponent bytes, block 4j lowest) -> fp32 scales
    [..., H / 128]."""
    e = torch.stack([(words >> (8 * t)) & 0xFF for t in range(4)], dim=-1).flatten(-2)
    return torch.ldexp(torch.ones_like(e, dtype=torch.float32), e - 127)


def inputs(T, H, K, E, seed, dev):
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = ((torch.rand((T, H), generator=g) + 0.5) * (torch.randint(0, 2, (T, H), generator=g)
                                                  * 2 - 1)).to(torch.bfloat16).to(dev)
    scores = torch.randn((T, E), generator=g).abs() + 1
    idx = scores.topk(K, dim=1).indices.to(dev)
    w = (torch.rand((T, K), generator=g) + 0.1).to(dev)
    return x, idx, w


def timed(fn, iters, sets):
    """Median, min, max µs of fn(i) (input set i) with events around each call; then the
    median host µs from the call to its return, on this rank and the largest over the ranks
    (a collective: every rank calls timed alike)."""
    times, host = [], []
    for i in range(iters):
        dist.barrier()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        t0 = time.perf_counter()
        fn(i % len(sets))
        host.append((time.perf_counter() - t0) * 1e6)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000.0)
    h = statistics.median(host)
    worst = torch.tensor([h], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return statistics.median(times), min(times), max(times), h, float(worst[0])


def graph_timed(step, load, iters, sets):
    """Median, min, max µs of one replay of a CUDA graph of step(), captured once (after two
    warm-up calls on a side stream, as torch.cuda.graph asks) on static inputs that load(i)
    fills from input set i before each replay (not timed). A collective, as timed."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    torch.cuda.synchronize()
    times = []
    for i in range(iters):
        load(i % len(sets))
        dist.barrier()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000.0)
    return statistics.median(times), min(times), max(times)


def profiled(fn, calls, label, show):
    """Runs fn(i) `calls` times (collectively: every rank) under torch.profiler; `show` (one
    rank) prints where the time goes: the top kernels by GPU time and the top operators by CPU
    time, totals over the calls."""
    from torch.profiler import ProfilerActivity, profile
    dist.barrier()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as pr:
        for i in range(calls):
            fn(i % 3)
        torch.cuda.synchronize()
    if show:
        ka = pr.key_averages()
        print(f"# profile: {label}, {calls} calls")
        print(ka.table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=70))
        print(ka.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=70))
        # The last call's GPU work in launch order (which of two same-named kernels costs what).
        gpu = [e for e in pr.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        gpu.sort(key=lambda e: e.time_range.start)
        print(f"# profile: {label}, the last call's GPU work in order (µs)")
        for e in gpu[-(len(gpu) // calls):]:
            print(f"  {e.time_range.elapsed_us():9.1f}  {e.name[:90]}")


def host_profiled(fns, calls, label, show):
    """The host side of each (name, fn) in fns: `calls` calls under cProfile with the GPU kept
    busy ahead of them (a long kernel queued first, so no call waits for the device unless it
    synchronises), then one synchronize. `show` prints the host µs a call and the functions
    the time goes to (self time, top 12)."""
    import cProfile
    import io
    import pstats
    import time
    for name, fn in fns:
        dist.barrier()
        torch.cuda.synchronize()
        torch.cuda._sleep(int(5e8))  # ~0.3 s of GPU cycles ahead of the calls
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        for i in range(calls):
            fn(i % 3)
        prof.disable()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        if show:
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(12)
            body = "\n".join(out.getvalue().strip().splitlines()[2:])
            print(f"# host: {label} {name}: {(t1 - t0) * 1e6 / calls:.1f} µs a call "
                  f"(wall, under cProfile), {calls} calls\n{body}")


def fmt(t):
    return f"{t[0]:8.1f} ({t[1]:.1f}, {t[2]:.1f}) [host {t[3]:.1f} / {t[4]:.1f}]"


def against(layer_us: float, own_us: float) -> str:
    """The layer's time as a ratio of epcomm's own call, and whether it is within the layer's
    goal of 1.1 times that call plus 5 µs (by how much over, where it is not)."""
    bound = 1.1 * own_us + 5.0
    verdict = "within" if layer_us <= bound else f"{layer_us - bound:.1f} over"
    return f"[{layer_us / own_us:.2f}x; 1.1x + 5: {verdict}]"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sms", type=int, default=24)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--workloads", default="decode,decode-ue8m0,prefill")
    ap.add_argument("--profile", type=int, default=0, metavar="CALLS",
                    help="also profile CALLS calls of each layer side (torch.profiler) and "
                         "print where the time goes")
    ap.add_argument("--host-profile", type=int, default=0, metavar="CALLS",
                    help="also run CALLS calls of each side (layer and epcomm) under cProfile "
                         "with the GPU busy ahead of them, and print the host µs a call and "
                         "where it goes")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    me, n = dist.get_rank(), dist.get_world_size()
    dev_i, per_gpu = epcomm.torch_device()
    torch.cuda.set_device(dev_i)
    dev = torch.device("cuda", dev_i)
    Buffer.set_num_sms(args.sms)
    if me == 0:
        print(f"# {n} rank(s), {torch.cuda.get_device_name(dev)}, {args.sms} SMs per kernel; "
              f"median (min, max) µs over {args.iters} calls")
        if per_gpu > 1:
            print(f"# {per_gpu} ranks share each GPU: the figures are the protocol's fixed "
                  "costs, not link time")
    for name in args.workloads.split(","):
        T, H, K, E, form = WORKLOADS[name]
        ue8m0 = name == "decode-ue8m0"
        sets = [inputs(T, H, K, E, 1000 * s + me, dev) for s in range(3)]
        ids32 = [s[1].to(torch.int32) for s in sets]
        grp = epcomm.Group.from_torch(hidden=H, top_k=K, n_experts=E, max_tokens_per_rank=T,
                                      format=form, num_sms=args.sms, share_gpus=per_gpu > 1,
                                      **({"fp8_pow2_scales": True} if ue8m0 else {}))
        ll_args = {"use_fp8": True, "round_scale": ue8m0, "use_ue8m0": ue8m0}
        buf = Buffer(dist.group.WORLD, low_latency_mode=True, explicitly_destroy=True,
                     max_tokens_per_rank=T)
        rows = grp.sizes.max_recv_rows
        y_native = torch.randn((rows, H), device=dev).to(torch.bfloat16)
        res = {}
        if name.startswith("decode"):
            E_l = E // n
            y_pad = torch.randn((E_l, n * T, H), device=dev).to(torch.bfloat16)
            state = {}
            # epcomm's own call writing DeepEP's padded layout, as the layer's group does
            # (Config.padded_capacity; UE8M0 words for decode-ue8m0): what the layout costs the
            # kernel, apart from the layer's host work.
            grp_p = epcomm.Group.from_torch(
                hidden=H, top_k=K, n_experts=E, max_tokens_per_rank=T, format=form,
                num_sms=args.sms, share_gpus=per_gpu > 1, padded_capacity=n * T,
                **({"fp8_pow2_scales": True, "fp8_ue8m0_scales": True} if ue8m0 else {}))

            def layer_d(i):
                x, idx, _ = sets[i]
                state["h"] = buf.low_latency_dispatch(x, idx, T, E, **ll_args)[2]

            def layer_c(i):
                _, idx, w = sets[i]
                buf.low_latency_combine(y_pad, idx, w, state["h"])

            def native_d(i):
                grp.dispatch(sets[i][0], ids32[i])

            def native_c(i):
                grp.combine(y_native, sets[i][2])

            def padded_d(i):
                grp_p.dispatch(sets[i][0], ids32[i])

            def padded_c(i):
                grp_p.combine(y_pad, sets[i][2])

            for _ in range(args.warmup):
                layer_d(0), layer_c(0), native_d(0), native_c(0), padded_d(0), padded_c(0)
            # Check: the layer's combine of expert rows (y = the dispatched values) equals
            # epcomm's combine of the same values.
            x, idx, w = sets[1]
            recv, count, h, _, _ = buf.low_latency_dispatch(x, idx, T, E, **ll_args)
            scales = ue8m0_scales(recv[1]) if ue8m0 else recv[1]
            deq = (recv[0].float() * scales.repeat_interleave(128, dim=2)).to(torch.bfloat16)
            got, _, _ = buf.low_latency_combine(deq, idx, w, h)
            d = grp.dispatch(x, ids32[1])
            sc = d.scales.t().repeat_interleave(128, dim=1)[: d.tokens.size(0)]
            deq_n = (d.tokens.float() * sc).to(torch.bfloat16)
            want = grp.combine(deq_n, w)
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), "decode check"
            # The padded group writes what the layer returns: each expert's counted rows (codes
            # and scales or UE8M0 words), the same counts.
            p = grp_p.dispatch(x, ids32[1])
            assert torch.equal(p.counts, count), "decode check: padded counts"
            words = p.scales.transpose(1, 2)  # [E_l, cols, S] -> DeepEP's [E_l, S, cols] view
            for e in range(E_l):
                c = int(count[e])
                assert torch.equal(p.tokens[e, :c].view(torch.uint8),
                                   recv[0][e, :c].view(torch.uint8)), "decode check: padded codes"
                assert torch.equal(words[e, :c].view(torch.int32),
                                   recv[1][e, :c].view(torch.int32)), "decode check: padded scales"
            res["dispatch"] = (timed(layer_d, args.iters, sets), timed(native_d, args.iters, sets),
                               timed(padded_d, args.iters, sets))
            res["combine"] = (timed(layer_c, args.iters, sets), timed(native_c, args.iters, sets),
                              timed(padded_c, args.iters, sets))
            # Replayed from a CUDA graph, as serving engines run decode: the layer's dispatch +
            # combine and epcomm's own calls writing the padded layout, each captured once on
            # static inputs. The host's work is gone; what is left is the GPU's.
            sx, sidx, sw = (t.clone() for t in sets[0])
            sids = ids32[0].clone()

            def load(i):
                for dst, src in zip((sx, sidx, sw, sids), sets[i] + (ids32[i],)):
                    dst.copy_(src)

            def layer_step():
                h = buf.low_latency_dispatch(sx, sidx, T, E, **ll_args)[2]
                buf.low_latency_combine(y_pad, sidx, sw, h)

            def padded_step():
                grp_p.dispatch(sx, sids)
                grp_p.combine(y_pad, sw)

            graphs = (graph_timed(layer_step, load, args.iters, sets),
                      graph_timed(padded_step, load, args.iters, sets))
        else:
            state = {}

            def layer_d(i):
                x, idx, w = sets[i]
                pr, _, pe, ir, _ = buf.get_dispatch_layout(idx, E)
                out = buf.dispatch(x, num_tokens_per_rank=pr, is_token_in_rank=ir,
                                   num_tokens_per_expert=pe, topk_idx=idx, topk_weights=w)
                state["x"], state["h"] = out[0], out[4]

            def layer_c(i):
                buf.combine(state["x"], state["h"])

            def native_d(i):
                grp.dispatch(sets[i][0], ids32[i], sets[i][2])

            def native_c(i):
                grp.combine(y_native)

            for _ in range(args.warmup):
                layer_d(0), layer_c(0), native_d(0), native_c(0)
            # Check: combine of the received rows gives each token times the ranks it went to.
            layer_d(1)
            got, _, _ = buf.combine(state["x"], state["h"])
            ranks = torch.zeros((T, n), dtype=torch.bool, device=dev)
            ranks.scatter_(1, sets[1][1] // (E // n), True)
            want = (sets[1][0].float() * ranks.sum(1, keepdim=True)).to(torch.bfloat16)
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), "prefill check"
            res["dispatch"] = (timed(layer_d, args.iters, sets), timed(native_d, args.iters, sets))
            res["combine"] = (timed(layer_c, args.iters, sets), timed(native_c, args.iters, sets))
        if args.profile:
            for side, fn in (("dispatch", layer_d), ("combine", layer_c)):
                if side == "combine":
                    layer_d(0)  # the combine's dispatch
                profiled(fn, args.profile, f"{name} layer {side}", me == 0)
        if args.host_profile:
            host_profiled((("layer dispatch", layer_d), ("epcomm dispatch", native_d)),
                          args.host_profile, name, me == 0)
            layer_d(0)  # the combine's dispatch
            host_profiled((("layer combine", layer_c), ("epcomm combine", native_c)),
                          args.host_profile, name, me == 0)
        if me == 0:
            for side, (lay, nat, *pad) in res.items():
                print(f"{name:8s} {side:8s} layer {fmt(lay)}  epcomm {fmt(nat)}  "
                      f"layer cost {lay[0] - nat[0]:7.1f} {against(lay[0], nat[0])}" +
                      (f"  epcomm padded {fmt(pad[0])}  layer cost over it "
                       f"{lay[0] - pad[0][0]:7.1f}" if pad else ""))
            if name.startswith("decode"):
                lay, pad = graphs
                print(f"{name:8s} graph    layer {lay[0]:8.1f} ({lay[1]:.1f}, {lay[2]:.1f})  "
                      f"epcomm padded {pad[0]:8.1f} ({pad[1]:.1f}, {pad[2]:.1f})  layer cost "
                      f"{lay[0] - pad[0]:7.1f} {against(lay[0], pad[0])}  (dispatch + combine, "
                      "replayed)")
        buf.destroy()
        grp.close()
        if name.startswith("decode"):
            grp_p.close()
    if me == 0:
        print("check: every layer result equals epcomm's")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
