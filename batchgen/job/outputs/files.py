"""Writing files whole or not at all, on any store, as parts, merged files and the saved job need.
A failure is a ``JobError`` naming the file."""

from __future__ import annotations

from ...storage import Location
from ...storage.stores import Writer
from ..errors import JobError


def write_whole(final: Location, write: Writer, create_only: bool = False) -> bool:
    """``write`` a local temp file and publish it at ``final`` at once (``Location.publish``)."""
    try:
        return final.publish(write, create_only)
    except OSError as e:
        raise JobError(f"cannot write {final}: {e}") from None


def remove_file(path: Location) -> None:
    try:
        path.remove()
    except OSError as e:
        raise JobError(f"cannot remove {path}: {e}") from None
