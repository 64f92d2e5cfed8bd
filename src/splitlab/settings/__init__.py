"""A run's setting: who holds what of its samples, as a `Plan` that splitlab.build places in this
process, on Ray actors or over the network. `horizontal` (setting=vanilla: clients hold whole
samples) and `vertical` (parties hold different features of shared samples, aligned by private
set intersection) are the two settings; a third is one more module and one more entry here.
"""

from __future__ import annotations

from splitlab.config import ResolvedConfig
from splitlab.settings.base import Hosted, Plan, Setting
from splitlab.settings.horizontal import Horizontal
from splitlab.settings.vertical import Vertical

#: setting= -> the setting
SETTINGS: dict[str, Setting] = {"vanilla": Horizontal(), "vertical": Vertical()}


def setting_of(config: ResolvedConfig) -> Setting:
    return SETTINGS[config.run.setting]


__all__ = ["SETTINGS", "Hosted", "Plan", "Setting", "setting_of"]
