"""Where a run's frozen text encoders live (``model.text_encoder_placement``, resolved by
``config.rules.text_encoder_placement``).

An LLM text encoder (FLUX.2 dev's Mistral Small 3.1 is 24B parameters, 48 GB in bf16) need not take GPU memory
for the whole run: with text states stored in latent shards the steps never run it, and only sample grids and
eval images do. :func:`place` keeps such an encoder where the user says:

* ``device``: on the training device (nothing installed: the module is used as built);
* ``cpu``: in host memory, and it runs there: a forward pre-hook moves its tensor inputs to the CPU and a
  forward hook moves its outputs (tensors, tuples, dicts and transformers' ``ModelOutput``) back to the training
  device, so its callers (our encoders, a diffusers pipeline's ``encode_prompt``) see a device-side result;
* ``offload``: in host memory, moved onto the device for each forward and back after it: the run pays one
  host-to-device copy of the weights per call (a grid's prompts, a batch of eval images), and the steps have
  the memory.

On a CPU run the moves are no-ops, but the hooks are installed all the same (the same code path as on a GPU).

The hooks sit on the encoder module itself, so every caller goes through them; :func:`off_device` tells the
memory plan which frozen modules do not stay on the device.

A frozen VAE is not called through its forward (pipelines call ``vae.decode``, and a pipeline runs where its
first module is, often the VAE), so hooks do not fit it: with latent shards (``model.vae.placement``) it is
:func:`park`-ed in host memory and :func:`brought_in` for the whole of a sample grid, a set of eval images or
the validation batches' encode, and parked again after.
"""

from __future__ import annotations

import contextlib
import logging

import torch

log = logging.getLogger(__name__)

_ATTR = "_sdt_placement"  # on a placed module: (placement, hook handles)


def move(x, device: torch.device):
    """``x`` with every tensor in it on ``device`` (tensors, lists, tuples, dicts, transformers' ModelOutput;
    anything else, e.g. a key-value cache object, as it is)."""
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, dict):
        if type(x) is dict:
            return {k: move(v, device) for k, v in x.items()}
        for k in list(x.keys()):  # a ModelOutput (an OrderedDict): set in place, its attributes follow
            x[k] = move(x[k], device)
        return x
    if isinstance(x, tuple) and hasattr(x, "_fields"):  # a NamedTuple
        return type(x)(*(move(v, device) for v in x))
    if isinstance(x, (list, tuple)):
        return type(x)(move(v, device) for v in x)
    return x


def place(module: torch.nn.Module, placement: str, device: torch.device) -> torch.nn.Module:
    """``module`` (a frozen text encoder) kept as ``placement`` says, for a run on ``device`` (see the module).
    Placing a module again replaces its hooks."""
    unplace(module)
    if placement == "device":
        return module.to(device)
    if placement not in ("cpu", "offload"):
        raise ValueError(f"unknown text encoder placement {placement!r}: device, cpu or offload")
    host = torch.device("cpu")
    module.to(host)
    run_on = host if placement == "cpu" else device

    def before(mod, args, kwargs):
        if placement == "offload":
            mod.to(device)
        return move(args, run_on), move(kwargs, run_on)

    def after(mod, args, kwargs, output):
        if placement == "offload":
            mod.to(host)
        return move(output, device)

    handles = (module.register_forward_pre_hook(before, with_kwargs=True),
               module.register_forward_hook(after, with_kwargs=True))
    setattr(module, _ATTR, (placement, handles))
    return module


def park(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` kept in host memory between uses (see the module); :func:`brought_in` takes it to the device."""
    unplace(module)
    module.to(torch.device("cpu"))
    setattr(module, _ATTR, ("offload", ()))
    return module


@contextlib.contextmanager
def brought_in(modules, device: torch.device):
    """The :func:`park`-ed ones among ``modules`` on ``device`` inside the block, back in host memory after
    (whatever the block raises); the others untouched."""
    parked = [m for m in modules if getattr(m, _ATTR, (None, None))[1] == ()]
    for module in parked:
        module.to(device)
    try:
        yield
    finally:
        for module in parked:
            module.to(torch.device("cpu"))


def unplace(module: torch.nn.Module) -> None:
    """The hooks of :func:`place` removed (the module stays where it is)."""
    placed = getattr(module, _ATTR, None)
    if placed is not None:
        for handle in placed[1]:
            handle.remove()
        delattr(module, _ATTR)


def placement_of(module: torch.nn.Module) -> str:
    """How :func:`place` keeps ``module``: ``cpu`` or ``offload``; ``device`` for a module it left alone."""
    placed = getattr(module, _ATTR, None)
    return placed[0] if placed is not None else "device"


def off_device(module: torch.nn.Module) -> bool:
    """``module`` does not stay on the training device between its uses (the memory plan leaves it out)."""
    return placement_of(module) != "device"


def place_text_encoders(encoders: dict[str, torch.nn.Module], placement: str, device: torch.device) -> None:
    """Every frozen text encoder of a run placed; the log says where they are when not on the device."""
    for module in encoders.values():
        place(module, placement, device)
    if placement != "device" and encoders:
        size = sum(p.numel() * p.element_size() for m in encoders.values() for p in m.parameters()) / 2**30
        log.info("model.text_encoder_placement=%s: the text encoders (%s, %.2f GiB) stay in host memory%s",
                 placement, ", ".join(encoders), size,
                 " and run there" if placement == "cpu" else "; each use moves them onto the device and back")
