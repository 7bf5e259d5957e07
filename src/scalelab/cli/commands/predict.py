"""`scalelab predict WORKLOAD --strategy S --ranks 1,2,...`: how a study will scale, from the
measured ceilings, a network profile and (optionally) one-rank measurements to calibrate on;
`scalelab predict --validate RESULTS`: the model against every measurement there.

The model: scalelab.predict (docs/PREDICT.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from scalelab.cli.base import COMMANDS, Command
from scalelab.cli.options import RUN_ONLY, add_config_options, workload_config, workload_name
from scalelab.errors import UsageError
from scalelab.outputs import check_dir
from scalelab.strategies import STRATEGIES

GPUS_PER_NODE = 8


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("workload", nargs="?", help="workload to predict (not with --validate)")
    p.add_argument("--ranks", default="1,2,4,8", help="rank counts, comma list (default 1,2,4,8)")
    p.add_argument(
        "--gpus-per-node",
        type=int,
        default=None,
        help=f"ranks per node: GPUs per node (default {GPUS_PER_NODE}), CPU ranks per node for "
        "CPU strategies (default: the ceilings machine's cores)",
    )
    p.add_argument(
        "--nics-per-node",
        type=int,
        default=None,
        help="network ports per node (default: one per GPU; 1 for CPU ranks)",
    )
    p.add_argument("--ceilings", default=None, help="ceilings.json from `scalelab ceilings`")
    p.add_argument(
        "--network",
        default=None,
        help="inter-node network: a profile (ndr400, hdr200, roce200, roce100) or a JSON file "
        "with a measured alpha_s/beta_Bps",
    )
    p.add_argument(
        "--calibrate",
        default=None,
        metavar="RESULTS",
        help="results file or folder with one-rank measurements to calibrate compute on",
    )
    p.add_argument(
        "--bands",
        default=None,
        metavar="FILE",
        help="bands.json from `predict --validate RESULTS -o DIR`: each prediction's "
        "uncertainty (default: scalelab-results/validate/bands.json when present)",
    )
    p.add_argument(
        "--validate",
        default=None,
        metavar="RESULTS",
        help="compare the model with every measured record under RESULTS",
    )
    p.add_argument(
        "--drop-warned", action="store_true",
        help="--validate: leave out runs whose records carry warnings (busy host, ...)",
    )  # fmt: skip
    p.add_argument(
        "--per-rank-batch", type=int, default=None, metavar="B",
        help="weak scaling: B items per rank, the global batch growing with --ranks (--batch "
        "is the global batch, fixed: strong scaling)",
    )  # fmt: skip
    p.add_argument("-o", "--out", default=None, help="folder for predict.csv/.json and the plot")
    p.add_argument("--no-plots", action="store_true", help="table and files only")
    # Not read by the model: training hyper-parameters, seeds, how a pipeline is re-cut or
    # placed, the timeline instrument. (--engine torch with --virtual-stages: torch's
    # pipeline schedules, replayed from torch's own order.)
    unread = {"seed", "lr", "momentum", "l2", "rebalance", "placement", "timeline"}
    add_config_options(p, skip={"ranks", "quiet"} | RUN_ONLY | unread)


def run(args: argparse.Namespace) -> int:
    if args.out is not None:
        check_dir(args.out, "-o")  # before any work
    from scalelab.analysis import require

    require("pandas", "scalelab predict")
    from scalelab.predict.network import load_network

    network = load_network(args.network)
    if args.validate is not None:
        return validate(args, network)
    return predict(args, network)


# --- prediction ----------------------------------------------------------------------------
def predict(args: argparse.Namespace, network) -> int:
    from scalelab.predict.figures import figures_at
    from scalelab.predict.frame import bottleneck_summary, prediction_table
    from scalelab.predict.models import Context, model_for

    workload = workload_name(args, required=False)
    if workload is None:
        raise UsageError("name a workload to predict (or give --validate RESULTS)")
    if args.strategy is None:
        raise UsageError("give --strategy (the strategy to predict: ddp, mpi, mpi-gpu, nccl, ...)")
    model_for(args.strategy)  # an unmodelled strategy fails before anything is read
    ranks = _ranks(args.ranks)
    figures = figures_at(args.ceilings)
    template = _scenario(args, figures)
    found = _calibration_found(args.calibrate)
    ctx = Context(figures, network, _pool_of(found))
    table, notes = prediction_table(ctx, template, ranks)
    if found is not None:  # the runs it leaned on; the rows RESULTS measured, checked
        table, notes = _crosscheck(ctx, template, ranks, table, notes, found)
    notes += _trust(ctx, template, ranks, args.bands)
    summary = bottleneck_summary(table)
    print(_header(template, network))
    print(_shown(table).to_string(index=False, float_format="{:.4g}".format, na_rep="-"))
    print(f"bottleneck: {summary}")
    for note in notes:
        print(f"- {note}")
    if args.out is not None:
        _write(args, table, notes, summary, template, network)
    return 0


def _trust(ctx, template, ranks: list[int], bands: str | None) -> list[str]:
    """The band from the family's validation errors, and what the predictions extrapolate."""
    from scalelab.predict.uncertainty import band_note, extrapolations
    from scalelab.predict.validate import family, strategy_label

    band = band_note(family(strategy_label(template.cfg)), bands)
    return ([band] if band else []) + extrapolations(ctx.pool, template, ranks)


