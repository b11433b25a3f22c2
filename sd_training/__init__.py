"""sd-training: latent diffusion training from one CPU to SLURM clusters.

Importing the package registers the config keys that their owners declare (the families' fields, torch-free)
with the schema in ``sd_training.config``, which imports nothing above itself: every entry point (train.py,
the scripts, ``sd_training.configure.load``) parses against the whole schema.
"""

from .families import options as _family_options  # noqa: F401  (registers the families' config fields)
