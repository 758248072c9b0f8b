"""epcomm's dispatch and combine as PyTorch operators (torch.library custom ops), so that a MoE
layer built on them traces whole: torch.compile(fullgraph=True), torch.export, CUDA graphs.

Every output has a fixed shape, the group's capacity (Group.dispatch_output_descs), so nothing
in a traced graph depends on the routing; each op's fake implementation makes its outputs from
those descriptions. The ops return new tensors on every call (PyTorch's caching allocator
reuses the memory), never views of the group's own buffers.

    import epcomm.torch_ops as ops
    gid = ops.register(group)                           # once per epcomm.Group
    d = ops.dispatch(gid, tokens, topk_ids, weights)    # an epcomm.DispatchOutput
    y = ops.combine(gid, expert_out, d, num_tokens=tokens.shape[0],
                    reduced=weights is not None)        # [T, H] bf16 (or [T, K, H])

The operators themselves are torch.ops.epcomm.dispatch and torch.ops.epcomm.combine; the two
functions above wrap them. register(config, n_ranks=...) registers the shapes of a group that
does not exist in this process: enough to trace or export a model (the fake implementations),
not to run it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import List, Optional

import torch

from . import _epcomm as _C
from . import _frameworks as _fw
from . import DispatchOutput, InvalidArgument

# The dispatch outputs, in the order the operator returns them (DispatchOutput's fields).
OUTPUT_NAMES = ("tokens", "scales", "row_offsets", "expert_ids", "src_info", "scales_offsets",
                "counts", "slot_token", "layout_range")


@dataclass(frozen=True)
class _Entry:
    group: object        # the epcomm.Group, or None for a shapes-only entry
    config: object       # its epcomm.Config
    descs: dict          # name -> TensorDesc of every dispatch output
    present: tuple       # per OUTPUT_NAMES: whether the format has it (plain bools: the
                         # wrappers read them while torch.compile traces)


_entries: dict = {}
_ids = itertools.count()  # next() is atomic under the GIL


def register(group_or_config, n_ranks: Optional[int] = None) -> int:
    """Makes a group reachable from the operators; returns the id they take. An epcomm.Group
    (its dispatch and combine run), or an epcomm.Config with n_ranks (shapes only: tracing and
    export work, running raises)."""
    if n_ranks is None:
        group = group_or_config
        config = group.config
        descs = group.dispatch_output_descs()
    else:
        group = None
        config = group_or_config
        if not isinstance(config, _C.Config):
            raise TypeError("epcomm ops: register(config, n_ranks=...) takes an epcomm.Config")
        if int(n_ranks) < 1:
            raise InvalidArgument(
                f"epcomm ops: register: n_ranks is {n_ranks}; it must be at least 1")
        descs = {d.name: d for d in _C.dispatch_output_descs(config, config.sizes(int(n_ranks)))}
    missing = [n for n in OUTPUT_NAMES if n not in descs]
    if missing:
        raise RuntimeError(f"register: the group describes no {missing} output")
    gid = next(_ids)
    _entries[gid] = _Entry(group, config, descs, tuple(bool(descs[n].bytes) for n in OUTPUT_NAMES))
    return gid


def unregister(group_id: int) -> None:
    """Forgets an id (the ops then refuse it, InvalidArgument); the group itself is not
    closed."""
    _entries.pop(int(group_id), None)


def _entry(group_id: int) -> _Entry:
    e = _entries.get(int(group_id))
    if e is None:
        raise InvalidArgument(
            f"epcomm ops: no group registered as {group_id} (epcomm.torch_ops.register)")
    return e


def _running(group_id: int):
    g = _entry(group_id).group
    if g is None:
        raise InvalidArgument(f"epcomm ops: group {group_id} was registered for its shapes only "
                           "(register(config, n_ranks=...)); it cannot run")
    return g


def _as_output(outs, present) -> DispatchOutput:
    """The operator's list as a DispatchOutput: an output the format does not have is None."""
    return DispatchOutput(**{n: (t if p else None) for n, t, p in zip(OUTPUT_NAMES, outs, present)})


