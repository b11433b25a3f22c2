"""Model families: which one a run trains, and everything specific to one.

``model.family`` (``auto``: the ``_class_name`` in the pipeline's ``model_index.json``) picks the
pipeline family; ``model.train_target=vae`` trains that pipeline's autoencoder instead of its UNet.

Torch-free: importing this package (``families.options`` for the config schema) loads no model code.

* ``registry.py``: ``FAMILIES`` (name -> class), ``detect()`` / ``detect_source()``, ``validate()``,
  ``create()``, ``make_tiny_pipeline()``. Adding a family is its module and one line there.
* ``base.py``: what a family tells the trainer (``Family``) and the scripts (classmethods
  ``make_tiny_pipeline``, ``text_encoding`` -> ``TextEncoding``, ``text_storage_tag``).
* ``options.py``: the config sections one family reads (torch-free).
* ``sd.py``, ``sdxl.py``: the UNet pipelines; ``unet_components.py`` builds their components.
* ``autoencoder.py`` with ``autoencoder_loss.py``: the VAE stage on top of a pipeline family.
* ``tiny.py``: the shared sizes of the tiny random-weight pipelines (``registry.make_tiny_pipeline`` builds one).
"""
