"""Attacks that hold against an adaptive adversary (issue 42): a record attacked with the client
part that made it, the targets channel, the releases of a sequence linked across rounds, MAP
decoding with d_chi's density, the strongest figure over the attacks run, and what d_chi
promises at the embedding's scale; hand-checked small cases and one tiny end-to-end run."""

from __future__ import annotations

import json
import math

import torch
from safetensors.torch import load_file
from torch import nn

from splitlab.audit.embedding_inversion import embedding_outputs, map_with_prior
from splitlab.audit.linked_releases import link_scores, mutual_links, release_links, summed
from splitlab.audit.run import strongest
from splitlab.audit.targets_channel import text_from_targets
from splitlab.cli import main
from splitlab.engine import run
from splitlab.models import HeadAndTail
from splitlab.privacy.defenses import token_distances
from splitlab.targets import IGNORED


def test_the_text_is_read_off_the_targets_shifted_by_one():
    targets = torch.tensor([[5, 6, 7, IGNORED], [1, 2, 3, 4]])
    assert text_from_targets(targets, 9).tolist() == [[9, 5, 6, 7], [9, 1, 2, 3]]


def test_map_with_a_prior_answers_the_likely_token_the_nearest_one_misses():
    """Token 0 is nearer (distance 1.0 against 1.1), but token 1 is 9 times as frequent: at scale 1
    its log-prior outweighs the 0.1 of distance (log 9 = 2.2 > 0.1); at scale 100 the distance wins."""
    distance = torch.tensor([[[1.0, 1.1]]])
    prior = torch.tensor([0.1, 0.9])
    assert map_with_prior(distance, prior, 1.0).item() == 1
    assert map_with_prior(distance, prior, 100.0).item() == 0


