"""Model TFLOP/s per device and MFU (model FLOPs utilisation) of a training step: one count for the plan
(predicted, from the simulated step), the report (measured), scripts/megatron_table.py and scripts/bench_gpu.py.
Imports no torch.

The numerator is `terapipe_cli.models.flops_per_token` (6·N plus attention, PaLM's count, without the recomputed
forward: model FLOPs, not hardware FLOPs) times the tokens of one replica's step, over the K·T devices that run it.
The denominator is the device's dense peak at the run's precision: the hardware file an analytic profile was
estimated from (when it prices that precision), else the datasheet figure of a known device (`KNOWN_PEAKS`), else
none ("n/a")."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from terapipe_cli.errors import UserError
from terapipe_cli.models import ModelConfig, flops_per_token

# Dense peaks by (device-name fragment, precision), FLOP/s, from the vendors' datasheets: tensor-core bf16/fp16
# without sparsity; fp32 is the CUDA-core figure (PyTorch runs fp32 products without TF32 unless told to).
KNOWN_PEAKS: dict[tuple[str, str], float] = {
    ("H100", "bf16"): 989e12,  # NVIDIA H100 SXM datasheet: 1,979 TFLOPS with sparsity
    ("H100", "fp16"): 989e12,
    ("H100", "fp32"): 67e12,
    ("H200", "bf16"): 989e12,  # NVIDIA H200 datasheet: the H100's compute
    ("H200", "fp16"): 989e12,
    ("H200", "fp32"): 67e12,
    ("A100", "bf16"): 312e12,  # NVIDIA A100 datasheet
    ("A100", "fp16"): 312e12,
    ("A100", "fp32"): 19.5e12,
    ("V100", "fp16"): 125e12,  # NVIDIA Tesla V100 datasheet (SXM2)
    ("V100", "fp32"): 15.7e12,
}


def peak_flops(device: dict | str | None, precision: str) -> tuple[float | None, str]:
    """The device's dense peak at ``precision`` (FLOP/s) and where it came from; (None, "n/a") when unknown.
    ``device``: a profile's ``device`` record (an analytic one names its hardware file) or a device name."""
    if isinstance(device, dict):
        path = device.get("hardware_file")
        if path:
            from terapipe_cli.config.hardware import load_hardware

            try:
                hardware = load_hardware(path)
            except (UserError, OSError):
                hardware = None
            if hardware is not None and hardware.training.dtype == precision:
                return hardware.device.peak_flops, Path(str(path)).name
        name = str(device.get("name") or "")
    else:
        name = str(device or "")
    for (fragment, dtype), peak in KNOWN_PEAKS.items():
        if fragment in name and dtype == precision:
            return peak, f"{fragment} {dtype} datasheet"
    return None, "n/a"


@dataclass(frozen=True)
class Utilisation:
    """Model FLOP/s per device of one step, and the share of the peak it is."""

    model_tflops: float  # model teraFLOP/s per device
    mfu: float | None  # model_tflops over the peak; None where the peak is unknown
    peak_tflops: float | None
    peak_source: str

    def text(self) -> str:
        """``412.3 model TFLOP/s per device, MFU 41.7% of 989 (h100.toml)``."""
        if self.mfu is None:
            return f"{self.model_tflops:.3g} model TFLOP/s per device, MFU n/a (peak unknown)"
        return (
            f"{self.model_tflops:.3g} model TFLOP/s per device, MFU {self.mfu:.1%} of {self.peak_tflops:g} "
            f"({self.peak_source})"
        )

    def mfu_text(self) -> str:
        return "n/a" if self.mfu is None else f"{self.mfu:.1%}"

    def to_dict(self) -> dict:
        return {
            "model_tflops": self.model_tflops,
            "mfu": self.mfu,
            "peak_tflops": self.peak_tflops,
            "peak_source": self.peak_source,
        }


def step_flops(model: ModelConfig, seq_len: int, sequences: int, *, recompute: float = 0.0) -> float:
    """FLOPs of one step of ``sequences`` sequences of ``seq_len`` tokens (`flops_per_token` at that length)."""
    cfg = model if model.seq_len == seq_len else replace(model, seq_len=seq_len)
    return flops_per_token(cfg, recompute=recompute) * sequences * seq_len


def utilisation(
    model: ModelConfig,
    *,
    seq_len: int,
    sequences: int,
    devices: int,
    step_s: float,
    device: dict | str | None,
    precision: str,
) -> Utilisation:
    """One replica's step of ``sequences`` sequences on ``devices`` devices (K·T) taking ``step_s`` seconds."""
    tflops = step_flops(model, seq_len, sequences) / devices / step_s / 1e12
    peak, source = peak_flops(device, precision)
    mfu = None if peak is None else tflops * 1e12 / peak
    return Utilisation(tflops, mfu, None if peak is None else peak / 1e12, source)
