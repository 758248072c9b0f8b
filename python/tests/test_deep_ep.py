"""epcomm.deep_ep, DeepEP's Buffer API: the argument checks (every rejected argument, no GPU
needed) and, on a GPU, deep_ep_worker.py under torchrun with 1, 2 and 4 processes sharing the
GPUs there are. Skipped, with the reason, without PyTorch (and the GPU part without a GPU)."""

import contextlib

import launch  # python/tests/launch.py
import pytest

torch = pytest.importorskip("torch", reason="epcomm.deep_ep needs PyTorch")
import torch.distributed as dist  # noqa: E402

import epcomm  # noqa: E402
from epcomm import deep_ep  # noqa: E402
from epcomm.deep_ep import Buffer, Config, EventOverlap  # noqa: E402


@pytest.fixture(scope="module")
def world():
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD


@pytest.fixture
def buf(world):
    return Buffer(world, int(1e6), 0, low_latency_mode=True, explicitly_destroy=True,
                  max_tokens_per_rank=32)


def raises(match, fn, *args, **kwargs):
    with pytest.raises(epcomm.InvalidArgument, match=match) as e:
        fn(*args, **kwargs)
    assert isinstance(e.value, ValueError)
    return e.value


def test_import_surface():
    assert deep_ep.topk_idx_t is torch.int64
    for name in ("Buffer", "Config", "EventOverlap", "topk_idx_t"):
        assert hasattr(deep_ep, name)
    cfg = Buffer.get_dispatch_config(8)
    assert isinstance(cfg, Config) and cfg.num_sms == Buffer.num_sms
    assert Config(24, 6, 256).get_rdma_buffer_size_hint(7168 * 2, 8) == 0
    assert Config(24, 6, 256).get_nvl_buffer_size_hint(7168 * 2, 8) > 0
    assert Buffer.get_low_latency_rdma_size_hint(128, 7168, 8, 256) > 0
    ev = EventOverlap(None)
    with ev:  # no event: nothing to wait for
        pass
    with pytest.raises(epcomm.Error, match="no event"):
        ev.current_stream_wait()


def test_constructor_rejects_what_it_cannot_honour(world):
    raises("comm", Buffer, world, comm=object())
    raises("group must be", Buffer, None)
    raises("allow_nvlink_for_low_latency_mode", Buffer, world,
           allow_nvlink_for_low_latency_mode=False)
    # allow_mnnvl (SGLang passes it always) means nothing on one node: accepted.
    assert Buffer(world, allow_mnnvl=True, explicitly_destroy=True).allow_mnnvl
    raises("enable_shrink", Buffer, world, enable_shrink=True)
    raises("max_tokens_per_rank", Buffer, world, max_tokens_per_rank=0)
    raises("new_num_sms", Buffer.set_num_sms, 0)
    raises("num_sms", Config, 0)
    with pytest.raises(TypeError):
        Buffer(world, no_such_argument=1)


def test_buffer_calls_reject_bad_arguments(buf):
    T, H, K, E = 4, 256, 2, 8
    x = torch.ones((T, H), dtype=torch.bfloat16)
    idx = torch.zeros((T, K), dtype=torch.int64)
    w = torch.ones((T, K), dtype=torch.float32)
    raises("topk_idx must be torch.int64", buf.get_dispatch_layout, idx.int(), E)
    raises("num_experts", buf.get_dispatch_layout, idx, 0)
    raises("allocate_on_comm_stream", buf.get_dispatch_layout, idx, E,
           allocate_on_comm_stream=True)
    in_rank = torch.ones((T, 1), dtype=torch.bool)
    per_e = torch.zeros(E, dtype=torch.int32)
    d = dict(is_token_in_rank=in_rank, num_tokens_per_expert=per_e)
    raises("x must be torch.bfloat16", buf.dispatch, x.float(), **d)
    raises("x must be 2-D", buf.dispatch, x.view(-1), **d)
    raises("x must be contiguous", buf.dispatch, x.t(), **d)
    raises(r"x\[0\] must be a 1-byte", buf.dispatch, (x, torch.ones(T, 2)), **d)
    raises(r"x\[1\] must have 4 rows", buf.dispatch,
           (torch.ones((T, H), dtype=torch.uint8), torch.ones(T + 1, 2)), **d)
    raises("max_tokens_per_rank", buf.dispatch, torch.ones((33, H), dtype=torch.bfloat16),
           **dict(d, is_token_in_rank=torch.ones((33, 1), dtype=torch.bool)))
    raises("num_tokens_per_rdma_rank", buf.dispatch, x, num_tokens_per_rdma_rank=per_e, **d)
    raises("is_token_in_rank must be torch.bool", buf.dispatch, x,
           **dict(d, is_token_in_rank=in_rank.int()))
    raises("num_tokens_per_expert must be torch.int32", buf.dispatch, x,
           **dict(d, num_tokens_per_expert=per_e.long()))
    raises("together", buf.dispatch, x, topk_idx=idx, **d)
    raises("topk_idx must be torch.int64", buf.dispatch, x, topk_idx=idx.int(), topk_weights=w,
           **d)
    raises("topk_weights must be torch.float32", buf.dispatch, x, topk_idx=idx,
           topk_weights=w.double(), **d)
    raises("num_worst_tokens needs topk_idx", buf.dispatch, x, num_worst_tokens=8, **d)
    wide = torch.zeros((T, 1025), dtype=torch.int64)  # before any launch (received_topk's bound)
    raises("1025 columns; at most 1024", buf.dispatch, x, topk_idx=wide,
           topk_weights=torch.ones((T, 1025)), **d)
    raises("12289 experts a rank; at most 12288", buf.dispatch, x, topk_idx=idx, topk_weights=w,
           **dict(d, num_tokens_per_expert=torch.zeros(12289, dtype=torch.int32)))
    raises("expert_alignment", buf.dispatch, x, expert_alignment=0, **d)
    raises("handle must come from", buf.dispatch, x, handle=object())
    raises("handle must come from", buf.combine, x, object())
    # Low-latency mode.
    ll = (x, idx, 8, E)
    raises("use_ue8m0=True needs round_scale=True", buf.low_latency_dispatch, *ll,
           use_ue8m0=True)
    raises("need use_fp8=True", buf.low_latency_dispatch, *ll, round_scale=True, use_fp8=False)
    raises("multiple of 512 with use_ue8m0", buf.low_latency_dispatch, *ll, round_scale=True,
           use_ue8m0=True)  # H = 256
    raises("dispatch_wait_recv_cost_stats", buf.low_latency_dispatch, *ll,
           dispatch_wait_recv_cost_stats=torch.zeros(1, dtype=torch.int64))
    raises("cannot both", buf.low_latency_dispatch, *ll, async_finish=True,
           return_recv_hook=True)
    raises("x must be torch.bfloat16", buf.low_latency_dispatch, x.half(), idx, 8, E)
    raises("topk_idx must be torch.int64", buf.low_latency_dispatch, x, idx.int(), 8, E)
    raises("num_max_dispatch_tokens_per_rank", buf.low_latency_dispatch, x, idx, 2, E)
    raises("num_experts", buf.low_latency_dispatch, x, idx, 8, 0)
    raises("at most 16", buf.low_latency_dispatch, x, torch.zeros((T, 17), dtype=torch.int64),
           8, E)
    raises("multiple of 128", buf.low_latency_dispatch, x[:, :96].contiguous(), idx, 8, E)
    raises("cumulative_local_expert_recv_stats", buf.low_latency_dispatch, *ll,
           cumulative_local_expert_recv_stats=torch.zeros(3, dtype=torch.int32))
    raises("use_logfmt", buf.low_latency_combine, x, idx, w, None, use_logfmt=True)
    raises("combine_wait_recv_cost_stats", buf.low_latency_combine, x, idx, w, None,
           combine_wait_recv_cost_stats=torch.zeros(1))
    raises("handle must come from", buf.low_latency_combine, x, idx, w, None)
    raises("handle must come from", buf.get_next_low_latency_combine_buffer, None)
    raises("get_local_buffer_tensor", buf.get_local_buffer_tensor, torch.bfloat16)
    # Shrink mode's calls (vLLM's fault tolerance) and the internode kernels: present, refused.
    for call, args in (("low_latency_update_mask_buffer", (1, True)),
                       ("low_latency_query_mask_buffer", (torch.zeros(1, dtype=torch.int32),)),
                       ("low_latency_clean_mask_buffer", ())):
        raises(rf"{call}: needs shrink mode \(Buffer\(\.\.\., enable_shrink=True\)\)",
               getattr(buf, call), *args)
    for call in ("internode_dispatch", "internode_combine"):
        raises(rf"{call}: this layer runs groups within one node", getattr(buf, call), None)
    # Valid arguments on the CPU: the last check names the tensor and the GPU it needs.
    raises("x is on cpu", buf.low_latency_dispatch, *ll)


