"""Text encoders: CLIP folders, open_clip towers converted to CLIPTextModel, clip skip, max length, training."""

import json

import pytest
import torch

from sd_training.config import ConfigError
from sd_training.families.components.clip import encode_text
from sd_training.families.components.clip import (
    CLIP_SKIP_KEY,
    TextEncoderConfig,
    build_text_encoder,
    clip_text_model_from_open_clip,
    open_clip_tokenizer,
    text_encoder_for_pipeline,
    text_encoder_param_groups,
    validate_text_encoder_config,
)

CPU = torch.device("cpu")
CAPTIONS = ["a photo of a cat", "", "A Painting, of a LIGHTHOUSE at sunset!!", "word " * 100]

# A tiny open_clip CLIP: real vocabulary and context, 3 text layers of width 64 (the tiny UNet's
# cross_attention_dim), a token vision tower.
TINY_OPEN_CLIP = {
    "embed_dim": 32,
    "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "head_width": 16, "patch_size": 16},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 64, "heads": 4, "layers": 3},
}
# name -> (quick_gelu, custom_text: text tower under model.text, checkpoint suffix)
VARIANTS = {
    "sdt-tiny-text": (False, False, ".bin"),
    "sdt-tiny-text-quickgelu-custom": (True, True, ".safetensors"),
}


@pytest.fixture(scope="module")
def open_clip_checkpoints(tmp_path_factory):
    """name -> (the random open_clip model, the path of its full state dict)."""
    import open_clip

    root = tmp_path_factory.mktemp("open_clip")
    out = {}
    for i, (name, (quick_gelu, custom_text, suffix)) in enumerate(VARIANTS.items()):
        cfg = dict(TINY_OPEN_CLIP, quick_gelu=quick_gelu, custom_text=custom_text)
        (root / f"{name}.json").write_text(json.dumps(cfg))
        open_clip.add_model_config(root / f"{name}.json")
        torch.manual_seed(i)
        model = open_clip.create_model(name).eval()
        # open_clip inits LayerNorms to (1, 0) and biases to 0: randomise them so the mapping is tested.
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n.endswith("bias") or "ln" in n:
                    p.add_(0.1 * torch.randn_like(p))
        path = root / f"{name}{suffix}"
        if suffix == ".safetensors":
            from safetensors.torch import save_file

            save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
        else:
            torch.save(model.state_dict(), path)
        out[name] = (model, path)
    return out


def _open_clip_hidden(model, ids, drop_last: int = 0):
    """open_clip's own text path (encode_text without pooling): embed + pos -> resblocks -> ln_final."""
    t = model.text if hasattr(model, "text") else model
    x = t.token_embedding(ids) + t.positional_embedding
    blocks = list(t.transformer.resblocks)
    for blk in blocks[: len(blocks) - drop_last]:
        x = blk(x, attn_mask=t.attn_mask)
    return t.ln_final(x)


def _ids(tokenizer, captions=CAPTIONS):
    return tokenizer(captions, padding="max_length", truncation=True, max_length=tokenizer.model_max_length, return_tensors="pt").input_ids


def test_open_clip_tokenizer_ids_equal_open_clip():
    import open_clip

    tok = open_clip_tokenizer()
    assert torch.equal(_ids(tok), open_clip.tokenize(CAPTIONS))
    assert tok.pad_token_id == 0 and tok.model_max_length == 77


@pytest.mark.parametrize("name", list(VARIANTS))
def test_open_clip_conversion_matches_open_clip_hidden_states(open_clip_checkpoints, name):
    import open_clip

    model, path = open_clip_checkpoints[name]
    cfg = TextEncoderConfig(type="open_clip", open_clip_model=name, open_clip_weights=str(path))
    te, tok = build_text_encoder(cfg, None, CPU)
    ids = open_clip.tokenize(CAPTIONS)
    assert torch.equal(_ids(tok), ids)
    assert te.config.hidden_act == ("quick_gelu" if VARIANTS[name][0] else "gelu")
    assert not te.training and not any(p.requires_grad for p in te.parameters())
    with torch.no_grad():
        ours = encode_text(te, ids)
        theirs = _open_clip_hidden(model, ids)
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
        # The public API too: pooling our per-token states the open_clip way gives encode_text.
        t = model.text if hasattr(model, "text") else model
        pooled = ours[torch.arange(len(ids)), ids.argmax(dim=-1)] @ t.text_projection
        torch.testing.assert_close(pooled, model.encode_text(ids), atol=1e-5, rtol=1e-5)


