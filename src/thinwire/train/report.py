"""From per-step logs to the numbers a user compares: bytes, modelled time, time to target.

Modelled wall time of a run at bandwidth B (bits/s) and per-collective latency L:

    T_B = Σ_steps [ compute_s + 8 · max(link sent, link received) / B + collectives · L ]

with compute_s = measured step time − time blocked in collectives (worker.py; for DDP, whose
wait hides inside backward, the compute-only s/step measured with communication off:
train/ddp.py), and link
bytes from thinwire.comm.links (ring all-reduce 2n(W−1)/W each way, ...): a full-duplex
link of rate B carries the larger direction. 'compute' is the same sum with a free link
(B infinite, no latency). Time to target is the training time (evaluations excluded) at the
first evaluation whose validation loss is <= the target; None when never reached. The
target defaults to the dense baseline's final loss x 1.02.

The physical limit (`add_limits`): a run's no-communication limit is the steps it needed to
reach the target times its own compute-only s/step; every row also gets dense AdamW's limit
and its measured time to target divided by it: how close it comes to training as if the
network were free. A DDP run's compute-only s/step is the smaller of two calibrations, before
and after training (`probe.py`). Every other single-tier run also timed dense AdamW's step in
its own processes, before and after training (`adamw_step_s`) and at each evaluation
(`adamw_step_during_s`, the mean up to its target; `adamw_step_during_median_s`, their median,
for reference), so its row also gets `ratio_to_dense_limit_here`: its time over AdamW's steps
to target x that step. It leaves out
the machine's drift between the two runs (minutes apart) and within the run, which on a
shared CPU can be larger than the gap being measured.

Under `--sites` the link is a site's: its ranks share it, so the link bytes of a step are
the busiest site's sum over its ranks (the log's final `tiers` record), compute_s excludes
only the time blocked in inter-site collectives (FSDP2's traffic inside a site is compute's
fast tier), and the row adds the intra-site bytes and the optimizer-state bytes per rank.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from .config import BANDWIDTHS
from .probe import samples_during, step_during

# dense AdamW's entries, in the order a table takes its limit from: DDP, else DenseAllReduce
DENSE_ADAMW = ("adamw", "adamw-allreduce")


def read_log(path: str | Path) -> dict:
    steps, evals, resumes, final = [], [], [], None
    with open(path) as f:
        for line in f:
            rec = json.loads(line)
            if rec["kind"] == "step":
                steps.append(rec)
            elif rec["kind"] == "eval":
                evals.append(rec)
            elif rec["kind"] == "resume":            # a resumed run (worker.py): step, world sizes, time to recover
                resumes.append(rec)
            else:
                final = rec
    return {"steps": steps, "evals": evals, "resumes": resumes, "final": final}


def link_per_step(log: dict) -> list[tuple[int, int]]:
    """(link bytes sent, received) of every step: the rank's, or under --sites its busiest site's."""
    tiers = (log.get("final") or {}).get("tiers")
    if tiers:
        return list(zip(tiers["site"]["link_bytes_sent"], tiers["site"]["link_bytes_received"]))
    return [(s["link_bytes_sent"], s["link_bytes_received"]) for s in log["steps"]]


def cumulative_times(steps: list[dict], latency_s: float, link: list[tuple[int, int]] | None = None,
                     compute_s: float | None = None) -> dict[str, list[float]]:
    """Per time model ('measured', 'compute' and each bandwidth), the elapsed time after
    every step, with a leading 0 for 'before step 1'. `link`: (sent, received) bytes per step
    (default: the steps' own). `compute_s`: a measured compute-only s/step that replaces
    step − blocked time (DDP, whose wait hides in backward: train/ddp.py)."""
    link = link or [(s["link_bytes_sent"], s["link_bytes_received"]) for s in steps]
    out = {"measured": [0.0], "compute": [0.0], **{name: [0.0] for name in BANDWIDTHS}}
    for s, (sent, received) in zip(steps, link):
        out["measured"].append(out["measured"][-1] + s["step_s"])
        compute = s["step_s"] - s["comm_s"] if compute_s is None else compute_s
        out["compute"].append(out["compute"][-1] + compute)
        wire = 8 * max(sent, received)
        for name, bw in BANDWIDTHS.items():
            out[name].append(out[name][-1] + compute + wire / bw + s["collectives"] * latency_s)
    return out


def steps_to_target(evals: list[dict], target: float) -> int | None:
    """The step of the first evaluation whose validation loss is <= target; None if none is."""
    return next((e["step"] for e in evals if e["val_loss"] <= target), None)


def time_to_target(evals: list[dict], times: dict[str, list[float]], target: float, first_step: int = 1) -> dict:
    """Per time model, the time from the first logged step (`first_step`: a site that joined a
    store run later logs from the step after its snapshot's) to the first evaluation at target."""
    hit = steps_to_target(evals, target)
    at = None if hit is None or hit < first_step - 1 else hit - (first_step - 1)
    return {name: (None if at is None else series[at]) for name, series in times.items()}


def summarize(optimizer: str, log: dict, target: float, latency_s: float, link: dict | None = None) -> dict:
    steps, evals = log["steps"], log["evals"]
    n = len(steps)
    mean = lambda key: sum(s[key] for s in steps) / n
    link_bytes = link_per_step(log)
    calibrated = (log["final"] or {}).get("compute_only_step_s")
    times = cumulative_times(steps, latency_s, link_bytes, calibrated)
    compute_only = calibrated if calibrated is not None else mean("step_s") - mean("comm_s")
    hit = steps_to_target(evals, target)
    row = {
        "optimizer": optimizer,
        "val_loss": evals[-1]["val_loss"],
        "steps": n,
        "payload_bytes_per_step": mean("payload_bytes"),
        "link_bytes_per_step": mean("link_bytes_sent"),
        "link_bytes_received_per_step": mean("link_bytes_received"),
        "collectives_per_step": mean("collectives"),
        "step_time_s": mean("step_s"),
        "compute_time_s": mean("step_s") - mean("comm_s"),
        # the physical limit: compute-only s/step, and the steps to target at that rate
        "compute_only_step_s": compute_only,
        "adamw_step_s": (log["final"] or {}).get("adamw_step_s"),       # dense AdamW's, probed in this run
        "adamw_step_during_s": step_during(evals, hit),                  # ... and at its evaluations to target
        "adamw_step_during_median_s": _median(samples_during(evals, hit)),
        "compute_only_source": "calibrated: steps under DDP no_sync()" if calibrated is not None
                               else "step time - time blocked in collectives",
        "steps_to_target": hit,
        "no_comm_limit_s": None if hit is None else hit * compute_only,
        "train_time_s": {k: v[-1] for k, v in times.items()},
        "target_loss": target,
        "time_to_target_s": time_to_target(evals, times, target, steps[0].get("step", 1) if steps else 1),
        "payload_bytes_per_step_by_tag": _by_tag(log["final"], n),
        "comm_stats": log["final"]["comm_stats"] if log["final"] else None,
        "n_params": log["final"]["n_params"] if log["final"] else None,
        "optimizer_state_bytes_per_rank": (log["final"] or {}).get("optimizer_state_bytes"),
        "resumes": [{k: r.get(k) for k in ("step", "checkpoint", "old_world", "world", "load_s", "time_to_recover_s")}
                    for r in log.get("resumes", [])],
    }
    tiers = (log["final"] or {}).get("tiers")
    if tiers:
        row.update(_tiers(tiers, steps))
    if link is not None:
        row["link"] = link
        row["modelled_at_link_s"] = _at_link(steps, link_bytes, link["rate_bps"], latency_s, calibrated)
    return row


def add_limits(rows: list[dict], dense: tuple[str, ...] = DENSE_ADAMW,
               dense_steps: int | None = None) -> dict | None:
    """Every row gets dense AdamW's no-communication limit (`dense_limit_s`: its steps to target
    x its compute-only s/step; the first of the names `dense` that ran: DDP AdamW, else
    DenseAllReduce AdamW) and `ratio_to_dense_limit` = its measured time to target / that limit (None when
    either is missing); a row that probed AdamW's step in its own run also gets
    `ratio_to_dense_limit_here` = its time / (AdamW's steps to target x that step): the step
    sampled at its evaluations up to its target (`adamw_step_during_s`), else the calibration's
    (`adamw_step_s`, a log without samples). AdamW's steps to target are its row's, or
    `dense_steps` (from AdamW's own run to the same target) when it is not in the table; the row
    records which in `dense_steps_to_target` / `dense_steps_of`. Returns the reference row (None
    when it did not run)."""
    ref = next((r for name in dense for r in rows if r["optimizer"] == name), None)
    limit = ref["no_comm_limit_s"] if ref else None
    steps = ref["steps_to_target"] if ref else dense_steps
    for r in rows:
        measured = r["time_to_target_s"]["measured"]
        r["dense_limit_s"] = limit
        r["dense_limit_of"] = ref["optimizer"] if ref else None
        r["ratio_to_dense_limit"] = None if (limit is None or measured is None or not limit) else measured / limit
        r["dense_steps_to_target"], r["dense_steps_of"] = steps, (ref["optimizer"] if ref else
                                                                  "--dense-steps" if steps else None)
        adamw_step = r.get("adamw_step_during_s") or r.get("adamw_step_s")
        here = None if not steps or not adamw_step else steps * adamw_step
        r["ratio_to_dense_limit_here"] = None if (here is None or measured is None) else measured / here
    return ref


def _median(times: list[float]) -> float | None:
    return statistics.median(times) if times else None


def _tiers(tiers: dict, steps: list[dict]) -> dict:
    """The per-tier figures of a --sites run (summary.json's `inter_site` and `intra_site`)."""
    n = len(steps)
    mean = lambda xs: sum(xs) / n
    site = tiers["site"]
    return {
        "sites": tiers["sites"], "ranks_per_site": tiers["ranks_per_site"],
        # the busiest rank's state: what each rank needs memory for
        "optimizer_state_bytes_per_rank": max(tiers["optimizer_state_bytes"]),
        "optimizer_state_bytes_by_rank": tiers["optimizer_state_bytes"],
        "inter_site": {
            "payload_bytes_per_step_per_worker": mean([s["payload_bytes"] for s in steps]),
            "payload_bytes_per_step_per_site": mean(site["payload_bytes"]),
            "link_bytes_per_step_per_site": mean(site["link_bytes_sent"]),
            "link_bytes_received_per_step_per_site": mean(site["link_bytes_received"]),
        },
        "intra_site": {                      # FSDP2's all-gathers and reduce-scatters, measured (rank 0)
            "payload_bytes_per_step_per_worker": mean([s.get("intra_payload_bytes", 0) for s in steps]),
            "link_bytes_per_step_per_worker": mean([s.get("intra_link_bytes_sent", 0) for s in steps]),
            "collectives_per_step": mean([s.get("intra_collectives", 0) for s in steps]),
        },
    }


def _by_tag(final: dict | None, steps: int) -> dict[str, float]:
    """Mean payload bytes per step for each collective tag ('payload', 'downlink', 'handshake', ...)."""
    if not final or not steps:
        return {}
    return {tag: c["payload_bytes"] / steps for tag, c in final["comm_stats"]["by_tag"].items()}


def _at_link(steps: list[dict], link_bytes: list[tuple[int, int]], bw: float, latency_s: float,
             compute_s: float | None = None) -> float:
    return sum((s["step_s"] - s["comm_s"] if compute_s is None else compute_s) + 8 * max(sent, received) / bw
               + s["collectives"] * latency_s for s, (sent, received) in zip(steps, link_bytes))


def _mb(x: float) -> str:
    return f"{x / 1e6:.4g}"


def _t(x) -> str:
    return "never" if x is None else f"{x:.1f}"


def _ratio(row: dict, by_name: dict, baseline: str | None) -> str:
    """'N x vs <dense run>': payload bytes of the row's dense counterpart (when it ran) or the baseline."""
    ref = by_name.get(row.get("counterpart")) or by_name.get(baseline)
    if ref is None or not row["payload_bytes_per_step"]:
        return "-"
    return f"{ref['payload_bytes_per_step'] / row['payload_bytes_per_step']:.1f} vs {ref['optimizer']}"


def format_table(rows: list[dict], baseline: str | None) -> str:
    """Markdown table of a comparison; byte ratios against each run's dense counterpart
    (Adam for APMSqueeze, Muon for EF21-Muon, ...) when it ran, else against `baseline`."""
    by_name = {r["optimizer"]: r for r in rows}
    tiered = any("inter_site" in r for r in rows)
    payload, link = (("inter-site payload MB/step/worker", "inter-site link MB/step/site") if tiered else
                     ("payload MB/step/worker", "link MB/step"))
    head = (f"| optimizer | val loss | {payload} | {link} | x fewer bytes | step s | "
            "to target: measured s | " + " | ".join(f"{k} s" for k in BANDWIDTHS) + " |")
    lines = [head, "|" + "---|" * (7 + len(BANDWIDTHS))]
    for r in rows:
        ratio = _ratio(r, by_name, baseline)
        ttt = r["time_to_target_s"]
        link_mb = r["inter_site"]["link_bytes_per_step_per_site"] if "inter_site" in r else r["link_bytes_per_step"]
        lines.append(f"| {r['optimizer']} | {r['val_loss']:.4f} | {_mb(r['payload_bytes_per_step'])} | "
                     f"{_mb(link_mb)} | {ratio} | {r['step_time_s']:.3f} | {_t(ttt['measured'])} | "
                     + " | ".join(_t(ttt[k]) for k in BANDWIDTHS) + " |")
    target = rows[0]["target_loss"] if rows else float("nan")
    lines.append(f"\nTarget validation loss {target:.4f}; dense baselines send fp32 gradients; "
                 f"modelled time = compute + link bytes / bandwidth + collectives x latency (training only).")
    if tiered:
        lines.append("\n" + _tiers_table(rows))
    if any("no_comm_limit_s" in r for r in rows):
        lines.append("\n" + _limits_table(rows))
    for r in rows:
        tags = {t: b for t, b in r.get("payload_bytes_per_step_by_tag", {}).items() if t != "handshake"}
        if len(tags) > 1:
            lines.append(f"{r['optimizer']} payload MB/step by direction: "
                         + ", ".join(f"{'uplink' if t == 'payload' else t} {_mb(b)}" for t, b in sorted(tags.items())))
    for r in rows:
        if "link" in r:
            measured, modelled = r["train_time_s"]["measured"], r["modelled_at_link_s"]
            gap = abs(measured - modelled) / max(modelled, 1e-9)
            verdict = "agree within 25 %" if gap <= 0.25 else "DISAGREE by more than 25 %"
            if r.get("overlap") and measured < modelled:
                verdict += "; the model adds compute and link time, which overlap runs side by side"
            lines.append(f"{r['optimizer']} over the emulated {r['link']['spec']} link: measured "
                         f"{measured:.1f} s, modelled {modelled:.1f} s ({gap:.0%} apart: {verdict}).")
    return "\n".join(lines)


def _x(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def _limits_table(rows: list[dict]) -> str:
    """Against the physical limit: compute-only step time, the no-communication limit (steps
    to target x compute-only s/step) and measured time to target over dense AdamW's limit."""
    lines = ["| optimizer | overlap | step s | compute-only s/step | steps to target | no-comm limit s | "
             "to target: measured s | x dense AdamW's limit | x that limit, AdamW's step timed in this run |",
             "|" + "---|" * 9]
    for r in rows:
        steps = "never" if r.get("steps_to_target") is None else str(r["steps_to_target"])
        lines.append(f"| {r['optimizer']} | {'yes' if r.get('overlap') else 'no'} | {r['step_time_s']:.3f} | "
                     f"{r['compute_only_step_s']:.3f} | {steps} | {_t(r.get('no_comm_limit_s'))} | "
                     f"{_t(r['time_to_target_s']['measured'])} | {_x(r.get('ratio_to_dense_limit'))} | "
                     f"{_x(r.get('ratio_to_dense_limit_here'))} |")
    ref = next((r for r in rows if r.get("dense_limit_of")), None)
    if ref is not None and ref["dense_limit_s"] is not None:
        lines.append(f"\nDense AdamW's no-communication limit: {ref['dense_limit_s']:.1f} s ({ref['dense_limit_of']}). "
                     f"Compute-only s/step: DDP runs measured with communication off (no_sync), the "
                     f"smaller of before and after training; others step time - time blocked in "
                     f"collectives (with overlap, the wait in the next step). The last column divides by "
                     f"AdamW's steps to target x the mean of AdamW's steps timed in the row's own "
                     f"processes at its evaluations up to its target, free of the machine's drift "
                     f"between and within runs.")
    else:
        lines.append("\nDense AdamW (adamw) did not run or did not reach the target: no ratio to its limit.")
    given = next((r for r in rows if r.get("dense_steps_of") == "--dense-steps"), None)
    if given is not None:
        lines.append(f"The last column takes AdamW's steps to target from --dense-steps "
                     f"({given['dense_steps_to_target']}).")
    return "\n".join(lines)


def _tiers_table(rows: list[dict]) -> str:
    """Per tier, for --sites runs: inter-site bytes per worker and per site, intra-site bytes,
    optimizer state per rank, compute per step and time to target with a free link."""
    r0 = next(r for r in rows if "inter_site" in r)
    lines = ["| optimizer | inter-site payload MB/step: worker / site | inter-site link MB/step/site | "
             "intra-site MB/step/worker: payload / link | optimizer state MB/rank | step s | compute s | "
             "to target: link-free s |", "|" + "---|" * 8]
    for r in rows:
        inter, intra = r.get("inter_site"), r.get("intra_site")
        if inter is None:
            continue
        lines.append(f"| {r['optimizer']} | {_mb(inter['payload_bytes_per_step_per_worker'])} / "
                     f"{_mb(inter['payload_bytes_per_step_per_site'])} | {_mb(inter['link_bytes_per_step_per_site'])} | "
                     f"{_mb(intra['payload_bytes_per_step_per_worker'])} / {_mb(intra['link_bytes_per_step_per_worker'])} | "
                     f"{_mb(r['optimizer_state_bytes_per_rank'])} | {r['step_time_s']:.3f} | "
                     f"{r['compute_time_s']:.3f} | {_t(r['time_to_target_s']['compute'])} |")
    lines.append(f"\n{r0['sites']} sites x {r0['ranks_per_site']} ranks: FSDP2 inside each site, the optimizer "
                 f"across sites; dense baselines are FSDP2 HSDP (gradient reduce-scattered in the site, "
                 f"all-reduced across sites) with the plain torch optimizer. Inter-site bytes are measured "
                 f"(optimizer comm stats; FSDP2's all-reduce); the site's link carries the sum over its ranks "
                 f"(busiest site), which modelled times use. Intra-site bytes are FSDP2's all-gathers and "
                 f"reduce-scatters, measured on rank 0. Compute = step time - time blocked in inter-site "
                 f"collectives (rank 0); link-free = the sum of compute up to the target. Over a shaped link a "
                 f"rank's wait inside its site for a site peer's inter-site transfer counts as compute, so both "
                 f"are upper bounds there; a run without --link measures the link-free time directly.")
    return "\n".join(lines)


def plot(logs: dict[str, dict], out_dir: Path, latency_s: float) -> list[Path]:
    """Validation loss vs step, vs cumulative bytes, vs modelled time at 100 Mbit/s (PNG);
    nothing when matplotlib is not installed (it is an optional extra)."""
    try:                       # a Figure on the Agg canvas: pyplot's import (about 1 s) is not needed
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return []
    fig = Figure(figsize=(15, 4))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 3)
    for name, log in logs.items():
        steps = [e["step"] for e in log["evals"]]
        loss = [e["val_loss"] for e in log["evals"]]
        cum = [0]
        for s in log["steps"]:
            cum.append(cum[-1] + s["payload_bytes"])
        t100 = cumulative_times(log["steps"], latency_s, link_per_step(log),
                                (log["final"] or {}).get("compute_only_step_s"))["100mbit"]
        first = log["steps"][0].get("step", 1) - 1 if log["steps"] else 0     # a store site that joined later: > 0
        steps, loss = zip(*[(k, v) for k, v in zip(steps, loss) if k >= first]) if steps else ((), ())
        axes[0].plot(steps, loss, label=name)
        axes[1].plot([cum[k - first] / 1e6 for k in steps], loss, label=name)
        axes[2].plot([t100[k - first] for k in steps], loss, label=name)
    for ax, xlabel in zip(axes, ("step", "cumulative payload MB per worker", "modelled time at 100 Mbit/s (s)")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel("validation loss")
        ax.legend()
    axes[1].set_xscale("symlog")
    path = out_dir / "loss.png"
    fig.tight_layout()
    fig.savefig(path)
    return [path]
