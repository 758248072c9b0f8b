"""epcomm: expert-parallel dispatch and combine for Mixture-of-Experts models.

    import torch, torch.distributed as dist, epcomm
    dist.init_process_group("gloo")           # any backend: it only carries the set-up bytes
    g = epcomm.Group.from_torch(hidden=7168, top_k=8, n_experts=256, max_tokens_per_rank=4096)
    d = g.dispatch(x, topk_ids, weights)        # x [T, H] bf16, topk_ids [T, K] int32 or int64, weights fp32
    y = grouped_gemm(d.tokens, d.row_offsets)   # rows of group e: [row_offsets[e], row_offsets[e+1])
    out = g.combine(y)                          # [T, H] bf16: sum over k of weights * expert output

Every call is collective (every rank makes the same calls in the same order) and runs on the
framework's current CUDA stream (or `stream=`), without synchronising the host, so a dispatch +
combine can be captured in a CUDA graph (torch.cuda.graph) and replayed. Tearing a group down is
collective too: call close() (or use `with`) at the same point on every rank.

Outputs. Unless `out=` is given, dispatch and combine write into buffers the group allocated at
set-up and return tensors over them: they stay valid until the group's next dispatch (for the
dispatch outputs) or next combine (for the combine output). Copy them, or pass your own `out=`,
to keep them longer.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional

from . import _epcomm as _C
from . import _frameworks as _fw
from ._epcomm import (  # noqa: F401  (re-exported)
    FORMATS,
    LOW_LATENCY_MAX_TOKENS,
    LOW_LATENCY_MIN_SMS,
    MAX_EXPERTS,
    MAX_RANKS,
    MAX_TOP_K,
    SHARED_EXPERT_ID,
    Bootstrap,
    CallbackBootstrap,
    Config,
    Error,
    ErrorCode,
    FileBootstrap,
    InvalidArgument,
    Sizes,
    TensorDesc,
    reference,
    spans_nodes_supported,
)

__all__ = [
    "Group",
    "DispatchOutput",
    "DispatchHandle",
    "CombineHandle",
    "make_config",
    "torch_bootstrap",
    "torch_device",
    "silu",
    "Config",
    "Sizes",
    "TensorDesc",
    "Error",
    "InvalidArgument",
    "ErrorCode",
    "Bootstrap",
    "CallbackBootstrap",
    "FileBootstrap",
    "reference",
    "FORMATS",
    "MAX_TOP_K",
    "MAX_EXPERTS",
    "MAX_RANKS",
    "LOW_LATENCY_MAX_TOKENS",
    "LOW_LATENCY_MIN_SMS",
    "SHARED_EXPERT_ID",
    "spans_nodes_supported",
]

# Config's fields, in declaration order (epcomm::kConfigFields: the C++ table that also drives
# Config's properties and the cross-rank comparison).
CONFIG_FIELDS = tuple(_C.CONFIG_FIELDS)


def make_config(**fields) -> Config:
    """A Config from keyword arguments named as its fields (epcomm/config.h). `format` is one
    of FORMATS, `dispatch_path` one of "auto", "throughput", "low-latency". The values are
    validated when a group is set up (Config.validate(n_ranks) checks them earlier), with the
    library's messages, as InvalidArgument."""
    cfg = Config()
    for name, value in fields.items():
        if name not in CONFIG_FIELDS:
            raise TypeError(
                f"epcomm config: unknown field {name!r}; the fields are {', '.join(CONFIG_FIELDS)}"
            )
        try:
            setattr(cfg, name, value)
        except TypeError:
            want = type(getattr(cfg, name)).__name__
            raise TypeError(
                f"epcomm config: {name} = {value!r} has type {type(value).__name__}; it takes {want}"
            ) from None
    return cfg


def torch_bootstrap(group=None) -> Bootstrap:
    """A Bootstrap over a torch.distributed process group (default: the world): its all-gather
    carries the set-up bytes, so any backend works, gloo included. With the NCCL backend, select
    each process's GPU (torch.cuda.set_device) first."""
    import torch.distributed as dist

    if not dist.is_initialized():
        raise Error("epcomm: torch.distributed is not initialised (dist.init_process_group)")
    rank, size = dist.get_rank(group), dist.get_world_size(group)

    def all_gather(data: bytes):
        out = [None] * size
        dist.all_gather_object(out, data, group=group)
        return out

    return CallbackBootstrap(rank, size, all_gather)


