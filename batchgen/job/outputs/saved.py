"""The job configuration a run saves into its output dir (``_job.yaml`` as written, ``_job.json``
resolved with its config hash), so ``batchgen status OUTPUT_DIR`` can find the input again and a
later run with a different configuration is noticed. Names start with ``_`` so Parquet dataset
readers skip them."""

from __future__ import annotations

import json
from typing import Any

from ...storage import Location
from ..errors import JobError
from ..line_ids import SAVED_KEY, line_ids_from
from ..spec import Job
from .files import write_whole

SAVED_JSON = "_job.json"
SAVED_YAML = "_job.yaml"


def read_saved(out_dir: Location) -> dict[str, Any] | None:
    path = out_dir / SAVED_JSON
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise JobError(f"cannot read {path}: {e}") from None


def check_saved(out_dir: Location, job: Job, force: bool) -> None:
    saved = read_saved(out_dir)
    if saved is None or force or saved.get("config_hash") == job.config_hash:
        return
    raise JobError(
        f"{out_dir} holds the output of another job configuration ({changes_since(saved, job)}; config "
        f"{saved.get('config_hash')}, this job {job.config_hash}; see {out_dir / SAVED_YAML}); use a new "
        "output.dir, or pass --force to keep the rows already done and do the rest with the new configuration")


def changes_since(saved: dict[str, Any], job: Job) -> str:
    """The fields that differ between the saved job and ``job``, as ``field: old -> new; ...``."""
    try:
        changes = job.config_changes(Job.from_saved(saved))
    except (KeyError, TypeError, ValueError):  # written by a version whose saved form this one cannot read
        changes = []
    if not changes:
        return "no field differs as this version reads them; another batchgen version may have written it"
    return "; ".join(changes)


def save(out_dir: Location, job: Job) -> None:
    """Every shard saves the same files; on a bucket the last PUT wins, with the same content."""
    numbering = {SAVED_KEY: line_ids_from(read_saved(out_dir))}  # a dir keeps the numbering it began with
    write_whole(out_dir / SAVED_YAML, lambda tmp: tmp.write_text(job.text, encoding="utf-8"))
    text = json.dumps({**job.saved_form(), **numbering}, indent=2, sort_keys=True) + "\n"
    write_whole(out_dir / SAVED_JSON, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def load_saved_job(out_dir: Location) -> Job:
    saved = read_saved(out_dir)
    if saved is None:
        raise JobError(f"{out_dir} has no {SAVED_JSON}: not a batchgen output dir (or no run started yet)")
    try:
        return Job.from_saved(saved)
    except (KeyError, ValueError) as e:
        raise JobError(f"{out_dir / SAVED_JSON} is not usable: {e}") from None


def dir_line_ids_from(out_dir: Location) -> int:
    """The numbering of the output dir's derived ids (line_ids.FIRST_LINE for a dir not begun yet)."""
    return line_ids_from(read_saved(out_dir))
