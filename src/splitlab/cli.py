"""The `splitlab` command line: run | sweep | report | evaluate | latency | attack | advise | datasets |
models | algorithms | certs | server | client | launch.

A user mistake prints one line, `error: ...`, and exits with code 2; anything else is a bug and
keeps its traceback.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from collections.abc import Callable

from rich.console import Console
from rich.table import Table

from splitlab.errors import UserError, unknown_key
from splitlab.logs import setup_logging
from splitlab.process_settings import prepare_process
from splitlab.units import format_bytes

console = Console()
log = logging.getLogger("splitlab.cli")


def _cmd_run(args: argparse.Namespace) -> int:
    from splitlab.engine import run
    from splitlab.experiments.plots import plot_run
    from splitlab.io import read_jsonl
    from splitlab.resolve import resolve_config
    from splitlab.rundir import CURVES

    raw = _run_config(args)
    summary = run(raw, progress=not args.no_progress)
    _print_summary(summary, raw)
    resolved = resolve_config(raw)
    settings, out = resolved.run, resolved.out_dir
    title = f"{settings.algorithm} on {settings.dataset} ({settings.model}, cut {settings.cut}, seed {settings.seed})"
    plot_run(read_jsonl(out / "metrics.jsonl"), out / CURVES, title)
    console.print(f"written to {out}  (curves: {out / CURVES})", soft_wrap=True)
    return 0


def _run_config(args: argparse.Namespace) -> dict:
    from splitlab.config import load_config_file, parse_overrides

    raw = load_config_file(args.config) if args.config else {}
    raw.update(parse_overrides(args.overrides))
    return raw


def _cmd_certs(args: argparse.Namespace) -> int:
    from splitlab.config import parse_overrides, parse_settings
    from splitlab.net.certs import CertsSettings, make_certs

    keys = parse_settings(CertsSettings, parse_overrides(args.overrides))
    hosts = [h for h in (keys.hosts or "").split(",") if h]
    written = make_certs(keys.out.expanduser(), keys.clients, hosts, keys.overwrite)
    console.print(f"written to {written[0].parent}: {', '.join(p.stem for p in written)} (.pem and .key)")
    return 0


def _cmd_server(args: argparse.Namespace) -> int:
    from splitlab.engine import serve
    from splitlab.net.server import ServerSettings, split_settings

    settings, raw = split_settings(_run_config(args), ServerSettings)
    summary = serve(raw, settings, progress=not args.no_progress)  # type: ignore[arg-type]
    _print_summary(summary, raw)
    return 0


def _cmd_client(args: argparse.Namespace) -> int:
    from splitlab.config import parse_overrides
    from splitlab.net.client import ClientSettings, run_client
    from splitlab.net.server import split_settings

    settings, rest = split_settings(parse_overrides(args.overrides), ClientSettings)
    if rest:
        raise unknown_key(sorted(rest)[0], ClientSettings.model_fields, "client")
    return run_client(settings)  # type: ignore[arg-type]


def _cmd_launch(args: argparse.Namespace) -> int:
    from splitlab.net.launch import LaunchSettings, launch
    from splitlab.net.server import ServerSettings, split_settings

    settings, raw = split_settings(_run_config(args), LaunchSettings)
    for key in ("listen", "certs"):
        if key in raw:
            raise UserError(
                f"{key}= does not apply to launch: it listens on a free loopback port with certificates it makes "
                f"in OUT/certs; use `splitlab server` to choose them"
            )
    server_keys, raw = split_settings(raw, ServerSettings)
    given = server_keys.model_dump(exclude_defaults=True)
    return launch(raw, given, settings, progress=not args.no_progress)  # type: ignore[arg-type]


def _cuts(summary: dict) -> str:
    """The run's cut, or a U-shaped run's two cuts A,B."""
    return f"{summary['cut']},{summary['tail_cut']}" if "tail_cut" in summary else str(summary["cut"])


def _print_summary(summary: dict, raw: dict) -> None:
    table = Table(
        title=f"{summary['algorithm']} on {summary['dataset']} ({summary['model']}, cut {_cuts(summary)})",
        show_header=False,
    )
    table.add_row("rounds", f"{summary['rounds_completed']} (stopped by {summary['stopped_by']})")
    table.add_row("final accuracy", f"{100 * summary['final_accuracy']:.2f}%")
    table.add_row("best accuracy", f"{100 * summary['best_accuracy']:.2f}% (round {summary['best_round']})")
    if "final_f1" in summary:
        table.add_row("final macro-F1 / MCC", f"{summary['final_f1']:.4f} / {summary['final_mcc']:.4f}")
    else:  # a language task: token accuracy above, masked test loss and perplexity here
        table.add_row(
            "final test loss / perplexity", f"{summary['final_loss']:.4f} / {summary['final_perplexity']:.2f}"
        )
    table.add_row("communication", format_bytes(summary["total_bytes"]))
    for kind, nbytes in sorted(summary["comm_bytes_by_kind"].items()):
        table.add_row(f"  {kind}", format_bytes(nbytes))
    table.add_row("training time", f"{summary['wall_seconds']:.1f} s")
    privacy = summary.get("privacy")
    if privacy is not None:
        guarantee = (
            f"({privacy['epsilon']:.3g}, {privacy['delta']:g})-DP per sample's smashed data, "
            f"{privacy['releases_per_sample']} releases (not labels or weights; docs/privacy.md)"
            if privacy["epsilon"] is not None
            else privacy["why"]
        )
        table.add_row("privacy", guarantee)
    console.print(table)


def _listing_plugins(args: argparse.Namespace) -> bool:
    """Import the plugins a listing command names (`plugins=MODULE`); whether there were any."""
    if not args.overrides:
        return False
    from splitlab.config import parse_overrides, parse_settings
    from splitlab.plugins import ListingSettings, load_plugins

    plugins = parse_settings(ListingSettings, parse_overrides(args.overrides)).plugins
    load_plugins(plugins)
    return plugins is not None


def _cmd_datasets(args: argparse.Namespace) -> int:
    _listing_plugins(args)
    from splitlab.data import dataset_availability

    table = Table("dataset", "available", "where")
    for row in dataset_availability():
        table.add_row(row["name"], "yes" if row["available"] else "no", row["where"])
    console.print(table)
    return 0


def _cmd_download(args: argparse.Namespace) -> int:
    from splitlab.data.download import download_fashion_mnist

    console.print(f"fashion_mnist files are in {download_fashion_mnist(args.dir)}")
    return 0


def _cmd_models(args: argparse.Namespace) -> int:
    from splitlab import catalog

    rows = catalog.load()["models"]
    if _listing_plugins(args):
        rows = rows + catalog.plugin_rows()["models"]
    table = Table("model", "valid cuts", "parameters (28x28x1 input, 10 classes)", "own keys (defaults)")
    for row in rows:
        table.add_row(*row)
    console.print(table)
    return 0


def _cmd_algorithms(args: argparse.Namespace) -> int:
    from splitlab import catalog

    rows = catalog.load()["algorithms"]
    if _listing_plugins(args):
        rows = rows + catalog.plugin_rows()["algorithms"]
    table = Table("algorithm", "own keys (defaults)", "description")
    for row in rows:
        table.add_row(*row)
    console.print(table)
    return 0


def _cmd_sweep(args: argparse.Namespace) -> int:
    from splitlab.experiments.sweep import SweepFailed, run_sweep

    try:
        sweep_dir = run_sweep(
            args.file,
            out=args.out,
            jobs=args.jobs,
            progress=not args.no_progress,
            ray=args.ray,
            cpus_per_run=args.cpus_per_run,
            gpus_per_run=args.gpus_per_run,
        )
    except SweepFailed as failed:
        log.error(f"error: {failed}")
        return 1
    console.print(f"sweep finished: {sweep_dir}  (next: splitlab report {sweep_dir})")
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from splitlab.experiments.report import write_report

    console.print(f"report written: {write_report(args.dir, target_accuracy=args.target)}")
    return 0


def _cmd_evaluate(args: argparse.Namespace) -> int:
    from splitlab.config import parse_overrides
    from splitlab.splitgp_evaluation import evaluate_run

    result = evaluate_run(args.dir, parse_overrides(args.overrides))
    if result.get("setting") == "vertical":  # one model over every party's features: its test metrics
        metrics = Table("metric", "value", title=f"final model on the test set (vertical {result['algorithm']})")
        for name, value in result["metrics"].items():
            metrics.add_row(name, f"{value:.6g}")
        console.print(metrics)
        return 0
    table = Table(
        "method",
        *(f"rho={r:g}" for r in result["rho"]),
        title=f"mean per-client accuracy ({result['algorithm']}; written to evaluation.json)",
    )
    for name, row in result["rows"].items():
        table.add_row(name, *(f"{100 * a:.2f}%" for a in row["accuracy"]))
    if "splitgp" in result["rows"]:
        gated = result["rows"]["splitgp"]
        table.add_row("  E_th", *(f"{t:g}" for t in gated["entropy_threshold"]))
        table.add_row("  decided at client", *(f"{100 * f:.1f}%" for f in gated["client_fraction"]))
        table.add_row("  bytes sent", *(f"{b:,}" for b in gated["bytes_sent"]))
    console.print(table)
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from splitlab.config import parse_overrides, parse_settings
    from splitlab.runmodel import GenerateSettings, generate

    settings = parse_settings(GenerateSettings, parse_overrides(args.overrides))
    print(generate(args.dir, **settings.model_dump()))
    return 0


def _cmd_latency(args: argparse.Namespace) -> int:
    from splitlab.config import parse_overrides, parse_settings
    from splitlab.splitgp_latency import LatencySettings, report

    settings = parse_settings(LatencySettings, parse_overrides(args.overrides))
    result = report(settings)
    sizes = result["sizes"]
    table = Table(
        "scheme",
        "storage",
        "client computation",
        "communication",
        "latency",
        title=f"{settings.model} cut {settings.cut}: |phi|={sizes['phi']:,} |theta|={sizes['theta']:,} "
        f"|h|={sizes['head']:,} q={sizes['q']:,} q_c={sizes['q_c']:,}",
    )
    for scheme, row in result["table_one"].items():
        table.add_row(
            scheme,
            *(f"{row[k]:,.1f}".removesuffix(".0") for k in ("storage", "computation", "communication", "latency")),
        )
    console.print(table)
    console.print(
        f"SplitGP faster than the full model at the client (Prop. 2) iff P_C <= "
        f"{result['client_power_threshold']:,.6g} (P_C = {settings.client_power:g})"
    )
    console.print(
        f"SplitGP faster than the full model at the server (Prop. 3) {result['rate_threshold']} (R = {settings.rate:g})"
    )
    cuts = Table(
        "cut",
        "|phi|",
        "|theta|",
        "|h|",
        "q_c",
        "SplitGP latency / sample",
        *(("max |phi| (Prop. 1)", "feasible") if settings.latency_budget is not None else ()),
    )
    for row in result["cuts"]:
        extra = (f"{row['max_phi']:,.0f}", "yes" if row["feasible"] else "no") if "max_phi" in row else ()
        cuts.add_row(
            str(row["cut"]),
            f"{row['phi']:,}",
            f"{row['theta']:,}",
            f"{row['head']:,}",
            f"{row['q_c']:,}",
            f"{row['latency_per_sample']:,.6g}",
            *extra,
        )
    console.print(cuts)
    return 0


def _cmd_attack(args: argparse.Namespace) -> int:
    from splitlab.audit.attack import attacks
    from splitlab.audit.run import attack_run, strongest_rows
    from splitlab.config import parse_overrides

    result = attack_run(args.dir, parse_overrides(args.overrides))
    table = Table(show_header=False, title=f"{result['attack']} on {result['targets']} (defense {result['defense']})")
    for row in attacks()[result["attack"]].rows(result):
        table.add_row(*row)
    console.print(table)
    beside = Table(show_header=False, title="the strongest so far on these targets")
    for row in strongest_rows(result):
        beside.add_row(*row)
    if beside.rows:
        console.print(beside)
    console.print(f"written to {args.dir}/attack.json")
    return 0


def _cmd_advise(args: argparse.Namespace) -> int:
    from splitlab.audit.advise import advise
    from splitlab.config import parse_overrides

    result = advise(parse_overrides(args.overrides))
    print(result["markdown"])
    console.print(f"written to {result['out']}: {', '.join(result['files'])}")
    return 0


class _CommandParser(argparse.ArgumentParser):
    """A command's parser whose --help ends with its keys, generated from its settings models
    (splitlab.command_help) when help is asked for, not at every start."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    #: `plugins=MODULE` among the command's arguments: their algorithms and models are listed too
    plugins: str | None = None

    def format_help(self) -> str:
        from splitlab.command_help import command_keys

        command = self.prog.split()[-1]
        self.epilog = command_keys(command, self.plugins) or None
        return super().format_help()


