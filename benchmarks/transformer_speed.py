"""Training a transformer at the engines' speed on 1, 2 and 4 GPUs: scalelab beside a plain
PyTorch peer, in one call.

    PYTHONPATH=src NCCL_NVLS_ENABLE=0 python benchmarks/transformer_speed.py --out OUT/speed
    PYTHONPATH=src python benchmarks/transformer_speed.py --smoke --out /tmp/speed   # CPU

--rounds R runs each GPU count's launches R times over, alternating scalelab and the peer, and
the table gives each run's median with its range: on the lent hosts one launch can lose 10-17%
at random, more than the 2-5% questions this benchmark answers.

The model is the example GPT (examples/models/gpt.py) at GPT-2 small's shape (depth 12,
width 768, 12 heads, seq 1024, vocab 50304), 16 sequences per GPU, SGD with momentum. On
every GPU count that exists among 1, 2, 4 it runs, each count in a few torchrun launches
(every run of a launch in one process, so a launch pays start-up and NCCL once; with 3+
GPUs the 1-GPU chain runs on GPU 0 beside the 2-GPU chain on GPUs 1-2, then the 4-GPU one):

  scalelab  ddp --amp bf16, fsdp --dtype bf16, and both with --compile;
            on one GPU also local --amp bf16 [--compile]
  peer      benchmarks/peer_gpt_train.py: the same model under DDP and FSDP2 with the same
            policies (bf16 autocast / MixedPrecisionPolicy(bf16, fp32 reduce), scalelab's
            default unit size and its optimizer on local shards, per-block compile), no
            scalelab code

Steady sequences/s after warm-up (scalelab: the record's steady_throughput; peer: timed steps
between two syncs), tokens/s, MFU against the GPU's datasheet bf16 peak (the model's FLOPs:
3 x forward, forward = 2 x tokens x block matmul weights + 4 x T^2 x width per block + the
last position's head), weak-scaling efficiency against the same run on one GPU, and
scalelab / peer (what scalelab's loop and instrumentation cost). Compiled runs share one
Inductor cache (--cache-dir), so a graph compiled once is loaded by later processes. Writes
OUT/records.jsonl (scalelab's records), OUT/peer.jsonl, OUT/summary.json, OUT/summary.md
and OUT/logs/. A launch that fails or runs past the time budget (--budget-s) is named in the
summary; the others still report.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GPT = ROOT / "examples" / "models" / "gpt.py"
PEER = ROOT / "benchmarks" / "peer_gpt_train.py"
FULL = dict(width=768, depth=12, heads=12, seq=1024, vocab=50304, per_gpu=16, warmup=10,
            steps=30)  # fmt: skip
SMOKE = dict(width=64, depth=2, heads=4, seq=32, vocab=512, per_gpu=2, warmup=1, steps=2)
LR, MOMENTUM = 0.01, 0.9
# (name, scalelab fields): the strategy's bf16 path as a user asks for it
SCALELAB = {
    "ddp": dict(strategy="ddp", amp="bf16"),
    "fsdp": dict(strategy="fsdp", dtype="bf16"),
    "local": dict(strategy="local", amp="bf16"),
}
# scalelab's run -> the peer's run of the same policy (a compiled run: both + " compile");
# fsdp: scalelab's default unit size and its optimizer on local shards (fsdp_step.py)
PEER_OF = {"ddp": "ddp", "fsdp": "fsdp unitmb{mb:g} localopt", "fsdp unit_mb=0": "fsdp localopt",
           "local": "ddp", "ddp grad_compress=bf16": "ddp bf16grad"}  # fmt: skip


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--smoke", action="store_true", help="CPU, gloo, tiny model, 1-2 ranks")
    p.add_argument("--smoke-compile", action="store_true", help="--smoke with the compiled runs")
    p.add_argument("--gpus", default="1,2,4", help="GPU counts to run (those that exist)")
    p.add_argument("--no-compile", action="store_true", help="leave the compiled runs out")
    p.add_argument("--budget-s", type=float, default=510.0, help="stop launching after this")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run each GPU count's launches this many times, alternating scalelab and the "
        "peer; the table gives each run's median and range (one launch can lose 10-17%%)",
    )
    p.add_argument(
        "--fsdp-unit-mb",
        default="",
        help="comma list: more scalelab fsdp runs, one per --fsdp-unit-mb value",
    )
    p.add_argument(
        "--grad-compress",
        default="",
        help="comma list (bf16, fp16): more scalelab ddp runs on 2+ GPUs, gradients all-reduced "
        "in that dtype (the peer's ddp+bf16grad is the bf16 one's peer)",
    )
    p.add_argument(
        "--peer-extra",
        default="",
        help="comma list: more peer runs (peer_gpt_train.py's names: fsdp+units3)",
    )
    p.add_argument("--cache-dir", type=Path, default=Path("/tmp/scalelab-inductor-cache"))
    p.add_argument("--worker", help=argparse.SUPPRESS)  # JSON: the runs of one launch
    return p.parse_args()


# --- one launch's scalelab runs (inside torchrun) -----------------------------------------------
def worker(spec: str) -> None:
    """Run every scalelab config of this launch in order, in this process."""
    import gc

    import torch

    from scalelab.config import RunConfig
    from scalelab.run.runner import execute

    job = json.loads(spec)
    for fields in job["runs"]:
        cfg = RunConfig(**{**fields, "model_arg": tuple(fields["model_arg"])})
        execute(cfg, Path(job["records"]))
        # each run compiles as a fresh process would (dynamo's in-process cache entries for
        # Module._call_impl would pile up over runs); Inductor's disk cache still serves
        torch._dynamo.reset()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def scalelab_fields(name: str, gpus: int, compile_: bool, shape: dict, device: str) -> dict:
    args = ("vocab", "seq", "width", "heads", "depth")
    steps = shape["warmup"] + shape["steps"]
    batch = shape["per_gpu"] * gpus
    return {
        **SCALELAB[name], "compile": compile_, "ranks": gpus, "device": device,
        "workload": "model", "model": f"{GPT}:gpt",
        "model_arg": [f"{k}={shape[k]}" for k in args],
        "input_shape": str(shape["seq"]), "input_dtype": "int64", "vocab": shape["vocab"],
        "train": True, "batch": batch, "train_size": batch * steps, "heldout_size": gpus,
        "steps": steps, "epochs": 1, "lr": LR, "momentum": MOMENTUM, "seed": 0, "quiet": True,
        "warmup": shape["warmup"],  # steady_throughput over the steps the peer times
    }  # fmt: skip


# --- the plan: launches per GPU count --------------------------------------------------------
def launches(a: argparse.Namespace, n: int, shape: dict, device: str) -> list[dict]:
    """One GPU count's launches, in order: scalelab eager, the peer, scalelab compiled."""
    compiled = not a.no_compile and (not a.smoke or a.smoke_compile)
    names = ["ddp", "fsdp", *(["local"] if n == 1 else [])]
    eager = [scalelab_fields(x, n, False, shape, device) for x in names]
    for mb in filter(None, a.fsdp_unit_mb.split(",")):
        fields = scalelab_fields("fsdp", n, False, shape, device)
        eager.append({**fields, "fsdp_unit_mb": float(mb)})
    for dtype in filter(None, a.grad_compress.split(",") if n > 1 else []):
        eager.append({**scalelab_fields("ddp", n, False, shape, device), "grad_compress": dtype})
    out = [{"what": f"scalelab eager x{n}", "gpus": n, "runs": eager}]
    fsdp = peer_name("fsdp").replace(" ", "+")
    peer_runs = ["ddp", fsdp, *(["ddp+compile", f"{fsdp}+compile"] if compiled else [])]
    peer_runs += list(filter(None, a.peer_extra.split(",")))
    out.append({"what": f"peer x{n}", "gpus": n, "peer": peer_runs})
    if compiled:
        runs = [scalelab_fields(x, n, True, shape, device) for x in names]
        out.append({"what": f"scalelab compiled x{n}", "gpus": n, "runs": runs})
    return out


