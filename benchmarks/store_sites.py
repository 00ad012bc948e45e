"""Issue 48's runs: sites with no route between them train through a store, one command per site.

Each site is `thinwire train --exchange URL --site NAME --peers ...` with its own workers,
started with `ip netns exec` inside its own network namespace of `IsolatedSites` (a link of
--rate to the host namespace, forwarding off: sites reach the store, never each other). The
store is a folder (file://, a real filesystem shared by the namespaces) or a moto S3-API
server listening in the host namespace (s3://, reached over each site's shaped link). The
reference is the same config as one plain torch.distributed (gloo) command on the host with
every worker. Not a test: it prints tables (markdown).

    python benchmarks/store_sites.py same --preset tiny --optimizers demo,sparseloco --stores file,s3
    python benchmarks/store_sites.py same --preset wan --steps 100 --optimizers demo,sparseloco
    python benchmarks/store_sites.py slow --preset tiny --optimizers demo,sparseloco --slow 0.25:3
    python benchmarks/store_sites.py churn --preset tiny --optimizers demo --kill b:30 --join c:20

same    2 sites x 2 workers: each site's final parameters (SHA-256) against the gloo run's,
        final validation loss, rounds missed, store requests, wall time.
slow    site b sleeps FACTOR x its last step's compute before a step with probability P
        (THINWIRE_SLOW_STEPS, seeded): the other site goes on at its own pace; the sites'
        parameters compared after every step (THINWIRE_STEP_DIGEST), rounds b missed, final
        loss against the unslowed store run, and the waiting saved: b's sleeps (what an
        all-gather would have made every site wait) against what a waited.
churn   three sites declared; one killed for good at a step, one joining later from the
        store's snapshot: final loss against an uninterrupted run of the same sites.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from store_round_time import CREDENTIALS, make_bucket, start_s3  # noqa: E402

from thinwire.train.netns_isolated import IsolatedSites  # noqa: E402

THINWIRE = [sys.executable, "-m", "thinwire"]


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("scenario", choices=("same", "slow", "churn"))
    p.add_argument("--preset", default="tiny")
    p.add_argument("--optimizers", default="demo,sparseloco")
    p.add_argument("--stores", default="file,s3", help="file, s3 or both (comma-separated)")
    p.add_argument("--workers", type=int, default=2, help="workers per site")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--rate", default="100mbit", help="each site's link to the store")
    p.add_argument("--round-timeout", type=float, default=10.0)
    p.add_argument("--slow", default="0.25:3", help="slow: P:FACTOR for site b")
    p.add_argument("--kill", default="b:30", help="churn: SITE:STEP killed for good")
    p.add_argument("--join", default="c:10", help="churn: SITE:STEP (of the others) it starts at")
    p.add_argument("--snapshot-every", type=int, default=5, help="churn: rounds between snapshots")
    p.add_argument("--join-timeout", type=float, default=20.0, help="churn: how long the first round waits for every site")
    p.add_argument("--pace", type=float, default=0.2, help="churn: seconds every site sleeps after each step, so "
                   "that a joiner's start-up (imports, the settings check) spans a few steps, not tens")
    p.add_argument("--sync-every", type=int, default=None, help="SparseLoCo's local steps between syncs")
    p.add_argument("--rows", type=int, default=None, help="batch rows per step (wan has 2: give 4 for 4 workers)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="keep the runs' logs here (default: a temporary folder)")
    return p.parse_args()


def rate_bps(text: str) -> float:
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
    for unit, scale in units.items():
        if text.endswith(unit):
            return float(text[:-len(unit)]) * scale
    raise SystemExit(f"--rate must look like 100mbit, got {text!r}")


def common(args, optimizer: str) -> list[str]:
    extra = ["--steps", str(args.steps)] if args.steps else []
    extra += ["--sync-every", str(args.sync_every)] if args.sync_every else []
    extra += ["--rows", str(args.rows)] if args.rows else []
    return ["train", "--preset", args.preset, "--optimizer", optimizer, "--quiet", "--no-adamw-probe",
            "--seed", str(args.seed), *extra]


def reference(args, optimizer: str, sites: int, out: Path) -> dict:
    """The same config as one gloo command with every worker (no store)."""
    t0 = time.time()
    subprocess.run([*THINWIRE, *common(args, optimizer), "--workers", str(sites * args.workers),
                    "--out", str(out)], check=True, env=os.environ.copy())
    return {**final(out / f"{optimizer}.jsonl"), "wall_s": time.time() - t0}


def final(log: Path) -> dict:
    records = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    return next(r for r in reversed(records) if r.get("kind") == "final")


def steps(log: Path) -> list[dict]:
    return [r for r in (json.loads(line) for line in log.read_text().splitlines() if line.strip())
            if r.get("kind") == "step"]


class Store:
    """file:// (a folder) or s3:// (moto in the host namespace): the URL and each site's env."""

    def __init__(self, kind: str, root: Path):
        self.kind, self.server = kind, None
        if kind == "file":
            self.url = (root / "store").as_uri()
        else:
            self.server, self.port = start_s3()
            self.url = f"s3://{make_bucket(self.port)}/runs"

    def env(self, net: IsolatedSites, site: int) -> dict:
        if self.kind == "file":
            return {}
        return {"AWS_ENDPOINT_URL": f"http://{net.store_address(site)}:{self.port}", "AWS_ALLOW_HTTP": "true",
                "AWS_ACCESS_KEY_ID": CREDENTIALS["access_key_id"], "AWS_REGION": CREDENTIALS["region"],
                "AWS_SECRET_ACCESS_KEY": CREDENTIALS["secret_access_key"]}

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()


