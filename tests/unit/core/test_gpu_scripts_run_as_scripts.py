"""The GPU scripts run as `python benchmarks/gpu/<area>.py`, which puts their folder first on sys.path. Its
kernels.py then shadowed the `kernels` package that transformers probes for, and `import transformers`
failed inside benchmarks/gpu/memory.py (caught by its first dry run as a script, before an H200 run)."""

import subprocess
import sys
from pathlib import Path

import pytest

GPU = Path(__file__).resolve().parents[3] / "benchmarks" / "gpu"

CHECK = """
import runpy, sys
from pathlib import Path
gpu = Path(sys.argv[1])
for script in sorted(gpu.glob("*.py")):
    sys.path.insert(0, str(gpu))  # what `python benchmarks/gpu/<area>.py` does
    runpy.run_path(str(script), run_name="not_main")
    assert str(gpu) not in sys.path, script.name
import transformers.activations  # probes for a `kernels` package (hub kernels)
print("ok")
"""


@pytest.mark.timeout(120)
def test_each_gpu_script_drops_its_folder_so_transformers_imports() -> None:
    pytest.importorskip("transformers")
    done = subprocess.run(
        [sys.executable, "-c", CHECK, str(GPU)], capture_output=True, text=True, timeout=110
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
