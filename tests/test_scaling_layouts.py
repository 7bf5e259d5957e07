"""One config measured at 1 and 2 ranks on one node and at 2 ranks on two nodes: two series
(the node layouts), never one merged or one dropped, in `scaling`, the report's Scaling
section, its Versions table and its per-rank tables. Synthetic records (the checked-in
strong-scaling fixture, the two-node point a copy with a Slurm job of 2 nodes)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from scalelab.analysis.frame import sibling_labels
from scalelab.analysis.report import write_report
from scalelab.analysis.scaling import families, scaling_table
from scalelab.orchestration.strategy_roles import strategy_roles
from scalelab.record import read_records

FIXTURES = Path(__file__).parent / "fixtures"


def _mixed() -> list[dict]:
    one, two = (copy.deepcopy(r) for r in read_records(FIXTURES / "scaling_strong.jsonl")[:2])
    assert (one["ranks"], two["ranks"]) == (1, 2)  # s1: 8 s, s2a: 4.2 s, global batch 16
    across = copy.deepcopy(two)
    across.update(id="x2", wall_s=5.0, throughput=16 / 5.0)
    for rec, nodes in ((one, 1), (two, 1), (across, 2)):
        rec["slurm"] = {
            "job_id": rec["id"],
            "nodes": nodes,
            "node_list": ("n1", "n[1-2]")[nodes - 1],
        }
        rec.update(relerr=1e-7, check_passed=True, digest="d")
    return [one, two, across]


def test_node_layouts_stay_two_series(cli, tmp_path):
    recs = _mixed()
    assert sibling_labels(recs) == [
        "alexnet mpi fp32 cpu nodes=1 ranks=1",
        "alexnet mpi fp32 cpu nodes=1 ranks=2",
        "alexnet mpi fp32 cpu nodes=2 ranks=2",
    ]
    fams = families(recs)
    assert {k: [r["id"] for r in v] for k, v in fams.items()} == {
        "alexnet mpi fp32 cpu nodes=1": ["s1", "s2a"],
        "alexnet mpi fp32 cpu nodes=2": ["x2"],
    }
    t = scaling_table(recs)
    one = t[t["family"].str.endswith("nodes=1")].set_index("ranks")
    assert one["speedup"].tolist() == pytest.approx([1.0, 8 / 4.2])  # not 8 / 5.0
    assert t[t["family"].str.endswith("nodes=2")]["seconds"].tolist() == [5.0]

    res = tmp_path / "r.jsonl"
    res.write_text("".join(json.dumps(r) + "\n" for r in recs))
    code, out, err = cli("scaling", res, "-o", tmp_path / "s", "--no-plots")
    assert code == 0, err
    assert "no series has more than one rank count" not in out
    assert "nodes=1" in out and "(1 runs in series with a single rank count" in out

    page = write_report(recs, tmp_path / "rep", plots=False, roles=strategy_roles()).read_text()
    scaling = page.split('<section id="scaling">')[1].split("</section>")[0]
    assert "No series with more than one rank count" not in scaling
    assert "alexnet mpi fp32 cpu nodes=1" in scaling
    phases = page.split('<section id="phases">')[1].split("</section>")[0]
    for name in ("nodes=1 x1", "nodes=1 x2", "nodes=2 x2"):  # a per-rank table each
        assert phases.count(f"<h3>alexnet mpi fp32 cpu {name}</h3>") == 1, name
    versions = page.split('<section id="versions">')[1].split("</section>")[0]
    assert '">nodes</th>' in versions  # the two 2-rank rows told apart