def phases(counts: list[int], have: int, device: str) -> list[list[tuple[int, str | None]]]:
    """(GPU count, CUDA_VISIBLE_DEVICES) chains that run side by side, phase after phase.
    With 3+ GPUs the 1- and 2-GPU chains share a phase on disjoint GPUs (0; 1,2): each
    compiles while the other trains, which keeps the whole call inside the time budget."""
    if device != "cuda":
        return [[(n, None)] for n in counts]
    if 1 in counts and 2 in counts and have >= 3:
        rest = [[(n, ",".join(map(str, range(n))))] for n in counts if n > 2]
        return [[(1, "0"), (2, "1,2")], *rest]
    return [[(n, ",".join(map(str, range(n))))] for n in counts]


def run_chain(a, n: int, visible: str | None, shape: dict, device: str, t0: float) -> list:
    """The GPU count's launches, `--rounds` times over (round r: scalelab, the peer, ...)."""
    done = []
    for r in range(a.rounds):
        for launch in launches(a, n, shape, device):
            what = launch["what"] + (f" round {r + 1}" if a.rounds > 1 else "")
            left = a.budget_s - (time.perf_counter() - t0)
            if left < 20:
                done.append({"what": what, "rc": "skipped (time budget)"})
                continue
            log = a.out / "logs" / (what.replace(" ", "_") + ".log")
            done.append(run_launch({**launch, "what": what}, command(launch, a, shape), log,
                                   left, visible))  # fmt: skip
    return done


