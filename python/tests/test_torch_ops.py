"""epcomm.torch_ops without a GPU: the operators' fake implementations against the group's
tensor descriptions, a whole MoE step exported with torch.export (strict: one graph, as
torch.compile(fullgraph=True) needs), and the errors. Running the ops is tested on a GPU
(test_gpu.py)."""

import pytest

torch = pytest.importorskip("torch")

import epcomm  # noqa: E402
import epcomm.torch_ops as ops  # noqa: E402

H, K, E, T, RANKS = 256, 4, 16, 32, 2


def make(fmt="bf16"):
    cfg = epcomm.make_config(hidden=H, top_k=K, n_experts=E, max_tokens_per_rank=T, format=fmt)
    return cfg, ops.register(cfg, n_ranks=RANKS)


class MoeStep(torch.nn.Module):
    """Dispatch, a stand-in for the expert GEMMs, combine reduced with the router weights."""

    def __init__(self, gid, scale):
        super().__init__()
        self.gid = gid
        self.scale = scale

    def forward(self, tokens, topk_ids, weights):
        d = ops.dispatch(self.gid, tokens, topk_ids, weights)
        expert_out = (d.tokens.float() * self.scale).to(torch.bfloat16)
        return ops.combine(self.gid, expert_out, d, num_tokens=tokens.shape[0], reduced=True)


def inputs():
    g = torch.Generator().manual_seed(3)
    tokens = torch.randn(T, H, generator=g).to(torch.bfloat16)
    topk_ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32)
    weights = torch.rand(T, K, generator=g)
    return tokens, topk_ids, weights


@pytest.mark.parametrize("fmt", ["bf16", "fp8-blockwise", "nvfp4"])
def test_fake_outputs_match_the_descriptions(fmt):
    cfg, gid = make(fmt)
    descs = {d.name: d for d in epcomm._epcomm.dispatch_output_descs(cfg, cfg.sizes(RANKS))}
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        tokens, topk_ids, weights = (mode.from_tensor(x) for x in inputs())
        outs = torch.ops.epcomm.dispatch(gid, tokens, topk_ids, weights)
        assert len(outs) == len(ops.OUTPUT_NAMES)
        for name, t in zip(ops.OUTPUT_NAMES, outs):
            d = descs[name]
            assert tuple(t.shape) == tuple(d.shape), name
            assert str(t.dtype) == "torch." + d.dtype or (t.dtype == torch.uint8), name
        rows = descs["tokens"].shape[0]
        expert_out = torch.empty(rows, H, dtype=torch.bfloat16)
        for reduced, shape in ((True, (T, H)), (False, (T, K, H))):
            y = torch.ops.epcomm.combine(gid, expert_out, outs[2], outs[4], None, T, reduced)
            assert tuple(y.shape) == shape and y.dtype == torch.bfloat16
    ops.unregister(gid)


def test_a_moe_step_exports_as_one_graph():
    _, gid = make()
    exported = torch.export.export(MoeStep(gid, 0.5), inputs(), strict=True)
    targets = [str(n.target) for n in exported.graph.nodes if n.op == "call_function"]
    assert "epcomm.dispatch.default" in targets and "epcomm.combine.default" in targets
    out = [n for n in exported.graph.nodes if n.op == "output"][0].args[0][0]
    assert tuple(out.meta["val"].shape) == (T, H) and out.meta["val"].dtype == torch.bfloat16
    ops.unregister(gid)


class DispatchOnly(torch.nn.Module):
    """Calls dispatch and ignores its outputs (as a rank with nothing to compute might)."""

    def __init__(self, gid):
        super().__init__()
        self.gid = gid

    def forward(self, tokens, topk_ids, weights):
        ops.dispatch(self.gid, tokens, topk_ids, weights)
        return tokens + 1


def test_a_call_with_unused_outputs_stays():
    """The other ranks wait for this rank's call: graph passes must not drop it."""
    _, gid = make()
    exported = torch.export.export(DispatchOnly(gid), inputs(), strict=True)
    exported.graph.eliminate_dead_code()
    targets = [str(n.target) for n in exported.graph.nodes if n.op == "call_function"]
    assert "epcomm.dispatch.default" in targets
    ops.unregister(gid)


def test_errors():
    _, gid = make()
    tokens, topk_ids, weights = inputs()
    with pytest.raises(epcomm.InvalidArgument, match="shapes only"):
        ops.dispatch(gid, tokens, topk_ids, weights)
    ops.unregister(gid)
    with pytest.raises(epcomm.InvalidArgument, match="no group registered"):
        ops.dispatch(gid, tokens, topk_ids, weights)
    with pytest.raises(TypeError):
        ops.register("not a config", n_ranks=2)
    with pytest.raises(epcomm.InvalidArgument, match="n_ranks"):
        ops.register(epcomm.make_config(hidden=H, top_k=K, n_experts=E), n_ranks=0)
    _, gid = make()
    d = epcomm.DispatchOutput(tokens=None, scales=None,
                              row_offsets=torch.zeros(9, dtype=torch.int32), expert_ids=None,
                              src_info=torch.zeros(1, dtype=torch.int32), scales_offsets=None)
    with pytest.raises(epcomm.InvalidArgument, match="reduced=True"):
        ops.combine(gid, torch.empty(1, H, dtype=torch.bfloat16), d, num_tokens=T, reduced=False,
                    weights=weights)
    ops.unregister(gid)
