"""`python -m thinwire.train ...`: under torchrun (RANK set) this process is one worker of
one run; otherwise it is `thinwire train` (spawns its own workers).

    torchrun --nproc-per-node 4 -m thinwire.train --optimizer demo --preset small --out runs/demo

The command itself is `thinwire.train.cli.torchrun_main`.
"""

from __future__ import annotations

from .cli import torchrun_main as main

__all__ = ["main"]

if __name__ == "__main__":
    main()
