"""The code map (docs/STRUCTURE.md) against the code: its import layers hold for every import of
freetoken/ and ftw/ (lazy ones inside functions too) and no import cycle exists; it lists every
file of the repository's code, tools and docs. Static: the modules are parsed, not imported."""
import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
STRUCTURE = ROOT / "docs" / "STRUCTURE.md"


def modules() -> dict:
    """{dotted name: (path, is_package)} for every .py file of freetoken/ and ftw/."""
    out = {}
    for pkg in ("freetoken", "ftw"):
        for path in (ROOT / pkg).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            is_pkg = parts[-1] == "__init__"
            out[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return out


def imports(mods: dict) -> dict:
    """{module: {(imported module, line)}}: every import statement's target that is one of
    `mods` (`from P import x` counts as P.x when that is a module, else P); compiled modules
    (freetoken._plan: not a .py file) and other packages are left out."""
    edges = {}
    for name, (path, is_pkg) in mods.items():
        package = name if is_pkg else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[:len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    if sub in mods:
                        found.add((sub, node.lineno))
                    elif target in mods and not alias.name.startswith("_"):
                        found.add((target, node.lineno))
            elif isinstance(node, ast.Import):
                found |= {(a.name, node.lineno) for a in node.names if a.name in mods}
        edges[name] = {(t, line) for t, line in found if t != name}
    return edges


def layers() -> list:
    """[(rank, name)] from STRUCTURE.md's layers block, in order."""
    text = STRUCTURE.read_text()
    block = re.search(r"<!-- layers -->\n(.*?)<!-- /layers -->", text, re.S)
    assert block, "docs/STRUCTURE.md has no <!-- layers --> block"
    out = []
    for line in block.group(1).splitlines():
        rank, *names = line.split()
        out += [(int(rank), n) for n in names]
    return out


def layer_of(module: str, table: list) -> tuple:
    """(rank, entry): the entry naming the module, else the longest entry naming a package
    above it (the root packages freetoken and ftw only name themselves)."""
    best = None
    for rank, entry in table:
        exact = module == entry
        inside = module.startswith(entry + ".") and entry not in ("freetoken",)
        if (exact or inside) and (best is None or exact or len(entry) > len(best[1])):
            best = (rank, entry)
            if exact:
                break
    return best


def test_every_module_has_a_layer():
    table = layers()
    missing = [m for m in modules() if layer_of(m, table) is None]
    assert not missing, f"add these modules to docs/STRUCTURE.md's layers: {missing}"


def test_imports_run_downward():
    mods, table = modules(), layers()
    upward = []
    for name, targets in imports(mods).items():
        rank = layer_of(name, table)[0]
        for target, line in sorted(targets):
            if layer_of(target, table)[0] < rank:
                upward.append(f"{mods[name][0].relative_to(ROOT)}:{line} imports {target}")
    assert not upward, "upward imports (docs/STRUCTURE.md layers):\n" + "\n".join(upward)


def test_no_import_cycles():
    """Tarjan's strongly connected components over every import, lazy ones included."""
    edges = {m: {t for t, _ in ts} for m, ts in imports(modules()).items()}
    index, low, stack, on_stack, cycles, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_the_checks_catch_what_they_look_for(tmp_path, monkeypatch):
    """The walker sees a lazy import inside a function, and an upward one fails the layers."""
    pkg = tmp_path / "freetoken"
    (pkg / "experts").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "profile.py").write_text("")
    (pkg / "experts" / "__init__.py").write_text("")
    (pkg / "experts" / "policy.py").write_text("def f():\n    from .. import profile\n")
    (tmp_path / "ftw").mkdir()
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    mods = modules()
    assert ("freetoken.profile", 2) in imports(mods)["freetoken.experts.policy"]
    table = layers()
    assert layer_of("freetoken.experts.policy", table)[0] > layer_of("freetoken.profile", table)[0]


def tracked_files() -> list:
    try:
        out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return out


def listed_files() -> set:
    """The paths STRUCTURE.md's file list names ("cython/pool.h, pool_impl.c": the second name
    in the first one's folder)."""
    listed = set()
    for line in STRUCTURE.read_text().split("## Files", 1)[1].splitlines():
        tokens, names = line.split(), []
        for token in tokens:
            names.append(token.rstrip(","))
            if not token.endswith(","):
                break
        if names and not names[0].startswith("`"):
            folder = names[0].rpartition("/")[0]
            listed |= {names[0]} | {f"{folder}/{n}" for n in names[1:]}
    return listed


def test_structure_lists_every_file():
    """Every tracked file of the code, tools, cython and docs has its line (a folder's line
    covers what is below it: tests/, docs/traces/; freetoken/models/<family>.py the families)."""
    listed = listed_files()
    folders = tuple(n for n in listed if n.endswith("/"))
    missing = []
    for path in tracked_files():
        if path.startswith((".ci/", "tests/")) or "/" not in path or path in listed:
            continue
        if path.startswith(folders):
            continue
        if path.startswith("freetoken/models/") and "freetoken/models/<family>.py" in listed:
            continue
        missing.append(path)
    assert not missing, f"add these files to docs/STRUCTURE.md: {missing}"
