"""What the package does without a GPU: import, configuration and its errors, the bootstraps,
argument checks, and the CPU reference model. These run in CI."""

import os
import tempfile
import threading

import numpy as np
import pytest

import epcomm

BASE = dict(hidden=512, top_k=4, n_experts=16, max_tokens_per_rank=64)


def test_import_and_constants():
    assert epcomm.FORMATS == ["bf16", "fp8-blockwise", "nvfp4", "mxfp8", "mxfp4"]
    assert epcomm.MAX_TOP_K == 16 and epcomm.MAX_EXPERTS == 1024 and epcomm.MAX_RANKS == 64
    assert epcomm.SHARED_EXPERT_ID == -1
    assert issubclass(epcomm.InvalidArgument, epcomm.Error)
    assert issubclass(epcomm.InvalidArgument, ValueError)
    assert issubclass(epcomm.Error, RuntimeError)


def test_spans_nodes_supported_says_how_it_was_built():
    """False in the default build; EPCOMM_TEST_EXPECT_NVSHMEM=1 where the package was built with
    -C cmake.define.EPCOMM_WITH_NVSHMEM=ON."""
    expected = os.environ.get("EPCOMM_TEST_EXPECT_NVSHMEM", "0") == "1"
    assert epcomm.spans_nodes_supported() is expected


def test_config_keywords_round_trip():
    cfg = epcomm.make_config(**BASE, format="nvfp4", nvfp4_global_scale=0.5, num_sms=16,
                             timeout_seconds=2.5, share_gpus=True, max_routed_rows=100,
                             dispatch_path="low-latency", shared_expert=True, skip_a2a=True,
                             allreduce_world_size=2, trace=True, ranks_per_node=2)
    assert (cfg.hidden, cfg.top_k, cfg.n_experts, cfg.max_tokens_per_rank) == (512, 4, 16, 64)
    assert cfg.format == "nvfp4" and cfg.dispatch_path == "low-latency"
    assert cfg.nvfp4_global_scale == 0.5 and cfg.num_sms == 16 and cfg.timeout_seconds == 2.5
    assert cfg.share_gpus and cfg.shared_expert and cfg.skip_a2a and cfg.trace
    assert cfg.max_routed_rows == 100 and cfg.allreduce_world_size == 2 and cfg.ranks_per_node == 2
    cfg.validate(4)


def test_dispatch_path_limits():
    # `auto` takes the low-latency path up to LOW_LATENCY_MAX_TOKENS tokens a rank with at least
    # LOW_LATENCY_MIN_SMS SMs (epcomm/config.h); asking for it past the token limit is refused.
    assert epcomm.LOW_LATENCY_MAX_TOKENS == 512 and epcomm.LOW_LATENCY_MIN_SMS == 128
    over = dict(BASE, max_tokens_per_rank=epcomm.LOW_LATENCY_MAX_TOKENS + 1)
    epcomm.make_config(**over).validate(4)
    with pytest.raises(epcomm.InvalidArgument, match="max_tokens_per_rank"):
        epcomm.make_config(**over, dispatch_path="low-latency").validate(4)


def test_config_unknown_and_mistyped_fields():
    with pytest.raises(TypeError, match="unknown field 'hiden'"):
        epcomm.make_config(hiden=7168)
    with pytest.raises(TypeError, match="hidden = 'big' has type str; it takes int"):
        epcomm.make_config(hidden="big")


