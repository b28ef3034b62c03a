"""Snapshot metadata (a typed schema that names the file and the bad key) and sharded snapshot tensors."""

import json

import pytest
import torch

from checkpoints import SnapshotError, SnapshotMeta, read_meta, save_snapshot, trained_tensors
from checkpoints.snapshot import WEIGHTS_INDEX, read_tensors


def write_meta(folder, values) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "retrokv.json").write_text(json.dumps(values))


def test_metadata_round_trips_and_old_snapshots_get_no_sinks(tmp_path):
    meta = SnapshotMeta(backbone="smollm2-135m", gate_kind="dms", gate_settings={"window": 16, "sinks": 4}, cr=3.0,
                        step=50, config={"seed": 1})
    write_meta(tmp_path / "new", meta.to_json())
    assert read_meta(tmp_path / "new") == meta
    write_meta(tmp_path / "old", {"backbone": "b", "gate_kind": "trimkv", "gate_settings": {"budget": 8}})
    assert read_meta(tmp_path / "old").gate_settings == {"sinks": 0, "budget": 8}


@pytest.mark.parametrize("values,message", [
    ([1, 2], r"holds a JSON list, not the snapshot metadata"),
    ("dms", r"holds a JSON str"),
    ({}, r"lacks \['backbone', 'gate_kind', 'gate_settings'\]"),
    ({"backbone": "b", "gate_kind": "dms", "gate_settings": {"budget": 8}}, r"unknown dms gate setting\(s\) \['budget'\]"),
    ({"backbone": "b", "gate_kind": "h2o", "gate_settings": {}}, r"unknown gate kind 'h2o'"),
    ({"backbone": "b", "gate_kind": "dms", "gate_settings": {"window": -3}}, r"dms window=-3 is invalid"),
    ({"backbone": "b", "gate_kind": "dms", "gate_settings": {}, "cr": "4"}, r"cr='4' is invalid; expected an integer or a number"),
    ({"backbone": 7, "gate_kind": "dms", "gate_settings": {}}, r"backbone=7 is invalid; expected a string"),
])
def test_junk_metadata_is_named(tmp_path, values, message, capsys):
    write_meta(tmp_path, values)
    with pytest.raises(SnapshotError, match=message) as err:
        read_meta(tmp_path)
    assert str(tmp_path / "retrokv.json") in str(err.value)
    from checkpoints.__main__ import main

    assert main(["show", str(tmp_path)]) == 2
    assert str(tmp_path / "retrokv.json") in capsys.readouterr().err


def test_large_snapshots_are_sharded_and_read_back(tmp_path):
    tensors = {f"layer{i}.weight": torch.randn(64, 64) for i in range(6)}  # 16 KB each
    meta = SnapshotMeta(backbone="b", gate_kind="dms", gate_settings={})
    folder = save_snapshot(tensors, tmp_path / "s", meta, max_shard_size="40KB")
    shards = sorted(p.name for p in folder.glob("trainable-*.safetensors"))
    assert len(shards) == 3 and (folder / WEIGHTS_INDEX).is_file() and not (folder / "trainable.safetensors").exists()
    back = read_tensors(folder)
    assert back.keys() == tensors.keys() and all(torch.equal(back[k], tensors[k]) for k in tensors)
    (folder / shards[1]).write_bytes(b"garbage")
    with pytest.raises(SnapshotError, match=f"{shards[1]} is corrupt or missing"):
        read_tensors(folder)
    small = save_snapshot(tensors, tmp_path / "one", meta)
    assert [p.name for p in small.glob("*.safetensors")] == ["trainable.safetensors"]


def test_only_the_writing_rank_keeps_a_copy_of_the_trained_tensors():
    model = torch.nn.Linear(3, 2)
    model.bias.requires_grad_(False)
    assert list(trained_tensors(model)) == ["weight"] and trained_tensors(model, keep=False) == {}
