"""The package's layering, read from the code: no import cycles (function-level imports included, so a
cycle cannot hide inside a function), every folder imports only the layers below it, and the config
modules import in either order with nothing lazily re-exported (a module `__getattr__` hides a cycle)."""

import ast
import importlib
import pathlib
import sys

import jaxrl

ROOT = pathlib.Path(jaxrl.__file__).resolve().parent

# What each part of jaxrl may import (besides itself): the stages, lowest first. `config` is the floor;
# `losses` never sees a model; `rollout` never sees the sources that drive it, nor `train` anything but
# what is below it; `eval` and `cli` are the commands on top.
ALLOWED = {
    "config": set(),
    "runlog": {"config"},
    "models": {"config"},
    "data": {"config"},
    "losses": {"config"},
    "sharding": {"config", "models"},
    "multihost": set(),
    "agents": {"config", "data"},
    "rollout": {"config", "models", "sharding", "multihost"},
    # sources: black-box agents (sources/blackbox.py) play through the run's own server (serve's engine,
    # app and recorder; never serve/server.py, the command)
    "sources": {"config", "models", "data", "sharding", "multihost", "agents", "rollout", "serve"},
    # serve: the engine and the HTTP layer sit on rollout (a training run may serve its own engine); only
    # serve/server.py, the `jaxrl serve` command, reaches up to eval's policy loading
    "serve": {"config", "models", "data", "sharding", "multihost", "rollout", "policy", "eval"},
    "policy": {"config", "models", "data", "sharding", "multihost", "agents", "sources"},
    # rewards: reward models start from the run's base policy (policy) and judges decode on the slot engine
    "rewards": {"config", "runlog", "models", "data", "sharding", "multihost", "rollout", "policy"},
    "train": {
        "config",
        "runlog",
        "models",
        "data",
        "losses",
        "sharding",
        "multihost",
        "agents",
        "rollout",
        "sources",
        "policy",
        "rewards",
    },
    "eval": {
        "config",
        "runlog",
        "models",
        "data",
        "losses",
        "sharding",
        "multihost",
        "agents",
        "rollout",
        "sources",
        "policy",
        "rewards",
        "train",
    },
    "cli": {"config", "losses", "sharding", "multihost", "policy", "rewards", "train", "eval", "serve"},
}


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(node: ast.AST, modules: set[str]) -> set[str]:
    if isinstance(node, ast.Import):
        return {a.name for a in node.names} & modules
    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        # `from pkg import submodule` needs the submodule only (pkg is already being imported);
        # any other name needs pkg itself to have run.
        subs = {f"{node.module}.{a.name}" for a in node.names} & modules
        return (subs | ({node.module} if len(subs) < len(node.names) else set())) & modules
    return set()


def _imports(tree: ast.Module, modules: set[str], *, inside_functions: bool) -> set[str]:
    """jaxrl modules this module imports: statements at module level (also inside a module-level try/if,
    except `if TYPE_CHECKING:`), and with `inside_functions` those inside functions and classes too."""
    found, todo = set(), list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found |= _imported(node, modules)
        elif isinstance(node, (ast.If, ast.Try)):
            todo += node.body + node.orelse + getattr(node, "finalbody", [])
            todo += [s for h in getattr(node, "handlers", []) for s in h.body]
        elif inside_functions and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            todo += [n for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom))]
    return found


def _import_graph(*, inside_functions: bool) -> dict[str, set[str]]:
    files = sorted(ROOT.rglob("*.py"))
    modules = {_module_name(f) for f in files}
    return {
        _module_name(f): _imports(ast.parse(f.read_text()), modules, inside_functions=inside_functions) for f in files
    }


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node, path):
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt, path + [nxt])):
                return cycle
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start, [start])):
            return cycle
    return None


def _part(module: str) -> str:
    return module.split(".")[1] if module != "jaxrl" else ""


def test_find_cycle_reports_a_loop_and_passes_a_tree():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_the_scan_reads_function_level_imports():
    tree = ast.parse(
        "import jaxrl.a\ndef f():\n    from jaxrl.b import c\nclass K:\n    def g(self):\n        import jaxrl.d\n"
    )
    mods = {"jaxrl.a", "jaxrl.b", "jaxrl.d"}
    assert _imports(tree, mods, inside_functions=False) == {"jaxrl.a"}
    assert _imports(tree, mods, inside_functions=True) == {"jaxrl.a", "jaxrl.b", "jaxrl.d"}


def test_jaxrl_imports_have_no_cycle_even_inside_functions():
    graph = _import_graph(inside_functions=True)
    assert graph["jaxrl.config"] >= {"jaxrl.config.load", "jaxrl.config.schema"}  # the scan sees imports
    assert _find_cycle(_import_graph(inside_functions=False)) is None
    assert _find_cycle(graph) is None
    assert "jaxrl.config.schema" not in graph["jaxrl.config.load"]  # the loader does not need the run's Config


def test_every_part_imports_only_the_layers_below_it():
    graph = _import_graph(inside_functions=True)
    parts = {_part(m) for m in graph} - {""}
    assert parts == set(ALLOWED), f"a part of jaxrl has no layering rule: {sorted(parts ^ set(ALLOWED))}"
    wrong = sorted(
        f"{m} -> {i}"
        for m, deps in graph.items()
        for i in deps
        if _part(i) != _part(m) and _part(i) not in ALLOWED[_part(m)]
    )
    assert not wrong, "imports against the layering:\n" + "\n".join(wrong)


def test_config_modules_import_in_either_order_without_lazy_reexports():
    saved = {k: v for k, v in sys.modules.items() if k.startswith("jaxrl.config")}
    saved_attr = getattr(jaxrl, "config", None)
    try:
        for name in saved:
            del sys.modules[name]
        config_load = importlib.import_module("jaxrl.config.load")
        config = importlib.import_module("jaxrl.config")
        assert "__getattr__" not in vars(config)
        assert config.apply_overrides is config_load.apply_overrides
        assert config.load_config.__module__ == "jaxrl.config.schema"
    finally:
        for name in [k for k in sys.modules if k.startswith("jaxrl.config")]:
            del sys.modules[name]
        sys.modules.update(saved)  # the rest of the suite keeps the classes it already imported
        if saved_attr is None:  # `from jaxrl import config` reads the package attribute
            vars(jaxrl).pop("config", None)
        else:
            jaxrl.config = saved_attr