def _ranks(text: str) -> list[int]:
    try:
        ranks = [int(x) for x in text.split(",")]
    except ValueError:
        raise UsageError(f"--ranks {text!r}: give a comma list of integers, e.g. 1,2,4,8") from None
    if any(n < 1 for n in ranks):
        raise UsageError(f"--ranks {text!r}: rank counts must be >= 1")
    return sorted(set(ranks))


def _scenario(args: argparse.Namespace, figures):
    from scalelab.predict.scenario import Scenario

    cls = STRATEGIES.get(args.strategy)
    gpu = args.device == "cuda" or (args.device is None and cls.gpu_first)
    overrides = {"workload": workload_name(args), "ranks": 1, "device": "cuda" if gpu else "cpu"}
    if cls.trains_only and not cls.traced_by_torch(args):
        overrides["train"] = True
    cfg = workload_config(args, **overrides)
    cores = (figures.data.get("machine") or {}).get("cpu_cores") or 1
    per_node = args.gpus_per_node or (GPUS_PER_NODE if gpu else int(cores))
    if per_node < 1 or (args.nics_per_node is not None and args.nics_per_node < 1):
        raise UsageError("--gpus-per-node and --nics-per-node must be >= 1")
    weak = args.per_rank_batch
    if weak is not None and (weak < 1 or args.batch is not None):
        raise UsageError("--per-rank-batch must be >= 1 and not given with --batch")
    if weak is not None:
        cfg = dataclasses.replace(cfg, batch=weak)
    return Scenario(cfg, 1, per_node, args.nics_per_node, weak_batch=weak)


def _calibration_found(path: str | None):
    from scalelab.predict.points import discover

    if path is None:
        return None
    if not Path(path).exists():
        raise UsageError(f"--calibrate {path}: no such results file or folder")
    return discover(Path(path))


def _calibration_pool(path: str | None):
    return _pool_of(_calibration_found(path))


def _pool_of(found):
    from scalelab.predict.calibration import Pool

    pool = Pool()
    for p in found.pools.values() if found is not None else ():
        pool.extend(p)
    return pool


def _crosscheck(ctx, template, ranks, table, notes, found):
    from scalelab.predict import crosscheck

    warned = {p.source: p.warnings for pool in found.pools.values()
              for p in [*pool.singles, *pool.multis] if p.warnings}  # fmt: skip
    used = crosscheck.calibrated_on(ctx, template, ranks)
    table, disagree = crosscheck.against_measured(table, template, found.points)
    return table, [*crosscheck.calibration_notes(used, warned), *notes, *disagree]


