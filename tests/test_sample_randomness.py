"""The randomness belongs to the sample, not to the rank (issue 13): with a batch's ``sample_seeds``, every
random number of sample i (VAE posterior sample, noise, pyramid levels and ratios, offset, timestep, input
perturbation) comes from generators seeded from its own seed, so its loss is the same whichever batch,
micro-batch or rank it is in, and whatever the global RNG state.

Each test fails when the seeds are ignored: the split batches and the reseeded global RNG would then
give other draws, and each comparison also checks that the same batch drawn from the global RNG is
outside its tolerance. Tolerances: fp32 losses of the same sample in batches of other sizes differ only
by the kernels' summation order (measured on the tiny models: < 2e-7 relative; bound 1e-5); under bf16
autocast a matmul of another batch size may round differently (measured: < 5e-4 relative; bound 2e-3),
while other draws move a per-sample loss by 1-2000% (SD) or 0.07-0.7% (the autoencoder, whose random
decoder barely reacts to the posterior sample; its split losses are bit-identical, fp32 and bf16)."""

import contextlib

import pytest
import torch
from conftest import train_args

from sd_training.configure import load
from sd_training.families import registry as families
from sd_training.families.tiny import SD_SCHEDULER
from sd_training.families.components.vae import encode as encode_images
from sd_training.families.components.ddpm import (
    STREAMS,
    ObjectiveConfig,
    diffusion_loss,
    host_seeds,
    pyramid_noise,
    sample_noise,
    sample_timesteps,
    stream_seed,
)

pytestmark = pytest.mark.usefixtures("one_thread")

SEEDS = torch.tensor([11, 2**62 + 5, 987654321, 3], dtype=torch.int64)  # 63-bit seeds, as the loader's
SPLITS = ([2, 0], [3, 1])  # two micro-batches of 2, in another order than the batch of 4
FP32 = dict(rtol=1e-5, atol=1e-6)
BF16 = dict(rtol=2e-3, atol=1e-5)
ALL_OPTIONS = {
    "objective.prediction_type": "v_prediction", "objective.loss_weighting": "min_snr",
    "objective.noise_offset": 0.1, "objective.pyramid_noise_discount": 0.8, "objective.input_perturbation": 0.1,
    "objective.timestep_sampling": "logit_normal",
}


def ddpm(**over):
    from diffusers import DDPMScheduler

    return DDPMScheduler.from_config({**SD_SCHEDULER, **over})


@pytest.fixture(scope="module")
def make_family(tiny_pipeline, shapes_shards, tmp_path_factory, request):
    """Families built once per set of overrides (building the tiny models is the slow part);
    ``pipeline="sdxl"``: of the tiny SDXL pipeline."""
    built = {}

    def make(pipeline="sd", **overrides):
        key = (pipeline, *sorted(overrides.items()))
        if key not in built:
            src = request.getfixturevalue("sdxl_pipeline") if pipeline == "sdxl" else tiny_pipeline
            args = train_args(tmp_path_factory.mktemp("cfg"), src, shapes_shards,
                              **{k.replace(".", "__"): v for k, v in overrides.items()})
            built[key] = families.create(load(args), torch.device("cpu"), 0, False)
        return built[key]

    return make


def _batch(family, kind: str) -> dict:
    """4 samples: stored latents and token ids, or uint8 pixels (encoded by the VAE in the loss)."""
    g = torch.Generator().manual_seed(0)
    captions = ["a red circle", "a blue square", "", "a green triangle on white"]
    batch = {"sample_seeds": SEEDS.clone()}
    tokenizers = family.tokenizers if isinstance(family.tokenizers, tuple) else (family.tokenizers,)
    for k, tok in enumerate(tokenizers):
        ids = tok(captions, padding="max_length", max_length=77, truncation=True, return_tensors="pt").input_ids
        batch["input_ids" if k == 0 else f"input_ids_{k + 1}"] = ids
    if kind == "latents":
        batch["latents"] = torch.randn(4, 4, 8, 8, generator=g)
    else:
        batch["pixel_values"] = torch.randint(0, 256, (4, 3, 64, 64), generator=g, dtype=torch.uint8)
    return batch


def _rows(batch: dict, rows: list[int]) -> dict:
    return {k: v[rows] for k, v in batch.items()}


@torch.no_grad()
def _per_sample(family, batch: dict, autocast=None, global_seed: int = 0) -> torch.Tensor:
    """The family's per-sample losses of ``batch``, the global RNG seeded with ``global_seed`` first."""
    torch.manual_seed(global_seed)
    out = family.loss(family.loss_module, batch, autocast or contextlib.nullcontext())
    return out.per_sample.float()


