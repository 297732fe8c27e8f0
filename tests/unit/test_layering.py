"""Only tandem.runner (plus test/bench tooling) may import mlx; the HTTP side never loads it."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "tandem"
TOOLING = {"testing", "bench"}


def imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_mlx_is_imported_only_under_runner():
    offenders = []
    for path in ROOT.rglob("*.py"):
        part = path.relative_to(ROOT).parts[0]
        if part in TOOLING or part == "runner":
            continue
        if any(m == "mlx" or m.startswith(("mlx.", "mlx_lm")) for m in imported_modules(path)):
            offenders.append(str(path.relative_to(ROOT)))
    assert offenders == []


def test_http_process_modules_load_without_mlx():
    code = (
        "import sys, tandem.server.app, tandem.server.serve, tandem.frontend.engine_client, "
        "tandem.frontend.tokenizer, tandem.engine.core_process, tandem.llm; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert out == "[]"