@pytest.mark.parametrize(
    "fields, n_ranks, message",
    [
        (dict(hidden=100), 2, "hidden = 100 is invalid: a positive multiple of 8 (bf16)"),
        (dict(hidden=256, format="fp8-blockwise"), 2,
         None),
        (dict(hidden=64, format="fp8-blockwise"), 2,
         "hidden = 64 is invalid: a positive multiple of 128 (fp8-blockwise)"),
        (dict(top_k=17), 2, "top_k = 17 is invalid: between 1 and 16"),
        (dict(n_experts=15), 2, "n_experts = 15 is invalid: a multiple of n_ranks = 2"),
        (dict(max_tokens_per_rank=0), 2, "max_tokens_per_rank = 0 is invalid"),
        (dict(max_tokens_per_rank=1024, dispatch_path="low-latency"), 2,
         "max_tokens_per_rank = 1024 is invalid: at most 512 with dispatch_path = kLowLatency"),
        (dict(top_k=16, shared_expert=True), 2, "top_k = 16 is invalid: at most 15 with shared_expert"),
        (dict(allreduce_world_size=3), 2, "allreduce_world_size = 3 is invalid"),
        (dict(ranks_per_node=3), 4, "ranks_per_node = 3 is invalid"),
        (dict(num_sms=0), 2, "num_sms = 0 is invalid: between 1 and 1024"),
        (dict(), 65, "n_ranks = 65 is invalid: between 1 and 64"),
        (dict(format="nvfp4", nvfp4_global_scale=-1.0), 2, "nvfp4_global_scale"),
    ],
)
def test_config_validation_messages(fields, n_ranks, message):
    cfg = epcomm.make_config(**{**BASE, **fields})
    if message is None:
        cfg.validate(n_ranks)
        return
    with pytest.raises(epcomm.InvalidArgument) as e:
        cfg.validate(n_ranks)
    assert message in str(e.value)
    assert e.value.code == epcomm.ErrorCode.invalid_argument


def test_format_and_path_names_are_checked():
    with pytest.raises(epcomm.InvalidArgument, match="format = 'fp4' is invalid: one of 'bf16', "):
        epcomm.make_config(format="fp4")
    with pytest.raises(epcomm.InvalidArgument, match="dispatch_path = 'fast' is invalid"):
        epcomm.make_config(dispatch_path="fast")