def _assert_split_invariant(family, batch: dict, tol: dict, autocast=lambda: None):
    whole = _per_sample(family, batch, autocast(), global_seed=0)
    split = torch.empty_like(whole)
    for k, rows in enumerate(SPLITS):  # another global RNG state for each micro-batch
        split[rows] = _per_sample(family, _rows(batch, rows), autocast(), global_seed=100 + k)
    torch.testing.assert_close(split, whole, **tol)
    # The same batch without its seeds (global RNG) is outside the tolerance: ignored seeds would fail.
    unseeded = _per_sample(family, {k: v for k, v in batch.items() if k != "sample_seeds"}, autocast(), global_seed=0)
    assert not torch.allclose(unseeded, whole, **tol)
    return whole


# ---------------------------------------------------------------------------------------------- families


@pytest.mark.parametrize("options", [{}, ALL_OPTIONS], ids=["defaults", "all_options"])
@pytest.mark.parametrize("kind", ["latents", "pixels"])
def test_sd_per_sample_losses_do_not_depend_on_the_batch_split(make_family, options, kind):
    family = make_family(**options)
    _assert_split_invariant(family, _batch(family, kind), FP32)


@pytest.mark.parametrize("kind", ["latents", "pixels"])
def test_sdxl_per_sample_losses_do_not_depend_on_the_batch_split(make_family, kind):
    family = make_family("sdxl", **ALL_OPTIONS)
    _assert_split_invariant(family, _batch(family, kind), FP32)


def test_sd_per_sample_losses_under_bf16_autocast(make_family):
    family = make_family(**ALL_OPTIONS)
    _assert_split_invariant(family, _batch(family, "pixels"), BF16,
                            autocast=lambda: torch.autocast("cpu", dtype=torch.bfloat16))


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_autoencoder_per_sample_losses_do_not_depend_on_the_batch_split(make_family, bf16):
    family = make_family(**{"model.train_target": "vae"})
    batch = {k: v for k, v in _batch(family, "pixels").items() if not k.startswith("input_ids")}
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if bf16 else (lambda: None)
    _assert_split_invariant(family, batch, BF16 if bf16 else FP32, autocast)


@pytest.mark.parametrize("kind", ["latents", "pixels"])
def test_sd_losses_ignore_the_global_rng_and_leave_it_alone(make_family, kind):
    family = make_family(**ALL_OPTIONS)
    batch = _batch(family, kind)
    a = _per_sample(family, batch, global_seed=1)
    assert torch.equal(torch.get_rng_state(), torch.manual_seed(1).get_state())  # nothing drew from it
    b = _per_sample(family, batch, global_seed=2)
    assert torch.equal(a, b)
    # Without seeds the global RNG decides (the check above is not vacuous).
    unseeded = {k: v for k, v in batch.items() if k != "sample_seeds"}
    assert not torch.equal(_per_sample(family, unseeded, global_seed=1), _per_sample(family, unseeded, global_seed=2))


@pytest.mark.parametrize("kind", ["latents", "pixels"])
def test_sd_other_seeds_give_other_losses(make_family, kind):
    family = make_family()
    batch = _batch(family, kind)
    a = _per_sample(family, batch, global_seed=0)
    b = _per_sample(family, dict(batch, sample_seeds=SEEDS + 1), global_seed=0)
    assert ((a - b).abs() > 1e-3 * a.abs()).all()
    # The same seed for samples with the same data: the same loss in any position.
    twin = {k: v[[0, 0, 1, 1]] for k, v in batch.items()}
    c = _per_sample(family, twin, global_seed=0)
    assert torch.allclose(c[0], c[1], **FP32) and torch.allclose(c[2], c[3], **FP32)
    torch.testing.assert_close(c[[0, 2]], a[:2], **FP32)


# ---------------------------------------------------------------------------------------------- the draws


def test_stream_seeds_are_splitmix64_outputs():
    # SplitMix64 started at 0: its first two outputs (Steele et al.; Vigna's reference splitmix64.c).
    assert stream_seed(0, "noise") == 0xE220A8397B1DCDAF >> 1
    assert stream_seed(0, "timesteps") == 0x6E789E6AA1B965F4 >> 1
    assert len(set(STREAMS.values())) == len(STREAMS)
    seeds = {stream_seed(s, k) for s in range(100) for k in STREAMS}
    assert len(seeds) == 100 * len(STREAMS) and all(0 <= s < 2**63 for s in seeds)
    assert host_seeds(torch.tensor([2**63 - 1, 0])) == [2**63 - 1, 0] and host_seeds((3, 4)) == [3, 4]
    with pytest.raises(ValueError, match="CPU tensor"):
        host_seeds(torch.zeros(2, dtype=torch.int64, device="meta"))


