"""The Hydra configs have one home, the top-level ``configs/``: no copy under the package, the recipe's
lookup resolves to it (installed or not), and pyproject.toml ships it as ``lightning_hotspa.configs``
with every yaml file and every package of the checkout."""

from __future__ import annotations

import glob
import importlib.resources
import sys
from pathlib import Path

import pytest
from setuptools import find_namespace_packages

from lightning_hotspa.adapter.recipes import hydra_recipe

ROOT = Path(__file__).resolve().parents[2]
HOME = ROOT / "configs"


def _pyproject() -> dict:
    if sys.version_info >= (3, 11):
        import tomllib
    else:
        tomllib = pytest.importorskip("tomli")
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]


def test_configs_live_only_at_the_top_level() -> None:
    assert (HOME / "config.yaml").is_file()
    assert sorted(p.name for p in HOME.iterdir() if p.is_dir() and p.name != "__pycache__") == [
        "data", "hardware", "logger", "model", "strategy", "trainer"]
    copies = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "lightning_hotspa").rglob("*.yaml"))
    assert copies == [], f"configs belong in configs/ only: {copies}"
    assert hydra_recipe.CONFIG_DIR.resolve() == HOME
    assert hydra_recipe.group_options("hardware") == sorted(p.stem for p in (HOME / "hardware").glob("*.yaml"))


def test_a_checkout_run_without_installing_finds_the_same_folder(monkeypatch: pytest.MonkeyPatch) -> None:
    def not_installed(name: str):
        raise ModuleNotFoundError(f"No module named {name!r}")

    monkeypatch.setattr(hydra_recipe.importlib.resources, "files", not_installed)
    assert hydra_recipe.find_config_dir().resolve() == HOME


def test_the_installed_package_resolves_to_the_top_level_folder() -> None:
    try:
        found = Path(str(importlib.resources.files("lightning_hotspa.configs")))
    except ModuleNotFoundError:
        pytest.skip("this environment's install of lightning_hotspa predates configs/ (run make install)")
    assert found.resolve() == HOME


def test_pyproject_ships_configs_as_the_package() -> None:
    tool = _pyproject()
    assert tool["package-dir"] == {"lightning_hotspa.configs": "configs"}
    found = find_namespace_packages(str(ROOT), include=["lightning_hotspa*"])
    missing = sorted(set(found) - set(tool["packages"]))
    assert not missing, f"add these packages to [tool.setuptools] packages in pyproject.toml: {missing}"
    assert sorted(tool["packages"]) == sorted([*found, "lightning_hotspa.configs"])
    patterns = tool["package-data"]["lightning_hotspa.configs"]
    shipped = {Path(f).resolve() for pattern in patterns for f in glob.glob(str(HOME / pattern), recursive=True)}
    assert shipped == {p.resolve() for p in HOME.rglob("*.yaml")}
