"""The command line: `thinwire train`, `thinwire compare`, `thinwire quickrun`, and
`python -m thinwire.train` (one worker of one run under torchrun).

`thinwire/__main__.py` and `thinwire/train/__main__.py` are thin entry points that call
`main` and `torchrun_main` here. Imports nothing heavy at import time: the command that
runs imports what it needs (torch, the training loop).
"""

from __future__ import annotations

import argparse
import os
import sys

DEFAULT_COMPARE = "adamw,powersgd,demo"
_OVERRIDES = ("model", "init_from", "workers", "sites", "n_layer", "n_embd", "n_head", "context", "vocab_size", "rows",
              "steps", "eval_every", "eval_rows", "seed", "lr", "sync_every", "sync_delay")
_FLOATS = ("lr",)
_STRINGS = ("model", "init_from")
_TYPES = {"int": int, "float": float, "str": str}
_METAVARS = {"int": "N", "float": "X", "str": "TEXT"}


class _Renamed(argparse.Action):
    """An old flag of a field that became an optimizer's setting: still taken, with a note."""

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"thinwire: note: {option_string} is now --{self.dest.replace('_', '-')}", file=sys.stderr)
        setattr(namespace, self.dest, values)


def _settings_args(p: argparse.ArgumentParser) -> None:
    """--<prefix>-<field> for every optimizer's settings (train/settings.py), help from the
    field's docstring; the fields' old flags (config.RENAMED) as hidden aliases."""
    from dataclasses import fields
    from .config import RENAMED
    from .settings import Settings, field_docs, flat_key
    kinds = {}
    for cls in Settings.KNOWN.values():
        docs, group = field_docs(cls), p.add_argument_group(f"{cls.PREFIX} settings", cls.__doc__)
        for f in fields(cls):
            key, kinds[flat_key(cls, f.name)] = flat_key(cls, f.name), _TYPES[str(f.type)]
            group.add_argument(f"--{cls.PREFIX}-{f.name.replace('_', '-')}", dest=key, type=kinds[key],
                               metavar=_METAVARS[str(f.type)],
                               help=f"{docs.get(f.name, '')} (default: the preset's, else {f.default})"
                               .replace("%", "%%"))
    for old, key in RENAMED.items():
        p.add_argument("--" + old.replace("_", "-"), dest=key, type=kinds[key], action=_Renamed,
                       help=argparse.SUPPRESS)


def _run_args(p: argparse.ArgumentParser) -> None:
    from .config import FIELD_HELP
    p.add_argument("--preset", default="small",
                   help="tiny (smoke test), small (default), base (longer), wan (link-bound: 2 workers), "
                        "sites (link-bound: 2 sites x 2 workers)")
    p.add_argument("--out", help="directory for <optimizer>.jsonl logs, summary.json, table.md, plots")
    p.add_argument("--data", help="text file, directory of files, .jsonl/.parquet of records with a text field, "
                                  "or .bin of uint16 ids (default: the Python standard library's source)")
    p.add_argument("--tokenizer", metavar="PATH", help="tokenise --data with this local tokenizer.json, once, "
                   "cached; the vocabulary is the tokenizer's (default: byte-level, 256) [hf extra]")
    p.add_argument("--text-field", default="text", help="the text field of JSONL/Parquet records (default: text)")
    p.add_argument("--data-cache", metavar="DIR", help="cache of tokenised corpora "
                   "(default: $THINWIRE_CACHE or ~/.cache/thinwire/corpora)")
    p.add_argument("--link", help="emulate a slow link, e.g. 100mbit or 100mbit,20ms (root + iproute2); "
                                  "with --sites, between sites only")
    p.add_argument("--latency", help="per-collective latency for modelled time (default 1ms, or the --link delay)")
    p.add_argument("--target", type=float, help="target validation loss (default: dense baseline's final x 1.02)")
    p.add_argument("--dense-steps", type=int, metavar="N",
                   help="dense AdamW's steps to --target from its own run, for a table without it: the "
                        "limits table then divides each run's time by N x AdamW's step timed in that run")
    p.add_argument("--no-adamw-probe", action="store_true",
                   help="do not time dense AdamW's step on a copy of the model in each run (its memory and "
                        "about 3 steps per evaluation): no ratio to AdamW's limit in the limits table's last column")
    p.add_argument("--exchange", metavar="URL", help="the optimizer's messages through this store instead of "
                   "torch.distributed, each worker a site: file:///folder or s3://bucket/prefix (s3: the [store] "
                   "extra; endpoint and credentials from AWS_* variables); agreed rounds, signed messages")
    p.add_argument("--round-timeout", type=float, default=90.0, metavar="SECONDS",
                   help="with --exchange: how long a round waits for every worker before it closes without the "
                        "late ones, who keep their messages for the next (default 90)")
    p.add_argument("--site", metavar="NAME", help="with --exchange: run only this site's --workers (a local gloo "
                   "world); the other sites run the same command with their own --site and share only the store")
    p.add_argument("--peers", metavar="A,B,...", help="with --site: every site of the run, this one included, the "
                   "same list at every site (each runs the same --workers)")
    p.add_argument("--exchange-key-file", metavar="PATH", help="with --exchange: a file holding the run's hex "
                   "signing key (or set THINWIRE_EXCHANGE_KEY); --site needs one, the same at every site")
    p.add_argument("--snapshot-every", type=int, default=0, metavar="ROUNDS", help="with --exchange: every ROUNDS "
                   "rounds a site writes a snapshot to the store that a later site starts from (default 0: none)")
    p.add_argument("--join-timeout", type=float, default=600.0, metavar="SECONDS", help="with --exchange: how long "
                   "the first round waits for every site before starting without the missing ones (default 600)")
    p.add_argument("--join", action="store_true", help="with --site: join a run already going, from the store's "
                   "latest snapshot (the live sites give --snapshot-every)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--overlap", action="store_true", default=None, help=FIELD_HELP["overlap"])
    for name in _OVERRIDES:
        kind = float if name in _FLOATS else str if name in _STRINGS else int
        p.add_argument("--" + name.replace("_", "-"), type=kind, help=FIELD_HELP[name] + " (overrides the preset)")
    _settings_args(p)


