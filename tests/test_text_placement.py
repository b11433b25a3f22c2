"""model.text_encoder_placement and model.vae.placement: where the frozen text encoders and VAE live
(components.placement).

The config's choice (auto: offload with stored text states, else device) and its refusals, and the hooks'
contract on a real LLM text encoder: ``cpu`` runs it in host memory and hands its outputs (a ModelOutput
with a tuple of hidden states) to the training device; ``offload`` moves it onto the device for each forward
and back. The runs that go through the hooks end to end (steps, validation, grids, eval images, and grids
equal to the device's) are in tests/test_family_conformance.py."""

import pytest
import torch
from helpers import args_with

from sd_training.config import ConfigError
from sd_training.config.rules import text_encoder_placement
from sd_training.configure import load
from sd_training.families.components import llm_text, placement

args = args_with({"dataset.params.resolution": 32})


@pytest.mark.parametrize("over, want", [
    ({}, "device"),
    ({"dataset.type": "latents", "dataset.params.text_embeddings": "true"}, "offload"),
    ({"model.text_encoder_placement": "cpu"}, "cpu"),
    ({"dataset.type": "latents", "dataset.params.text_embeddings": "true", "model.text_encoder_placement": "device"},
     "device"),
])
def test_auto_offloads_only_when_the_steps_read_stored_text(tiny_pipeline, shapes_shards, tmp_path, over, want):
    assert text_encoder_placement(load(args(tmp_path, tiny_pipeline, shapes_shards, **over))) == want


@pytest.mark.parametrize("over, key", [
    ({"model.text_encoder.train": "true", "model.text_encoder_placement": "cpu"}, "model.text_encoder.train"),
    ({"model.adapter.type": "lora", "model.adapter.text_encoders.train": "true",
      "model.text_encoder_placement": "offload"}, "model.adapter.text_encoders.train"),
])
def test_a_trained_text_encoder_cannot_be_kept_off_the_device(tiny_pipeline, shapes_shards, tmp_path, over, key):
    with pytest.raises(ConfigError, match=key):
        load(args(tmp_path, tiny_pipeline, shapes_shards, **over))


@pytest.mark.parametrize("over, want", [
    ({}, "device"),
    ({"dataset.type": "latents"}, "offload"),
    ({"dataset.type": "latents", "model.vae.placement": "device"}, "device"),
])
def test_the_vae_is_offloaded_when_the_steps_read_latents(tiny_pipeline, shapes_shards, tmp_path, over, want):
    from sd_training.config.rules import vae_placement

    assert vae_placement(load(args(tmp_path, tiny_pipeline, shapes_shards, **over))) == want


def test_an_offloaded_vae_with_image_batches_is_refused(tiny_pipeline, shapes_shards, tmp_path):
    with pytest.raises(ConfigError, match="model.vae.placement=offload.*every step encodes them"):
        load(args(tmp_path, tiny_pipeline, shapes_shards, **{"model.vae.placement": "offload"}))


def test_a_parked_module_is_brought_in_for_the_block_and_parked_after(monkeypatch):
    """park + brought_in (the VAE's placement): on the device inside the block, whatever it raises, back in host
    memory after; a module not parked is left alone. ``cpu:0`` stands for the device, as above."""
    device, vae, other = torch.device("cpu", 0), torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    placement.park(vae)
    moves = []
    for name, module in (("vae", vae), ("other", other)):
        real = module.to
        monkeypatch.setattr(module, "to", lambda *a, _n=name, _r=real, **k: (moves.append((_n, str(a[0]))), _r(*a, **k))[1])
    with pytest.raises(RuntimeError):
        with placement.brought_in([vae, other], device):
            moves.append(("inside", ""))
            raise RuntimeError("a failing grid")
    assert moves == [("vae", "cpu:0"), ("inside", ""), ("vae", "cpu")]
    assert placement.off_device(vae) and not placement.off_device(other)


def test_an_unknown_placement_is_refused_naming_the_key(tiny_pipeline, shapes_shards, tmp_path):
    with pytest.raises(ConfigError, match="text_encoder_placement"):
        load(args(tmp_path, tiny_pipeline, shapes_shards, **{"model.text_encoder_placement": "gpu"}))


@pytest.fixture(scope="module")
def encoder():
    return llm_text.tiny_qwen3(300).eval()


