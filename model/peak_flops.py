"""The GPUs' peak throughput, the denominator of MFU (model FLOPs utilisation), in one table.

MFU = the model's training FLOPs per token (`GPT.flops_per_token`, counted from its shape) x tokens/s /
the GPU's dense BF16 tensor-core peak. The figures are the datasheets' dense ones (NVIDIA also prints
figures with 2:4 sparsity, twice these). A GPU that is not in the table gets no MFU, and the reason says
so, rather than a figure against another GPU's peak (a probe on a GB10 once reported MFU against an
H100's; NVIDIA publishes no dense BF16 figure for the GB10).
"""
from __future__ import annotations

import torch

# (a part of torch.cuda.get_device_name(), dense BF16 TFLOP/s); the first that matches wins, so a
# variant comes before its family's SXM part
PEAK_BF16_TFLOPS = (
    ("H100 PCIe", 756), ("H100 NVL", 835), ("H100", 989),
    ("H200 NVL", 835), ("H200", 989),
    ("A100", 312),
    ("B200", 2250),
)


def peak_flops(device) -> tuple[float | None, str]:
    """(the device's dense BF16 peak in FLOP/s, a line saying which), or (None, why there is no MFU)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None, f"no MFU on {device.type}: the peak table (model/peak_flops.py) holds GPUs"
    name = torch.cuda.get_device_name(device)
    tflops = next((v for part, v in PEAK_BF16_TFLOPS if part in name), None)
    if tflops is None:
        return None, (f"no MFU: {name}'s dense BF16 peak is not in model/peak_flops.py PEAK_BF16_TFLOPS "
                      f"(known: {', '.join(part for part, _ in PEAK_BF16_TFLOPS)}); add it to report MFU")
    return tflops * 1e12, f"MFU against {name}'s dense BF16 peak, {tflops} TFLOP/s"
