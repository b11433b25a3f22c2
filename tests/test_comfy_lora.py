"""``model.adapter.export_kohya`` for the families whose ComfyUI names are their original checkpoint's
(``Family.comfy_lora_names``, ``sd_training.outputs.comfy_lora``): Z-Image, FLUX.2 klein and dev, Qwen-Image.

For each, from its tiny pipeline: a LoRA made by our adapter code (rank 4, alpha 8: a scale of 2) on every layer
that has an original name, with random non-zero weights, exported; the ComfyUI file holds the original names
(fused q/k/v as one layer), and

- loaded with the family's pipeline ``load_lora_weights`` (diffusers detects the non-diffusers keys and converts
  them) it gives the transformer the same merged weights as the diffusers file and as our own merged net;
- applied as ComfyUI applies a LoRA (``weight += alpha / rank * up @ down`` on the original layer, alpha 1
  where none is written) it gives each original layer the update of our layers in the original's row order.

Layers with no original name both read, text-encoder LoRAs, other families and DoRA are refused naming the key.
No training: the adapter is made and exported by direct calls."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from helpers import args_with

from sd_training import adapters, configure
from sd_training.config import ConfigError
from sd_training.configure import load
from sd_training.families import registry
from sd_training.outputs import comfy_lora, model_card

pytestmark = pytest.mark.usefixtures("one_thread")
LORA = {"model.adapter.type": "lora", "model.adapter.rank": 4, "model.adapter.alpha": 8,
        "model.adapter.export_kohya": "true"}
# Per family: the targets (every layer with an original name; FLUX.2's txt add_k_proj left out so its fused
# qkv has a part without a LoRA), and keys the ComfyUI file must hold (ComfyUI's own names for the tiny nets).
CASES = {
    "zimage": (r"(?!all_).+", ["layers.1.attention.qkv.lora.down.weight", "layers.0.attention.out.alpha",
                               "noise_refiner.0.adaLN_modulation.0.lora.up.weight",
                               "context_refiner.0.feed_forward.w2.alpha",
                               "t_embedder.mlp.2.lora.down.weight", "cap_embedder.1.lora.up.weight"]),
    "flux2_klein": (r"(?!norm_out|transformer_blocks\.0\.attn\.add_k_proj).+",
                    ["double_blocks.0.img_attn.qkv.lora_A.weight", "double_blocks.0.txt_attn.qkv.lora_B.weight",
                     "double_blocks.0.img_mlp.2.lora_A.weight", "single_blocks.0.linear1.lora_B.weight",
                     "img_in.lora_A.weight", "double_stream_modulation_img.lin.lora_A.weight"]),
    "flux2_dev": (r"transformer_blocks\.\d+\.attn\..+|time_guidance_embed\..+",
                  ["double_blocks.0.img_attn.qkv.lora_B.weight", "double_blocks.0.txt_attn.proj.lora_A.weight",
                   "guidance_in.out_layer.lora_B.weight", "time_in.in_layer.lora_A.weight"]),
    "qwen_image": (r".+", ["transformer_blocks.0.attn.to_q.lora_A.weight",
                           "transformer_blocks.0.img_mlp.net.0.proj.alpha", "norm_out.linear.lora_B.weight",
                           "img_in.alpha"]),
}
args = args_with({"dataset.params.resolution": 32, **LORA})


def make(pipeline, shards, tmp_path, **over):
    """The family of ``pipeline`` with a LoRA from ``model.adapter`` (our adapter code), its weights random."""
    cfg = load(args(tmp_path, pipeline, shards, **over))
    fam = registry.create(cfg, torch.device("cpu"), 0, True)
    ad = adapters.apply(cfg, fam, None)
    gen = torch.Generator().manual_seed(1)
    for n, p in fam.net.named_parameters():
        if "lora_" in n:
            p.data = torch.randn(p.shape, generator=gen) * 0.1
    return fam, ad


def merged_weights(pipe, folder, weight_name: str) -> dict[str, torch.Tensor]:
    """The transformer's weights after ``load_lora_weights(folder, weight_name)`` and ``fuse_lora``."""
    pipe = copy.deepcopy(pipe)
    pipe.load_lora_weights(str(folder), weight_name=weight_name)
    pipe.fuse_lora()
    return {k.replace("base_layer.", ""): v.detach().clone() for k, v in pipe.transformer.state_dict().items()
            if "lora_" not in k}


