"""Where a model comes from, and the local directory the engine loads it from.

``model`` may be:

- a local directory (or ``.gguf`` file); one that exists always wins over the other readings;
- a Hugging Face Hub id (``org/name``; a bare ``name`` only when the Hub cache has it), found
  through ``huggingface_hub`` as transformers and vLLM find it: its cache (``HF_HOME``,
  ``HF_HUB_CACHE``), ``revision``, ``HF_TOKEN``, ``HF_HUB_OFFLINE``;
- a bucket URL (``s3://bucket/models/NAME``, ``gs://...``), copied once per node into batchgen's
  cache (``batchgen.storage.model_cache``).

The environment is read at each call, not at import, so one process can change it between models.
Nothing here imports torch: the job layer uses it to check a job file.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from batchgen.errors import first_line
from batchgen.storage import StorageOptions, is_url, location
from batchgen.storage.model_cache import Log, ModelCache, stderr_log

ModelKind = Literal["local", "hub", "bucket"]

# A Hub repo id as huggingface_hub validates it: "name" or "namespace/name", letters, digits, "-", "_", ".".
_HUB_ID = re.compile(r"^(?:[A-Za-z0-9][\w.-]*/)?[A-Za-z0-9][\w.-]*$")
# What a Hub download takes from a repo: config, weights as safetensors, tokenizer and chat template
# files, at the top level (not the .bin/.pth/.gguf copies of the weights, nor subfolders such as original/).
HUB_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja"]
HUB_SKIP = ["*/*"]


class ModelNotFound(FileNotFoundError):
    """The model cannot be had from where ``model`` points; the message is one line saying why
    and what to do."""


@dataclass(frozen=True)
class ModelSource:
    kind: ModelKind
    ref: str  # local: the path; hub: the repo id; bucket: the URL
    revision: str | None = None  # hub only: a branch, tag or commit

    def __str__(self) -> str:
        return f"{self.ref}@{self.revision}" if self.revision else self.ref

    @property
    def name(self) -> str:
        """A short name for outputs: the directory's name, the Hub id, the URL's last part."""
        if self.kind == "hub":
            return self.ref
        return Path(self.ref).name if self.kind == "local" else self.ref.rstrip("/").rsplit("/", 1)[-1]

    @property
    def identity(self) -> str:
        """What names the model wherever it is cached (for config hashes): the resolved local
        path, the Hub id (its revision is hashed on its own), or the URL."""
        return str(Path(self.ref).expanduser().resolve()) if self.kind == "local" else self.ref

    def revision_problem(self) -> str | None:
        if self.revision is None or self.kind == "hub":
            return None
        what = "a local path" if self.kind == "local" else "a bucket URL"
        return f"applies to a Hugging Face Hub id only, and {self.ref} is {what}; remove it"


def model_source(model: str | os.PathLike[str], base_dir: Path | None = None,
                 revision: str | None = None) -> ModelSource:
    """Read ``model`` as a local path (relative to ``base_dir`` if given), a Hub id or a URL."""
    text = os.fspath(model)
    if is_url(text):
        return ModelSource("bucket", text.rstrip("/"), revision)
    if text.lower().startswith("file://"):
        text = text[len("file://"):]
    path = Path(text).expanduser()
    local = path if path.is_absolute() or base_dir is None else base_dir / path
    ref = str(local) if base_dir is not None else text
    if local.exists() or not looks_like_hub_id(text):
        return ModelSource("local", ref, revision)
    if "/" not in text and not (hub_cache_dir() / _hub_folder(text)).is_dir():
        return ModelSource("local", ref, revision)  # a bare name is an id only once the Hub cache has it
    return ModelSource("hub", text, revision)


def looks_like_hub_id(text: str) -> bool:
    return (bool(_HUB_ID.match(text)) and len(text) <= 96 and "--" not in text and ".." not in text
            and not text.endswith((".git", ".", "-")))


def resolve_model(source: ModelSource, storage: StorageOptions | dict[str, Any] | None = None,
                  log: Log = stderr_log) -> Path:
    """The local path to load: the directory itself, the Hub snapshot (downloaded unless offline),
    or the bucket's copy in the cache (copied or updated first). Raises ``ModelNotFound`` or
    ``StorageError`` with one line."""
    if problem := source.revision_problem():
        raise ValueError(f"revision {source.revision!r} {problem}")
    if source.kind == "local":
        return Path(source.ref)
    if source.kind == "hub":
        return hub_snapshot(source.ref, source.revision, log)
    return ModelCache(location(source.ref, options=_options(storage)), log=log).fetch()


def locate_model(source: ModelSource, storage: StorageOptions | dict[str, Any] | None = None) -> Path | None:
    """The local path holding the model now, fetching nothing; None when a run would fetch it
    first (online and not in the Hub cache, or not yet copied from its bucket). Raises
    ``ModelNotFound`` or ``StorageError`` (one line) when a run could not have it either."""
    if problem := source.revision_problem():
        raise ValueError(f"revision {source.revision!r} {problem}")
    if source.kind == "local":
        return Path(source.ref)
    if source.kind == "hub":
        return cached_hub_snapshot(source.ref, source.revision)
    cache = ModelCache(location(source.ref, options=_options(storage)))
    return cache.dir if cache.is_current(cache.remote_files()) else None


def fetch_note(source: ModelSource) -> str:
    """What the first run will do for a model ``locate_model`` found nowhere local."""
    if source.kind == "hub":
        return (f"{source} is not in the Hugging Face cache ({hub_cache_dir()}) yet: the run downloads it "
                "from the Hub first, and checks the engine options against it then")
    return (f"{source} is not in the local cache yet: the first run on this node copies it (and checks "
            "the engine options against it then)")


def _options(storage: StorageOptions | dict[str, Any] | None) -> StorageOptions | None:
    return StorageOptions.model_validate(storage) if isinstance(storage, dict) else storage


# ----------------------------------------------------------------------------- Hugging Face Hub


def _true(value: str | None) -> bool:
    return (value or "").strip().upper() in ("1", "ON", "YES", "TRUE")


def hub_offline() -> bool:
    return _true(os.environ.get("HF_HUB_OFFLINE")) or _true(os.environ.get("TRANSFORMERS_OFFLINE"))


def hub_cache_dir() -> Path:
    """The Hub cache as huggingface_hub finds it: HF_HUB_CACHE, else HF_HOME/hub, else
    ~/.cache/huggingface/hub (XDG_CACHE_HOME moves ~/.cache)."""
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(os.path.expandvars(explicit)).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(os.path.expandvars(home)).expanduser() / "hub"


def _hub_folder(repo_id: str) -> str:
    return "models--" + repo_id.replace("/", "--")


def _fetch_hint(repo_id: str, revision: str | None) -> str:
    rev = f" --revision {revision}" if revision else ""
    return f"fetch it with `hf download {repo_id}{rev}` (or set HF_HOME to a cache that has it)"


def _not_cached(repo_id: str, revision: str | None) -> str:
    rev = f" at revision {revision!r}" if revision else ""
    offline = " and HF_HUB_OFFLINE is set" if hub_offline() else ""
    return (f"{repo_id}: no local directory of that name, and the Hugging Face id was not found{rev} in the "
            f"cache ({hub_cache_dir()}){offline}; {_fetch_hint(repo_id, revision)}")


def cached_hub_snapshot(repo_id: str, revision: str | None = None) -> Path | None:
    """The snapshot directory in the Hub cache, without network. Not there: offline, a
    ``ModelNotFound``; online, None if the Hub has the model (a run will download it)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=hub_cache_dir(), local_files_only=True,
                                      allow_patterns=HUB_FILES, ignore_patterns=HUB_SKIP))
    except HFValidationError as e:
        raise ModelNotFound(f"{repo_id}: not a local path, nor a valid Hugging Face id ({first_line(e)})") from None
    except LocalEntryNotFoundError:
        pass
    if hub_offline():
        raise ModelNotFound(_not_cached(repo_id, revision))
    _check_on_hub(repo_id, revision)
    return None


