"""The folder a module sits in says what it may import (docs/layout.md):

    drafters/*.py          foundation and one file per drafter family: imports only drafters/*.py
    drafters/engines/      external serving engines driven as programs (llama.cpp): + drafters/engines
    drafters/export/       formats and their readers: + drafters/engines, drafters/export
    drafters/decode/       trees, decoder, sampling, proposers, benches: + drafters/decode, drafters/export,
                           drafters/engines
    drafters/training/     recipes, data, loop, objectives, feature store: anything in drafters
    drafters/peers/        other trainers (speculators, SpecForge) driven as programs from their own venvs, for
                           eval/peers.py: + drafters/training (our feature store), drafters/peers
    train/, eval/          entry scripts: anything in drafters, never each other

and no module imports another that (directly or not) imports it back. A drafter family's modules (drafters/<family>.py
and its namesakes under training/, export/ and decode/proposers/) import another family's only where they build on
it: its declared parents (FAMILY_PARENTS); what every family shares lives in the foundation. Every import counts, at module
level or inside a function: a cycle hidden in a function is still a cycle.

The checker runs on the repository and on a planted copy that breaks each rule once, so a checker
that stopped seeing imports would fail here rather than pass everything.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# layer -> the layers it may import from; "scripts" are train/*.py and eval/*.py.
ALLOWED = {
    "core": {"core"},
    "engines": {"core", "engines"},
    "export": {"core", "engines", "export"},
    "decode": {"core", "engines", "decode", "export"},
    "training": {"core", "engines", "export", "decode", "training"},
    "peers": {"core", "training", "peers"},
    "scripts": {"core", "engines", "export", "decode", "training", "peers"},
}


# family -> the families its modules may import: the ones it subclasses or extends ("heads" is the module the
# multi-head families share, and the one that trains, drafts and exports both)
FAMILY_PARENTS = {
    "eagle3": set(), "eagle1": set(), "dflash": {"eagle3"}, "dspark": {"dflash", "eagle3"}, "peagle": {"eagle3"},
    "eagle4": {"eagle3"}, "dflash2": {"dflash"}, "mtp": set(),
    "medusa": {"heads"}, "blockwise": {"heads"}, "heads": {"medusa", "blockwise"},
}
# the one import against it, with why it stays: to be split (an exporter of its own for DSpark)
FAMILY_EXCEPTIONS = {("drafters.export.dflash", "drafters.dspark"): "DSpark's vllm layout is DFlash's plus its heads, "
                                                                     "written and read back by DFlash's exporter"}


def family(name: str) -> str | None:
    stem = name.split(".")[-1]
    return stem if name.startswith("drafters.") and stem in FAMILY_PARENTS else None


def module_name(root: Path, file: Path) -> str:
    parts = list(file.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer(name: str) -> str:
    parts = name.split(".")
    if parts[0] in ("train", "eval"):
        return "scripts"
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in ALLOWED) else "core"


def collect(root: Path) -> dict[str, Path]:
    files = sorted((root / "drafters").rglob("*.py"))
    files += sorted((root / "train").glob("*.py")) + sorted((root / "eval").glob("*.py"))
    return {module_name(root, f): f for f in files}


def imports(name: str, file: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules `file` imports, anywhere in it. `from pkg import x` names the submodule
    pkg.x when x is one, else pkg itself; relative imports are resolved against `name`."""
    found = set()
    package = name if file.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(file.read_text(), str(file))):
        if isinstance(node, ast.Import):
            targets = [(a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [(base, a.name) for a in node.names]
        else:
            continue
        for base, member in targets:
            if name.split(".")[0] in ("train", "eval") and base and f"{name.split('.')[0]}.{base}" in modules:
                base = f"{name.split('.')[0]}.{base}"  # `import tau` from eval/compare.py: a sibling script
            if member and f"{base}.{member}" in modules:
                found.add(f"{base}.{member}")
            elif base in modules:
                found.add(base)
            elif base.split(".")[0] in ("drafters", "train", "eval"):
                # `import drafters.decode.tree as t` or an attribute of a package: the longest module prefix
                parts = base.split(".")
                while parts and ".".join(parts) not in modules:
                    parts.pop()
                if parts:
                    found.add(".".join(parts))
    found.discard(name)
    return found


def violations(root: Path) -> list[str]:
    modules = collect(root)
    graph = {name: imports(name, file, modules) for name, file in modules.items()}
    problems = []
    for name, deps in sorted(graph.items()):
        for dep in sorted(deps):
            if layer(name) == "scripts" and layer(dep) == "scripts":
                problems.append(f"{name} imports the entry script {dep}: move what both need into drafters/")
            elif layer(dep) not in ALLOWED[layer(name)]:
                problems.append(f"{name} ({layer(name)}) imports {dep} ({layer(dep)})")
            elif family(name) and family(dep) and family(dep) != family(name) and \
                    family(dep) not in FAMILY_PARENTS[family(name)] and (name, dep) not in FAMILY_EXCEPTIONS:
                problems.append(f"{name} (family {family(name)}) imports {dep} (family {family(dep)}), not a declared "
                                "parent: move what both need into the foundation")
        if layer(name) == "scripts":
            tree = ast.parse(modules[name].read_text())
            for node in ast.walk(tree):
                if isinstance(node, ast.Attribute) and node.attr in ("path", "spec_from_file_location") and \
                        isinstance(node.value, (ast.Name, ast.Attribute)) and \
                        ast.unparse(node) in ("sys.path", "importlib.util.spec_from_file_location"):
                    problems.append(f"{name} loads code by file path ({ast.unparse(node)}): import it from drafters/")
    problems += [f"import cycle: {' -> '.join(c)}" for c in cycles(graph)]
    return problems


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component) + [sorted(component)[0]])

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_repository_keeps_its_layers():
    assert violations(ROOT) == []


