"""The house's purity lines, checked by reading each module's imports (docs/DESIGN.md, "The house").

A line drawn in a design document holds only until the first import that
crosses it; these tests read every module's imports (module level, in
functions, under TYPE_CHECKING) with `ast`, so a crossing fails here and names
the module and the import.

1. The policy core (batching/) imports no asyncio, no aiohttp, no vLLM and
   nothing of server/: it is sans-IO, time is an argument.
2. Every API's translation (server/api/*/ except endpoint.py and a runner.py) and the pieces
   they share (server/wire/) import no aiohttp and no vLLM, and nothing of the
   shell, the engines or operations: bytes in, values out.
3. Nothing in server/api/ imports vLLM; the engine seam (interface.py), the
   driver and LoRA's registry (server/engines/) import no vLLM and no aiohttp.
4. Every module opens with a docstring saying why it exists.
5. Every import points down the house: each room has a floor (`FLOORS`,
   docs/DESIGN.md "The floors"), and a module imports only rooms on floors
   below its own room's (or its own room), so no import runs up and none
   goes round in a circle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _imports(path: Path) -> set[str]:
    """Every module name `path` imports, absolute, wherever the import stands."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def _crossings(path: Path, forbidden: tuple[str, ...]) -> list[str]:
    return sorted(
        name
        for name in _imports(path)
        if any(name == f or name.startswith(f + ".") for f in forbidden)
    )


def _modules(*patterns: str, skip: tuple[str, ...] = ()) -> list[Path]:
    found = {p for pattern in patterns for p in ROOT.glob(pattern)}
    return sorted(p for p in found if p.name not in skip)


CORE = _modules("batching/**/*.py")
TRANSLATION = _modules("server/wire/*.py", "server/api/*/*.py", skip=("endpoint.py", "runner.py"))
API = _modules("server/api/**/*.py")
ENGINE_SEAM = [
    ROOT / "server/engines/interface.py",
    ROOT / "server/engines/driver.py",
    ROOT / "server/engines/lora.py",
]
SHELL = (
    "server.http",
    "server.callers",  # server/http/callers.py until issue 40
    "server.router",  # server/http/routes.py until issue 40
    "server.engines",
    "server.operations",
    "server.app",
    "server.state",
)


def _id(path: Path) -> str:
    return str(path.relative_to(ROOT))


def test_the_rooms_exist() -> None:
    # An empty glob would pass every test below: these are modules it must find.
    assert ROOT / "batching/coalescer.py" in CORE
    assert ROOT / "server/wire/fields.py" in TRANSLATION
    assert ROOT / "server/api/openai_chat/parse.py" in TRANSLATION
    assert ROOT / "server/api/openai_chat/endpoint.py" not in TRANSLATION
    assert ROOT / "server/api/openai_chat/endpoint.py" in API
    assert all(p.exists() for p in ENGINE_SEAM)


@pytest.mark.parametrize("path", CORE, ids=_id)
def test_the_core_is_sans_io(path: Path) -> None:
    crossings = _crossings(path, ("asyncio", "aiohttp", "vllm", "server"))
    assert crossings == [], f"the core imports {crossings}"


@pytest.mark.parametrize("path", TRANSLATION, ids=_id)
def test_translation_is_pure(path: Path) -> None:
    crossings = _crossings(path, ("aiohttp", "vllm", "asyncio", *SHELL))
    assert crossings == [], f"a pure translation module imports {crossings}"


@pytest.mark.parametrize("path", API, ids=_id)
def test_no_api_imports_vllm(path: Path) -> None:
    assert _crossings(path, ("vllm",)) == [], "only server/engines/ imports vLLM"


@pytest.mark.parametrize("path", ENGINE_SEAM, ids=_id)
def test_the_engine_seam_imports_no_vllm(path: Path) -> None:
    crossings = _crossings(path, ("vllm", "aiohttp"))
    assert crossings == [], f"the engine seam imports {crossings}"


@pytest.mark.parametrize("path", _modules("server/**/*.py", "batching/**/*.py"), ids=_id)
def test_every_module_says_why_it_exists(path: Path) -> None:
    doc = ast.get_docstring(ast.parse(path.read_text()))
    assert doc and doc.strip(), f"{_id(path)} has no docstring"


# Rule 5: the house's rooms by module prefix, and their floors (docs/DESIGN.md).
FLOORS = {
    "server.__main__": 10,
    "server.app": 9,
    "server.cli": 9,
    "server.router": 8,
    "server.options": 8,
    "server.api": 7,
    "server.http": 6,
    "server.state": 5,
    "server.settings": 4,
    "server.callers": 3,
    "server.operations": 3,
    "server.engines": 2,
    "server.wire": 1,
    "server.errors": 0,
    "server.listen": 0,
    "server": 0,  # the package's face: its version only
    "batching": 0,
}


def _room(module: str) -> str | None:
    """The room (a key of FLOORS) a module name belongs to; None outside the house."""
    rooms = [r for r in FLOORS if module == r or module.startswith(r + ".")]
    return max(rooms, key=len) if rooms else None


def _module(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


HOUSE = _modules("server/**/*.py", "batching/**/*.py")


@pytest.mark.parametrize("path", HOUSE, ids=_id)
def test_every_module_stands_in_a_room_with_a_floor(path: Path) -> None:
    # A new top-level module must be given its floor, not fall into the package's face.
    assert _room(_module(path)) not in (None, "server") or path == ROOT / "server/__init__.py"


@pytest.mark.parametrize("path", HOUSE, ids=_id)
def test_every_import_points_down(path: Path) -> None:
    room = _room(_module(path))
    assert room is not None
    up = sorted(
        name
        for name in _imports(path)
        if (target := _room(name)) is not None and target != room and FLOORS[target] >= FLOORS[room]
    )
    assert up == [], f"{_id(path)} (floor {FLOORS[room]}) imports on its floor or above: {up}"
