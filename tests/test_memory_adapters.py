"""The memory plan of adapter runs (model.adapter): the adapter's parameters train (fp32 weights, gradients,
AdamW state, EMA), the net's frozen base is counted as stored (bf16) with nothing else, text encoders with
their own adapter are counted whole on every GPU; every number equals what a real peft-injected tiny UNet
and CLIP hold. At config load (nothing built) the adapter is counted from the layers' shapes, and the count
equals peft's."""

import json

import pytest
import torch
from diffusers import UNet2DConditionModel
from transformers import CLIPTextConfig, CLIPTextModel

from sd_training.adapters import inject, lora_config, resolve_targets
from sd_training.config import ConfigError
from sd_training.config.loading import parse
from sd_training.families.unet_family import UNET_ADAPTER_PRESETS, shard_units
from sd_training.families.tiny import TINY_TEXT_ENCODER, TINY_UNET
from sd_training.memory.fit import check_batch
from sd_training.memory.load import lora_params
from sd_training.memory.plan import GIB, STRATEGIES, format_plan, memory_plan

pytestmark = pytest.mark.usefixtures("one_thread")
TEXT_PRESET = r".*self_attn\.(q_proj|k_proj|v_proj|out_proj)"


class Adapter:  # model.adapter's fields that lora_config reads
    dropout, init = 0.0, "default"

    def __init__(self, dora=False):
        self.use_dora = dora


def lora_unet(preset: str, rank: int, dora: bool = False):
    """A tiny UNet with a LoRA as sd_training.adapters puts it: base in bf16, adapter in fp32. Returns (net,
    targets, the adapter's parameter count as peft made it)."""
    torch.manual_seed(0)
    net = UNet2DConditionModel(**TINY_UNET)
    targets = resolve_targets(net, UNET_ADAPTER_PRESETS, preset, [], None, "model.adapter", "unet")
    net.to(torch.bfloat16)
    n = inject(net, lora_config(targets, rank, None, Adapter(dora)))
    assert n == sum(p.numel() for p in net.parameters() if p.requires_grad)
    return net, targets, n


@pytest.mark.parametrize("preset, dora", [("attention", False), ("all_linear", False), ("attention", True)])
def test_the_formula_counts_what_peft_injects(preset, dora):
    """rank x (inputs + outputs) per layer (convolutions: in_channels x kernel area), + outputs with DoRA."""
    net, targets, n = lora_unet(preset, 4, dora)
    bare = UNet2DConditionModel(**TINY_UNET)
    if preset == "all_linear":
        assert any(isinstance(m, torch.nn.Conv2d) for name, m in bare.named_modules() if name in targets)
    assert lora_params(bare, targets, 4, dora) == n > 0
    with torch.device("meta"):  # what the plan at load builds
        assert lora_params(UNet2DConditionModel(**TINY_UNET), targets, 4, dora) == n


def test_the_start_up_plan_of_an_adapter_run_counts_the_real_modules():
    net, _targets, n = lora_unet("attention", 8)
    base = sum(p.numel() for p in net.parameters() if not p.requires_grad)
    assert {p.dtype for p in net.parameters() if not p.requires_grad} == {torch.bfloat16}
    text = CLIPTextModel(CLIPTextConfig(**TINY_TEXT_ENCODER))
    text_targets = resolve_targets(text, {"attention": TEXT_PRESET}, "attention", [], None, "x", "text_encoder")
    text.to(torch.bfloat16)
    n_text = inject(text, lora_config(text_targets, 4, None, Adapter()))
    text_frozen = sum(p.numel() * 2 for p in text.parameters() if not p.requires_grad)
    vae = torch.nn.Linear(8, 8)  # a frozen component, counted as stored
    ema = 1234 * 4  # the EMA's copy (an adapters-only EMA) as build.py measures it
    rows = memory_plan(net, [vae], "adamw", 2, True, False, 2, shard_units, "layer", replicated=[text, text],
                       activations=3 * 2**20, ema_bytes=ema)
    ddp, fsdp, offload = rows
    assert [r.strategy for r in rows] == list(STRATEGIES)
    for r in rows:
        assert (r.trained_params, r.base_params, r.encoder_trained_params) == (n, base, n_text)
        parts = r.weights + r.gradients + r.optimizer + r.ema + r.gathered + r.base + r.frozen + r.activations
        assert r.total == pytest.approx(parts)
    assert ddp.weights * GIB == n * 4 and ddp.gradients * GIB == n * 4 and ddp.optimizer * GIB == n * 8
    assert ddp.base * GIB == base * 2 and ddp.ema * GIB == ema  # the base: bf16, no grads, no optimizer state
    # The text encoder (given twice: counted once): its adapter trains, its base is frozen, whole on every GPU.
    assert ddp.frozen * GIB == (8 * 8 + 8) * 4 + n_text * 16 + text_frozen == fsdp.frozen * GIB
    assert fsdp.base == ddp.base / 2 and fsdp.optimizer == ddp.optimizer / 2 and offload.base == offload.weights == 0
    assert fsdp.gathered > 0 and ddp.gathered == 0
    text_log = format_plan(rows, "ddp", 1)
    assert f"trained: {n:,} parameters (the adapter) + {n_text:,} of the text encoders" in text_log
    assert f"frozen base: {base:,} parameters" in text_log and " base " in text_log.splitlines()[2]
    # A full fine-tune: no base column, every parameter trained in fp32 (as before adapters).
    full = UNet2DConditionModel(**TINY_UNET)
    row = memory_plan(full, [], "adamw", 1, True, False, 2, None, "layer")[0]
    total = sum(p.numel() for p in full.parameters())
    assert (row.trained_params, row.base_params, row.base) == (total, 0, 0)
    assert row.weights * GIB == row.ema * GIB == total * 4 and " base " not in format_plan([row], "ddp", 1)


def test_an_adapter_run_is_planned_at_load_from_the_layer_shapes(tmp_path):
    """Nothing built but the net on the meta device: the LoRA counted from its layers, the base at 2 bytes."""
    unet = json.dumps(TINY_UNET)  # JSON is YAML
    args = ["experiment.name=x", f"experiment.log_dir={tmp_path}", "experiment.num_examples_to_see=64",
            "dataset.params.path=/data/{0..3}.tar", "system.device=cpu", "model.family=sd", "model.pretrained=/models/sd",
            f"model.unet.params={unet}", "model.mixed_precision=bf16", "model.adapter.type=lora",
            "model.adapter.rank=8", "dataset.params.resolution=64", "system.batch_size=100000000"]
    _net, targets, n = lora_unet("attention", 8)
    base = sum(p.numel() for p in UNet2DConditionModel(**TINY_UNET).parameters())
    with pytest.raises(ConfigError) as err:
        check_batch(parse(args))
    text = str(err.value)
    assert f"a LoRA of {n / 1e6:,.2f}M parameters on {len(targets)} layers" in text and "bytes" in text
    assert f"plus {(n * 16 + base * 2) / GIB:,.2f} GiB of the unet's" in text  # AdamW: 4 + 4 + 8 per trained param
    full = str(pytest.raises(ConfigError, check_batch, parse([a for a in args if "adapter" not in a])).value)
    assert f"plus {base * 16 / GIB:,.2f} GiB of the unet's" in full
    check_batch(parse([*args[:-1], "system.batch_size=1"]))  # fits
    check_batch(parse([*args, "model.adapter.target_modules=[no_such_layer]"]))  # the build reports it, not the plan
