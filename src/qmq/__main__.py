"""``python -m qmq`` is the ``qmq`` command."""

from qmq.cli.main import main

main()
