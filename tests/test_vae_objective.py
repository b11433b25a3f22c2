"""The autoencoder stage: loss pieces against hand computation, the perceptual loss from local weights,
the measured scaling factor and its export, and the fp16 policy shown by an overflow, not assumed."""

import json
import math

import pytest
import torch

from sd_training.families.autoencoder_loss import (
    FP16_MAX,
    VAEObjectiveConfig,
    VAEPrecisionError,
    VGGPerceptual,
    build_perceptual,
    check_vae_precision,
    export_vae,
    kl_divergence,
    latent_statistics,
    measure_scaling_factor,
    vae_loss,
    validate_vae_objective_config,
)

RES = 32  # 4x4 latents with the 8x-downsampling tiny VAE: fast, and every block still runs


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def vae():
    from diffusers import AutoencoderKL

    from sd_training.families.tiny import TINY_VAE

    torch.manual_seed(0)
    return AutoencoderKL(**TINY_VAE).eval()


def pixels(n=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, 3, RES, RES, generator=g) * 2 - 1


@pytest.fixture(scope="module")
def vgg_weights(tmp_path_factory):
    """A random-weight torchvision VGG16 state_dict file (its ``features.*`` part: 59 MB, not 528)."""
    import torchvision

    torch.manual_seed(0)
    features = torchvision.models.vgg16(weights=None).features
    path = tmp_path_factory.mktemp("vgg") / "vgg16.pth"
    torch.save({f"features.{k}": v for k, v in features.state_dict().items()}, path)
    return path


def test_kl_by_hand():
    # KL(N(m, s^2) || N(0, 1)) = 0.5 (m^2 + s^2 - 1 - log s^2), summed over the latent.
    assert kl_divergence(torch.zeros(1, 1, 1, 1), torch.zeros(1, 1, 1, 1)).item() == 0.0
    assert kl_divergence(torch.ones(1, 1, 1, 1), torch.zeros(1, 1, 1, 1)).item() == pytest.approx(0.5)
    logvar = torch.full((1, 2, 1, 1), math.log(4.0))
    assert kl_divergence(torch.zeros(1, 2, 1, 1), logvar).item() == pytest.approx(2 * 0.5 * (4 - 1 - math.log(4)))


@pytest.mark.parametrize("reconstruction", ["l1", "l2"])
def test_vae_loss_pieces_equal_a_hand_computation(vae, reconstruction):
    x = pixels()
    cfg = VAEObjectiveConfig(reconstruction=reconstruction, kl_weight=1e-2)
    with torch.no_grad():
        loss, per_sample, logs = vae_loss(vae, x, cfg, generator=torch.Generator().manual_seed(7))
        # By hand: the posterior sample with the same generator, decoded, compared.
        post = vae.encode(x).latent_dist
        eps = torch.randn(post.mean.shape, generator=torch.Generator().manual_seed(7))
        rec = vae.decode(post.mean + post.std * eps).sample
    err = (rec - x).abs() if reconstruction == "l1" else (rec - x) ** 2
    rec_term = err.mean(dim=(1, 2, 3))
    kl = 0.5 * (post.mean**2 + post.logvar.exp() - 1 - post.logvar).sum(dim=(1, 2, 3))
    torch.testing.assert_close(kl, post.kl())  # the same KL as diffusers' posterior
    expected = rec_term + 1e-2 * kl / (3 * RES * RES)  # LDM's per-image sum, divided by the pixel values
    torch.testing.assert_close(per_sample, expected)
    torch.testing.assert_close(loss, expected.mean())
    torch.testing.assert_close(logs["rec"], rec_term.mean())
    torch.testing.assert_close(logs["kl"], kl.mean())
    assert logs["perceptual"].item() == 0.0 and logs["loss"].item() == pytest.approx(loss.item())
    assert all(v.ndim == 0 and not v.requires_grad for v in logs.values())  # detached, no device sync


def test_the_posterior_is_sampled_and_gradients_reach_encoder_and_decoder(vae):
    x = pixels()
    cfg = VAEObjectiveConfig()
    a, _, _ = vae_loss(vae, x, cfg, generator=torch.Generator().manual_seed(1))
    b, _, _ = vae_loss(vae, x, cfg, generator=torch.Generator().manual_seed(2))
    assert a.item() != b.item()  # a sample, not the mean (LDM)
    vae.zero_grad()
    a.backward()
    for name in ("encoder.conv_in.weight", "quant_conv.weight", "decoder.conv_out.weight"):
        grad = dict(vae.named_parameters())[name].grad
        assert grad is not None and grad.abs().sum() > 0, name
    vae.zero_grad()


