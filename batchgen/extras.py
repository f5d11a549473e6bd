"""How to install an optional extra (s3, gcs, datasets, ray), said one way by every message that needs
one: the packages themselves, as this batchgen requires them, and the way of a clone, ``pip install -e
'.[EXTRA]'``. batchgen is installed from its clone, so naming the extra on ``batchgen`` would ask a
package index for another project."""

from __future__ import annotations

import shlex
from importlib import metadata


def extra_packages(extra: str) -> list[str]:
    """The requirements of ``extra`` in batchgen's metadata (``s3fs>=2025.7``); [] when unknown."""
    try:
        requires = metadata.requires("batchgen") or []
    except metadata.PackageNotFoundError:
        return []
    return [r.split(";")[0].strip() for r in requires if f'extra == "{extra}"' in r]


def install_hint(extra: str, fallback: str) -> str:
    """``pip install 's3fs>=2025.7' (in a clone of batchgen: pip install -e '.[s3]')``; ``fallback``: the
    package to name when batchgen's metadata is not there."""
    packages = " ".join(shlex.quote(p) for p in extra_packages(extra) or [fallback])
    return f"pip install {packages} (in a clone of batchgen: pip install -e '.[{extra}]')"