class _Residual(nn.Module):
    """u -> u + 0.1 tanh(W u): a residual stage whose branch is contractive (|W| <= 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.linear.weight.data = torch.eye(4).roll(1, 0)  # a permutation: norm 1

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        return u + 0.1 * torch.tanh(self.linear(u))


def test_the_stages_after_the_embedding_are_inverted_back_to_its_noised_output():
    """Two contractive residual stages after an embedding: the fixed point gives back the input
    of the stages exactly (U-shaped: the head's, not the tail's); a stage that is not
    residual-invertible (doubling) is left as received."""
    torch.manual_seed(0)
    embedding_output = torch.randn(3, 5, 4)
    client = nn.Sequential(nn.Identity(), _Residual(), _Residual())
    with torch.no_grad():
        hidden = client(embedding_output)
    assert torch.allclose(embedding_outputs(client, hidden), embedding_output, atol=1e-5)
    u_shaped = HeadAndTail([("embed", nn.Identity()), ("block", _Residual()), ("head", nn.Linear(4, 2))], 2)
    with torch.no_grad():
        assert torch.allclose(embedding_outputs(u_shaped, u_shaped(embedding_output)), embedding_output, atol=1e-5)
    doubling = nn.Sequential(nn.Identity(), nn.Linear(4, 4))
    doubling[1].weight.data, doubling[1].bias.data = 2 * torch.eye(4), torch.zeros(4)
    assert embedding_outputs(doubling, hidden) is hidden


def test_releases_are_linked_by_what_they_decode_and_their_posteriors_summed():
    """Two sequences of 2 positions over 2 tokens, released in two rounds (in the other order in
    round 2); each release alone is unsure at one position, the two together are not."""
    p = lambda *rows: torch.tensor(rows).log()  # noqa: E731  # (T, V) probabilities -> log
    round_1 = torch.stack([p([0.9, 0.1], [0.45, 0.55]), p([0.2, 0.8], [0.2, 0.8])])  # true: [0, 0] and [1, 1]
    round_2 = torch.stack([p([0.1, 0.9], [0.3, 0.7]), p([0.8, 0.2], [0.8, 0.2])])
    prior = torch.tensor([0.5, 0.5])
    scores = link_scores(round_1, round_2, prior)
    # sequence 0 against round 2's 1: log(2 (0.9 0.8 + 0.1 0.2)) + log(2 (0.45 0.8 + 0.55 0.2))
    assert math.isclose(scores[0, 1].item(), math.log(2 * 0.74) + math.log(2 * 0.47), rel_tol=1e-5)
    assert mutual_links(scores).tolist() == [1, 0]
    links = release_links([round_1, round_2], 0, prior)
    assert links.tolist() == [[0, 1], [1, 0]]
    total = summed([round_1, round_2], links)
    assert round_1.argmax(-1).tolist() == [[0, 1], [1, 1]]  # alone: position 2 of sequence 0 wrong
    assert total.argmax(-1).tolist() == [[0, 0], [1, 1]]  # 0.45 x 0.8 > 0.55 x 0.2
    assert torch.allclose(total[0], round_1[0] + round_2[1])


def test_the_strongest_figure_is_the_highest_of_its_kind_on_the_same_targets():
    entries = {
        "token_inversion": {"targets": "recorded round 3", "accuracy": 0.5, "attacker": "decoder"},
        "targets_channel": {"targets": "recorded round 3", "accuracy": 0.98, "attacker": "read_off_targets"},
        "embedding_inversion": {"targets": "recorded round 2", "accuracy": 0.99, "attacker": "mapped"},
        "label_leak": {
            "targets": "recorded round 3",
            "norm_auc": 0.7,
            "direction_auc": 0.9,
            "linked": {"auc": 0.95},
            "per_batch": {"norm_auc_median": 0.6, "residual_auc_median": 0.99},
        },
    }
    found = {(row["figure"], row["targets"]): row for row in strongest(entries)}
    text = found["text recovered", "recorded round 3"]
    assert (text["value"], text["attack"], text["attacker"]) == (0.98, "targets_channel", "read_off_targets")
    assert text["run"] == ["token_inversion", "targets_channel"] and "embedding_inversion" in text["not_run"]
    assert found["text recovered", "recorded round 2"]["value"] == 0.99
    label = found["label AUC", "recorded round 3"]
    assert (label["value"], label["attacker"]) == (0.95, "linked.auc")  # a figure nested in the result
    per_batch = found["per-batch label AUC (median)", "recorded round 3"]
    assert (per_batch["value"], per_batch["attacker"]) == (0.99, "per_batch.residual_auc_median")


def test_dchi_is_stated_at_the_scale_of_the_embedding_table():
    """Tokens at 0, 0.3 and 1.0 on a line: nearest neighbours 0.3, 0.3 and 0.7 apart."""
    table = nn.Embedding(3, 2, dtype=torch.float64)
    table.weight.data = torch.tensor([[0.0, 0.0], [0.3, 0.0], [1.0, 0.0]], dtype=torch.float64)
    stated = token_distances(nn.Sequential(table), 3, epsilon=100, releases=3)
    assert math.isclose(stated["nearest_token_distance_min"], 0.3, rel_tol=1e-9)
    assert math.isclose(stated["nearest_token_distance_median"], 0.3, rel_tol=1e-9)
    assert math.isclose(stated["epsilon_nearest_tokens"], 30.0, rel_tol=1e-9)
    assert math.isclose(stated["epsilon_nearest_tokens_over_run"], 90.0, rel_tol=1e-9)


def test_a_dchi_run_is_attacked_with_each_round_s_weights_and_all_its_releases(lm, tmp_path, capsys):
    """2 rounds of sfl_v2 at cut 1 under dchi:100, every sequence sent once a round and recorded:
    each round file keeps the client part the round started with (round 1: the seeded initial
    one; its first batch is exactly that part's output, noise aside), the summary states d_chi at
    the embedding's scale, the linked releases recover more than one release, the targets nearly
    all, and attack.json keeps the strongest of them."""
    from splitlab.assembly import load_data  # noqa: F401  # the run's own modules, as the CLI imports them
    from splitlab.finished_run import load_run

    out = tmp_path / "dchi"
    config = {**lm, "algorithm": "sfl_v2", "cut": 1, "rounds": 2, "train_subset": 24, "local_steps": 1}
    keyed = {"defense": "dchi:100", "noise_key": "a", "record": 24}  # a fixed key: the same noise every time
    summary = run({**config, **keyed, "out": str(out)}, progress=False)
    tokens = summary["privacy"]["tokens"]
    assert tokens["releases_per_token"] == 2 and tokens["epsilon_per_token_over_run"] == 200
    assert tokens["epsilon_nearest_tokens"] == 100 * tokens["nearest_token_distance_median"] > 0
    rounds = [load_file(out / "record" / f"round_{r:04d}.safetensors") for r in (1, 2)]
    experiment = load_run(out)
    initial, _ = experiment.blueprint.new_split()
    first = {name[len("weights.0.") :]: t for name, t in rounds[0].items() if name.startswith("weights.0.")}
    assert first.keys() == initial.state_dict().keys()
    assert all(torch.equal(first[name], t) for name, t in initial.state_dict().items())
    later = {name[len("weights.0.") :]: t for name, t in rounds[1].items() if name.startswith("weights.0.")}
    assert not all(torch.equal(first[name], later[name]) for name in first)  # round 2 started elsewhere
    assert main(["attack", str(out), "attack=token_inversion", "epochs=20"]) == 0
    one = json.loads((out / "attack.json").read_text())["token_inversion"]
    assert one["client_weights"] == "the client part round 2 started with"
    assert main(["attack", str(out), "attack=linked_releases", "epochs=20"]) == 0
    linked = json.loads((out / "attack.json").read_text())["linked_releases"]
    assert linked["one_release"] == one["decoder"] and linked["links_right"] > 0.9 and linked["releases"] > 1.5
    assert linked["linked"] > linked["one_release"] + 0.05
    assert linked["linked_prior"] > linked["one_release"] + 0.05  # d_chi's density, all releases, the prior
    assert main(["attack", str(out), "attack=targets_channel"]) == 0
    printed = capsys.readouterr().out
    channel = json.loads((out / "attack.json").read_text())
    assert channel["targets_channel"]["accuracy"] >= 15 / 16  # every position but the first
    (best,) = channel["strongest"]
    assert best["attack"] == "targets_channel" and best["value"] == channel["targets_channel"]["accuracy"]
    assert best["run"] == ["token_inversion", "linked_releases", "targets_channel"]
    assert printed.count("strongest text recovered so far") == 3  # beside each attack's own figure
