"""A job's LoRA adapters (``model.lora_modules: {name: path}``): where each one is on this node, its
content digest (part of the config hash) and its rank, and which adapter a row runs with.

A path is a local directory (relative to the job file) or a bucket URL, whose files are copied once per
node into the model cache (``batchgen.storage.model_cache``). Adapter ids follow the order of
``lora_modules``, so a name keeps its id within a run.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..lora.request import LoRARequest
from ..storage import StorageOptions, is_url, location
from ..storage.model_cache import ModelCache
from .errors import JobError

CONFIG_FILE = "adapter_config.json"
DIGESTED = (CONFIG_FILE, "adapter_model.safetensors", "adapter_model.bin")  # what a PEFT adapter is made of
LORA_COLUMN = "lora"  # the output column naming each row's adapter (null: the base model)


class UnknownAdapter(ValueError):
    """A row names an adapter the job does not have; the message says which names it has."""


@dataclass(frozen=True)
class JobAdapter:
    name: str
    request: LoRARequest  # lora_path: the local directory
    digest: str
    rank: int


def adapter_dir(name: str, path: str, base_dir: Path, storage: StorageOptions | None) -> Path:
    """The adapter's local directory, a bucket's copied into the node's cache first (``JobError``: one line
    naming the job-file field)."""
    where = f"model.lora_modules.{name}"
    if is_url(path):
        try:
            return ModelCache(location(path, options=storage)).fetch()
        except (OSError, ValueError) as e:
            raise JobError(f"{where}: {e}") from None
    local = Path(path).expanduser()
    local = local if local.is_absolute() else base_dir / local
    if not local.is_dir():
        raise JobError(f"{where}: no adapter directory at {local}")
    if not (local / CONFIG_FILE).is_file():
        raise JobError(f"{where}: {local} has no {CONFIG_FILE} (not a PEFT adapter directory)")
    return local


def content_digest(directory: Path) -> str:
    """sha256 over the adapter's config and weight files (names and bytes): other weights, another job."""
    h = hashlib.sha256()
    for name in DIGESTED:
        file = directory / name
        if file.is_file():
            h.update(f"{name}\0{file.stat().st_size}\0".encode())
            with open(file, "rb") as f:
                while chunk := f.read(1 << 20):
                    h.update(chunk)
    return h.hexdigest()[:16]


def config_rank(directory: Path) -> int:
    """The largest rank the adapter's config declares (``r`` and its ``rank_pattern``); the engine checks the
    weights themselves when it loads them."""
    try:
        config = json.loads((directory / CONFIG_FILE).read_text())
    except (OSError, ValueError):
        return 0  # the engine's load says why in one line
    pattern = config.get("rank_pattern") or {}
    ranks = [config.get("r", 8), *(pattern.values() if isinstance(pattern, dict) else [])]
    return max(r for r in ranks if isinstance(r, int))


def resolve_adapters(modules: dict[str, str], base_dir: Path, storage: StorageOptions | None) -> dict[str, JobAdapter]:
    """Every adapter of ``model.lora_modules`` by name, found or fetched."""
    out = {}
    for lora_id, (name, path) in enumerate(modules.items(), start=1):
        local = adapter_dir(name, path, base_dir, storage)
        out[name] = JobAdapter(name, LoRARequest(name, lora_id, str(local)), content_digest(local), config_rank(local))
    return out


def lora_rank_kwargs(adapters: dict[str, JobAdapter]) -> dict[str, Any]:
    """The engine's max_lora_rank for a job's adapters: the largest of their ranks."""
    return {"max_lora_rank": max(1, *(a.rank for a in adapters.values()))} if adapters else {}


def pick_adapter(adapters: dict[str, JobAdapter], name: str | None) -> JobAdapter | None:
    """The adapter `name` names (None: the base model); ``UnknownAdapter`` for a name the job lacks."""
    if name is None:
        return None
    found = adapters.get(name)
    if found is None:
        have = ", ".join(adapters) or "none"
        raise UnknownAdapter(f"unknown adapter {name!r} (model.lora_modules has: {have})")
    return found
