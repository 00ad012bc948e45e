"""`python -m thinwire.train ...`: under torchrun (RANK set) this process is one worker of
one run; otherwise it is `thinwire train` (spawns its own workers).

    torchrun --nproc-per-node 4 -m thinwire.train --optimizer demo --preset small --out runs/demo

Under torchrun, rank 0 writes <out>/<optimizer>.jsonl and summary.json and prints the table
(one optimizer per launch; `--link` belongs to the local launcher and is refused here).
"""

from __future__ import annotations

import os
import sys


def main(argv=None) -> None:
    from ..__main__ import build_parser, config_from_args, main as cli_main
    argv = list(sys.argv[1:] if argv is None else argv)
    if "RANK" not in os.environ:
        cli_main(["train", *argv])
        return
    args = build_parser().parse_args(["train", *argv])
    cfg = config_from_args(args)
    if args.link:
        raise SystemExit("thinwire: error: --link emulates links between local workers; under torchrun "
                         "the links are real (use `thinwire train --link ...` without torchrun)")
    import torch.distributed as dist
    from .launch import init_from_env
    from .optimizers import get_optimizer
    from .worker import train_worker
    rank, world = init_from_env()
    try:
        lr = cfg.lr or get_optimizer(args.optimizer).lr_for(cfg.name)
        log = os.path.join(args.out, f"{args.optimizer}.jsonl") if args.out else None
        if log and rank == 0:
            os.makedirs(args.out, exist_ok=True)
        train_worker(rank, world, cfg, args.optimizer, lr, log, args.quiet, args.data)
        if log and rank == 0:
            from pathlib import Path
            from .config import parse_time
            from .report import read_log
            from .run import DEFAULT_LATENCY_S, report
            logs = {args.optimizer: {**read_log(log), "lr": lr}}
            latency = parse_time(args.latency) if args.latency else DEFAULT_LATENCY_S
            report(cfg, logs, world, Path(args.out), latency, args.target)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