def command(launch: dict, a: argparse.Namespace, shape: dict) -> list[str]:
    n = launch["gpus"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc-per-node={n}"]  # fmt: skip
    if "peer" in launch:
        opts = [f"--{k.replace('_', '-')}={v}" for k, v in shape.items()]
        opts += [f"--lr={LR}", f"--momentum={MOMENTUM}", "--out", str(a.out / "peer.jsonl")]
        return [*torchrun, str(PEER), "--runs", ",".join(launch["peer"]), *opts]
    job = {"runs": launch["runs"], "records": str(a.out / "records.jsonl")}
    return [*torchrun, str(Path(__file__).resolve()), "--out", str(a.out), "--worker",
            json.dumps(job)]  # fmt: skip


def run_launch(launch: dict, cmd: list[str], log: Path, timeout: float, visible: str | None):
    """Run one launch in its own process group (killed whole past its timeout)."""
    t0 = time.perf_counter()
    env = dict(os.environ, **({"CUDA_VISIBLE_DEVICES": visible} if visible else {}))
    with open(log, "w") as f:
        proc = subprocess.Popen(
            cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True, env=env
        )
        try:
            rc = proc.wait(timeout=max(timeout, 1.0))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = "timeout"
    seconds = time.perf_counter() - t0
    print(f"  {launch['what']}: rc {rc}, {seconds:.0f} s", flush=True)
    return {"what": launch["what"], "rc": rc, "seconds": round(seconds, 1), "log": log.name}


# --- what the runs say ------------------------------------------------------------------------
def flops_per_sequence(s: dict) -> float:
    """Training FLOPs of one sequence: 3 x forward (a multiply-add is 2 FLOPs)."""
    w, t = s["width"], s["seq"]
    block = 2 * t * 12 * w * w + 4 * t * t * w  # qkv, proj, 4x MLP matmuls; QK^T and AV
    return 3 * (s["depth"] * block + 2 * w * s["vocab"])  # the head: the last position only


def collect(a: argparse.Namespace, shape: dict, peak: float | None) -> list[dict]:
    default = default_unit_mb()
    rows = []
    fps = flops_per_sequence(shape)
    records = a.out / "records.jsonl"
    for line in records.read_text().splitlines() if records.exists() else []:
        r = json.loads(line)
        c = r["config"]
        name = c["strategy"]
        if c["strategy"] == "fsdp" and c.get("fsdp_unit_mb") != default:
            name += f" unit_mb={c.get('fsdp_unit_mb', 0):g}"  # records before 200 was the default
        if c.get("grad_compress"):
            name += f" grad_compress={c['grad_compress']}"
        name += " compile" if c.get("compile") else ""
        rate = r.get("steady_throughput") if r.get("status") == "ok" else None
        rows.append(row("scalelab", name, c["ranks"], rate, shape, fps, peak, r))
    peer = a.out / "peer.jsonl"
    for line in peer.read_text().splitlines() if peer.exists() else []:
        r = json.loads(line)
        name = r["run"].replace("+", " ")
        rows.append(row("peer", name, r["gpus"], r["sequences_per_s"], shape, fps, peak, r))
    return rows


def row(who, name, gpus, rate, shape, fps, peak, raw) -> dict:
    out = {"who": who, "run": name, "gpus": gpus, "sequences_per_s": rate}
    if rate:
        out["tokens_per_s"] = rate * shape["seq"]
        out["mfu"] = rate * fps / gpus / peak if peak else None
    if who == "scalelab":
        out.update(status=raw.get("status"), compile=raw.get("compile"),
                   fsdp=raw.get("fsdp"), steady=raw.get("steady"))  # fmt: skip
    else:
        out.update(step_ms=raw["step_ms"], warmup_s=raw["warmup_s"])
    return out


def table(rows: list[dict], counts: list[int]) -> list[str]:
    """Markdown: one line per (who, run); seq/s per GPU count, efficiency, MFU, vs peer. A run
    measured in several rounds shows its median, and its range and count beside it."""
    by = {key: median_row(group) for key, group in grouped(rows).items()}
    kinds = sorted({(r["who"], r["run"]) for r in rows}, key=lambda k: (k[1], k[0] != "scalelab"))
    top = max(counts)
    at = [f"{what} at {top}" for what in ("eff.", "tokens/s", "MFU", "scalelab/peer")]
    head = ["who", "run", *[f"{n} GPU seq/s" for n in counts], *at]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for who, run in kinds:
        rates = [(by.get((who, run, n)) or {}).get("sequences_per_s") for n in counts]
        last = by.get((who, run, top)) or {}
        eff = ratio_of(rates[-1], top * rates[0] if rates[0] else None)
        base, compiled, _ = run.partition(" compile")
        peer_run = peer_name(base) + compiled
        peer = (by.get(("peer", peer_run, top)) or {}).get("sequences_per_s")
        ratio = ratio_of(rates[-1], peer) if who == "scalelab" else None
        cells = [
            who,
            run,
            *[fmt(x, 1) + spread(by.get((who, run, n)) or {}) for x, n in zip(rates, counts)],
            fmt(eff, 3),
            fmt(last.get("tokens_per_s"), 0),
            fmt(last.get("mfu"), 3),
            fmt(ratio, 3),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def grouped(rows: list[dict]) -> dict[tuple, list[dict]]:
    out: dict[tuple, list[dict]] = {}
    for r in rows:
        out.setdefault((r["who"], r["run"], r["gpus"]), []).append(r)
    return out


def median_row(group: list[dict]) -> dict:
    """The row of the median rate (the lower middle of an even count), with every round's
    rate in `rates`; a failed round (no rate) counts as none."""
    rated = sorted(
        (r for r in group if r.get("sequences_per_s")), key=lambda r: r["sequences_per_s"]
    )
    if not rated:
        return group[-1]
    return {**rated[(len(rated) - 1) // 2], "rates": [r["sequences_per_s"] for r in rated]}


def spread(row: dict) -> str:
    rates = row.get("rates") or []
    return f" ({rates[0]:,.1f}-{rates[-1]:,.1f}, n={len(rates)})" if len(rates) > 1 else ""


def peer_name(run: str) -> str:
    """The peer's run (names as in the table) that runs scalelab's `run` policy."""
    return PEER_OF.get(run, run).format(mb=default_unit_mb())


def default_unit_mb() -> float:
    """RunConfig's --fsdp-unit-mb default (scalelab imported only where it is read)."""
    from scalelab.config import RunConfig

    return RunConfig.__dataclass_fields__["fsdp_unit_mb"].default


def ratio_of(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def fmt(x: float | None, digits: int) -> str:
    return "–" if x is None else f"{x:,.{digits}f}"


def environment(device: str) -> dict:
    import torch

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
        return done.stdout.strip()

    gpu = torch.cuda.get_device_name(0) if device == "cuda" else None
    return {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        # a device copy can carry a stale .git: the commit it was made from wins where named
        "git_commit": os.environ.get("SCALELAB_GIT_COMMIT") or git("rev-parse", "HEAD"),
        "git_dirty": None if os.environ.get("SCALELAB_GIT_COMMIT") else bool(
            git("status", "--porcelain")),
        "torch": torch.__version__, "gpu": gpu,
        "gpus_visible": torch.cuda.device_count() if device == "cuda" else 0,
        "host": os.uname().nodename, "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE"),
    }  # fmt: skip


def main() -> None:
    a = parse()
    if a.worker:
        worker(a.worker)
        return
    t0 = time.perf_counter()
    import torch

    device = "cpu" if a.smoke or not torch.cuda.is_available() else "cuda"
    shape = SMOKE if device == "cpu" else FULL
    have = torch.cuda.device_count() if device == "cuda" else 2
    counts = [n for n in map(int, a.gpus.split(",")) if n <= have]
    (a.out / "logs").mkdir(parents=True, exist_ok=True)
    a.cache_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(a.cache_dir))
    os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")
    os.environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "1")
    env = environment(device)
    peak = None
    if device == "cuda":
        from scalelab.instrument.peaks import datasheet_peak

        found = datasheet_peak(env["gpu"])
        peak = found.bf16 if found else None
    done = []
    for phase in phases(counts, have, device):
        with ThreadPoolExecutor(len(phase)) as pool:
            chains = [pool.submit(run_chain, a, n, vis, shape, device, t0) for n, vis in phase]
            done += [d for c in chains for d in c.result()]
    rows = collect(a, shape, peak)
    meta = {**env, "device": device, "shape": shape, "gpu_counts": counts, "lr": LR,
            "momentum": MOMENTUM, "rounds": a.rounds,
            "flops_per_sequence": flops_per_sequence(shape),
            "peak_bf16_flops": peak, "launches": done,
            "wall_s": round(time.perf_counter() - t0, 1)}  # fmt: skip
    (a.out / "summary.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    md = [f"# Transformer training speed ({env['gpu'] or 'CPU smoke'}, {env['date']})", "",
          f"commit {env['git_commit'][:12]}{' (dirty)' if env['git_dirty'] else ''}, "
          f"torch {env['torch']}, shape {shape}, peak bf16 {peak}", "",
          *table(rows, counts), "", "launches: " + "; ".join(
              f"{d['what']}: {d['rc']}" for d in done)]  # fmt: skip
    (a.out / "summary.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
