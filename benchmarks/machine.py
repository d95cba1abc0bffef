"""The machine a figure was measured on: the CPU's model and instruction-set flags (and the GPU's
name on CUDA), named in every report so that a figure is never read without them."""

from __future__ import annotations

import os
import platform
from pathlib import Path

# the flags that decide which kernels run, in the order they are printed
ISA_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl",
             "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8", "asimd", "sve")


def _cpuinfo(text: str) -> tuple[str, list[str], int | None]:
    """(model name, flags, hardware threads a core) of the first processor in /proc/cpuinfo's text
    ('', [] and None where absent)."""
    model, flags, numbers = "", [], {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if not model and key in ("model name", "Model Name", "Hardware"):
            model = value.strip()
        elif not flags and key in ("flags", "Features"):
            flags = value.split()
        elif key in ("siblings", "cpu cores") and key not in numbers and value.strip().isdigit():
            numbers[key] = int(value)
        if model and flags and len(numbers) == 2:
            break
    if len(numbers) < 2 or not numbers["cpu cores"]:
        return model, flags, None
    return model, flags, numbers["siblings"] // numbers["cpu cores"]


def machine_info(device: str = "cpu", cpuinfo: str | None = None) -> dict:
    """{cpu_model, cpus, threads_per_core, isa_flags (the ISA_FLAGS present), flags (all of them), device}."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    model, flags, per_core = _cpuinfo(cpuinfo)
    # threads_per_core: 2 where the CPUs are SMT siblings (torch's main thread then runs on half of them;
    # the engine runs on all, engine.openmp.engine_threads)
    info = {"cpu_model": model or platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "threads_per_core": per_core, "isa_flags": [f for f in ISA_FLAGS if f in flags],
            "flags": sorted(flags), "device": device}
    if device.startswith("cuda"):
        import torch

        info["device"] = f"{device} ({torch.cuda.get_device_name(torch.device(device))})"
    return info


def describe(info: dict) -> str:
    """One line: 'machine: <model>, <n> CPUs; flags: avx2 fma ...' (and the device where not the CPU)."""
    flags = " ".join(info["isa_flags"]) or "none"
    smt = f" ({info['threads_per_core']} threads a core)" if (info.get("threads_per_core") or 1) > 1 else ""
    line = f"machine: {info['cpu_model']}, {info['cpus']} CPUs{smt}; flags: {flags}"
    return line if info["device"] == "cpu" else f"{line}; device {info['device']}"
