"""Diffusion math: noise schedules, the training objectives, and samplers.

schedules.py: ᾱ tables and log-SNR (linear, cosine, sigmoid, piecewise; zero terminal SNR);
    the flow and EDM noise levels (FlowSchedule, EDMSchedule); ``make_schedule`` builds the
    objective's (docs/objectives.md).
objectives.py: level sampling, the ddpm/flow/edm targets and weights, ``diffusion_loss``.
samplers.py: ddpm, ddim, dpmpp_2m, euler, heun as plain functions; ``Denoiser`` (CFG);
    ``sample``.
edm.py: Karras et al. 2022 (preconditioning, log-normal σ, Karras σ grid, Euler and Heun).
flow.py: rectified flow (timestep densities, shifts, the line, loss weights, sampling sigmas,
flow-match Euler and Heun), pure functions shared with the diffusers model families.
"""

from .objectives import (
    Draws,
    LossOutput,
    diffusion_loss,
    draw,
    loss_weights,
    output_to_x0_eps,
    q_sample,
    sample_levels,
    sample_timesteps,
    to_x0_eps,
    training_target,
)
from .samplers import (
    SAMPLERS,
    Denoiser,
    ddim,
    ddpm,
    dpmpp_2m,
    euler,
    heun,
    sample,
    sampling_timesteps,
)
from .schedules import AnySchedule, EDMSchedule, FlowSchedule, Schedule, make_schedule

__all__ = [
    "Schedule", "FlowSchedule", "EDMSchedule", "AnySchedule", "make_schedule",
    "Draws", "LossOutput", "diffusion_loss", "draw", "loss_weights", "output_to_x0_eps",
    "q_sample", "sample_levels", "sample_timesteps", "to_x0_eps", "training_target",
    "SAMPLERS", "Denoiser", "ddim", "ddpm", "dpmpp_2m", "euler", "heun", "sample",
    "sampling_timesteps",
]
