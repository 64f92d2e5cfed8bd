"""Language runs over the network: what `splitlab launch` of a GPT on the plays runs (here in
threads of this process; test_launch launches processes) gives bit for bit what `splitlab run`
gives, and the server checks a language client's messages and data report as strictly as a
classifier's: targets (B, T) in [0, vocabulary) or -100, hidden states (B, T, D)."""

from __future__ import annotations

import json
import re
import threading

import pytest
import torch
from processes import NONE, Rogue, ServerThread, credentials, launch_in_threads
from safetensors.torch import load_file

from splitlab import codec
from splitlab.engine import build, run
from splitlab.net.certs import make_certs
from splitlab.net.checks import Checks, Refused, data_report
from splitlab.roles import ClientNode
from splitlab.targets import IGNORED


@pytest.fixture
def one_thread():
    """As each launched process runs (LaunchSettings.threads): results then match bit for bit."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def rows(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_language_launch_is_bit_identical_to_run(tmp_path, lm, one_thread):
    run({**lm, "out": str(tmp_path / "run")}, progress=False)
    assert isinstance(launch_in_threads({**lm, "out": str(tmp_path / "net")}).ended[0], dict)
    here, there = (
        load_file(tmp_path / "run" / "weights.safetensors"),
        load_file(tmp_path / "net" / "weights.safetensors"),
    )
    assert here.keys() == there.keys() and all((here[k] == there[k]).all() for k in here)
    ran, launched = rows(tmp_path / "run"), rows(tmp_path / "net")
    assert len(ran) == len(launched) == 2
    for a, b in zip(ran, launched, strict=True):
        for key in ("test_accuracy", "test_loss", "test_perplexity", "train_loss", "comm_bytes_by_kind"):
            assert a[key] == b[key], key
        assert b["dropped_clients"] == []
    # hidden states 4 B T D bytes each way, targets 8 B T, as in-process
    assert launched[0]["comm_bytes_by_kind"]["smashed"] > 0 and launched[0]["comm_bytes_by_kind"]["labels"] > 0


def test_the_server_refuses_a_language_result_with_a_target_out_of_range_in_one_line(tmp_path, lm):
    make_certs(tmp_path / "certs", 2, [])
    server = ServerThread({**lm, "out": str(tmp_path / "run")}, tmp_path / "certs", rejoin_wait=60, join_timeout=60)
    rogue = Rogue(server.address, credentials(tmp_path / "certs", "client-0"), 0)
    assert rogue.first_reply().kind == 2  # WELCOME; it reports its true data
    bad = codec.encode({"smashed": torch.zeros(8, 16, 16), "labels": torch.full((8, 16), 80)})
    answering = threading.Thread(target=rogue.serve, args=(lambda call: bad if call.verb == "forward" else NONE,))
    answering.start()
    honest = server.client(1)
    server.wait_for_log("refused the result of forward")
    answering.join()
    rogue.close()
    back = server.client(0)  # the real client 0 joins in round 2
    assert isinstance(server.wait(), dict) and honest == back == [0]
    refusals = [line for line in server.lines if "refused" in line]
    assert len(refusals) == 1 and refusals[0].endswith(
        "refused the result of forward from client 0: labels outside [0, 80) or -100"
    ), refusals
    assert [row["dropped_clients"] for row in rows(tmp_path / "run")] == [[[1, 0]], []]


@pytest.fixture(scope="module")
def language(lm) -> tuple[Checks, ClientNode]:
    experiment = build(lm)
    return Checks(experiment.blueprint), experiment.roles.clients[0]


FORWARD = ClientNode.forward.__verb__
TARGETS = torch.zeros(4, 16, dtype=torch.int64)
HIDDEN = torch.zeros(4, 16, 16)


def test_checks_accept_a_language_forward_with_ignored_targets(language):
    checks, _ = language
    targets = TARGETS.clone()
    targets[:, :3] = IGNORED
    targets[0, 5] = 79  # the last of LEAF's 80 characters
    checks.result("forward", FORWARD, (0,), {"smashed": HIDDEN, "labels": targets})


@pytest.mark.parametrize(
    ("result", "message"),
    [
        ({"smashed": HIDDEN, "labels": torch.full((4, 16), 80)}, "labels outside [0, 80) or -100"),
        ({"smashed": HIDDEN, "labels": torch.full((4, 16), -1)}, "labels outside [0, 80) or -100"),
        ({"smashed": HIDDEN, "labels": torch.zeros(4, 15, dtype=torch.int64)}, "expected torch.int64 (4, 16)"),
        ({"smashed": HIDDEN, "labels": torch.zeros(4, dtype=torch.int64)}, "labels are torch.int64 (4,), expected"),
        ({"smashed": HIDDEN, "labels": TARGETS.int()}, "labels are torch.int32 (4, 16)"),
        ({"smashed": torch.zeros(4, 15, 16), "labels": TARGETS}, "expected torch.float32 (B, 16, 16)"),
        ({"smashed": torch.zeros(4, 16, 8), "labels": TARGETS}, "smashed is torch.float32 (4, 16, 8)"),
        ({"smashed": HIDDEN.flatten(1), "labels": TARGETS}, "smashed is torch.float32 (4, 256)"),
        ({"smashed": torch.full((4, 16, 16), float("inf")), "labels": TARGETS}, "smashed holds NaN or infinite"),
    ],
)
def test_checks_refuse_malformed_language_results_in_one_line(language, result, message):
    checks, _ = language
    with pytest.raises(Refused, match=re.escape(message)) as refusal:
        checks.result("forward", FORWARD, (0,), result)
    assert "\n" not in str(refusal.value)


def test_a_language_client_reports_its_sequences_and_token_counts(language):
    checks, node = language
    report = data_report(node, "partition")
    assert set(report) == {"data", "input_shape", "sequences", "token_counts"}
    assert report["input_shape"] == [16] and report["sequences"] == len(node.y) == node.num_samples
    assert report["token_counts"] == torch.bincount(node.y[node.y != IGNORED], minlength=80).tolist()
    summary = {"sequences": report["sequences"], "token_counts": report["token_counts"]}
    assert checks.report(report, None) == checks.report(report, summary) == summary
    other = list(report["token_counts"])
    other[0], other[1] = other[0] + 1, other[1] - 1 if other[1] else other[1] + 1
    refusals = [
        ({**report, "class_counts": [1]}, None, "a report holds exactly data, input_shape, sequences and token_counts"),
        ({**report, "input_shape": [32]}, None, "its samples have shape [32]; shakespeare_lm samples have [16]"),
        ({**report, "sequences": 0}, None, "it holds 0 sequences; expected at least 1"),
        ({**report, "token_counts": report["token_counts"][:79]}, None, "expected 80 counts (tokens 0 to 79)"),
        ({**report, "token_counts": [17 * report["sequences"]] + [0] * 79}, None, "target tokens in"),
        (report, {**summary, "sequences": report["sequences"] + 1}, f"it holds {report['sequences']} sequences"),
        (report, {**summary, "token_counts": other}, "the run has"),
    ]
    for bad, expected, message in refusals:
        with pytest.raises(Refused, match=re.escape(message)):
            checks.report(bad, expected)
