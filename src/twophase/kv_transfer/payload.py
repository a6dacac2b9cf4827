"""The payload of a read, in the form its transport carries: one exchange (JSON header + one frame) on every
transport, only the payload's form differs.

The payload is the blocks' K/V as one tensor ``[num_layers, 2, num_blocks * block_size, num_kv_heads, head_dim]``
in the cache's dtype (see ``worker_connector``):

- ``tcp``: the frame holds the tensor's raw bytes. The prefill worker frees the blocks once they are copied out.
- ``cuda-ipc``: the header holds a CUDA IPC handle of the tensor (a staging copy in the prefill worker's GPU
  memory), made by torch's own ``reduce_tensor`` and sent as JSON — never a pickle from the network — and the
  frame is empty. The prefill worker keeps the staging tensor under the request's lease until the decode worker
  sends ``read_done`` or the lease expires; torch's IPC reference count keeps the memory from being reused while
  the decode worker still maps it. The handle names the GPU by UUID; the decode worker opens it on its own index
  of that GPU. A limit of torch's scheme: a handle sent but never opened (the decode worker timed out or died
  in between) leaves its count above zero, and torch keeps that one staging buffer until the prefill process
  exits.
"""

from __future__ import annotations

import abc
import base64
import math
from typing import Any

import torch

from twophase.kv_transfer.spec import KVTransferError

Shape = tuple[int, ...]


class PayloadCodec(abc.ABC):
    """Turns the payload tensor into (header fields, frame) on the prefill side, and back on the decode side."""

    holds_source: bool = False  # the sender keeps the tensor alive until the reader's read_done

    @abc.abstractmethod
    def encode(self, values: torch.Tensor) -> tuple[dict[str, Any], bytes]:
        """Header fields and frame carrying ``values`` [L, 2, n*bs, H, D] (contiguous)."""

    @abc.abstractmethod
    def decode(self, header: dict[str, Any], frame: bytes, shape: Shape, dtype: torch.dtype) -> torch.Tensor:
        """The payload tensor ``shape`` in ``dtype``; KVTransferError when the reply does not hold exactly that."""


class BytesCodec(PayloadCodec):
    """tcp: the raw bytes in the frame (works from any device, across hosts)."""

    def encode(self, values: torch.Tensor) -> tuple[dict[str, Any], bytes]:
        """See PayloadCodec.encode."""
        data = values.contiguous().cpu().view(torch.uint8).numpy().tobytes()
        return {"nbytes": len(data)}, data

    def decode(self, header: dict[str, Any], frame: bytes, shape: Shape, dtype: torch.dtype) -> torch.Tensor:
        """See PayloadCodec.decode (a CPU tensor)."""
        expected = math.prod(shape) * dtype.itemsize
        if len(frame) != expected:
            raise KVTransferError(f"received {len(frame)} bytes for a {list(shape)} payload, expected {expected}",
                                  "size_mismatch")
        return torch.frombuffer(bytearray(frame), dtype=torch.uint8).view(dtype).reshape(shape)  # [L, 2, n*bs, H, D]


class CudaIpcCodec(PayloadCodec):
    """cuda-ipc: a CUDA IPC handle in the header (both workers on one host; the tensor never leaves the GPU)."""

    holds_source = True

    def encode(self, values: torch.Tensor) -> tuple[dict[str, Any], bytes]:
        """See PayloadCodec.encode; waits for the kernels writing ``values`` before sharing it."""
        from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

        if values.device.type != "cuda" or not values.is_contiguous():
            raise KVTransferError("cuda-ipc payload must be a contiguous CUDA tensor", "ipc")
        torch.cuda.current_stream(values.device).synchronize()
        rebuild, args = reduce_tensor(values)
        if rebuild is not rebuild_cuda_tensor:
            raise KVTransferError(f"torch shares this tensor with {rebuild.__name__}, not a CUDA IPC handle", "ipc")
        handle = {**ipc_args_to_json(args), "gpu": gpu_uuid(values.device.index)}
        return {"nbytes": values.numel() * values.element_size(), "ipc": handle}, b""

    def decode(self, header: dict[str, Any], frame: bytes, shape: Shape, dtype: torch.dtype) -> torch.Tensor:
        """See PayloadCodec.decode: the producer's memory mapped into this process (drop it, after the copy has
        finished, before sending read_done)."""
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        data = header.get("ipc")
        args = ipc_args_from_json(data, shape, dtype)
        gpus = visible_gpus()
        gpu = data.get("gpu") if isinstance(data, dict) else None
        if not gpu or gpu not in gpus:
            raise KVTransferError(f"the CUDA IPC payload is on GPU {gpu!r}, which this process cannot see", "ipc")
        args = (*args[:6], gpus.index(gpu), *args[7:])  # the storage device: this process's index of that GPU
        try:
            return rebuild_cuda_tensor(*args)  # [L, 2, n*bs, H, D] in the prefill worker's memory
        except Exception as exc:  # noqa: BLE001 — any failure to open the handle fails this transfer only
            raise KVTransferError(f"could not open the CUDA IPC handle: {exc}", "ipc") from exc