def comfy_updates(state: dict) -> dict[str, torch.Tensor]:
    """What ComfyUI's LoRA loader adds to each original weight (comfy/weight_adapter/lora.py at strength 1)."""
    out = {}
    for key, down in state.items():
        for down_key, up_key in comfy_lora.STYLES.values():
            if key.endswith(down_key):
                base = key[:-len(down_key)]
                alpha = state.get(base + ".alpha")
                scale = float(alpha) / down.shape[0] if alpha is not None else 1.0
                out[base[len(comfy_lora.PREFIX):]] = scale * state[base + up_key] @ down
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_the_comfyui_file_loads_to_the_same_weights(name, family_pipeline, shapes_shards, tmp_path):
    from diffusers import DiffusionPipeline
    from safetensors.torch import load_file

    regex, expected = CASES[name]
    pipeline = family_pipeline(name)
    fam, ad = make(pipeline, shapes_shards, tmp_path, **{"model.adapter.target_regex": regex})
    out = tmp_path / "export"
    adapters.export(ad, fam, fam.net, out, merged=False, kohya=True)
    assert not (out / adapters.KOHYA_FILE).exists()
    assert model_card.kohya_line(out).startswith(adapters.COMFY_FILE)  # what the export's card lists
    saved = load_file(str(out / adapters.COMFY_FILE))
    assert all(k.startswith(comfy_lora.PREFIX) for k in saved)
    missing = [k for k in expected if comfy_lora.PREFIX + k not in saved]
    assert not missing, (missing, sorted(saved)[:12])

    ours = adapters.merged_copy(fam.net).state_dict()
    base = {k.replace("base_layer.", ""): v for k, v in fam.net.state_dict().items() if "lora_" not in k}
    pipe = DiffusionPipeline.from_pretrained(pipeline)
    from_diffusers = merged_weights(pipe, out, adapters.LORA_FILE)
    from_comfy = merged_weights(pipe, out, adapters.COMFY_FILE)
    moved = [k for k in ours if not torch.equal(ours[k], base[k])]
    adapted = {n for n, m in fam.net.named_modules() if isinstance(getattr(m, "scaling", None), dict)}
    assert {k[:-len(".weight")] for k in moved} == adapted and adapted
    for k in ours:
        torch.testing.assert_close(from_diffusers[k], ours[k], atol=1e-5, rtol=0, msg=f"diffusers file: {k}")
        torch.testing.assert_close(from_comfy[k], ours[k], atol=1e-5, rtol=0, msg=f"ComfyUI file: {k}")

    # ComfyUI's arithmetic on the file: each original layer's update is our layers' updates in its row order
    names = fam.comfy_lora_names
    want: dict[str, list] = {}
    for key in moved:
        layer = key[:-len(".weight")]
        original, part, parts = names.original(layer)
        rows = want.setdefault(original, [None] * parts)
        rows[part] = ours[key] - base[key]
    got = comfy_updates(saved)
    assert set(got) == set(want)
    for original, rows in want.items():
        width = next(r for r in rows if r is not None).shape
        full = torch.cat([r if r is not None else torch.zeros(width) for r in rows])
        torch.testing.assert_close(got[original], full, atol=1e-5, rtol=0, msg=original)


def test_a_layer_without_an_original_name_is_refused(family_pipeline, shapes_shards, tmp_path, monkeypatch):
    """FLUX.2's final adaLN: BFL's (shift, scale) against diffusers' (scale, shift), which diffusers' LoRA converter
    does not swap; Z-Image's embedder, whose diffusers name its converter does not map back. Refused at config
    load (the net built on the meta device) and, where the net could not be read then, when the adapter is made."""
    for name, target in (("flux2_klein", "norm_out.linear"), ("zimage", "all_x_embedder.2-1")):
        argv = args(tmp_path, family_pipeline(name), shapes_shards, **{"model.adapter.target_modules": f"[{target}]"})
        message = rf"'model.adapter.export_kohya': the transformer's layer {re.escape(target)} has no name in the"
        with pytest.raises(ConfigError, match=message):
            load(argv)
        with monkeypatch.context() as m:
            m.setattr(configure, "check_comfy_names", lambda cfg: None)  # as for a net not readable at load
            cfg = load(argv)
            fam = registry.create(cfg, torch.device("cpu"), 0, True)
            with pytest.raises(ConfigError, match=message):
                adapters.apply(cfg, fam, None)


@pytest.mark.parametrize("name, over, message", [
    ("zimage", {"model.adapter.use_dora": "true"}, "export_kohya' with model.adapter.use_dora"),
    ("flux2_klein", {"model.adapter.text_encoders.train": "true"},
     "the flux2_klein family's ComfyUI file holds the transformer's LoRA only"),
    ("sd3", {"model.t5.max_length": 16}, "the sd3 family's transformer has no kohya key names"),
])
def test_what_the_file_cannot_hold_is_refused_at_load(name, over, message, family_pipeline, shapes_shards, tmp_path):
    with pytest.raises(ConfigError, match=message):
        load(args(tmp_path, family_pipeline(name), shapes_shards, **over))


def test_a_fused_layer_is_the_inverse_of_the_converters_split():
    """Parts with their own down matrices (different ranks and scales, one part missing) stack and sit
    block-diagonally, so the converters' split (whole down, up.chunk) gives each part its own update."""
    names = comfy_lora.ComfyLoraNames(rules=comfy_lora.fused(r"b\.{}", "b.qkv", ("q", "k", "v")), style="dot",
                                      alpha=True, reader="test")
    gen = torch.Generator().manual_seed(0)
    parts = {"b.q": (torch.randn(2, 6, generator=gen), torch.randn(5, 2, generator=gen), 2.0),
             "b.v": (torch.randn(3, 6, generator=gen), torch.randn(5, 3, generator=gen), 0.5)}
    state = comfy_lora.comfy_state(names, parts)
    down, up = state["diffusion_model.b.qkv.lora.down.weight"], state["diffusion_model.b.qkv.lora.up.weight"]
    scale = float(state["diffusion_model.b.qkv.alpha"]) / down.shape[0]
    assert down.shape == (5, 6) and up.shape == (15, 5)
    for chunk, layer in zip(up.chunk(3), ("b.q", "b.k", "b.v")):
        a, b, s = parts.get(layer, (None, torch.zeros(5, 1), 0.0))
        expect = s * b @ a if a is not None else torch.zeros(5, 6)
        torch.testing.assert_close(scale * chunk @ down, expect)
