"""The example GPT's model parallelism on 2 and 4 GPUs: predictions first, then measurements.

    python benchmarks/predict_model_parallel.py predict [--out DIR]
        predictions from the committed calibration (1-2 GPUs: the GPT runs of
        results/holdout_events_clock_mpi_h200x2_2026-11-26, the 4x H200 ceilings) for
        pipeline (4 and 2 stages, 1F1B, 8 micro-batches), tensor (tp 2, 4) and dp 2 x tp 2,
        all at global batch 32, into DIR/predictions.txt (committed before any of them is
        measured: benchmarks/results/model_parallel/predictions.txt)
    python benchmarks/predict_model_parallel.py measure --out DIR [--gpus 4] [--smoke]
        on the GPU host, in one call: (1) the one-rank torch-engine pipeline run that
        calibrates the runtime's forward host work (GPipe, 8 micro-batches of 4), (2) the
        predictions again with it (DIR/predictions_recalibrated.txt), (3) every target
        configuration measured into DIR/measured.jsonl, (4) DIR/compare.txt: each target's
        committed and recalibrated prediction beside its measurement. --smoke: a tiny GPT on
        CPU (gloo), to check the script end to end.

Each run is `scalelab run` (torchrun for several ranks), steady step timed by the run itself.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CAL = Path("benchmarks/results/holdout_events_clock_mpi_h200x2_2026-11-26")  # from ROOT
CAL = CAL / "gpt_calibration_complete.jsonl"
CEILINGS = Path("benchmarks/results/ceilings_h200x4.json")
BANDS = Path("benchmarks/results/validate/bands.json")  # predict --validate benchmarks/results
GPT = ["--model", "examples/models/gpt.py:gpt", "--model-arg", "vocab=4096", "--model-arg",
       "seq=512", "--model-arg", "width=768", "--model-arg", "heads=12", "--model-arg",
       "depth=12", "--input-shape", "512", "--input-dtype", "int64", "--vocab", "4096"]  # fmt: skip
TINY = ["--model", "examples/models/gpt.py:gpt", "--model-arg", "vocab=64", "--model-arg",
        "seq=16", "--model-arg", "width=32", "--model-arg", "heads=4", "--model-arg",
        "depth=4", "--input-shape", "16", "--input-dtype", "int64", "--vocab", "64"]  # fmt: skip
BATCH = 32
# name -> (the strategy's flags, the rank counts predicted and measured)
TARGETS: dict[str, tuple[list[str], list[int]]] = {
    "pipeline-1f1b": (
        [
            "--strategy",
            "pipeline",
            "--engine",
            "torch",
            "--schedule",
            "1f1b",
            "--microbatches",
            "8",
        ],
        [2, 4],
    ),  # fmt: skip
    "tensor": (["--strategy", "tensor", "--engine", "torch"], [2, 4]),
    "dp2-tp2": (["--strategy", "tensor", "--engine", "torch", "--dp", "2"], [4]),
}
# the one-rank run that calibrates torch pipelining's forward host work (GPipe: the host
# issues the 8 forwards back to back, so a host-bound forward shows in its action times)
HOST_CAL = ["--strategy", "pipeline", "--engine", "torch", "--schedule", "gpipe",
            "--microbatches", "8", "--ranks", "1", "--stages", "1"]  # fmt: skip


def scalelab(args: list[str], **kw) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), NCCL_NVLS_ENABLE="0")
    cmd = [sys.executable, "-m", "scalelab", *args]
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, cwd=ROOT, env=env, text=True, **kw)


def predict(cal: Path, out: Path, gpus: list[int], model: list[str], device: str) -> str:
    """Every target's prediction at `gpus` ranks, one table per target, as one text."""
    parts = []
    for name, (flags, ranks) in TARGETS.items():
        want = ",".join(str(n) for n in ranks if n in gpus)
        if not want:
            continue
        args = ["predict", *model, "--train", "--device", device, *flags, "--batch", str(BATCH),
                "--ranks", want, "--gpus-per-node", str(max(gpus)),
                "--ceilings", str(CEILINGS), "--calibrate", str(cal),
                "--bands", str(BANDS)]  # fmt: skip
        dest = os.path.relpath(out / name, ROOT)
        done = scalelab([*args, "-o", dest], capture_output=True)
        parts.append(f"## {name}\n$ scalelab {' '.join(args)}\n{done.stdout}{done.stderr}")
    return "\n".join(parts)


def measure(out: Path, gpus: int, smoke: bool) -> None:
    model, device = (TINY, "cpu") if smoke else (GPT, "cuda")
    common = [*model, "--train", "--device", device, "--batch", str(BATCH), "--train-size",
              str(BATCH * 10), "--epochs", "1", "--quiet"]  # fmt: skip
    folder = out / "calibration"  # the committed GPT runs and the host-work run beside them
    folder.mkdir(parents=True, exist_ok=True)
    if not smoke:
        shutil.copy(CAL, folder / CAL.name)
    scalelab(["run", *common, *HOST_CAL, "--out", str(folder / "host.jsonl")], check=True)
    (out / "predictions_recalibrated.txt").write_text(
        predict(folder, out / "predict", [2, gpus], model, device)
    )
    for flags, ranks in TARGETS.values():
        for n in (r for r in ranks if r <= gpus):
            shape = ["--stages", str(n)] if "pipeline" in flags else []
            scalelab(["run", *common, *flags, *shape, "--ranks", str(n), "--out",
                      str(out / "measured.jsonl")])  # fmt: skip
    compare(out)


def compare(out: Path) -> None:
    """Each measured target's steady step beside the rows of the recalibrated predictions."""
    lines = []
    for line in (out / "measured.jsonl").read_text().splitlines():
        rec = json.loads(line)
        cfg, steady = rec["config"], rec.get("steady") or {}
        step = steady.get("seconds", 0) / max(1, steady.get("steps", 1)) * 1e3
        what = f"{cfg['strategy']} ranks={rec['ranks']} dp={cfg.get('dp')} {cfg.get('schedule')}"
        lines.append(f"{what}: measured {step:.4g} ms/step ({rec.get('steady_throughput')})")
    (out / "compare.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=["predict", "measure"])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/model_parallel"))
    ap.add_argument("--gpus", type=int, default=4)
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args()
    a.out = a.out.resolve()
    os.chdir(ROOT)  # the committed files' paths below are relative to the checkout
    a.out.mkdir(parents=True, exist_ok=True)
    if a.mode == "predict":
        text = predict(CAL, a.out / "predict", [2, a.gpus], GPT, "cuda")
        (a.out / "predictions.txt").write_text(text)
        print(text)
    else:
        measure(a.out, a.gpus, a.smoke)


if __name__ == "__main__":
    main()