def ids():
    return torch.randint(0, 300, (2, 7), generator=torch.Generator().manual_seed(0))


def test_cpu_runs_in_host_memory_and_hands_every_output_tensor_to_the_device(encoder):
    """The run's device here is ``meta`` (any device other than the host): the encoder stays on the CPU, and its
    ModelOutput (last state and the tuple of every layer's states) arrives on the run's device."""
    want = encoder(input_ids=ids(), output_hidden_states=True)
    placement.place(encoder, "cpu", torch.device("meta"))
    try:
        out = encoder(input_ids=ids(), output_hidden_states=True)
        assert {p.device.type for p in encoder.parameters()} == {"cpu"}
        assert out.last_hidden_state.device.type == "meta" and out["last_hidden_state"].device.type == "meta"
        assert {h.device.type for h in out.hidden_states} == {"meta"}
        assert len(out.hidden_states) == len(want.hidden_states)
        assert placement.off_device(encoder) and placement.placement_of(encoder) == "cpu"
    finally:
        placement.unplace(encoder)
    assert not placement.off_device(encoder)
    torch.testing.assert_close(encoder(input_ids=ids()).last_hidden_state, want.last_hidden_state)


def test_offload_moves_the_encoder_onto_the_device_for_each_forward_and_back(encoder, monkeypatch):
    """Each call: onto the run's device before the forward (inputs there too), back to the host after; outputs
    equal the encoder's own. ``cpu:0`` stands for the device (the same memory on this machine, a distinct name)."""
    device = torch.device("cpu", 0)
    want = encoder(input_ids=ids()).last_hidden_state
    events = []
    real_to = encoder.to

    def to(*a, **kw):
        events.append(("to", str(a[0] if a else kw.get("device"))))
        return real_to(*a, **kw)

    placement.place(encoder, "offload", device)
    monkeypatch.setattr(encoder, "to", to)
    seen = encoder.register_forward_pre_hook(lambda m, a, kw: events.append(("forward", str(kw["input_ids"].device))),
                                             with_kwargs=True)
    try:
        for _ in range(2):
            torch.testing.assert_close(encoder(input_ids=ids()).last_hidden_state, want)
    finally:
        seen.remove()
        placement.unplace(encoder)
    assert events == [("to", "cpu:0"), ("forward", "cpu"), ("to", "cpu")] * 2, events


def test_placing_again_replaces_the_hooks(encoder):
    placement.place(encoder, "cpu", torch.device("meta"))
    placement.place(encoder, "device", torch.device("cpu"))
    assert not encoder._forward_pre_hooks and not encoder._forward_hooks
    assert placement.placement_of(encoder) == "device"


def test_the_plan_at_config_load_counts_the_text_encoders_that_stay_on_the_device(family_pipeline, shapes_shards,
                                                                                  tmp_path):
    """Z-Image's LLM, counted from its weight files' headers at the training precision, is in the load-time
    plan when it stays on the device, not when the shards store the text (auto: offload); a run that forces it
    onto the device with stored text is advised to offload it when that is what fits."""
    from safetensors.torch import load_file

    from sd_training.memory.fit import ADVICE_FRACTION, advise, load_plan, need_bytes

    pipeline = family_pipeline("zimage")
    n = sum(t.numel() for f in (pipeline / "text_encoder").glob("*.safetensors") for t in load_file(f).values())
    stored = {"dataset.type": "latents", "dataset.params.text_embeddings": "true"}

    def plan(**over):
        cfg = load(args(tmp_path, pipeline, shapes_shards, **{"model.mixed_precision": "bf16", **over}))
        return cfg, load_plan(cfg)

    online, p_online = plan()
    assert p_online.frozen_text == 2 * n and p_online.frozen_what.startswith("text_encoder ")
    offloaded, p_off = plan(**stored)
    assert need_bytes(p_off, offloaded) == pytest.approx(need_bytes(p_online, online) - 2 * n)
    forced, p_forced = plan(**stored, **{"model.text_encoder_placement": "device"})
    need = need_bytes(p_forced, forced)
    assert need == pytest.approx(need_bytes(p_online, online))
    memory = (need - n) / ADVICE_FRACTION  # fits only without the encoder
    assert ["model.text_encoder_placement=offload"] in [a.changes for a in advise(p_forced, forced, memory)]
    assert not any("text_encoder_placement" in c for a in advise(p_online, online, memory) for c in a.changes)
