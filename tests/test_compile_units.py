"""``model.compile`` per unit (``Family.compile_units``): a family that names units gets each compiled in
place (the wrapper is not replaced, one graph serves every block of the same shape, results equal eager);
a family that names none gets the whole loss module compiled, as before. Run on the CPU with a counting
backend (what dynamo hands the compiler, no code generation: inductor's C++ build of even one small block
took 36 s on the shared 2-core test machine, so the suite leaves it out)."""

import types

import torch
from conftest import counting_backend

from sd_training.build import compile_model
from sd_training.families.base import Family


def tiny_sd3():
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(0)
    return SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, out_channels=4, num_layers=3,
                                 attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16,
                                 caption_projection_dim=16, pooled_projection_dim=8, pos_embed_max_size=8)


def forward(net, seed=1):
    g = torch.Generator().manual_seed(seed)
    out = net(hidden_states=torch.randn(2, 4, 8, 8, generator=g),
              encoder_hidden_states=torch.randn(2, 5, 16, generator=g),
              pooled_projections=torch.randn(2, 8, generator=g), timestep=torch.tensor([10.0, 500.0]),
              return_dict=False)[0]
    return out


def family_with(units):
    return types.SimpleNamespace(compile_units=lambda net: units(net), net_name="transformer")


def test_the_default_hook_compiles_the_whole_module():
    assert Family.compile_units(None, torch.nn.Linear(2, 2)) is None
    backend, graphs = counting_backend()
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.ReLU())
    out = compile_model(model, family_with(lambda net: None), model, backend=backend)
    assert isinstance(out, torch._dynamo.eval_frame.OptimizedModule)
    out(torch.randn(2, 3))
    assert len(graphs) == 1


def test_each_transformer_block_is_compiled_in_place_and_shares_a_graph():
    from sd_training.families.components.transformer import transformer_blocks

    torch._dynamo.reset()
    net = tiny_sd3()
    want = forward(net)
    backend, graphs = counting_backend()
    loss_module = torch.nn.ModuleDict({"transformer": net})  # what the strategy wrapped
    out = compile_model(loss_module, family_with(transformer_blocks), net, backend=backend)
    assert out is loss_module  # not replaced: checkpoints read the same module as before
    blocks = transformer_blocks(net)
    assert len(blocks) == 3 and all(b._compiled_call_impl is not None for b in blocks)
    got = forward(net)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # SD3's last block is context_pre_only (another module): one graph serves the first two, one the last;
    # the embeddings are not compiled
    assert len(graphs) == 2, [g.code for g in graphs]
    got.sum().backward()
    assert all(p.grad is not None for p in blocks[0].parameters())
    forward(net, seed=2)
    assert len(graphs) == 2  # new values, same shapes: no recompilation

