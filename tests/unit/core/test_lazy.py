"""Areas export their public names lazily: every name resolves, and building the CLI imports no torch,
scipy or matplotlib (``steptune --help`` took 4.6 s when every area imported torch at registration)."""

import importlib
import subprocess
import sys

import pytest

AREAS = ("memory", "comm", "pipeline", "kernels", "resilience")


@pytest.mark.parametrize("area", AREAS)
def test_every_public_name_resolves(area):
    package = importlib.import_module(f"steptune.{area}")
    for name in package.__all__:
        assert getattr(package, name) is not None
        assert name in dir(package)
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        package.nope  # noqa: B018


def test_building_the_cli_imports_no_heavy_library():
    code = (
        "import sys, steptune.cli; steptune.cli.build_parser(); "
        "heavy = ('torch', 'scipy', 'matplotlib', 'numpy', 'transformers'); "
        "print(sorted(m for m in heavy if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