#: Every command, in the order `splitlab --help` lists them: (what its help says, its description
#: where it has one beyond that, its handler, its positional arguments: `dir` a run or sweep
#: directory, `file` a sweep file, then its settings as KEY=VALUE or plugins=MODULE).
COMMANDS: dict[str, tuple[str, str | None, Callable[[argparse.Namespace], int], str]] = {
    "run": (
        "train one configuration",
        "Train one configuration given as KEY=VALUE settings (and/or a YAML file of them); docs/cli.md explains them.",
        _cmd_run,
        "KEY=VALUE",
    ),
    **{
        name: (help_text, f"{help_text}; the keys of `run` plus its own (docs/deployment.md).", handler, "KEY=VALUE")
        for name, help_text, handler in (
            (
                "server",
                "run a configuration as the server of a networked deployment (clients connect over gRPC)",
                _cmd_server,
            ),
            ("launch", "a server and its clients as processes on this machine (loopback, mutual TLS)", _cmd_launch),
        )
    },
    "client": (
        "one client node of a networked run: connect=HOST:PORT client_id=K certs=DIR [data=own data_dir=DIR]",
        "One client node of a networked run; see docs/deployment.md.",
        _cmd_client,
        "KEY=VALUE",
    ),
    "certs": (
        "a development CA, server and client certificates: out=DIR clients=K [hosts=a,b] [overwrite=true]",
        "A development CA, server and client certificates (valid for localhost, 127.0.0.1 and hosts).",
        _cmd_certs,
        "KEY=VALUE",
    ),
    **{
        name: (f"{help_text} (plugins=MODULE: a plugin's too)", None, handler, "plugins=MODULE")
        for name, help_text, handler in (
            ("datasets", "list datasets and whether their files are here", _cmd_datasets),
            ("models", "list models, their valid cut layers and their own keys", _cmd_models),
            ("algorithms", "list algorithms and their own keys", _cmd_algorithms),
        )
    },
    "download": ("fetch Fashion-MNIST from its official mirror (needs a network)", None, _cmd_download, ""),
    "sweep": ("run a grid of configurations from a sweep file", None, _cmd_sweep, "file"),
    "report": ("tables and plots from a sweep directory", None, _cmd_report, "dir"),
    "evaluate": (
        "SplitGP's per-client view of a finished run (rho, E_th)",
        "SplitGP's per-client view of a finished run; see docs/splitgp.md.",
        _cmd_evaluate,
        "dir KEY=VALUE",
    ),
    "generate": (
        "continue a prompt with a finished language run's model (client stages, then server stages)",
        "Continue a prompt with a finished language run's model; see docs/language.md.",
        _cmd_generate,
        "dir KEY=VALUE",
    ),
    "latency": (
        "SplitGP's inference-time model (Table I, Props. 1-3)",
        "SplitGP's inference-time model; see docs/splitgp.md.",
        _cmd_latency,
        "KEY=VALUE",
    ),
    "attack": (
        "an attack on a finished run (inversion | unsplit | fsha | label_leak | model_completion | "
        "token_inversion | embedding_inversion | targets_channel | linked_releases | gradient_matching | bisr)",
        "An attack on a finished run (a curious or malicious server's, or model completion); see docs/privacy.md.",
        _cmd_attack,
        "dir KEY=VALUE",
    ),
    "advise": (
        "every cut of a model side by side: client cost, bytes, latency, leakage, accuracy",
        "Every cut of a model side by side; see docs/privacy.md.",
        _cmd_advise,
        "KEY=VALUE",
    ),
}


