"""Schema of the ``objective`` section (the diffusion loss); checked by ``sd_training.objective``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..fields import f


@dataclass
class ObjectiveConfig:
    prediction_type: Optional[str] = f(
        None, "epsilon | v_prediction | sample: what the UNet predicts (None: the training scheduler's own prediction_type)"
    )
    loss_weighting: str = f("none", "none | min_snr: per-sample loss weight (min_snr: min(SNR, snr_gamma) in x0 units)")
    snr_gamma: float = f(5.0, "min_snr: the SNR cap gamma (dimensionless; 5 in Hang et al.)")
    noise_offset: float = f(0.0, "std of the per-channel constant (zero-frequency) noise added to the unit noise (0: off)")
    pyramid_noise_discount: float = f(0.0, "multi-resolution noise: weight ratio between successive coarser levels, in [0, 1) (0: off)")
    input_perturbation: float = f(0.0, "std of extra noise added to the UNet input only, in units of the noise (0: off)")
    zero_terminal_snr: bool = f(False, "rescale betas to SNR 0 at the last timestep (Lin et al.); needs v_prediction or sample")
    timestep_sampling: str = f("uniform", "uniform | logit_normal: distribution of training timesteps")
    logit_mean: float = f(0.0, "logit_normal: mean of the normal in logit(t / num_train_timesteps) units")
    logit_std: float = f(1.0, "logit_normal: std of the normal in logit(t / num_train_timesteps) units")
