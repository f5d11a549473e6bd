"""The processor a benchmark ran on, named as scripts/PERF.md names it: its model name and CPUID family and
model (VMs often show only "AMD EPYC" or "Intel(R) Xeon(R) Processor", which say nothing of the generation)."""

from __future__ import annotations

import platform
from pathlib import Path


def processor() -> str:
    """E.g. "AMD EPYC (CPUID family 25 model 17)"; the platform's name where /proc/cpuinfo is not."""
    try:
        fields = {}
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if not key.strip():
                break  # the first processor's block
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        return platform.processor() or platform.machine() or "unknown"
    name = fields.get("model name", platform.processor() or "unknown")
    if "cpu family" in fields and "model" in fields:
        return f"{name} (CPUID family {fields['cpu family']} model {fields['model']})"
    return name