def start_site(args, optimizer: str, net: IsolatedSites, store: Store, index: int, name: str,
               peers: list[str], key: str, out: Path, env: dict | None = None, extra=()) -> subprocess.Popen:
    """One site's command inside its namespace (its own process group, so it can be killed whole)."""
    cmd = ["ip", "netns", "exec", net.namespaces[index], *THINWIRE, *common(args, optimizer),
           "--workers", str(args.workers), "--exchange", store.url, "--site", name, "--peers", ",".join(peers),
           "--round-timeout", str(args.round_timeout), "--out", str(out / name), *extra]
    full = {**os.environ, "THINWIRE_EXCHANGE_KEY": key, **store.env(net, index), **(env or {})}
    return subprocess.Popen(cmd, env=full, start_new_session=True)


def wait_all(procs: dict[str, subprocess.Popen]) -> dict[str, int]:
    return {name: p.wait() for name, p in procs.items()}


def site_row(label: str, out: Path, optimizer: str, ref: dict | None, wall: float) -> dict:
    rec = final(out / f"{optimizer}.jsonl")
    store = rec.get("store", {})
    traffic = store.get("traffic", {})
    return {"run": label, "val_loss": rec["val_loss"], "params_sha256": rec["params_sha256"][:12],
            "same_as_gloo": None if ref is None else rec["params_sha256"] == ref["params_sha256"],
            "missed": store.get("missed_rounds"), "puts": traffic.get("puts"), "gets": traffic.get("gets"),
            "lists": traffic.get("lists"), "wall_s": round(wall, 1)}


def print_table(title: str, rows: list[dict]) -> None:
    print(f"\n### {title}\n")
    if not rows:
        return
    keys = list(rows[0])
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for r in rows:
        print("| " + " | ".join(f"{v:.6f}" if isinstance(v, float) and k == "val_loss" else str(v)
                                for k, v in r.items()) + " |")
    sys.stdout.flush()


def run_sites(args, optimizer, net, store, names, key, out, envs=None) -> tuple[dict, float]:
    t0 = time.time()
    procs = {n: start_site(args, optimizer, net, store, i, n, names, key, out, (envs or {}).get(n))
             for i, n in enumerate(names)}
    codes = wait_all(procs)
    if any(codes.values()):
        raise SystemExit(f"a site failed: {codes} (logs under {out})")
    return codes, time.time() - t0


