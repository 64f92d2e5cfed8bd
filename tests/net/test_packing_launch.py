"""packing=true over the network (issue 43): the segment ids sent beside the smashed data pass the
server's checks, and the launched run is bit for bit the in-process one."""

from __future__ import annotations

import json

from processes import launch_in_threads
from safetensors.torch import load_file

from hf_helpers import tiny_hf_model
from splitlab.engine import run

CHAT_TEMPLATE = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{{ eos_token }}{% endfor %}"


def test_a_packed_launch_is_bit_identical_to_run(tmp_path):
    rows = [
        {"messages": [{"role": "user", "content": "to be" * (1 + i % 3)}, {"role": "assistant", "content": "or"}]}
        for i in range(20)
    ]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = dict(
        algorithm="sfl_v2",
        dataset="jsonl",
        data_file=str(tmp_path / "chat.jsonl"),
        model="hf",
        model_dir=str(tiny_hf_model(tmp_path / "gpt2", chat_template=CHAT_TEMPLATE)),
        seq_len=64,
        packing=True,
        clients=2,
        batch_size=2,
        local_steps=2,
        rounds=1,
        device="cpu",
    )
    run({**config, "out": str(tmp_path / "run")}, progress=False)
    assert isinstance(launch_in_threads({**config, "out": str(tmp_path / "net")}).ended[0], dict)
    here, there = (load_file(tmp_path / out / "weights.safetensors") for out in ("run", "net"))
    assert here.keys() == there.keys() and all((here[k] == there[k]).all() for k in here)
    ran, launched = (json.loads((tmp_path / out / "metrics.jsonl").read_text()) for out in ("run", "net"))
    assert launched["comm_bytes_by_kind"] == ran["comm_bytes_by_kind"]
    assert launched["comm_bytes_by_kind"]["segments"] == 2 * 2 * 2 * 64 * 8  # 2 clients x 2 steps, (2, 64) int64
