"""Learning-rate sweep behind the harness's default learning rates (docs/harness.md).

    python benchmarks/lr_sweep.py --preset small --workers 4 --optimizers adamw,demo,powersgd \
        --lrs 1e-3,3e-3,1e-2 [--set topk=16 --set alpha=1.0]

Runs every (optimizer, lr) on the same data, seed and initial weights and prints one
markdown table: final validation loss, best validation loss, payload MB/step/worker.
"""

from __future__ import annotations

import argparse
import tempfile

from thinwire.train.config import get_preset
from thinwire.train.run import compare


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="small")
    ap.add_argument("--workers", type=int, help="default: the preset's (4; wan: 2)")
    ap.add_argument("--optimizers", default="adamw,demo,powersgd")
    ap.add_argument("--lrs", default="1e-3,3e-3,1e-2")
    ap.add_argument("--steps", type=int)
    ap.add_argument("--set", action="append", default=[], help="config override key=value (topk=16)")
    args = ap.parse_args()
    overrides = {}
    for item in args.set:
        key, value = item.split("=")
        overrides[key] = _number(value)
    cfg = get_preset(args.preset, steps=args.steps, **overrides)
    print(f"preset {cfg.name}, {args.workers or cfg.workers} workers, {cfg.steps} steps, overrides {overrides or 'none'}\n")
    print("| optimizer | lr | final val loss | best val loss | payload MB/step/worker |")
    print("|---|---|---|---|---|")
    for name in args.optimizers.split(","):
        for lr in map(float, args.lrs.split(",")):
            with tempfile.TemporaryDirectory() as out:
                (row,) = compare(cfg, [name], workers=args.workers, out_dir=out, lrs={name: lr}, quiet=True,
                                 show=False)
                best = min(e["val_loss"] for e in _evals(out, name))
            print(f"| {name} | {lr:g} | {row['val_loss']:.4f} | {best:.4f} | "
                  f"{row['payload_bytes_per_step'] / 1e6:.4g} |", flush=True)


def _number(text: str):
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _evals(out: str, name: str) -> list[dict]:
    import json
    with open(f"{out}/{name}.jsonl") as f:
        return [r for r in map(json.loads, f) if r["kind"] == "eval"]


if __name__ == "__main__":
    main()