def test_sizes():
    s = epcomm.make_config(**BASE).sizes(4)
    assert (s.n_ranks, s.n_local_experts, s.num_groups) == (4, 4, 4)
    assert s.max_routed_rows == 64 * 4 * 4 and s.max_recv_rows == s.max_routed_rows
    assert s.token_bytes == 1024 and s.scales_bytes == 0 and s.num_scales_offsets == 0
    s = epcomm.make_config(**BASE, format="fp8-blockwise", shared_expert=True).sizes(4)
    assert s.num_groups == 5 and s.token_bytes == 512
    assert s.max_routed_rows == 64 * 4 * 4 + 64
    assert s.scales_bytes == 4 * (512 // 128) * s.max_recv_rows


def test_config_fields_are_the_properties():
    """CONFIG_FIELDS (the C++ table kConfigFields) names every Config property, each once."""
    fields = epcomm.CONFIG_FIELDS
    assert len(set(fields)) == len(fields) and "max_routed_rows" in fields
    assert "max_recv_rows" not in fields  # the cap is max_routed_rows; sizes.max_recv_rows pads it
    props = {n for n in dir(epcomm.Config) if not n.startswith("_")} - {"validate", "sizes"}
    assert props == set(fields)


@pytest.mark.parametrize("fmt", ["bf16", "fp8-blockwise", "nvfp4", "mxfp8", "mxfp4"])
def test_dispatch_output_descs(fmt):
    cfg = epcomm.make_config(**BASE, format=fmt)
    s = cfg.sizes(4)
    d = {t.name: t for t in epcomm._epcomm.dispatch_output_descs(cfg, s)}
    assert list(d) == ["tokens", "row_offsets", "expert_ids", "src_info", "scales",
                       "scales_offsets", "counts", "slot_token", "layout_range"]
    assert [d[n].shape for n in ("counts", "slot_token", "layout_range")] == \
        [(0,), (0, 0), (0, 4)]  # the padded layout's: empty when packed
    R, H, G = s.max_recv_rows, cfg.hidden, s.num_groups
    assert d["tokens"].bytes == R * s.token_bytes and d["tokens"].shape[0] == R
    assert d["tokens"].dtype == {"bf16": "bfloat16", "fp8-blockwise": "float8_e4m3fn",
                                 "mxfp8": "float8_e4m3fn"}.get(fmt, "uint8")
    assert (d["row_offsets"].shape, d["expert_ids"].shape) == ((G + 1,), (G,))
    assert d["src_info"].shape == (R, 2) and d["src_info"].dtype == "int32"
    assert d["scales"].bytes == s.scales_bytes
    assert d["scales"].shape == {"bf16": (0,), "fp8-blockwise": (H // 128, R),
                                 "mxfp4": (R, H // 32)}.get(fmt, (s.scales_bytes,))
    assert d["scales_offsets"].shape == (s.num_scales_offsets,)
    out = epcomm._epcomm.combine_output_desc(cfg, 3, False)
    assert (out.shape, out.strides, out.dtype) == ((3, 4, H), (4 * H, H, 1), "bfloat16")
    assert epcomm._epcomm.expert_out_desc(cfg, s).shape == (R, H)


def test_dispatch_output_descs_of_the_padded_layout():
    C = 4 * BASE["max_tokens_per_rank"] + 1
    cfg = epcomm.make_config(**BASE, format="fp8-blockwise", padded_capacity=C)
    s = cfg.sizes(4)
    d = {t.name: t for t in epcomm._epcomm.dispatch_output_descs(cfg, s)}
    G, H = s.num_groups, cfg.hidden
    assert d["tokens"].shape == (G, C, H) and d["scales"].shape == (G, H // 128, C)
    assert d["src_info"].shape == (s.max_routed_rows, 2)  # packed, no padding rows
    assert (d["counts"].shape, d["slot_token"].shape, d["layout_range"].shape) == \
        ((G,), (G, C), (G, 4))
    assert d["layout_range"].dtype == "int64"
    with pytest.raises(epcomm.InvalidArgument, match="padded_capacity"):
        epcomm.make_config(**BASE, padded_capacity=C - 2).validate(4)


def _thread_gather(n):
    """n CallbackBootstraps over one Python rendezvous: an all-gather through a dict."""
    slots, barrier = {}, threading.Barrier(n)

    def endpoint(rank):
        def all_gather(data):
            slots[rank] = data
            barrier.wait()
            out = [slots[r] for r in range(n)]
            barrier.wait()
            return out
        return epcomm.CallbackBootstrap(rank, n, all_gather)

    return [endpoint(r) for r in range(n)]


def _run_threads(n, fn):
    results, errors = [None] * n, []

    def run(r):
        try:
            results[r] = fn(r)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    ts = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not errors, errors
    return results


def test_callback_bootstrap_gathers_across_threads():
    bss = _thread_gather(3)

    def run(r):
        bss[r].barrier()
        return bss[r].all_gather(bytes([r]) * 5)

    for got in _run_threads(3, run):
        assert got == b"\x00" * 5 + b"\x01" * 5 + b"\x02" * 5


def test_file_bootstrap_releases_the_gil():
    # Three FileBootstraps in threads of one process: each all_gather blocks in C++ until the
    # others arrive, which needs the others' Python threads to run.
    with tempfile.TemporaryDirectory() as d:
        bss = [epcomm.FileBootstrap(d, r, 3, 30.0) for r in range(3)]
        got = _run_threads(3, lambda r: bss[r].all_gather(b"rank%d" % r))
    assert all(g == b"rank0rank1rank2" for g in got)


def test_file_bootstrap_from_env():
    with tempfile.TemporaryDirectory() as d:
        os.environ.update(EPCOMM_RANK="0", EPCOMM_WORLD_SIZE="1", EPCOMM_BOOTSTRAP_DIR=d)
        try:
            bs = epcomm.FileBootstrap.from_env(5.0)
            assert (bs.rank, bs.size) == (0, 1)
            assert bs.all_gather(b"abc") == b"abc"
        finally:
            for k in ("EPCOMM_RANK", "EPCOMM_WORLD_SIZE", "EPCOMM_BOOTSTRAP_DIR"):
                del os.environ[k]


@pytest.mark.parametrize(
    "result, message",
    [
        (lambda b: b * 2, "returned 8 bytes; expected 3 x 4"),
        (lambda b: [b, b], "returned 2 entries; expected one per rank (3)"),
        (lambda b: [b, b, b"xy"], "entry 2 holds 2 bytes; every rank sends 4"),
        (lambda b: [b, b, "text"], "entry 2 of the all_gather callback's result is not bytes"),
        (lambda b: 42, "must return bytes or a list of bytes"),
    ],
)
def test_callback_bootstrap_bad_results(result, message):
    with pytest.raises(epcomm.Error) as e:
        epcomm.CallbackBootstrap(1, 3, result).all_gather(b"abcd")
    assert e.value.code == epcomm.ErrorCode.bootstrap
    assert str(e.value).startswith("epcomm bootstrap (rank 1): ")
    assert message in str(e.value)


def test_callback_bootstrap_callback_raises():
    def gone(_):
        raise ConnectionError("peer 2 gone")

    with pytest.raises(epcomm.Error, match="callback raised ConnectionError: peer 2 gone") as e:
        epcomm.CallbackBootstrap(0, 2, gone).barrier()
    assert e.value.code == epcomm.ErrorCode.bootstrap
    with pytest.raises(epcomm.InvalidArgument, match="rank 3 of size 2 is out of range"):
        epcomm.CallbackBootstrap(3, 2, gone)


def test_group_setup_checks_the_config_first():
    # Every rank validates, then the ranks compare configs, after selecting the device: so
    # this needs a GPU (without one, set-up fails on the device first; see the next test).
    pytest.importorskip("torch", reason="needs PyTorch to see whether a GPU is visible")
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU visible: set-up selects the device before comparing configs")
    solo = epcomm.CallbackBootstrap(0, 1, lambda b: [b])
    with pytest.raises(epcomm.InvalidArgument, match="top_k = 0 is invalid"):
        epcomm.Group.create(solo, 0, **{**BASE, "top_k": 0})


def test_group_setup_without_a_gpu_is_a_clear_error():
    try:
        import torch  # noqa: F401

        if torch.cuda.is_available():
            pytest.skip("a GPU is visible: this checks the no-GPU failure")
    except ImportError:
        pass
    solo = epcomm.CallbackBootstrap(0, 1, lambda b: [b])
    with pytest.raises(epcomm.Error) as e:
        epcomm.Group.create(solo, 0, **BASE)
    assert e.value.code in (epcomm.ErrorCode.cuda, epcomm.ErrorCode.setup)
    assert "cuda" in str(e.value).lower()


def _silu_args(rows=8, inter=256, groups=2):
    x = np.zeros((rows, 2 * inter), dtype=np.uint16)  # bf16 bits
    ro = np.array([0, 4, rows][: groups + 1], dtype=np.int32)
    return x, ro, inter


def test_array_checks_name_the_argument():
    x, ro, inter = _silu_args()
    out = np.zeros((8, inter), dtype=np.uint16)
    C = epcomm._epcomm
    with pytest.raises(epcomm.InvalidArgument,
                       match=r"epcomm silu_bf16: x must be bfloat16 .*; got float32"):
        C.silu_bf16(x.astype(np.float32), ro, inter, out, 0)
    with pytest.raises(epcomm.InvalidArgument,
                       match=r"x must have shape \[rows, 2 \* I\]; got \[8, 500\]"):
        C.silu_bf16(x[:, :500].copy(), ro, inter, out, 0)
    with pytest.raises(epcomm.InvalidArgument, match="x must be contiguous"):
        C.silu_bf16(np.zeros((8, 1024), np.uint16)[:, ::2], ro, inter, out, 0)
    with pytest.raises(epcomm.InvalidArgument,
                       match=r"x must be a CUDA tensor on cuda:0; got cpu memory"):
        C.silu_bf16(x, ro, inter, out, 0)


def test_routing_launches_check_before_any_cuda_call():
    """The DeepEP layer's routing launches take device addresses (the layer checks its tensors
    first); the library refuses bad sizes and addresses before any CUDA call, so these raise
    on a machine without a GPU too."""
    C = epcomm._epcomm
    dev, stream, p = 0, 0, 4096  # p: an aligned address never read
    with pytest.raises(epcomm.InvalidArgument, match=r"id_bytes = 2 \(4 for int32 ids, 8 for"):
        C.routing_layout(p, 2, 4, 2, 8, 2, p, 0, 0, dev, stream)
    with pytest.raises(epcomm.InvalidArgument,
                       match=r"num_experts = 9 must be a positive multiple of n_ranks = 2"):
        C.routing_layout(p, 8, 4, 2, 9, 2, p, 0, 0, dev, stream)
    with pytest.raises(epcomm.InvalidArgument, match=r"topk_ids is null"):
        C.routing_layout(0, 8, 4, 2, 8, 2, p, 0, 0, dev, stream)
    with pytest.raises(epcomm.InvalidArgument, match=r"no output given"):
        C.routing_layout(p, 8, 4, 2, 8, 2, 0, 0, 0, dev, stream)
    with pytest.raises(epcomm.InvalidArgument, match=r"tokens_per_rank is not 4-byte aligned"):
        C.routing_layout(p, 8, 4, 2, 8, 2, p + 2, 0, 0, dev, stream)
    with pytest.raises(epcomm.InvalidArgument, match=r"must be a positive multiple of n_ranks = 0"):
        C.routing_layout_of_mask(p, 4, 0, p, p, dev, stream)
    with pytest.raises(epcomm.InvalidArgument, match=r"rank_ids is not 4-byte aligned"):
        C.routing_layout_of_mask(p, 4, 2, p, p + 1, dev, stream)
    with pytest.raises(epcomm.InvalidArgument, match=r"n_local = 0 is outside \[1, 12288\]"):
        C.received_topk(p, p, 32, p, 2, 0, p, p, 4, p, 0, dev, stream)
    with pytest.raises(epcomm.InvalidArgument, match=r"counts is null"):
        C.received_topk(p, p, 32, p, 2, 0, p, p, 4, 0, 3, dev, stream)
    with pytest.raises(epcomm.InvalidArgument, match=r"row_bytes = 12 must be a multiple of 8"):
        C.received_topk(p, p, 12, p, 2, 0, p, p, 4, p, 3, dev, stream)


def test_silu_wrapper_arguments():
    x, ro, _ = _silu_args()
    with pytest.raises(epcomm.InvalidArgument, match="clamp is only for format='mxfp4'"):
        epcomm.silu(x, ro, format="bf16", clamp=(7.0, 1.702), out=x)
    with pytest.raises(epcomm.InvalidArgument, match="x has 511 columns; it needs 2 \\* I"):
        epcomm.silu(np.zeros((8, 511), np.uint16), ro, out=x)
    with pytest.raises(epcomm.InvalidArgument, match="format = 'fp16' is invalid"):
        epcomm.silu(x, ro, format="fp16", out=x)


# ---- the CPU reference model through the bindings ----------------------------------------------

def _bf16_to_f64(bits):
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32).astype(np.float64)


def _random_bf16(rng, shape):
    v = (rng.uniform(0.5, 2.0, size=shape) * rng.choice([-1, 1], size=shape)).astype(np.float32)
    return (v.view(np.uint32) >> 16).astype(np.uint16)


def test_reference_dispatch_and_combine_agree_with_numpy():
    n, H, K, E = 3, 64, 4, 12
    p = epcomm.reference.make_problem(n, H, K, E, [7, 0, 5], seed=11)
    layouts = [epcomm.reference.dispatch(p, r) for r in range(n)]
    # Every routed (token, slot) arrives once, at the rank of its expert, in its group.
    n_local = E // n
    for r, d in enumerate(layouts):
        ro = d.row_offsets
        for g in range(n_local):
            for row in range(ro[g], ro[g + 1]):
                tok, rs = d.src_info[row]
                src, slot = np.int16(rs & 0xFFFF), rs >> 16
                assert p.topk_ids(src)[tok, slot] == r * n_local + g
                assert (d.tokens[row] == p.tokens(src)[tok]).all()
    routed = sum(int((p.topk_ids(s) >= 0).sum()) for s in range(n))
    assert sum(d.rows for d in layouts) == routed
    rng = np.random.default_rng(3)
    ys = [_random_bf16(rng, (d.rows, H)) for d in layouts]
    for r in range(n):
        ref = epcomm.reference.combine(p, layouts, ys, r, True)
        ids, w = p.topk_ids(r), p.weights(r)
        want = np.zeros((p.num_tokens(r), H))
        for d_rank, d in enumerate(layouts):
            for row in range(d.rows):
                tok, rs = d.src_info[row]
                if np.int16(rs & 0xFFFF) == r:
                    want[tok] += w[tok, rs >> 16] * _bf16_to_f64(ys[d_rank][row])
        np.testing.assert_allclose(ref, want, rtol=1e-12, atol=1e-12)
        assert ids.shape == (p.num_tokens(r), K)


def test_reference_compare_finds_a_flipped_bit():
    p = epcomm.reference.make_problem(2, 64, 2, 4, [6, 6], seed=5)
    d = epcomm.reference.dispatch(p, 0)
    ro = d.row_offsets.view(np.int32)
    assert epcomm.reference.compare_dispatch(d, ro, d.expert_ids, d.src_info, d.tokens, 64) == ""
    t = d.tokens.copy()
    t[2, 9] ^= 1
    msg = epcomm.reference.compare_dispatch(d, ro, d.expert_ids, d.src_info, t, 64)
    assert msg.startswith("tokens[2][9]")
    layouts = [d, epcomm.reference.dispatch(p, 1)]
    ys = [_random_bf16(np.random.default_rng(r), (l.rows, 64)) for r, l in enumerate(layouts)]
    ref = epcomm.reference.combine(p, layouts, ys, 0, False)
    exact = (ref.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    assert epcomm.reference.compare_exact_bf16(ref, exact) == ""
    exact[1, 0, 3] ^= 2
    assert epcomm.reference.compare_exact_bf16(ref, exact) != ""


def test_reference_quantized_dispatch_compares_with_itself():
    p = epcomm.reference.make_problem(2, 256, 4, 8, [9, 4], seed=2)
    for fmt in ("fp8-blockwise", "nvfp4", "mxfp8", "mxfp4"):
        q = epcomm.reference.dispatch_quantized(p, 1, fmt, 1.0)
        lay = q.layout()
        assert (lay.row_offsets == q.row_offsets).all() and lay.rows == q.rows
        ro = q.row_offsets.view(np.int32)
        args = (q.out_rows, q.row_bytes, ro, q.expert_ids, q.src_info, q.codes, q.scales,
                q.scales_offsets)
        assert epcomm.reference.compare_dispatch_quantized(q, *args) == "", fmt
        codes = q.codes.copy()
        codes[0, 3] ^= 0x10
        msg = epcomm.reference.compare_dispatch_quantized(q, args[0], args[1], ro, q.expert_ids,
                                                          q.src_info, codes, q.scales,
                                                          q.scales_offsets)
        assert "codes" in msg, (fmt, msg)


def test_dlpack_buffer_follows_the_protocol():
    """The generic path's output objects (DLPackBuffer): device reported, and a request for
    another device or a copy refused with BufferError, as the DLPack protocol asks."""
    from epcomm._frameworks import DLPackBuffer

    exported = []
    b = DLPackBuffer(lambda: exported.append(1) or "capsule", 3)
    assert b.__dlpack_device__() == (2, 3)
    assert b.__dlpack__() == "capsule" and b.__dlpack__(stream=None) == "capsule"
    assert len(exported) == 2  # exported afresh each time (a capsule is consumed once)
    for kwargs in ({"dl_device": (2, 0)}, {"dl_device": (1, 0)}, {"copy": True}):
        try:
            b.__dlpack__(**kwargs)
        except BufferError:
            pass
        else:
            raise AssertionError(f"accepted {kwargs}")
    assert b.__dlpack__(dl_device=(2, 3), copy=False) == "capsule"