def same(args, root: Path) -> None:
    names = ["a", "b"]
    for optimizer in args.optimizers.split(","):
        ref = reference(args, optimizer, len(names), root / f"gloo-{optimizer}")
        rows = [{"run": f"gloo, {len(names) * args.workers} workers, one command", "val_loss": ref["val_loss"],
                 "params_sha256": ref["params_sha256"][:12], "same_as_gloo": True, "missed": None, "puts": None,
                 "gets": None, "lists": None, "wall_s": round(ref["wall_s"], 1)}]
        for kind in args.stores.split(","):
            store, key = Store(kind, root / f"{kind}-{optimizer}"), secrets.token_hex(32)
            try:
                with IsolatedSites(len(names), rate_bps(args.rate)) as net:
                    out = root / f"{kind}-{optimizer}"
                    _, wall = run_sites(args, optimizer, net, store, names, key, out)
                    rows += [site_row(f"{kind}://, site {n}", out / n, optimizer, ref, wall) for n in names]
            finally:
                store.close()
        print_table(f"{optimizer} on {args.preset}: 2 sites x {args.workers} workers, no route between them, "
                    f"{args.rate} to the store", rows)


def main() -> None:
    args = parse()
    root = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="store-sites-"))
    root.mkdir(parents=True, exist_ok=True)
    print(f"logs under {root}; load {os.getloadavg()[0]:.2f}")
    {"same": same, "slow": slow, "churn": churn}[args.scenario](args, root)


def logs(out: Path, optimizer: str, names) -> dict[str, list[dict]]:
    return {n: [json.loads(line) for line in (out / n / f"{optimizer}.jsonl").read_text().splitlines() if line]
            for n in names}


