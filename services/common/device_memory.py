"""Free and total memory of the device a process works on: a GPU's through CUDA, the host's for the CPU."""

import os


def free_and_total(device) -> tuple[int, int]:
    """Bytes free and in all on `device` (a torch.device; a CUDA device without an index: the current one)."""
    if device.type == "cuda":
        import torch

        return torch.cuda.mem_get_info(device.index)
    page = os.sysconf("SC_PAGE_SIZE")
    return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page
