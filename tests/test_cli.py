"""The command line end to end: a real run, and every kind of bad input -> one line, exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from splitlab.cli import main

QUICK_ARGS = ["dataset=synthetic", "model=mlp", "clients=3", "rounds=1", "train_subset=200", "device=cpu"]


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_module_entry_point_runs_and_prints_a_summary(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "splitlab", "run", *QUICK_ARGS, f"out={tmp_path}"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "final accuracy" in result.stdout and "communication" in result.stdout
    assert json.loads((tmp_path / "summary.json").read_text())["rounds_completed"] == 1


def test_yaml_config_with_overrides(tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_text(
        "algorithm: fedavg\ndataset: synthetic\nmodel: mlp\nclients: 2\nrounds: 5\ntrain_subset: 200\ndevice: cpu\n"
    )
    code, _, _ = run_cli(capsys, "run", "--no-progress", "--config", str(config), "rounds=2", f"out={tmp_path / 'r'}")
    assert code == 0
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert (summary["algorithm"], summary["rounds_completed"]) == ("fedavg", 2)


BAD_INPUT = [
    (["algorithm=sfl_v3"], "unknown algorithm 'sfl_v3'; available: "),
    (["dataset=mnistt"], "unknown dataset 'mnistt'; available: "),
    (["model=resnet7"], "unknown model 'resnet7'; available: "),
    (["cut=3"], "cut 3 is out of range for this model; valid cuts: [1, 2]"),
    (["partition=dirichlet:0"], "dirichlet:0"),
    (["partition=dirichlet:-1"], "dirichlet:-1"),
    (["partition=zipf"], "zipf"),
    (["clients=500"], "500"),
    (["dataset=cifar10", "data_dir=/nonexistent/cifar"], "/nonexistent/cifar"),
    (["lr=-1"], "invalid value -1 for lr"),
    (["optimizer=rmsprop"], "invalid value 'rmsprop' for optimizer"),
    (["rounds=0"], "invalid value 0 for rounds"),
    (["participation=1.5"], "invalid value 1.5 for participation"),
    (["colour=blue"], "unknown key 'colour' for algorithm 'sfl_v2'; "),
    (["server_schedule=sequential", "algorithm=fedavg"], "server_schedule applies to algorithm sfl_v2, not fedavg"),
    (["aux=blocks:1", "algorithm=sfl_v2"], "error: aux applies to algorithm cse_fsl and fsl_sage, not sfl_v2\n"),
    (["layers=2"], "error: layers applies to model gpt, not mlp\n"),
    (["colourfulness=1"], "unknown key 'colourfulness' for algorithm 'sfl_v2'; the command's --help lists the keys\n"),
    (
        ["model=cnn", "dataset=shakespeare_lm"],
        "error: model=cnn takes images, but dataset=shakespeare_lm holds tokens; models for tokens: gpt, hf, lstm\n",
    ),
    (["model=gpt", "dataset=synthetic"], "model=gpt takes tokens, but dataset=synthetic holds images; models for"),
    (["train_subset=99999"], "train_subset=99999 is more than the 1200 samples"),
    (["device=cuda"], "device 'cuda'"),
    (["lr"], "expected KEY=VALUE, got 'lr'"),
    (["precision=fp16", "defense=gradnoise:0.1"], "precision=fp16 does not apply here: defense=gradnoise:0.1"),
]


@pytest.mark.parametrize("args,message", BAD_INPUT, ids=[" ".join(a) for a, _ in BAD_INPUT])
def test_bad_input_is_one_line_and_exit_code_2_and_writes_nothing(tmp_path, capsys, args, message):
    out = tmp_path / "run"
    base = [a for a in QUICK_ARGS if a.split("=")[0] not in {x.split("=")[0] for x in args}]
    if "device=cuda" in args:
        pytest.importorskip("torch").cuda.is_available() and pytest.skip("a GPU is present")
    code, stdout, stderr = run_cli(capsys, "run", "--no-progress", *base, *args, f"out={out}")
    assert code == 2
    assert stderr.startswith("error: ") and stderr.count("\n") == 1, stderr
    assert message in stderr
    assert "Traceback" not in stderr + stdout
    assert not out.exists()


def test_malformed_yaml_and_missing_file(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("algorithm: [sfl_v2\n")
    code, _, stderr = run_cli(capsys, "run", "--config", str(bad))
    assert code == 2 and "is not valid YAML at line" in stderr and stderr.count("\n") == 1
    code, _, stderr = run_cli(capsys, "run", "--config", str(tmp_path / "none.yaml"))
    assert code == 2 and "none.yaml': no such file" in stderr


def test_existing_run_is_not_overwritten_silently(tmp_path, capsys):
    assert run_cli(capsys, "run", "--no-progress", *QUICK_ARGS, f"out={tmp_path}")[0] == 0
    code, _, stderr = run_cli(capsys, "run", "--no-progress", *QUICK_ARGS, f"out={tmp_path}")
    assert code == 2 and "already holds a run" in stderr


def test_missing_fashion_mnist_says_how_to_get_it(tmp_path, capsys, monkeypatch):
    code, _, stderr = run_cli(capsys, "run", "dataset=fashion_mnist", f"data_dir={tmp_path}", f"out={tmp_path / 'r'}")
    assert code == 2 and "apt-get install dataset-fashion-mnist" in stderr


def test_listing_commands(capsys):
    for command, expected in [("datasets", "fashion_mnist"), ("models", "resnet18"), ("algorithms", "sfl_v1")]:
        code, stdout, _ = run_cli(capsys, command)
        assert code == 0 and expected in stdout


def test_sweep_on_ray_refuses_bad_resources_in_one_line(tmp_path, capsys):
    sweep = tmp_path / "s.yaml"
    sweep.write_text("base: {dataset: synthetic, model: mlp}\naxes: {seed: [0, 1]}\n")
    code, _, err = run_cli(capsys, "sweep", str(sweep), "--ray", "auto", "--gpus-per-run", "-0.5")
    assert code == 2 and err.strip() == "error: --gpus-per-run must be a number >= 0, got -0.5"
    assert not (tmp_path / "runs").exists()


def test_run_help_lists_every_key_with_its_default_and_description(capsys):
    from splitlab.algorithms import algorithms
    from splitlab.config import RunConfig

    with pytest.raises(SystemExit):
        main(["run", "--help"])
    shown = capsys.readouterr().out
    for name, field in RunConfig.model_fields.items():
        default = "none" if field.default is None else field.default
        assert f"\n  {name}={str(default).lower() if isinstance(default, bool) else default}\n" in shown
        assert field.description.split()[0] in shown
    for name, cls in algorithms().items():
        for key in cls.Params.model_fields:
            assert f"\n  {key}=" in shown, (name, key)
    assert "keys of algorithm=sfl_v2:\n  server_schedule=interleaved\n" in shown


@pytest.mark.parametrize(
    ("command", "key"),
    [
        ("latency", "client_power"),
        ("attack", "targets"),
        ("certs", "hosts"),
        ("evaluate", "rho"),
        ("generate", "prompt"),
    ],
)
def test_every_commands_help_lists_its_keys(capsys, command, key):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    assert f"\n  {key}=" in capsys.readouterr().out


def test_an_unknown_key_close_to_a_known_one_gets_did_you_mean(capsys):
    code, _, err = run_cli(capsys, "run", "lrr=0.1")
    assert code == 2 and err == "error: unknown key 'lrr' for algorithm 'sfl_v2'; did you mean 'lr'?\n"
    code, _, err = run_cli(capsys, "certs", "client=2")
    assert code == 2 and "did you mean 'clients'?" in err


@pytest.mark.parametrize(
    ("given", "ours"),
    [("learning_rate=0.1", "lr"), ("gradient_accumulation_steps=2", "grad_accum"), ("bf16=true", "precision=bf16")],
)
def test_the_trainers_and_pefts_names_get_splitlabs_key(capsys, given, ours):
    code, _, err = run_cli(capsys, "run", given)
    assert code == 2 and err == f"error: unknown key '{given.split('=')[0]}': splitlab calls it {ours}\n"


def test_run_config_from_python_says_where_a_models_key_goes():
    from splitlab.config import RunConfig
    from splitlab.errors import UserError

    with pytest.raises(
        UserError, match=r"^unknown key 'model_dir' for RunConfig, .* splitlab\.run\(\{\.\.\., 'model_dir'"
    ):
        RunConfig(model="hf", model_dir="x")
    with pytest.raises(UserError, match="^unknown key 'learning_rate': splitlab calls it lr$"):
        RunConfig(learning_rate=0.1)


@pytest.mark.parametrize("text", ["ROMEO:", "yes", "1e3", "null", "[a]", "a: b", "{a: 1}", "~", "0x10", ""])
def test_a_string_key_keeps_the_exact_text_typed(text):
    """Command-line values are read by the key's type, not as YAML: a string stays what was typed."""
    from splitlab.config import parse_overrides, parse_settings
    from splitlab.runmodel import GenerateSettings

    assert parse_settings(GenerateSettings, parse_overrides([f"prompt={text}"])).prompt == text