def slow_row(label: str, records: dict, optimizer: str, base_loss: float | None, wall: float) -> list[dict]:
    """Per site: its loss, rounds missed, seconds slept and waited, and replica agreement after every
    step both sites synced (DeMo: every step; SparseLoCo: the sync steps)."""
    steps = {n: {r["step"]: r for r in rs if r.get("kind") == "step"} for n, rs in records.items()}
    a, b = list(steps)
    # the steps that carried a message (a periodic method's first step carries only the handshake)
    full = max(r["payload_bytes"] for r in steps[a].values())
    synced = [s for s in steps[a] if steps[a][s]["payload_bytes"] > full // 2 and s in steps[b]
              and steps[b][s]["payload_bytes"] > full // 2]
    differ = sum(steps[a][s]["params_sha256"] != steps[b][s]["params_sha256"] for s in synced)
    rows = []
    for n, rs in records.items():
        rec = next(r for r in reversed(rs) if r.get("kind") == "final")
        store = rec["store"]
        rows.append({"run": f"{label}, site {n}", "val_loss": rec["val_loss"],
                     "vs unslowed %": "" if base_loss is None else f"{100 * (rec['val_loss'] / base_loss - 1):+.2f}",
                     "rounds": store["participants"][0]["rounds"], "missed": store["missed_rounds"],
                     "slept s": round(sum(r.get("slept_s", 0) for r in steps[n].values()), 1),
                     "waited s": round(sum(p["waited_s"] for p in store["participants"]) / len(store["participants"]), 1),
                     "synced steps differing": f"{differ} of {len(synced)}", "wall s": round(wall, 1)})
    return rows


def slow(args, root: Path) -> None:
    """Each optimizer through the first store kind: unslowed, then with site b slowed."""
    names, kind = ["a", "b"], args.stores.split(",")[0]
    digests = {n: {"THINWIRE_STEP_DIGEST": "1"} for n in names}
    slowed = {**digests, "b": {**digests["b"], "THINWIRE_SLOW_STEPS": f"{args.slow}:{args.seed}"}}
    for optimizer in args.optimizers.split(","):
        rows, base = [], None
        for label, envs in (("unslowed", digests), (f"b slowed {args.slow}", slowed)):
            store, key, out = Store(kind, root / f"slow-{label}-{optimizer}"), secrets.token_hex(32), \
                root / f"slow-{optimizer}-{len(rows)}"
            try:
                with IsolatedSites(len(names), rate_bps(args.rate)) as net:
                    _, wall = run_sites(args, optimizer, net, store, names, key, out, envs)
            finally:
                store.close()
            new = slow_row(label, logs(out, optimizer, names), optimizer, base, wall)
            base = new[0]["val_loss"] if base is None else base
            rows += new
        print_table(f"{optimizer} on {args.preset} through {kind}://, round timeout {args.round_timeout} s: "
                    f"site b sleeps {args.slow.split(':')[1]}x its last step with probability "
                    f"{args.slow.split(':')[0]} before each step", rows)


def log_step(out: Path, optimizer: str) -> int:
    """The newest step in a site's log (0 before the first)."""
    path = out / f"{optimizer}.jsonl"
    if not path.exists():
        return 0
    found = [json.loads(line).get("step", 0) for line in path.read_text().splitlines()
             if line.strip() and '"kind": "step"' in line]
    return max(found, default=0)


def churn_run(args, optimizer, names, kind, out, kill, join) -> tuple[dict, float]:
    """Sites `names`, all from the start unless `join` = (site, at step of names[0]) starts later;
    `kill` = (site, at its own step) is killed for good there (SIGKILL to its process group)."""
    store, key, t0 = Store(kind, out), secrets.token_hex(32), time.time()
    snap = ["--snapshot-every", str(args.snapshot_every), "--join-timeout", str(args.join_timeout)]
    paced = {"THINWIRE_STEP_SLEEP": str(args.pace)} if args.pace else {}
    try:
        with IsolatedSites(len(names), rate_bps(args.rate)) as net:
            procs = {n: start_site(args, optimizer, net, store, i, n, names, key, out, paced, extra=snap)
                     for i, n in enumerate(names) if not join or n != join[0]}
            pending_join, killed = join, None
            while any(p.poll() is None for p in procs.values()) or pending_join:
                if pending_join and log_step(out / names[0], optimizer) >= pending_join[1]:
                    i = names.index(pending_join[0])
                    procs[pending_join[0]] = start_site(args, optimizer, net, store, i, pending_join[0], names, key,
                                                        out, paced, extra=["--join"])
                    pending_join = None
                if kill and killed is None and log_step(out / kill[0], optimizer) >= kill[1]:
                    os.killpg(procs[kill[0]].pid, signal.SIGKILL)
                    killed = kill[0]
                time.sleep(0.1)
            codes = {n: p.returncode for n, p in procs.items() if n != killed}
            if any(codes.values()):
                raise SystemExit(f"a site failed: {codes} (logs under {out})")
    finally:
        store.close()
    return {n: final(out / n / f"{optimizer}.jsonl") for n in names if n != (kill or (None,))[0]}, time.time() - t0


def churn(args, root: Path) -> None:
    """Three sites: uninterrupted, then one killed for good and one joining later."""
    names, kind = ["a", "b", "c"], args.stores.split(",")[0]
    kill = (args.kill.split(":")[0], int(args.kill.split(":")[1]))
    join = (args.join.split(":")[0], int(args.join.split(":")[1]))
    for optimizer in args.optimizers.split(","):
        rows, base = [], None
        for label, k, j in (("uninterrupted", None, None), (f"{kill[0]} killed at step {kill[1]}, {join[0]} joins "
                                                           f"at a's step {join[1]}", kill, join)):
            out = root / f"churn-{optimizer}-{len(rows)}"
            finals, wall = churn_run(args, optimizer, names, kind, out, k, j)
            for n, rec in finals.items():
                base = rec["val_loss"] if base is None else base
                store = rec["store"]
                rows.append({"run": f"{label}, site {n}", "val_loss": rec["val_loss"],
                             "vs uninterrupted %": f"{100 * (rec['val_loss'] / base - 1):+.2f}",
                             "params_sha256": rec["params_sha256"][:12],
                             "rounds": store["participants"][0]["rounds"], "missed": store["missed_rounds"],
                             "waited s": round(store["participants"][0]["waited_s"], 1), "wall s": round(wall, 1)})
        print_table(f"{optimizer} on {args.preset} through {kind}://, {args.workers} worker(s) per site, round "
                    f"timeout {args.round_timeout} s, snapshots every {args.snapshot_every} rounds", rows)


if __name__ == "__main__":
    main()