def torch_device(group=None):
    """(device, ranks_per_gpu) of this process in a torch.distributed group run one process per
    GPU (torchrun): device = LOCAL_RANK (else the group rank) modulo the visible GPUs, and how
    many of the group's processes land on each GPU that way (> 1: pass share_gpus=True, and a
    num_sms that lets every sharing rank's blocks be resident at once)."""
    import torch
    import torch.distributed as dist

    n = torch.cuda.device_count()
    if n == 0:
        raise Error("epcomm: no CUDA device is visible")
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    return int(os.environ.get("LOCAL_RANK", rank)) % n, (size + n - 1) // n


@dataclass
class DispatchOutput:
    """What dispatch produces on this rank: the codes (tokens), their scales (quantised
    formats), row_offsets, expert_ids, src_info and scales_offsets (NVFP4 / MXFP8); None for an
    output the format does not have. Each one's dtype and shape: Group.dispatch_output_descs()
    (epcomm/tensors.h, where they are described once). Rows are expert-major: group g is rows
    [row_offsets[g], row_offsets[g + 1]), by source rank then source token. e4m3 codes are
    float8_e4m3fn in PyTorch (uint8 elsewhere); src_info holds the token, then rank | slot << 16
    (see src_token, src_rank, src_slot); padding rows of FP8 hold rank -1.
    """

    tokens: Any
    scales: Any
    row_offsets: Any
    expert_ids: Any
    src_info: Any
    scales_offsets: Any
    # The padded layout (Config.padded_capacity): each group's rows, each slot's source token,
    # and (first slot << 32) | rows of each source rank; None otherwise.
    counts: Any = None
    slot_token: Any = None
    layout_range: Any = None

    def src_token(self):
        return self.src_info[:, 0]

    def src_rank(self):
        return self.src_info[:, 1] << 16 >> 16  # low 16 bits, sign-extended

    def src_slot(self):
        return self.src_info[:, 1] >> 16

    def num_rows(self) -> int:
        """Rows in use, row_offsets[G] (reads the device: synchronises)."""
        return int(self.row_offsets[-1])

    def group_rows(self) -> list:
        """Rows of each group (reads the device: synchronises)."""
        off = [int(v) for v in self.row_offsets.tolist()]
        return [b - a for a, b in zip(off[:-1], off[1:])]


class DispatchHandle:
    """The send half of a dispatch in flight; wait() completes it (after other work)."""

    def __init__(self, group: "Group", framework: str):
        self._group, self._fw, self._done = group, framework, False

    def wait(self, *, out: Optional[DispatchOutput] = None, stream=None) -> DispatchOutput:
        if self._done:
            raise Error("epcomm dispatch_wait: this handle was already waited on")
        g = self._group
        s = _fw.stream_handle(stream, self._fw, g.device)
        g._impl.dispatch_wait(s, **g._out_kwargs(out))
        self._done = True
        return g._dispatch_result(self._fw, out, s)


class CombineHandle:
    """The send half of a combine in flight; wait() completes it."""

    def __init__(self, group: "Group", framework: str):
        self._group, self._fw, self._done = group, framework, False

    def wait(self, weights=None, *, out=None, stream=None):
        if self._done:
            raise Error("epcomm combine_wait: this handle was already waited on")
        g = self._group
        s = _fw.stream_handle(stream, self._fw, g.device)
        if weights is not None:
            _fw.ready(weights)
        reduced, T = g._impl.combine_wait(weights, s, out)
        self._done = True
        return g._combine_result(self._fw, out, reduced, T, s)


