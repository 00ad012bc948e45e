"""`thinwire train` / `thinwire compare`: run optimizers on N workers, then report.

    rows = compare(cfg, ["adamw", "demo"], RunOptions(workers=4, out_dir="runs/x"))
    rows = compare(cfg, ["adamw", "demo"], workers=4, out_dir="runs/x")     # the same

Each optimizer runs in turn on the same data, seed and initial weights, on `workers` real
gloo processes (optionally across an emulated link, netns.EmulatedLink). Rank 0 logs every
step to `<out>/<optimizer>.jsonl`; afterwards `<out>/summary.json` holds one row per run
(report.summarize) and the markdown table is printed (and saved as `<out>/table.md`).
With `cfg.sites` (`--sites S`) the workers are S sites (train/sites.py) and `--link` puts
each site, not each worker, in its own namespace.
"""

from __future__ import annotations

import json
import sys
import tempfile
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

from .config import RunOptions, TrainConfig, check_sites, parse_link
from .data import check_corpus, load_corpus
from .launch import launch
from .optimizers import OPTIMIZERS, get_optimizer, learning_rate
from .report import DENSE_ADAMW, add_limits, format_table, plot, read_log, summarize
from .site_agree import agree
from .site_join import check_join
from .site_run import check_site, local_ifname, run_world, site_options, site_summary
from .store_runs import check_exchange, with_key
from .worker import process_started, train_worker

DEFAULT_LATENCY_S = 1e-3


def check_run(cfg: TrainConfig, optimizers: list[str], workers: int, data: str | None) -> None:
    """Every user error we can see before spawning anything, as a ValueError."""
    if not optimizers:
        raise ValueError("give at least one optimizer")
    for name in optimizers:
        spec = get_optimizer(name)
        if cfg.overlap and not spec.can_overlap:
            raise ValueError(f"--overlap: {spec.why_no_overlap}; overlap applies to thinwire optimizers")
        if spec.why_not_config is not None and spec.why_not_config(cfg):
            raise ValueError(spec.why_not_config(cfg))
    if len(set(optimizers)) != len(optimizers):
        raise ValueError(f"optimizers repeat a name: {optimizers}")
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if workers > cfg.rows:
        raise ValueError(f"{workers} workers but only {cfg.rows} batch rows per step: every worker needs "
                         f"at least one row (raise --rows or lower --workers)")
    if cfg.sites:
        check_sites(cfg.sites, workers)
        if workers > cfg.sites:                         # several ranks per site: FSDP2 shards
            _check_shards(cfg, optimizers, workers)
    train, val = load_corpus(data, cfg.vocab_size)
    check_corpus(train, val, cfg.context)


def _check_shards(cfg: TrainConfig, optimizers: list[str], workers: int) -> None:
    """ValueError unless every optimizer can run on FSDP2 shards of cfg's model at workers/sites ranks per site."""
    import torch
    from .model import build_model
    from .sites import narrow_parameter, why_not_on_shards
    per_site = workers // cfg.sites
    narrow = None
    for name in optimizers:
        reason = why_not_on_shards(get_optimizer(name))
        if reason is None and get_optimizer(name).hsdp is None:
            if narrow is None:
                with torch.device("meta"):
                    narrow = narrow_parameter(build_model(cfg), per_site) or ""
            reason = narrow and f"{name} on FSDP2 shards: {narrow}"
        if reason:
            raise ValueError(f"{reason}; under --sites {cfg.sites} with {per_site} ranks per site run it without "
                             f"--sites (or with --sites {workers}, or fewer ranks per site)")


def _link_context(link: str | None, workers: int, sites: int = 0):
    """(context manager, link description or None); falls back to modelled time only."""
    if link is None:
        return nullcontext(None), None
    rate, delay = parse_link(link)
    from .netns import EmulatedLink, available
    ok, reason = available()
    if not ok:
        print(f"thinwire: cannot emulate --link {link}: {reason}. Reporting modelled time only.", file=sys.stderr)
        return nullcontext(None), None
    return (EmulatedLink(workers, rate, delay, sites=sites or None),
            {"spec": link, "rate_bps": rate, "delay_s": delay, "sites": sites or workers})


