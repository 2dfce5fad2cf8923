"""The layout and install promises: namespaced packages, one CLI, lean services."""

from __future__ import annotations

import subprocess
import tomllib

import pytest

from tests.conftest import PYTHON, ROOT

SERVICES = ["gateway", "trainer", "checkpointer", "inference-worker", "cluster-agent"]
LEAN = ["gateway", "checkpointer", "cluster-agent"]
HEAVY = ("torch", "diffusers", "transformers")


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_every_service_folder_is_a_namespaced_package_with_its_own_entry_points() -> None:
    mapping = _pyproject()["tool"]["setuptools"]["package-dir"]
    for svc in SERVICES:
        module = "tandem." + svc.replace("-", "_")
        assert mapping[module] == f"services/{svc}"
        folder = ROOT / "services" / svc
        for name in ("__main__.py", "service.py", "README.md"):
            assert (folder / name).is_file(), f"services/{svc}/{name} is missing"


@pytest.mark.parametrize("svc", LEAN)
def test_lean_services_neither_require_nor_import_torch(svc: str) -> None:
    extras = _pyproject()["project"]["optional-dependencies"]
    core = _pyproject()["project"]["dependencies"]
    assert not [d for d in extras[svc] + core if d.split(">")[0].split("=")[0] in HEAVY]
    module = "tandem." + svc.replace("-", "_") + ".service"
    code = (f"import sys, {module}; "
            f"print([m for m in {HEAVY!r} if m in sys.modules])")
    out = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, check=True,
                         timeout=120)
    assert out.stdout.strip() == "[]"


def test_one_cli_runs_every_service() -> None:
    out = subprocess.run([PYTHON, "-m", "tandem.cli.main", "run", "--help"],
                         capture_output=True, text=True, check=True, timeout=120)
    for svc in SERVICES:
        assert svc in out.stdout
    scripts = _pyproject()["project"]["scripts"]
    assert scripts == {"tandem": "tandem.cli.main:main"}


def test_torch_is_installed_first_and_pinned_overridably() -> None:
    makefile = (ROOT / "Makefile").read_text()
    assert "TORCH_SPEC ?= torch==2.13.0" in makefile
    torch_line = makefile.index("$(TORCH_SPEC)")
    assert torch_line < makefile.index("-e '.[dev]'")
