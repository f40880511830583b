"""No import cycles in jaxrl: module-level imports form a graph without loops, and the config modules
import in either order with nothing lazily re-exported (a module `__getattr__` hides a cycle)."""

import ast
import importlib
import pathlib
import sys

import jaxrl

ROOT = pathlib.Path(jaxrl.__file__).resolve().parent


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _top_level_imports(tree: ast.Module, modules: set[str]) -> set[str]:
    """jaxrl modules imported when this module is imported: statements at module level (also inside a
    module-level try/if, except `if TYPE_CHECKING:`), not inside functions."""
    found, todo = set(), list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        if isinstance(node, (ast.If, ast.Try)):
            todo += node.body + node.orelse + getattr(node, "finalbody", [])
            todo += [s for h in getattr(node, "handlers", []) for s in h.body]
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from pkg import submodule` needs the submodule only (pkg is already being imported);
            # any other name needs pkg itself to have run.
            subs = {f"{node.module}.{a.name}" for a in node.names} & modules
            found |= subs
            if len(subs) < len(node.names):
                found.add(node.module)
    return found & modules


def _import_graph() -> dict[str, set[str]]:
    files = sorted(ROOT.rglob("*.py"))
    modules = {_module_name(f) for f in files}
    return {_module_name(f): _top_level_imports(ast.parse(f.read_text()), modules) for f in files}


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


def test_find_cycle_reports_a_loop_and_passes_a_tree():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_jaxrl_module_level_imports_have_no_cycle():
    graph = _import_graph()
    assert graph["jaxrl.config"] >= {"jaxrl.config.load", "jaxrl.config.checks"}  # the scan sees imports
    assert _find_cycle(graph) is None


def test_config_modules_import_in_either_order_without_lazy_reexports():
    saved = {k: v for k, v in sys.modules.items() if k.startswith("jaxrl.config")}
    names = {k.split(".")[1] for k in saved} | {"config", "config_load", "config_checks"}
    saved_attrs = {k: getattr(jaxrl, k, None) for k in names}
    try:
        for name in saved:
            del sys.modules[name]
        config_load = importlib.import_module("jaxrl.config.load")
        assert "jaxrl.config" not in sys.modules  # the loader does not need the run's Config
        config = importlib.import_module("jaxrl.config")
        assert "__getattr__" not in vars(config)
        assert config.apply_overrides is config_load.apply_overrides
        assert config.load_config.__module__ == "jaxrl.config"
    finally:
        for name in [k for k in sys.modules if k.startswith("jaxrl.config")]:
            del sys.modules[name]
        sys.modules.update(saved)  # the rest of the suite keeps the classes it already imported
        for k, v in saved_attrs.items():  # `from jaxrl import config` reads the package attribute
            if v is None:
                vars(jaxrl).pop(k, None)
            else:
                setattr(jaxrl, k, v)
