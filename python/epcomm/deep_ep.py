"""DeepEP's Python `Buffer` API, run by epcomm: code written for DeepEP runs on epcomm by
changing its import.

    # from deep_ep import Buffer, EventOverlap, Config
    from epcomm.deep_ep import Buffer, EventOverlap, Config

The calls take DeepEP's argument names, dtypes and shapes and return its tuples. What epcomm
does not do (several nodes, RDMA-only transport, LogFMT combine, the wait-time statistics) raises epcomm.InvalidArgument naming the argument; nothing
is silently different. docs/deep_ep.md maps every call.

How it runs on epcomm:
  normal mode   dispatch sends each token once to each rank in is_token_in_rank (an epcomm group
                whose "experts" are the ranks), so the received rows are DeepEP's: one per
                (token, rank), by source rank then token. topk_idx, topk_weights and FP8 scales
                travel beside them, bit for bit, in a second small dispatch. combine sums each
                token's rows over the ranks in fp32 (rank ascending) and rounds once to bf16.
  low latency   an epcomm group over the real experts (FP8 blockwise or bf16); its expert-major
                rows are copied into DeepEP's padded [local experts, ranks * max tokens, H]
                layout, and combine copies them back and reduces with the router weights.
Every call is stream-ordered and checked; outputs are new tensors the caller owns.
"""

from __future__ import annotations

import itertools
import operator
import os
import weakref
from typing import Optional, Tuple, Union

import torch
import torch.distributed as dist

from . import _epcomm as _C
from . import Error, Group, InvalidArgument, MAX_TOP_K, torch_bootstrap

# The ranks of one NVLink node: the most this layer takes (it runs no group across nodes).
_NODE_RANKS = 8
# Buffer's max_tokens_per_rank when not given: this variable, else the default.
_MAX_TOKENS_ENV = "EPCOMM_DEEP_EP_MAX_TOKENS"
_DEFAULT_MAX_TOKENS = 4096

__all__ = ["Buffer", "Config", "EventHandle", "EventOverlap", "topk_idx_t"]

topk_idx_t = torch.int64  # DeepEP's index dtype


def _collective(group, t: torch.Tensor, op: str):
    """all_reduce (sum; returns the sum) or all_gather (returns every rank's copy, in rank
    order) of a small tensor over a torch.distributed group, on t's device; through host
    memory where the group's backend (gloo) does not take device tensors. Leaves t as it was."""
    dev = t.device
    on_host = dev.type == "cuda" and dist.get_backend(group) == "gloo"
    x = t.cpu() if on_host else t.clone()
    if op == "all_reduce":
        dist.all_reduce(x, group=group)
        return x.to(dev)
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x, group=group)
    return [q.to(dev) for q in parts]


# The current CUDA stream's handle on a device: torch's own accessor (what its compiled code
# uses), far cheaper than torch.cuda.current_stream(device).cuda_stream, which builds a Stream.
_current_stream_handle = getattr(torch._C, "_cuda_getCurrentRawStream", None) or \
    (lambda device: torch.cuda.current_stream(device).cuda_stream)


def _bad(call: str, msg: str):
    raise InvalidArgument(f"epcomm.deep_ep {call}: {msg}")


def _check(call: str, name: str, t, dtype=None, ndim=None, rows=None, cols=None, contiguous=True):
    # The common case first, in one expression (a call's host time is mostly such checks):
    # a plain tensor of the one dtype and the rank asked, which the full checks below pass.
    if type(t) is torch.Tensor and t.dtype is dtype and t.dim() == ndim and \
            (rows is None or t.size(0) == rows) and (cols is None or t.size(1) == cols) and \
            (not contiguous or t.is_contiguous()):
        return
    if not isinstance(t, torch.Tensor):
        _bad(call, f"{name} must be a torch.Tensor; got {type(t).__name__}")
    if dtype is not None and t.dtype not in (dtype if isinstance(dtype, tuple) else (dtype,)):
        want = " or ".join(str(d) for d in (dtype if isinstance(dtype, tuple) else (dtype,)))
        _bad(call, f"{name} must be {want}; got {t.dtype}")
    if ndim is not None and t.dim() != ndim:
        _bad(call, f"{name} must be {ndim}-D; got shape {list(t.shape)}")
    if rows is not None and t.size(0) != rows:
        _bad(call, f"{name} must have {rows} rows; got shape {list(t.shape)}")
    if cols is not None and t.size(1) != cols:
        _bad(call, f"{name} must have {cols} columns; got shape {list(t.shape)}")
    if contiguous and not t.is_contiguous():
        _bad(call, f"{name} must be contiguous; call .contiguous()")


def _capturing() -> bool:
    """Whether the current stream is capturing a CUDA graph (without initialising CUDA)."""
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def _stream_of(handle: int, device) -> torch.cuda.Stream:
    """The torch stream whose CUDA handle is `handle`. The default stream's handle is 0, and
    torch.cuda.ExternalStream(0) is not that stream but a fresh one from torch's pool (a null
    pointer reads as "none given"), so work queued there would be ordered with nothing."""
    if handle == 0:
        return torch.cuda.default_stream(device)
    return torch.cuda.ExternalStream(handle, device=device)


class EventHandle(torch.cuda.Event):
    """DeepEP's EventHandle: a CUDA event recorded on the current stream (or `stream`) when it
    is made; current_stream_wait() makes the current stream wait for it. Megatron passes
    EventOverlap(EventHandle()) as previous_event."""

    def __new__(cls, stream: Optional[torch.cuda.Stream] = None):
        return super().__new__(cls)

    def __init__(self, stream: Optional[torch.cuda.Stream] = None):
        super().__init__()
        self.record(stream if stream is not None else torch.cuda.current_stream())

    def current_stream_wait(self) -> None:
        torch.cuda.current_stream().wait_event(self)


class EventOverlap:
    """A CUDA event (or None) with the tensors that must live until it completes, as DeepEP's.
    `with event:` (or `with event(release_handle=True):`) and current_stream_wait() make the
    current stream wait for it, then run the hook registered with register_hook_after_wait."""

    def __init__(self, event: Optional[torch.cuda.Event] = None, extra_tensors=None):
        self.event = event
        self.extra_tensors = extra_tensors
        self.hook_after_wait = None
        self._release_handle_by_call = False

    def current_stream_wait(self, release_handle: bool = False) -> None:
        """The current stream waits for the event; then the registered hook runs (once), and
        with release_handle the event is dropped."""
        if self.event is None:
            raise Error("epcomm.deep_ep EventOverlap.current_stream_wait: no event (the call "
                        "was not made with async_finish=True)")
        wait = getattr(self.event, "current_stream_wait", None)
        if wait is not None:
            wait()
        else:
            torch.cuda.current_stream().wait_event(self.event)
        if self.hook_after_wait is not None:
            hook, self.hook_after_wait = self.hook_after_wait, None
            hook()
        if release_handle:
            self.event = None

    def register_hook_after_wait(self, hook_after_wait) -> None:
        """A callable run once after the next current_stream_wait()."""
        if self.hook_after_wait is not None:
            raise Error("epcomm.deep_ep EventOverlap.register_hook_after_wait: a hook is "
                        "already registered")
        self.hook_after_wait = hook_after_wait

    def __call__(self, release_handle: bool = False) -> "EventOverlap":
        """`with event(release_handle=True):` drops the event after the wait at the end."""
        self._release_handle_by_call = release_handle
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.event is not None:
            self.current_stream_wait(release_handle=self._release_handle_by_call)
        self._release_handle_by_call = False


