"""The Python package's imports run one way: no module of python/ imports,
directly or through others, a module that imports it back. Every import
counts, those inside functions too (a lazy import hides a circle from the
interpreter, not from the reader). Importing a module of a package always
runs the package's __init__ first, so that edge is not counted; importing a
name the package's __init__ defines (`from tpcomm import stats`) is."""

import ast
import os

ROOT = __file__.rsplit("/tests/", 1)[0]
PYTHON = os.path.join(ROOT, "python")


def _modules(base):
    """{dotted name: path or None (an extension module)} under `base`."""
    mods = {}
    for folder, _, names in os.walk(base):
        for name in names:
            rel = os.path.relpath(os.path.join(folder, name), base)
            if name.endswith(".py"):
                dotted = rel[:-3].replace("/", ".")
                mods[dotted[:-len(".__init__")] if dotted.endswith(".__init__") else dotted] = \
                    os.path.join(folder, name)
            elif name.endswith(".so"):
                mods.setdefault(rel.split(".")[0].replace("/", "."), None)
    # The extension the build puts beside the package.
    mods.setdefault("tpcomm._C", None)
    return mods


def import_graph(sources):
    """{module: {modules of `sources` it imports}}; `sources` is
    {dotted name: source text or None}."""
    def known(name):
        while name and name not in sources:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for module, text in sources.items():
        graph[module] = set()
        if text is None:
            continue
        package = module if text is not None and _is_package(module, sources) else \
            module.rpartition(".")[0]
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Import):
                targets = [known(a.name) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in sources else known(base)
                           for a in node.names]
            else:
                continue
            graph[module] |= {t for t in targets if t is not None and t != module}
    return graph


def _is_package(module, sources):
    return any(other.startswith(module + ".") for other in sources)


def circles(graph):
    """Every set of modules that import each other (strongly connected,
    more than one), each sorted."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                found.append(sorted(part))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _tree_sources():
    out = {}
    for module, path in _modules(PYTHON).items():
        if path is None:
            out[module] = None
        else:
            with open(path) as f:
                out[module] = f.read()
    return out


def test_no_module_of_the_package_imports_one_that_imports_it_back():
    sources = _tree_sources()
    assert "tpcomm.coordinator" in sources and "tpcomm.bench.vllm_cpu.offline" in sources, sorted(sources)
    found = circles(import_graph(sources))
    assert found == [], f"import circles in python/: {found}"


def test_a_circle_through_a_lazy_import_or_the_packages_own_names_is_caught():
    base = {"pkg": "from pkg import low\nfrom pkg.low import f\n",
            "pkg.low": "import os\n", "pkg.mid": "from pkg import low\n",
            "pkg.ext": None}
    assert circles(import_graph(base)) == []
    lazy = dict(base, **{"pkg.low": "def f():\n    from pkg import mid\n",
                         "pkg.mid": "from pkg.low import f\n"})
    assert circles(import_graph(lazy)) == [["pkg.low", "pkg.mid"]]
    relative = dict(base, **{"pkg.low": "from . import mid\n", "pkg.mid": "from .low import f\n"})
    assert circles(import_graph(relative)) == [["pkg.low", "pkg.mid"]]
    # A module importing a name its package's __init__ defines, where the
    # __init__ imports that module.
    through_init = dict(base, **{"pkg.low": "from pkg import helper\n"})
    assert circles(import_graph(through_init)) == [["pkg", "pkg.low"]]
