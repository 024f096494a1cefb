"""Where models run: "auto" is CUDA when a GPU is visible, else the CPU (training and serving alike)."""

import torch


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)
