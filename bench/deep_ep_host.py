"""The DeepEP layer's host time per low-latency call, without a GPU: epcomm.deep_ep's Python
path (argument checks, output allocation, handle, the call into C++) runs against a fake group
that takes its calls instead of launching kernels, on tensors of torch's "meta" device (shapes,
no memory: an allocation costs its Python and dispatch work, about what the CUDA caching
allocator's does). On a GPU machine the
layer's decode cost over epcomm's own call (bench/deep_ep_bench.py) is mostly this host time,
so a change to the layer's Python can be weighed here first:

    python bench/deep_ep_host.py [--calls 2000] [--profile 500]

The figures are host work on this machine's CPU: compare them with each other, on one machine,
not with a GPU machine's."""

import argparse
import cProfile
import io
import pstats
import time

import torch
import torch.distributed as dist

from epcomm import deep_ep
from epcomm.deep_ep import Buffer, EventOverlap


class _FakeImpl:
    """Stands for the C++ group: takes the calls the layer makes and does nothing. (Whether the
    layer calls it with the binding's arguments is python/tests/test_deep_ep.py's check.)"""

    def __getattr__(self, name):
        return _nothing


def _nothing(*args):
    pass


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--profile", type=int, default=0, metavar="CALLS",
                    help="also run CALLS calls of each side under cProfile and print where the "
                         "time goes")
    args = ap.parse_args()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    T, H, K, E = 128, 7168, 8, 256  # the benchmark's decode
    buf = Buffer(dist.group.WORLD, low_latency_mode=True, explicitly_destroy=True,
                 max_tokens_per_rank=T)
    impl = _FakeImpl()

    class FakeGroup:
        _impl = impl

        def close(self):
            pass

    buf._on_device = lambda call, **tensors: None
    buf._group = lambda key, **config: buf._groups.setdefault(key, FakeGroup())
    buf._comm_handle = 2  # the comm stream
    buf._tail = 1  # as after a first call: plain calls stay on the current stream
    buf._ll_finish = lambda async_finish, stats, count, tensors: EventOverlap()
    deep_ep._current_stream_handle = lambda device: 1
    meta = torch.device("meta")
    x = torch.empty((T, H), dtype=torch.bfloat16, device=meta)
    idx = torch.empty((T, K), dtype=torch.int64, device=meta)
    w = torch.empty((T, K), dtype=torch.float32, device=meta)
    y = torch.empty((E, T, H), dtype=torch.bfloat16, device=meta)
    state = {}

    def dispatch():
        state["h"] = buf.low_latency_dispatch(x, idx, T, E)[2]

    def combine():
        buf.low_latency_combine(y, idx, w, state["h"])

    for name, fn in (("dispatch", dispatch), ("combine", combine)):
        dispatch()  # combine's handle: the last dispatch
        for _ in range(100):
            fn()
        t0 = time.perf_counter()
        for _ in range(args.calls):
            fn()
        us = (time.perf_counter() - t0) / args.calls * 1e6
        print(f"low_latency_{name}: {us:.1f} µs of host time a call ({args.calls} calls, CPU, "
              "fake group)")
        if args.profile:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.profile):
                fn()
            prof.disable()
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(10)
            print("\n".join(out.getvalue().strip().splitlines()[2:]))
    buf.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