def test_noise_rows_are_their_seeds_alone():
    latents = torch.zeros(4, 4, 16, 16)
    cfg = ObjectiveConfig(pyramid_noise_discount=0.8, noise_offset=0.1)
    torch.manual_seed(0)
    full = sample_noise(latents, cfg, SEEDS)
    torch.manual_seed(1)
    for i in range(4):
        torch.testing.assert_close(sample_noise(latents[:1], cfg, SEEDS[i:i + 1]), full[i:i + 1], **FP32)
    # The plain noise row is a randn of the sample's noise stream.
    g = torch.Generator().manual_seed(stream_seed(int(SEEDS[2]), "noise"))
    assert torch.equal(sample_noise(latents, ObjectiveConfig(), SEEDS)[2:3], torch.randn(1, 4, 16, 16, generator=g))
    # Other seeds, other noise, whatever the global RNG.
    torch.manual_seed(0)
    other = sample_noise(latents, cfg, SEEDS + 1)
    assert ((other - full).abs().amax(dim=(1, 2, 3)) > 0.5).all()
    # Pyramid levels (and their sizes) follow the sample's seed too.
    base = torch.randn(2, 4, 16, 16)
    torch.testing.assert_close(pyramid_noise(base, 0.8, sample_seeds=[5, 6])[1:], pyramid_noise(base[1:], 0.8, sample_seeds=[6]))


def test_an_option_draws_from_its_own_stream():
    latents = torch.zeros(4, 4, 8, 8)
    plain = sample_noise(latents, ObjectiveConfig(), SEEDS)
    offset = sample_noise(latents, ObjectiveConfig(noise_offset=0.1), SEEDS)
    shift = offset - plain  # the offset only: one constant per (sample, channel)
    torch.testing.assert_close(shift, shift[..., :1, :1].expand_as(shift))
    assert shift.abs().min() > 0
    sched = ddpm()
    t = sample_timesteps(sched, 4, torch.device("cpu"), ObjectiveConfig(), SEEDS)
    assert torch.equal(t, sample_timesteps(sched, 4, torch.device("cpu"), ObjectiveConfig(), SEEDS.tolist()))
    assert not torch.equal(t, sample_timesteps(sched, 4, torch.device("cpu"), ObjectiveConfig(), SEEDS + 1))

    class Unet(torch.nn.Module):
        def forward(self, x, t, h, return_dict=False):
            return (x,)

    hidden = torch.zeros(4, 7, 16)
    _, _, t_plain = diffusion_loss(Unet(), sched, latents, hidden, ObjectiveConfig(), sample_seeds=SEEDS)
    on = ObjectiveConfig(noise_offset=0.1, pyramid_noise_discount=0.5, input_perturbation=0.1)
    _, _, t_on = diffusion_loss(Unet(), sched, latents, hidden, on, sample_seeds=SEEDS)
    assert torch.equal(t_plain, t) and torch.equal(t_on, t)


def test_given_noise_and_timesteps_take_precedence_over_the_seeds():
    sched = ddpm()
    latents, hidden = torch.randn(4, 4, 8, 8), torch.zeros(4, 7, 16)
    noise, t = torch.randn(4, 4, 8, 8), torch.tensor([0, 10, 500, 999])

    class Unet(torch.nn.Module):
        def forward(self, x, t, h, return_dict=False):
            return (x * 0.5,)

    cfg = ObjectiveConfig(input_perturbation=0.1, noise_offset=0.1)
    a = diffusion_loss(Unet(), sched, latents, hidden, cfg, noise=noise, timesteps=t)
    b = diffusion_loss(Unet(), sched, latents, hidden, cfg, noise=noise, timesteps=t, sample_seeds=SEEDS)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_posterior_sample_is_the_samples_own(make_family):
    vae = make_family().models.vae
    pixels = torch.rand(4, 3, 32, 32, generator=torch.Generator().manual_seed(0)) * 2 - 1
    torch.manual_seed(0)
    full = encode_images(vae, pixels, 0.5, sample_seeds=SEEDS)
    torch.manual_seed(1)
    half = encode_images(vae, pixels[[3, 1]], 0.5, sample_seeds=SEEDS[[3, 1]])
    torch.testing.assert_close(half, full[[3, 1]], **FP32)
    with torch.no_grad():
        dist = vae.encode(pixels).latent_dist
    g = torch.Generator().manual_seed(stream_seed(int(SEEDS[1]), "posterior"))
    eps = torch.randn(1, *dist.mean.shape[1:], generator=g)
    torch.testing.assert_close(full[1:2], (dist.mean[1:2] + dist.std[1:2] * eps) * 0.5, **FP32)
    assert not torch.allclose(encode_images(vae, pixels, 0.5, sample_seeds=SEEDS + 1), full)