def _header(s, network) -> str:
    cfg = s.cfg
    mode = "strong scaling, global batch" if s.strong else "weak scaling, per rank"
    batch = s.global_batch if s.strong else cfg.batch
    where = f"network {network.describe()}" if network is not None else "one node (no --network)"
    split = f" --split {cfg.split}" if STRATEGIES.get(cfg.strategy).takes_split else ""
    return (
        f"predict: {cfg.workload} {cfg.strategy}{split}, {s.precision} on {cfg.device}, "
        f"{'training' if cfg.train else 'inference'}, {mode} {batch}; "
        f"{s.per_node} ranks per node; {where}"
    )


def _shown(table):
    drop = [c for c in ("global_batch",) if c in table]  # the header names it
    return table.drop(columns=drop)


def _write(args, table, notes, summary, template, network) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table.to_csv(out / "predict.csv", index=False)
    meta = {
        "scenario": template.cfg.to_dict(),
        "per_node": template.per_node,
        "network": None if network is None else network.describe(),
        "bottleneck": summary,
        "notes": notes,
        "rows": json.loads(table.to_json(orient="records")),
    }
    (out / "predict.json").write_text(json.dumps(meta, indent=1))
    wrote = "predict.csv, predict.json"
    if not args.no_plots:
        from scalelab.analysis import require_plotting

        require_plotting()
        from scalelab.analysis.predict_plots import prediction_plot

        title = _header(template, network).split(";")[0].removeprefix("predict: ")
        prediction_plot(table, out, title=title)
        wrote += ", predict.png"
    print(f"wrote {out}/: {wrote}")


# --- validation ----------------------------------------------------------------------------
def validate(args: argparse.Namespace, network) -> int:
    from scalelab.predict.uncertainty import write_bands
    from scalelab.predict.validate import validate as run_validation

    v = run_validation(args.validate, args.ceilings, network, args.drop_warned)
    verbose = bool(getattr(args, "verbose", 0))  # scalelab -v: every point and file
    used = sorted({c.split(" (")[0] for c in v.ceilings.values()})
    print(f"validate: {args.validate} ({len(v.ceilings)} results files over the ceilings "
          f"{', '.join(used)})")  # fmt: skip
    if verbose:
        for results, ceilings in sorted(v.ceilings.items()):
            print(f"  {results} -> {ceilings}")
        for results, what in sorted(v.borrowed.items()):
            print(f"  {results} borrowed another host's ceilings: {what}")
    elif v.borrowed:
        print(f"  {len(v.borrowed)} results files borrowed another host's ceilings (-v: which)")
    fmt = {"float_format": "{:.4g}".format, "na_rep": "-", "index": False}
    if verbose:
        shown = v.table.assign(error=v.table["error_pct"].map(lambda e: f"{e:+.1f}%"))
        print(shown.drop(columns=["error_pct"]).to_string(**fmt))
    print("per strategy family (MAPE held out = leave-one-out, then in sample):")
    print(v.families().to_string(float_format="{:.1f}".format, na_rep="-", index=False))
    _skipped(v.skipped, verbose)
    far = v.outside()
    worst = v.table["error_pct"].abs().max()
    names = ", ".join(far["source"][:8]) + (f" and {len(far) - 8} more" if len(far) > 8 else "")
    print(f"outside 15%: {len(far)} point(s): {names}" if len(far)
          else f"every point within 15% (worst {worst:.1f}%)")  # fmt: skip
    if args.out is not None:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        v.table.to_csv(out / "validate.csv", index=False)
        write_bands(v.families(), out / "bands.json")
    print(v.summary())
    return 0


def _skipped(skipped: dict[str, int], verbose: bool) -> None:
    """What was passed over, one line a reason; the unknown files folded into a count."""
    print("skipped:" + ("" if skipped else " nothing"))
    unknown = {w: n for w, n in skipped.items() if w.startswith("in no known format")}
    for why, n in sorted(skipped.items()):
        if verbose or why not in unknown:
            line = f"  {n} {why}"
            print(line if verbose or len(line) <= 160 else line[:157] + "...")
    if unknown and not verbose:
        print(f"  {sum(unknown.values())} files in no known format ({len(unknown)} names; -v)")


COMMANDS.register(
    "predict", "performance model: time, throughput and bottleneck at N ranks; --validate"
)(Command(add_arguments, run))
