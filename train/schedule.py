"""Step-indexed schedules: compression ratio, DMS temperature and query-neuron fade-out."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ScheduleState:
    cr: float  # the compression ratio targeted at this step
    neuron_keep: float  # 1 -> 0 over the neuron warm-up, 0 after
    tau: float | None  # DMS temperature, None to keep the gate's own

    @property
    def eviction_target(self) -> float:
        return 1.0 - 1.0 / self.cr


def schedule_at(step: int, cfg, base_tau: float | None = None) -> ScheduleState:
    """CR(step) = 1 + (CR_final - 1) * min(ramp_step / ramp_len, 1), after the neuron warm-up."""
    warmup = cfg.neuron_warmup_steps
    if step < warmup:
        return ScheduleState(cr=1.0, neuron_keep=1.0 - step / warmup, tau=base_tau)
    ramp = max(round((cfg.cr_final - 1) * cfg.steps_per_cr), 1)
    progress = min((step - warmup) / ramp, 1.0)
    tau = base_tau
    if cfg.tau_final is not None and base_tau is not None:
        tau = base_tau + (cfg.tau_final - base_tau) * progress
    return ScheduleState(cr=1.0 + (cfg.cr_final - 1.0) * progress, neuron_keep=0.0, tau=tau)
