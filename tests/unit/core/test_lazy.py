"""Areas export their public names lazily: every name resolves, and building the CLI imports no torch,
scipy or matplotlib (``steptune --help`` took 4.6 s when every area imported torch at registration)."""

import importlib
import pkgutil
import subprocess
import sys
import types

import pytest

AREAS = ("memory", "comm", "pipeline", "kernels", "resilience")


@pytest.mark.parametrize("area", AREAS)
def test_every_public_name_resolves_to_the_object_not_a_submodule(area):
    package = importlib.import_module(f"steptune.{area}")
    # Every submodule first: importing steptune.pipeline.tune binds the module on the package, and the
    # exported function of the same name must win.
    for info in pkgutil.iter_modules(package.__path__, f"steptune.{area}."):
        if not info.ispkg and not info.name.rsplit(".", 1)[-1].startswith("_"):
            importlib.import_module(info.name)
    for name in package.__all__:
        value = getattr(package, name)
        assert value is not None and not isinstance(value, types.ModuleType), (name, value)
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
