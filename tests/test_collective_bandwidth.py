"""Collective bandwidth as nccl-tests defines it: algbw and busbw per collective, nccl-tests'
own output read into a ceilings file (and other text refused), and the five collectives of
`ceilings --comm-only` measured on 2 real gloo ranks."""

from __future__ import annotations

import json

import pytest

from scalelab.instrument.collective_bench import bandwidths, parse_nccl_tests
from timeline_helpers import _scalelab

# --- nccl-tests numbers -------------------------------------------------------------------------
NCCL_TESTS_OUT = """# Collective test starting: all_gather_perf
# nThread 1 nGpus 1 minBytes 8 maxBytes 1024 step: 2(factor) warmup iters: 5 iters: 20
#  Rank  0 Group  0 Pid   6899 on host device  0 [0000:04:00] NVIDIA H100 80GB HBM3
#  Rank  1 Group  0 Pid   6900 on host device  1 [0000:05:00] NVIDIA H100 80GB HBM3
#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong
        1024           128     float    none      -1    10.00    0.10    0.05      0     9.00    0.11    0.06      0
     1048576        131072     float    none      -1    20.00   52.43   26.21    N/A    19.00   55.19   27.59    N/A
"""  # noqa: E501


def test_bus_bandwidth_follows_nccl_tests_and_its_output_is_read():
    n = 8
    assert bandwidths("all_reduce", 10**9, 1.0, n) == (1e9, pytest.approx(1e9 * 2 * 7 / 8))
    assert bandwidths("broadcast", 10**9, 2.0, n) == (5e8, 5e8)
    assert bandwidths("alltoall", 10**9, 1.0, n)[1] == pytest.approx(1e9 * 7 / 8)
    name, ranks, rows = parse_nccl_tests(NCCL_TESTS_OUT)
    assert (name, ranks, len(rows)) == ("all_gather", 2, 2)
    assert rows[1] == {
        "bytes": 1048576,
        "time_s": pytest.approx(20e-6),
        "algbw_Bps": pytest.approx(52.43e9),
        "busbw_Bps": pytest.approx(26.21e9),
    }
    # nccl-tests' own numbers agree with the definitions: algbw = size / time, busbw = algbw/2
    assert rows[1]["bytes"] / rows[1]["time_s"] == pytest.approx(rows[1]["algbw_Bps"], rel=1e-3)
    assert bandwidths("all_gather", 1048576, 20e-6, 2)[1] == pytest.approx(26.21e9, rel=1e-3)


def test_nccl_tests_files_become_a_ceilings_source(cli, tmp_path):
    src = tmp_path / "all_gather_perf.txt"
    src.write_text(NCCL_TESTS_OUT.replace("# Collective test starting: all_gather_perf\n", ""))
    out = tmp_path / "c.json"
    code, stdout, err = cli("ceilings", "--nccl-tests", src, "-o", out)
    assert code == 0, err
    data = json.loads(out.read_text())
    assert data["collectives"]["nccl-tests"]["ops"]["all_gather"][0]["bytes"] == 1024
    assert "busbw" in stdout
    bad = tmp_path / "notes.txt"
    bad.write_text("hello\n")
    code, _, err = cli("ceilings", "--nccl-tests", bad, "-o", tmp_path / "d.json")
    assert code == 2 and "not nccl-tests output" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "d.json").exists()


@pytest.mark.mpi
def test_comm_only_ceilings_print_the_five_collectives_on_gloo(tmp_path):
    out = tmp_path / "c.json"
    proc = _scalelab(
        tmp_path,
        "ceilings",
        "--comm-only",
        "--ranks",
        "2",
        "--backend",
        "gloo",
        "--quick",
        "--quiet",
        "-o",
        out,
    )
    data = json.loads(out.read_text())["collectives"]["gloo"]
    assert data["ranks"] == 2
    for name in ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "alltoall"):
        rows = data["ops"][name]
        assert rows and all(r["algbw_Bps"] > 0 for r in rows)
        for r in rows:  # the definitions, from the stored time
            algbw, busbw = bandwidths(name, r["bytes"], r["time_s"], 2)
            assert r["algbw_Bps"] == pytest.approx(algbw) and r["busbw_Bps"] == pytest.approx(busbw)
        assert f"  {name}\n" in proc.stdout
    assert "algbw" in proc.stdout and "busbw" in proc.stdout
