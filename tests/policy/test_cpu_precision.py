"""``"native"`` precision: bf16 only where the CPU multiplies bf16 natively (stages/policy/cpu_precision.py)."""

from __future__ import annotations

import pytest
import torch

from schemas.config import load_config
from schemas.errors import GraftError
from stages.policy import cpu_precision
from stages.policy.cpu_precision import (
    CpuPrecision,
    native_precision_line,
    parse_cpuinfo,
    resolve_bf16_on_cpu,
)
from stages.update.trainer import bf16_autocast
from tests.helpers.paths import CONFIGS

SAPPHIRE = """processor\t: 0
model name\t: Intel(R) Xeon(R) Processor
flags\t\t: fpu sse avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8
processor\t: 1
model name\t: Intel(R) Xeon(R) Processor
flags\t\t: fpu sse avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8
"""
GENOA = """model name\t: AMD EPYC 9R14 96-Core Processor
flags\t\t: fpu sse avx2 avx512f avx512_bf16 avx512_vnni
"""
ICELAKE = """model name\t: Intel(R) Xeon(R) Platinum 8375C CPU
flags\t\t: fpu sse avx2 avx512f avx512_vnni
"""


def test_parse_cpuinfo_names_the_native_bf16_flags() -> None:
    amx = parse_cpuinfo(SAPPHIRE)
    assert amx == CpuPrecision("Intel(R) Xeon(R) Processor", ("amx_bf16", "avx512_bf16"))
    assert amx.bf16 and amx.dtype == "bfloat16" and "amx_bf16" in amx.describe()
    amd = parse_cpuinfo(GENOA)
    assert amd.bf16_flags == ("avx512_bf16",) and amd.dtype == "bfloat16"
    plain = parse_cpuinfo(ICELAKE)
    assert not plain.bf16 and plain.dtype == "float32" and "without native bf16" in plain.describe()
    assert parse_cpuinfo("") == CpuPrecision("", ())


@pytest.mark.parametrize("flags", [(), ("amx_bf16",)])
def test_native_bf16_on_cpu_resolves_by_the_cpu(monkeypatch, flags) -> None:
    monkeypatch.setattr(cpu_precision, "cpu_precision", lambda: CpuPrecision("x", flags))
    assert resolve_bf16_on_cpu("native") is bool(flags)
    assert resolve_bf16_on_cpu(True) is True and resolve_bf16_on_cpu(False) is False
    with bf16_autocast(torch.device("cpu"), True, "native"):
        out = torch.nn.Linear(4, 4)(torch.ones(1, 4))
    assert out.dtype == (torch.bfloat16 if flags else torch.float32)


def test_native_is_a_valid_value_and_the_start_names_what_it_chose(monkeypatch) -> None:
    monkeypatch.setattr(cpu_precision, "cpu_precision", lambda: CpuPrecision("Some CPU", ("amx_bf16",)))
    config = load_config(
        CONFIGS / "quickstart.toml",
        ["update.bf16_on_cpu=native", "rollout.engine=vllm", "rollout.engine_options.dtype=native"],
    )
    line = native_precision_line(config)
    assert line.startswith("cpu: Some CPU with amx_bf16: native precision = bfloat16")
    assert "rollout.engine_options.dtype" in line and "update.bf16_on_cpu" in line
    assert native_precision_line(load_config(CONFIGS / "quickstart.toml", [])) == ""
    with pytest.raises(GraftError, match="bf16_on_cpu"):
        load_config(CONFIGS / "quickstart.toml", ["update.bf16_on_cpu=fast"])