def compare(cfg: TrainConfig, optimizers: list[str], options: RunOptions | None = None, **fields) -> list[dict]:
    """Run each optimizer on `options.workers` processes (default: the preset's `cfg.workers`);
    the rows. `fields`: RunOptions fields as keywords, over those of `options`.

    `options.checkpoint` (`thinwire train`, one optimizer, needs `out_dir`): checkpoints under
    `<out>/checkpoint/` every `checkpoint_every` steps and at the end, and the run resumes
    from the latest complete one there (train/checkpoint.py)."""
    started = process_started()            # a resumed run's time to recover counts from the command's start
    opts = replace(options or RunOptions(), **fields)
    workers = cfg.workers if opts.workers is None else opts.workers
    check_site(opts, workers, cfg.sites)       # --site's flags and key first: they need no data
    opts = site_options(with_key(opts))
    cfg, opts = prepare(cfg, opts)
    check_run(cfg, optimizers, run_world(opts, workers), opts.data)
    check_exchange(cfg, optimizers, opts)
    check_join(opts, optimizers)
    if opts.checkpoint_every and not opts.checkpoint:
        raise ValueError("--checkpoint-every belongs to `thinwire train` (one optimizer per run)")
    if opts.peer_timeout is not None and opts.peer_timeout <= 0:
        raise ValueError(f"--peer-timeout must be > 0 seconds, got {opts.peer_timeout}")
    check_dense_steps(opts, optimizers)
    if opts.writes_checkpoints:
        _check_checkpointing(cfg, optimizers, workers, opts)
    elif opts.checkpoint_every:
        raise ValueError("--checkpoint-every needs --out (checkpoints go to <out>/checkpoint/)")
    if opts.site:                              # the sites agree through the store that they run the same thing
        lrs = {name: learning_rate(cfg, name, opts.lrs) for name in optimizers}
        agree(cfg, lrs, opts, workers, timeout=opts.join_timeout)
    out = Path(opts.out_dir) if opts.out_dir else Path(tempfile.mkdtemp(prefix="thinwire-"))
    out.mkdir(parents=True, exist_ok=True)
    context, link_info = _link_context(opts.link, workers, cfg.sites)
    latency_s = opts.latency_s
    if latency_s is None:
        latency_s = link_info["delay_s"] if link_info and link_info["delay_s"] else DEFAULT_LATENCY_S
    logs = {}
    with context as emulated:
        for name in optimizers:
            lr = learning_rate(cfg, name, opts.lrs)
            path = out / f"{name}.jsonl"
            kwargs = ({"namespaces": emulated.namespaces, "ifname": emulated.ifname} if emulated else {})
            kwargs.setdefault("ifname", local_ifname(opts))
            launch(train_worker, workers, args=(cfg, name, lr, str(path), opts, started), timeout=opts.peer_timeout,
                   **kwargs)
            logs[name] = read_log(path)
            logs[name]["lr"] = lr
    return report(cfg, logs, run_world(opts, workers), out, latency_s, opts.target, link_info, opts.show,
                  opts.dense_steps, site=site_summary(opts, workers))


def check_dense_steps(opts: RunOptions, optimizers: list[str]) -> None:
    """--dense-steps stands in for dense AdamW's run to --target: a ValueError unless it is an
    integer >= 1, --target is given and AdamW is not in this table."""
    steps = opts.dense_steps
    if steps is None:
        return
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"--dense-steps must be an integer >= 1, got {steps!r}")
    if opts.target is None:
        raise ValueError("--dense-steps needs --target: they are dense AdamW's steps to that loss")
    dense = [name for name in optimizers if name in DENSE_ADAMW]
    if dense:
        raise ValueError(f"--dense-steps stands in for a dense AdamW run, and this one runs {dense[0]}: "
                         f"drop one of them")


