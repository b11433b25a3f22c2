"""open_clip text towers converted to transformers' ``CLIPTextModel`` (``model.text_encoder.type=open_clip``):
only the text tower is built and its weights are copied into an equivalent ``CLIPTextModel`` (see
``clip.py``'s notes), so training and exported pipelines see a standard diffusers text encoder."""

from __future__ import annotations

import difflib

import torch

from ...config import ConfigError


def _error(message: str) -> ValueError:
    return ConfigError(message)


# ----------------------------------------------------------------------------------------------
# open_clip -> CLIPTextModel
# ----------------------------------------------------------------------------------------------

_TEXT_KEYS = ("token_embedding.", "positional_embedding", "transformer.", "ln_final.", "text_projection", "cls_emb")


def _text_state_dict(state_dict: dict) -> dict:
    """The text tower's entries of a full open_clip checkpoint: under ``text.`` (CustomTextCLIP) or top level (CLIP)."""
    if any(k.startswith("text.") for k in state_dict):
        return {k[len("text."):]: v for k, v in state_dict.items() if k.startswith("text.")}
    return {k: v for k, v in state_dict.items() if k.startswith(_TEXT_KEYS)}


def load_open_clip_text_tower(name: str, weights: str) -> torch.nn.Module:
    """open_clip's text tower of architecture ``name`` with the text weights of checkpoint ``weights``."""
    try:
        import open_clip
        from open_clip.factory import load_state_dict
        from open_clip.model import _build_text_tower
    except ImportError as e:
        raise _error(f"model.text_encoder.type=open_clip needs open_clip_torch (pip install open_clip_torch): {e}") from None
    model_cfg = open_clip.get_model_config(name)
    if model_cfg is None:
        close = difflib.get_close_matches(name, open_clip.list_models(), n=3)
        raise _error(
            f"'model.text_encoder.open_clip_model': open_clip has no architecture '{name}'"
            + (f"; did you mean {', '.join(close)}?" if close else " (open_clip.list_models() lists them)")
        )
    text_cfg = model_cfg.get("text_cfg", {})
    if text_cfg.get("hf_model_name"):
        raise _error(
            f"'model.text_encoder.open_clip_model' {name} has a Hugging Face text tower ({text_cfg['hf_model_name']}), "
            "not a CLIP text transformer; it cannot become a CLIPTextModel"
        )
    tower = _build_text_tower(model_cfg["embed_dim"], text_cfg, quick_gelu=model_cfg.get("quick_gelu", False))
    try:
        state_dict = _text_state_dict(load_state_dict(weights))
    except Exception as e:  # a truncated file, a pickle that weights_only refuses ...
        raise _error(f"cannot read 'model.text_encoder.open_clip_weights' {weights}: {e}") from None
    misfit = f"'model.text_encoder.open_clip_weights' {weights} does not fit open_clip architecture '{name}'"
    try:
        result = tower.load_state_dict(state_dict, strict=False)
    except RuntimeError as e:  # shape mismatches
        raise _error(f"{misfit}: {str(e).splitlines()[-1].strip()}") from None
    # The projection to the joint image-text space is not part of what SD conditions on.
    missing = [k for k in result.missing_keys if not k.startswith("text_projection")]
    if missing or result.unexpected_keys:
        raise _error(f"{misfit}: missing {missing[:5]}{'...' if len(missing) > 5 else ''}, unexpected {result.unexpected_keys[:5]}")
    return tower.eval()


def _activation(act: torch.nn.Module) -> str | None:
    from open_clip.transformer import QuickGELU

    if isinstance(act, QuickGELU):
        return "quick_gelu"
    if type(act) is torch.nn.GELU:
        return {"none": "gelu", "tanh": "gelu_pytorch_tanh"}.get(act.approximate)
    return None