def _check_on_hub(repo_id: str, revision: str | None) -> None:
    """Ask the Hub whether it has the model (and revision); a ``ModelNotFound`` if not, or if
    it cannot be reached."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    try:
        HfApi().model_info(repo_id, revision=revision, timeout=10)
    except HfHubHTTPError as e:
        raise ModelNotFound(_hub_error(repo_id, revision, e)) from None
    except Exception as e:  # the HTTP client's connection errors and timeouts
        raise ModelNotFound(_unreachable(repo_id, revision, e)) from None


def hub_snapshot(repo_id: str, revision: str | None = None, log: Log = stderr_log) -> Path:
    """The model's snapshot directory, downloaded into the Hub cache first unless HF_HUB_OFFLINE is
    set (online, huggingface_hub checks the Hub for the revision's files and fetches what the cache
    lacks; if the Hub cannot be reached, a cached snapshot is used)."""
    if hub_offline():
        found = cached_hub_snapshot(repo_id, revision)
        assert found is not None  # offline, a snapshot not found raises
        return found
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError, LocalEntryNotFoundError

    log(f"model {repo_id}: looking it up on the Hugging Face Hub (cache: {hub_cache_dir()})")
    try:
        path = snapshot_download(repo_id, revision=revision, cache_dir=hub_cache_dir(), allow_patterns=HUB_FILES,
                                 ignore_patterns=HUB_SKIP, tqdm_class=None if sys.stderr.isatty() else _log_bar(
                                     f"model {repo_id}", log))
    except HFValidationError as e:
        raise ModelNotFound(f"{repo_id}: not a local path, nor a valid Hugging Face id ({first_line(e)})") from None
    except LocalEntryNotFoundError as e:  # the Hub cannot be reached and the cache does not have it
        raise ModelNotFound(_unreachable(repo_id, revision, e.__cause__ or e)) from None
    except HfHubHTTPError as e:
        raise ModelNotFound(_hub_error(repo_id, revision, e)) from None
    except OSError as e:
        raise ModelNotFound(f"{repo_id}: cannot download it into {hub_cache_dir()}: {first_line(e)}") from None
    log(f"model {repo_id}: snapshot at {path}")
    return Path(path)


def _hub_error(repo_id: str, revision: str | None, e: Exception) -> str:
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    if isinstance(e, GatedRepoError):
        return f"{repo_id}: a gated model; accept its terms on huggingface.co and set HF_TOKEN"
    if isinstance(e, RepositoryNotFoundError):
        return (f"{repo_id}: no local directory of that name, and no such model on the Hugging Face Hub "
                "(a private one needs HF_TOKEN)")
    if isinstance(e, RevisionNotFoundError):
        return f"{repo_id}: the Hugging Face Hub has no revision {revision!r} of it"
    return f"{repo_id}: the Hugging Face Hub refused it ({first_line(e)}); check HF_TOKEN"


def _unreachable(repo_id: str, revision: str | None, e: BaseException) -> str:
    return (f"{repo_id}: no local directory of that name, not in the Hugging Face cache ({hub_cache_dir()}), "
            "and the Hub cannot be reached "
            f"({type(e).__name__}: {first_line(e)}); {_fetch_hint(repo_id, revision)}")


def _log_bar(label: str, log: Log) -> type:
    """A tqdm class for huggingface_hub that draws nothing and logs plain lines instead (a line
    per file, and every 512 MiB of bytes), for logs that are not a terminal."""
    from tqdm.std import tqdm

    from batchgen.storage.model_cache import PROGRESS_EVERY, size_text

    class LogBar(tqdm):  # type: ignore[misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.pop("name", None)
            kwargs["file"] = _Sink()
            kwargs["disable"] = False
            super().__init__(*args, **kwargs)
            self._mark = PROGRESS_EVERY

        def update(self, n: float | None = 1) -> bool | None:
            shown = super().update(n)
            if self.unit != "B":
                log(f"{label}: {self.n:.0f} of {self.total or '?'} files")
            elif str(self.desc).startswith("Download") and self.n >= self._mark:
                self._mark = (self.n // PROGRESS_EVERY + 1) * PROGRESS_EVERY
                log(f"{label}: {size_text(self.n)} of {size_text(self.total or 0)}")
            return shown

    return LogBar


class _Sink:
    def write(self, text: str) -> None:
        pass

    def flush(self) -> None:
        pass
