"""The config schema's sections: plain dataclasses with help text, importing no model, objective or
data code. ``sd_training.config`` assembles them into ``TrainConfig``; each section's owner checks it
(``sd_training.configure`` runs every check)."""