def build_parser() -> argparse.ArgumentParser:
    from .optimizers import OPTIMIZERS
    parser = argparse.ArgumentParser(prog="thinwire", description="Data-parallel training over slow links.")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a small GPT on N gloo workers with one optimizer")
    train.add_argument("--optimizer", default="demo", help=f"one of: {', '.join(OPTIMIZERS)}")
    _run_args(train)
    train.add_argument("--checkpoint-every", type=int, default=0, metavar="N",
                       help="checkpoint every N steps and at the end under <out>/checkpoint/ (0: only resume); "
                            "a run resumes from the latest complete checkpoint in --out")
    train.add_argument("--peer-timeout", type=float, default=None, metavar="SECONDS",
                       help="a collective waits this long for a silent peer before every survivor fails "
                            "(default 120)")
    comp = sub.add_parser("compare", help="train with several optimizers; print loss, bytes and time table")
    comp.add_argument("--optimizers", default=DEFAULT_COMPARE,
                      help=f"comma-separated, from: {', '.join(OPTIMIZERS)} (default {DEFAULT_COMPARE})")
    _run_args(comp)
    quick = sub.add_parser("quickrun", help="short DeMo run on N gloo worker processes; prints loss and bytes")
    quick.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    quick.add_argument("--steps", type=int, default=60, help="optimizer steps (default 60)")
    quick.add_argument("--rows", type=int, default=64, help="global batch rows, split across workers")
    quick.add_argument("--lr", type=float, default=3e-3, help="DeMo learning rate")
    quick.add_argument("--topk", type=int, default=16, help="DCT coefficients kept per 64x64 chunk")
    return parser


def config_from_args(args):
    from .config import get_preset
    from .settings import flat_fields
    return get_preset(args.preset, **{name: getattr(args, name) for name in (*_OVERRIDES, *flat_fields())},
                      overlap=getattr(args, "overlap", None))


def options_from_args(args):
    """The RunOptions of `thinwire train|compare` (workers: the preset's, as overridden)."""
    from .config import RunOptions, parse_time
    train = args.command == "train"
    return RunOptions(out_dir=args.out, link=args.link, latency_s=parse_time(args.latency) if args.latency else None,
                      target=args.target, data=args.data, tokenizer=args.tokenizer, text_field=args.text_field,
                      data_cache=args.data_cache, quiet=args.quiet, checkpoint=train,
                      checkpoint_every=args.checkpoint_every if train else 0,
                      peer_timeout=args.peer_timeout if train else None, dense_steps=args.dense_steps,
                      adamw_probe=not args.no_adamw_probe, exchange=args.exchange,
                      round_timeout=args.round_timeout, site=args.site, exchange_key_file=args.exchange_key_file,
                      peers=tuple(p.strip() for p in (args.peers or "").split(",") if p.strip()),
                      snapshot_every=args.snapshot_every, join=args.join,
                      join_timeout=args.join_timeout)


def _train_or_compare(args) -> None:
    from .run import compare
    cfg = config_from_args(args)
    names = [args.optimizer.lower()] if args.command == "train" else [n.strip().lower() for n in args.optimizers.split(",")
                                                              if n.strip()]
    compare(cfg, names, options_from_args(args))


def main(argv=None) -> None:
    """`thinwire COMMAND ...` (argv without the program name; default sys.argv[1:])."""
    args = build_parser().parse_args(argv)
    if args.command == "quickrun":
        from .quickrun import run
        run(workers=args.workers, steps=args.steps, rows=args.rows, lr=args.lr, topk=args.topk)
        return
    try:
        _train_or_compare(args)
    except ValueError as err:          # user errors: one clear line, no traceback
        print(f"thinwire: error: {err}", file=sys.stderr)
        sys.exit(2)
    except RuntimeError as err:        # a worker killed: one line, and how to go on
        from .launch import WorkerDied
        if not isinstance(err, WorkerDied):
            raise
        again = (" Run the same command again to resume from the latest checkpoint in --out."
                 if args.command == "train" and args.out else "")
        print(f"thinwire: error: {err}.{again}", file=sys.stderr)
        sys.exit(1)


