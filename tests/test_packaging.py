"""The layout and install promises: namespaced packages, one CLI, lean services."""

from __future__ import annotations

import ast
import shutil
import subprocess
import tomllib
import zipfile
from pathlib import Path

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


# --------------------------------------------------------------- the layout, kept true

SERVICE_PACKAGES = {"tandem." + s.replace("-", "_") for s in SERVICES}


def _package_folders() -> dict[str, Path]:
    """Every package pyproject ships -> its folder: package-dir, and a sub-package's
    folder inside its parent's (``tandem.cli.bench`` -> ``libs/cli/bench``)."""
    setup = _pyproject()["tool"]["setuptools"]
    mapping = setup["package-dir"]
    out = {}
    for pkg in setup["packages"]:
        parent = max((p for p in mapping if pkg == p or pkg.startswith(p + ".")), key=len)
        out[pkg] = ROOT / mapping[parent] / pkg.removeprefix(parent).lstrip(".").replace(
            ".", "/")
    return out


def _readme_table() -> list[tuple[str, str, str]]:
    """The rows of README's "Where things live" table: (folder, package or "-", what)."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Where things live\n", 1)[1]
    table = section[section.index("| folder | import package |"):].split("\n\n", 1)[0]
    rows = [[c.strip() for c in line.strip("|").split("|")]
            for line in table.splitlines()[2:]]
    return [(folder.strip("`"), pkg.strip("`"), what) for folder, pkg, what in rows]


def test_readme_first_lines_are_the_two_commands() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert lines[0] == "# Tandem" and lines[2] == "```sh"
    assert lines[3].startswith("make demo ") and lines[6].startswith("make test ")


def test_readme_where_things_live_matches_package_dir_and_the_tree() -> None:
    rows = _readme_table()
    for path, _, what in rows:
        assert (ROOT / path).exists(), f"README lists {path}, which does not exist"
        assert what, path
    listed = {pkg: (ROOT / folder.rstrip("/")) for folder, pkg, _ in rows if pkg != "-"}
    assert listed == _package_folders()
    # and every folder of libs/ and services/ holding code is one of them
    code_dirs = {p.parent for base in ("libs", "services")
                 for p in (ROOT / base).rglob("__init__.py")}
    assert code_dirs == set(listed.values())


def test_every_package_init_says_what_the_package_is_and_must_not_import() -> None:
    for pkg, folder in _package_folders().items():
        doc = ast.get_docstring(ast.parse((folder / "__init__.py").read_text()))
        assert doc and doc.strip().lower() != "placeholder", f"{pkg}/__init__.py"
        assert doc.startswith(pkg + ":") or doc.startswith("``tandem"), pkg
        if pkg in SERVICE_PACKAGES:
            assert "Imports only ``tandem.common``" in doc, pkg
        elif pkg in ("tandem.common", "tandem.cli"):
            assert "imports no service" in doc or "nothing imports it" in doc, pkg


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at module level or inside a function."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def _module_level_imports(path: Path) -> set[str]:
    out = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
    return out


def _within(name: str, packages: set[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def test_services_import_only_tandem_common_never_each_other_or_the_cli() -> None:
    folders = _package_folders()
    for pkg in SERVICE_PACKAGES:
        forbidden = (SERVICE_PACKAGES - {pkg}) | {"tandem.cli"}
        for path in folders[pkg].rglob("*.py"):
            bad = {m for m in _imports(path) if _within(m, forbidden)}
            assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


def test_common_imports_no_service_no_cli_and_torch_only_in_diffusion_and_dcp() -> None:
    folder = _package_folders()["tandem.common"]
    for path in folder.rglob("*.py"):
        bad = {m for m in _imports(path) if _within(m, SERVICE_PACKAGES | {"tandem.cli"})}
        assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"
        # Only the modules that services with torch import themselves may load it.
        if path.relative_to(folder).as_posix() not in ("diffusion.py", "checkpoints/dcp.py"):
            heavy = {m for m in _module_level_imports(path) if _within(m, set(HEAVY))}
            assert not heavy, f"{path.relative_to(ROOT)} imports {sorted(heavy)} at load"


def test_no_module_imports_another_modules_private_names() -> None:
    for base in ("libs", "services"):
        for path in (ROOT / base).rglob("*.py"):
            private = {m for m in _imports(path)
                       if m.startswith("tandem.")
                       and any(part.startswith("_") and not part.startswith("__")
                               for part in m.split("."))}
            assert not private, f"{path.relative_to(ROOT)} imports {sorted(private)}"


def test_contributing_says_how_to_run_one_service_test_and_bench_and_the_rules() -> None:
    text = (ROOT / "CONTRIBUTING.md").read_text()
    for heading in ("## Run one service", "## Run one test", "## Run one bench",
                    "## The rules of the house"):
        assert heading in text, heading
    for rule in ("One runner", "One bus", "Services import only `tandem.common`",
                 "No copy between services", "No sleeps in tests", "A flaky test is a bug",
                 "duplicates --change"):
        assert rule in text, rule


def test_the_wheel_ships_the_dashboard_and_the_stack_list_without_build_warnings(
        tmp_path: Path) -> None:
    """The images install the wheel (``pip install ".[<service>]"``, not editable): built
    from a copy of the sources, it holds the data files the services read at run time,
    and setuptools builds it without a warning about something it was not told of."""
    src = tmp_path / "src"
    src.mkdir()
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build")
    for name in ("libs", "services"):
        shutil.copytree(ROOT / name, src / name, ignore=skip)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    out = tmp_path / "dist"
    built = subprocess.run([PYTHON, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                            "--no-index", "-w", str(out), str(src)],
                           capture_output=True, text=True, timeout=240, check=False)
    said = built.stdout + built.stderr
    assert built.returncode == 0, said[-4000:]
    assert "Warning" not in said, said[-4000:]
    (wheel,) = out.glob("tandem-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    static = [p.name for p in (ROOT / "services/gateway/static").iterdir() if p.is_file()]
    assert static and {f"tandem/gateway/static/{n}" for n in static} <= names
    assert {"tandem/cli/stack.toml", "tandem/gateway/dashboard.py"} <= names