def test_perceptual_loss_from_a_local_vgg16_state_dict(vae, vgg_weights):
    net = build_perceptual(vgg_weights)
    x = pixels()
    assert isinstance(net, VGGPerceptual) and not any(p.requires_grad for p in net.parameters())
    torch.testing.assert_close(net(x, x), torch.zeros(2))  # a distance: zero for identical images
    assert (net(x, pixels(seed=1)) > 0).all()

    base = VAEObjectiveConfig(kl_weight=1e-6)
    with_p = VAEObjectiveConfig(kl_weight=1e-6, perceptual_weight=0.5, perceptual_weights=str(vgg_weights))
    validate_vae_objective_config(with_p)
    l0, s0, _ = vae_loss(vae, x, base, generator=torch.Generator().manual_seed(3))
    vae.zero_grad()
    l1, s1, logs = vae_loss(vae, x, with_p, generator=torch.Generator().manual_seed(3))
    assert logs["perceptual"] > 0
    with torch.no_grad():
        rec = vae.decode(vae.encode(x).latent_dist.sample(torch.Generator().manual_seed(3))).sample
    torch.testing.assert_close(s1 - s0, 0.5 * net(x, rec), rtol=1e-4, atol=1e-6)
    # Differentiable: the perceptual term alone sends gradients into the decoder.
    (l1 - l0).backward()  # the rec and KL gradients cancel: what is left is the perceptual term's
    p_only = dict(vae.named_parameters())["decoder.conv_out.weight"].grad.clone()
    vae.zero_grad()
    (0.5 * net(x, vae.decode(vae.encode(x).latent_dist.sample(torch.Generator().manual_seed(3))).sample).mean()).backward()
    torch.testing.assert_close(dict(vae.named_parameters())["decoder.conv_out.weight"].grad, p_only, rtol=1e-3, atol=1e-7)
    vae.zero_grad()
    # The same weights given without the 'features.' prefix (a vgg16().features state_dict).
    plain = vgg_weights.with_name("features_only.pth")
    torch.save({k[len("features."):]: v for k, v in torch.load(vgg_weights).items()}, plain)
    torch.testing.assert_close(build_perceptual(plain)(x, rec), net(x, rec))


def test_perceptual_settings_fail_clearly(tmp_path):
    from sd_training.config import ConfigError

    with pytest.raises(FileNotFoundError, match="do not exist.*perceptual_weight=0"):
        build_perceptual(tmp_path / "nope.pth")
    with pytest.raises(ConfigError, match="perceptual_weights' is not set"):
        validate_vae_objective_config(VAEObjectiveConfig(perceptual_weight=1.0))
    with pytest.raises(ConfigError, match="does not exist"):
        validate_vae_objective_config(VAEObjectiveConfig(perceptual_weight=1.0, perceptual_weights=str(tmp_path / "x.pth")))
    with pytest.raises(ConfigError, match="perceptual_weight' is 0"):
        validate_vae_objective_config(VAEObjectiveConfig(perceptual_weights=str(tmp_path / "x.pth")))
    with pytest.raises(ConfigError, match="reconstruction"):
        validate_vae_objective_config(VAEObjectiveConfig(reconstruction="l3"))
    torch.save({"features.0.weight": torch.zeros(1)}, tmp_path / "bad.pth")
    with pytest.raises(ValueError, match="not a torchvision VGG16 state_dict"):
        build_perceptual(tmp_path / "bad.pth")


def test_measure_scaling_factor_is_one_over_the_std_of_posterior_samples(vae):
    batches = [pixels(4, seed=s) for s in range(3)]
    scale = measure_scaling_factor(vae, batches, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        z = torch.cat([vae.encode(b).latent_dist.sample(generator=g) for b in batches])
    assert scale == pytest.approx(1.0 / z.std().item(), rel=1e-5)
    assert (z * scale).std().item() == pytest.approx(1.0, rel=1e-5)  # unit variance after scaling
    stats = latent_statistics(vae, [{"pixel_values": b} for b in batches], generator=torch.Generator().manual_seed(0))
    assert stats["num_images"] == 12 and stats["num_elements"] == z.numel()
    assert stats["std"] == pytest.approx(1.0 / scale, rel=1e-6)


def _stats_on_rank(rank, vae, batches, port, out):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        stats = latent_statistics(vae, batches[rank], torch.Generator().manual_seed(rank), all_ranks=True)
        (out / f"{rank}.json").write_text(json.dumps(stats))
    finally:
        dist.destroy_process_group()


def test_latent_statistics_sum_over_ranks_when_asked(vae, tmp_path):
    import socket

    import torch.multiprocessing as mp

    batches = [[pixels(2, seed=0)], [pixels(2, seed=1), pixels(2, seed=2)]]  # ranks may hold different counts
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.start_processes(_stats_on_rank, args=(vae, batches, port, tmp_path), nprocs=2, start_method="fork")
    results = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]
    with torch.no_grad():
        z = torch.cat([vae.encode(b).latent_dist.sample(generator=g) for r, g in
                       ((0, torch.Generator().manual_seed(0)), (1, torch.Generator().manual_seed(1))) for b in batches[r]])
    for res in results:  # every rank gets the statistics of all ranks' samples
        assert res["num_images"] == 6 and res["num_elements"] == z.numel()
        assert res["std"] == pytest.approx(z.std().item(), rel=1e-5)


