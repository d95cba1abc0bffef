"""`make gpu-check` must run on its first try on a GPU image that has only torch, triton, numpy,
click, jinja2, tokenizers and safetensors: its dry run (`--device cpu --quick`, Triton interpreter)
goes through every section here, with any other third-party import by the project's code refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GPU_IMAGE_PACKAGES = ["torch", "triton", "numpy", "click", "jinja2", "tokenizers", "safetensors"]

GUARD = '''
import sys
ROOT = {root!r}
ALLOWED = set({allowed!r}) | {{"engine", "kernels", "scripts"}}


class _OnlyWhatTheGpuImageHas:
    """Refuse third-party imports made by the project's own files outside the GPU image's packages."""

    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        if path is not None or top in ALLOWED or top in sys.stdlib_module_names:
            return None
        frame = sys._getframe(1)
        while frame is not None and ("importlib" in frame.f_code.co_filename
                                     or frame.f_code.co_filename.startswith("<frozen")):
            frame = frame.f_back
        where = frame.f_code.co_filename if frame is not None else ""
        if where.startswith(ROOT) and "/.venv" not in where:
            raise ImportError(f"{{where}} imports {{name!r}}, which the GPU image does not have")
        return None


sys.meta_path.insert(0, _OnlyWhatTheGpuImageHas())
'''


@pytest.mark.slow
def test_dry_run_goes_through_every_section_with_only_the_gpu_image_packages(tmp_path):
    guard_dir = tmp_path / "guard"
    guard_dir.mkdir()
    (guard_dir / "sitecustomize.py").write_text(GUARD.format(root=str(ROOT), allowed=GPU_IMAGE_PACKAGES))
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "BATCHGEN_KERNELS")}
    env["PYTHONPATH"] = os.pathsep.join([str(guard_dir), str(ROOT)])
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "scripts/gpu_check.py", "--device", "cpu", "--quick", "--out",
                           str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    table = (out / "gpu_check.md").read_text()
    for section in ("kernels", "decode attention", "tuning", "engine toy"):
        assert f"| {section} |" in table, section
    assert "FAILED" not in table and "skipped" not in table
    data = json.loads((out / "gpu_check.json").read_text())
    assert all(row["ok"] for row in data["kernels"])
    step = data["engine/toy"]["decode_step"]
    assert step["syncs_explicit"] == 1.0
    engine = data["engine/toy"]
    assert engine["bench_t0.6"]["output_tokens"] == engine["bench_t0.0"]["output_tokens"]
    assert (out / "cpu.json").exists() and not (ROOT / "kernels" / "configs" / "cpu.json").exists()


def test_the_guard_refuses_what_the_image_lacks(tmp_path):
    """The guard itself: a project file importing a package outside the list fails the run."""
    guard_dir = tmp_path / "guard"
    guard_dir.mkdir()
    (guard_dir / "sitecustomize.py").write_text(GUARD.format(root=str(tmp_path), allowed=GPU_IMAGE_PACKAGES))
    (tmp_path / "probe.py").write_text("import duckdb\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(guard_dir), str(tmp_path)]))
    proc = subprocess.run([sys.executable, "-c", "import probe"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0 and "which the GPU image does not have" in proc.stderr
