"""The Hydra configs of ``recipes/train.py`` (``config.yaml`` and one folder per config group).

This folder is the one copy. pyproject.toml ships it as the package ``lightning_hotspa.configs``, so
a wheel and an editable install find it with ``importlib.resources``; a checkout run without
installing finds it beside ``lightning_hotspa/`` (``lightning_hotspa.adapter.recipes.hydra_recipe.CONFIG_DIR``).
"""