def test_open_clip_clip_skip_is_the_penultimate_layer(open_clip_checkpoints):
    import open_clip

    name = "sdt-tiny-text"
    model, path = open_clip_checkpoints[name]
    cfg = TextEncoderConfig(type="open_clip", open_clip_model=name, open_clip_weights=str(path), clip_skip=2)
    te, _ = build_text_encoder(cfg, None, CPU)
    assert te.config.num_hidden_layers == 2 and getattr(te.config, CLIP_SKIP_KEY) == 2
    ids = open_clip.tokenize(CAPTIONS)
    with torch.no_grad():
        torch.testing.assert_close(encode_text(te, ids), _open_clip_hidden(model, ids, drop_last=1), atol=1e-5, rtol=1e-5)


def test_open_clip_encoder_exports_as_a_standard_pipeline(open_clip_checkpoints, tiny_pipeline, tmp_path):
    from diffusers import StableDiffusionPipeline

    name = "sdt-tiny-text"
    _, path = open_clip_checkpoints[name]
    te, tok = build_text_encoder(
        TextEncoderConfig(type="open_clip", open_clip_model=name, open_clip_weights=str(path), clip_skip=2, max_length=32), None, CPU
    )
    base = StableDiffusionPipeline.from_pretrained(tiny_pipeline)
    pipe = StableDiffusionPipeline(
        vae=base.vae, text_encoder=te, tokenizer=tok, unet=base.unet, scheduler=base.scheduler,
        safety_checker=None, feature_extractor=None, requires_safety_checker=False,
    )
    pipe.save_pretrained(tmp_path / "export")
    loaded = StableDiffusionPipeline.from_pretrained(tmp_path / "export")
    assert loaded.tokenizer.model_max_length == 32 and loaded.tokenizer.pad_token_id == 0
    assert loaded.text_encoder.config.num_hidden_layers == 2
    with torch.no_grad():
        embeds, _ = loaded.encode_prompt(CAPTIONS[0], "cpu", 1, False)
        ids = _ids(tok, CAPTIONS[:1])
        assert ids.shape[1] == 32
        torch.testing.assert_close(embeds, encode_text(te, ids), atol=1e-6, rtol=1e-6)
    # Building again from the export with the same clip_skip removes nothing more.
    again, _ = build_text_encoder(TextEncoderConfig(pretrained=str(tmp_path / "export"), clip_skip=2), None, CPU)
    assert again.config.num_hidden_layers == 2


def test_baked_clip_skip_cannot_be_undone(open_clip_checkpoints, tiny_pipeline, tmp_path):
    name = "sdt-tiny-text"
    _, path = open_clip_checkpoints[name]
    te, _ = build_text_encoder(
        TextEncoderConfig(type="open_clip", open_clip_model=name, open_clip_weights=str(path), clip_skip=3), None, CPU
    )
    assert te.config.num_hidden_layers == 1
    te.save_pretrained(tmp_path / "skip3")
    tok = str(tiny_pipeline)
    with pytest.raises(ConfigError, match="saved with clip_skip 3"):
        build_text_encoder(TextEncoderConfig(pretrained=str(tmp_path / "skip3"), clip_skip=2), None, CPU, tokenizer_src=tok)
    with pytest.raises(ConfigError, match="leaves no layer"):
        build_text_encoder(TextEncoderConfig(pretrained=str(tmp_path / "skip3"), clip_skip=4), None, CPU, tokenizer_src=tok)
    # 0 (or 1) uses it as saved.
    as_is, _ = build_text_encoder(TextEncoderConfig(pretrained=str(tmp_path / "skip3")), None, CPU, tokenizer_src=tok)
    assert as_is.config.num_hidden_layers == 1