class Group:
    """One rank of an expert-parallel group. Create it with from_torch (one process per GPU,
    under torchrun), create (any Bootstrap) or create_local (one process driving several GPUs).
    Config fields are keyword arguments (make_config)."""

    def __init__(self, impl):
        self._impl = impl
        self._views = {}
        self._descs = None

    # ---- set-up -----------------------------------------------------------------------------
    @classmethod
    def create(cls, bootstrap: Bootstrap, device: int, **config) -> "Group":
        return cls(_C.Group.create(make_config(**config), bootstrap, int(device)))

    @classmethod
    def from_torch(cls, group=None, device: Optional[int] = None, **config) -> "Group":
        """Rank dist.get_rank(group) of a group over the processes of a torch.distributed
        process group (default: the world). device: this process's GPU; default LOCAL_RANK
        modulo the visible GPUs (processes share a GPU where there are fewer GPUs than
        processes: then pass share_gpus=True)."""
        bs = torch_bootstrap(group)
        if device is None:
            device = torch_device(group)[0]
        return cls.create(bs, device, **config)

    @classmethod
    def create_local(cls, devices=None, **config) -> list:
        """One process, one rank per entry of devices (default: every visible GPU); a device
        may repeat with share_gpus=True. Issue every rank's call before synchronising any, and
        give every rank its own stream (stream=): ranks queued on one stream wait for each
        other forever (until the timeout)."""
        impls = _C.Group.create_local(make_config(**config), list(devices or []))
        return [cls(i) for i in impls]

    # ---- properties -------------------------------------------------------------------------
    rank = property(lambda self: self._impl.rank)
    n_ranks = property(lambda self: self._impl.n_ranks)
    device = property(lambda self: self._impl.device)
    config = property(lambda self: self._impl.config)
    sizes = property(lambda self: self._impl.sizes)
    poisoned = property(lambda self: self._impl.poisoned)

    def close(self) -> None:
        """Tears the group down now. Collective: every rank closes its group at the same point
        (the teardown waits for the peers). Tensors over the group's outputs stay readable
        until they are dropped; every other call raises. A group that is garbage-collected
        without close() is torn down then, which is collective too: close() explicitly, or
        use the group as a context manager, so every rank does it at the same point."""
        self._impl.close()

    closed = property(lambda self: self._impl.closed)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def check(self) -> None:
        """Raises the error the device recorded since the last check, if any."""
        self._impl.check()

    def synchronize(self, stream=None) -> None:
        """Synchronises `stream` (default: the torch current stream on the group's device, or
        the legacy default stream without PyTorch), then check()."""
        fw = _fw.TORCH if _fw.loaded("torch") else _fw.DLPACK
        self._impl.synchronize(_fw.stream_handle(stream, fw, self.device))

    # ---- buffers ----------------------------------------------------------------------------
    def dispatch_output_descs(self) -> dict:
        """Each dispatch output's TensorDesc (name, dtype, shape, strides), by name: tokens,
        row_offsets, expert_ids, src_info, scales, scales_offsets, counts, slot_token,
        layout_range (shape (0, ...) where the format or layout has none)."""
        if self._descs is None:
            self._descs = {d.name: d for d in _C.dispatch_output_descs(self.config, self.sizes)}
        return self._descs

    def _view(self, fw: str, name: str):
        key = (fw, name)
        t = self._views.get(key)
        if t is None:
            desc = self.dispatch_output_descs().get(name)
            if fw == _fw.DLPACK:
                raw = _fw.DLPackBuffer(lambda: self._impl.buffer(name, plain=False), self.device)
            else:
                raw = self._impl.buffer(name, plain=(fw == _fw.CUPY))
            t = _fw.wrap(fw, raw, desc.dtype if desc is not None else None)
            self._views[key] = t
        return t

    def _out_kwargs(self, out: Optional[DispatchOutput]) -> dict:
        if out is None:
            return {}
        return dict(
            out_tokens=out.tokens,
            out_scales=out.scales,
            out_row_offsets=out.row_offsets,
            out_expert_ids=out.expert_ids,
            out_src_info=out.src_info,
            out_scales_offsets=out.scales_offsets,
            out_counts=out.counts,
            out_slot_token=out.slot_token,
            out_layout_range=out.layout_range,
        )

    def _dispatch_result(self, fw: str, out: Optional[DispatchOutput], stream: int):
        if out is not None:
            return out
        res = DispatchOutput(**{
            name: self._view(fw, name) if d.bytes else None
            for name, d in self.dispatch_output_descs().items()
        })
        if fw == _fw.DLPACK:
            self._impl.synchronize(stream)
        return res

    def empty_dispatch_output(self, like) -> DispatchOutput:
        """Caller-owned dispatch outputs of like's framework and device, for dispatch(out=)."""
        fw = _fw.framework_of(like)
        return DispatchOutput(**{
            name: _fw.empty(fw, like, d.shape, d.dtype) if d.bytes else None
            for name, d in self.dispatch_output_descs().items()
        })

    def empty_expert_out(self, like):
        """An expert-output tensor combine takes: [max_recv_rows, H] bf16 on like's device."""
        d = _C.expert_out_desc(self.config, self.sizes)
        return _fw.empty(_fw.framework_of(like), like, d.shape, d.dtype)

    # ---- dispatch ---------------------------------------------------------------------------
    def dispatch(
        self, tokens, topk_ids, weights=None, *, out: Optional[DispatchOutput] = None, stream=None
    ) -> DispatchOutput:
        """Sends each token to the ranks of its experts and lays the received rows out
        expert-major. tokens [T, H] bf16, topk_ids [T, K] int32 or int64 (global expert ids, -1
        masks a slot; int64, as torch.topk gives them, is read as it is), weights [T, K] float32
        or None. With weights, combine reduces on the expert side
        (fewer bytes back); without, give them to combine, or get the un-reduced [T, K, H]."""
        fw = _fw.framework_of(tokens)
        for x in (tokens, topk_ids, weights):
            if x is not None and fw == _fw.DLPACK:
                _fw.ready(x)
        s = _fw.stream_handle(stream, fw, self.device)
        self._impl.dispatch(tokens, topk_ids, weights, s, **self._out_kwargs(out))
        return self._dispatch_result(fw, out, s)

    def dispatch_async(self, tokens, topk_ids, weights=None, *, stream=None) -> DispatchHandle:
        """The send half of dispatch: returns a handle whose wait() delivers the outputs."""
        fw = _fw.framework_of(tokens)
        for x in (tokens, topk_ids, weights):
            if x is not None and fw == _fw.DLPACK:
                _fw.ready(x)
        self._impl.dispatch_async(
            tokens, topk_ids, weights, _fw.stream_handle(stream, fw, self.device)
        )
        return DispatchHandle(self, fw)

    # ---- combine ----------------------------------------------------------------------------
    def _combine_result(self, fw: str, out, reduced: bool, T: int, stream: int):
        if out is not None:
            return out
        buf = self._view(fw, "out" if reduced else "out_unreduced")
        if fw == _fw.DLPACK:
            self._impl.synchronize(stream)
            return buf
        return buf[:T]

    def combine(self, expert_out, weights=None, *, out=None, layout: Optional[DispatchOutput] = None,
                stream=None):
        """Brings the expert outputs back to the tokens' ranks and reduces them. expert_out
        [max_recv_rows, H] bf16 in the dispatch's row order, or [G, capacity, H] in the padded
        per-expert layout (group g's rows at [g, 0 .. count), capacity at least n_ranks *
        max_tokens_per_rank), as a masked grouped GEMM writes it. Returns [T, H] bf16 (router weights
        given to dispatch, or here as weights [T, K] float32) or the un-reduced [T, K, H].
        expert_out may be narrower than the dispatched rows (h columns, a multiple of 8, fewer
        than H): the output then has h columns, the first h of a full-width combine, and must
        be given as out=.
        layout: the DispatchOutput the rows came from when it was dispatched into out=."""
        fw = _fw.framework_of(expert_out)
        if fw == _fw.DLPACK:
            _fw.ready(expert_out)
        s = _fw.stream_handle(stream, fw, self.device)
        ro, si = (layout.row_offsets, layout.src_info) if layout is not None else (None, None)
        reduced, T = self._impl.combine(expert_out, weights, s, out, ro, si)
        return self._combine_result(fw, out, reduced, T, s)

    def combine_async(self, expert_out, *, layout: Optional[DispatchOutput] = None,
                      stream=None) -> CombineHandle:
        """The send half of combine; the handle's wait(weights=None, out=None) completes it."""
        fw = _fw.framework_of(expert_out)
        if fw == _fw.DLPACK:
            _fw.ready(expert_out)
        ro, si = (layout.row_offsets, layout.src_info) if layout is not None else (None, None)
        self._impl.combine_async(expert_out, _fw.stream_handle(stream, fw, self.device), ro, si)
        return CombineHandle(self, fw)


