"""Which precision a CPU computes fast: bf16 where it multiplies bf16 natively, else float32.

CPUs with AMX (``amx_bf16``) or AVX-512 BF16 (``avx512_bf16``) run bf16 matrix products several times
faster than float32 (measured in docs/results/update-speed.md and docs/results/real-model-speed.md);
elsewhere bf16 is emulated and slower than float32. The settings that take ``"native"``
(``rollout.engine_options.dtype``, ``update.bf16_on_cpu``, ``sft.bf16_on_cpu``) resolve it here, once
per process, from the flags the kernel reports (/proc/cpuinfo; none there: float32).
"""

from __future__ import annotations

import functools
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from schemas.config import Config

NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")


@dataclass(frozen=True)
class CpuPrecision:
    """The CPU's model name, its native bf16 flags, and what ``"native"`` resolves to."""

    model: str
    bf16_flags: tuple[str, ...]

    @property
    def bf16(self) -> bool:
        return bool(self.bf16_flags)

    @property
    def dtype(self) -> str:
        return "bfloat16" if self.bf16 else "float32"

    def describe(self) -> str:
        """One line for a run's start: the CPU and the precision ``native`` chose."""
        why = (
            "with " + " and ".join(self.bf16_flags)
            if self.bf16
            else "without native bf16 (no AMX or AVX-512 BF16)"
        )
        return f"cpu: {self.model or 'unknown'} {why}: native precision = {self.dtype}"


def parse_cpuinfo(text: str) -> CpuPrecision:
    """The first processor's model name and native bf16 flags from /proc/cpuinfo's text (pure)."""
    model, flags = "", set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key == "flags" and not flags:
            flags = set(value.split())
    return CpuPrecision(model, tuple(f for f in NATIVE_BF16_FLAGS if f in flags))


@functools.cache
def cpu_precision() -> CpuPrecision:
    """This machine's ``CpuPrecision`` (read once per process)."""
    try:
        return parse_cpuinfo(Path("/proc/cpuinfo").read_text())
    except OSError:
        return CpuPrecision(platform.processor(), ())


def resolve_bf16_on_cpu(setting: bool | str) -> bool:
    """``update.bf16_on_cpu`` / ``sft.bf16_on_cpu``: a bool as it is; ``"native"`` = the CPU's choice."""
    if setting == "native":
        return cpu_precision().bf16
    return bool(setting)


def native_settings(config: Config) -> list[str]:
    """The settings of ``config`` that ask for the CPU's native precision (none on a GPU run)."""
    if config.run.device == "cuda":
        return []
    found = []
    if config.rollout.engine == "vllm" and config.rollout.engine_options.get("dtype") == "native":
        found.append("rollout.engine_options.dtype")
    if config.update.bf16_on_cpu == "native":
        found.append("update.bf16_on_cpu")
    if config.sft.enabled and config.sft.bf16_on_cpu == "native":
        found.append("sft.bf16_on_cpu")
    return found


def native_precision_line(config: Config) -> str:
    """What ``"native"`` chose on this CPU, naming the settings that asked ("" when none did)."""
    names = native_settings(config)
    return f"{cpu_precision().describe()} ({', '.join(names)})" if names else ""