def test_unconvertible_open_clip_tower_is_refused():
    from open_clip.model import _build_text_tower

    tower = _build_text_tower(32, dict(TINY_OPEN_CLIP["text_cfg"], ls_init_value=1e-5))
    with pytest.raises(ConfigError, match="LayerScale"):
        clip_text_model_from_open_clip(tower)
    tower = _build_text_tower(32, dict(TINY_OPEN_CLIP["text_cfg"], no_causal_mask=True))
    with pytest.raises(ConfigError, match="causal"):
        clip_text_model_from_open_clip(tower)


def test_open_clip_weights_that_do_not_fit_are_explained(open_clip_checkpoints, tmp_path):
    torch.save({"token_embedding.weight": torch.zeros(10, 64)}, tmp_path / "bad.pt")
    cfg = TextEncoderConfig(type="open_clip", open_clip_model="sdt-tiny-text", open_clip_weights=str(tmp_path / "bad.pt"))
    with pytest.raises(ConfigError, match="does not fit open_clip architecture"):
        build_text_encoder(cfg, None, CPU)
    cfg = TextEncoderConfig(type="open_clip", open_clip_model="ViT-H-14-typo", open_clip_weights=str(tmp_path / "bad.pt"))
    with pytest.raises(ConfigError, match="did you mean"):
        build_text_encoder(cfg, None, CPU)


# ---------------------------------------------------------------------------------------------- type clip


def test_clip_folder_frozen_by_default(tiny_pipeline):
    from transformers import CLIPTextModel

    te, tok = build_text_encoder(TextEncoderConfig(), str(tiny_pipeline), CPU)
    ref = CLIPTextModel.from_pretrained(tiny_pipeline, subfolder="text_encoder")
    assert not te.training and not any(p.requires_grad for p in te.parameters())
    assert tok.model_max_length == 77 and tok.pad_token_id == 49407  # the pipeline's own tokenizer
    ids = _ids(tok)
    with torch.no_grad():
        assert torch.equal(encode_text(te, ids), ref(ids, return_dict=False)[0])


