"""Experiments: sweep files (a grid of runs), result tables, paper-style reports and plots.

- `expand_sweep(path_or_dict)` -> `[(run_name, config), ...]`, validated before anything runs.
- `run_sweep(path, out=None, jobs=1)` runs the grid (resumable, in parallel processes) and
  returns the sweep directory; raises `SweepFailed` at the end if some runs failed.
- `write_report(sweep_dir, target_accuracy=None)` writes `results.csv`, `report.md` and
  `plots/*.png` from whatever runs have finished and returns the path of `report.md`.

Modules, by concern: `grid` (sweep files, validation, grid expansion), `sweep` (running the
grid), `runs` (loading run directories), `analysis` (result rows, seed groups, layout),
`tables` (report.md), `plots` (PNG figures), `report` (writing the three outputs).

The sweep file format and the report's contents are documented in `docs/experiments.md`.
"""

from splitlab.experiments.grid import expand_sweep, load_sweep, run_name
from splitlab.experiments.report import collect_results, write_report
from splitlab.experiments.sweep import SweepFailed, run_sweep

__all__ = [
    "SweepFailed",
    "collect_results",
    "expand_sweep",
    "load_sweep",
    "run_name",
    "run_sweep",
    "write_report",
]
