"""model.compile_mode: torch.compile's mode reaches the compiler (reduce-overhead turns inductor's CUDA
graphs on), CUDA-graph modes start a new graph generation at every forward of the trained net (so a loss
kept from the last step is never overwritten by the next replay), and the key is refused without
model.compile. The CUDA-graph replay itself needs a GPU: scripts/gpu_check.sh and bench_step
--compile-mode measure it."""

import types

import pytest
import torch
from conftest import train_args

from sd_training.build import compile_model, new_cuda_graph_step
from sd_training.config import ConfigError
from sd_training.configure import load
from sd_training.families.unet_family import compile_units

pytestmark = pytest.mark.usefixtures("one_thread")
FAMILY = types.SimpleNamespace(compile_units=compile_units, net_name="unet")


def _hooks(module) -> list:
    return list(module._forward_pre_hooks.values())


@pytest.mark.parametrize("mode, graphs", [("reduce-overhead", True), ("max-autotune", True),
                                          ("max-autotune-no-cudagraphs", False)])
def test_the_mode_reaches_inductor_and_cuda_graph_modes_mark_each_step(mode, graphs):
    model = torch.nn.Sequential(torch.nn.Conv2d(4, 4, 3, padding=1), torch.nn.SiLU())
    out = compile_model(model, FAMILY, model, "whole", mode=mode)
    assert out.get_compiler_config()["triton.cudagraphs"] is graphs
    assert (new_cuda_graph_step in _hooks(out)) is graphs
    plain = compile_model(model, FAMILY, model, "whole")
    assert plain.get_compiler_config()["triton.cudagraphs"] is False and not _hooks(plain)


def test_blocks_scope_marks_the_step_on_the_net(tiny_pipeline):
    from diffusers import UNet2DConditionModel

    net = UNet2DConditionModel.from_pretrained(tiny_pipeline, subfolder="unet")
    assert compile_model(net, FAMILY, net, "blocks", mode="reduce-overhead") is net
    assert new_cuda_graph_step in _hooks(net)
    assert all(u._compiled_call_impl is not None for u in compile_units(net))
    new_cuda_graph_step()  # harmless without a GPU (a new generation of nothing)


def test_compile_mode_is_a_checked_key(tmp_path, tiny_pipeline, shapes_shards):
    assert load(train_args(tmp_path, tiny_pipeline, shapes_shards)).model.compile_mode == "default"
    with pytest.raises(ConfigError, match="'model.compile_mode' is reduce-overhead but model.compile is false"):
        load(train_args(tmp_path, tiny_pipeline, shapes_shards, **{"model.compile_mode": "reduce-overhead"}))
    with pytest.raises(ConfigError, match="compile_mode"):
        load(train_args(tmp_path, tiny_pipeline, shapes_shards, **{"model.compile": "true", "model.compile_mode": "fast"}))
    cfg = load(train_args(tmp_path, tiny_pipeline, shapes_shards, **{"model.compile": "true",
                                                                     "model.compile_mode": "reduce-overhead"}))
    assert cfg.model.compile_mode == "reduce-overhead"
