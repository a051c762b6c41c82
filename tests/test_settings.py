"""lens_evals.settings: every environment variable the package reads is listed there and in
docs/settings.md (generated from it), is read through it (no ``os.environ`` read of a
``LENS_EVALS_*`` name elsewhere), and is read when asked for, not at import. No engine."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lens_evals import host_memory, settings

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "lens_evals"
SETTINGS_FILE = PACKAGE / "settings.py"
DOCS_PAGE = ROOT / "docs" / "settings.md"
NAME = re.compile(r"\bLENS_EVALS_[A-Z0-9_]*[A-Z0-9]\b")
NAMES = {setting.name for setting in settings.ALL}


def package_files() -> list[Path]:
    """The package's modules and the benchmarks' (a checkout's ``benchmarks/`` reads settings too)."""
    paths = [*PACKAGE.rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py")]
    return [path for path in sorted(paths) if path != SETTINGS_FILE]


def test_every_name_in_the_package_is_a_setting() -> None:
    unknown = {
        f"{path.relative_to(ROOT)}: {name}"
        for path in package_files()
        for name in NAME.findall(path.read_text(encoding="utf-8"))
        if name not in NAMES
    }
    assert not unknown, f"LENS_EVALS_* names missing from lens_evals/settings.py: {sorted(unknown)}"


def _environment_reads(tree: ast.Module) -> list[ast.expr]:
    """The key argument of every ``os.environ.get(k)``, ``os.getenv(k)``, ``os.environ[k]`` (load)."""
    keys: list[ast.expr] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            target = ast.unparse(node.func)
            if target in ("os.environ.get", "os.getenv", "environ.get", "getenv"):
                keys.append(node.args[0])
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and ast.unparse(node.value) in ("os.environ", "environ"):
            keys.append(node.slice)
    return keys


def _module_strings(tree: ast.Module) -> dict[str, str]:
    """Module-level ``NAME = "literal"`` assignments (tuples of them too)."""
    found: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
            pairs = zip(target.elts, value.elts) if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple) else [(target, value)]
            for name, literal in pairs:
                if isinstance(name, ast.Name) and isinstance(literal, ast.Constant) and isinstance(literal.value, str):
                    found[name.id] = literal.value
    return found


def test_no_setting_is_read_around_the_settings_module() -> None:
    offenders = []
    for path in package_files():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        strings = _module_strings(tree)
        for key in _environment_reads(tree):
            value = key.value if isinstance(key, ast.Constant) else strings.get(key.id) if isinstance(key, ast.Name) else None
            if not isinstance(value, str) or value in NAMES or value.startswith("LENS_EVALS_"):
                offenders.append(f"{path.relative_to(ROOT)}:{key.lineno}: {ast.unparse(key)}")
    assert not offenders, f"environment reads of settings (or of names not known here) outside lens_evals.settings: {offenders}"


def test_every_setting_is_used_in_the_package() -> None:
    sources = "\n".join(path.read_text(encoding="utf-8") for path in package_files())
    attributes = {name for name, value in vars(settings).items() if isinstance(value, settings.Setting)}
    unused = sorted(name for name in attributes if not re.search(rf"\bsettings\.{name}\b", sources))
    assert not unused, f"settings never read in the package: {unused}"
    assert len(attributes) == len(settings.ALL) == len(NAMES), "every Setting is listed once in settings.ALL"


def test_docs_table_is_generated_from_the_module() -> None:
    page = DOCS_PAGE.read_text(encoding="utf-8")
    assert settings.markdown_table() in page, (
        "docs/settings.md is stale: paste the output of "
        "`python -c 'from lens_evals import settings; print(settings.markdown_table(), end=\"\")'`"
    )
    documented = set(re.findall(r"^\| `([A-Z0-9_]+)` \|", page, re.MULTILINE))
    assert documented == NAMES


def test_read_when_asked_not_at_import(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LENS_EVALS_MAX_CAPTURE_GIB", raising=False)
    assert settings.MAX_CAPTURE_GIB.get() == 4.0 and settings.MAX_CAPTURE_GIB.in_bytes() == 4 * 2**30
    monkeypatch.setenv("LENS_EVALS_MAX_CAPTURE_GIB", "0.5")
    assert settings.MAX_CAPTURE_GIB.in_bytes() == 2**29
    monkeypatch.setenv("LENS_EVALS_MAX_SAVED_MIB", "1.5")
    assert settings.MAX_SAVED_MIB.in_bytes() == 3 * 2**19
    monkeypatch.setenv("LENS_EVALS_MAX_CAPTURE_GIB", "")  # empty is unset
    assert settings.MAX_CAPTURE_GIB.get() == 4.0
    monkeypatch.setenv("LENS_EVALS_PROBE_DIR", "/x/probes")
    assert settings.PROBE_DIR.get() == Path("/x/probes")
    monkeypatch.delenv("LENS_EVALS_PROBE_DIR")
    monkeypatch.chdir(ROOT / "docs")
    assert settings.PROBE_DIR.get() == ROOT / "probes"  # the repository's, whatever the working directory


@pytest.mark.parametrize(
    ("raw", "expected"),
    [("1", True), ("TRUE", True), (" yes ", True), ("on", True), ("0", False), ("False", False), ("no", False), ("off", False)],
)
def test_flag_spellings(monkeypatch: pytest.MonkeyPatch, raw: str, expected: bool) -> None:
    monkeypatch.setenv("LENS_EVALS_TRUST_ARCH", raw)
    assert settings.TRUST_ARCH.get() is expected


def test_bad_values_name_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LENS_EVALS_TRUST_ARCH", "maybe")
    with pytest.raises(ValueError, match="LENS_EVALS_TRUST_ARCH='maybe': expected one of"):
        settings.TRUST_ARCH.get()
    monkeypatch.setenv("LENS_EVALS_MAX_HOOK_SETS", "3.5")
    with pytest.raises(ValueError, match="LENS_EVALS_MAX_HOOK_SETS='3.5': expected an integer"):
        settings.MAX_HOOK_SETS.get()
    monkeypatch.setenv("LENS_EVALS_MAX_CAPTURE_GIB", "four")
    with pytest.raises(ValueError, match="LENS_EVALS_MAX_CAPTURE_GIB='four': expected a number"):
        settings.MAX_CAPTURE_GIB.in_bytes()
    with pytest.raises(TypeError, match="not a size"):
        settings.TRUST_ARCH.in_bytes()


def test_a_child_process_reads_the_environment_it_starts_with() -> None:
    """What vLLM's engine core and workers see: the environment at their start."""
    code = "from lens_evals import settings; print(settings.MAX_HELD_CAPTURE_GIB.in_bytes(), settings.DISABLE.get())"
    env = {"PATH": "/usr/bin:/bin", "LENS_EVALS_MAX_HELD_CAPTURE_GIB": "0.25", "LENS_EVALS_DISABLE": "yes"}
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.split() == [str(2**28), "True"]


@pytest.mark.parametrize("raw", ["nan", "inf", "-inf", "-1", "-0.5"])
def test_a_size_that_is_negative_or_not_finite_is_refused_naming_the_variable(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    """NaN used to pass as a limit (every comparison with it is false) and fail later in
    ``in_bytes`` with "cannot convert float NaN to integer"; -1 became a limit of -2**30 bytes."""
    monkeypatch.setenv("LENS_EVALS_MAX_CAPTURE_GIB", raw)
    with pytest.raises(ValueError, match=rf"LENS_EVALS_MAX_CAPTURE_GIB='{re.escape(raw)}': expected a finite number, 0 or more"):
        settings.MAX_CAPTURE_GIB.get()
    with pytest.raises(ValueError, match="LENS_EVALS_MAX_CAPTURE_GIB="):
        settings.MAX_CAPTURE_GIB.in_bytes()


def test_a_negative_count_is_refused_naming_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LENS_EVALS_MAX_HOOK_SETS", "-5")
    with pytest.raises(ValueError, match="LENS_EVALS_MAX_HOOK_SETS='-5': expected an integer, 0 or more"):
        settings.MAX_HOOK_SETS.get()
    monkeypatch.setenv("LENS_EVALS_HANDOFF_POOL_MIB", "0")  # 0 is a documented value (no pool)
    assert settings.HANDOFF_POOL_MIB.in_bytes() == 0
    monkeypatch.setenv("LENS_EVALS_WRITE_THREADS", "0")
    assert settings.WRITE_THREADS.get() == 0


def test_the_pool_default_is_a_quarter_of_the_hosts_memory_at_least_4_gib(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reference: /proc/meminfo's MemTotal (the kernel's count of the pages ``SC_PHYS_PAGES``
    reads), lowered to the cgroup v2 limit where one is set."""
    monkeypatch.delenv(settings.HANDOFF_POOL_MIB.name, raising=False)
    meminfo = Path("/proc/meminfo").read_text()
    total = int(re.search(r"^MemTotal:\s+(\d+) kB", meminfo, re.M).group(1)) * 1024  # type: ignore[union-attr]
    limit = Path("/sys/fs/cgroup/memory.max")
    if limit.exists() and limit.read_text().strip().isdigit():
        total = min(total, int(limit.read_text()))
    assert host_memory.host_memory_bytes() == total
    assert settings.HANDOFF_POOL_MIB.get() == max(4096.0, total / 4 / 2**20)
    monkeypatch.setenv(settings.HANDOFF_POOL_MIB.name, "512")
    assert settings.HANDOFF_POOL_MIB.in_bytes() == 512 * 2**20