def test_handle_indexes_like_deep_eps_tuple(buf):
    # A normal-mode handle as dispatch leaves it (one rank: the gather is over a group of one).
    from epcomm.deep_ep import _Routing
    h = _Routing(buf, 5, 8, 0)
    h.tokens_to_rank = torch.tensor([4], dtype=torch.int32)
    h.is_token_in_rank = torch.tensor([[True], [True], [False], [True], [True]])
    assert len(h) == 6
    assert h[0].tolist() == [[4]] and h[0].dtype == torch.int32
    assert h[-6] is h[0]  # gathered once, then kept
    assert h[4] is h.is_token_in_rank
    for i in (1, 2, 5):
        raises(rf"handle\[{i}\] .* DeepEP's channels", h.__getitem__, i)
    raises(r"handle\[3\] \(recv_src_idx\) is not kept", h.__getitem__, 3)
    with pytest.raises(IndexError):
        h[6]
    with pytest.raises(TypeError):
        h["rank_prefix_matrix"]


def test_collective_helper_leaves_its_input(world):
    from epcomm.deep_ep import _collective
    t = torch.tensor([3, 1, 2], dtype=torch.int32)
    total = _collective(world, t, "all_reduce")
    assert total.tolist() == [3, 1, 2] and total.data_ptr() != t.data_ptr()
    parts = _collective(world, t, "all_gather")
    assert len(parts) == 1 and parts[0].tolist() == [3, 1, 2]
    assert t.tolist() == [3, 1, 2]