def clip_text_model_from_open_clip(model: torch.nn.Module):
    """An equivalent transformers ``CLIPTextModel`` (fp32, eval) of an open_clip text tower or CLIP model.

    Equivalent means: for the same token ids, its hidden states after every layer and its
    ``last_hidden_state`` equal open_clip's token embedding + positional embedding -> resblocks (causal
    mask) -> ``ln_final``. Towers that a ``CLIPTextModel`` cannot express are refused with the reason.
    """
    from open_clip.transformer import ResidualAttentionBlock
    from transformers import CLIPTextConfig, CLIPTextModel

    t = model.text if hasattr(model, "text") else model  # CustomTextCLIP keeps the tower in .text
    if not hasattr(t, "token_embedding") or not hasattr(t, "transformer"):
        raise _error(f"{type(t).__name__} is not an open_clip text transformer; it cannot become a CLIPTextModel")
    blocks = list(t.transformer.resblocks)
    width = t.token_embedding.weight.shape[1]
    n_pos = t.positional_embedding.shape[0]
    problems = []
    if getattr(t, "cls_emb", None) is not None:
        problems.append("a class-token embedding (embed_cls)")
    mask = getattr(t, "attn_mask", None)
    causal = torch.full((n_pos, n_pos), float("-inf")).triu_(1)
    if mask is None or mask.shape != causal.shape or not torch.equal(mask.float().cpu(), causal):
        problems.append("no causal attention mask")
    act = _activation(blocks[0].mlp.gelu) if blocks and type(blocks[0]) is ResidualAttentionBlock else None
    norms = [m for b in blocks for m in (getattr(b, "ln_1", None), getattr(b, "ln_2", None))] + [t.ln_final]
    for b in blocks:
        if type(b) is not ResidualAttentionBlock:
            problems.append(f"custom attention blocks ({type(b).__name__}: qk_norm / scaled cosine / extra norms)")
            break
        if not isinstance(b.ls_1, torch.nn.Identity) or not isinstance(b.ls_2, torch.nn.Identity):
            problems.append("LayerScale (ls_init_value)")
            break
        if hasattr(b, "ln_1_kv") or _activation(b.mlp.gelu) != act:
            problems.append("cross-attention or mixed activations")
            break
    if blocks and act is None and not problems:
        problems.append(f"activation {type(blocks[0].mlp.gelu).__name__}")
    if not all(isinstance(m, torch.nn.LayerNorm) and m.elementwise_affine and m.bias is not None for m in norms):
        problems.append("norms other than affine LayerNorm")
    elif len({m.eps for m in norms}) != 1:
        problems.append("layer norms with different eps")
    if problems:
        raise _error(f"this open_clip text tower cannot become a CLIPTextModel: it has {'; '.join(dict.fromkeys(problems))}")

    proj = getattr(t, "text_projection", None)
    proj_dim = proj.shape[1] if isinstance(proj, torch.Tensor) else proj.out_features if proj is not None else width
    config = CLIPTextConfig(
        vocab_size=t.token_embedding.weight.shape[0],
        hidden_size=width,
        intermediate_size=blocks[0].mlp.c_fc.out_features,
        num_hidden_layers=len(blocks),
        num_attention_heads=blocks[0].attn.num_heads,
        max_position_embeddings=n_pos,
        hidden_act=act,
        layer_norm_eps=norms[0].eps,
        projection_dim=proj_dim,
        attention_dropout=0.0,
        bos_token_id=49406,
        eos_token_id=49407,
        pad_token_id=0,
    )
    te = CLIPTextModel(config).float()
    core = te.text_model if hasattr(te, "text_model") else te  # transformers 4 nests it, 5 does not
    written: set[int] = set()

    def put(dst: torch.nn.Parameter, src: torch.Tensor | None) -> None:
        with torch.no_grad():
            dst.copy_(src if src is not None else torch.zeros_like(dst))
        written.add(id(dst))

    def linear(dst, weight, bias):
        put(dst.weight, weight)
        put(dst.bias, bias)

    put(core.embeddings.token_embedding.weight, t.token_embedding.weight)
    put(core.embeddings.position_embedding.weight, t.positional_embedding)
    for ours, theirs in zip(core.encoder.layers, blocks):
        a = theirs.attn  # nn.MultiheadAttention: q, k, v stacked in in_proj
        w = a.in_proj_weight.chunk(3, dim=0)
        b = a.in_proj_bias.chunk(3, dim=0) if a.in_proj_bias is not None else (None,) * 3
        for proj_name, wi, bi in zip(("q_proj", "k_proj", "v_proj"), w, b):
            linear(getattr(ours.self_attn, proj_name), wi, bi)
        linear(ours.self_attn.out_proj, a.out_proj.weight, a.out_proj.bias)
        linear(ours.layer_norm1, theirs.ln_1.weight, theirs.ln_1.bias)
        linear(ours.layer_norm2, theirs.ln_2.weight, theirs.ln_2.bias)
        linear(ours.mlp.fc1, theirs.mlp.c_fc.weight, theirs.mlp.c_fc.bias)
        linear(ours.mlp.fc2, theirs.mlp.c_proj.weight, theirs.mlp.c_proj.bias)
    linear(core.final_layer_norm, t.ln_final.weight, t.ln_final.bias)
    left = [n for n, p in te.named_parameters() if id(p) not in written]
    if left:  # a transformers version with parameters this mapping does not know
        raise RuntimeError(f"open_clip -> CLIPTextModel conversion left parameters unset: {left[:5]}")
    return te.eval()
