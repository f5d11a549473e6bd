"""batchgen on Ray: ``batchgen ray job.yaml`` (``cluster.py``) and a Ray Data stage,
``batchgen.ray.generate`` (``data.py``). Needs ``pip install -e '.[ray]'`` in the clone
(or ``pip install 'ray[data]'``)."""

from .data import generate

__all__ = ["generate"]