def _empty(desc, like: torch.Tensor) -> torch.Tensor:
    return _fw.empty(_fw.TORCH, like, desc.shape, desc.dtype)


# ---- dispatch -----------------------------------------------------------------------------------

@torch.library.custom_op("epcomm::dispatch", mutates_args=())
def _dispatch_op(group_id: int, tokens: torch.Tensor, topk_ids: torch.Tensor,
                 weights: Optional[torch.Tensor]) -> List[torch.Tensor]:
    g = _running(group_id)
    e = _entry(group_id)
    outs = [_empty(e.descs[n], tokens) for n in OUTPUT_NAMES]
    # Outputs a format does not have (shape (0,)) stay as the empty tensors.
    g.dispatch(tokens, topk_ids, weights, out=_as_output(outs, e.present))
    return outs


@_dispatch_op.register_fake
def _dispatch_fake(group_id, tokens, topk_ids, weights):
    descs = _entry(group_id).descs
    return [_empty(descs[n], tokens) for n in OUTPUT_NAMES]


def _keep(op) -> None:
    """Marks an operator as having side effects, so graph passes never drop a call whose
    outputs go unused: every rank of the group waits for every other's call."""
    mark = getattr(torch.fx.node, "has_side_effect", None)
    if mark is not None:
        mark(op)


_keep(torch.ops.epcomm.dispatch.default)


def dispatch(group_id: int, tokens: torch.Tensor, topk_ids: torch.Tensor,
             weights: Optional[torch.Tensor] = None) -> DispatchOutput:
    """Group.dispatch as an operator (see Group.dispatch): returns a DispatchOutput of new
    tensors, an output the format does not have as None."""
    outs = torch.ops.epcomm.dispatch(group_id, tokens, topk_ids, weights)
    return _as_output(outs, _entry(group_id).present)


# ---- combine ------------------------------------------------------------------------------------

@dataclass
class _Layout:  # what Group.combine reads of a DispatchOutput given as layout=
    row_offsets: torch.Tensor
    src_info: torch.Tensor


def _combine_shape(group_id: int, num_tokens: int, reduced: bool, expert_out: torch.Tensor):
    # As wide as the expert outputs' rows: the group's hidden, or fewer (a combine of fewer
    # columns than the dispatch carried).
    desc = _C.combine_output_desc(_entry(group_id).config, int(num_tokens), bool(reduced),
                                  int(expert_out.size(-1)))
    return tuple(desc.shape)


@torch.library.custom_op("epcomm::combine", mutates_args=())
def _combine_op(group_id: int, expert_out: torch.Tensor, row_offsets: torch.Tensor,
                src_info: torch.Tensor, weights: Optional[torch.Tensor], num_tokens: int,
                reduced: bool) -> torch.Tensor:
    g = _running(group_id)
    out = torch.empty(_combine_shape(group_id, num_tokens, reduced, expert_out),
                      dtype=torch.bfloat16, device=expert_out.device)
    g.combine(expert_out, weights, out=out, layout=_Layout(row_offsets, src_info))
    return out


@_combine_op.register_fake
def _combine_fake(group_id, expert_out, row_offsets, src_info, weights, num_tokens, reduced):
    return expert_out.new_empty(_combine_shape(group_id, num_tokens, reduced, expert_out))


_keep(torch.ops.epcomm.combine.default)


def combine(group_id: int, expert_out: torch.Tensor, layout: DispatchOutput, *, num_tokens: int,
            reduced: bool, weights: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Group.combine as an operator (see Group.combine), for the dispatch that produced
    `layout` from num_tokens tokens. reduced: whether the rows are summed, that is whether router
    weights went to that dispatch or come here as `weights` (a traced graph needs the output's
    shape before it runs: [T, H] reduced, else [T, top_k, H]); a wrong value raises when the op
    runs."""
    if weights is not None and not reduced:
        raise InvalidArgument("epcomm ops: combine with weights is reduced: pass reduced=True")
    return torch.ops.epcomm.combine(group_id, expert_out, layout.row_offsets, layout.src_info,
                                    weights, int(num_tokens), bool(reduced))
