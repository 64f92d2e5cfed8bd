"""What the server checks of a vertical party's messages: its report (its samples, its columns),
its private set intersection messages (1-D uint8, bounded by the ids it reported), its embedding
(its own bottom model's shape), its count after alignment; and a rogue party over the real
protocol whose malformed PSI answer stops the run in one line."""

from __future__ import annotations

import threading

import pytest
import torch
from processes import NONE, Rogue, ServerThread, credentials

from splitlab import codec, psi
from splitlab.algorithms.vertical_sl import FeatureParty, LabelParty
from splitlab.errors import UserError
from splitlab.net.certs import make_certs
from splitlab.net.checks import Checks, Refused
from splitlab.resolve import resolve_config
from splitlab.settings.vertical import plan_vertical

IMAGES = dict(setting="vertical", algorithm="sl", dataset="fashion_mnist", model="cnn", cut=1, device="cpu", seed=0)
TABLE = dict(setting="vertical", algorithm="sl", dataset="breast_cancer", model="mlp", device="cpu", seed=0)
REQUEST, ANSWER, COUNT = (getattr(FeatureParty, v).__verb__ for v in ("psi_request", "psi_answer", "sample_count"))
FORWARD = FeatureParty.forward.__verb__


@pytest.fixture(scope="module")
def checks() -> Checks:
    """Checks of a Fashion-MNIST run whose two parties hold 12 and 16 columns (of 28) and 10 samples each."""
    checks = Checks(plan_vertical(resolve_config({**IMAGES, "features": "0-11/12-27"})).blueprint, parties=True)
    for party, columns in ((0, 12), (1, 16)):
        report = {"data": "partition", "input_shape": [1, 28, columns], "samples": 10}
        assert checks.report(report, {"samples": 10}, party) == {"samples": 10}
    return checks


def test_a_party_reports_its_samples_and_its_columns(checks):
    report = {"data": "partition", "input_shape": [1, 28, 12], "samples": 10}
    shapes = r"its samples have shape \[1, 28, 12\]; fashion_mnist samples have \[1, 28, 16\]"
    with pytest.raises(Refused, match=shapes):
        checks.report(report, None, 1)  # party 0's columns, from party 1
    with pytest.raises(Refused, match="it holds 9 samples; the run has 10 samples for it"):
        checks.report({**report, "samples": 9}, {"samples": 10}, 0)
    with pytest.raises(Refused, match="a report holds exactly data, input_shape and samples"):
        checks.report({**report, "class_counts": [10]}, None, 0)
    with pytest.raises(Refused, match="client 2 is not a party of this run"):
        checks.report(report, None, 2)


def test_psi_messages_are_bytes_bounded_by_the_ids_reported(checks):
    request = psi.PsiAsker(torch.arange(10).numpy()).request()
    checks.result("psi_request", REQUEST, (), request, 0)
    answer = psi.answer(torch.arange(10).numpy(), request)
    checks.result("psi_answer", ANSWER, (request,), answer, 0)
    too_long = torch.zeros(35 * 10 + 17, dtype=torch.uint8)  # more bytes than 10 ids take
    bad = [
        ("psi_request", REQUEST, (), request.float()),
        ("psi_request", REQUEST, (), request.view(1, -1)),
        ("psi_request", REQUEST, (), too_long),
        ("psi_request", REQUEST, (), {"request": request}),
        ("psi_answer", ANSWER, (request,), {"setup": answer["setup"]}),
        ("psi_answer", ANSWER, (request,), {**answer, "setup": too_long}),
        ("psi_answer", ANSWER, (request[:37],), answer),  # more points than the request held
    ]
    messages = []
    for verb, spec, args, result in bad:
        with pytest.raises(Refused) as refused:
            checks.result(verb, spec, args, result, 0)
        messages.append(str(refused.value))
    assert messages == [
        "psi_request is torch.float32 (352,), expected torch.uint8 (N,) bytes",
        "psi_request is torch.uint8 (1, 352), expected torch.uint8 (N,) bytes",
        "psi_request holds 367 bytes; 10 ids take at most 366",
        "psi_request is dict, expected torch.uint8 (N,) bytes",
        "psi_answer returns exactly ['response', 'setup'], the result holds ['setup']",
        "psi_answer.setup holds 367 bytes; 10 ids take at most 366",
        "psi_answer.response holds 350 bytes; 2 ids take at most 86",
    ]


