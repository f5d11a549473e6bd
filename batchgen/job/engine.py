"""Building the engine. ``batchgen run`` takes a factory so the job layer never depends on how
the engine is made; tests inject a fake with ``--engine`` or ``BATCHGEN_ENGINE``."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..models.resolve import resolve_model
from .adapters import JobAdapter, lora_rank_kwargs
from .errors import JobError
from .spec import Job

EngineFactory = Callable[..., Any]
ENGINE_ENV = "BATCHGEN_ENGINE"  # "package.module:callable" or "path/to/file.py:callable"


def default_factory(**kwargs: Any) -> Any:
    """``batchgen.LLM``, imported only when a run needs it."""
    try:
        from batchgen import LLM  # type: ignore[attr-defined]
    except ImportError as e:
        raise JobError(f"the batchgen engine (batchgen.LLM) cannot be imported: {e}") from None
    return LLM(**kwargs)


def config_checker(factory: EngineFactory) -> Callable[..., list[Any]] | None:
    """The engine's check of its options against the model without loading it (``LLM.check_config``,
    returning problems with ``option`` and ``message``), if the factory's engine has one."""
    if factory is default_factory:
        try:
            from batchgen import LLM  # type: ignore[attr-defined]
        except ImportError:
            return None
        return LLM.check_config
    return getattr(factory, "check_config", None)


def load_factory(spec: str | None = None) -> EngineFactory:
    spec = spec or os.environ.get(ENGINE_ENV)
    if not spec:
        return default_factory
    target, _, attr = spec.rpartition(":") if ":" in spec else (spec, "", "LLM")
    try:
        if target.endswith(".py"):
            mod_spec = importlib.util.spec_from_file_location(Path(target).stem, target)
            if mod_spec is None or mod_spec.loader is None:
                raise ImportError(f"cannot load {target}")
            module = importlib.util.module_from_spec(mod_spec)
            sys.modules[mod_spec.name] = module  # dataclasses look their module up there
            mod_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(target)
        return getattr(module, attr or "LLM")
    except (ImportError, AttributeError, OSError) as e:
        raise JobError(f"cannot load engine factory {spec!r}: {e}") from None


def build_engine(factory: EngineFactory, job: Job) -> Any:
    """Call the factory with the model's local directory (a Hub id is found in the Hub cache or
    downloaded, a bucket's model copied into the node's cache, with the job's storage options);
    a bad model path or option is a user error, reported in one line."""
    source = job.model_source
    try:
        local = resolve_model(source, job.spec.storage)
    except (OSError, ValueError) as e:  # ModelNotFound, StorageError
        raise JobError(f"model.path: {e}") from None
    kwargs = job.spec.model.engine_kwargs(local) | lora_rank_kwargs(job.adapters)
    if source.kind != "local":  # outputs name the model by its id or URL, not by the cache's path
        kwargs["served_model_name"] = source.ref
    try:
        llm = factory(**kwargs)
    except (OSError, ValueError) as e:
        raise JobError(f"cannot load model {kwargs['model']}: {e}") from None
    load_adapters(llm, job.adapters)
    return llm


def load_adapters(llm: Any, adapters: dict[str, JobAdapter]) -> None:
    """Every adapter loaded and checked against the model before any row, so a bad one stops the job in
    one line instead of failing its rows (an engine without ``add_lora`` checks them as rows name them)."""
    add = getattr(llm, "add_lora", None)
    if add is None:
        return
    for name, adapter in adapters.items():
        try:
            add(adapter.request)
        except ValueError as e:
            raise JobError(f"model.lora_modules.{name}: {str(e).removeprefix('lora_request: ')}") from None
