"""transformers must never take our top-level ``kernels`` package for the hub ``kernels`` one.

transformers (``utils/import_utils.py``, ``is_kernels_available``) looks for an importable
module named ``kernels`` and then for its version: first a distribution named ``kernels``, then
the distributions that ``importlib.metadata.packages_distributions()`` says provide it (for
this project: ``fkvstore``, whose editable install lists ``kernels`` among its top-level names),
and last ``kernels.__version__`` after importing it. The hub integration
(``integrations/hub_kernels.py``) switches on only if that version lies in
``[KERNELS_MIN_VERSION, KERNELS_MAX_VERSION)``. These tests run a real transformers model in a
fresh process with our package importable, once from the source tree and once through a real
editable install, and pin the version condition that keeps the two apart.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[2]

# run with -S: the environment's site-packages go on the path without their .pth files, so an
# editable install of this project there (its import hook) cannot answer for the one under test
PROBE = r"""
import importlib.util, json, site, sys
for d in SITE_DIRS:  # first: their .pth files import hooks whose module names ours share
    site.addsitedir(d)
sys.path.extend(BASE_DIRS)
import torch
import transformers
from transformers.utils import import_utils

spec = importlib.util.find_spec("kernels")
found, version = import_utils._is_package_available("kernels", return_version=True)
import transformers.integrations.hub_kernels  # noqa: F401  (must import cleanly)

torch.manual_seed(0)
config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=101, n_positions=64)
model = transformers.GPT2LMHeadModel(config).eval()
ids = torch.randint(0, 101, (2, 7))
with torch.no_grad():
    logits = model(ids).logits
    generated = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
print(json.dumps({
    "origin": spec.origin if spec else None,
    "found": found,
    "version": version,
    "hub_kernels_available": import_utils.is_kernels_available(),
    "logits_shape": list(logits.shape),
    "logits_finite": bool(torch.isfinite(logits).all()),
    "generated_shape": list(generated.shape),
    "kernels_imported_torch_free": "kernels._atomic" not in sys.modules,
}))
"""


def run_probe(site_dirs, pythonpath, cwd):
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    code = PROBE.replace("SITE_DIRS", repr([str(d) for d in site_dirs])).replace(
        "BASE_DIRS", repr(site.getsitepackages()))
    proc = subprocess.run([sys.executable, "-S", "-c", code], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def check_model_ran(result):
    assert result["hub_kernels_available"] is False
    assert result["logits_shape"] == [2, 7, 101] and result["logits_finite"]
    assert result["generated_shape"] == [2, 11]
    assert result["kernels_imported_torch_free"]


def test_model_runs_with_our_kernels_on_the_path(tmp_path):
    result = run_probe([], str(ROOT), tmp_path)
    assert result["origin"] == str(ROOT / "kernels" / "__init__.py")
    check_model_ran(result)


@pytest.mark.skipif(not all(importlib.util.find_spec(m) for m in ("pip", "setuptools", "wheel")),
                    reason="an editable install needs pip, setuptools and wheel offline")
def test_model_runs_with_the_project_installed_editable(tmp_path):
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for package in ("fkvstore", "model_adapters", "kernels"):
        shutil.copytree(ROOT / package, source / package,
                        ignore=shutil.ignore_patterns("__pycache__"))
    prefix = tmp_path / "prefix"
    installed_before = importable_elsewhere(tmp_path)
    # --ignore-installed: never uninstall the environment's own copy of the project
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
         "--no-index", "--ignore-installed", "--prefix", str(prefix), "-e", str(source)],
        capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stderr[-4000:]
    site_dirs = list(prefix.glob("lib*/python*/site-packages"))
    assert site_dirs, "the install wrote no site-packages"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    result = run_probe(site_dirs, None, elsewhere)
    assert result["origin"] == str(source / "kernels" / "__init__.py")
    # transformers reads the version of the distribution that ships `kernels`: ours
    assert result["found"] and result["version"] == project_version()
    check_model_ran(result)
    assert importable_elsewhere(tmp_path) == installed_before, \
        "installing into the prefix changed the environment's own install"


def importable_elsewhere(tmp_path) -> bool:
    """Whether this environment imports fkvstore from outside the repository (its install)."""
    away = tmp_path / "away"
    away.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", "import fkvstore, kernels"], cwd=away, env=env,
                          capture_output=True, timeout=120)
    return proc.returncode == 0


def project_version() -> str:
    text = (ROOT / "pyproject.toml").read_text()
    return re.search(r'^version\s*=\s*"([^"]+)"', text, re.MULTILINE).group(1)


def test_project_version_stays_outside_the_hub_kernels_range():
    # An installed fkvstore inside this range would make transformers import hub-kernels names
    # (`from kernels import get_kernel, ...`) from our package and fail: bump around it, or
    # rename the top-level package (see docs/kernels.md).
    from packaging.version import Version
    from transformers.utils.import_utils import KERNELS_MAX_VERSION, KERNELS_MIN_VERSION

    version = Version(project_version())
    assert not Version(KERNELS_MIN_VERSION) <= version < Version(KERNELS_MAX_VERSION)


def test_our_kernels_package_has_no_version_attribute():
    # transformers falls back to `kernels.__version__` when no distribution provides the name
    import kernels

    assert not hasattr(kernels, "__version__")


def test_importing_kernels_loads_neither_torch_nor_triton():
    # transformers may import the package just to look for a version: that must stay cheap
    code = "import sys, kernels; print(sorted(m for m in ('torch', 'triton') if m in sys.modules))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
