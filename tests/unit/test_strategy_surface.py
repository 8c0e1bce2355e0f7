"""Issue 57 item 4: ``HotSPaStrategy`` takes <= 8 top-level arguments and <= 3 typed option groups
(adapter/lightning/strategy_options.py), each group also a dict (as Hydra passes it) and mirrored by the
Hydra strategy configs; every keyword it took before names its new place, in Python and from Hydra."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
from omegaconf import OmegaConf

from lightning_hotspa import HotSPaStrategy, ReliabilityOptions, RuntimeOptions
from lightning_hotspa.adapter.lightning.strategy_options import GROUPS, MOVED
from lightning_hotspa.adapter.recipes.hydra_recipe import CONFIG_DIR, ConfigError, check_config, check_overrides

#: HotSPaStrategy.__init__'s keywords before issue 57 (main 37d0817): each one is still accepted or names its place
BEFORE = ("layouts", "tokens_per_rank", "planner", "hardware", "activation_checkpointing", "default_layout",
          "nonfinite", "breadcrumb_dir", "accelerator", "parallel_devices", "cluster_environment", "checkpoint_io",
          "precision_plugin", "process_group_backend", "timeout", "subgroup_timeout", "compile_blocks", "bucket_mb",
          "switch_buckets_in_flight", "reduce_buckets_in_flight", "fsdp_reduce_dtype", "tp_regather", "fp8")


def _parameters() -> list[str]:
    return [n for n in inspect.signature(HotSPaStrategy.__init__).parameters if n != "self"]


def test_at_most_eight_arguments_and_three_typed_groups() -> None:
    params = _parameters()
    groups = [n for n in params if n in GROUPS]
    assert set(groups) == set(GROUPS) and len(groups) <= 3, groups
    assert len(params) - len(groups) <= 8 and len(params) <= 11, params
    for name in groups:
        cls = GROUPS[name]
        assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen, cls
        assert cls.__name__ in str(inspect.signature(HotSPaStrategy.__init__).parameters[name].annotation)
        doc = inspect.getdoc(cls) or ""
        undocumented = [f.name for f in dataclasses.fields(cls) if f"    {f.name}:" not in doc]
        assert not undocumented, f"{cls.__name__} fields without a line in its docstring: {undocumented}"
    with pytest.raises(dataclasses.FrozenInstanceError):
        RuntimeOptions().fp8 = "rowwise"  # type: ignore[misc]


@pytest.mark.parametrize("name", BEFORE)
def test_every_old_keyword_is_accepted_or_names_its_new_place(name: str) -> None:
    if name in _parameters():
        assert name not in MOVED
        return
    assert name in MOVED, f"HotSPaStrategy({name}=...) vanished without a message"
    with pytest.raises(TypeError) as info:
        HotSPaStrategy(["dp1"], **{name: object()})
    message = str(info.value)
    assert f"HotSPaStrategy({name}=...) moved" in message
    group = MOVED[name]
    if group in GROUPS:
        assert name in {f.name for f in dataclasses.fields(GROUPS[group])}
        assert f"{group}={GROUPS[group].__name__}({name}=...)" in message and f"strategy.{group}.{name}" in message
    else:
        assert "Trainer(" in message


def test_a_group_as_a_dict_is_the_same_as_the_dataclass() -> None:
    fields = dict(compile_blocks={"backend": "aot_eager"}, tp_regather=False, fsdp_reduce_dtype="bf16", bucket_mb=8,
                  switch_buckets_in_flight=3, reduce_buckets_in_flight=2, process_group_backend="gloo")
    typed = HotSPaStrategy(["dp1"], runtime=RuntimeOptions(**fields),
                           reliability=ReliabilityOptions(subgroup_timeout=7))
    plain = HotSPaStrategy(["dp1"], runtime=fields, reliability={"subgroup_timeout": 7})
    assert typed.runtime == plain.runtime and typed.reliability == plain.reliability
    for attr in ("_compile", "_tp_regather", "_fsdp_reduce_dtype", "_bucket_args", "_process_group_backend",
                 "_subgroup_timeout", "fp8"):
        assert getattr(typed, attr) == getattr(plain, attr), attr
    assert plain._compile == {"backend": "aot_eager", "dynamic": True} and plain._tp_regather is False
    default = HotSPaStrategy(["dp1"])
    assert default.runtime == RuntimeOptions() and default.reliability == ReliabilityOptions()
    with pytest.raises(TypeError, match=r"runtime: unknown option\(s\) \['compile', 'fp16'\] for RuntimeOptions"):
        HotSPaStrategy(["dp1"], runtime={"compile": True, "fp16": 1, "fp8": None})
    with pytest.raises(TypeError, match=r"reliability: unknown option\(s\) \['timeout'\].*'subgroup_timeout'"):
        HotSPaStrategy(["dp1"], reliability={"timeout": 3})
    with pytest.raises(TypeError, match=r"reliability must be a ReliabilityOptions.*got RuntimeOptions"):
        HotSPaStrategy(["dp1"], reliability=RuntimeOptions())


def test_the_hydra_strategy_configs_mirror_the_groups() -> None:
    """strategy/hotspa.yaml carries every field of each group at its default; no strategy config has a key
    that is not a field, nor a keyword that moved."""
    paths = sorted((CONFIG_DIR / "strategy").glob("*.yaml"))
    assert paths
    for path in paths:
        node = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
        assert not set(node) & set(MOVED), (path.name, set(node) & set(MOVED))
        for group, cls in GROUPS.items():
            names = {f.name for f in dataclasses.fields(cls)}
            keys = set(node.get(group) or {})
            assert keys <= names, (path.name, group, keys - names)
            if path.name == "hotspa.yaml":
                assert keys == names, (group, names - keys)
                assert node[group] == dataclasses.asdict(cls()), (group, node[group])


def _composed(*overrides: str):
    from hydra import compose, initialize_config_dir

    from lightning_hotspa.adapter.recipes.hydra_recipe import register_resolvers

    register_resolvers()
    with initialize_config_dir(version_base="1.3", config_dir=str(CONFIG_DIR)):
        return compose("config", overrides=["output_dir=out", "run_name=t", "logger=none", "hardware=cpu-gloo",
                                             *overrides])


def test_hydra_builds_the_groups_and_names_an_old_key() -> None:
    from lightning_hotspa.adapter.recipes.hydra_recipe import build

    cfg = _composed("strategy.runtime.compile_blocks={backend: aot_eager}", "strategy.reliability.subgroup_timeout=9")
    check_config(cfg)
    strategy = build("strategy", cfg.strategy)
    assert strategy.runtime == RuntimeOptions(compile_blocks={"backend": "aot_eager"})
    assert strategy.reliability == ReliabilityOptions(subgroup_timeout=9)
    message = "HotSPaStrategy(compile_blocks=...) moved: use runtime=RuntimeOptions(compile_blocks=...)"
    with pytest.raises(ConfigError, match=r"strategy\.runtime\.compile_blocks") as info:
        check_config(_composed("+strategy.compile_blocks=true"))  # a user's config with the old key, too
    assert message in str(info.value)
    assert message in check_overrides(["trainer.max_steps=3", "strategy.compile_blocks=true"])
    assert "Trainer(accelerator=...)" in check_overrides(["+strategy.accelerator=cpu"])
    assert check_overrides(["strategy.runtime.compile_blocks=true", "trainer.accelerator=cpu"]) is None
    with pytest.raises(ConfigError, match=r"strategy: could not build .*unknown option\(s\) \['compile'\]"):
        build("strategy", _composed("+strategy.runtime.compile=true").strategy)
