"""Puts ``pkg://megatrain_lightning.configs`` on every Hydra app's search path.

Hydra imports the modules under ``hydra_plugins`` when it starts, so a user's own Hydra app can
select ``model=tiny_llama strategy=megatrain ...`` (or compose ``train``) from the installed
package without copying configs. Importing ``megatrain_lightning`` here also registers
``Trainer(strategy="megatrain")`` before any config is instantiated. The configs are appended,
so an app's own config groups and options take precedence.
"""

from __future__ import annotations

import warnings

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin

try:
    with warnings.catch_warnings():
        # Hydra reports warnings raised while it imports a plugin as the plugin's fault.
        warnings.simplefilter("ignore")
        import megatrain_lightning  # noqa: F401  (registers the "megatrain" strategy)
except ImportError as err:  # never break unrelated Hydra apps in the same environment
    warnings.warn(f"megatrain_lightning could not be imported by its Hydra plugin: {err}", stacklevel=1)


class MegaTrainSearchPathPlugin(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        search_path.append(provider="megatrain_lightning", path="pkg://megatrain_lightning.configs")
