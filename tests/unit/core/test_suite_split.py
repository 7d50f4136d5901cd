"""`make test` runs unit tests on 2 xdist workers unless tests/conftest.py lists them as serial: a unit file
that starts processes, rank groups or threads, or times itself, must be listed there."""

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[2]
# names in code (not in strings) that make a test sensitive to a second worker on 2 cores
SIGNS = {
    "subprocess", "Popen", "run_threads", "SpawnPool", "EvalPool", "start_context", "master_store",
    "TCPStore", "perf_counter", "monotonic", "time.time",
}  # fmt: skip


def _serial_files() -> set[str]:
    tree = ast.parse((TESTS / "conftest.py").read_text())
    for node in tree.body:
        names = [getattr(t, "id", "") for t in getattr(node, "targets", [])]
        if isinstance(node, ast.Assign) and "_SERIAL_FILES" in names:
            return set(ast.literal_eval(node.value))
    raise AssertionError("tests/conftest.py has no _SERIAL_FILES")


def _used(tree: ast.AST) -> set[str]:
    used = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            used.add(node.id)
        elif isinstance(node, ast.Attribute):
            used.add(node.attr)
            if isinstance(node.value, ast.Name):
                used.add(f"{node.value.id}.{node.attr}")
        elif isinstance(node, ast.Import | ast.ImportFrom):
            used.update(a.name for a in node.names)
    return used


def test_every_unit_file_that_starts_processes_or_reads_a_clock_is_serial():
    listed = _serial_files()
    missing = [
        rel
        for path in sorted((TESTS / "unit").rglob("test_*.py"))
        if (rel := path.relative_to(TESTS.parent).as_posix()) not in listed
        and _used(ast.parse(path.read_text())) & SIGNS
    ]
    assert not missing, f"add to _SERIAL_FILES in tests/conftest.py (or drop what they use): {missing}"
    stale = [f for f in listed if not (TESTS.parent / f).exists()]
    assert not stale, f"_SERIAL_FILES names files that do not exist: {stale}"


def test_the_check_sees_code_not_strings():
    code = "import subprocess\nimport time\nt = time.time()\nx = 'perf_counter'\n"
    assert _used(ast.parse(code)) & SIGNS == {"subprocess", "time.time"}