def silu(x, row_offsets, *, format: str = "bf16", src_info=None, global_scales=None,
         interleaved: bool = False, clamp=None, out=None, stream=None):
    """The fused SiLU / SwiGLU of every dispatch row after the first grouped GEMM (epcomm/silu.h):
    z = silu(gate) * up of x [rows, 2I] bf16 (gate then up), for rows [0, row_offsets[G]), read
    on the device. Returns, by format:
      "bf16"           out [rows, I] bf16
      "fp8-blockwise"  (codes [rows, I] float8_e4m3fn / uint8, scales float32 [I / 128, rows]);
                       src_info (the dispatch's) marks FP8 padding rows, written as zero
      "nvfp4"          (codes [rows, I / 2] uint8, swizzled scales uint8, scales_offsets int32
                       [G]); global_scales float32 [G]; interleaved: x is [g0, u0, g1, u1, ...]
      "mxfp4"          (codes [rows, I / 2] uint8, scales uint8 [rows, I / 32]); clamp =
                       (limit, alpha) for the clamped SwiGLU
    Outputs are allocated with x's framework (torch, cupy) unless out= gives them (a tensor,
    or a tuple in the order above)."""
    fw = _fw.framework_of(x)
    if x.shape[-1] % 2:
        raise InvalidArgument(f"epcomm silu: x has {x.shape[-1]} columns; it needs 2 * I")
    inter, rows = int(x.shape[-1]) // 2, int(x.shape[0])
    dev = x.device.index if fw == _fw.TORCH else (x.device.id if fw == _fw.CUPY else 0)
    s = _fw.stream_handle(stream, fw, dev)
    if clamp is not None and format != "mxfp4":
        raise InvalidArgument("epcomm silu: clamp is only for format='mxfp4'")
    if global_scales is not None and format != "nvfp4":
        raise InvalidArgument("epcomm silu: global_scales is only for format='nvfp4'")
    if format == "bf16":
        o = out if out is not None else _fw.empty(fw, x, (rows, inter), "bfloat16")
        _C.silu_bf16(x, row_offsets, inter, o, s)
        return o
    if format == "fp8-blockwise":
        codes, scales = out if out is not None else (
            _fw.empty(fw, x, (rows, inter), "uint8"),
            _fw.empty(fw, x, (inter // 128, rows), "float32"),
        )
        _C.silu_fp8(x, row_offsets, inter, src_info, codes, scales, s)
        if out is None and fw == _fw.TORCH:
            codes = codes.view(_fw._torch_dtype("float8_e4m3fn"))
        return codes, scales
    if format == "nvfp4":
        if global_scales is None:
            raise InvalidArgument("epcomm silu: format='nvfp4' needs global_scales [G] float32")
        G = int(row_offsets.shape[0]) - 1
        if out is None:
            out = (
                _fw.empty(fw, x, (rows, inter // 2), "uint8"),
                _fw.empty(fw, x, (_C.nvfp4_scales_bytes(inter, rows, max(G, 1)),), "uint8"),
                _fw.empty(fw, x, (max(G, 0),), "int32"),
            )
        _C.silu_nvfp4(x, row_offsets, inter, out[0], out[1], out[2], global_scales, interleaved, s)
        return out
    if format == "mxfp4":
        if out is None:
            out = (
                _fw.empty(fw, x, (rows, inter // 2), "uint8"),
                _fw.empty(fw, x, (rows, inter // 32), "uint8"),
            )
        _C.silu_mxfp4(x, row_offsets, inter, out[0], out[1],
                      None if clamp is None else (float(clamp[0]), float(clamp[1])), s)
        return out
    raise InvalidArgument(
        f"epcomm silu: format = {format!r} is invalid: one of 'bf16', 'fp8-blockwise', 'nvfp4', "
        "'mxfp4'"
    )