def test_the_family_rule_knows_every_family():
    from drafters.registry import FAMILIES

    assert set(FAMILY_PARENTS) == set(FAMILIES) | {"heads"}


def write(root: Path, rel: str, text: str = "") -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.mark.parametrize("planted, expected", [
    ({"drafters/eagle9.py": "from drafters.training.loop import x\n"},
     "drafters.eagle9 (core) imports drafters.training.loop (training)"),
    ({"drafters/decode/d.py": "def f():\n    from drafters.training import loop\n"},
     "drafters.decode.d (decode) imports drafters.training.loop (training)"),
    ({"drafters/export/e.py": "from ..decode.tree import Tree\n"},
     "drafters.export.e (export) imports drafters.decode.tree (decode)"),
    ({"eval/b.py": "import train.a\n"}, "eval.b imports the entry script train.a"),
    ({"eval/b.py": "import a\n", "eval/a.py": ""}, "eval.b imports the entry script eval.a"),
    ({"eval/b.py": "import sys\nsys.path.insert(0, '.')\n"}, "eval.b loads code by file path (sys.path)"),
    ({"drafters/a.py": "from drafters import b\n", "drafters/b.py": "def f():\n    import drafters.a\n"},
     "import cycle: drafters.a -> drafters.b -> drafters.a"),
    ({"drafters/eagle1.py": "", "drafters/training/eagle3.py": "from drafters.eagle1 import FrozenHead\n"},
     "drafters.training.eagle3 (family eagle3) imports drafters.eagle1 (family eagle1), not a declared parent"),
])
def test_a_planted_violation_is_reported(tmp_path, planted, expected):
    for rel in ("drafters/__init__.py", "drafters/training/__init__.py", "drafters/training/loop.py",
                "drafters/decode/__init__.py", "drafters/decode/tree.py", "drafters/export/__init__.py",
                "train/a.py"):
        write(tmp_path, rel)
    assert violations(tmp_path) == []
    for rel, text in planted.items():
        write(tmp_path, rel, text)
    found = violations(tmp_path)
    assert len(found) == 1 and found[0].startswith(expected), found
