"""Packaging: the declared dependency ranges, the wheel's contents, ``__version__``, and the README's set-up commands.

The ranges must admit the newest releases of what peft-fastlora depends on (an install next to a newer torch must not
downgrade it), and may only exclude a release that docs/versions.md names as breaking.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

tomllib = pytest.importorskip("tomllib" if sys.version_info >= (3, 11) else "tomli")

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
DEPENDENCIES = {Requirement(r).name.lower(): Requirement(r) for r in PYPROJECT["project"]["dependencies"]}
README = (REPO / "README.md").read_text(encoding="utf-8")
VERSIONS_DOC = (REPO / "docs" / "versions.md").read_text(encoding="utf-8")

# Releases known to exist on the package index (looked up on 2026-11-26), oldest tested to newest. Add new ones here
# when they come out; the online test below asks the index itself.
KNOWN_RELEASES = {
    "torch": ["2.11.0", "2.13.0", "2.14.0", "2.14.1", "2.15.0"],
    "triton": ["3.6.0", "3.9.0", "3.10.0"],
    "peft": ["0.21.0", "0.21.2", "0.22.0"],
    "transformers": ["5.17.0", "5.24.0"],
    "bitsandbytes": ["0.50.2", "0.51.0"],
    "accelerate": ["1.10.0", "1.15.0"],
}
UPPER_BOUND_OPERATORS = ("<", "<=", "==", "===", "~=", "!=")


def known_to_break() -> set[str]:
    """Package names in docs/versions.md's "Known to break" table: the only ones that may have an upper bound."""
    section = VERSIONS_DOC.split("## Known to break", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")][2:]  # skip the header and its rule
    return {row.split("|")[1].strip().lower() for row in rows} - {"(none)"}


@pytest.mark.parametrize(
    "name, version", [(name, v) for name, versions in KNOWN_RELEASES.items() for v in versions], ids=str
)
def test_declared_range_admits_known_release(name, version):
    requirement = DEPENDENCIES[name]
    assert requirement.specifier.contains(Version(version), prereleases=True), (
        f"pyproject.toml requires {requirement}, which refuses the released {name} {version}: an install next to it "
        "would downgrade it. Lift the bound, or name the release in docs/versions.md's 'Known to break' table."
    )


@pytest.mark.parametrize("requirement", DEPENDENCIES.values(), ids=str)
def test_upper_bounds_only_where_docs_say_a_release_breaks(requirement):
    capped = [s for s in requirement.specifier if s.operator in UPPER_BOUND_OPERATORS]
    if capped:
        assert requirement.name.lower() in known_to_break(), (
            f"{requirement} has an upper bound or exclusion; add a row to docs/versions.md's 'Known to break' table "
            "saying which release breaks and why, or drop the bound."
        )


def test_versions_doc_shows_the_declared_ranges():
    table = VERSIONS_DOC.split("| Package ", 1)[1].split("\n\n", 1)[0]
    documented = {}
    for row in table.splitlines()[2:]:
        cells = [c.strip() for c in row.strip("|").split("|")]
        documented[cells[0].lower().replace("_", "-")] = re.match(r"`([^`]*)`", cells[1]).group(1)
    declared = {name.replace("_", "-"): str(req.specifier) for name, req in DEPENDENCIES.items()}
    declared["python"] = PYPROJECT["project"]["requires-python"]
    assert documented == declared


def test_build_backend_reads_spdx_license():
    """SPDX ``license`` strings and ``license-files`` need setuptools 77 (older ones reject them)."""
    (setuptools,) = [Requirement(r) for r in PYPROJECT["build-system"]["requires"] if r.startswith("setuptools")]
    assert not setuptools.specifier.contains("76.1.0") and setuptools.specifier.contains("77.0.0")
    project = PYPROJECT["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    assert "Apache License" in (REPO / "LICENSE").read_text(encoding="utf-8")
    assert {"Homepage", "Documentation", "Source", "Issues"} <= project["urls"].keys()


def test_version_comes_from_the_installed_metadata():
    import importlib.metadata

    import peft_fastlora

    try:
        installed = importlib.metadata.version("peft-fastlora")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("peft-fastlora is not installed (running from a source tree)")
    assert peft_fastlora.__version__ == installed


@pytest.mark.slow
@pytest.mark.parametrize("metadata_version, expected", [("9.8.7", "9.8.7"), (None, "0+unknown")])
def test_version_follows_metadata_and_falls_back_without_an_install(metadata_version, expected):
    """In a fresh interpreter, with ``importlib.metadata`` answering ``metadata_version`` (``None``: not installed)."""
    code = f"""
import importlib.metadata as md
real = md.version
def version(name):
    if name != "peft-fastlora":
        return real(name)
    if {metadata_version!r} is None:
        raise md.PackageNotFoundError(name)
    return {metadata_version!r}
md.version = version
import peft_fastlora
print(peft_fastlora.__version__)
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == expected


def newest_release(name: str) -> Version | None:
    """The newest release of ``name`` on the configured package index (``pip index versions``), or ``None``."""
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "index", "versions", name, "--disable-pip-version-check"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return None
    match = re.search(rf"^{re.escape(name)} \(([^)]+)\)", proc.stdout, re.MULTILINE | re.IGNORECASE)
    return Version(match.group(1)) if proc.returncode == 0 and match else None


@pytest.mark.slow
def test_declared_ranges_admit_the_newest_releases_on_the_index():
    """Online: asks the package index for the newest release of each pinned-down dependency; skips offline."""
    newest = {name: newest_release(name) for name in KNOWN_RELEASES}
    if not any(newest.values()):
        pytest.skip("the package index cannot be reached")
    refused = {
        name: f"{DEPENDENCIES[name]} refuses {version}"
        for name, version in newest.items()
        if version is not None and not DEPENDENCIES[name].specifier.contains(version, prereleases=True)
    }
    assert not refused, refused


def test_wheel_holds_the_license_the_type_marker_and_the_kernel_configs(tmp_path):
    """``pip wheel`` of the checkout's files (no build isolation: the installed setuptools must satisfy pyproject)."""
    import importlib.metadata

    setuptools_req = next(Requirement(r) for r in PYPROJECT["build-system"]["requires"] if r.startswith("setuptools"))
    if not setuptools_req.specifier.contains(importlib.metadata.version("setuptools")):
        pytest.skip(f"the installed setuptools does not satisfy {setuptools_req}")
    git = shutil.which("git")
    if git is None or not (REPO / ".git").exists():
        pytest.skip("needs a git checkout to list the files a wheel is built from")
    files = subprocess.run([git, "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True, text=True,
                           check=True).stdout.split()  # fmt: skip
    src = tmp_path / "src"
    for name in files:
        if (REPO / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, src / name)
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path / "whl"),
         str(src)],
        capture_output=True, text=True, timeout=600, env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (wheel,) = (tmp_path / "whl").glob("peft_fastlora-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        (dist_info,) = {n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info")}
        metadata = archive.read(f"{dist_info}/METADATA").decode()
        license_text = archive.read(f"{dist_info}/licenses/LICENSE")
    configs = {f"peft_fastlora/ops/configs/{p.name}" for p in (REPO / "peft_fastlora/ops/configs").glob("*.json")}
    assert configs and configs <= names
    assert "peft_fastlora/py.typed" in names
    assert license_text == (REPO / "LICENSE").read_bytes()
    assert not {n for n in names if n.startswith(("tests/", "examples/", "benchmarks/", "docs/"))}
    assert "License-Expression: Apache-2.0" in metadata
    assert f"Version: {PYPROJECT['project']['version']}" in metadata
    assert re.search(r"^Project-URL: Source, https://", metadata, re.MULTILINE)
    requires = [Requirement(line[len("Requires-Dist: ") :]) for line in metadata.splitlines()
                if line.startswith("Requires-Dist: ")]  # fmt: skip
    runtime = {r.name.lower(): r for r in requires if r.marker is None or "extra" not in str(r.marker)}
    assert {name: str(r.specifier) for name, r in runtime.items()} == {
        name: str(r.specifier) for name, r in DEPENDENCIES.items()
    }