def test_worker_fp8_casts_match_the_reference():
    # deep_ep_worker.py's torch casts (its GPU checks' oracle) against epcomm's CPU reference,
    # bit for bit: the default scales, and round_scale's powers of two with their UE8M0 words.
    import numpy as np
    import deep_ep_worker as w
    R = epcomm.reference
    p = R.make_problem(1, w.H, 4, 16, [40], 7)
    x = torch.from_numpy(p.tokens(0).astype(np.int16)).view(torch.bfloat16)
    for pow2 in (False, True):
        q = R.dispatch_quantized(p, 0, "fp8-blockwise", fp8_pow2_scales=pow2)
        ld = q.out_rows
        scales = np.frombuffer(q.scales.tobytes(), dtype=np.float32)
        codes = torch.from_numpy(q.codes.copy())
        ref_q, ref_s = w.fp8_cast(x, pow2)
        rows = [(r, int(t)) for r, (t, _) in enumerate(q.src_info) if t >= 0]  # not padding
        assert len(rows) > 40
        for r, t in rows:
            assert torch.equal(codes[r], ref_q[t].view(torch.uint8)), (pow2, r, t)
            got = torch.tensor([scales[c * ld + r] for c in range(w.H // 128)])
            assert torch.equal(got, ref_s[t]), (pow2, r, t)
        if pow2:
            assert bool(((ref_s.view(torch.int32) & 0x7fffff) == 0).all())  # powers of two
            words = w.pack_ue8m0(ref_s)
            assert words.shape == (40, w.H // 512) and words.dtype == torch.int32
            unpacked = w.ll_scales_f32(words.unsqueeze(0), "ue8m0")[0]
            assert torch.equal(unpacked, ref_s)
            # As the layer hands them over: token-major words (here one column, H = 512).
            strided = torch.empty_strided((1, 40, 1), (40, 1, 40), dtype=torch.int32)
            strided.copy_(words.unsqueeze(0))
            assert strided.stride(-1) != 1
            assert torch.equal(w.ll_scales_f32(strided, "ue8m0")[0], ref_s)


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU visible")


def _normal_case(fp8):
    """Normal-mode rows of 5 tokens, top-3, rank 1 of 2 with 8 experts each; the ids hold one no
    int32 holds (2^32 + 9, which truncated would be this rank's expert 9)."""
    T, H, K, R, E, rank = 5, 256, 3, 2, 16, 1
    codes = (torch.randint(0, 255, (T, H), dtype=torch.uint8) if fp8
             else torch.randn(T, H).to(torch.bfloat16))
    scales = torch.rand(T, H // 128) if fp8 else None
    idx = torch.tensor([[9, 3, -1], [2**32 + 9, 15, 8], [0, 1, 2], [10, -1, 11], [12, 13, 14]],
                       dtype=deep_ep.topk_idx_t)
    w = torch.rand(T, K)
    return codes, scales, idx, w, K, E // R, rank


@pytest.mark.parametrize("fp8", [False, True])
def test_normal_rows_carry_ids_scales_and_weights(fp8):
    """The normal-mode dispatch's rows (_normal_rows): the codes, then the int64 ids, the scales
    and the weights where _NormalMeta (which _normal_topk's launch reads by) puts them."""
    codes, scales, idx, w, K, _, _ = _normal_case(fp8)
    rows = deep_ep._normal_rows(codes, scales, idx, w).view(torch.int32)
    cw = codes.view(torch.uint8).size(1) // 4
    S = 0 if scales is None else scales.size(1)
    layout = deep_ep._NormalMeta(K, S)
    assert rows.size(1) % 4 == 0 and rows.size(1) >= cw + layout.words
    assert torch.equal(rows[:, :cw], codes.view(torch.uint8).view(torch.int32))
    meta = rows[:, cw:]
    assert torch.equal(meta[:, layout.ids].contiguous().view(deep_ep.topk_idx_t), idx)
    assert torch.equal(meta[:, layout.weights].view(torch.float32), w)
    if fp8:
        assert torch.equal(meta[:, layout.scales].view(torch.float32), scales)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
def test_normal_topk_reads_the_received_rows(fp8):
    """What a rank reads back from received rows (_normal_topk, one launch of received_topk):
    its experts as local ids, their weights, the rows received and the slots per local expert;
    the int64 ids travel whole, so 2^32 + 9 is dropped like any bad id, not taken for expert 1.
    Outputs past the received rows are -1 / 0."""
    codes, scales, idx, w, K, n_local, rank = _normal_case(fp8)
    dev = torch.device("cuda")
    rows = deep_ep._normal_rows(codes.to(dev), None if scales is None else scales.to(dev),
                                idx.to(dev), w.to(dev)).view(torch.int32)
    cw = codes.view(torch.uint8).size(1) // 4
    S = 0 if scales is None else scales.size(1)
    received = torch.tensor([4], dtype=torch.int32, device=dev)  # the fifth row did not arrive
    stream = torch.cuda.current_stream()
    ids, weights, counts = deep_ep._normal_topk(rows, cw, K, S, rank * n_local, n_local,
                                                received, stream.cuda_stream)
    torch.cuda.synchronize()
    want = torch.tensor([[1, -1, -1], [-1, 7, 0], [-1, -1, -1], [2, -1, 3], [-1, -1, -1]])
    assert ids.dtype == deep_ep.topk_idx_t and torch.equal(ids.cpu(), want)
    assert torch.equal(weights.cpu(), torch.where(want >= 0, w, 0.0))
    assert counts.cpu().tolist() == [4, 1, 1, 1, 1, 0, 0, 0, 1]


def test_normal_rows_take_ids_of_any_contiguous_strides():
    # [T, 1] from a transpose: contiguous to torch, yet a last-dimension stride of T.
    T, H = 5, 128
    idx = torch.tensor([[9, 3, 8, 2**32, 15]], dtype=deep_ep.topk_idx_t).t()
    assert idx.is_contiguous() and idx.stride(1) != 1
    codes = torch.randn(T, H).to(torch.bfloat16)
    w = torch.rand(T, 1)
    meta = deep_ep._normal_rows(codes, None, idx, w).view(torch.int32)[:, H // 2:]
    layout = deep_ep._NormalMeta(1, 0)
    assert torch.equal(meta[:, layout.ids].contiguous().view(deep_ep.topk_idx_t), idx)


def test_max_tokens_from_the_environment(world, monkeypatch):
    # Frameworks build the Buffer themselves: the normal-mode cap can come from the environment.
    monkeypatch.delenv("EPCOMM_DEEP_EP_MAX_TOKENS", raising=False)
    assert Buffer(world).max_tokens_per_rank == 4096
    monkeypatch.setenv("EPCOMM_DEEP_EP_MAX_TOKENS", "16384")
    b = Buffer(world)
    assert b.max_tokens_per_rank == 16384
    assert Buffer(world, max_tokens_per_rank=8).max_tokens_per_rank == 8  # the argument wins
    x = torch.ones((16385, 128), dtype=torch.bfloat16)
    raises("EPCOMM_DEEP_EP_MAX_TOKENS", b.dispatch, x,
           is_token_in_rank=torch.ones((16385, 1), dtype=torch.bool),
           num_tokens_per_expert=torch.zeros(8, dtype=torch.int32))
    monkeypatch.setenv("EPCOMM_DEEP_EP_MAX_TOKENS", "lots")
    raises("EPCOMM_DEEP_EP_MAX_TOKENS", Buffer, world)


def test_low_latency_needs_the_mode(world):
    b = Buffer(world, low_latency_mode=False)
    raises("low_latency_mode=False", b.low_latency_dispatch,
           torch.ones((1, 128), dtype=torch.bfloat16), torch.zeros((1, 1), dtype=torch.int64),
           8, 8)
    raises("explicitly_destroy=False", b.destroy)


def test_event_handle_and_overlap_as_deepep(world):
    """DeepEP's EventHandle is exported (Megatron builds EventOverlap(EventHandle()) as a
    previous_event); EventOverlap waits through the event's own current_stream_wait, runs a
    registered hook once after the wait, and drops the event with release_handle (also as
    `with ev(release_handle=True):`)."""
    assert "EventHandle" in deep_ep.__all__ and issubclass(deep_ep.EventHandle, torch.cuda.Event)

    class FakeHandle:
        waits = 0

        def current_stream_wait(self):
            FakeHandle.waits += 1

    hooks = []
    ev = EventOverlap(FakeHandle())
    ev.register_hook_after_wait(lambda: hooks.append(1))
    with pytest.raises(epcomm.Error, match="already registered"):
        ev.register_hook_after_wait(lambda: None)
    ev.current_stream_wait()
    ev.current_stream_wait()
    assert FakeHandle.waits == 2 and hooks == [1] and ev.event is not None
    with ev(release_handle=True):
        pass
    assert FakeHandle.waits == 3 and ev.event is None
    with ev:  # no event left: nothing to wait for
        pass
    with pytest.raises(epcomm.Error, match="no event"):
        ev.current_stream_wait()


def test_buffer_is_freed_when_dropped(world):
    """A normal-mode handle refers to its Buffer weakly, so the Buffer (which keeps its last
    routings) is freed, and its groups torn down, when the caller drops it, at the same point on
    every rank, not whenever the cycle collector runs; a handle outliving it says so."""
    import gc
    import weakref

    b = Buffer(world, int(1e6), 0, max_tokens_per_rank=32)
    r = deep_ep._Routing(b, 1, 8, 0)
    b._routing["key"] = r
    assert r.buffer is b
    gc.disable()
    try:
        alive = weakref.ref(b)
        del b
        assert alive() is None, "freed by its reference count, with no cycle"
    finally:
        gc.enable()
    assert r.buffer is None
    with pytest.raises(epcomm.Error, match="Buffer of this dispatch is gone"):
        r[0]


def test_destroyed_buffer_refuses_calls(buf):
    buf.destroy()
    raises("destroyed", buf.get_dispatch_layout, torch.zeros((1, 1), dtype=torch.int64), 8)


def torchrun(nproc, *args, timeout=500):
    launch.torchrun("deep_ep_worker.py", nproc, *args, timeout=timeout)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("nproc", [1, 2, 4])
def test_deep_ep_calls_under_torchrun(nproc):
    torchrun(nproc)


@pytest.mark.parametrize("use_fp8", [False, True])
def test_low_latency_calls_trace_whole(buf, use_fp8):
    # torch.compile(fullgraph=True) of a layer's low-latency dispatch, expert and combine: no
    # graph break, and the graph holds the two operators (run on a GPU by deep_ep_worker.py).
    # The backend only records the graph: its outputs are zeros of the traced shapes.
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        vals = [a.meta.get("val", a.meta.get("example_value")) for a in out]
        return lambda *args: [torch.zeros(v.shape, dtype=v.dtype) for v in vals]

    T, H, K, E, max_t = 5, 256, 2, 8, 8

    def layer(x, idx, w):
        recv_x, count, handle, event, hook = buf.low_latency_dispatch(x, idx, max_t, E,
                                                                      use_fp8=use_fp8)
        assert hook is None
        if use_fp8:
            codes, scales = recv_x
            y = (codes.float() * scales.repeat_interleave(128, dim=2)).to(torch.bfloat16)
        else:
            y = recv_x * 2
        out, event, hook = buf.low_latency_combine(y, idx, w, handle)
        return out, count

    torch._dynamo.reset()
    x = torch.randn(T, H).to(torch.bfloat16)
    idx = torch.randint(0, E, (T, K), dtype=torch.int64)
    w = torch.rand(T, K)
    out, count = torch.compile(layer, fullgraph=True, backend=record)(x, idx, w)
    assert out.shape == (T, H) and out.dtype == torch.bfloat16
    assert count.shape == (E,) and count.dtype == torch.int32
    code = str(graphs[0].graph)
    assert "epcomm_deep_ep.ll_dispatch" in code and "epcomm_deep_ep.ll_combine" in code


def test_low_latency_traced_calls_refuse_what_they_cannot_trace(buf):
    x = torch.randn(3, 256).to(torch.bfloat16)
    idx = torch.zeros((3, 2), dtype=torch.int64)

    def hooked(x, idx):
        return buf.low_latency_dispatch(x, idx, 8, 8, use_fp8=False, return_recv_hook=True)[1]

    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported, match="only plain calls are traced"):
        torch.compile(hooked, fullgraph=True, backend="eager")(x, idx)


def test_low_latency_traced_calls_run_in_program_order(buf, monkeypatch):
    # Compiled through AOTAutograd (functionalisation), as inductor compiles it: the operators
    # run in program order, a dispatch whose outputs go unused still runs, and the cumulative
    # stats are added. The operators' eager work is replaced by CPU stand-ins that allocate as
    # the eager call does and record the order.
    import epcomm.deep_ep as D
    calls = []

    def dispatch(b, x, topk_idx, max_t, num_experts, use_fp8, round_scale, use_ue8m0):
        calls.append("d")
        codes, scales, ue8m0, count, src_info, layout_range = D._ll_outputs(
            b.group_size, num_experts, max_t, x.size(1), x.device, use_fp8, use_ue8m0)
        count.fill_(len(calls))
        src_info.fill_(len(calls))  # which dispatch, for the combine to record
        return (codes.zero_(), D._ll_returned_scales(scales, ue8m0, x.device), count, src_info,
                layout_range.zero_())

    def combine(b, x, topk_idx, topk_weights, src_info):
        calls.append(f"c{int(src_info.flatten()[0])}")
        return torch.full((topk_idx.size(0), x.size(2)), float(len(calls)), dtype=torch.bfloat16)

    monkeypatch.setattr(D, "_ll_dispatch_eager", dispatch)
    monkeypatch.setattr(D, "_ll_combine_eager", combine)
    T, H, K, E, max_t = 4, 128, 2, 8, 8
    stats = torch.zeros(E, dtype=torch.int32)

    def layer(x, idx, w):
        r1, c1, h1, _, _ = buf.low_latency_dispatch(x, idx, max_t, E, use_fp8=False,
                                                    cumulative_local_expert_recv_stats=stats)
        r2, c2, h2, _, _ = buf.low_latency_dispatch(x, idx, max_t, E, use_fp8=False)
        o1, _, _ = buf.low_latency_combine(r1 * 2, idx, w, h1)
        buf.low_latency_dispatch(x, idx, max_t, E, use_fp8=False)  # outputs unused
        o2, _, _ = buf.low_latency_combine(r2 * 2, idx, w, h2)
        return o1, o2

    torch._dynamo.reset()
    x = torch.randn(T, H).to(torch.bfloat16)
    idx = torch.randint(0, E, (T, K), dtype=torch.int64)
    w = torch.rand(T, K)
    o1, o2 = torch.compile(layer, fullgraph=True, backend="aot_eager")(x, idx, w)
    assert calls == ["d", "d", "c1", "d", "c2"]
    assert float(o1[0, 0]) == 3.0 and float(o2[0, 0]) == 5.0
    assert stats.tolist() == [1] * E  # the first dispatch's counts, added once


def test_stream_of_a_handle_is_that_stream(monkeypatch):
    """A raw stream handle becomes the torch stream with that handle: the default stream for 0.
    torch.cuda.ExternalStream(0) would be a fresh stream from torch's pool (it reads a null
    pointer as none given), so the comm stream's wait for a call that stayed on the default
    stream, and a hook's counter update, would be ordered with nothing (seen on a GPU: the
    receive hook's cumulative_local_expert_recv_stats added counts not yet received)."""
    made = []
    monkeypatch.setattr(torch.cuda, "default_stream", lambda device: ("default", device))
    monkeypatch.setattr(torch.cuda, "ExternalStream",
                        lambda handle, device: made.append(handle) or ("ext", handle, device))
    assert deep_ep._stream_of(0, 3) == ("default", 3)
    assert made == []
    assert deep_ep._stream_of(0x7F00, 3) == ("ext", 0x7F00, 3)
    assert made == [0x7F00]


def test_calls_keep_deepep_order_across_streams(buf, monkeypatch):
    """DeepEP queues every call on its comm stream, so each call runs after the Buffer's
    earlier calls whatever stream they came from. Buffer._order keeps that while letting a plain
    call stay on the current stream where the Buffer's earlier work all precedes what that
    stream queues next; elsewhere the comm stream also waits for the stream that
    holds the Buffer's last work, with previous_event too (a failed call leaves it to the comm
    stream)."""
    waits = []
    monkeypatch.setattr(buf, "_comm_waits_for", waits.append)
    ev = object()  # a previous_event
    steps = [  # (current stream, previous_event, async_finish, joined) -> (comm?, waits)
        ((1, None, False, True), (True, [])),    # first call: nothing joined yet
        ((1, None, False, False), (False, [])),  # plain, same stream: stays
        ((1, ev, True, False), (True, [1])),     # previous_event: after the call on 1 too
        ((1, None, False, True), (True, [])),    # behind the async call, joined
        ((2, None, True, False), (True, [])),    # the comm stream holds every call so far
        ((3, None, False, True), (True, [])),    # behind the async call (comm's order)
        ((3, None, False, False), (False, [])),  # stays on 3
        ((2, None, True, False), (True, [3])),   # from 2: after what stayed on 3 too
        ((2, None, False, True), (True, [])),
        ((2, None, False, False), (False, [])),
        ((2, ev, False, False), (True, [2])),    # fails after its launch: not joined
        ((2, None, False, True), (True, [])),    # so the next call goes behind it
        ((2, None, False, False), (False, [])),
    ]
    buf._tail = None
    for (stream, prev, async_finish, joined), (on_comm, waited) in steps:
        assert buf._order(stream, prev, async_finish) == on_comm, (stream, prev)
        assert waits == waited, (stream, prev, async_finish)
        waits.clear()
        if joined:
            buf._joined(stream)
    # Once the caller has the comm stream, every call runs there (it may queue work there, or
    # wait for it to cover the calls), and the comm stream first waits for the call that
    # stayed (on 2).
    monkeypatch.setattr(buf, "_stream", "the comm stream")  # made already: no CUDA here
    # (While a graph is captured it orders nothing; the next call on the comm stream will.)
    monkeypatch.setattr(deep_ep, "_capturing", lambda: True)
    assert buf.get_comm_stream() == "the comm stream" and waits == [] and buf._stayed
    monkeypatch.setattr(deep_ep, "_capturing", lambda: False)
    assert buf.get_comm_stream() == "the comm stream" and waits == [2]
    waits.clear()
    assert buf._order(2, None, False) and waits == []
    buf._joined(2)
    assert buf._order(2, None, False) and waits == []


class _FakeStream:
    """A torch stream stand-in: its CUDA handle, and a log of what it was made to wait for."""

    def __init__(self, handle):
        self.cuda_stream, self.log = handle, []

    def wait_stream(self, other):
        self.log.append(("stream", other.cuda_stream))

    def wait_event(self, event):
        self.log.append(("event", event))


def _no_stream_switch(stream):
    """torch.cuda.stream for a _FakeStream: no switch (on a machine with a GPU, the real one
    would make the fake current)."""
    return contextlib.nullcontext()


def test_normal_calls_streams_with_fake_streams(buf, monkeypatch):
    """_streams and _finish without a GPU: on the comm stream a call waits for the current
    stream (or previous_event, and a stream calls stayed on), the outputs it made there are
    recorded for the current stream, which then waits for it and becomes the Buffer's last; a
    plain call from that stream stays on it (no wait, record or join); get_comm_stream() puts
    the comm stream after the calls that stayed."""
    class Output:
        def __init__(self):
            self.recorded = []

        def record_stream(self, stream):
            self.recorded.append(stream.cuda_stream)

    compute, comm = _FakeStream(11), _FakeStream(22)
    waits, out = [], Output()
    monkeypatch.setattr(deep_ep.torch.cuda, "current_stream", lambda device=None: compute)
    monkeypatch.setattr(buf, "_stream", comm)
    monkeypatch.setattr(buf, "_comm_waits_for", waits.append)
    buf._tail = None
    c, s = buf._streams("dispatch", None, False, False)  # nothing joined yet: the comm stream
    assert (c, s) == (compute, comm) and comm.log == [("stream", 11)]
    buf._finish(c, s, False, (), (out,))
    assert out.recorded == [11] and compute.log == [("stream", 22)] and buf._tail == 11
    c, s = buf._streams("combine", None, False, False)  # plain, from the last stream: stays
    assert s is compute and len(comm.log) == 1
    buf._finish(c, s, False, (), (out,))
    assert out.recorded == [11] and len(compute.log) == 1 and buf._tail == 11
    # previous_event: the comm stream waits for it and for the call that stayed.
    c, s = buf._streams("dispatch", EventOverlap("ev"), True, True)
    assert s is comm and comm.log[1:] == [("event", "ev")] and waits == [11]
    assert buf._tail is None
    waits.clear()
    c, s = buf._streams("dispatch", None, False, False)  # behind the async call, joined
    buf._finish(c, s, False, (), ())
    assert s is comm and buf._tail == 11 and waits == []
    assert buf._streams("dispatch", None, False, False)[1] is compute
    assert buf.get_comm_stream() is comm and waits == [11]
    assert buf._streams("dispatch", None, False, False)[1] is comm  # none stays any more


class _Recorder:
    """A fake epcomm group's C++ side: records each call (name, arguments), after checking that
    the real binding (epcomm._epcomm.Group) takes that many arguments."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        signature = getattr(epcomm._epcomm.Group, name).__doc__.splitlines()[0]
        params = signature[signature.index("(") + 1:signature.index(")")].split(", ")[1:]

        def call(*args):
            assert len(args) == len(params), f"{name}{tuple(args)} against {signature}"
            self.calls.append((name, args))
        return call


def _fake_low_latency(buf, monkeypatch, current, comm):
    """The Buffer's low-latency calls against a _Recorder group, with stream handles for
    streams (`current` the current one, `comm` the comm stream) and no device or event work."""
    impl = _Recorder()

    class FakeGroup:
        _impl = impl

    monkeypatch.setattr(buf, "_on_device", lambda call, **tensors: None)
    monkeypatch.setattr(buf, "_group", lambda key, **c: buf._groups.setdefault(key, FakeGroup()))
    monkeypatch.setattr(buf, "_comm_handle", comm)
    monkeypatch.setattr(buf, "_ll_finish", lambda *args: EventOverlap())
    monkeypatch.setattr(deep_ep, "_current_stream_handle", lambda device: current)
    return impl


def test_low_latency_calls_captured_where_they_warmed_up(buf, monkeypatch):
    """As vLLM and SGLang capture decode: warm up on a stream, then capture a CUDA graph on that
    same stream. The captured plain calls stay on it (no fork, no wait on another stream), and
    the Buffer still knows where its work is ordered (a call that stayed does not forget it,
    which once made the captured combine wait on no stream and synchronise inside the
    capture)."""
    s, comm = 11, 22
    capturing, waits = [False], []
    impl = _fake_low_latency(buf, monkeypatch, s, comm)
    monkeypatch.setattr(buf, "_comm_waits_for", waits.append)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    monkeypatch.setattr(torch.cuda, "synchronize",
                        lambda *a: pytest.fail("synchronised (inside a capture)"))
    x = torch.randn((3, 512)).to(torch.bfloat16)
    idx = torch.randint(0, 8, (3, 2))
    w = torch.rand((3, 2))
    y = torch.randn((8, 4, 512)).to(torch.bfloat16)

    def layer():
        _, _, handle, _, _ = buf.low_latency_dispatch(x, idx, 4, 8)
        buf.low_latency_combine(y, idx, w, handle)
        on = [args[-3] for name, args in impl.calls]  # each call's stream ("on")
        impl.calls.clear()
        return on

    assert layer() == [comm, s]  # the first call joins back; the combine stays
    capturing[0] = True
    assert layer() == [s, s] and waits == []  # captured where they warmed up
    assert buf._tail == s
    capturing[0] = False
    assert layer() == [s, s] and waits == []


def test_low_latency_calls_that_fail_keep_their_tensors(buf, monkeypatch):
    """A low-latency call that fails in C++ may have launched on the comm stream: dispatch and
    combine alike hand their tensors to _failed (kept for the comm stream, the caller's
    stream ordered after it), then raise."""
    failed = []
    impl = _fake_low_latency(buf, monkeypatch, 11, 22)
    monkeypatch.setattr(buf, "_failed", lambda *args: failed.append(args))
    x = torch.randn((3, 512)).to(torch.bfloat16)
    idx = torch.randint(0, 8, (3, 2))
    w = torch.rand((3, 2))
    _, _, handle, _, _ = buf.low_latency_dispatch(x, idx, 4, 8)

    def fail(*args):
        raise MemoryError("launch failed")

    monkeypatch.setattr(impl, "ll_combine", fail, raising=False)
    y = torch.randn((8, 4, 512)).to(torch.bfloat16)
    out = torch.empty((3, 512), dtype=torch.bfloat16)
    with pytest.raises(MemoryError):
        buf.low_latency_combine(y, idx, w, handle, async_finish=True, out=out)
    (on_comm, tensors), = failed
    assert on_comm and tensors[0] is y and tensors[1] is w and tensors[2] is out
    monkeypatch.setattr(impl, "ll_dispatch", fail, raising=False)
    with pytest.raises(MemoryError):
        buf.low_latency_dispatch(x, idx, 4, 8, async_finish=True)
    assert failed[1][0] and failed[1][1][0] is x and failed[1][1][1] is idx


class _Kept:
    """A tensor stand-in that logs the streams it is recorded for (Tensor.record_stream)."""

    def __init__(self):
        self.recorded = []

    def record_stream(self, stream):
        self.recorded.append(stream)


def test_failed_keeps_tensors_for_the_comm_stream(buf, monkeypatch):
    """_failed: on the comm stream, every tensor given (None skipped) is recorded for it and the
    caller's stream waits for it; on the caller's own stream nothing is needed."""
    waited = []

    class Current:
        def wait_stream(self, other):
            waited.append(other)

    monkeypatch.setattr(buf, "_stream", "the comm stream")
    monkeypatch.setattr(deep_ep.torch.cuda, "current_stream", lambda device=None: Current())
    a, b = _Kept(), _Kept()
    buf._failed(True, (a, None, b))
    assert a.recorded == b.recorded == ["the comm stream"] and waited == ["the comm stream"]
    buf._failed(False, (a, b))
    assert len(a.recorded) == 1 and len(waited) == 1

    class Broken:
        def record_stream(self, stream):
            raise RuntimeError("CUDA error: the device has failed")

    buf._failed(True, (Broken(),))  # the caller's own error is the one it raises next


def test_normal_dispatch_forgets_the_groups_routing_before_launching(buf, monkeypatch):
    """The group's previous routing is forgotten before the launch: a launch that fails leaves
    no routing whose rows a later combine would take from the group."""
    class Impl:
        def dispatch(self, *args):
            raise MemoryError("launch failed")

    class FakeGroup:
        _impl = Impl()

    monkeypatch.setattr(buf, "_group", lambda key, **c: FakeGroup())
    key = ("data", 64, 24, 0)
    buf._routing[key] = "the previous routing"
    routing = deep_ep._Routing(buf, 3, 8, 0)
    with pytest.raises(MemoryError):
        buf._dispatch_on(key, torch.zeros((3, 64)), routing, 24, 0)
    assert key not in buf._routing


def test_normal_dispatch_that_fails_keeps_its_tensors(buf, monkeypatch):
    """A normal dispatch that fails once its routing launch may be queued on the comm stream
    (here the dispatch itself raises) hands the caller's tensors it reads to _failed, then
    raises."""
    failed, launched = [], []

    def dispatch_on(*args):
        raise MemoryError("launch failed")

    compute, comm = _FakeStream(11), _FakeStream(22)
    monkeypatch.setattr(buf, "_failed", lambda *args: failed.append(args))
    monkeypatch.setattr(buf, "_on_device", lambda call, **tensors: None)
    monkeypatch.setattr(buf, "_dispatch_on", dispatch_on)
    monkeypatch.setattr(buf, "_stream", comm)
    monkeypatch.setattr(deep_ep._C, "routing_layout_of_mask", lambda *a: launched.append(a))
    monkeypatch.setattr(deep_ep, "EventHandle", lambda stream=None: "event")
    monkeypatch.setattr(deep_ep.torch.cuda, "current_stream", lambda device=None: compute)
    monkeypatch.setattr(deep_ep.torch.cuda, "stream", _no_stream_switch)
    monkeypatch.setattr(deep_ep.torch.Tensor, "record_stream", lambda self, stream: None)
    x = torch.randn((3, 64)).to(torch.bfloat16)
    mask = torch.ones((3, 1), dtype=torch.bool)
    per_expert = torch.tensor([3, 0], dtype=torch.int32)
    idx = torch.tensor([[0], [1], [0]])
    w = torch.rand((3, 1))
    buf._tail = None
    with pytest.raises(MemoryError):
        buf.dispatch(x, is_token_in_rank=mask, num_tokens_per_expert=per_expert,
                     topk_idx=idx, topk_weights=w)
    assert len(launched) == 1
    (on_comm, tensors), = failed
    assert on_comm and tensors[0] is x and tensors[1] is None and tensors[2] is idx
    assert tensors[3] is w and tensors[4] is mask and tensors[5] is per_expert


def test_normal_combine_that_fails_keeps_its_tensors(buf, monkeypatch):
    """A normal combine that fails once its kernels may be queued on the comm stream (here the
    group's combine raises) hands x, its output, the weights and the biases to _failed, then
    raises; a plain call that stays on the caller's stream hands them over as not on it."""
    failed = []

    class Impl:
        def combine(self, *args):
            raise MemoryError("launch failed")

    class FakeGroup:
        _impl = Impl()

    compute, comm = _FakeStream(11), _FakeStream(22)
    monkeypatch.setattr(buf, "_failed", lambda *args: failed.append(args))
    monkeypatch.setattr(buf, "_on_device", lambda call, **tensors: None)
    monkeypatch.setattr(buf, "_routed_group", lambda *args: FakeGroup())
    monkeypatch.setattr(buf, "_stream", comm)
    monkeypatch.setattr(deep_ep.torch.cuda, "current_stream", lambda device=None: compute)
    monkeypatch.setattr(deep_ep.torch.cuda, "stream", _no_stream_switch)
    handle = deep_ep._Routing(buf, 3, 8, 0)
    handle.num_rows, handle.rank_ids = 5, _Kept()
    x = torch.randn((5, 64)).to(torch.bfloat16)
    w = torch.rand((5, 2))
    bias = torch.randn((3, 64)).to(torch.bfloat16)
    buf._tail = None  # the comm stream: nothing has joined the current one yet
    with pytest.raises(MemoryError):
        buf.combine(x, handle, topk_weights=w, bias=bias)
    (on_comm, tensors), = failed
    assert on_comm and tensors[0] is x and tensors[1].shape == (3, 64)
    assert tensors[2] is w and tensors[3] is bias
    assert handle.rank_ids.recorded == [comm]
    buf._tail = 11  # a plain call from the Buffer's last stream stays on it
    with pytest.raises(MemoryError):
        buf.combine(x, handle)
    assert failed[1][0] is False and failed[1][1][0] is x and failed[1][1][2] is None


def test_low_latency_dispatch_calls_in_order_with_a_fake_group(buf, monkeypatch):
    """The layer's low-latency calls without a GPU, against a fake group: dispatch writes the
    outputs it returns (DeepEP's padded layout, in a group set up for it), in one call on the
    comm stream, joined back unless async, or on the current stream where that keeps DeepEP's
    order; with a hook the receive waits for the hook, on the
    stream current then, and the hook keeps the outputs alive; combine is one call (and its
    hook's wait); a failure before the launch launches nothing and keeps the last handle."""
    import gc
    import weakref

    impl = _Recorder()
    configs = []

    class FakeGroup:
        _impl = impl

    def group(key, **config):
        configs.append(config)
        return buf._groups.setdefault(key, FakeGroup())

    # Stream handles; later: the current stream when hook() is called (the hook's work still
    # goes to the stream of its call, as DeepEP's).
    compute, comm, later, other = 11, 22, 33, 44
    current, waits = [compute], []  # the current stream; what the comm stream was made to wait for
    monkeypatch.setattr(buf, "_on_device", lambda call, **tensors: None)
    monkeypatch.setattr(buf, "_group", group)
    monkeypatch.setattr(buf, "_comm_handle", comm)
    monkeypatch.setattr(buf, "_comm_waits_for", waits.append)
    monkeypatch.setattr(buf, "_ll_finish", lambda *args: EventOverlap())
    monkeypatch.setattr(deep_ep, "_current_stream_handle", lambda device: current[0])

    def run_hook(hook):
        current[0] = later
        hook()
        current[0] = compute
    x = torch.randn((3, 512)).to(torch.bfloat16)
    idx = torch.randint(0, 8, (3, 2))

    def pointers(recv, count, handle):
        codes, scales = recv
        return (codes.data_ptr(), scales.data_ptr(), count.data_ptr(), handle[0].data_ptr(),
                handle[1].data_ptr())

    # Streams: a call runs on the comm stream, joined back unless async, except a plain call
    # made where every earlier call of the Buffer was joined (or ran): it stays on the current
    # stream. The first call has nothing joined yet; after an async call the next plain one
    # goes behind it on the comm stream.
    for async_finish, on in ((False, comm), (True, comm), (False, comm), (False, compute)):
        recv, count, handle, _, hook = buf.low_latency_dispatch(x, idx, 4, 8,
                                                                async_finish=async_finish)
        assert hook is None
        assert len(impl.calls) == 1 and impl.calls[0][0] == "ll_dispatch"
        # The caller's int64 ids go to the kernel as they are (id_bytes 8): no conversion.
        assert impl.calls[0][1][2:4] == (idx.data_ptr(), 8)
        assert impl.calls[0][1][4:] == pointers(recv, count, handle) + (
            compute, on, not async_finish, False)
        assert tuple(recv[0].shape) == (8, 4, 512) and tuple(recv[1].shape) == (8, 4, 4)
        assert buf._routing[handle.key] is handle
        impl.calls.clear()
    # The group writes the padded layout for the layer's S = R * max rows a group.
    assert configs[-1]["padded_capacity"] == 4 and "fp8_ue8m0_scales" not in configs[-1]

    # Combine: one call, reading the expert outputs in the padded layout where they are.
    y = torch.randn((8, 4, 512)).to(torch.bfloat16)  # [E_l, R * max, H], R = 1
    w = torch.rand((3, 2))
    # After a call from another stream, a plain call goes through the comm stream, which also
    # waits for that stream (DeepEP's calls all queue on the comm stream, so each runs after
    # the Buffer's earlier ones, whatever stream they came from).
    for async_finish, stream, on, waited in (
            (False, compute, compute, []), (True, compute, comm, []),
            (False, compute, comm, []), (False, compute, compute, []),
            (False, other, comm, [compute]), (False, other, other, []),
            (False, compute, comm, [other]), (False, compute, compute, [])):
        current[0] = stream
        out, _, hook = buf.low_latency_combine(y, idx, w, handle, async_finish=async_finish)
        assert hook is None and tuple(out.shape) == (3, 512)
        assert impl.calls == [("ll_combine", (y.data_ptr(), 4, w.data_ptr(), out.data_ptr(),
                                              stream, on, not async_finish, False))]
        assert waits == waited
        impl.calls.clear()
        waits.clear()
    current[0] = compute
    out, _, hook = buf.low_latency_combine(y, idx, w, handle, return_recv_hook=True)
    run_hook(hook)
    assert impl.calls == [
        ("ll_combine", (y.data_ptr(), 4, w.data_ptr(), out.data_ptr(), compute, compute, True,
                        True)),
        ("ll_combine_wait", (w.data_ptr(), out.data_ptr(), compute))]  # the call's stream
    impl.calls.clear()

    # UE8M0 words: their own group, and the words are what dispatch writes as scales.
    recv, count, handle, _, hook = buf.low_latency_dispatch(
        x, idx, 4, 8, round_scale=True, use_ue8m0=True, return_recv_hook=True)
    assert configs[-1]["fp8_ue8m0_scales"] and configs[-1]["fp8_pow2_scales"]
    assert recv[1].dtype == torch.int32 and tuple(recv[1].shape) == (8, 4, 1)
    assert [c[0] for c in impl.calls] == ["ll_dispatch"] and impl.calls[0][1][-1] is True
    want = pointers(recv, count, handle) + (compute,)  # received on the call's stream
    alive = weakref.ref(recv[0])
    del recv, count, handle
    gc.collect()
    assert alive() is not None, "the hook must keep the outputs it fills"
    run_hook(hook)
    assert impl.calls[-1] == ("ll_receive", want)
    impl.calls.clear()

    def fail(*args):
        raise MemoryError("no memory for the outputs")

    before = dict(buf._routing)
    monkeypatch.setattr(deep_ep, "_ll_outputs", fail)
    with pytest.raises(MemoryError):
        buf.low_latency_dispatch(x, idx, 4, 8)
    assert impl.calls == [] and buf._routing == before
    monkeypatch.undo()

    # A failure in the call itself (it may have launched): the group's old handle is dropped.
    monkeypatch.setattr(buf, "_on_device", lambda call, **tensors: None)
    monkeypatch.setattr(buf, "_group", group)
    monkeypatch.setattr(buf, "_ll_stream_handles", lambda hook, async_finish: (compute, compute))
    monkeypatch.setattr(impl, "ll_dispatch", fail, raising=False)
    with pytest.raises(MemoryError):
        buf.low_latency_dispatch(x, idx, 4, 8, return_recv_hook=True)
    key = next(k for k in buf._groups if k[-1] == buf._ll_parity and not k[6])
    assert key not in buf._routing, "a failed dispatch leaves no handle of its group"
