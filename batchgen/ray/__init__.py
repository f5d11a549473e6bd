"""batchgen on Ray: ``batchgen ray job.yaml`` (``cluster.py``) and a Ray Data stage,
``batchgen.ray.generate`` (``data.py``). Needs ``pip install 'batchgen[ray]'``."""

from .data import generate

__all__ = ["generate"]