def test_export_vae_into_a_loadable_pipeline(vae, tiny_pipeline, tmp_path):
    from diffusers import AutoencoderKL, StableDiffusionPipeline

    stats = latent_statistics(vae, [pixels(4)], generator=torch.Generator().manual_seed(0))
    before = vae.config.scaling_factor
    folder = export_vae(vae, tmp_path / "pipe", 1.0 / stats["std"], base_pipeline=tiny_pipeline, statistics=stats)
    assert vae.config.scaling_factor == before  # the trained module's config is left alone
    loaded = AutoencoderKL.from_pretrained(folder)
    assert loaded.config.scaling_factor == pytest.approx(1.0 / stats["std"])
    for k, v in vae.state_dict().items():
        assert torch.equal(v, loaded.state_dict()[k]), k
    record = json.loads((folder / "latent_statistics.json").read_text())
    assert record["num_images"] == 4 and record["scaling_factor"] == pytest.approx(1.0 / stats["std"])
    pipe = StableDiffusionPipeline.from_pretrained(tmp_path / "pipe")
    assert pipe.vae.config.scaling_factor == pytest.approx(1.0 / stats["std"])
    assert not (tmp_path / "pipe" / "vae.tmp").exists()


# ---------------------------------------------------------------- precision policy


def test_check_vae_precision_refuses_fp16_only():
    for ok in ("no", "fp32", "bf16"):
        check_vae_precision(ok)
    with pytest.raises(VAEPrecisionError, match="fp16 is refused.*bf16") as err:
        check_vae_precision("fp16")
    assert isinstance(err.value, ValueError)
    with pytest.raises(VAEPrecisionError):
        check_vae_precision("fp8")


def test_vae_loss_refuses_fp16_at_run_time(vae):
    import copy

    with pytest.raises(VAEPrecisionError, match="fp16 autocast"):
        with torch.autocast("cpu", dtype=torch.float16):
            vae_loss(vae, pixels(1), VAEObjectiveConfig())
    with pytest.raises(VAEPrecisionError, match="weights are fp16"):
        vae_loss(copy.deepcopy(vae).half(), pixels(1).half(), VAEObjectiveConfig())


def test_bf16_autocast_training_loss_is_finite(vae):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, _, logs = vae_loss(vae, pixels(1), VAEObjectiveConfig(), generator=torch.Generator().manual_seed(0))
    assert loss.dtype == torch.float32 and torch.isfinite(loss) and all(torch.isfinite(v) for v in logs.values())


def test_decoder_activations_past_fp16_max_overflow_in_fp16_but_not_in_fp32_or_bf16(vae):
    """The evidence for the policy: the decoder's residual stream is not normalised, so large latents (a
    trained decoder's large activations) carry activations past 65504; fp16 turns them into inf and
    GroupNorm into NaN, while fp32 and bf16 (fp32's exponent range) stay finite."""
    import copy

    with torch.no_grad():
        z = vae.encode(pixels()).latent_dist.mean
        # The decoder's first convolution is linear in z: scale z so its output peaks at 4 x fp16's max.
        z_big = z * (4 * FP16_MAX / (vae.decoder.conv_in(z) - vae.decoder.conv_in.bias.view(1, -1, 1, 1)).abs().max())
    peak = {}

    def record(module, args, out):
        peak["max"] = max(peak.get("max", 0.0), out.detach().abs().max().item())

    hooks = [m.register_forward_hook(record) for m in vae.decoder.modules() if isinstance(m, torch.nn.Conv2d)]
    try:
        with torch.no_grad():
            out32 = vae.decode(z_big).sample
    finally:
        for h in hooks:
            h.remove()
    assert peak["max"] > FP16_MAX  # in fp32: values fp16 cannot hold
    assert torch.isfinite(out32).all()
    with torch.no_grad():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out_bf16 = vae.decode(z_big).sample
        with torch.autocast("cpu", dtype=torch.float16):
            out_fp16_autocast = vae.decode(z_big).sample
        out_fp16 = copy.deepcopy(vae).half().decode(z_big.half()).sample
    assert torch.isfinite(out_bf16).all()
    assert not torch.isfinite(out_fp16_autocast).all()
    assert not torch.isfinite(out_fp16).all()
