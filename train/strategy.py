"""Lightning strategies from the recipe: single device, DDP, DeepSpeed ZeRO (also on CPU for tests)."""

from __future__ import annotations

import contextlib

import torch
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, SingleDeviceStrategy, Strategy

from recipes import RecipeError


class CPUDeepSpeedStrategy(DeepSpeedStrategy):
    """Lightning's DeepSpeed strategy refuses CPUs; DeepSpeed itself runs ZeRO on CPU over gloo.

    Used for multi-process tests on machines without a GPU; a GPU run uses the stock strategy.
    """

    def setup_environment(self) -> None:
        Strategy.setup_environment(self)  # skip the CUDA-only accelerator check
        self.setup_distributed()

    def setup_distributed(self) -> None:
        import deepspeed

        self.set_world_ranks()
        self._set_node_environment_variables()  # RANK/WORLD_SIZE/MASTER_*: else DeepSpeed looks for MPI
        if not torch.distributed.is_initialized():
            deepspeed.init_distributed("gloo", distributed_port=self.cluster_environment.main_port)

    @property
    def root_device(self) -> torch.device:
        return torch.device("cpu", 0)  # DeepSpeed reads an integer device index


def deepspeed_config(cfg) -> dict:
    s = cfg.strategy
    zero: dict = {"stage": s.zero_stage, "contiguous_gradients": True, "overlap_comm": True}
    if s.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if s.offload_parameters:
        if s.zero_stage != 3:
            raise RecipeError(f"strategy.offload_parameters needs strategy.zero_stage=3, not {s.zero_stage}")
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    return {
        "zero_optimization": zero,
        "gradient_clipping": cfg.optim.grad_clip,
        "train_micro_batch_size_per_gpu": cfg.data.batch_size,
        "zero_allow_untested_optimizer": True,
    }


def build_strategy(cfg, accelerator: str) -> Strategy | str:
    name = cfg.strategy.name
    cpu = accelerator == "cpu" or (accelerator == "auto" and not torch.cuda.is_available())
    if name == "auto":
        return "auto"
    if name == "single":
        return SingleDeviceStrategy(device=torch.device("cpu" if cpu else "cuda:0"))
    if name == "ddp":
        return DDPStrategy(process_group_backend="gloo" if cpu else "nccl")
    if name == "deepspeed":
        # ZeRO-3 with a full fine-tune works because the separate teacher lives outside the engine
        cls = CPUDeepSpeedStrategy if cpu else DeepSpeedStrategy
        return cls(config=deepspeed_config(cfg))
    raise RecipeError(f"strategy.name={name!r} is invalid; valid: auto, single, ddp, deepspeed")


@contextlib.contextmanager
def zero3_loading(config: dict | None):
    """While active (given a ZeRO-3 DeepSpeed config), transformers' from_pretrained loads partitioned: rank 0
    reads the checkpoint, every rank keeps only its partition (transformers' HfDeepSpeedConfig integration)."""
    if config is None:
        yield
        return
    from transformers.integrations.deepspeed import HfDeepSpeedConfig, unset_hf_deepspeed_config

    hf_config = HfDeepSpeedConfig(config)  # noqa: F841 -- transformers holds only a weak reference to it
    try:
        yield
    finally:
        unset_hf_deepspeed_config()


def zero3_inference_engine(model: torch.nn.Module, config: dict):
    """A DeepSpeed ZeRO-3 engine without optimizer around a frozen, partitioned model (the teacher), so that its
    forward gathers each layer's weights as it runs; the student's training engine does not own it."""
    import deepspeed

    precision = {key: config[key] for key in ("bf16", "fp16") if key in config}
    # the teacher runs in parts (its decoder, then its head chunk by chunk), not as one traced forward, so
    # prefetching along a recorded trace would fetch the wrong parameters: off
    zero = {"stage": 3, "stage3_prefetch_bucket_size": 0}
    engine, *_ = deepspeed.initialize(model=model, config={
        "zero_optimization": zero, "train_micro_batch_size_per_gpu": config["train_micro_batch_size_per_gpu"],
        "gradient_accumulation_steps": 1, **precision})
    engine.eval()
    return engine
