"""Whether an output dir looks shared between machines, for runs whose workers are on several
nodes (``batchgen ray``): parts written to a node-local disk are invisible to the other nodes and
to a retry on another node, so rows would be redone or lost from the merged view. A bucket is
shared by nature."""

from __future__ import annotations

from pathlib import Path

from .locations import Location

# Filesystem types (as /proc/mounts names them) that several machines mount at once.
SHARED_FILESYSTEMS = frozenset({
    "nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "gpfs", "beegfs", "ceph", "cephfs", "glusterfs",
    "afs", "panfs", "wekafs", "virtiofs", "9p", "fuse.s3fs", "fuse.gcsfuse", "fuse.juicefs", "fuse.sshfs",
    "fuse.mountpoint-s3", "fuse.glusterfs", "fuse.cephfs", "fuse.blobfuse", "fuse.rclone", "fuse.goofys",
})


def filesystem_of(path: Path, mounts: str = "/proc/mounts") -> tuple[str, str] | None:
    """(mount point, filesystem type) holding ``path`` (or its nearest existing parent)."""
    try:
        lines = Path(mounts).read_text().splitlines()
    except OSError:
        return None
    path = path.expanduser().absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    path = path.resolve()
    best: tuple[str, str] | None = None
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        mount = fields[1].replace("\\040", " ")
        if path.is_relative_to(mount) and (best is None or len(mount) > len(best[0])):
            best = (mount, fields[2])
    return best


def node_local_warning(out_dir: Location | Path, mounts: str = "/proc/mounts") -> str | None:
    if isinstance(out_dir, Location):
        if not out_dir.is_local:
            return None
        out_dir = out_dir.local
    found = filesystem_of(out_dir, mounts)
    if found is None or found[1] in SHARED_FILESYSTEMS:
        return None
    mount, fstype = found
    return (f"output.dir {out_dir} is on {fstype} (mounted at {mount}), which looks local to this machine: "
            "workers on other nodes, and retries there, must see the same output dir (NFS, Lustre, a "
            "mounted bucket, ...)")
