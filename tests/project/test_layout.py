"""The layout holds: folders by role, imports one way, every KV cache in roseinfer/cache/,
and the packages a user installs hold neither the course's nor the benchmarks' code.

Read from the source with `ast` (nothing is imported, so this runs in a blink): the
module-level import graph of the three packages counts every import a module can run,
at its top, under `if TYPE_CHECKING:` or inside a function, and importing `a.b.c` counts
as importing the packages `a` and `a.b` too (Python runs their `__init__` first).
"""

from __future__ import annotations

import ast
import re
import subprocess
from functools import cache
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("rosetrainer", "roseinfer", "rosecourse")
CACHE_FOLDER = "roseinfer.cache"
# The folders of the builds whose learner writes a cache (the cached loop's static cache, the
# verify step's cache that rolls back) hold caches written as a learner writes them, in the
# reference and in the wrong answers beside it: the course's answers, not rose's caches.
LEARNERS_CACHES = ("rosecourse.builds.cached_loop.", "rosecourse.builds.verify.")
OUT = re.compile(r"--out[ =]([\w./-]+)")  # where a documented export writes


@cache
def modules() -> dict[str, ast.Module]:
    """Every first-party module by dotted name (a package by its own name), parsed."""
    found = {}
    for package in PACKAGES:
        for path in sorted((REPO_ROOT / package).rglob("*.py")):
            parts = path.relative_to(REPO_ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = ast.parse(path.read_text(encoding="utf-8"), str(path))
    return found


def imported_names(module: str, tree: ast.Module) -> set[str]:
    """The first-party modules `module` can import, wherever the import statement sits."""
    known = modules()
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the importer's package
                package = module.split(".")
                is_package = module in known and _is_package(module)
                anchor = package[: len(package) - node.level + (1 if is_package else 0)]
                base = ".".join(anchor + ([base] if base else []))
            names.add(base)
            # `from pkg import mod` imports the module pkg.mod
            names.update(f"{base}.{alias.name}" for alias in node.names)
    edges = set()
    for name in names:
        parts = name.split(".")
        for stop in range(1, len(parts) + 1):
            target = ".".join(parts[:stop])
            # A package the importer sits in is being imported already: no edge to it.
            if target in known and target != module and not module.startswith(target + "."):
                edges.add(target)
    return edges


def _is_package(module: str) -> bool:
    return (REPO_ROOT / module.replace(".", "/") / "__init__.py").is_file()


@cache
def import_graph() -> dict[str, frozenset[str]]:
    return {name: frozenset(imported_names(name, tree)) for name, tree in modules().items()}


def cycles(graph: dict[str, frozenset[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def classes() -> list[tuple[str, ast.ClassDef]]:
    return [
        (module, node)
        for module, tree in modules().items()
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef)
    ]


def base_names(node: ast.ClassDef) -> set[str]:
    return {ast.unparse(base).split(".")[-1] for base in node.bases}


def is_kv_cache_or_pool(node: ast.ClassDef, cache_classes: set[str]) -> bool:
    """A KV cache (answers the model's `prepare` and `update`), a pool, or a subclass of one;
    Protocols only describe them."""
    if "Protocol" in base_names(node):
        return False
    methods = {item.name for item in node.body if isinstance(item, ast.FunctionDef)}
    return (
        {"prepare", "update"} <= methods
        or node.name.endswith(("Cache", "Pool"))
        or bool(base_names(node) & cache_classes)
    )


def in_cache_folder(module: str) -> bool:
    return module == CACHE_FOLDER or module.startswith(CACHE_FOLDER + ".")


def cache_class_names() -> set[str]:
    return {node.name for module, node in classes() if in_cache_folder(module)}


# -- the acceptance points ---------------------------------------------------------------


def test_roseinfer_holds_at_most_four_top_level_modules() -> None:
    top = sorted(path.name for path in (REPO_ROOT / "roseinfer").glob("*.py"))
    assert len(top) <= 4, top


def test_the_graph_reader_sees_every_kind_of_import() -> None:
    tree = ast.parse(
        "from typing import TYPE_CHECKING\n"
        "import roseinfer.cache.dense\n"
        "from roseinfer.engine import config\n"
        "if TYPE_CHECKING:\n    from roseinfer.pipeline.stage import PipelineStage\n"
        "def f():\n    from . import sampling\n"
    )
    edges = imported_names("roseinfer.request.rows", tree)
    assert {"roseinfer.cache", "roseinfer.cache.dense", "roseinfer.engine"} <= edges
    assert {"roseinfer.engine.config", "roseinfer.pipeline.stage"} <= edges
    assert "roseinfer.request.sampling" in edges
    assert "roseinfer.request" not in edges  # its own package: already being imported
    assert cycles({"a": frozenset({"b"}), "b": frozenset({"a"}), "c": frozenset()}) == [["a", "b"]]


def test_no_import_cycle_in_the_packages() -> None:
    graph = import_graph()
    assert len(graph) > 50, sorted(graph)  # the reader found the packages
    assert cycles(graph) == []


def imported_roots(tree: ast.Module) -> set[tuple[int, str]]:
    """(line, top-level name) of every absolute import in `tree`, wherever it sits, and of
    every module named by a string to importlib.import_module or __import__."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update((node.lineno, alias.name.split(".")[0]) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add((node.lineno, node.module.split(".")[0]))
        elif (
            isinstance(node, ast.Call)
            and ast.unparse(node.func) in ("importlib.import_module", "import_module", "__import__")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.add((node.lineno, node.args[0].value.split(".")[0]))
    return found


def test_the_import_reader_sees_absolute_and_dynamic_imports() -> None:
    tree = ast.parse(
        "import benchmarks.engine\nfrom . import sampling\n"
        "def f():\n    from rosecourse.demo import PROMPT\n"
        "    importlib.import_module('benchmarks.decode')\n"
    )
    assert imported_roots(tree) == {(1, "benchmarks"), (4, "rosecourse"), (5, "benchmarks")}


def test_the_packages_never_import_the_course_or_the_benchmarks() -> None:
    """The package is what a user imports: `rosetrainer` and `roseinfer` stand on their own.
    The course (rosecourse/) and the benchmark programs (benchmarks/) may import them, never
    the other way."""
    names = {path.name for path in REPO_ROOT.glob("benchmarks/*.py")}
    assert {"engine.py", "decode.py", "train.py", "vllm_venv.py"} <= names  # the reader's target
    wrong_way = sorted(
        f"{module}:{line} imports {root}"
        for module, tree in modules().items()
        if module.split(".")[0] in ("rosetrainer", "roseinfer")
        for line, root in imported_roots(tree)
        if root in ("rosecourse", "benchmarks")
    )
    assert wrong_way == []


def test_pip_install_installs_no_benchmark() -> None:
    """The packages pyproject names for the wheel hold no benchmark program, and no console
    script points at one (a script can only run what the wheel installed)."""
    from setuptools import find_packages

    pyproject = (REPO_ROOT / "pyproject.toml").read_text(encoding="utf-8")
    found = re.search(r"\[tool\.setuptools\.packages\.find\]\s*include = (\[[^\]]*\])", pyproject)
    assert found, "pyproject.toml names no [tool.setuptools.packages.find] include list"
    installed = find_packages(where=str(REPO_ROOT), include=ast.literal_eval(found.group(1)))
    assert {"rosetrainer", "roseinfer.engine", "rosecourse"} <= set(installed)
    assert [name for name in installed if "bench" in name] == []
    table = pyproject.split("[project.scripts]", 1)[1].split("\n[", 1)[0]
    targets = re.findall(r'^[\w-]+\s*=\s*"([\w.]+):\w+"', table, re.M)
    assert "rosetrainer.train" in targets
    assert [target for target in targets if target.split(".")[0] not in PACKAGES] == []


def test_rosetrainer_imports_nothing_of_the_inference_stack_or_the_course() -> None:
    outside = {
        (module, target)
        for module, targets in import_graph().items()
        if module.split(".")[0] == "rosetrainer"
        for target in targets
        if target.split(".")[0] != "rosetrainer"
    }
    assert outside == set()


def test_every_kv_cache_and_pool_is_defined_in_the_cache_folder() -> None:
    cache_classes = cache_class_names()
    assert {"ConcatKVCache", "StaticKVCache", "PagedKVCache", "KVPool"} <= cache_classes
    elsewhere = [
        f"{module}.{node.name}"
        for module, node in classes()
        if not in_cache_folder(module)
        and is_kv_cache_or_pool(node, cache_classes)
        and not module.startswith(LEARNERS_CACHES)
    ]
    assert elsewhere == []


def test_no_module_outside_the_cache_folder_branches_on_a_cache_class() -> None:
    cache_classes = cache_class_names()
    branches = []
    for module, tree in modules().items():
        if in_cache_folder(module):
            continue
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("isinstance", "issubclass")
                and len(node.args) == 2
            ):
                kinds = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
                named = {ast.unparse(kind).split(".")[-1] for kind in kinds}
                if named & cache_classes:
                    branches.append(f"{module}:{node.lineno} {ast.unparse(node)}")
    assert branches == []


def test_the_engine_and_the_split_model_take_nothing_from_the_teaching_loops() -> None:
    """What every batched loop needs sits in roseinfer/request/ (rows, sampling)."""
    below_the_loops = ("roseinfer.request", "roseinfer.cache", "roseinfer.engine")
    below_the_loops += ("roseinfer.pipeline", "roseinfer.serving")
    reaching_up = {
        (module, target)
        for module, targets in import_graph().items()
        if module.startswith(below_the_loops)
        for target in targets
        if target.startswith("roseinfer.loops")
    }
    assert reaching_up == set()


def test_what_the_documented_commands_write_is_ignored_by_git() -> None:
    """The folders the README's and the docs' exports write (`--out hf/tiny`, `--out
    onnx/tiny`) hold a user's artifacts, never files to commit: git ignores every file in
    them, not only the weights."""
    pages = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
    outs = {out for page in pages for out in OUT.findall(page.read_text(encoding="utf-8"))}
    assert {"hf/tiny", "onnx/tiny"} <= outs
    names = ("config.json", "model.safetensors", "generation_config.json", "meta.json", "a.txt")
    files = [f"{out}/{name}" for out in sorted(outs) for name in names]
    check = subprocess.run(
        ["git", "check-ignore", "--no-index", "--stdin"],
        input="\n".join(files),
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=60,
    )
    assert check.returncode in (0, 1), check.stderr  # 1: none ignored; 128: not a work tree
    assert sorted(set(files) - set(check.stdout.splitlines())) == []


# An exception's message cut into lines by hand (the lines after the first, a library's
# details, are another matter: `[1:]`).
EXCEPTION_FIRST_LINE = re.compile(
    r"str\((?:err|error|exc|e)\)(?:\.strip\(\))?\.splitlines\(\)(?!\[1)"
)


def test_an_exception_is_put_in_one_line_by_one_function() -> None:
    """rosetrainer.errors.one_line says what an exception was in one line; no other module
    cuts an exception's message to its first line by hand."""
    from rosetrainer.errors import one_line

    assert one_line(ValueError("bad shape\n  at line 3")) == "ValueError: bad shape"
    assert one_line(ValueError("\n bad shape "), with_type=False) == "bad shape"
    assert one_line(KeyError(), with_type=False) == one_line(KeyError()) == "KeyError"
    by_hand = [
        f"{path.relative_to(REPO_ROOT)}:{text[: match.start()].count(chr(10)) + 1}"
        for package in PACKAGES
        for path in sorted((REPO_ROOT / package).rglob("*.py"))
        if path != REPO_ROOT / "rosetrainer" / "errors.py"
        for text in [path.read_text(encoding="utf-8")]
        for match in EXCEPTION_FIRST_LINE.finditer(text)
    ]
    assert by_hand == [], "say what an exception was with rosetrainer.errors.one_line"
