"""A run's setting: who holds what of its samples, as a `Plan` that splitlab.build places in this
process, on Ray actors or over the network. `horizontal` (setting=vanilla: clients hold whole
samples) and `vertical` (parties hold different features of shared samples, aligned by private
set intersection) are the two settings; a third is one more module and one more entry here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from splitlab.config import ResolvedConfig, RunConfig
from splitlab.errors import UserError
from splitlab.settings.base import Hosted, Plan, Setting
from splitlab.settings.horizontal import Horizontal
from splitlab.settings.vertical import Vertical

#: setting= -> the setting
SETTINGS: dict[str, Setting] = {"vanilla": Horizontal(), "vertical": Vertical()}


def setting_of(config: ResolvedConfig) -> Setting:
    return SETTINGS[config.run.setting]


def stored_setting(stored: Mapping[str, Any]) -> Setting:
    """The setting of a finished run's stored config (a name that is none: the default's, whose
    build then refuses it in one line)."""
    return SETTINGS.get(str(stored.get("setting")), SETTINGS[RunConfig.model_fields["setting"].default])


def check_keys(config: ResolvedConfig) -> Setting:
    """The run's setting, once a key that only another setting takes, or one this setting cannot
    use, given other than its default, is refused in one line (as splitlab.config's ONLY_WHEN)."""
    run, setting = config.run, setting_of(config)
    others = {key: why for other in SETTINGS.values() if other is not setting for key, why in other.own_keys.items()}
    for key, why in {**others, **setting.refused_keys}.items():
        if getattr(run, key) != RunConfig.model_fields[key].default:
            raise UserError(f"{key}={getattr(run, key)} does not apply here: {why}")
    return setting


__all__ = ["SETTINGS", "Hosted", "Plan", "Setting", "check_keys", "setting_of", "stored_setting"]
