"""How this process was started, checked before any process group forms.

Lightning reads a node's index from NODE_RANK (or GROUP_RANK). torchrun and SLURM set what Lightning reads,
but DeepSpeed's launcher (`deepspeed --hostfile ... --module train`) sets CROSS_RANK / CROSS_SIZE /
LOCAL_SIZE instead, so without a mapping every node would believe it is node 0 and ranks would collide.
It also appends `--local_rank=N` to the command line. This module maps the one and accepts the other, and
refuses a world that disagrees with the recipe's `trainer.devices` x `trainer.num_nodes`, naming both.
"""

from __future__ import annotations

import os
from typing import MutableMapping

from recipes import RecipeError

DEEPSPEED_LAUNCHER_VARIABLES = ("CROSS_RANK", "CROSS_SIZE", "LOCAL_SIZE")


def local_rank_argument(argv: list[str], env: MutableMapping[str, str] = os.environ) -> list[str]:
    """`argv` without the `--local_rank=N` (or `--local-rank=N`) that DeepSpeed's launcher appends; N must
    agree with LOCAL_RANK when the launcher set that too."""
    kept = []
    for arg in argv:
        name, _, value = arg.partition("=")
        if name not in ("--local_rank", "--local-rank"):
            kept.append(arg)
            continue
        if not value.isdigit():
            raise RecipeError(f"{arg!r}: the local rank must be a non-negative integer")
        if "LOCAL_RANK" in env and env["LOCAL_RANK"] != value:
            raise RecipeError(f"{arg} disagrees with LOCAL_RANK={env['LOCAL_RANK']} in the environment")
        env.setdefault("LOCAL_RANK", value)
    return kept


def adopt_launcher_environment(devices_per_node: int, num_nodes: int,
                               env: MutableMapping[str, str] = os.environ) -> str | None:
    """Map the launcher's variables onto Lightning's and check the world against the recipe.

    Returns the launcher recognised ('deepspeed', 'torchrun', 'slurm') or None for a plain start, where
    Lightning starts the processes itself. `env` is changed in place (NODE_RANK for DeepSpeed's launcher).
    """
    launcher = None
    if "CROSS_RANK" in env:
        launcher = "deepspeed"
        _adopt_deepspeed(env, devices_per_node, num_nodes)
    elif "TORCHELASTIC_RUN_ID" in env or "GROUP_RANK" in env:
        launcher = "torchrun"
    elif "SLURM_NTASKS" in env:
        launcher = "slurm"
    if launcher in ("deepspeed", "torchrun") and "WORLD_SIZE" in env:
        world = int(env["WORLD_SIZE"])
        if world != devices_per_node * num_nodes:
            raise RecipeError(f"the launcher started WORLD_SIZE={world} processes, but trainer.devices={devices_per_node} x "
                              f"trainer.num_nodes={num_nodes} = {devices_per_node * num_nodes}; set trainer.devices to the "
                              "processes per node and trainer.num_nodes to the node count")
    return launcher


def _adopt_deepspeed(env: MutableMapping[str, str], devices_per_node: int, num_nodes: int) -> None:
    missing = [k for k in (*DEEPSPEED_LAUNCHER_VARIABLES, "RANK", "LOCAL_RANK", "WORLD_SIZE") if k not in env]
    if missing:
        raise RecipeError(f"CROSS_RANK is set (DeepSpeed's launcher) but {', '.join(missing)} is not; start the run with "
                          "`deepspeed --hostfile ... --module train ...`, torchrun or srun")
    node, nodes, local_size = int(env["CROSS_RANK"]), int(env["CROSS_SIZE"]), int(env["LOCAL_SIZE"])
    if "NODE_RANK" in env and int(env["NODE_RANK"]) != node:
        raise RecipeError(f"NODE_RANK={env['NODE_RANK']} disagrees with DeepSpeed's launcher (CROSS_RANK={node}); "
                          "unset NODE_RANK and let the launcher number the nodes")
    if nodes != num_nodes:
        raise RecipeError(f"DeepSpeed's launcher started {nodes} node(s) (CROSS_SIZE={nodes}) but trainer.num_nodes="
                          f"{num_nodes}; pass trainer.num_nodes={nodes}")
    if local_size != devices_per_node:
        raise RecipeError(f"DeepSpeed's launcher started {local_size} process(es) on this node (LOCAL_SIZE, the hostfile's "
                          f"slots) but trainer.devices={devices_per_node}; pass trainer.devices={local_size}")
    rank, local_rank = int(env["RANK"]), int(env["LOCAL_RANK"])
    if rank != node * local_size + local_rank:
        raise RecipeError(f"RANK={rank} is not CROSS_RANK x LOCAL_SIZE + LOCAL_RANK = {node} x {local_size} + {local_rank}: "
                          "the hostfile gives nodes different slot counts, and Lightning needs the same number of "
                          "devices on every node")
    env["NODE_RANK"] = str(node)