def test_command_line_values_are_converted_by_the_keys_type():
    from splitlab.config import parse_overrides, parse_settings
    from splitlab.resolve import resolve_config
    from splitlab.splitgp_evaluation import EvaluationSettings

    config = resolve_config(
        parse_overrides(
            ["rounds=3", "lr=1e-2", "resume=yes", "local_steps=none", "clients=all", "dataset=shakespeare",
             "model=lstm", "defense=clip:10+noise:0.5", "noise_key=null", "out=", "cut=1,2", "labels_at=server"]
        )
    ).run  # fmt: skip
    assert (config.rounds, config.lr, config.resume, config.local_steps, config.clients) == (3, 0.01, True, None, "all")
    assert (config.defense, config.noise_key, config.out, config.cut, config.tail_cut) == (
        "clip:10+noise:0.5", "null", None, 1, 2,
    )  # fmt: skip
    sgd = resolve_config(parse_overrides(["partition=dirichlet:0.5", "momentum=0.5", "optimizer=sgd"])).run
    assert (sgd.partition, sgd.momentum) == ("dirichlet:0.5", 0.5)
    for text in ("0,0.2", "[0, 0.2]"):
        assert parse_settings(EvaluationSettings, parse_overrides([f"rho={text}"])).rho == [0, 0.2]


def test_generate_takes_a_prompt_that_looks_like_yaml(monkeypatch, capsys, tmp_path):
    """`splitlab generate RUN prompt="ROMEO:"` reaches the run with the prompt as typed."""
    import splitlab.runmodel

    seen = []
    monkeypatch.setattr(splitlab.runmodel, "generate", lambda run_dir, **settings: seen.append(settings) or "text")
    code, out, _ = run_cli(capsys, "generate", str(tmp_path), "prompt=ROMEO:", "max_new_tokens=3")
    assert (code, out, seen[0]["prompt"], seen[0]["max_new_tokens"]) == (0, "text\n", "ROMEO:", 3)


def test_a_config_yaml_from_before_models_owned_their_keys_still_resolves():
    """Earlier runs recorded every model's keys, null where not given: null is the model's default."""
    from splitlab.resolve import resolve_config

    old = {"layers": None, "heads": None, "width": None, "context": None, "model_dir": None}
    assert resolve_config({"model": "mlp", **old}).model_params.model_dump() == {}
    gpt = resolve_config({"model": "gpt", "dataset": "shakespeare_lm", **old, "layers": 2}).model_params
    assert gpt.model_dump() == {"layers": 2, "heads": 4, "width": 128, "context": 256}
