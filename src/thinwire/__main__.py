"""Command line: `thinwire quickrun` (a short DeMo run on real gloo workers)."""

from __future__ import annotations

import argparse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="thinwire", description="Data-parallel training over slow links.")
    sub = parser.add_subparsers(dest="command", required=True)
    quick = sub.add_parser("quickrun", help="short DeMo run on N gloo worker processes; prints loss and bytes")
    quick.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    quick.add_argument("--steps", type=int, default=60, help="optimizer steps (default 60)")
    quick.add_argument("--rows", type=int, default=64, help="global batch rows, split across workers")
    quick.add_argument("--lr", type=float, default=3e-3, help="DeMo learning rate")
    quick.add_argument("--topk", type=int, default=16, help="DCT coefficients kept per 64x64 chunk")
    return parser


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    if args.command == "quickrun":
        from .train.quickrun import run
        run(workers=args.workers, steps=args.steps, rows=args.rows, lr=args.lr, topk=args.topk)


if __name__ == "__main__":
    main()
