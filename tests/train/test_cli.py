"""`thinwire compare` end to end on the tiny preset with 2 real gloo workers (the CLI run this
file shares with two others: shared.py), plus the CLI's user errors (which must come
before anything is spawned)."""

import json
import subprocess
import sys

import pytest

from tests.train.shared import STEPS, TINY_OPTIMIZERS
from thinwire.train.cli import main

OPTIMIZERS = ("adamw", "powersgd", "demo")
RUN_KEYS = ("optimizer", "val_loss", "payload_bytes_per_step", "link_bytes_per_step", "step_time_s",
            "time_to_target_s")
BANDWIDTH_KEYS = ("measured", "compute", "10gbit", "1gbit", "100mbit", "10mbit", "1mbit")
# tiny preset: vocab 256, width 64, context 32, one block (LayerNorms without bias, tied head)
V, C, T = 256, 64, 32
MATRICES = [(V, C), (T, C), (3 * C, C), (C, C), (4 * C, C), (C, 4 * C)]   # wte(=head), wpe, qkv, proj, fc, out
VECTORS = [C, C, C]                                                      # ln1, ln2, ln_f


@pytest.fixture(scope="module")
def run(tiny_compare):
    return tiny_compare["summary"], tiny_compare["logs"], tiny_compare["stdout"]


def test_table_printed(run):
    summary, _, stdout = run
    for name in OPTIMIZERS:
        assert f"| {name} |" in stdout
    assert "100mbit" in stdout


def test_summary_complete(run):
    summary, logs, _ = run
    assert [r["optimizer"] for r in summary["runs"]] == list(TINY_OPTIMIZERS)      # run order; OPTIMIZERS first
    assert summary["baseline"] == "adamw"
    assert summary["target_loss"] == pytest.approx(logs["adamw"]["eval"][-1]["val_loss"] * 1.02)
    for row in summary["runs"]:
        for key in RUN_KEYS:
            assert row[key] is not None, key
        assert set(row["time_to_target_s"]) == set(BANDWIDTH_KEYS)
        assert row["step_time_s"] > 0 and row["payload_bytes_per_step"] > 0
    dense = summary["runs"][0]["time_to_target_s"]
    assert all(dense[k] is not None for k in BANDWIDTH_KEYS)          # the baseline reaches 1.02 x its own loss


def test_loss_falls(run):
    _, logs, _ = run
    for name in OPTIMIZERS:
        evals = logs[name]["eval"]
        assert evals[0]["step"] == 0 and evals[-1]["step"] == STEPS
        assert evals[-1]["val_loss"] < evals[0]["val_loss"] - 1.0, name     # from ~ln(256)=5.5


def test_bytes_equal_optimizer_stats(run):
    summary, logs, _ = run
    for name in OPTIMIZERS:
        steps, stats = logs[name]["step"], logs[name]["final"][0]["comm_stats"]["totals"]
        for key in ("payload_bytes", "link_bytes_sent", "link_bytes_received", "collectives"):
            assert sum(s[key] for s in steps) == stats[key], (name, key)
        row = next(r for r in summary["runs"] if r["optimizer"] == name)
        assert row["payload_bytes_per_step"] == pytest.approx(stats["payload_bytes"] / len(steps))


