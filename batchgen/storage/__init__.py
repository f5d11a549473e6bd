"""The storage seam: every file a job reads or writes, local or in a bucket, is a ``Location``.

What differs per store (atomic publish, create-only writes, locks, listing, retries) lives in
this package alone; the job code calls the same methods for a local dir and for ``s3://``.
"""

from .locations import Location, is_url, location, store_for
from .options import StorageOptions
from .stores import FileInfo, StorageError

__all__ = ["FileInfo", "Location", "StorageError", "StorageOptions", "is_url", "location", "store_for"]
