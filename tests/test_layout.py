"""The package's layering: the core imports nothing from the application layer, and nothing imports in a cycle."""

from __future__ import annotations

import ast
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import megatrain_lightning

CORE = ("engine", "store", "optim", "serialization")
APPLICATION = ("megatrain_lightning.models", "megatrain_lightning.cli", "megatrain_lightning.train",
               "megatrain_lightning.hf_trainer", "megatrain_lightning.hf_args",
               "megatrain_lightning.data")  # fmt: skip
PACKAGE = Path(megatrain_lightning.__file__).parent
MAX_LINES = 460


def _modules() -> dict[str, Path]:
    found = {}
    for info in pkgutil.walk_packages([str(PACKAGE)], prefix="megatrain_lightning."):
        if info.ispkg:
            path = PACKAGE / Path(*info.name.split(".")[1:]) / "__init__.py"
        else:
            path = PACKAGE / Path(*info.name.split(".")[1:]).with_suffix(".py")
        if path.exists():
            found[info.name] = path
    return found


def _imports_at_import_time(path: Path, package: str) -> set[str]:
    """Project modules imported at module level (not inside functions, not under TYPE_CHECKING)."""
    imported = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        for sub in ast.walk(node) if not isinstance(node, (ast.FunctionDef, ast.ClassDef)) else ():
            if isinstance(sub, ast.ImportFrom) and sub.level == 0 and (sub.module or "").startswith(package):
                imported.add(sub.module)
                imported.update(f"{sub.module}.{alias.name}" for alias in sub.names)
            elif isinstance(sub, ast.Import):
                imported.update(a.name for a in sub.names if a.name.startswith(package))
    return imported


def _foreign_modules(imports: str) -> set[str]:
    """The torchmetrics, hydra and application-layer modules loaded by ``imports``, in a fresh process,
    with the package's ``__init__`` (which registers the strategy and exports the app's API) skipped."""
    stub = "import sys, types; sys.modules['megatrain_lightning'] = types.ModuleType('megatrain_lightning'); "
    stub += f"sys.modules['megatrain_lightning'].__path__ = [{str(PACKAGE)!r}]\n"
    show = (
        "print(repr(sorted(m for m in sys.modules if m.split('.')[0] in ('torchmetrics', 'hydra')"
        f" or m in {APPLICATION!r})))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", stub + imports + show], capture_output=True, text=True, check=True
    )
    return set(ast.literal_eval(out.stdout.strip().splitlines()[-1]))


def test_the_core_imports_no_application_layer():
    core = "".join(
        f"import megatrain_lightning.{name}\n"
        for name in (
            "engine.runtime",
            "store.disk",
            "optim.adamw",
            "optim.rebuild",
            "serialization.checkpoint",
            "serialization.export",
            "serialization.initialization",
        )  # fmt: skip
    )
    # Lightning itself imports torchmetrics: only what the core adds to that counts.
    lightning = _foreign_modules("import lightning.fabric.utilities.exceptions\n")
    assert _foreign_modules(core) - lightning == set()


def test_no_import_cycles():
    modules = _modules()
    graph = {name: {m for m in _imports_at_import_time(path, "megatrain_lightning") if m in modules}
             for name, path in modules.items()}  # fmt: skip
    for name in graph:  # a module's package __init__ runs first: an edge to it too
        graph[name] -= {name}
    visiting, done, cycles = [], set(), []

    def visit(node: str) -> None:
        if node in done:
            return
        if node in visiting:
            cycles.append(visiting[visiting.index(node) :] + [node])
            return
        visiting.append(node)
        for nxt in sorted(graph[node]):
            visit(nxt)
        visiting.pop()
        done.add(node)

    for node in sorted(graph):
        visit(node)
    assert not cycles, f"import cycles: {cycles}"


def test_no_module_holds_more_than_one_person_can_read_at_once():
    kernel = {path.name: path for path in (PACKAGE / "optim" / "csrc").iterdir()}
    long = {
        name: n
        for name, path in {**_modules(), **kernel}.items()
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_every_file_the_package_reads_is_package_data():
    """An editable install reads files from the checkout; a wheel holds only what ``package-data`` names
    (globbed as setuptools globs them: ``**`` is any number of folders)."""
    tomllib = pytest.importorskip("tomllib")
    with open(PACKAGE.parent / "pyproject.toml", "rb") as f:
        patterns = tomllib.load(f)["tool"]["setuptools"]["package-data"]["megatrain_lightning"]
    packaged = {path for pattern in patterns for path in PACKAGE.glob(pattern)}
    read = [
        *(PACKAGE / "optim" / "csrc").iterdir(),
        *(PACKAGE / "data").iterdir(),
        *(PACKAGE / "configs").rglob("*.yaml"),
    ]
    left_out = [str(path.relative_to(PACKAGE)) for path in read if path not in packaged]
    assert not left_out, f"not in package-data: {left_out}"
