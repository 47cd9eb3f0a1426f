"""How large an HF cache may be made: within the device's int32 lengths and page ids, and within the free memory,
checked before anything is allocated (issue: a cache of 1e6 slots grew to 23 GB until the OOM killer stopped it)."""

from __future__ import annotations

import torch

from oscar_export.kernels.layout import KVCacheLayout

#: the most slots and tokens a slot a cache may be made with (int32 lengths and page ids on the device).
MAX_BATCH, MAX_LENGTH = 1 << 20, 1 << 28


def available_bytes(device: torch.device | str) -> int:
    """Bytes free for new tensors on ``device``: the CUDA free memory, or the host's MemAvailable."""
    import os

    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_cache_size(layout: KVCacheLayout, num_layers: int, batch_size: int, max_length: int,
                     device: torch.device | str) -> None:
    """Refuse, before anything is allocated, a cache beyond the int32 bounds or larger than the free memory
    (estimate: every layer's windows and pages of ``batch_size`` slots of ``max_length`` tokens)."""
    if batch_size > MAX_BATCH or max_length > MAX_LENGTH:
        raise ValueError(f"batch_size and max_length: expected at most {MAX_BATCH:,} slots of {MAX_LENGTH:,} tokens, "
                         f"got {batch_size:,} x {max_length:,}")
    need = num_layers * batch_size * layout.sequence_bytes(max_length)
    free = available_bytes(device)
    if need > free:
        raise MemoryError(f"an OscarCache of {batch_size:,} slots x {max_length:,} tokens needs about {need:,} bytes "
                          f"({num_layers} layers); {free:,} bytes are free on {device}")


__all__ = ["MAX_BATCH", "MAX_LENGTH", "available_bytes", "check_cache_size"]