def test_each_party_s_embedding_has_its_own_bottom_model_s_shape(checks):
    """Party 0 (12 columns) and party 1 (16) differ after the cut: each is held to its own."""
    shapes = {}
    for party, columns in ((0, 12), (1, 16)):
        node = FeatureParty(checks.blueprint, party, torch.arange(4).numpy(), torch.zeros(4, 1, 28, columns), None)
        node.begin_round(0)
        shapes[party] = node.forward(0)["smashed"]
        checks.result("forward", FORWARD, (0,), {"smashed": shapes[party]}, party)
    assert shapes[0].shape[1:] != shapes[1].shape[1:]
    with pytest.raises(Refused, match="smashed is torch.float32"):
        checks.result("forward", FORWARD, (0,), {"smashed": shapes[0]}, 1)
    keys = r"forward returns exactly \['smashed'\], the result holds \['labels', 'smashed'\]"
    with pytest.raises(Refused, match=keys):
        checks.result("forward", FORWARD, (0,), {"smashed": shapes[0], "labels": torch.zeros(4).long()}, 0)
    assert LabelParty.forward.__verb__.result_keys((0,)) == ("smashed", "labels")


def test_a_party_s_part_of_the_joint_evaluation_has_its_own_shape_and_the_task_s_labels(checks):
    """test_embeddings(start, stop): the party's bottom model's dtype and shape, one row per test
    sample asked for, finite; test_labels: the label holder's targets of those samples."""
    embed, labels = FeatureParty.test_embeddings.__verb__, LabelParty.test_labels.__verb__
    node = LabelParty(
        checks.blueprint,
        0,
        torch.arange(4).numpy(),
        torch.zeros(4, 1, 28, 12),
        None,
        torch.zeros(4).long(),
        torch.rand(6, 1, 28, 12),
        torch.arange(6),
    )
    embeddings = node.test_embeddings(1, 5)
    checks.result("test_embeddings", embed, (1, 5), embeddings, 0)
    checks.result("test_labels", labels, (1, 5), node.test_labels(1, 5), 0)
    for args, result, client, refusal in [
        ((1, 5), embeddings, 1, r"test_embeddings are torch.float32 \(4, .*\), expected torch.float32 \(4, "),
        ((0, 5), embeddings, 0, r"expected torch.float32 \(5, "),
        ((1, 5), embeddings.double(), 0, "test_embeddings are torch.float64"),
        ((1, 5), embeddings * float("nan"), 0, "holds NaN or infinite values"),
        ((1, 5), {"smashed": embeddings}, 0, "test_embeddings returns a tensor, the result is a dict"),
    ]:
        with pytest.raises(Refused, match=refusal):
            checks.result("test_embeddings", embed, args, result, client)
    for result, refusal in [
        (torch.arange(3), r"labels are torch.int64 \(3,\), expected torch.int64 \(4,\)"),
        (torch.arange(4).float(), "labels are torch.float32"),
        (torch.full((4,), 10), r"labels outside \[0, 10\)"),
    ]:
        with pytest.raises(Refused, match=refusal):
            checks.result("test_labels", labels, (1, 5), result, 0)


def test_sample_count_is_a_whole_number_up_to_the_samples_reported(checks):
    checks.result("sample_count", COUNT, (), 10, 0)
    for bad in (11, -1, 2.0, True, torch.tensor(3)):
        with pytest.raises(Refused, match="sample_count is .*, expected a whole number from 0 to 10"):
            checks.result("sample_count", COUNT, (), bad, 0)


BYTES = torch.zeros(40, dtype=torch.uint8)  # of the form the checks allow, but no PSI message


@pytest.mark.parametrize(
    ("answer", "refusal", "error"),
    [
        (
            {"setup": BYTES, "response": torch.zeros(2, 2)},
            "psi_answer.response is torch.float32 (2, 2), expected torch.uint8 (N,) bytes",
            "party 0 left during the private set intersection (client 0 dropped: refused its psi_answer result); "
            "every party must take part in the alignment",
        ),
        (
            {"setup": BYTES, "response": BYTES},
            None,
            "party 0's private set intersection message is malformed (not an answer to our request: "
            "Error parsing message with type 'psi_proto.ServerSetup')",
        ),
    ],
)
def test_a_rogue_party_s_malformed_psi_answer_stops_the_run_in_one_line(tmp_path, answer, refusal, error):
    """Labels at the server: the server asks party 0 (a rogue) which of its ids it holds too. The
    run ends with a UserError, which `splitlab server` prints as `error: ...` in one line, exit code
    2 (test_own_data's processes)."""
    make_certs(tmp_path / "certs", 2, [])
    server = ServerThread({**TABLE, "out": str(tmp_path / "run")}, tmp_path / "certs", join_timeout=60)
    rogue = Rogue(server.address, credentials(tmp_path / "certs", "client-0"), 0)
    assert rogue.first_reply().kind == 2  # WELCOME; it reports its true data
    bad = codec.encode(answer)
    answering = threading.Thread(target=rogue.serve, args=(lambda call: bad if call.verb == "psi_answer" else NONE,))
    answering.start()
    ended = server.wait()
    answering.join()
    rogue.close()
    refusals = [line for line in server.lines if "refused the result" in line]
    said = "splitlab server: refused the result of psi_answer from client 0: "
    assert refusals == ([said + refusal] if refusal else [])
    assert isinstance(ended, UserError) and str(ended) == error, (ended, server.lines)
