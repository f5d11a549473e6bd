"""Writing files whole or not at all, on any store, as parts, merged files and the saved job need.
A failure is a ``JobError`` naming the file."""

from __future__ import annotations

import errno

from ...storage import Location
from ...storage.stores import Writer
from ..errors import JobError


def write_whole(final: Location, write: Writer, create_only: bool = False) -> bool:
    """``write`` a local temp file and publish it at ``final`` at once (``Location.publish``)."""
    try:
        return final.publish(write, create_only)
    except OSError as e:
        raise JobError(f"cannot write {final}: {e.strerror or e}{_write_hint(e)}") from None


def _write_hint(e: OSError) -> str:
    """What to do about a local write that failed for want of room or of permission."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return "; free space there (or raise the quota) and run again: finished parts are kept, this one is redone"
    if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return "; make the output dir writable and run again: finished parts are kept, this one is redone"
    return ""


def remove_file(path: Location) -> None:
    try:
        path.remove()
    except OSError as e:
        raise JobError(f"cannot remove {path}: {e}") from None
