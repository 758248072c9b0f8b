"""The framework side of the Python API: which framework a tensor belongs to, its current CUDA
stream, and turning the library's DLPack buffers into that framework's tensors.

Supported: PyTorch and CuPy (zero-copy, on the framework's current stream), and any other
DLPack producer (JAX included) through the generic path: inputs are read through DLPack on the
legacy default stream after the producer is ready, and outputs are returned as DLPackBuffer
objects (the DLPack protocol), which `<framework>.from_dlpack` takes.
"""

from __future__ import annotations

import sys

TORCH = "torch"
CUPY = "cupy"
DLPACK = "dlpack"


def framework_of(x) -> str:
    mod = type(x).__module__ or ""
    if mod.startswith("torch"):
        return TORCH
    if mod.startswith("cupy"):
        return CUPY
    return DLPACK


def stream_handle(stream, framework: str, device: int) -> int:
    """The cudaStream_t to launch on: `stream` if given (an int, a torch.cuda.Stream or a
    cupy.cuda.Stream), else the framework's current stream on `device`."""
    if stream is not None:
        if isinstance(stream, int):
            return stream
        for attr in ("cuda_stream", "ptr"):
            if hasattr(stream, attr):
                return int(getattr(stream, attr))
        raise TypeError(
            "epcomm: stream must be an int (cudaStream_t), a torch.cuda.Stream or a "
            f"cupy.cuda.Stream; got {type(stream).__name__}"
        )
    if framework == TORCH:
        import torch

        return torch.cuda.current_stream(device).cuda_stream
    if framework == CUPY:
        import cupy

        with cupy.cuda.Device(device):
            return cupy.cuda.get_current_stream().ptr
    return 0


def ready(x) -> None:
    """Generic DLPack producers (JAX) have their own streams: wait until `x` is computed."""
    if hasattr(x, "block_until_ready"):
        x.block_until_ready()


class DLPackBuffer:
    """One of a group's buffers for a generic DLPack consumer (jax.dlpack.from_dlpack, or any
    other from_dlpack): the DLPack protocol's two methods. Each __dlpack__ call exports the
    buffer afresh (a DLPack capsule can be consumed once). The buffer is ready when it is
    returned (the call that returned it synchronised), so the consumer's stream needs no wait."""

    kDLCUDA = 2

    def __init__(self, export, device: int):
        self._export, self._device = export, device

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        # The buffer lives on its GPU and is exported without a copy: a request for another
        # device or for a copy cannot be honoured (BufferError, as the protocol asks).
        if dl_device is not None and tuple(dl_device) != self.__dlpack_device__():
            raise BufferError(f"epcomm: this buffer is on CUDA device {self._device}; "
                              f"{tuple(dl_device)} was asked for")
        if copy:
            raise BufferError("epcomm: the group's buffers are exported without a copy")
        # An unversioned capsule whatever max_version says: every consumer takes one (the
        # protocol lets a producer answer a max_version it does not meet so).
        raw = self._export()
        return raw.__dlpack__() if hasattr(raw, "__dlpack__") else raw

    def __dlpack_device__(self):
        return (self.kDLCUDA, self._device)


def _torch_dtype(name: str):
    import torch

    return getattr(torch, name, None)


def wrap(framework: str, raw, view: str | None = None):
    """The framework's tensor over the library's buffer `raw` (no copy). `view` names the
    element type the bytes hold where the framework has it ("float8_e4m3fn"). For a generic
    DLPack consumer, pass a DLPackBuffer as raw: it is returned as it is."""
    if framework == TORCH:
        import torch

        t = torch.from_dlpack(raw)
        if view is not None:
            dt = _torch_dtype(view)
            if dt is not None:
                t = t.view(dt)
        return t
    if framework == CUPY:
        import cupy

        return cupy.from_dlpack(raw)
    return raw


# Where a framework lacks a dtype of the library's (TensorDesc.dtype), the plain type of the
# same width holds its bits.
_PLAIN = {"bfloat16": "uint16", "float8_e4m3fn": "uint8"}


def empty(framework: str, like, shape, dtype: str):
    """A new uninitialised tensor of `framework` on like's device. dtype: a TensorDesc dtype,
    bfloat16, float8_e4m3fn, uint8, float32, int32 (CuPy has no bfloat16 or float8: uint16 and
    uint8 bit patterns instead; a PyTorch without float8 gets uint8)."""
    if framework == TORCH:
        import torch

        dt = _torch_dtype(dtype)
        if dt is None:
            dt = getattr(torch, _PLAIN[dtype])
        return torch.empty(tuple(shape), dtype=dt, device=like.device)
    if framework == CUPY:
        import cupy

        with cupy.cuda.Device(like.device.id):
            return cupy.empty(tuple(shape), dtype=_PLAIN.get(dtype, dtype))
    raise TypeError(
        "epcomm: outputs can be allocated for torch and cupy tensors only; pass out= for "
        f"{type(like).__module__} arrays"
    )


def loaded(name: str) -> bool:
    return name in sys.modules
