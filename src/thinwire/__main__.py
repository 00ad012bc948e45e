"""`thinwire ...` and `python -m thinwire ...`: the command line, which lives in
`thinwire.train.cli` (this entry point only calls it)."""

from __future__ import annotations

from .train.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    main()