def build_parser(plugins: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitlab", description="Split learning and split federated learning.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_CommandParser)
    for name, (help_text, description, handler, arguments) in COMMANDS.items():
        command = commands.add_parser(name, help=help_text, description=description)
        for argument in arguments.split():
            if "=" in argument:
                command.add_argument("overrides", nargs="*", metavar=argument)
            else:
                command.add_argument(argument)
        command.set_defaults(handler=handler)
    for name in ("run", "server", "launch"):
        command = commands.choices[name]
        command.add_argument("--config", help="YAML file of KEY: VALUE settings; KEY=VALUE arguments override it")
        command.add_argument("--no-progress", action="store_true", help="no progress bar")
    download = commands.choices["download"]
    download.add_argument("dataset", choices=["fashion_mnist"])
    download.add_argument("--dir", help="target folder (default: ~/.cache/splitlab/fashion_mnist, searched by runs)")
    sweep = commands.choices["sweep"]
    sweep.add_argument("--jobs", type=int, default=1, help="runs in parallel (processes)")
    sweep.add_argument("--out", help="sweep directory (default runs/<file stem>)")
    sweep.add_argument(
        "--ray",
        metavar="ADDRESS",
        help="run every grid point as a Ray task: auto (local Ray or this cluster) or an address",
    )
    sweep.add_argument("--cpus-per-run", type=int, default=1, help="with --ray: CPUs (torch threads) per run")
    sweep.add_argument(
        "--gpus-per-run", type=float, default=0, help="with --ray: GPUs per run (0.5: two runs share one)"
    )
    sweep.add_argument("--no-progress", action="store_true")
    commands.choices["report"].add_argument(
        "--target", type=float, help="target accuracy (fraction) for GiB/rounds-to-target"
    )
    for command in commands.choices.values():
        command.plugins = plugins
        command.add_argument("-q", "--quiet", action="store_true", help="only warnings and errors; no progress bar")
        command.add_argument("-v", "--verbose", action="store_true", help="debug messages too")
    return parser


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(next((item.partition("=")[2] for item in argv if item.startswith("plugins=")), None))
    # Flags may come anywhere among KEY=VALUE pairs: argparse stops the pairs at the first flag.
    args, rest = parser.parse_known_args(argv)
    if rest and (not hasattr(args, "overrides") or any(item.startswith("-") for item in rest)):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if rest:
        args.overrides += rest
    prepare_process()  # this process is splitlab's (splitlab.process_settings)
    setup_logging(args.verbose - args.quiet, force=True)
    if args.quiet and hasattr(args, "no_progress"):
        args.no_progress = True
    handler: Callable[[argparse.Namespace], int] = args.handler
    if args.command in ("run", "sweep"):
        signal.signal(signal.SIGTERM, _interrupt)  # a polite kill ends as Ctrl-C does: files complete, lock gone
    try:
        return handler(args)
    except UserError as err:
        log.error(f"error: {err}")
        return getattr(err, "exit_code", 2)
    except OSError as err:  # a command's files (sweep, report, attack, advise, certs): one line, exit 1
        from splitlab.rundir import FILE_ERRNOS, describe_file_error

        if err.errno not in FILE_ERRNOS:
            raise
        log.error(f"error: {describe_file_error(err, '.')}")
        return 1
    except KeyboardInterrupt as interrupted:
        if interrupted.args:  # the engine says what the run kept (splitlab.rundir.kept_after_interruption)
            log.error(f"interrupted; {interrupted}")
        else:
            again = "run the same sweep command again" if args.command == "sweep" else "add resume=true"
            log.error(f"interrupted; to continue, {again}")
        return 130


if __name__ == "__main__":
    sys.exit(main())
