"""Model families: which one a run trains, and the registry adding one touches.

``model.family`` (``auto``: the ``_class_name`` in the pipeline's ``model_index.json``) picks the
pipeline family; ``model.train_target=vae`` trains that pipeline's autoencoder instead of its UNet.

Torch-free: importing this package (``families.options`` for the config schema) loads no model code. The
registry, ``detect()``, ``validate()`` and ``create()`` live in ``sd_training.families.registry``.
"""
