"""Model families: which one a run trains, and everything specific to one.

``model.family`` (``auto``: the ``_class_name`` in the pipeline's ``model_index.json``) picks the
pipeline family; ``model.train_target=vae`` trains that pipeline's autoencoder instead of its UNet.

Torch-free: importing this package (``families.options`` for the config schema) loads no model code.

* ``registry.py``: ``FAMILIES`` (name -> class), ``detect()`` / ``detect_source()``, ``validate()``,
  ``create()``, ``make_tiny_pipeline()``. Adding a family is its module and one line there.
* ``base.py``: what a family tells the trainer (``Family``) and the scripts (classmethods
  ``make_tiny_pipeline``, ``text_encoding`` -> ``components.text.TextEncoding``).
* ``pipeline_family.py``: what the text-to-image families share (latents, validation batches, shard checks,
  exports, sample grids, eval images); ``unet_family.py`` (a UNet, the eps/v objective) and
  ``flow_family.py`` (a transformer, flow matching) are the two bases a family extends.
* ``sd.py``, ``sdxl.py`` (UNet), ``sd3.py``, ``flux.py`` (flow matching): the families.
* ``components/``: what families compose: the objectives (``ddpm.py``, ``flow_matching.py``), the text
  encoders (``clip.py``, ``open_clip_text.py``, ``t5.py``, their common shape in ``text.py``), the one VAE
  encode (``vae.py``), latent packing (``packing.py``), the nets' builders (``unet.py``, ``transformer.py``).
* ``options.py``: the config sections one family reads (torch-free), registered with the schema
  (``sd_training.config.schema.register_fields``) when ``sd_training`` is imported.
* ``autoencoder.py`` with ``autoencoder_loss.py``: the VAE stage on top of a pipeline family.
* ``tiny.py``: the shared sizes of the tiny random-weight pipelines (``registry.make_tiny_pipeline`` builds one).
"""
