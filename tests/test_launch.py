"""How a run was started: DeepSpeed's launcher's variables mapped onto Lightning's, inconsistent worlds refused."""

import pytest

from recipes import RecipeError
from train.launch import adopt_launcher_environment, local_rank_argument


def deepspeed_launcher_env(node: int, local_rank: int, nodes: int = 2, slots: int = 8) -> dict:
    """Exactly what deepspeed/launcher/launch.py exports for one process (plus the hostfile's visible devices)."""
    return {"MASTER_ADDR": "node1", "MASTER_PORT": "29500", "WORLD_SIZE": str(nodes * slots), "CROSS_RANK": str(node),
            "CROSS_SIZE": str(nodes), "LOCAL_SIZE": str(slots), "RANK": str(node * slots + local_rank),
            "LOCAL_RANK": str(local_rank), "CUDA_VISIBLE_DEVICES": ",".join(map(str, range(slots)))}


def test_deepspeed_launcher_node_index_reaches_lightning():
    env = deepspeed_launcher_env(node=1, local_rank=3)
    assert adopt_launcher_environment(8, 2, env) == "deepspeed"
    assert env["NODE_RANK"] == "1"
    # what Lightning then computes for this process: node 1, global rank 8 + 3
    import os

    from lightning.fabric.plugins.environments import LightningEnvironment

    saved = dict(os.environ)
    try:
        os.environ.update(env)
        lightning = LightningEnvironment()
        assert lightning.node_rank() == 1 and lightning.local_rank() == 3
        assert lightning.node_rank() * 8 + lightning.local_rank() == int(env["RANK"])
    finally:
        os.environ.clear()
        os.environ.update(saved)


@pytest.mark.parametrize("change,devices,nodes,message", [
    ({}, 8, 1, r"started 2 node\(s\) \(CROSS_SIZE=2\) but trainer.num_nodes=1; pass trainer.num_nodes=2"),
    ({}, 4, 2, r"started 8 process\(es\) on this node .* but trainer.devices=4; pass trainer.devices=8"),
    ({"NODE_RANK": "0"}, 8, 2, r"NODE_RANK=0 disagrees with DeepSpeed's launcher \(CROSS_RANK=1\)"),
    ({"RANK": "5"}, 8, 2, r"RANK=5 is not CROSS_RANK x LOCAL_SIZE \+ LOCAL_RANK = 1 x 8 \+ 3"),
    ({"LOCAL_SIZE": None}, 8, 2, r"CROSS_RANK is set .* but LOCAL_SIZE is not"),
])
def test_inconsistent_deepspeed_worlds_are_refused(change, devices, nodes, message):
    env = deepspeed_launcher_env(node=1, local_rank=3)
    for key, value in change.items():
        env.pop(key) if value is None else env.__setitem__(key, value)
    with pytest.raises(RecipeError, match=message):
        adopt_launcher_environment(devices, nodes, env)


def test_torchrun_world_must_match_devices_times_nodes():
    env = {"TORCHELASTIC_RUN_ID": "x", "GROUP_RANK": "0", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "4",
           "LOCAL_WORLD_SIZE": "2"}
    assert adopt_launcher_environment(2, 2, dict(env)) == "torchrun"
    with pytest.raises(RecipeError, match=r"WORLD_SIZE=4 processes, but trainer.devices=2 x trainer.num_nodes=1 = 2"):
        adopt_launcher_environment(2, 1, dict(env))
    assert adopt_launcher_environment(1, 1, {}) is None  # a plain start: Lightning starts its processes itself


def test_local_rank_argument_is_accepted_and_checked():
    env = {"LOCAL_RANK": "2"}
    assert local_rank_argument(["recipe=x", "--local_rank=2", "a=b"], env) == ["recipe=x", "a=b"]
    with pytest.raises(RecipeError, match=r"--local_rank=1 disagrees with LOCAL_RANK=2"):
        local_rank_argument(["--local_rank=1"], env)
    fresh = {}
    assert local_rank_argument(["--local-rank=4"], fresh) == [] and fresh["LOCAL_RANK"] == "4"

