"""The framework side of the Python API: which framework a tensor belongs to, its current CUDA
stream, and turning the library's DLPack buffers into that framework's tensors.

Supported: PyTorch and CuPy (zero-copy, on the framework's current stream), and any other
DLPack producer (JAX included) through the generic path: inputs are read through DLPack on the
legacy default stream after the producer is ready, and outputs are returned as the library's
own DLPack arrays, which `<framework>.from_dlpack` takes.
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


def _torch_dtype(name: str):
    import torch

    return getattr(torch, name, None)


def wrap(framework: str, raw, view: str | None = None):
    """The framework's tensor over the library's buffer `raw` (no copy). `view` names the
    element type the bytes hold where the framework has it ("float8_e4m3fn")."""
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


def empty(framework: str, like, shape, dtype: str):
    """A new uninitialised tensor of `framework` on like's device. dtype: bfloat16, uint8,
    float32, int32 (CuPy has no bfloat16: uint16 bit patterns instead)."""
    if framework == TORCH:
        import torch

        return torch.empty(shape, dtype=getattr(torch, dtype), device=like.device)
    if framework == CUPY:
        import cupy

        with cupy.cuda.Device(like.device.id):
            return cupy.empty(shape, dtype="uint16" if dtype == "bfloat16" else dtype)
    raise TypeError(
        "epcomm: outputs can be allocated for torch and cupy tensors only; pass out= for "
        f"{type(like).__module__} arrays"
    )


def loaded(name: str) -> bool:
    return name in sys.modules
