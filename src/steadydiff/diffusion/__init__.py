"""Diffusion math: noise schedules, the training objective, and samplers.

schedules.py: ᾱ tables and log-SNR (linear, cosine, sigmoid, piecewise; zero terminal SNR).
objectives.py: timestep sampling, eps/x0/v targets, min-SNR weighting, ``diffusion_loss``.
samplers.py: ddpm, ddim, dpmpp_2m, euler as plain functions; ``Denoiser`` (CFG); ``sample``.
flow.py: rectified flow (timestep densities, shifts, the line, loss weights, sampling sigmas,
flow-match Euler and Heun), pure functions shared with the diffusers model families.
"""

from .objectives import (
    Draws,
    LossOutput,
    diffusion_loss,
    draw,
    loss_weights,
    q_sample,
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
    sample,
    sampling_timesteps,
)
from .schedules import Schedule, make_schedule

__all__ = [
    "Schedule", "make_schedule",
    "Draws", "LossOutput", "diffusion_loss", "draw", "loss_weights", "q_sample", "sample_timesteps",
    "to_x0_eps", "training_target",
    "SAMPLERS", "Denoiser", "ddim", "ddpm", "dpmpp_2m", "euler", "sample", "sampling_timesteps",
]
