"""The import layers docs/ARCHITECTURE.md states: models <- model_store <- training, server, the layers inside
server; no cycles.

Every import counts, including those inside functions and under TYPE_CHECKING: a cycle a reader has to
untangle is a cycle, whenever it runs."""

import ast
from pathlib import Path

from tests.conftest import REPO

PACKAGES = ("models", "model_store", "training", "server")
# package -> the project packages it may import
ALLOWED = {
    "models": set(),
    "model_store": {"models"},
    "training": {"models", "model_store"},
    "server": {"models", "model_store"},
}
# the `tinyserve` command dispatches to every job, training's included
EXCEPTIONS = {("server.cli", "training")}
# inside server, lowest first: each folder is one layer; a module imports only from its own layer or the ones
# before it (server/config.py and server/errors.py are the base every layer reads; the entry points sit on top)
SERVER_LAYERS = [
    {"config", "errors"},
    {"execution"},  # the compute thread, model runners, compiled steps, the background compiler
    {"engine"},  # continuous batching: requests and rows, speculation, events, text made on the output side
    {"serving"},  # the registry of served models, placement, model cards
    {"features"},  # completion, chat, tool calls, structured output, readouts (score, attention, fill-mask), inspect
    {"api"},  # the FastAPI app: middleware, routers, schemas, the demo page
    {"__main__", "ray_serve", "cli"},
]
# inside a folder, lowest first: the same rule one level down
FOLDER_LAYERS = {
    "execution": [
        {"graph_call", "compute_thread", "step_check", "native", "steering"},
        {"skinny_gemm"},
        {"kernel_choice", "huge_pages", "packaged", "compile_cache", "group_gemm", "compile_sharing", "passes"},
        {"compiler"},
        {"runner", "encoder_step"},
        {"decoder", "hf_causal"},
        {"loader"},
        {"compile_worker"},
    ],
    "engine": [
        {"events", "detokenizer", "kv_blocks"},
        {"output", "speculation"},
        {"rows"},
        {"request_blocks"},
        {"core"},
    ],
    "serving": [{"placement", "model_card", "vectors"}, {"registry"}],
    "features": [
        {"steering"},
        {"completion", "readouts"},
        {"constraints", "inspect"},
        {"tools"},
        {"chat", "responses"},
    ],
    "api": [{"metrics"}, {"middleware", "schemas", "dependencies"}, {"routers"}, {"app"}],
}
MAX_TOP_MODULES = 10  # server/ itself holds the entry points and the base, the rest lives in its layers


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_imports() -> dict[str, set[str]]:
    """module -> the project modules it imports (anywhere in the file)."""
    modules = {module_name(p): p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets.add(node.module)
                targets |= {f"{node.module}.{a.name}" for a in node.names}
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def test_packages_import_only_the_layers_below_them():
    bad = [
        f"{module} imports {target}"
        for module, targets in project_imports().items()
        for target in targets
        if (top := target.split(".")[0]) != module.split(".")[0]
        and top not in ALLOWED[module.split(".")[0]]
        and (module, top) not in EXCEPTIONS
    ]
    assert not bad, bad


def server_layer(module: str) -> int:
    part = module.split(".")[1] if "." in module else "__init__"
    if part == "__init__":
        return 0  # the package itself holds no code
    layer = next((i for i, names in enumerate(SERVER_LAYERS) if part in names), None)
    assert layer is not None, f"server.{part} is in no layer of SERVER_LAYERS: place it there"
    return layer


def folder_layer(module: str) -> int:
    folder, part = module.split(".")[1], (module.split(".") + ["__init__"])[2]
    if part == "__init__":
        return 0
    layer = next((i for i, names in enumerate(FOLDER_LAYERS[folder]) if part in names), None)
    assert layer is not None, f"server.{folder}.{part} is in no layer of FOLDER_LAYERS[{folder!r}]: place it there"
    return layer


def test_server_modules_import_only_the_layers_below_them():
    """config, errors <- execution <- engine <- serving <- features <- api <- the entry points."""
    bad = [
        f"{module} imports {target}"
        for module, targets in project_imports().items()
        if module.startswith("server")
        for target in targets
        if target.startswith("server.") and server_layer(target) > server_layer(module)
    ]
    assert not bad, bad


def test_folder_modules_import_only_the_layers_below_them():
    """Inside each layer's folder, e.g. the compute thread <- the compiler <- runners <- their loader."""
    bad = [
        f"{module} imports {target}"
        for module, targets in project_imports().items()
        if module.split(".")[0] == "server" and len(module.split(".")) > 2 and module.split(".")[1] in FOLDER_LAYERS
        for target in targets
        if target.split(".")[:2] == module.split(".")[:2]
        and len(target.split(".")) > 2
        and folder_layer(target) > folder_layer(module)
    ]
    assert not bad, bad


def test_server_holds_few_modules_and_a_folder_per_layer():
    top = sorted(p.stem for p in (REPO / "server").glob("*.py") if p.stem != "__init__")
    assert len(top) <= MAX_TOP_MODULES, top
    folders = {p.name for p in (REPO / "server").iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders == set(FOLDER_LAYERS), folders
    assert set(top) <= set().union(*SERVER_LAYERS), top


def test_no_import_cycles_between_modules():
    graph = project_imports()
    # a package's __init__ re-exporting its modules is not a cycle with them
    edges = {m: {t for t in ts if not (m.startswith(t + ".") and t in graph)} for m, ts in graph.items()}
    cycles, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(edges[node]):
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    assert not cycles, cycles
