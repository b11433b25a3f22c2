"""Schema of ``model.text_encoder``; checked and built by ``sd_training.text_encoders``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..fields import f


@dataclass
class TextEncoderConfig:
    pretrained: Optional[str] = f(
        None, "type clip: pipeline root or text_encoder folder, local path or hub id (None: model.pretrained)"
    )
    type: str = f("clip", "clip (transformers CLIPTextModel folder: SD 1.x, SD 2.x) | open_clip (open_clip_model + open_clip_weights)")
    open_clip_model: Optional[str] = f(None, "type open_clip: architecture name, e.g. ViT-H-14, or local-dir:FOLDER with open_clip_config.json")
    open_clip_weights: Optional[str] = f(None, "type open_clip: local path of the checkpoint file (.bin / .pt / .safetensors)")
    clip_skip: int = f(0, "layers counted back from the last: 0 or 1 = last, 2 = penultimate (kohya/EveryDream); baked into exports")
    max_length: Optional[int] = f(None, "tokens per caption, start and end tokens included (None: the tokenizer's model_max_length, 77)")
    train: bool = f(False, "train the text encoder with the UNet (False: frozen, eval mode, no gradients)")
    learning_rate: Optional[float] = f(None, "train: peak learning rate of the text encoder, same schedule (None: optimizer.params.learning_rate)")
    dtype: str = f("auto", "frozen text encoder weights: auto (the training precision: bf16 under bf16, fp16 under fp16, else fp32) | fp32 | fp16 | bf16 (train: fp32 or auto)")
