import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest
from peft import PeftConfig
from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING, PEFT_TYPE_TO_PREFIX_MAPPING, PEFT_TYPE_TO_TUNER_MAPPING
from peft.utils.peft_types import PeftType

import peft_fastlora
from peft_fastlora import _registry


def test_fastlora_is_a_peft_type():
    assert PeftType.FASTLORA == "FASTLORA"
    assert PeftType("FASTLORA") is PeftType.FASTLORA
    assert PeftType["FASTLORA"] is PeftType.FASTLORA
    assert PeftType.FASTLORA in list(PeftType)


def test_registered_with_lora_prefix_and_classes():
    assert PEFT_TYPE_TO_CONFIG_MAPPING[PeftType.FASTLORA] is peft_fastlora.FastLoraConfig
    assert PEFT_TYPE_TO_TUNER_MAPPING[PeftType.FASTLORA] is peft_fastlora.FastLoraModel
    assert PEFT_TYPE_TO_PREFIX_MAPPING[PeftType.FASTLORA] == "lora_"
    assert PEFT_TYPE_TO_PREFIX_MAPPING[PeftType.LORA] == "lora_", "LoRA's own prefix must be left in place"


def test_registration_is_idempotent_on_reimport():
    members_before = list(PeftType)
    importlib.reload(_registry)
    reloaded = importlib.reload(peft_fastlora)
    assert list(PeftType) == members_before
    assert PEFT_TYPE_TO_CONFIG_MAPPING[PeftType.FASTLORA] is reloaded.FastLoraConfig
    assert isinstance(reloaded.FastLoraConfig(r=4), PeftConfig)


def test_unsupported_peft_version_fails_loudly(monkeypatch):
    monkeypatch.setattr(_registry.peft, "__version__", "0.19.0")
    with pytest.raises(_registry.UnsupportedPeftVersionError, match=r"peft>=0\.21\.0 .*0\.19\.0 is older"):
        _registry.check_peft_version()


def test_a_newer_peft_with_the_same_internals_is_accepted(monkeypatch):
    """No upper bound: a release after the tested one passes as long as the internals it lists resolve."""
    monkeypatch.setattr(_registry.peft, "__version__", "0.23.1")
    _registry.check_peft_version()


def test_missing_internal_fails_loudly(monkeypatch):
    from peft import mapping

    monkeypatch.delattr(mapping, "PEFT_TYPE_TO_PREFIX_MAPPING")
    with pytest.raises(_registry.UnsupportedPeftVersionError, match="PEFT_TYPE_TO_PREFIX_MAPPING"):
        _registry.check_peft_version()


def test_import_does_not_initialise_cuda():
    code = "import torch, peft_fastlora; assert not torch.cuda.is_initialized(); print('ok')"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("ok")


# ---- package structure -------------------------------------------------------------------------------------------
PACKAGE = Path(peft_fastlora.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _package_modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imported_modules(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules that ``name`` imports anywhere in its file (top level and inside functions)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # `import a.b.c` of a non-module attribute: its module
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def test_import_graph_is_acyclic():
    modules = _package_modules()
    graph = {name: _imported_modules(name, path, modules) for name, path in modules.items()}
    assert graph["peft_fastlora.layer"] and "peft_fastlora.bnb" in graph["peft_fastlora.distributed.prepare"]  # live
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = path[path.index(nxt):] + [nxt] if nxt in path else [node, nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])


def test_tuner_does_not_import_distributed():
    modules = _package_modules()
    tuner = ["config", "dtypes", "layer", "model", "bnb", "guard", "trainer_check", "_registry"]
    for short in tuner:
        name = f"peft_fastlora.{short}"
        imported = _imported_modules(name, modules[name], modules)
        assert not any(m.startswith("peft_fastlora.distributed") for m in imported), (name, imported)


# ---- private PEFT API: listed once, used through the registry ------------------------------------------------------
def _peft_private_names() -> set[str]:
    """Single-underscore attribute names that PEFT's LoRA tuner classes (and their bases) define."""
    from peft.tuners.lora import LoraLayer, LoraModel
    from peft.tuners.tuners_utils import BaseTuner, BaseTunerLayer

    names = set()
    for cls in (LoraModel, LoraLayer, BaseTuner, BaseTunerLayer):
        for klass in cls.__mro__:
            if klass.__module__.startswith("peft"):
                names |= {n for n in vars(klass) if n.startswith("_") and not n.startswith("__")}
    return names


def test_every_private_peft_symbol_used_is_listed_in_the_registry():
    listed = {s.owner.rpartition(".")[2] for s in _registry.PRIVATE_PEFT_API}
    private = _peft_private_names()
    used = {}
    for name, path in _package_modules().items():
        if name == "peft_fastlora._registry":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("peft"):
                for alias in node.names:
                    assert not alias.name.startswith("_") and alias.name not in listed, (
                        f"{name} imports {node.module}.{alias.name}: go through peft_fastlora._registry"
                    )
            attr = node.attr if isinstance(node, ast.Attribute) else getattr(node, "name", None)
            if isinstance(node, (ast.Attribute, ast.FunctionDef)) and attr in private:
                used.setdefault(attr, set()).add(name)
    unlisted = {attr: mods for attr, mods in used.items() if attr not in listed}
    assert not unlisted, f"private PEFT names used outside _registry without a PRIVATE_PEFT_API entry: {unlisted}"
    assert {"_create_new_module", "_cast_adapter_dtype", "_move_adapter_to_device_of_base_layer"} <= set(used)


def test_every_listed_symbol_resolves():
    for symbol in _registry.PRIVATE_PEFT_API:
        assert _registry._resolve(symbol) is not None, symbol


def test_a_missing_private_symbol_fails_the_check(monkeypatch):
    from peft.tuners.lora import LoraModel

    monkeypatch.delattr(LoraModel, "_create_new_module")
    with pytest.raises(_registry.UnsupportedPeftVersionError, match=r"LoraModel\._create_new_module"):
        _registry.check_peft_version()


def test_peft_version_is_checked_once_at_import():
    code = (
        "import sys\n"
        "calls = []\n"
        "sys.setprofile(lambda frame, event, arg: calls.append(1)\n"
        "               if event == 'call' and frame.f_code.co_name == 'check_peft_version' else None)\n"
        "import peft_fastlora\n"
        "sys.setprofile(None)\n"
        "print(len(calls))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "1"
