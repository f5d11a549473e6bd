"""``python -m batchgen`` is the ``batchgen`` command."""

from .cli import main

main()