CODECS: dict[str, type[PayloadCodec]] = {"tcp": BytesCodec, "cuda-ipc": CudaIpcCodec}


def gpu_uuid(index: int) -> str:
    """The UUID of visible GPU ``index`` (hex; the same in every process whatever CUDA_VISIBLE_DEVICES says;
    empty when torch does not report it)."""
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    return bytes(uuid.bytes).hex() if hasattr(uuid, "bytes") else ""


def visible_gpus() -> tuple[str, ...]:
    """The UUIDs of the GPUs this process can use, by index."""
    if not torch.cuda.is_available():
        return ()
    return tuple(gpu_uuid(index) for index in range(torch.cuda.device_count()))


# ---- the JSON form of torch's rebuild_cuda_tensor arguments -------------------------------------------------
_STORAGE_CLASSES = {"TypedStorage": torch.storage.TypedStorage, "UntypedStorage": torch.UntypedStorage}
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64,
           "int8": torch.int8}


def ipc_args_to_json(args: tuple) -> dict[str, Any]:
    """``reduce_tensor``'s arguments for ``rebuild_cuda_tensor`` as a JSON-safe dict (bytes in base64)."""
    (tensor_cls, size, stride, offset, storage_cls, dtype, device, handle, storage_size, storage_offset,
     _requires_grad, ref_counter, ref_counter_offset, event, event_sync) = args
    if tensor_cls is not torch.Tensor or storage_cls.__name__ not in _STORAGE_CLASSES:
        raise KVTransferError(f"cannot share a {tensor_cls.__name__} on {storage_cls.__name__} over CUDA IPC", "ipc")
    return {"size": list(size), "stride": list(stride), "offset": int(offset), "storage": storage_cls.__name__,
            "dtype": str(dtype).removeprefix("torch."), "device": int(device), "handle": _b64(handle),
            "storage_size": int(storage_size), "storage_offset": int(storage_offset), "ref_counter": _b64(ref_counter),
            "ref_counter_offset": int(ref_counter_offset), "event": _b64(event), "event_sync": bool(event_sync)}


def ipc_args_from_json(data: Any, shape: Shape, dtype: torch.dtype) -> tuple:
    """The arguments of ``rebuild_cuda_tensor`` from ``ipc_args_to_json``'s dict, checked to describe a
    contiguous ``shape`` tensor of ``dtype`` inside its storage (KVTransferError otherwise)."""
    try:
        size, stride, offset = [int(x) for x in data["size"]], [int(x) for x in data["stride"]], int(data["offset"])
        got_dtype, storage_cls = _DTYPES[data["dtype"]], _STORAGE_CLASSES[data["storage"]]
        handle, ref_counter = _unb64(data["handle"]), _unb64(data["ref_counter"])
        storage_size, storage_offset = int(data["storage_size"]), int(data["storage_offset"])
        fields = (int(data["device"]), int(data["ref_counter_offset"]), _unb64(data["event"]), bool(data["event_sync"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise KVTransferError(f"malformed CUDA IPC handle: {exc!r}", "ipc") from exc
    _check_layout(size, stride, offset, got_dtype, storage_size, shape, dtype)
    if not handle or not ref_counter:
        raise KVTransferError("malformed CUDA IPC handle: empty memory or reference-count handle", "ipc")
    if not ref_counter.startswith(b"/") or b"/" in ref_counter[1:]:  # a shared-memory name, never a path
        raise KVTransferError("malformed CUDA IPC handle: bad reference-count name", "ipc")
    device, ref_counter_offset, event, event_sync = fields
    return (torch.Tensor, torch.Size(size), tuple(stride), offset, storage_cls, got_dtype, device, handle,
            storage_size, storage_offset, False, ref_counter, ref_counter_offset, event, event_sync)


def _check_layout(size: list[int], stride: list[int], offset: int, got: torch.dtype, storage_size: int,
                  shape: Shape, dtype: torch.dtype) -> None:
    if got != dtype or tuple(size) != tuple(shape):
        raise KVTransferError(f"CUDA IPC payload is {got} {size}, expected {dtype} {list(shape)}", "size_mismatch")
    if tuple(stride) != torch.empty(shape, device="meta").stride() or offset < 0:
        raise KVTransferError("CUDA IPC payload is not a contiguous tensor", "size_mismatch")
    if (offset + math.prod(shape)) * dtype.itemsize > storage_size:
        raise KVTransferError("CUDA IPC payload overruns its storage", "size_mismatch")


def _b64(value: bytes | None) -> str | None:
    return None if value is None else base64.b64encode(value).decode("ascii")


def _unb64(value: str | None) -> bytes | None:
    return None if value is None else base64.b64decode(value, validate=True)
