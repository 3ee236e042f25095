"""Where the model runs: `device` = "auto" (CUDA when this process sees a GPU, else the CPU),
"cuda" (or "cuda:N") or "cpu". Resolved once, in EngineConfig, so every layer below sees a
concrete device; asking for CUDA where there is none is an error that says so, not a
silent fall-back to the CPU (a GPU deployment that quietly runs on the CPU is the worse bug).

Under Ray each worker actor asks for `num_gpus_per_worker` GPUs (default 1 on CUDA) and Ray
sets its CUDA_VISIBLE_DEVICES, so "cuda" in a worker is the GPU it was given.
"""

from __future__ import annotations

DEVICES = ("auto", "cuda", "cpu")


def check_device_name(device: str) -> None:
    """A clear ValueError for a name that is none of DEVICES (or cuda:N)."""
    kind, colon, index = device.partition(":")
    if device not in DEVICES and not (kind == "cuda" and colon and index.isdigit()):
        raise ValueError(f"device must be one of {', '.join(DEVICES)} (or cuda:N), got {device!r}")


def visible_gpus() -> int:
    """CUDA devices this process sees (0 on a CPU-only build of torch)."""
    import torch  # here, not at import: configs and the gateway read device names without torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_device(device: str, num_gpus: int, where: str = "this process") -> str:
    """ "cpu", "cuda" or "cuda:N" for `device`, given the GPUs the engine can use (`num_gpus`:
    those this process sees, or under Ray the cluster's); a clear ValueError for CUDA where
    there is none."""
    check_device_name(device)
    if device == "auto":
        return "cuda" if num_gpus > 0 else "cpu"
    if device == "cpu":
        return "cpu"
    if num_gpus == 0:
        import torch

        build = "" if torch.version.cuda else " (this torch is a CPU-only build)"
        raise ValueError(
            f"device={device!r} but {where} has no CUDA device{build}; CUDA_VISIBLE_DEVICES and the "
            "driver decide what is seen. Use --device cpu, or --device auto to take a GPU when present."
        )
    index = int(device.partition(":")[2] or 0)
    if index >= num_gpus:
        raise ValueError(f"device={device!r} but {where} has {num_gpus} CUDA device(s)")
    return device
