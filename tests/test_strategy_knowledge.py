"""Nothing outside strategies/ compares a strategy's name with a literal: a caller asks the
strategy class (pipelined, shards_parameters, by_heads, traced_by_torch(cfg), ...) instead."""

import ast
from pathlib import Path

from scalelab.strategies import STRATEGIES

SRC = Path(__file__).resolve().parents[1] / "src" / "scalelab"


def _names(node: ast.AST) -> set[str]:
    """The registered strategy names a constant or a tuple/list/set of constants holds."""
    items = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
    return {e.value for e in items if isinstance(e, ast.Constant) and e.value in STRATEGIES}


def _mentions_strategy(node: ast.AST) -> bool:
    words = {getattr(s, "id", getattr(s, "attr", "")).lower() for s in ast.walk(node)}
    if any("launcher" in w or "backend" in w for w in words):  # "mpi" names a launcher too
        return False
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name) and "strategy" in sub.id.lower():
            return True
        if isinstance(sub, ast.Attribute) and "strategy" in sub.attr.lower():
            return True
        if isinstance(sub, ast.Constant) and sub.value == "strategy":  # out.get("strategy")
            return True
        if isinstance(sub, ast.Attribute) and sub.attr == "name" and _mentions_strategy(sub.value):
            return True
    return False


def name_comparisons(text: str) -> list[tuple[int, str]]:
    """Lines of `x.strategy == "fsdp"`, `strategy in ("ddp", "fsdp")` and the like."""
    lines = []
    for node in ast.walk(ast.parse(text)):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        for a, b in zip(sides, sides[1:]):
            if (_names(a) and _mentions_strategy(b)) or (_names(b) and _mentions_strategy(a)):
                lines.append((node.lineno, ast.unparse(node)))
    return lines


def test_the_check_catches_name_comparisons():
    for code in (
        "cfg.strategy == 'fsdp'",
        "strategy in ('ddp', 'fsdp')",
        "'pipeline' != args.strategy",
        "strategy.name != 'serial'",
        "out.get('strategy') == 'ddp'",
    ):
        assert name_comparisons(f"x = 1\nif {code}:\n    pass\n") == [(2, code)]
    assert name_comparisons('launcher == "mpi"\nbackend == "nccl"\n') == []


def test_no_strategy_name_is_compared_outside_strategies():
    found = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC)
        if rel.parts[0] == "strategies":
            continue
        for line, code in name_comparisons(path.read_text(encoding="utf-8")):
            found.append(f"src/scalelab/{rel}:{line}: {code}")
    assert not found, "ask the strategy class instead of comparing its name:\n" + "\n".join(found)


def test_the_analyses_roles_come_from_the_classes_traits():
    """What the report asks of a record's strategy (orchestration/strategy_roles.py): read
    off each registered class, so a plugin strategy with the trait plays the part too."""
    from scalelab.analysis.system_roofline import ceiling_backend
    from scalelab.orchestration.strategy_roles import strategy_roles

    roles = strategy_roles()
    assert roles.reference == {"serial"} and roles.plain_local == {"local"}
    assert roles.mpi_allreduce == {"mpi-dp"}
    from scalelab.record import read_records

    mpi = read_records(Path(__file__).parent / "fixtures" / "system_roofline.jsonl")  # mpi-dp
    ddp = [{**r, "strategy": "ddp"} for r in mpi]
    # the fixture's runs drove GPUs: the same runs under ddp all-reduced over NCCL
    assert [ceiling_backend(r, roles) for r in (mpi, ddp)] == ["mpi", "nccl"]