def test_clip_skip_matches_the_runtime_and_diffusers_conventions(tiny_pipeline):
    """Ours N == hidden_states[-N] + final LN == diffusers' clip_skip N-1 (hidden_states[-(N-1+1)])."""
    from transformers import CLIPTextModel

    te, tok = build_text_encoder(TextEncoderConfig(clip_skip=2), str(tiny_pipeline), CPU)
    full = CLIPTextModel.from_pretrained(tiny_pipeline, subfolder="text_encoder").eval()
    assert te.config.num_hidden_layers == full.config.num_hidden_layers - 1
    ids = _ids(tok)
    with torch.no_grad():
        baked = encode_text(te, ids)
        runtime = encode_text(full, ids, clip_skip=2)
        diffusers_clip_skip = 1
        states = full(ids, output_hidden_states=True).hidden_states
        theirs = full.final_layer_norm(states[-(diffusers_clip_skip + 1)])
        last = encode_text(full, ids, clip_skip=1)
    torch.testing.assert_close(baked, runtime, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(baked, theirs, atol=1e-6, rtol=1e-6)
    assert not torch.allclose(baked, last)
    assert torch.equal(last, encode_text(full, ids, clip_skip=0))


def test_max_length_sets_the_tokenizer(tiny_pipeline):
    te, tok = build_text_encoder(TextEncoderConfig(max_length=16), str(tiny_pipeline), CPU)
    assert tok.model_max_length == 16 and _ids(tok).shape == (len(CAPTIONS), 16)
    with pytest.raises(ConfigError, match="position embeddings"):
        build_text_encoder(TextEncoderConfig(max_length=100), str(tiny_pipeline), CPU)


def test_frozen_half_precision_storage_gives_fp32_hidden_states(tiny_pipeline):
    te32, tok = build_text_encoder(TextEncoderConfig(dtype="fp32"), str(tiny_pipeline), CPU)
    te16, _ = build_text_encoder(TextEncoderConfig(dtype="bf16"), str(tiny_pipeline), CPU)
    assert all(p.dtype == torch.bfloat16 for p in te16.parameters())
    ids = _ids(tok)
    with torch.no_grad():
        h = encode_text(te16, ids)
    assert h.dtype == torch.float32
    torch.testing.assert_close(h, encode_text(te32, ids), atol=0.1, rtol=0.05)
    # Pipelines get an fp32 copy; an fp32 encoder is handed over as is.
    copy = text_encoder_for_pipeline(te16)
    assert copy is not te16 and all(p.dtype == torch.float32 for p in copy.parameters())
    assert text_encoder_for_pipeline(te32) is te32


@pytest.mark.parametrize("mixed_precision, want", [("bf16", torch.bfloat16), ("fp16", torch.float16), ("no", torch.float32)])
def test_frozen_text_encoder_runs_in_the_training_precision_by_default(tiny_pipeline, mixed_precision, want):
    """dtype auto (the default): the frozen encoder is stored in the run's compute dtype; a trained one keeps
    fp32 master weights; an explicit dtype wins."""
    assert TextEncoderConfig().dtype == "auto"
    te, _ = build_text_encoder(TextEncoderConfig(), str(tiny_pipeline), CPU, mixed_precision=mixed_precision)
    assert {p.dtype for p in te.parameters()} == {want}
    trained, _ = build_text_encoder(TextEncoderConfig(train=True), str(tiny_pipeline), CPU, mixed_precision=mixed_precision)
    assert {p.dtype for p in trained.parameters()} == {torch.float32}
    pinned, _ = build_text_encoder(TextEncoderConfig(dtype="fp32"), str(tiny_pipeline), CPU, mixed_precision=mixed_precision)
    assert {p.dtype for p in pinned.parameters()} == {torch.float32}


def test_trained_text_encoder_gets_gradients_and_its_own_lr(tiny_pipeline):
    cfg = TextEncoderConfig(train=True, learning_rate=1e-5)
    te, tok = build_text_encoder(cfg, str(tiny_pipeline), CPU, gradient_checkpointing=True)
    checkpointing = getattr(te, "is_activation_checkpointing", None)
    assert te.training and all(p.requires_grad for p in te.parameters())
    assert checkpointing if checkpointing is not None else te.is_gradient_checkpointing
    encode_text(te, _ids(tok)).square().mean().backward()
    assert all(p.grad is not None for p in te.parameters())
    groups = text_encoder_param_groups(te, cfg, base_lr=1e-4, weight_decay=0.01)
    assert {g["lr"] for g in groups} == {1e-5} and {g["name"] for g in groups} == {"text_encoder"}
    assert sum(len(g["params"]) for g in groups) == len(list(te.parameters()))
    assert {g["weight_decay"] for g in groups} == {0.01, 0.0}  # norms and biases undecayed, as for the UNet
    assert {g["lr"] for g in text_encoder_param_groups(te, cfg, 1e-4, 0.0, lr_scale=2.0)} == {2e-5}
    assert {g["lr"] for g in text_encoder_param_groups(te, TextEncoderConfig(train=True), 1e-4, 0.0)} == {1e-4}
    assert text_encoder_param_groups(te, TextEncoderConfig(), 1e-4, 0.0) == []
    # Both groups follow one LambdaLR schedule, each from its own peak.
    unet_param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([{"params": [unet_param]}, *groups], lr=1e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([5e-5] + [5e-6] * len(groups))
    del sched


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(type="openclip"), "did you mean 'open_clip'"),
        (dict(type="open_clip"), "open_clip_model"),
        (dict(type="open_clip", open_clip_model="ViT-H-14", open_clip_weights="/nonexistent.bin"), "is not a file"),
        (dict(open_clip_model="ViT-H-14"), "only applies to"),
        (dict(learning_rate=1e-5), "'model.text_encoder.train' is False"),
        (dict(train=True, dtype="bf16"), "dtype=fp32"),
        (dict(dtype="fp8"), "expected one of"),
        (dict(clip_skip=-1), ">= 0"),
        (dict(max_length=1), ">= 2"),
    ],
)
def test_invalid_settings_name_the_key(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        validate_text_encoder_config(TextEncoderConfig(**kwargs))
