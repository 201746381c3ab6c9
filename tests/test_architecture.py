"""Import structure: no cycles among the modules of the library, its benchmarks and experiments; the
kernels stand alone; configs import no experiment. Also: library functions over 60 lines say why
they are long, and the rollout's entry points (`generate`, `generate_data_parallel`) take at most 12 parameters.

Every import counts, at module level or inside a function (a function-level import hides a
cycle from the interpreter, not from the design). Importing `a.b.c` runs the `__init__` of
`a.b` too, so it also depends on those packages, except the importer's own enclosing
packages, which are already initialising when it runs.
"""

from __future__ import annotations

import ast
import graphlib
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("qerl_jax", "pallas_kernels")
# Everything that imports the library: its benchmarks, experiments and configs (run from the
# repository root, as `python -m benchmarks.x` or `--config=configs/x.py`).
OUTER = ("benchmarks", "experiments", "configs")


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules(packages: tuple[str, ...] = PACKAGES) -> dict[str, pathlib.Path]:
    return {_module_name(p): p for pkg in packages for p in sorted((ROOT / pkg).rglob("*.py"))}


def _imported(node: ast.AST, module: str, is_package: bool, known: set[str]) -> list[str]:
    """The known modules an import statement names (for `from m import x`: m.x if a module, else m)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:
        anchor = module.split(".")
        anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
        base = ".".join(anchor + ([base] if base else []))
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]


def import_graph(packages: tuple[str, ...] = PACKAGES) -> dict[str, set[str]]:
    """module -> the modules of `packages` (default qerl_jax and pallas_kernels) it imports."""
    modules = _modules(packages)
    known = set(modules)
    graph = {m: set() for m in known}
    for module, path in modules.items():
        is_package = path.name == "__init__.py"
        own_packages = {".".join(module.split(".")[:i]) for i in range(1, module.count(".") + (2 if is_package else 1))}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            for target in _imported(node, module, is_package, known):
                parts = target.split(".")
                for i in range(1, len(parts) + 1):
                    dep = ".".join(parts[:i])
                    if dep in known and dep not in own_packages and dep != module:
                        graph[module].add(dep)
    return graph


def test_graph_sees_imports():
    graph = import_graph()
    assert "qerl_jax.quant.packed" in graph["qerl_jax.linear"]  # module level
    assert "pallas_kernels" in graph["qerl_jax.linear"]  # function level
    assert "qerl_jax.quant" in graph["qerl_jax.linear"]  # the package's __init__ runs first


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle of `graph` (its modules in order, the first repeated last), or []."""
    try:
        tuple(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as e:
        return list(e.args[1])
    return []


def test_cycle_check_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    assert set(_cycle({"a": {"b"}, "b": {"a"}, "c": {"a"}})) == {"a", "b"}


def test_no_import_cycles():
    cycle = _cycle(import_graph())
    assert not cycle, "import cycle: " + " -> ".join(cycle)


def test_no_import_cycles_among_benchmarks_experiments_and_configs():
    graph = import_graph(PACKAGES + OUTER)
    assert "benchmarks.common" in graph["benchmarks.grpo_step"] and "qerl_jax" in graph["benchmarks.common"]
    cycle = _cycle(graph)
    assert not cycle, "import cycle: " + " -> ".join(cycle)


def test_kernels_never_import_the_library():
    graph = import_graph()
    bad = [
        (m, d) for m, deps in graph.items() for d in deps if m.startswith("pallas_kernels") and d.startswith("qerl_jax")
    ]
    assert not bad, f"pallas_kernels imports qerl_jax: {bad}"


def test_the_model_never_imports_training_or_rollout():
    graph = import_graph()
    above = ("qerl_jax.rl", "qerl_jax.rollout", "qerl_jax.train", "qerl_jax.evaluation")
    bad = [(m, d) for m, deps in graph.items() for d in deps if m.startswith("qerl_jax.models") and d.startswith(above)]
    assert not bad, f"qerl_jax.models imports the layers above it: {bad}"


# The checkpoint I/O layer (ARCHITECTURE.md) and the layers below it that it may import.
MODEL_IO = "qerl_jax.model_io"
BELOW_MODEL_IO = ("qerl_jax.models", "qerl_jax.quant", "qerl_jax.projections", "qerl_jax.lora", "pallas_kernels")
MODEL_IO_EXCEPTIONS = {("qerl_jax.model_io.tiny", "qerl_jax.config")}  # the data directory


def test_checkpoint_io_imports_only_the_layers_below():
    graph = import_graph()
    assert "qerl_jax.model_io.hf_layout" in graph["qerl_jax.model_io.gguf"]
    bad = [
        (m, d)
        for m, deps in graph.items()
        if m.startswith(MODEL_IO)
        for d in deps
        if not d.startswith((MODEL_IO, *BELOW_MODEL_IO)) and (m, d) not in MODEL_IO_EXCEPTIONS
    ]
    assert not bad, f"qerl_jax.model_io imports the layers above it: {bad}"
    readers = ("qerl_jax.model_io.hf_layout", "qerl_jax.model_io.gguf")
    assert not [r for r in readers if "qerl_jax.model_io.loader" in graph[r]], "a reader imports loader"


def _top_level_imports(path: pathlib.Path) -> set[str]:
    """The first component of every absolute import in a file (module or function level)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names.add((node.module or "").split(".")[0])
    return names


def test_the_library_never_imports_experiments_benchmarks_or_tools():
    outside = {"experiments", "benchmarks", "tools"}
    found = {m: sorted(_top_level_imports(p) & outside) for m, p in _modules().items()}
    bad = {m: names for m, names in found.items() if names}
    assert not bad, f"library modules import experiments/benchmarks/tools: {bad}"


def test_configs_import_the_library_only():
    """A config is a recipe over the library: it imports no experiment or benchmark (an arrow back up)."""
    files = sorted((ROOT / "configs").glob("*.py"))
    assert files and "qerl_jax" in _top_level_imports(ROOT / "configs" / "arithmetic_smollm2.py")
    bad = {str(p.relative_to(ROOT)): sorted(_top_level_imports(p) & {"experiments", "benchmarks"}) for p in files}
    bad = {path: names for path, names in bad.items() if names}
    assert not bad, f"configs import experiments/benchmarks: {bad}"


def test_only_tests_import_tools():
    """tools/ (GPU machines reached by copying files) is outermost: no experiment, benchmark or config uses it."""
    files = [p for d in ("experiments", "benchmarks", "configs") for p in sorted((ROOT / d).rglob("*.py"))]
    assert files and (ROOT / "tools" / "carry.py").is_file()
    bad = [str(p.relative_to(ROOT)) for p in files if "tools" in _top_level_imports(p)]
    assert not bad, f"import tools/: {bad}"


# The rollout engine's entry point takes at most this many parameters; the engine's rarer choices are
# grouped in small frozen records (`RolloutOptions`, `RolloutPart`, `ShardPlan`).
MAX_GENERATE_PARAMETERS = 12


def _parameter_count(source: str, name: str) -> int:
    """How many parameters the module-level function `name` of `source` declares (*args, **kw included)."""
    node = next(n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == name)
    a = node.args
    return len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) + (a.vararg is not None) + (a.kwarg is not None)


@pytest.mark.parametrize("module, name", [("sampler", "generate"), ("data_parallel", "generate_data_parallel")])
def test_the_rollout_entry_points_take_at_most_twelve_parameters(module, name):
    assert _parameter_count("def f(a, /, b, *c, d=1, **e): pass", "f") == 5
    count = _parameter_count((ROOT / "qerl_jax" / "rollout" / f"{module}.py").read_text(), name)
    assert count <= MAX_GENERATE_PARAMETERS, (
        f"rollout.{module}.{name} takes {count} parameters (at most {MAX_GENERATE_PARAMETERS}): group the "
        "rarely set ones in RolloutOptions, RolloutPart or ShardPlan"
    )


# Functions a reader can hold: a library function over this many lines (its `def` line to its last)
# says in its docstring why it is long ("long because ...").
MAX_FUNCTION_LINES = 60
# Long functions of modules others are editing now, to be split or explained there; remove each
# as it is (the test fails on an entry that is no longer an unexplained long function).
LONG_FUNCTIONS_PENDING: set[str] = set()


def _unexplained_long_functions(source: str, path: str) -> dict[str, int]:
    """{'path:name': lines} of the functions (methods and nested ones too) of `source` over
    MAX_FUNCTION_LINES lines whose docstring does not contain "long because"."""
    found = {}
    for node in ast.walk(ast.parse(source, path)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = node.end_lineno - node.lineno + 1
            if lines > MAX_FUNCTION_LINES and "long because" not in (ast.get_docstring(node) or "").lower():
                found[f"{path}:{node.name}"] = lines
    return found


def test_the_long_function_check_sees_long_functions_and_their_reasons():
    body = "    x = 0\n" * MAX_FUNCTION_LINES
    assert _unexplained_long_functions(f"def f():\n{body}", "m.py") == {"m.py:f": MAX_FUNCTION_LINES + 1}
    assert _unexplained_long_functions(f"def f():\n{body[10:]}", "m.py") == {}  # one line shorter
    nested = f"class C:\n    def g(self):\n        def h():\n{body.replace('    ', '            ')}"
    assert set(_unexplained_long_functions(nested, "m.py")) == {"m.py:g", "m.py:h"}
    explained = f'def f():\n    """Long because it reads best straight through."""\n{body}'
    assert _unexplained_long_functions(explained, "m.py") == {}


def test_library_functions_are_short_or_say_why_they_are_long():
    found = {}
    for path in sorted((ROOT / "qerl_jax").rglob("*.py")):
        found |= _unexplained_long_functions(path.read_text(), str(path.relative_to(ROOT)))
    unexplained = {name: lines for name, lines in found.items() if name not in LONG_FUNCTIONS_PENDING}
    assert not unexplained, (
        f"functions over {MAX_FUNCTION_LINES} lines: split them, or say why in their docstring "
        f'("long because ..."): {unexplained}'
    )
    stale = LONG_FUNCTIONS_PENDING - set(found)
    assert not stale, f"no longer unexplained long functions, remove them from LONG_FUNCTIONS_PENDING: {stale}"


# Library modules whose tests live in a file not named after them: the file that covers them.
TESTED_IN = {
    "pallas_kernels.autotune": "test_kernels.py",
    "pallas_kernels.decode_asm": "test_kernels.py",
    "pallas_kernels.formats": "test_kernels.py",
    "pallas_kernels.numerics": "test_quant.py",
    "pallas_kernels.quant_matmul": "test_kernels.py",
    "qerl_jax.config": "test_schema.py",
    "qerl_jax.config_doc": "test_docs.py",  # docs/configuration.md, generated
    "qerl_jax.data.datasets": "test_data.py",
    "qerl_jax.data.prompts": "test_data.py",
    "qerl_jax.errors": "test_eval.py",
    "qerl_jax.evaluation": "test_eval.py",
    "qerl_jax.main": "test_cli.py",
    "qerl_jax.models.qwen2": "test_model.py",
    "qerl_jax.policy": "test_model_dir.py",
    "qerl_jax.projections": "test_sharding.py",  # constants: the split they name is tested there
    "qerl_jax.quant.formats": "test_quant.py",
    "qerl_jax.quant.mxfp4": "test_quant.py",
    "qerl_jax.quant.nf4": "test_quant.py",
    "qerl_jax.quant.nvfp4": "test_quant.py",
    "qerl_jax.quant.packed": "test_quant.py",
    "qerl_jax.quantize": "test_quantize_cli.py",
    "qerl_jax.quantize_checkpoint": "test_quantize_cli.py",
    "qerl_jax.rollout.data_parallel": "test_sharding.py",
    "qerl_jax.workdir": "test_cli.py",
}


def test_every_library_module_has_its_test_file():
    """tests/test_<module>.py, or the file named in TESTED_IN: a new module comes with its tests."""
    tests = ROOT / "tests"
    modules = [m for m, p in _modules().items() if p.name != "__init__.py"]
    missing = [m for m in modules if not (tests / f"test_{m.rsplit('.', 1)[-1]}.py").is_file() and m not in TESTED_IN]
    assert not missing, f"library modules without tests/test_<name>.py or a TESTED_IN entry: {missing}"
    stale = {m: f for m, f in TESTED_IN.items() if m not in modules or not (tests / f).is_file()}
    assert not stale, f"TESTED_IN names modules or test files that do not exist: {stale}"