def test_dense_bytes_are_the_fp32_gradient(run):
    """adamw is torch DDP: its buckets hold exactly the fp32 gradient, every step (the
    DenseAllReduce baseline's bytes, with its trailer: test_overlap_harness.py)."""
    _, logs, _ = run
    n_params = sum(a * b for a, b in MATRICES) + sum(VECTORS)
    steps = logs["adamw"]["step"]
    assert all(s["payload_bytes"] == 4 * n_params for s in steps)
    assert all(s["link_bytes_sent"] == 2 * 4 * n_params * 1 // 2 for s in steps)   # ring, W = 2


def test_powersgd_bytes_are_p_and_q(run):
    """PyTorch's rule: a matrix n x m is compressed at rank r when n*m >= 2 (n+m) r; then
    P (n x r) and Q (m x r) are all-reduced in fp32, the rest is all-reduced dense."""
    _, logs, _ = run
    r = 4
    compressed = 4 * sum((n + m) * r for n, m in MATRICES if n * m >= 2 * (n + m) * r)
    dense = 4 * (sum(n * m for n, m in MATRICES if n * m < 2 * (n + m) * r) + sum(VECTORS))
    steps = logs["powersgd"]["step"]
    n_params = sum(a * b for a, b in MATRICES) + sum(VECTORS)
    assert steps[0]["payload_bytes"] == 4 * n_params                        # before start_powerSGD_iter
    assert all(s["payload_bytes"] == compressed + dense for s in steps[2:])


def test_demo_sends_over_100x_less(run):
    summary, _, _ = run
    rows = {r["optimizer"]: r for r in summary["runs"]}
    assert rows["adamw"]["payload_bytes_per_step"] / rows["demo"]["payload_bytes_per_step"] > 100


@pytest.mark.parametrize("argv, message", [
    (["--optimizers", "adamw,sgdx"], "unknown optimizer 'sgdx'"),
    (["--preset", "huge"], "unknown preset 'huge'"),
    (["--data", "/nonexistent/thinwire"], "does not exist"),
    (["--workers", "40"], "40 workers but only 16 batch rows"),
    (["--rows", "3"], "4 workers but only 3 batch rows"),                   # tiny's own worker count
    (["--preset", "wan", "--rows", "1"], "2 workers but only 1 batch rows"),  # wan's: 2
    (["--ef21-muon-uplink", "topk:2"], "ef21-muon: uplink='topk:2'"),
    (["--uplink", "topk:2"], "ef21-muon: uplink='topk:2'"),                 # the old flag, still taken
    (["--apmsqueeze-compressed-after", "1.5"], "apmsqueeze: compressed_after must be in"),
    (["--demo-topk", "0"], "demo: topk must be an integer >= 1, got 0 (--demo-topk)"),
    (["--demo-values", "8bit"], "demo: values='8bit' sends a 256-level table"),
    (["--lordo-rank", "-1"], "lordo: rank must be an integer >= 0"),
    (["--powersgd-rank", "0"], "powersgd: rank must be an integer >= 1"),
    (["--optimizers", "adamw,apmsqueeze", "--apmsqueeze-compressed-after", "0.05"],      # 3 of tiny's 60 steps
     "gives APMSqueeze 3 dense warmup step(s); it needs at least 5"),
    (["--optimizers", "demo,apmsqueeze-overlap", "--steps", "20"], "gives APMSqueeze 4 dense warmup step(s)"),
    (["--sparseloco-topk", "1025", "--sparseloco-chunk", "32"],
     "sparseloco: topk must be at most chunk**2 = 1024 (every element), got 1025 (--sparseloco-topk)"),
    (["--sparseloco-chunk", "0"], "sparseloco: chunk must be an integer >= 1, got 0 (--sparseloco-chunk)"),
    (["--sparseloco-values", "sign"], "(--sparseloco-values)"),
    (["--sparseloco-indices", "gamma"], "(--sparseloco-indices)"),
    (["--sparseloco-error-decay", "1.5"], "sparseloco: error_decay must be in [0, 1], got 1.5 (--sparseloco-error-decay)"),
    (["--sparseloco-outer-lr", "0"], "sparseloco: outer_lr must be > 0, got 0.0 (--sparseloco-outer-lr)"),
    (["--sparseloco-eager-scale", "-1"], "sparseloco: eager_scale must be a finite number >= 0, got -1.0"),
    (["--diloco-outer-lr", "-1"], "diloco: outer_lr must be > 0, got -1.0 (--diloco-outer-lr)"),
    (["--diloco-outer-momentum", "1"], "diloco: outer_momentum must be in [0, 1), got 1.0 (--diloco-outer-momentum)"),
    (["--optimizers", "demo", "--dense-steps", "0", "--target", "3"], "--dense-steps must be an integer >= 1, got 0"),
    (["--optimizers", "demo", "--dense-steps", "5"], "--dense-steps needs --target"),
    (["--optimizers", "adamw,demo", "--dense-steps", "5", "--target", "3"], "and this one runs adamw"),
])
def test_user_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["compare", "--preset", "tiny", *argv] if "--preset" not in argv else ["compare", *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_bin_with_ids_beyond_vocab(tmp_path, capsys):
    path = tmp_path / "ids.bin"
    path.write_bytes(bytes([0, 0, 44, 1] * 100))           # little-endian uint16: 0 and 300
    with pytest.raises(SystemExit):
        main(["train", "--preset", "tiny", "--data", str(path)])
    assert "token id 300 >= vocab_size 256" in capsys.readouterr().err


def test_entry_points_and_layers():
    """`thinwire` (pyproject: thinwire.__main__:main), `python -m thinwire` and `python -m
    thinwire.train` all reach the parser in thinwire.train.cli; train/ never imports the
    top-level thinwire.__main__, and the CLI imports no training code until a command runs."""
    import thinwire.__main__ as entry
    import thinwire.train.__main__ as train_entry
    from thinwire.train import cli
    assert entry.main is cli.main and train_entry.main is cli.torchrun_main
    probe = ("import sys, thinwire.train.cli, thinwire.train.__main__; "
             "print(sorted(m for m in sys.modules if m in ('thinwire.__main__', 'thinwire.train.run', "
             "'thinwire.train.worker', 'thinwire.train.model')))")
    commands = [[sys.executable, "-m", "thinwire", "train", "--help"], [sys.executable, "-m", "thinwire.train", "--help"],
                [sys.executable, "-c", probe]]
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for c in commands]  # side by side
    (help_a, err_a), (help_b, err_b), (loaded, err) = (p.communicate(timeout=120) for p in procs)
    assert procs[0].returncode == 0 and "--optimizer" in help_a, err_a
    assert procs[1].returncode == 0 and "--optimizer" in help_b, err_b
    assert procs[2].returncode == 0 and loaded.strip() == "[]", loaded + err


def test_dense_steps_and_the_probe_switch_reach_the_run_options():
    from thinwire.train.cli import build_parser, options_from_args
    args = build_parser().parse_args(["compare", "--optimizers", "demo", "--target", "2.5", "--dense-steps", "475",
                                      "--no-adamw-probe"])
    assert (options_from_args(args).dense_steps, options_from_args(args).adamw_probe) == (475, False)
    plain = options_from_args(build_parser().parse_args(["compare"]))
    assert (plain.dense_steps, plain.adamw_probe) == (None, True)


def test_no_adamw_probe_times_nothing(tmp_path):
    main(["compare", "--preset", "tiny", "--optimizers", "sparseloco", "--steps", "10", "--eval-every", "5",
          "--no-adamw-probe", "--target", "9", "--dense-steps", "5", "--quiet", "--out", str(tmp_path)])
    records = [json.loads(line) for line in (tmp_path / "sparseloco.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "eval"] == [0, 5, 10]
    assert not any("adamw_probe_s" in r for r in records)
    final = next(r for r in records if r["kind"] == "final")
    assert "adamw_probe" not in final and "adamw_step_s" not in final
    row = json.loads((tmp_path / "summary.json").read_text())["runs"][0]
    assert row["time_to_target_s"]["measured"] is not None and row["ratio_to_dense_limit_here"] is None