def prepare(cfg: TrainConfig, opts: RunOptions, announce: bool = True) -> tuple[TrainConfig, RunOptions]:
    """The run as its workers see it, before any starts: the data tokenised once (cached;
    `opts.data` becomes the cache), the vocabulary the tokenizer's or, for a config.json, the
    model's; a transformers model checked (on the meta device) so a bad config or weights
    directory is one error here, not one per worker."""
    from .corpus import prepare_corpus
    prep = prepare_corpus(opts.data, tokenizer=opts.tokenizer, text_field=opts.text_field,
                          cache_dir=opts.data_cache, progress=announce and not opts.quiet)
    if prep.vocab_size:
        cfg = replace(cfg, vocab_size=prep.vocab_size)
    if cfg.model != "gpt":
        from .hf import FAMILIES, check_model
        vocab = check_model(cfg)
        if cfg.model not in FAMILIES:
            cfg = replace(cfg, vocab_size=vocab)
    return cfg, replace(opts, data=prep.path)


def _check_checkpointing(cfg: TrainConfig, optimizers: list[str], workers: int, opts: RunOptions) -> None:
    """A ValueError, before any worker starts, unless this run can checkpoint and the latest
    checkpoint in <out>/checkpoint (if any) can be resumed by it (CheckpointError naming what
    differs or is corrupt)."""
    from .checkpoint import check_resumable
    if len(optimizers) != 1:
        raise ValueError("checkpoints hold one optimizer's run: use `thinwire train`")
    name = optimizers[0]
    if opts.checkpoint_every < 0:
        raise ValueError(f"--checkpoint-every must be >= 0, got {opts.checkpoint_every}")
    if get_optimizer(name).why_no_checkpoint:
        raise ValueError(get_optimizer(name).why_no_checkpoint)
    check_resumable(opts.out_dir, cfg, name, learning_rate(cfg, name, opts.lrs), workers)


def report(cfg: TrainConfig, logs: dict[str, dict], workers: int, out: Path, latency_s: float,
           target: float | None = None, link_info: dict | None = None, show: bool = True,
           dense_steps: int | None = None, site: dict | None = None) -> list[dict]:
    """summary.json, table.md and plots in `out` from the runs' logs (in run order);
    `dense_steps`: AdamW's steps to `target` when it is not among them (`add_limits`);
    `site`: which site a --site run's command ran (site_run.site_summary), as summary.json's "site"."""
    optimizers = list(logs)
    baseline = next((n for n in optimizers if n in OPTIMIZERS and OPTIMIZERS[n].dense), None)
    if target is None:
        ref = baseline or optimizers[0]
        target = logs[ref]["evals"][-1]["val_loss"] * 1.02
    rows = []
    for name in optimizers:
        row = summarize(name, logs[name], target, latency_s, link_info)
        spec = OPTIMIZERS.get(name)
        row.update(lr=logs[name].get("lr"), workers=workers, preset=cfg.name, config=cfg.record(),
                   counterpart=spec.counterpart if spec else None,
                   overlap=bool(spec and (spec.overlap or (cfg.overlap and spec.can_overlap))))
        rows.append(row)
    add_limits(rows, dense_steps=dense_steps)
    table = format_table(rows, baseline)
    (out / "summary.json").write_text(json.dumps({"target_loss": target, "baseline": baseline,
                                                  "latency_s": latency_s, "sites": cfg.sites or None,
                                                  **({"site": site} if site else {}), "runs": rows}, indent=2))
    (out / "table.md").write_text(table + "\n")
    plots = plot(logs, out, latency_s)
    if show:
        print(table)
        print(f"\nlogs and summary.json in {out}" + (f"; plots: {', '.join(map(str, plots))}" if plots else ""))
    return rows
