"""`scalelab ceilings`: measure this machine's ceilings and write ceilings.json.

GEMM rate per dtype, device-memory and host<->device bandwidth, NumPy GEMM and copy on one
core and all cores, how much k single-threaded processes computing at once slow each other;
with `--ranks N` also MPI (mpiexec) or gloo/NCCL (torchrun) all-reduce and point-to-point
latency and bandwidth by message size. The file's format is documented in
scalelab.instrument.ceilings. `--peaks` prints the cited datasheet table instead.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from scalelab.cli.base import COMMANDS, Command
from scalelab.cli.commands import ceilings_collectives as coll
from scalelab.comm.launch import inside_launcher
from scalelab.environment import usable_cpus
from scalelab.errors import UsageError
from scalelab.instrument import ceilings as C
from scalelab.instrument.ceiling_checks import flag_moved, self_check
from scalelab.instrument.collective_bench import measure_collectives
from scalelab.instrument.comm_bench import measure_comm, message_sizes
from scalelab.instrument.host_checks import HostProbe, load_warning
from scalelab.instrument.peaks import PEAKS
from scalelab.instrument.progress import Progress
from scalelab.orchestration.jobs import relaunch

LAUNCHERS = {"mpi": "mpi", "gloo": "torchrun", "nccl": "torchrun"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "-o", "--out", default=str(C.DEFAULT_PATH), help=f"output (default: {C.DEFAULT_PATH})"
    )
    p.add_argument("--quick", action="store_true", help="smaller sizes, fewer repeats (seconds)")
    p.add_argument(
        "--device", choices=("cpu", "cuda"), help="where to time GEMM and copies (default: cuda "
        "when a GPU is visible)",
    )  # fmt: skip
    p.add_argument(
        "--ranks", type=int, default=None,
        help="also time communication over N ranks (default: 2 MPI ranks when MPI is installed)",
    )  # fmt: skip
    p.add_argument("--no-comm", action="store_true", help="time no communication")
    p.add_argument(
        "--backend", choices=tuple(LAUNCHERS), default="mpi",
        help="communication library for --ranks: mpi (mpiexec), gloo or nccl (torchrun)",
    )  # fmt: skip
    p.add_argument(
        "--comm-only", action="store_true",
        help="time only communication; keep the other sections of an existing --out file",
    )  # fmt: skip
    coll.add_arguments(p)
    p.add_argument("--peaks", action="store_true", help="print the datasheet peaks and exit")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    p.add_argument("--comm-result", help=argparse.SUPPRESS)  # set by the relaunch, per rank


def run(args: argparse.Namespace) -> int:
    if args.peaks:
        print(format_peaks())
        return 0
    default_comm = args.ranks is None
    if default_comm:
        args.ranks = 2 if not args.no_comm and args.backend == "mpi" and mpi_available() else 1
    elif args.no_comm:
        raise UsageError("--no-comm and --ranks contradict each other; give one")
    if args.ranks < 1:
        raise UsageError(f"--ranks must be >= 1, got {args.ranks}")
    if args.comm_result or (args.ranks > 1 and inside_launcher(LAUNCHERS[args.backend])):
        return comm_rank(args)
    if args.nccl_tests:
        data = coll.read_nccl_tests(args, kept_from(Path(args.out)))
        C.write_ceilings(args.out, data)
        coll.print_collectives(data)
        return 0
    if args.comm_only and args.ranks < 2:
        raise UsageError("--comm-only times communication: give --ranks N (N >= 2)")
    if args.backend == "nccl" and args.ranks > torch.cuda.device_count():
        raise UsageError(
            f"--backend nccl needs a GPU per rank: {args.ranks} ranks, "
            f"{torch.cuda.device_count()} GPUs visible"
        )
    device = pick_device(args.device)
    probe = HostProbe.start()
    previous = kept_from(Path(args.out))
    if args.comm_only:
        data = previous or C.new_ceilings(None)
    else:
        data = C.new_ceilings(C.measure_local(device, args.quick, args.quiet))
        checked_local(data, device, args.quick)
        flag_moved(data, previous)  # against the file it replaces: same host, across runs
        data["comm"] = {k: v for k, v in previous.get("comm", {}).items() if k != args.backend}
    if args.ranks > 1:
        comm = default_mpi(args) if default_comm else launch_comm(args)
        if comm is not None:
            coll.file_comm(data, args.backend, comm)
    if not data.get("comm"):
        data.pop("comm", None)
    busy = load_warning(probe.host_load(probe.own_cpu_s()), need_cpus=usable_cpus())
    if busy:  # a ceiling is what a quiet machine reaches: these may be low
        data["warnings"] = [*data.get("warnings", []), *busy]
    C.write_ceilings(args.out, data)
    print(format_summary(data, args.out))
    if data.get("warnings"):  # said in full once, in the summary's WARNING lines above
        n = len(data["warnings"])
        sys.stderr.write(
            f"scalelab ceilings: warning: {n} figure(s) suspect: the summary's WARNING lines "
            f"and the file's `warnings` say which\n"
        )
    if args.comm_only:
        coll.print_collectives(data)
    return 0


def mpi_available() -> bool:
    from scalelab.environment import mpi_problem

    if mpi_problem() is not None:  # mpi4py missing, or no MPI library it can load
        return False
    try:
        from scalelab.comm.launch import find_mpiexec

        find_mpiexec()
    except (ImportError, UsageError):
        return False
    return True


def default_mpi(args: argparse.Namespace) -> dict[str, Any] | None:
    """The MPI alpha-beta measured by default (2 ranks): a failure there is a warning, not
    the end of the local ceilings already measured."""
    try:
        return launch_comm(args)
    except UsageError as exc:
        sys.stderr.write(f"scalelab ceilings: warning: no MPI alpha-beta: {exc}\n")
        return None


def checked_local(data: dict[str, Any], device: torch.device, quick: bool) -> None:
    """Sanity relations on the local sections; re-measure what breaks one (ceiling_checks)."""
    plan = C.Plan.make(device, quick)
    names = [n for n in (data.get("gemm_flops") or {}) if n != "detail"]
    names = [n for n in names if not (device.type == "cpu" and n == "tf32")]
    remeasure = {
        "gemm": lambda: {"gemm_flops": C.gemm_flops(device, plan, names)},
        "host": lambda: C.host_ceilings(plan),
    }
    self_check(data, remeasure)
    if device.type == "cpu":
        data["gemm_flops"]["tf32"] = data["gemm_flops"]["fp32"]


def pick_device(name: str | None) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA GPU is visible to torch on this machine")
    if name is None:
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def kept_from(path: Path) -> dict[str, Any]:
    """An existing ceilings file of this host, whose comm entries a new run keeps."""
    if not path.exists():
        return {}
    data = C.read_ceilings(path)  # refuses to overwrite something that is not ours
    host = data.get("machine", {}).get("hostname")
    if host == C.machine_fingerprint()["hostname"]:
        return data
    sys.stderr.write(f"scalelab ceilings: replacing {path}, measured on {host}\n")
    return {}


# --- communication -------------------------------------------------------------------------
def launch_comm(args: argparse.Namespace) -> dict[str, Any]:
    """Re-run this command under the launcher; rank 0 leaves its result in a temp file."""
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "comm.json"
        argv = ["ceilings", "--ranks", str(args.ranks), "--backend", args.backend]
        argv += ["--comm-result", str(result)] + ["--quick"] * args.quick + ["--quiet"] * args.quiet
        argv += ["--comm-only"] * args.comm_only  # the collectives too
        code = relaunch(LAUNCHERS[args.backend], args.ranks, argv)
        if code != 0 or not result.exists():
            raise UsageError(
                f"the {args.ranks}-rank {args.backend} measurement failed (exit code {code}); "
                "its ranks' messages are above"
            )
        return json.loads(result.read_text())


def make_comm(backend: str):
    if backend == "mpi":
        from scalelab.comm.mpi import MPIComm

        return MPIComm()
    from scalelab.comm.torchdist import TorchDistComm

    return TorchDistComm(backend)


def comm_device(comm) -> torch.device:
    if comm.device == "cuda":
        return torch.device("cuda", comm.local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def comm_plan(device: torch.device, quick: bool) -> tuple[list[int], float, int]:
    """(message sizes, seconds per timed block, blocks): 8 B up to 256 MiB on GPUs, 16 MiB
    on host buffers; --quick stops at 16 / 1 MiB and steps by 16x instead of 4x."""
    largest = (16 if quick else 256) if device.type == "cuda" else (1 if quick else 16)
    sizes = message_sizes(largest << 20, factor=16 if quick else 4)
    return (sizes, 0.003, 3) if quick else (sizes, 0.01, 5)


def comm_rank(args: argparse.Namespace) -> int:
    """One rank of the communication measurement (every rank runs this)."""
    comm = make_comm(args.backend)
    try:
        if comm.size < 2:
            raise UsageError("communication ceilings need at least 2 ranks")
        device = comm_device(comm)
        sizes, block, repeats = comm_plan(device, args.quick)
        progress = Progress(2 * len(sizes), f"{args.backend} x{comm.size}",
                            enabled=comm.is_root and not args.quiet)  # fmt: skip
        result = measure_comm(comm, device, sizes, block, repeats, progress)
        if args.comm_only:  # nccl-tests' collectives (every rank takes part)
            ops = measure_collectives(comm, device, sizes, block, repeats)
            result = result if result is None else {**result, "collectives": ops}
        if result is not None:
            finish_comm_root(args, result)
    except BaseException as exc:
        if comm.size > 1 and not isinstance(exc, SystemExit):
            comm.abort(getattr(exc, "exit_code", 1))
        raise
    finally:
        comm.close()
    return 0


def finish_comm_root(args: argparse.Namespace, result: dict[str, Any]) -> None:
    if args.comm_result:
        Path(args.comm_result).write_text(json.dumps(result))
        return
    data = kept_from(Path(args.out)) or C.new_ceilings(None)  # started by the user's launcher
    coll.file_comm(data, args.backend, result)
    C.write_ceilings(args.out, data)
    print(format_summary(data, args.out))


# --- printing ------------------------------------------------------------------------------
def _si(x: float | None, unit: str) -> str:
    if x is None:
        return "-"
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.3g} {prefix}{unit}"
    return f"{x:.3g} {unit}"


def _vs_peak(measured: float, peak: float | None, unit: str = "FLOP/s") -> str:
    if not peak:
        return ""
    return f"   datasheet {_si(peak, unit)}: {measured / peak:.0%}"


def format_summary(data: dict[str, Any], path: str) -> str:
    m, peak = data["machine"], data.get("peaks", {})
    gpu = f"{m['gpu_count']}x {m['gpu']}" if m["gpu"] else "no GPU"
    lines = [f"ceilings of {m['hostname']} ({m['cpu']}, {m['cpu_cores']} cores; {gpu})"]
    for name, rate in data.get("gemm_flops", {}).items():
        if name != "detail":
            lines.append(f"  GEMM {data['device']} {name:<5} {_si(rate, 'FLOP/s'):>14}"
                         + _vs_peak(rate, peak.get(name)))  # fmt: skip
    if "mem_bw" in data:
        lines.append(f"  memory copy     {_si(data['mem_bw'], 'B/s'):>14}"
                     + _vs_peak(data["mem_bw"], peak.get("mem_Bps"), "B/s"))  # fmt: skip
    for way in ("h2d", "d2h"):
        if way in data:
            pin, page = data[way]["pinned"], data[way]["pageable"]
            lines.append(f"  {way} pinned {_si(pin, 'B/s')}, pageable {_si(page, 'B/s')}")
    if "cpu_gemm_flops" in data:
        g, b = data["cpu_gemm_flops"], data["cpu_mem_bw"]
        lines.append(f"  NumPy fp64 GEMM one core {_si(g['one_core'], 'FLOP/s')}, "
                     f"{g['cores']} cores {_si(g['all_cores'], 'FLOP/s')}")  # fmt: skip
        lines.append(f"  NumPy copy      one core {_si(b['one_core'], 'B/s')}, "
                     f"all cores {_si(b['all_cores'], 'B/s')}")  # fmt: skip
    if "cpu_concurrency" in data:
        c = data["cpu_concurrency"]
        shown = ", ".join(f"{k}: x{x:.2f}" for k, x in zip(c["ranks"], c["slowdown"]))
        lines.append(f"  CPU processes at once, slowdown per process {shown}")
    for backend, res in data.get("comm", {}).items():
        for op in ("allreduce", "p2p"):
            lines.append(f"  {backend} x{res['ranks']} {op:<9} alpha {res[op]['alpha_s'] * 1e6:.3g}"
                         f" us, beta {_si(res[op]['beta_Bps'], 'B/s')}")  # fmt: skip
    if "passes" in data:
        passes = ", ".join(f"{k} {v}" for k, v in data["passes"].items())
        lines.append(f"  passes per section (best of each kept): {passes}")
    for warning in data.get("warnings") or []:
        lines.append(f"  WARNING: {warning}")
    lines.append(f"  written to {path}")
    return "\n".join(lines)


def format_peaks() -> str:
    head = f"{'device':<24}{'fp64':>7}{'fp32':>7}{'tf32':>7}{'bf16':>7}{'fp16':>7}{'HBM':>8}"
    lines = [head + "  (dense TFLOP/s, TB/s)"]
    cell = lambda x, s=1e12: f"{x / s:>7.4g}" if x else f"{'-':>7}"  # noqa: E731
    for r in PEAKS:
        lines.append(f"{r.name:<24}{cell(r.fp64)}{cell(r.fp32)}{cell(r.tf32)}{cell(r.bf16)}"
                     f"{cell(r.fp16)} {cell(r.mem_Bps)}")  # fmt: skip
    lines.append("sources:")
    lines += [f"  {s}" for s in dict.fromkeys(r.source for r in PEAKS)]
    return "\n".join(lines)


COMMANDS.register("ceilings", "measure this machine's GEMM, memory and network ceilings")(
    Command(add_arguments, run)
)
