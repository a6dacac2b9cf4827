"""Where a worker's KV cache lives, and which transport a pair of workers uses (no torch: testable anywhere).

``--kv-transport`` picks how a read's payload travels: ``tcp`` (the blocks' bytes in the reply), ``cuda-ipc``
(a CUDA IPC handle to a staging copy of the blocks in the prefill worker's GPU memory; the decode worker maps
it and copies on the GPU) or ``auto`` (cuda-ipc when both caches are on CUDA on one host, tcp otherwise).
Both workers send their ``Placement`` and setting in the handshake and run ``choose_transport`` on the same
inputs, so they agree, or both refuse with the same error.

One host means: same host name, same boot id (``/proc/sys/kernel/random/boot_id``) and same PID namespace (two
containers on one machine share a boot id but not the ``/dev/shm`` torch's IPC reference counts live in). CUDA
IPC also needs each worker's GPU to be visible to the other (servers pinned to different GPUs with
``CUDA_VISIBLE_DEVICES`` cannot open each other's memory): GPUs are compared by UUID, not by index.
"""

from __future__ import annotations

import os
import socket
from dataclasses import asdict, dataclass
from typing import Any

TRANSPORTS = ("auto", "tcp", "cuda-ipc")
BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"
PID_NS_PATH = "/proc/self/ns/pid"


def _read_boot_id() -> str:
    try:
        with open(BOOT_ID_PATH, encoding="ascii") as file:
            return file.read().strip()
    except OSError:
        return ""


def _read_pid_namespace() -> str:
    try:
        return os.readlink(PID_NS_PATH)
    except OSError:
        return ""


@dataclass(frozen=True)
class Placement:
    """A worker's host identity, the device type of its KV cache ("cpu", "cuda", ...) and its GPUs."""

    hostname: str
    boot_id: str  # empty when unknown: never counts as the same host
    pid_namespace: str
    device: str
    gpu: str = ""  # UUID of the GPU holding the cache (empty: not on CUDA, or unknown)
    visible_gpus: tuple[str, ...] = ()  # UUIDs of every GPU this process can use

    @classmethod
    def local(cls, device: str, gpu: str = "", visible_gpus: tuple[str, ...] = ()) -> "Placement":
        """This process's placement, for a KV cache on ``device`` (a device type) and GPU ``gpu``."""
        return cls(socket.gethostname(), _read_boot_id(), _read_pid_namespace(), device, gpu, tuple(visible_gpus))

    def to_json(self) -> dict[str, Any]:
        """Plain dict for the wire."""
        return {**asdict(self), "visible_gpus": list(self.visible_gpus)}

    @classmethod
    def from_json(cls, data: Any) -> "Placement":
        """Parse the wire form; a missing or malformed one (an older peer) is an unknown host on an unknown
        device, which ``auto`` answers with tcp and ``cuda-ipc`` refuses."""
        if not isinstance(data, dict):
            data = {}
        gpus = data.get("visible_gpus")
        fields = [str(data.get(name) or "") for name in ("hostname", "boot_id", "pid_namespace", "device", "gpu")]
        return cls(*fields, tuple(str(g) for g in gpus) if isinstance(gpus, (list, tuple)) else ())

    def other_host(self, other: "Placement") -> str | None:
        """Why ``other`` is not on this host (None when it is)."""
        if not self.boot_id or not other.boot_id:
            return "the boot id of one of them is unknown"
        if self.hostname != other.hostname:
            return f"host names {self.hostname!r} and {other.hostname!r}"
        if self.boot_id != other.boot_id:
            return "different boot ids (two machines with one host name)"
        if self.pid_namespace != other.pid_namespace:
            return "different PID namespaces (two containers)"
        return None


@dataclass(frozen=True)
class Side:
    """One worker of a pair as the negotiation sees it: its name in messages, its setting, its placement."""

    name: str  # e.g. "the prefill worker"
    setting: str  # auto | tcp | cuda-ipc
    placement: Placement


def ipc_obstacle(a: Side, b: Side) -> str | None:
    """Why CUDA IPC cannot join these two workers (None when it can)."""
    for side in (a, b):
        if side.placement.device != "cuda":
            return f"{side.name}'s KV cache is on {side.placement.device or 'an unknown device'}, not CUDA"
    reason = a.placement.other_host(b.placement)
    if reason is not None:
        return f"{a.name} and {b.name} are not on one host ({reason})"
    for owner, viewer in ((a, b), (b, a)):
        if not owner.placement.gpu or owner.placement.gpu not in viewer.placement.visible_gpus:
            return f"{owner.name}'s GPU is not visible to {viewer.name} (CUDA_VISIBLE_DEVICES)"
    return None


def check_local(setting: str, device: str) -> None:
    """Start-up check of one worker's ``--kv-transport`` (ValueError with the fix)."""
    if setting not in TRANSPORTS:
        raise ValueError(f"unknown KV transport {setting!r}; choose one of {', '.join(TRANSPORTS)}")
    if setting == "cuda-ipc" and device != "cuda":
        raise ValueError(f"--kv-transport cuda-ipc needs the KV cache on CUDA (--device cuda); it is on {device}")


def choose_transport(a: Side, b: Side) -> str:
    """'tcp' or 'cuda-ipc' for a pair of workers (symmetric in ``a`` and ``b``); raises ValueError, a one-line
    reason for the handshake's refusal, when the settings conflict or cuda-ipc is asked for where it cannot
    work."""
    for side in (a, b):
        if side.setting not in TRANSPORTS:
            raise ValueError(f"{side.name} asks for an unknown KV transport {side.setting!r}")
    wanted = {a.setting, b.setting} - {"auto"}
    if len(wanted) > 1:
        raise ValueError(f"conflicting transports: --kv-transport {a.setting} on {a.name}, {b.setting} on {b.name}")
    obstacle = ipc_obstacle(a, b)
    if wanted == {"cuda-ipc"}:
        if obstacle is not None:
            raise ValueError(f"--kv-transport cuda-ipc needs both KV caches on CUDA on one host, but {obstacle}")
        return "cuda-ipc"
    if wanted == {"tcp"} or obstacle is not None:
        return "tcp"
    return "cuda-ipc"