class Config:
    """DeepEP's per-call tuning. epcomm uses num_sms (the SMs its kernels take); the chunk
    sizes are DeepEP's ring-buffer tuning, kept for the size hints and otherwise unused."""

    def __init__(self, num_sms: int = 20, num_max_nvl_chunked_send_tokens: int = 6,
                 num_max_nvl_chunked_recv_tokens: int = 256,
                 num_max_rdma_chunked_send_tokens: int = 6,
                 num_max_rdma_chunked_recv_tokens: int = 256):
        if int(num_sms) < 1:
            _bad("Config", f"num_sms = {num_sms} must be positive")
        self.num_sms = int(num_sms)
        self.num_max_nvl_chunked_send_tokens = int(num_max_nvl_chunked_send_tokens)
        self.num_max_nvl_chunked_recv_tokens = int(num_max_nvl_chunked_recv_tokens)
        self.num_max_rdma_chunked_send_tokens = int(num_max_rdma_chunked_send_tokens)
        self.num_max_rdma_chunked_recv_tokens = int(num_max_rdma_chunked_recv_tokens)

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        # DeepEP's ring: one channel per two SMs, each holding this many tokens per peer.
        per_token = int(hidden_bytes) + 64
        return (self.num_sms // 2 or 1) * int(num_ranks) * self.num_max_nvl_chunked_recv_tokens \
            * per_token

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        return 0  # one node: no RDMA buffer


class _Routing:
    """What a normal-mode dispatch fixes: which ranks each token went to, and the receive side's
    row count. The handle DeepEP returns. Like DeepEP's 6-tuple it can be indexed: handle[0] is
    rank_prefix_matrix and handle[4] is_token_in_rank; the other four entries (DeepEP's
    channels, and recv_src_idx, which is not kept) raise InvalidArgument, so unpacking or
    iterating the handle raises too."""

    _ENTRIES = ("rank_prefix_matrix", "channel_prefix_matrix", "recv_channel_prefix_matrix",
                "recv_src_idx", "is_token_in_rank", "send_head")

    def __init__(self, buffer, num_tokens, num_experts, worst):
        # Weakly: the Buffer keeps its last routings (Buffer._routing), and a cycle would leave
        # the Buffer, and the collective teardown of its groups, to the cycle collector, which
        # runs at a different moment on each rank.
        self._buffer = weakref.ref(buffer)
        self.rank_ids = None              # int32 [T, R]: r or -1 (the epcomm groups' top-k)
        self.num_tokens = num_tokens
        self.num_experts = num_experts
        self.num_rows = 0                 # rows of recv_x (num_worst_tokens where given)
        self.worst = worst                # the recv row cap (num_worst_tokens) or 0
        self.data_key = None              # the group the rows went through (last dispatch)
        self.meta_key = None              # the group the top-k and weights went through
        self.is_token_in_rank = None      # bool [T, R], the dispatch's
        self.tokens_to_rank = None        # int32 [R]: this rank's tokens sent to each rank
        self.tokens_ready = None          # event: tokens_to_rank written (on the call's stream)
        self._prefix = None               # rank_prefix_matrix, once read

    @property
    def buffer(self):
        """The Buffer whose dispatch made this routing (None once it is gone)."""
        return self._buffer()

    def __len__(self):
        return len(self._ENTRIES)

    def __getitem__(self, i):
        i = operator.index(i)
        if not -len(self) <= i < len(self):
            raise IndexError(f"a dispatch handle has {len(self)} entries; got index {i}")
        i %= len(self)
        if i == 0:
            return self.rank_prefix_matrix()
        if i == 4:
            return self.is_token_in_rank
        why = ("is not kept: each received row's source lives in epcomm's own layout, "
               "overwritten by the next dispatch" if i == 3 else
               "describes DeepEP's channels, which epcomm does not have")
        _bad("handle", f"handle[{i}] ({self._ENTRIES[i]}) {why}; handle[0] "
                       "(rank_prefix_matrix) and handle[4] (is_token_in_rank) are given")

    def rank_prefix_matrix(self) -> torch.Tensor:
        """int32 [R, R]: entry [i][j] = the tokens ranks 0..i sent to rank j, so rank j's
        received rows from source i end at row [i][j]. Gathered from every rank the first time
        it is read: a collective over the Buffer's group, so every rank must read it at the same
        point of the group's sequence of collectives (DeepEP computes it in dispatch)."""
        if self._prefix is None:
            buffer = self.buffer
            if buffer is None:
                raise Error("epcomm.deep_ep handle[0]: the Buffer of this dispatch is gone")
            # The counts were written on the dispatch's stream: the caller may read handle[0]
            # before waiting on an async dispatch's event.
            if self.tokens_ready is not None:
                here = torch.cuda.current_stream(buffer.device)
                here.wait_event(self.tokens_ready)
                # Made on the dispatch's stream, read here: its memory waits for this one too.
                self.tokens_to_rank.record_stream(here)
            parts = _collective(buffer.group, self.tokens_to_rank, "all_gather")
            self._prefix = torch.stack(parts).cumsum(0, dtype=torch.int32)
        return self._prefix


class _LowLatencyHandle(tuple):
    """DeepEP's 5-tuple (src_info [E_l, S] int32, layout_range [E_l, R] int64, max tokens,
    hidden, num_experts), carrying the epcomm group it came from."""

    def __new__(cls, items, group, key, topk_shape):
        h = super().__new__(cls, items)
        h.group, h.key, h.topk_shape = group, key, topk_shape
        return h


class Buffer:
    """DeepEP's Buffer over a torch.distributed group of at most 8 ranks (one node).

    Beyond DeepEP's arguments (keyword only):
      max_tokens_per_rank  the most tokens a normal-mode dispatch takes on any rank (DeepEP has
                           no such bound; epcomm sizes its buffers by it). Default:
                           EPCOMM_DEEP_EP_MAX_TOKENS from the environment, else 4096 (a
                           framework that builds the Buffer itself cannot pass the argument).
      share_gpus           let ranks share a GPU (tests on fewer GPUs than ranks); default: on
                           exactly when two ranks of the group are on one GPU.
      timeout_seconds      the bound on every wait for a peer (default: epcomm's, 300 s or
                           EPCOMM_TIMEOUT_SECONDS).
    num_nvl_bytes and num_rdma_bytes are accepted and not used: epcomm sizes its buffers from
    the shapes of the first call of each kind."""

    num_sms: int = 20

    def __init__(self, group, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 24,
                 allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False,
                 explicitly_destroy: bool = False, enable_shrink: bool = False, comm=None, *,
                 max_tokens_per_rank: Optional[int] = None, share_gpus: Optional[bool] = None,
                 timeout_seconds: Optional[float] = None):
        call = "Buffer"
        if comm is not None:
            _bad(call, "comm (an mpi4py communicator) is not supported: pass group, a "
                       "torch.distributed process group")
        if group is None:
            _bad(call, "group must be a torch.distributed process group")
        if not allow_nvlink_for_low_latency_mode:
            _bad(call, "allow_nvlink_for_low_latency_mode=False asks for RDMA inside the node; "
                       "epcomm moves every byte over NVLink")
        if enable_shrink:
            _bad(call, "enable_shrink=True (masking failed ranks) is not supported")
        if not dist.is_initialized():
            _bad(call, "torch.distributed is not initialised")
        self.group = group
        self.rank = dist.get_rank(group)
        self.group_size = dist.get_world_size(group)
        if self.group_size > _NODE_RANKS:
            _bad(call, f"the group has {self.group_size} ranks; this layer connects the GPUs of "
                       f"one node (at most {_NODE_RANKS})")
        if max_tokens_per_rank is None:  # frameworks cannot pass it: the environment can
            env = os.environ.get(_MAX_TOKENS_ENV)
            try:
                max_tokens_per_rank = int(env) if env is not None else _DEFAULT_MAX_TOKENS
            except ValueError:
                _bad(call, f"{_MAX_TOKENS_ENV} = {env!r} is not a whole number")
        if int(max_tokens_per_rank) < 1:
            _bad(call, f"max_tokens_per_rank = {max_tokens_per_rank} must be positive")
        self.num_nvl_bytes = int(num_nvl_bytes)
        self.num_rdma_bytes = int(num_rdma_bytes)
        self.low_latency_mode = bool(low_latency_mode)
        self.num_qps_per_rank = int(num_qps_per_rank)
        self.explicitly_destroy = bool(explicitly_destroy)
        # Multi-node NVLink (an NVL72 domain): DeepEP may then treat GPUs of several hosts as one
        # NVLink node. This layer's groups are one node of at most 8 ranks (refused above
        # otherwise), where the flag changes nothing, so it is accepted (SGLang always passes it).
        self.allow_mnnvl = bool(allow_mnnvl)
        self.enable_shrink = False
        self.max_tokens_per_rank = int(max_tokens_per_rank)
        self.timeout_seconds = (_C.Config().timeout_seconds if timeout_seconds is None
                                else float(timeout_seconds))
        # The GPU is taken at the first call that needs it (the current device then).
        self.device = torch.cuda.current_device() if torch.cuda.is_available() else None
        self._bootstrap = torch_bootstrap(group)
        self.share_gpus = share_gpus
        self._groups = {}       # key -> Group
        self._routing = {}      # key -> the routing (or low-latency handle) last dispatched there
        self._scratch = {}      # key -> tensors a group keeps (combine inputs)
        self._ll_parity = 0
        self._stream = None
        self._comm_handle = None  # self._stream's CUDA handle, set where it is made
        # The stream (handle) after whose queued work every earlier call of the Buffer has run:
        # where a call that waited for the comm stream was made, or the plain calls since;
        # None: the comm stream holds work no stream has waited for (or no call yet).
        self._tail = None
        self._stayed = False  # a plain call ran on _tail since the comm stream's last call
        self._comm_shared = False  # get_comm_stream() was called: no call stays off it
        self._destroyed = False
        # torch.compile: the operators below find this Buffer by its id, and a traced
        # low-latency combine finds its dispatch's handle by the src_info tensor it returned
        # (_ll_handle_of).
        self._op_id = next(_op_ids)
        _op_buffers[self._op_id] = weakref.ref(
            self, lambda _, i=self._op_id: _op_buffers.pop(i, None))  # gone with the Buffer
        # Threads the compiled calls in program order (the operators take it as mutated).
        self._ll_token = torch.zeros(1, dtype=torch.int64, device=self.device)

    # ---- DeepEP's static helpers --------------------------------------------------------
    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """SMs epcomm's kernels take, for groups set up after this call (DeepEP asks for an
        even number; epcomm takes any positive one)."""
        if int(new_num_sms) < 1:
            _bad("set_num_sms", f"new_num_sms = {new_num_sms} must be positive")
        Buffer.num_sms = int(new_num_sms)

    @staticmethod
    def capture() -> EventOverlap:
        return EventOverlap(EventHandle())  # recorded on the current stream

    @staticmethod
    def is_sm90_compiled() -> bool:
        return True

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        return Config(Buffer.num_sms)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        return Config(Buffer.num_sms)

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int,
                                       num_ranks: int, num_experts: int) -> int:
        """Bytes of the low-latency mode's padded outputs for one call (epcomm takes no RDMA
        buffer; num_rdma_bytes is not used)."""
        slots = num_experts // max(num_ranks, 1) * num_ranks * num_max_dispatch_tokens_per_rank
        return slots * hidden * 2

    def get_comm_stream(self) -> torch.cuda.Stream:
        """The stream the Buffer's calls run on. From the first time it is asked for, every
        call runs there (the caller may queue work on it, or wait for it to cover the calls),
        none on the current stream (Buffer._order). While a CUDA graph is being captured it
        orders nothing (as DeepEP's, it has no effect on the streams: a wait for the capturing
        stream would pull the comm stream into the capture); the next call on the comm stream
        then waits for the calls that stayed."""
        self._comm_shared = True
        if self._stayed and not _capturing():
            self._comm_waits_for(self._tail)  # the caller's work there comes after them too
            self._stayed = False
        return self._comm_stream

    def get_local_buffer_tensor(self, dtype, size=None, offset: int = 0,
                                use_rdma_buffer: bool = False):
        _bad("get_local_buffer_tensor", "epcomm exposes no raw communication buffer: pass "
                                        "tensors to dispatch and combine")

    # DeepEP's shrink mode (vLLM's fault tolerance): masking a failed rank out of the
    # low-latency calls. DeepEP asserts enable_shrink=True for these; epcomm refuses that flag
    # at construction, so each says so here.
    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False):
        _bad("low_latency_update_mask_buffer", self._no_shrink)

    def low_latency_query_mask_buffer(self, mask_status: torch.Tensor):
        _bad("low_latency_query_mask_buffer", self._no_shrink)

    def low_latency_clean_mask_buffer(self):
        _bad("low_latency_clean_mask_buffer", self._no_shrink)

    _no_shrink = ("needs shrink mode (Buffer(..., enable_shrink=True)), which epcomm does not "
                  "support: a failed rank cannot be masked out")

    # DeepEP's internode kernels, which its own dispatch and combine call on groups that span
    # nodes. This layer runs one node (the package's epcomm.Group spans nodes through NVSHMEM).
    def internode_dispatch(self, *args, **kwargs):
        _bad("internode_dispatch", self._one_node)

    def internode_combine(self, *args, **kwargs):
        _bad("internode_combine", self._one_node)

    _one_node = ("this layer runs groups within one node; across nodes use epcomm.Group "
                 "directly (NVSHMEM build)")

    def destroy(self) -> None:
        """Tears every epcomm group down (collective), for explicitly_destroy=True."""
        if not self.explicitly_destroy:
            _bad("destroy", "the Buffer was made with explicitly_destroy=False")
        for g in self._groups.values():
            g.close()
        self._groups.clear()
        self._routing.clear()
        self._scratch.clear()
        _op_buffers.pop(self._op_id, None)
        self._destroyed = True

    # ---- internals ------------------------------------------------------------------------
    def _live(self, call: str) -> None:
        if self._destroyed:
            _bad(call, "this Buffer was destroyed")

    @property
    def _comm_stream(self) -> torch.cuda.Stream:
        if self._stream is None:
            if self.device is None:
                raise Error("epcomm.deep_ep: no CUDA device is visible")
            # The highest priority torch gives (out-of-range values map to it), as DeepEP's:
            # its work goes ahead of the compute it overlaps.
            self._stream = torch.cuda.Stream(device=self.device, priority=-100)
            self._comm_handle = self._stream.cuda_stream
        return self._stream

    def _on_device(self, call: str, **tensors) -> None:
        """After the other checks: every tensor given is on this Buffer's GPU."""
        for name, t in tensors.items():
            if t is None:
                continue
            if self.device is None:
                _bad(call, f"{name} is on {t.device}; no CUDA device is visible")
            if not t.is_cuda or t.device.index != self.device:
                _bad(call, f"{name} is on {t.device}; this Buffer runs on cuda:{self.device}")

    def _group(self, key: tuple, **config) -> Group:
        g = self._groups.get(key)
        if g is None:
            if self.device is None:
                raise Error("epcomm.deep_ep: no CUDA device is visible")
            if self.share_gpus is None:  # collective, like every group's set-up
                ids = [None] * self.group_size
                me = str(torch.cuda.get_device_properties(self.device).uuid) + "@" + _hostname()
                dist.all_gather_object(ids, me, group=self.group)
                self.share_gpus = len(set(ids)) < len(ids)
            g = Group.create(self._bootstrap, self.device, share_gpus=bool(self.share_gpus),
                             timeout_seconds=self.timeout_seconds, **config)
            self._groups[key] = g
        return g

    def _order(self, current: int, previous_event, async_finish) -> bool:
        """Whether a call from the stream `current` (a handle) runs on the comm stream. DeepEP
        runs every call there (after previous_event, else after the current stream; without
        async_finish the current stream then waits for it), so each call runs after the
        Buffer's earlier calls whatever stream they came from. A plain call (neither
        previous_event nor async_finish; a low-latency call with a hook does not come here)
        runs on `current` itself where that keeps this order, that is where the Buffer's
        earlier work all precedes what `current` queues next (self._tail), and the caller has
        not been given the comm stream: the same order with no fork and join (two event
        records and two stream waits on the host, and the GPU's latency between streams). A
        call on the comm stream runs after the Buffer's earlier calls there; where plain calls
        stayed on a stream since, the comm stream also waits for that stream unless the
        caller's own wait covers it (the current stream, no previous_event). The call's caller
        sets self._tail = current once the current stream has waited for it (_joined)."""
        tail = self._tail
        if previous_event is None and not async_finish and tail == current and \
                not self._comm_shared:
            self._stayed = True
            return False
        if self._stayed and (tail != current or previous_event is not None):
            try:
                self._comm_waits_for(tail)
            except Exception:  # e.g. that stream is gone: order by the whole device instead
                if _capturing():
                    raise  # (a capture cannot synchronise)
                torch.cuda.synchronize(self.device)
        self._stayed = False
        self._tail = None  # until the current stream has waited for the call, if it does
        return True

    def _comm_waits_for(self, handle: int) -> None:
        self._comm_stream.wait_stream(_stream_of(handle, self.device))

    def _joined(self, current: int) -> None:
        """After a call the stream `current` waited for: every call of the Buffer so far runs
        before what `current` queues next. Not while `current` captures a CUDA graph: what it
        holds then runs only when the graph is replayed."""
        self._tail = None if _capturing() else current

    def _streams(self, call, previous_event, async_finish, allocate_on_comm_stream):
        """(compute, comm): the current stream and the stream the call runs on: the current
        one for a plain call where that keeps DeepEP's order (_order), else the comm stream,
        which waits for previous_event (else the current stream) and the Buffer's earlier
        calls."""
        if allocate_on_comm_stream and (previous_event is None or not async_finish):
            _bad(call, "allocate_on_comm_stream=True needs previous_event and async_finish=True")
        compute = torch.cuda.current_stream(self.device)
        if not self._order(compute.cuda_stream, previous_event, async_finish):
            return compute, compute
        comm = self._comm_stream
        ev = getattr(previous_event, "event", None) if previous_event is not None else None
        if ev is not None:
            comm.wait_event(ev)
        else:
            comm.wait_stream(compute)
        return compute, comm

    def _ll_stream_handles(self, return_recv_hook, async_finish):
        """(compute, on) CUDA stream handles of a low-latency call: the current stream, and the
        one the call runs on. With a receive hook the current one (which receives there; as
        DeepEP's, such a call waits for nothing else). A plain call: the current one where
        that keeps DeepEP's order (_order), else the comm stream. The C++ call orders them (on
        after compute; without async_finish, compute after on; nothing where they are one
        stream)."""
        compute = _current_stream_handle(self.device)
        if return_recv_hook or not self._order(compute, None, async_finish):
            return compute, compute
        if self._comm_handle is None:
            self._comm_stream  # creates the stream, and its handle with it
        return compute, self._comm_handle

    def _ll_joined(self, compute, comm, async_finish, return_recv_hook) -> None:
        """After a low-latency call that ran on the comm stream and that the current stream
        waited for (no async_finish, no hook): _joined. A call that stayed on the current
        stream found _tail there already."""
        if not async_finish and not return_recv_hook and comm != compute:
            self._joined(compute)

    def _failed(self, on_comm: bool, tensors) -> None:
        """After a call that failed: its kernels may have been launched (a failure after them:
        a low-latency call's join, a normal call's allocation of its outputs), so where they
        were to run on the comm stream (on_comm), the tensors they read or write are kept for
        it and the caller's stream waits for it. Otherwise the caller could free them, and the
        caching allocator hand their memory to new work, while the comm stream still uses
        them."""
        if not on_comm:
            return
        try:
            for t in tensors:
                if t is not None:
                    t.record_stream(self._comm_stream)
            torch.cuda.current_stream(self.device).wait_stream(self._comm_stream)
        except Exception:  # e.g. the device has failed: the caller's error is the one to raise
            pass

    def _ll_finish(self, async_finish, stats, count, tensors) -> EventOverlap:
        """After a low-latency call that ran on the comm stream: the received-token counter
        (stats += count, ordered after the call) and, with async_finish, the event and the
        tensors it keeps alive (as _finish)."""
        if not async_finish:
            if stats is not None:
                stats.add_(count)  # the current stream already waits for the call
            return EventOverlap(None)
        comm = self._comm_stream
        if stats is not None:
            with torch.cuda.stream(comm):
                stats.add_(count)
        return self._finish(torch.cuda.current_stream(), comm, True, tensors)

    def _finish(self, compute, comm, async_finish, tensors, returned=()) -> EventOverlap:
        """After a call that ran on `comm` (the comm stream, or the current stream itself):
        `returned`, the outputs allocated on the comm stream, are recorded as used by the
        current stream (where the caller uses them;
        DeepEP does so with allocate_on_comm_stream), so that the caching allocator does not
        hand their memory to the comm stream's next allocation while the current stream still
        reads it. Without async_finish the current stream waits for the call; with it, the
        tensors are kept for the comm stream and an event is returned."""
        if comm is not compute:
            for t in returned:
                if t is not None:
                    t.record_stream(compute)
        if not async_finish:
            if comm is not compute:
                compute.wait_stream(comm)
                self._joined(compute.cuda_stream)
            return EventOverlap(None)
        live = [t for t in tensors if isinstance(t, torch.Tensor)]
        for t in live:
            t.record_stream(comm)
        return EventOverlap(EventHandle(comm), tuple(live))

    def _dispatch_on(self, key: tuple, payload: torch.Tensor, routing: _Routing, num_sms: int,
                     stream: int):
        """Dispatches payload ([T, W] bf16 words) by routing on the group of that width."""
        R = self.group_size
        g = self._group(key, hidden=int(payload.size(1)), top_k=R, n_experts=R,
                        max_tokens_per_rank=self.max_tokens_per_rank, num_sms=num_sms,
                        max_routed_rows=routing.worst)
        # Forgotten first: if the launch fails, no later combine takes the group's rows for
        # those of its previous routing (as a low-latency dispatch's previous handle).
        self._routing.pop(key, None)
        g._impl.dispatch(payload, routing.rank_ids, None, stream)
        self._routing[key] = routing
        return g

    def _routed_group(self, key, width, routing, num_sms, stream):
        """The group of that width with routing as its last dispatch (dispatching a payload of
        no interest first where another dispatch came since)."""
        if self._routing.get(key) is routing:
            return self._groups[key]
        T = routing.num_tokens
        payload = torch.empty((T, width), dtype=torch.bfloat16, device=self.device)
        return self._dispatch_on(key, payload, routing, num_sms, stream)

    # ---- layout ---------------------------------------------------------------------------
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int,
                            previous_event: Optional[EventOverlap] = None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """(num_tokens_per_rank [R] int32, None, num_tokens_per_expert [E] int32,
        is_token_in_rank [T, R] bool, event)."""
        call = "get_dispatch_layout"
        self._live(call)
        _check(call, "topk_idx", topk_idx, topk_idx_t, 2)
        R = self.group_size
        if num_experts < 1 or num_experts % R:
            _bad(call, f"num_experts = {num_experts} must be a positive multiple of the "
                       f"{R} ranks")
        if allocate_on_comm_stream and (previous_event is None or not async_finish):
            _bad(call, "allocate_on_comm_stream=True needs previous_event and async_finish=True")
        self._on_device(call, topk_idx=topk_idx)
        compute, comm = self._streams(call, previous_event, async_finish, allocate_on_comm_stream)
        # Everything this call enqueues runs on `comm` (_streams: the comm stream, after
        # previous_event, or the current stream); the allocations are on the stream the caller
        # asked for (they launch nothing).
        with torch.cuda.stream(comm if allocate_on_comm_stream else compute):
            T = topk_idx.size(0)
            per_rank = torch.empty(R, dtype=torch.int32, device=self.device)
            per_expert = torch.empty(num_experts, dtype=torch.int32, device=self.device)
            is_token_in_rank = torch.empty((T, R), dtype=torch.bool, device=self.device)
        # One launch (epcomm/routing_layout.h) writes all three; an id outside [0, num_experts)
        # masks its slot, as -1 does. (topk_idx is contiguous: _check.) The dispatch computes
        # its own rank ids from the is_token_in_rank it is given: the caller may change it, and
        # tensors made under inference_mode have no version counter to tell.
        _C.routing_layout(topk_idx.data_ptr(), topk_idx.element_size(), T, topk_idx.size(1),
                          num_experts, R, per_rank.data_ptr(), per_expert.data_ptr(),
                          is_token_in_rank.data_ptr(), self.device, comm.cuda_stream)
        event = self._finish(compute, comm, async_finish,
                             (topk_idx, per_rank, per_expert, is_token_in_rank),
                             (per_rank, per_expert, is_token_in_rank)
                             if allocate_on_comm_stream else ())
        return per_rank, None, per_expert, is_token_in_rank, event

    # ---- normal mode ----------------------------------------------------------------------
    def dispatch(self, x: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]],
                 handle: Optional[_Routing] = None,
                 num_tokens_per_rank: Optional[torch.Tensor] = None,
                 num_tokens_per_rdma_rank: Optional[torch.Tensor] = None,
                 is_token_in_rank: Optional[torch.Tensor] = None,
                 num_tokens_per_expert: Optional[torch.Tensor] = None,
                 topk_idx: Optional[torch.Tensor] = None,
                 topk_weights: Optional[torch.Tensor] = None, expert_alignment: int = 1,
                 num_worst_tokens: int = 0, config: Optional[Config] = None,
                 previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False):
        """(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle,
        event); with a cached handle (recv_x, None, None, None, None, event)."""
        call = "dispatch"
        self._live(call)
        R = self.group_size
        if isinstance(x, tuple):
            if len(x) != 2:
                _bad(call, "x as a tuple must be (fp8 codes [T, H], scales [T, H / 128])")
            codes, scales = x
            _check(call, "x[0]", codes, None, 2)
            if codes.element_size() != 1:
                _bad(call, f"x[0] must be a 1-byte (FP8) tensor; got {codes.dtype}")
            _check(call, "x[1]", scales, (torch.float32, torch.int32), 2, rows=codes.size(0),
                   contiguous=False)
        else:
            codes, scales = x, None
            _check(call, "x", codes, torch.bfloat16, 2)
        T = codes.size(0)
        row_bytes = codes.size(1) * codes.element_size()
        if row_bytes % 16:
            _bad(call, f"x rows are {row_bytes} bytes; they must be a multiple of 16")
        if num_tokens_per_rdma_rank is not None:
            _bad(call, "num_tokens_per_rdma_rank must be None: epcomm connects one node")
        if expert_alignment < 1:
            _bad(call, f"expert_alignment = {expert_alignment} must be positive")
        if T > self.max_tokens_per_rank:
            _bad(call, f"x has {T} tokens; this Buffer takes at most max_tokens_per_rank = "
                       f"{self.max_tokens_per_rank} (a keyword argument of Buffer, or "
                       f"{_MAX_TOKENS_ENV} in the environment)")
        num_sms = (config.num_sms if config is not None else Buffer.num_sms)
        cached = handle is not None
        if cached:
            if not isinstance(handle, _Routing) or handle.buffer is not self:
                _bad(call, "handle must come from this Buffer's dispatch")
            if topk_idx is not None or topk_weights is not None:
                _bad(call, "a cached dispatch (handle given) takes no topk_idx / topk_weights")
            if num_worst_tokens and num_worst_tokens != handle.worst:
                _bad(call, "num_worst_tokens must be the handle's (or 0)")
            if T != handle.num_tokens:
                _bad(call, f"x has {T} tokens; the handle's dispatch had {handle.num_tokens}")
            routing = handle
            K = 0
        else:
            _check(call, "is_token_in_rank", is_token_in_rank, torch.bool, 2, rows=T, cols=R)
            _check(call, "num_tokens_per_expert", num_tokens_per_expert, torch.int32, 1)
            if num_tokens_per_rank is not None:
                _check(call, "num_tokens_per_rank", num_tokens_per_rank, torch.int32, 1, rows=R)
            E = num_tokens_per_expert.size(0)
            if E < 1 or E % R:
                _bad(call, f"num_tokens_per_expert has {E} experts; a positive multiple of the "
                           f"{R} ranks is needed")
            if (topk_idx is None) != (topk_weights is None):
                _bad(call, "give topk_idx and topk_weights together, or neither")
            K = 0
            if topk_idx is not None:
                _check(call, "topk_idx", topk_idx, topk_idx_t, 2, rows=T)
                K = topk_idx.size(1)
                _check(call, "topk_weights", topk_weights, torch.float32, 2, rows=T, cols=K)
                # The received side's bounds (epcomm/routing_layout.h: received_topk), refused
                # here, before anything is launched.
                if K > _C.ROUTING_MAX_TOP_K:
                    _bad(call, f"topk_idx has {K} columns; at most {_C.ROUTING_MAX_TOP_K}")
                if E // R > _C.ROUTING_MAX_COUNTERS:
                    _bad(call, f"{E // R} experts a rank; at most {_C.ROUTING_MAX_COUNTERS} "
                               "with topk_idx")
            if num_worst_tokens < 0:
                _bad(call, f"num_worst_tokens = {num_worst_tokens} must be >= 0")
            if num_worst_tokens and K == 0:
                _bad(call, "num_worst_tokens needs topk_idx (its padding rows get index -1)")
            self._on_device(call, is_token_in_rank=is_token_in_rank,
                            num_tokens_per_expert=num_tokens_per_expert,
                            num_tokens_per_rank=num_tokens_per_rank, topk_idx=topk_idx,
                            topk_weights=topk_weights)
            routing = _Routing(self, T, E, int(num_worst_tokens))
            routing.is_token_in_rank = is_token_in_rank
        self._on_device(call, x=codes, scales=scales)
        S = 0 if scales is None else scales.size(1)
        layout = _NormalMeta(K, S)  # the int32 words after the codes (_normal_rows)
        meta_words = layout.words
        cw = row_bytes // 4     # the codes' int32 words (row_bytes is a multiple of 16)
        compute, comm = self._streams(call, previous_event, async_finish, allocate_on_comm_stream)
        alloc = comm if allocate_on_comm_stream else compute
        # Every caller tensor the comm stream reads is kept for it (an async call returns
        # before the stream has read them): is_token_in_rank gives the rank ids, and
        # num_tokens_per_expert the per-expert list where no top-k travels (a cached dispatch
        # reads neither, and does not check them).
        read = () if cached else (is_token_in_rank, num_tokens_per_expert)
        try:
            with torch.cuda.stream(comm):
                stream = comm.cuda_stream
                if routing.rank_ids is None:  # on the call's stream: after previous_event
                    # One launch (epcomm/routing_layout.h): the epcomm groups' top-k (r or -1) and
                    # this rank's tokens per rank, from the mask.
                    routing.rank_ids = torch.empty((T, R), dtype=torch.int32, device=codes.device)
                    routing.tokens_to_rank = torch.empty(R, dtype=torch.int32, device=codes.device)
                    _C.routing_layout_of_mask(is_token_in_rank.data_ptr(), T, R,
                                              routing.tokens_to_rank.data_ptr(),
                                              routing.rank_ids.data_ptr(), self.device, stream)
                    routing.tokens_ready = EventHandle(comm)
                if meta_words:
                    # One dispatch: each row carries the codes and the rest (one concatenation).
                    # Combine brings back only the codes' columns (a combine of fewer columns).
                    payload = _normal_rows(codes, scales, topk_idx if K else None, topk_weights)
                else:
                    payload = codes if codes.dtype == torch.bfloat16 else \
                        codes.view(torch.uint8).view(torch.bfloat16)
                data_key = ("data", payload.size(1), num_sms, routing.worst)
                wide = routing.data_key
                if cached and wide is not None and wide[2] == num_sms and wide[1] > payload.size(1):
                    # A cached dispatch goes through its handle's group, its rows padded to that
                    # width: one copy of x, against a second group of the full size.
                    payload = torch.cat([payload, torch.zeros((T, wide[1] - payload.size(1)),
                                                              dtype=torch.bfloat16,
                                                              device=codes.device)], dim=1)
                    data_key = wide
                # The routing's rank ids were made on the stream of its first dispatch, which this
                # one (a cached dispatch) may not run on: their memory waits for this stream too.
                routing.rank_ids.record_stream(comm)
                g = self._dispatch_on(data_key, payload, routing, num_sms, stream)
                routing.data_key = data_key
                d = g._dispatch_result("torch", None, stream)
                rows = d.tokens.view(torch.int32)  # [max rows, width]: codes, then the rest
                meta = rows[:, cw:] if meta_words else None
                if K and not cached:
                    routing.meta_key = data_key
                n_local = routing.num_experts // R
                recv_dev = d.row_offsets[1:2]
                if K:
                    # The returned top-k, for every row the rank can receive, and the rows received
                    # with the slots per local expert, in one launch before the host waits for them
                    # (the caller gets the first N rows, views): after the wait the GPU idles while
                    # the host launches. (With num_worst_tokens the counts go unread: same launch.)
                    all_topk_idx, all_topk_weights, received = _normal_topk(
                        rows, cw, K, S, self.rank * n_local, n_local, recv_dev, stream)
                counts = None  # per local expert, where the host learns them
                if cached:
                    N = routing.num_rows
                elif routing.worst:
                    N = routing.worst
                    if N > d.tokens.size(0):
                        _bad(call, f"num_worst_tokens = {N} exceeds the {d.tokens.size(0)} rows a "
                                   "rank can receive")
                else:
                    if not K:
                        # No top-k ids travel: as DeepEP, the list comes from every rank's
                        # num_tokens_per_expert, summed (a collective over the group).
                        total = _collective(self.group, num_tokens_per_expert, "all_reduce")
                        host = torch.cat([recv_dev.to(torch.int32),
                                          total[self.rank * n_local:(self.rank + 1) * n_local]])
                    else:
                        host = received  # [rows, slots per local expert]
                    host = host.cpu().tolist()  # the one host synchronisation (as DeepEP's)
                    N, counts = host[0], host[1:]
                routing.num_rows = N
                with torch.cuda.stream(alloc):
                    recv_x = torch.empty((N, codes.size(1)), dtype=codes.dtype, device=codes.device)
                    recv_scales = None if scales is None else torch.empty(
                        (N, S), dtype=scales.dtype, device=codes.device)
                # In 8-byte words (a row is a multiple of 16 bytes): a byte-wise copy of the strided
                # rows took 124 us at prefill on one H200, where this moves the same bytes.
                recv_x.view(torch.int64).copy_(d.tokens[:N].view(torch.int64)[:, :row_bytes // 8])
                if S:
                    recv_scales.view(torch.int32).copy_(meta[:N, layout.scales])
                recv_topk_idx = recv_topk_weights = None
                if K:
                    recv_topk_idx = all_topk_idx[:N]
                    recv_topk_weights = all_topk_weights[:N]
        except BaseException:
            # Launched on the comm stream, perhaps: what it reads from the caller stays its.
            self._failed(comm is not compute, (codes, scales, topk_idx, topk_weights) + read)
            raise
        out_x = recv_x if scales is None else (recv_x, recv_scales)
        # The top-k outputs were made on the comm stream (as were recv_x and recv_scales with
        # allocate_on_comm_stream): the caller uses them on the current stream.
        event = self._finish(compute, comm, async_finish,
                             (codes, scales, recv_x, recv_scales, recv_topk_idx,
                              recv_topk_weights, topk_idx, topk_weights, routing.rank_ids) + read,
                             (recv_topk_idx, recv_topk_weights) +
                             ((recv_x, recv_scales) if allocate_on_comm_stream else ()))
        if cached:
            return out_x, None, None, None, None, event
        a = int(expert_alignment)
        per_expert_list = [(c + a - 1) // a * a for c in counts or []]
        return out_x, recv_topk_idx, recv_topk_weights, per_expert_list, routing, event

    def combine(self, x: torch.Tensor, handle: _Routing,
                topk_weights: Optional[torch.Tensor] = None,
                bias: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor], None] = None,
                config: Optional[Config] = None, previous_event: Optional[EventOverlap] = None,
                async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """(combined_x [T, H], combined_topk_weights [T, K] float32 or None, event): each
        token's rows summed over the ranks that received it (fp32, rank ascending, one bf16
        rounding), plus bias; the weights summed the same way."""
        call = "combine"
        self._live(call)
        if not isinstance(handle, _Routing) or handle.buffer is not self:
            _bad(call, "handle must come from this Buffer's dispatch")
        N, T, R = handle.num_rows, handle.num_tokens, self.group_size
        _check(call, "x", x, torch.bfloat16, 2, rows=N)
        H = x.size(1)
        if H % 8:
            _bad(call, f"x has {H} columns; a multiple of 8 is needed")
        biases = () if bias is None else (bias if isinstance(bias, tuple) else (bias,))
        for i, b in enumerate(biases):
            _check(call, f"bias[{i}]", b, torch.bfloat16, 2, rows=T, cols=H)
        if topk_weights is not None:
            _check(call, "topk_weights", topk_weights, torch.float32, 2, rows=N)
        num_sms = (config.num_sms if config is not None else Buffer.num_sms)
        self._on_device(call, x=x, topk_weights=topk_weights,
                        **{f"bias[{i}]": b for i, b in enumerate(biases)})
        compute, comm = self._streams(call, previous_event, async_finish, allocate_on_comm_stream)
        alloc = comm if allocate_on_comm_stream else compute
        with torch.cuda.stream(alloc):
            out = torch.empty((T, H), dtype=torch.bfloat16, device=x.device)
        try:
            with torch.cuda.stream(comm):
                stream = comm.cuda_stream
                # The dispatch's rank ids (read here: a dispatch of the routing again, the weights'
                # mask) were made on its stream, which this call may not run on.
                handle.rank_ids.record_stream(comm)
                ones = torch.ones((T, R), dtype=torch.float32, device=x.device)
                # The group the dispatch's rows went through, if nothing has dispatched on it since:
                # it brings back x's H columns, or (rows narrower than H: FP8 codes and the rest)
                # each half of them.
                key = handle.data_key
                if key is None or key[2] != num_sms or not (
                        key[1] >= H or (key[1] >= H // 2 and H % 16 == 0)):
                    key = ("data", H, num_sms, handle.worst)
                # Dispatches a payload of no interest first only where another dispatch has gone
                # through the group since the handle's.
                g = self._routed_group(key, key[1], handle, num_sms, stream)
                if key[1] >= H:
                    g._impl.combine(x, ones, stream, out, None, None, N)
                else:
                    for lo in (0, H // 2):
                        part = x[:, lo:lo + H // 2].contiguous()
                        o = torch.empty((T, H // 2), dtype=torch.bfloat16, device=x.device)
                        g._impl.combine(part, ones, stream, o, None, None, N)
                        out[:, lo:lo + H // 2] = o
                if biases:
                    acc = out.float()
                    for b in biases:
                        acc += b.float()
                    out.copy_(acc)
                combined_w = None
                if topk_weights is not None:
                    K = topk_weights.size(1)
                    width = -(-K // 4) * 4  # int32 words: a bf16 row of a multiple of 8 columns
                    # The dispatch's group (routed again just above where it had to be), else a
                    # small one of the weights' width.
                    meta_key = handle.meta_key
                    if meta_key is None or meta_key[1] < 2 * width or meta_key[2] != num_sms or \
                            self._routing.get(meta_key) is not handle:
                        meta_key = ("meta", 2 * width, num_sms, handle.worst)
                    gm = self._routed_group(meta_key, meta_key[1], handle, num_sms, stream)
                    # The weights' columns only (a combine of fewer columns than the group's rows).
                    mw = torch.zeros((N, width), dtype=torch.int32, device=x.device)
                    mw[:, :K] = topk_weights.view(torch.int32)
                    un = torch.empty((T, R, 2 * width), dtype=torch.bfloat16, device=x.device)
                    gm._impl.combine(mw.view(torch.bfloat16), None, stream, un, None, None, N)
                    w = un.view(torch.int32)[:, :, :K].view(torch.float32)
                    w = torch.where(handle.rank_ids.unsqueeze(2) >= 0, w, 0.0)
                    combined_w = w.sum(1)
        except BaseException:
            self._failed(comm is not compute, (x, out, topk_weights) + tuple(biases))
            raise
        event = self._finish(compute, comm, async_finish,
                             (x, out, topk_weights, combined_w) + tuple(biases),
                             (combined_w,) + ((out,) if allocate_on_comm_stream else ()))
        return out, combined_w, event

    # ---- low-latency mode -----------------------------------------------------------------
    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int,
                                 num_experts: int) -> None:
        """Nothing to clean: epcomm's arrival flags carry sequence numbers."""
        self._live("clean_low_latency_buffer")

    def _ll_check(self, call, stats_name=None, stats=None, async_finish=False,
                  return_recv_hook=False):
        """What every low-latency call checks first."""
        self._live(call)
        if not self.low_latency_mode:
            _bad(call, "the Buffer was made with low_latency_mode=False")
        if stats is not None:
            _bad(call, f"{stats_name} is not supported (epcomm has no per-rank wait timers)")
        if async_finish and return_recv_hook:
            _bad(call, "async_finish and return_recv_hook cannot both be set")

    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor,
                             num_max_dispatch_tokens_per_rank: int, num_experts: int,
                             cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
                             dispatch_wait_recv_cost_stats: Optional[torch.Tensor] = None,
                             use_fp8: bool = True, round_scale: bool = False,
                             use_ue8m0: bool = False, async_finish: bool = False,
                             return_recv_hook: bool = False):
        """(recv_x, recv_count, handle, event, hook): recv_x [E_l, R * max, H] (FP8: (codes,
        scales [E_l, R * max, H / 128] float32 column-major per expert; with use_ue8m0, scales
        [E_l, R * max, H / 512] int32 column-major per expert, each word four UE8M0 bytes, scale
        block 4j in its lowest byte)), recv_count int32 [E_l]; only the first recv_count[e] rows
        of expert e are written. round_scale: power-of-two scales (Config::fp8_pow2_scales).
        Under torch.compile it runs as the operator torch.ops.epcomm_deep_ep.ll_dispatch (plain
        calls: no async_finish or hook), after one call outside it has set the group up."""
        call = "low_latency_dispatch"
        if (round_scale or use_ue8m0) and not use_fp8:
            _bad(call, "round_scale and use_ue8m0 shape FP8 scales: they need use_fp8=True")
        if use_ue8m0 and not round_scale:
            _bad(call, "use_ue8m0=True needs round_scale=True (UE8M0 holds powers of two only)")
        self._ll_check(call, "dispatch_wait_recv_cost_stats", dispatch_wait_recv_cost_stats,
                       async_finish, return_recv_hook)
        _check(call, "x", x, torch.bfloat16, 2)
        T, H = x.shape
        _check(call, "topk_idx", topk_idx, topk_idx_t, 2, rows=T)
        K, R, max_t = topk_idx.size(1), self.group_size, int(num_max_dispatch_tokens_per_rank)
        if K > MAX_TOP_K:
            _bad(call, f"topk_idx has {K} columns; epcomm takes at most {MAX_TOP_K}")
        if T > max_t:
            _bad(call, f"x has {T} tokens; num_max_dispatch_tokens_per_rank is {max_t}")
        if num_experts < 1 or num_experts % R:
            _bad(call, f"num_experts = {num_experts} must be a positive multiple of the {R} ranks")
        if use_fp8 and H % 128:
            _bad(call, f"hidden = {H} must be a multiple of 128 with use_fp8")
        if use_ue8m0 and H % 512:
            _bad(call, f"hidden = {H} must be a multiple of 512 with use_ue8m0 (four scales "
                       "per word)")
        E_l = num_experts // R
        if cumulative_local_expert_recv_stats is not None:
            _check(call, "cumulative_local_expert_recv_stats", cumulative_local_expert_recv_stats,
                   torch.int32, 1, rows=E_l)
        if torch.compiler.is_compiling():  # the operator, after the same checks
            return self._ll_dispatch_traced(x, topk_idx, max_t, num_experts,
                                            cumulative_local_expert_recv_stats, use_fp8,
                                            round_scale, use_ue8m0, async_finish,
                                            return_recv_hook)
        stats = cumulative_local_expert_recv_stats
        if x.get_device() != self.device or topk_idx.get_device() != self.device or (
                stats is not None and stats.get_device() != self.device):
            self._on_device(call, x=x, topk_idx=topk_idx,
                            cumulative_local_expert_recv_stats=stats)  # raises, naming which
        fmt = "fp8-blockwise" if use_fp8 else "bf16"
        self._ll_parity ^= 1  # two groups in turn, so two dispatches may await their combines
        key = ("ll", H, num_experts, K, max_t, fmt, bool(round_scale), bool(use_ue8m0),
               Buffer.num_sms, self._ll_parity)
        # Dispatch writes DeepEP's padded layout itself (padded_capacity, UE8M0 words).
        g = self._groups.get(key) or self._group(
            key, hidden=H, top_k=K, n_experts=num_experts, max_tokens_per_rank=max_t, format=fmt,
            num_sms=Buffer.num_sms, padded_capacity=R * max_t,
            **({"fp8_pow2_scales": True} if round_scale else {}),
            **({"fp8_ue8m0_scales": True} if use_ue8m0 else {}))
        dev = x.device
        # The outputs, on the current stream as every output of the call, before the launch
        # that writes them.
        outputs = _ll_outputs(R, num_experts, max_t, H, dev, use_fp8, use_ue8m0)
        codes, scales, ue8m0, count, src_info, layout_range = outputs
        handle = _LowLatencyHandle(
            _ll_handle_items(src_info, layout_range, max_t, H, num_experts), g, key,
            tuple(topk_idx.shape))
        compute, comm = self._ll_stream_handles(return_recv_hook, async_finish)
        # The group's last dispatch may change now: its previous handle must not combine, even
        # if the call fails.
        self._routing.pop(key, None)
        try:
            # The int64 ids as they are (id_bytes 8): the kernel reads them, no conversion launch.
            g._impl.ll_dispatch(x.data_ptr(), T, topk_idx.data_ptr(), topk_idx.element_size(),
                                *_ll_pointers(outputs),
                                compute, comm, not async_finish, return_recv_hook)
        except BaseException:
            self._failed(comm != compute, (x, topk_idx) + outputs)
            raise
        self._ll_joined(compute, comm, async_finish, return_recv_hook)
        self._routing[key] = handle
        recv_x = (codes, _ll_returned_scales(scales, ue8m0, dev)) if use_fp8 else codes
        hook = None
        if return_recv_hook:
            def receive_hook():
                # The closure holds the outputs themselves (not only their addresses), so they
                # live until the hook has written them, as DeepEP's hook does. The receive runs
                # on the stream of the call, as DeepEP's, wherever hook() is called from.
                g._impl.ll_receive(*_ll_pointers(outputs), compute)
                if stats is not None:
                    with torch.cuda.stream(_stream_of(compute, self.device)):
                        stats.add_(count)

            hook = receive_hook
            event = EventOverlap(None)
        else:
            event = self._ll_finish(async_finish, stats, count, (x, topk_idx, stats) + outputs)
        return recv_x, count, handle, event, hook

    def get_next_low_latency_combine_buffer(self, handle: _LowLatencyHandle) -> torch.Tensor:
        """A [E_l, R * max, H] bf16 tensor to write the expert outputs into, for
        low_latency_combine(..., zero_copy=True)."""
        call = "get_next_low_latency_combine_buffer"
        self._ll_check(call)
        if not isinstance(handle, _LowLatencyHandle):
            _bad(call, "handle must come from low_latency_dispatch")
        return self._ll_scratch(handle)["padded"]

    def _ll_handle_of(self, src_info: torch.Tensor):
        """The low-latency handle (of the last two dispatches) whose src_info is this tensor's
        memory, or None: how a compiled dispatch's plain handle finds its own."""
        for h in self._routing.values():
            if isinstance(h, _LowLatencyHandle) and h[0].data_ptr() == src_info.data_ptr():
                return h
        return None

    def _ll_dispatch_traced(self, x, topk_idx, max_t, num_experts, stats, use_fp8, round_scale,
                            use_ue8m0, async_finish, return_recv_hook):
        call = "low_latency_dispatch"
        if async_finish or return_recv_hook:
            _bad(call, "under torch.compile only plain calls are traced (no async_finish or "
                       "return_recv_hook)")
        codes, scales, count, src_info, layout_range = torch.ops.epcomm_deep_ep.ll_dispatch(
            self._op_id, self._ll_token, x, topk_idx, int(max_t), int(num_experts),
            bool(use_fp8), bool(round_scale), bool(use_ue8m0))
        if stats is not None:  # as the eager call does, after the counts
            stats.add_(count)
        recv_x = (codes, scales) if use_fp8 else codes
        handle = _ll_handle_items(src_info, layout_range, max_t, x.size(1), num_experts)
        return recv_x, count, handle, EventOverlap(None), None

    def _ll_combine_traced(self, x, topk_idx, topk_weights, handle, zero_copy, async_finish,
                           return_recv_hook, out):
        call = "low_latency_combine"
        if zero_copy or async_finish or return_recv_hook or out is not None:
            _bad(call, "under torch.compile only plain calls are traced (no zero_copy, "
                       "async_finish, return_recv_hook or out)")
        combined = torch.ops.epcomm_deep_ep.ll_combine(self._op_id, self._ll_token, x, topk_idx,
                                                        topk_weights, handle[0])
        return combined, EventOverlap(None), None

    def _ll_scratch(self, handle) -> dict:
        sc = self._scratch.get(handle.key)
        if sc is None:
            _, _, max_t, H, E = handle
            R = self.group_size
            sc = {
                "padded": torch.empty((E // R, R * max_t, H), dtype=torch.bfloat16,
                                      device=self.device),
            }
            self._scratch[handle.key] = sc
        return sc

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor,
                            topk_weights: torch.Tensor, handle: _LowLatencyHandle,
                            use_logfmt: bool = False, zero_copy: bool = False,
                            async_finish: bool = False, return_recv_hook: bool = False,
                            out: Optional[torch.Tensor] = None,
                            combine_wait_recv_cost_stats: Optional[torch.Tensor] = None):
        """(combined_x [T, H] bf16, event, hook): sum over k of topk_weights * the expert
        output of slot k (fp32, slot ascending, one bf16 rounding; -1 slots skipped). Under
        torch.compile it runs as the operator torch.ops.epcomm_deep_ep.ll_combine (plain calls,
        with a handle from a traced low_latency_dispatch)."""
        call = "low_latency_combine"
        if use_logfmt:
            _bad(call, "use_logfmt=True (LogFMT-compressed combine) is not supported")
        self._ll_check(call, "combine_wait_recv_cost_stats", combine_wait_recv_cost_stats,
                       async_finish, return_recv_hook)
        if torch.compiler.is_compiling():  # the operator; its handle is a traced dispatch's
            return self._ll_combine_traced(x, topk_idx, topk_weights, handle, zero_copy,
                                           async_finish, return_recv_hook, out)
        if not isinstance(handle, _LowLatencyHandle) and isinstance(handle, tuple) and \
                handle and isinstance(handle[0], torch.Tensor):  # from a compiled dispatch
            handle = self._ll_handle_of(handle[0]) or handle
        if not isinstance(handle, _LowLatencyHandle) or self._groups.get(handle.key) \
                is not handle.group:
            _bad(call, "handle must come from this Buffer's low_latency_dispatch")
        if self._routing.get(handle.key) is not handle:
            _bad(call, "the handle's dispatch was followed by two more low_latency_dispatch "
                       "calls: only the last two dispatches can be combined (as in DeepEP)")
        _, _, max_t, H, E = handle
        R = self.group_size
        _check(call, "x", x, torch.bfloat16, 3)
        if tuple(x.shape) != (E // R, R * max_t, H):
            _bad(call, f"x must have shape {[E // R, R * max_t, H]}; got {list(x.shape)}")
        _check(call, "topk_idx", topk_idx, topk_idx_t, 2)
        if tuple(topk_idx.shape) != handle.topk_shape:
            _bad(call, f"topk_idx has shape {list(topk_idx.shape)}; the dispatch's was "
                       f"{list(handle.topk_shape)}")
        T, K = handle.topk_shape
        _check(call, "topk_weights", topk_weights, torch.float32, 2, rows=T, cols=K)
        if out is not None:
            _check(call, "out", out, torch.bfloat16, 2, rows=T, cols=H)
        dev = self.device
        if x.get_device() != dev or topk_idx.get_device() != dev or \
                topk_weights.get_device() != dev or (out is not None and out.get_device() != dev):
            self._on_device(call, x=x, topk_idx=topk_idx, topk_weights=topk_weights,
                            out=out)  # raises, naming which
        sc = self._ll_scratch(handle)
        # zero_copy: as in DeepEP, the expert outputs are already in
        # get_next_low_latency_combine_buffer(handle), and x's storage is not read.
        src = sc["padded"] if zero_copy else x
        g = handle.group
        combined = out if out is not None else torch.empty((T, H), dtype=torch.bfloat16,
                                                           device=x.device)
        # Combine reads the expert outputs in DeepEP's padded layout where they are
        # ([E_l, R * max, H]: CombineInput::expert_out_capacity), no unpad copy.
        compute, comm = self._ll_stream_handles(return_recv_hook, async_finish)
        try:
            g._impl.ll_combine(src.data_ptr(), src.size(1), topk_weights.data_ptr(),
                               combined.data_ptr(), compute, comm, not async_finish,
                               return_recv_hook)
        except BaseException:
            self._failed(comm != compute, (src, topk_weights, combined))
            raise
        self._ll_joined(compute, comm, async_finish, return_recv_hook)
        hook = None
        if return_recv_hook:
            def receive_hook():  # on the stream of the call, as DeepEP's
                g._impl.ll_combine_wait(topk_weights.data_ptr(), combined.data_ptr(), compute)

            hook = receive_hook
            event = EventOverlap(None)
        else:
            event = self._ll_finish(async_finish, None, None, (x, topk_weights, combined))
        return combined, event, hook


# ---- torch.compile: the low-latency calls as operators -----------------------------------------
# A traced MoE layer calls these instead of the methods' bodies (torch.compiler.is_compiling()).
# Each operator's real implementation is the eager method; its fake implementation makes the
# outputs' shapes from the arguments (DeepEP's padded layout is fixed by max tokens, hidden and
# the expert count), so nothing in the graph depends on the routing. The handle a traced
# dispatch returns is DeepEP's plain 5-tuple; the combine operator finds the dispatch's epcomm
# handle by the src_info tensor in it (Buffer._ll_handle_of: the last two dispatches, as in
# eager mode).
# Order: every operator of a Buffer takes its token tensor as mutated, so the compiled graph
# keeps the calls in program order (each is collective: ranks must make them in one order) and
# never drops a dispatch whose outputs go unused.

_op_ids = itertools.count()  # next() is atomic under the GIL
_op_buffers = {}             # op id -> weakref to the Buffer


def _op_buffer(buffer_id: int) -> "Buffer":
    ref = _op_buffers.get(buffer_id)
    b = ref() if ref is not None else None
    if b is None:
        raise InvalidArgument(f"epcomm.deep_ep: Buffer {buffer_id} of the compiled code was "
                              "destroyed or collected")
    return b


class _NormalMeta:
    """Where each part of a normal-mode row's words after the codes lies (_normal_rows writes
    them in this order): the top-k ids as int64 (2 K int32 words), the scales (S), the weights
    (K); `words` in all."""

    def __init__(self, K: int, S: int):
        self.ids = slice(0, 2 * K)
        self.scales = slice(2 * K, 2 * K + S)
        self.weights = slice(2 * K + S, 3 * K + S)
        self.words = 3 * K + S


def _normal_rows(codes, scales, topk_idx, topk_weights):
    """The rows a normal-mode dispatch sends: int32 words [codes | top-k ids | scales |
    weights | zeros to a multiple of 16 bytes], as bf16 [T, width * 2]. The ids go as the int64
    words they are (first after the codes, which are a multiple of 16 bytes, so they stay on 8):
    no conversion launch, and an id no int32 holds is not truncated into another expert's.
    topk_idx None: no ids or weights."""
    T = codes.size(0)
    parts = [codes.view(torch.uint8).view(torch.int32)]
    if topk_idx is not None:
        # Through a flat view: a [T, 1] tensor that passes the contiguity check may still have a
        # last-dimension stride other than 1, which a dtype view refuses.
        parts.append(topk_idx.reshape(-1).view(torch.int32).view(T, 2 * topk_idx.size(1)))
    if scales is not None:
        parts.append(scales.view(torch.int32))
    if topk_idx is not None:
        parts.append(topk_weights.view(torch.int32))
    words = sum(p.size(1) for p in parts)
    if words % 4:
        parts.append(torch.zeros((T, 4 - words % 4), dtype=torch.int32, device=codes.device))
    return torch.cat(parts, dim=1).view(torch.bfloat16)


def _normal_topk(rows, cw, K, S, first_expert, n_local, recv_dev, stream):
    """From received rows (_normal_rows; rows [max rows, width] int32 words, the codes' cw
    first): each row's top-k as this rank's local expert ids, int64 (-1 for a slot of another
    rank's expert, a bad id, or a row past the recv_dev received), their weights (0 there), and
    [rows received, slots per local expert] int32, in one launch (epcomm/routing_layout.h)."""
    layout = _NormalMeta(K, S)
    ids = torch.empty((rows.size(0), K), dtype=topk_idx_t, device=rows.device)
    weights = torch.empty((rows.size(0), K), dtype=torch.float32, device=rows.device)
    counts = torch.empty(1 + n_local, dtype=torch.int32, device=rows.device)
    base, word = rows.data_ptr(), rows.element_size()
    _C.received_topk(base + word * (cw + layout.ids.start), base + word * (cw + layout.weights.start),
                     word * rows.stride(0), recv_dev.data_ptr(), K, first_expert, ids.data_ptr(),
                     weights.data_ptr(), rows.size(0), counts.data_ptr(), n_local,
                     rows.get_device(), stream)
    return ids, weights, counts


def _ll_outputs(R: int, num_experts: int, max_t: int, H: int, dev, use_fp8: bool,
                use_ue8m0: bool):
    """A low-latency dispatch's outputs, allocated (S = R * max_t, E_l = num_experts / R):
    codes [E_l, S, H] (e4m3 or bf16), scales [E_l, S, H / 128] float32 (FP8 without
    use_ue8m0, else None), ue8m0 [E_l, S, H / 512] int32 (use_ue8m0, else None), count [E_l]
    int32, src_info [E_l, S] int32, layout_range [E_l, R] int64. The scales are column-major
    per expert (strides [S · cols, 1, S]), as DeepEP returns them and the kernel writes them
    ([E_l, cols, S] in memory): made so at once, not as a transpose of another tensor. The
    eager call and the operator's fake both take them from here."""
    E_l, S = num_experts // R, R * max_t
    codes = torch.empty((E_l, S, H), dtype=torch.float8_e4m3fn if use_fp8 else torch.bfloat16,
                        device=dev)
    scales = _column_major(E_l, S, H // 128, torch.float32, dev) \
        if use_fp8 and not use_ue8m0 else None
    ue8m0 = _column_major(E_l, S, H // 512, torch.int32, dev) if use_ue8m0 else None
    return (codes, scales, ue8m0, torch.empty(E_l, dtype=torch.int32, device=dev),
            torch.empty((E_l, S), dtype=torch.int32, device=dev),
            torch.empty((E_l, R), dtype=torch.int64, device=dev))


def _column_major(E_l: int, S: int, cols: int, dtype, dev) -> torch.Tensor:
    """[E_l, S, cols], each expert's [S, cols] column-major."""
    return torch.empty_strided((E_l, S, cols), (S * cols, 1, S), dtype=dtype, device=dev)


def _ll_pointers(outputs) -> tuple:
    """The device addresses of _ll_outputs' tensors as Group.ll_dispatch and ll_receive take
    them: codes, scales (the fp32 scales or the UE8M0 words; 0 without FP8), count, src_info
    (the group's slot_token), layout_range."""
    codes, scales, ue8m0, count, src_info, layout_range = outputs
    words = ue8m0 if ue8m0 is not None else scales
    return (codes.data_ptr(), 0 if words is None else words.data_ptr(), count.data_ptr(),
            src_info.data_ptr(), layout_range.data_ptr())


def _ll_handle_items(src_info, layout_range, max_t, H, num_experts) -> tuple:
    """DeepEP's low-latency handle: (src_info, layout_range, max tokens, hidden, experts)."""
    return (src_info, layout_range, int(max_t), H, int(num_experts))


def _ll_returned_scales(scales, ue8m0, dev):
    """The scales a dispatch returns: UE8M0 words or fp32 scales (column-major per expert);
    without FP8, the operator's empty float32 placeholder."""
    if ue8m0 is not None:
        return ue8m0
    if scales is not None:
        return scales
    return torch.empty(0, dtype=torch.float32, device=dev)


def _ll_dispatch_eager(b: "Buffer", x, topk_idx, max_t, num_experts, use_fp8, round_scale,
                       use_ue8m0):
    """The dispatch operator's work: the eager call, returning its tensors."""
    recv_x, count, handle, _, _ = b.low_latency_dispatch(
        x, topk_idx, max_t, num_experts, use_fp8=use_fp8, round_scale=round_scale,
        use_ue8m0=use_ue8m0)
    codes, scales = recv_x if use_fp8 else (recv_x, _ll_returned_scales(None, None, x.device))
    return codes, scales, count, handle[0], handle[1]


def _ll_combine_eager(b: "Buffer", x, topk_idx, topk_weights, src_info):
    """The combine operator's work: the eager call, which finds the dispatch's handle by
    src_info as for any compiled dispatch's plain handle."""
    combined, _, _ = b.low_latency_combine(x, topk_idx, topk_weights, (src_info,))
    return combined


@torch.library.custom_op("epcomm_deep_ep::ll_dispatch", mutates_args=("token",))
def _ll_dispatch_op(buffer_id: int, token: torch.Tensor, x: torch.Tensor,
                    topk_idx: torch.Tensor, max_t: int, num_experts: int, use_fp8: bool,
                    round_scale: bool, use_ue8m0: bool
                    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                               torch.Tensor]:
    return _ll_dispatch_eager(_op_buffer(buffer_id), x, topk_idx, max_t, num_experts, use_fp8,
                              round_scale, use_ue8m0)


@_ll_dispatch_op.register_fake
def _(buffer_id, token, x, topk_idx, max_t, num_experts, use_fp8, round_scale, use_ue8m0):
    codes, scales, ue8m0, count, src_info, layout_range = _ll_outputs(
        _op_buffer(buffer_id).group_size, num_experts, max_t, x.size(1), x.device, use_fp8,
        use_ue8m0)
    return codes, _ll_returned_scales(scales, ue8m0, x.device), count, src_info, layout_range


@torch.library.custom_op("epcomm_deep_ep::ll_combine", mutates_args=("token",))
def _ll_combine_op(buffer_id: int, token: torch.Tensor, x: torch.Tensor,
                   topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                   src_info: torch.Tensor) -> torch.Tensor:
    return _ll_combine_eager(_op_buffer(buffer_id), x, topk_idx, topk_weights, src_info)


@_ll_combine_op.register_fake
def _(buffer_id, token, x, topk_idx, topk_weights, src_info):
    return torch.empty((topk_idx.size(0), x.size(2)), dtype=torch.bfloat16, device=x.device)


def _hostname() -> str:
    import socket

    return socket.gethostname()