def _torchrun_check_checkpoint(args, cfg, lr: float) -> None:
    """Under torchrun every rank checks the latest checkpoint in <out>/checkpoint before joining."""
    if not args.out:
        if args.checkpoint_every:
            raise SystemExit("thinwire: error: --checkpoint-every needs --out")
        return
    from .checkpoint import CheckpointError, check_resumable
    try:
        check_resumable(args.out, cfg, args.optimizer, lr, int(os.environ["WORLD_SIZE"]),
                        announce=os.environ["RANK"] == "0")
    except CheckpointError as err:
        raise SystemExit(f"thinwire: error: {err}") from None


def torchrun_main(argv=None) -> None:
    """`python -m thinwire.train ...`: under torchrun (RANK set) this process is one worker of
    one run; otherwise it is `thinwire train` (spawns its own workers).

        torchrun --nproc-per-node 4 -m thinwire.train --optimizer demo --preset small --out runs/demo

    Under torchrun, rank 0 writes <out>/<optimizer>.jsonl and summary.json and prints the
    table (one optimizer per launch; `--link` belongs to the local launcher and is refused).
    `--sites S` with `torchrun --nnodes S`: torchrun numbers ranks node by node, so each node
    is one site (FSDP2 inside the node, the optimizer between nodes).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if "RANK" not in os.environ:
        main(["train", *argv])
        return
    args = build_parser().parse_args(["train", *argv])
    cfg, opts = config_from_args(args), options_from_args(args)
    if args.link:
        raise SystemExit("thinwire: error: --link emulates links between local workers; under torchrun "
                         "the links are real (use `thinwire train --link ...` without torchrun)")
    if args.exchange or args.site:
        from .store_runs import torchrun_site
        try:                                    # this torchrun world is one site of a store run
            opts = torchrun_site(cfg, args.optimizer, opts, int(os.environ["WORLD_SIZE"]))
        except ValueError as err:
            raise SystemExit(f"thinwire: error: {err}") from None
    if cfg.sites:
        from .config import check_sites
        world, local = int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_WORLD_SIZE", 0))
        try:
            check_sites(cfg.sites, world)
        except ValueError as err:
            raise SystemExit(f"thinwire: error: {err}") from None
        if local and world // cfg.sites != local and os.environ["RANK"] == "0":
            print(f"thinwire: warning: --sites {cfg.sites} puts {world // cfg.sites} ranks in a site but torchrun "
                  f"runs {local} per node; use --sites {world // local} (= --nnodes) to make each node a site",
                  file=sys.stderr)
    import torch.distributed as dist
    from .launch import exit_process, init_from_env
    from .optimizers import learning_rate
    from .worker import PeerFailure, train_worker
    from .run import check_dense_steps, prepare
    try:                                        # every rank: the cache is written atomically, read by all
        check_dense_steps(opts, [args.optimizer])
        cfg, opts = prepare(cfg, opts, announce=os.environ["RANK"] == "0")
    except ValueError as err:
        raise SystemExit(f"thinwire: error: {err}") from None
    lr = learning_rate(cfg, args.optimizer)
    _torchrun_check_checkpoint(args, cfg, lr)
    if opts.site:                               # every rank agrees (one record, written once): no rank waits on another
        from .site_agree import agree
        try:
            agree(cfg, {args.optimizer: lr}, opts, int(os.environ["WORLD_SIZE"]), timeout=opts.join_timeout)
        except ValueError as err:
            raise SystemExit(f"thinwire: error: {err}") from None
    rank, world = init_from_env(opts.peer_timeout)
    try:
        log = os.path.join(args.out, f"{args.optimizer}.jsonl") if args.out else None
        if log and rank == 0:
            os.makedirs(args.out, exist_ok=True)
        try:
            train_worker(rank, world, cfg, args.optimizer, lr, log, opts)
        except (PeerFailure, ValueError) as err:        # a dead peer, a bad checkpoint: one clear line each
            print(f"thinwire: error: {err}", file=sys.stderr, flush=True)
            os._exit(1)                                 # the group is broken: tearing it down could wait
        if log and rank == 0:
            from pathlib import Path
            from .report import read_log
            from .run import DEFAULT_LATENCY_S, report
            logs = {args.optimizer: {**read_log(log), "lr": lr}}
            latency = DEFAULT_LATENCY_S if opts.latency_s is None else opts.latency_s
            from .site_run import run_world, site_summary
            report(cfg, logs, run_world(opts, world), Path(args.out), latency, opts.target,
                   dense_steps=opts.dense_steps, site=site_summary(opts, world))
    finally:
        dist.destroy_process_group()
    exit_process(0)                             # not finalizing: see launch.exit_process
