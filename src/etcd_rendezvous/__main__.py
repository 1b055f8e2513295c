"""``python -m etcd_rendezvous``: the same as the ``etcd-rendezvous`` command."""

from __future__ import annotations

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