# ---- the README's set-up commands ------------------------------------------------------------------------------
def bash_blocks(markdown: str) -> list[str]:
    return [block.strip() for block in re.findall(r"```bash\n(.*?)```", markdown, re.DOTALL)]


def setup_section() -> str:
    return README.split("## Set-up", 1)[1].split("\n## ", 1)[0]


def test_readme_puts_the_cpu_torch_note_before_any_install():
    blocks = bash_blocks(setup_section())
    assert "--index-url https://download.pytorch.org/whl/cpu" in blocks[0]
    assert all("pip install -e" in block for block in blocks[1:3])


def test_readme_quickstart_installs_only_the_package():
    (quickstart,) = [b for b in bash_blocks(setup_section()) if "quickstart.py" in b]
    assert quickstart == "pip install -e . && python examples/quickstart.py"


def test_ci_runs_exactly_the_readme_test_command():
    (test_command,) = [b for b in bash_blocks(setup_section()) if b.endswith("pytest")]
    ci = [line for line in (REPO / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    assert ci[-1] == test_command
    assert any('pip install --quiet "torch==2.13.0"' in line for line in ci[:-1])  # CI stays on the local CPU torch


def test_readme_dtype_text_matches_the_policy_for_fp16_models():
    """The README's table and its fp16-model exception agree with ``peft_fastlora.dtypes``."""
    import torch

    from peft_fastlora.dtypes import resolve_adapter_dtype

    short = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
    table = README.split("## `adapter_dtype`", 1)[1].split("\n\n", 2)[1]
    for row in table.splitlines()[2:]:
        cells = [c.strip() for c in row.strip("|").split("|")]
        policy = re.match(r'`"([^"]+)"`', cells[0]).group(1)
        expected = [short[resolve_adapter_dtype(policy, c)] for c in (torch.float16, torch.bfloat16, torch.float32)]
        assert cells[1:] == expected, row
    assert "compute fp16, or any fp16 model" in table.splitlines()[0]
    assert "default policy gives fp32 adapters" in README


def requirement_closure(requirements: list[Requirement]) -> set[str]:
    """Names of the installed distributions that ``requirements`` pull in (extras left out), recursively."""
    import importlib.metadata

    seen: set[str] = set()
    todo = [r for r in requirements if r.marker is None or r.marker.evaluate({"extra": ""})]
    while todo:
        req = todo.pop()
        name = re.sub(r"[-_.]+", "-", req.name).lower()
        if name in seen:
            continue
        seen.add(name)
        try:
            for line in importlib.metadata.requires(name) or []:
                sub = Requirement(line)
                if sub.marker is None or sub.marker.evaluate({"extra": ""}):
                    todo.append(sub)
        except importlib.metadata.PackageNotFoundError:
            pass
    return seen


def install_only(distributions: set[str], site: Path) -> None:
    """Links the files of the installed ``distributions`` (and nothing else) into ``site``: a fresh environment's
    site-packages with only those packages, made from this one's."""
    import importlib.metadata

    site.mkdir()
    for name in sorted(distributions):
        dist = importlib.metadata.distribution(name)
        for top in sorted({Path(str(f)).parts[0] for f in dist.files or []} - {".."}):
            source = Path(dist.locate_file(top))
            if source.exists() and not (site / top).exists():
                (site / top).symlink_to(source)


@pytest.mark.slow
def test_quickstart_runs_with_only_the_package_dependencies(tmp_path):
    """The README's `pip install -e . && python examples/quickstart.py`, in an interpreter that sees only the
    distributions `pip install .` brings (the dependencies in pyproject.toml, recursively): no test or dev extra."""
    import sysconfig

    allowed = requirement_closure(list(DEPENDENCIES.values()))
    test_extra = PYPROJECT["project"]["optional-dependencies"]["test"]
    assert not allowed & {re.sub(r"[-_.]+", "-", Requirement(r).name).lower() for r in test_extra} - {"pytest"}
    install_only(allowed, tmp_path / "site")
    stdlib = [sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"]]
    stdlib.append(str(Path(stdlib[1]) / "lib-dynload"))
    path = [str(REPO / "examples"), str(REPO), str(tmp_path / "site"), *stdlib]
    code = f"""
import runpy, sys
sys.path[:] = {path!r}
sys.argv = ["quickstart.py", "--epochs", "2", "--samples", "8"]
for missing in ("trl", "matplotlib", "datasets", "pytest"):
    try:
        __import__(missing)
    except ImportError:
        pass
    else:
        raise SystemExit(f"{{missing}} is importable: the environment is not as fresh as meant")
runpy.run_path({str(REPO / "examples" / "quickstart.py")!r}, run_name="__main__")
"""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-I", "-S", "-c", code], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Generated:" in proc.stdout
