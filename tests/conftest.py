"""Shared fixtures: a tiny random-weight pipeline and generated-shapes shards, built once per session."""

import importlib.util
import os
from pathlib import Path

import pytest

# Nothing in the tests may reach a hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("WANDB_SILENT", "true")
# One intra-op thread in the test processes (torch is imported after this) and in every process they start
# (train.py, scripts) unless a test sets its own: the models are tiny, and with 2 pytest workers on 2 cores a
# second thread per process only waits for a busy core (measured on the shared 2-core machine: test_loss_decreases
# 260 CPU-s and over 900 s, timed out, with 2 threads; 60 CPU-s and 286 s with 1).
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def family_pipeline(tmp_path_factory):
    """``family_pipeline(name)``: the tiny random-weight pipeline of a registered family (seed 0), built once
    per session and shared by every module that asks for it (the fixtures below included)."""
    from sd_training.families.registry import make_tiny_pipeline

    made = {}

    def get(name: str):
        if name not in made:
            made[name] = make_tiny_pipeline(tmp_path_factory.mktemp(f"tiny_{name}") / "pipeline", family=name)
        return made[name]

    return get


@pytest.fixture(scope="session")
def tiny_pipeline(family_pipeline):
    """A tiny random-weight StableDiffusionPipeline (the default family's)."""
    return family_pipeline("sd")


@pytest.fixture(scope="session")
def sdxl_pipeline(family_pipeline):
    """A tiny random-weight StableDiffusionXLPipeline (two text encoders, size conditioning)."""
    return family_pipeline("sdxl")


@pytest.fixture(scope="session")
def shapes_shards(tmp_path_factory):
    """4 shards x 32 generated 64 px images; returns the brace pattern."""
    from sd_training.data.synthetic import write_shapes_shards

    return write_shapes_shards(tmp_path_factory.mktemp("shapes"), n_samples=128, n_shards=4, size=64, seed=0)


@pytest.fixture(scope="session")
def edit_shards(tmp_path_factory):
    """4 shards x 8 paired 32 px samples (``KEY.jpg`` a shape on blue, ``KEY.ref.jpg`` the same shape on another
    background, ``KEY.txt`` "make the background blue"); returns the brace pattern."""
    from sd_training.data.synthetic import write_edit_shards

    return write_edit_shards(tmp_path_factory.mktemp("edit"), n_samples=32, n_shards=4, size=32, seed=0)


def train_args(tmp_path, pipeline, shards, name="run", **overrides):
    """Command-line style arguments of a tiny CPU run; ``overrides`` as key=value."""
    args = {
        "experiment.log_dir": str(tmp_path / "runs"),
        "experiment.name": name,
        "experiment.num_examples_to_see": 32,
        "experiment.save_every": 1000,
        "experiment.log_every": 1,
        "experiment.sample_steps": 2,
        "experiment.sample_per_prompt": 1,
        "experiment.sample_prompts": "[a red circle on a blue background]",
        "system.batch_size": 4,
        "system.workers": 0,
        "system.device": "cpu",
        "model.pretrained": str(pipeline),
        "dataset.params.path": shards,
        "dataset.params.resolution": 64,
        "wandb.mode": "disabled",
        "optimizer.params.learning_rate": 1e-3,
        "lr_scheduler.params.warmup_length": 2,
        # The run report is redrawn by rank 0 at every export (~1 CPU-s each): off in the tiny runs, on in
        # tests/test_report.py, which checks it.
        "experiment.report": "false",
    }
    args.update({k.replace("__", "."): v for k, v in overrides.items()})
    return [f"{k}={v}" for k, v in args.items()]


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models: a second intra-op thread saves nothing, and on a shared 2-core machine it can make
    every op wait for a busy core (measured: 40x slower). Restored after the module. Use it with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def run_precompute(argv: list[str]) -> int:
    """``scripts/precompute_latents.py``'s main(argv), in this process."""
    script = Path(__file__).resolve().parents[1] / "scripts" / "precompute_latents.py"
    spec = importlib.util.spec_from_file_location("precompute_latents", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(argv)


def assert_shard_step_equals_online(online, from_shards, latents, shard, ids: dict, fixed: dict,
                                    stored_tol: float = 2e-2, grad_tol: tuple[float, float] = (1e-5, 1e-7),
                                    refs: tuple[dict, dict] = ({}, {})) -> None:
    """One step of ``from_shards`` (a family reading latent shards) equals ``online``'s step on the same images
    (``latents``: their online encoding) with the same ``fixed`` noise and timesteps: exactly with the text
    encoded online (gradients within ``grad_tol``: rtol, atol), within ``stored_tol`` (2e-2: bf16 storage) with
    the shard's stored text states and pooled embeddings (those the shard holds). ``refs``: an edit family's
    references, (the online step's ``reference_values``, the shard step's ``reference_latents``)."""
    import contextlib

    import torch

    def step(family, batch):
        family.net.load_state_dict(online.net.state_dict())
        family.net.zero_grad(set_to_none=True)
        out = family.loss(family.loss_module, batch, contextlib.nullcontext(), fixed)
        out.loss.backward()
        return out.loss, {n: p.grad.clone() for n, p in family.net.named_parameters()}

    want, want_grads = step(online, {"latents": latents, **ids, **refs[0]})
    stored = {k: shard[k] for k in ("encoder_hidden_states", "pooled_text_embeds") if k in shard}
    assert "encoder_hidden_states" in stored, sorted(shard)
    for extra, tol in (({}, 1e-5), (stored, stored_tol)):
        loss, grads = step(from_shards, {"latents": shard["latents"], **ids, **refs[1], **extra})
        torch.testing.assert_close(loss, want, rtol=tol, atol=1e-6)
        rtol, atol = max(tol, grad_tol[0]), max(tol * 1e-2, grad_tol[1])
        for n in grads:
            if extra and tol > 1e-3:
                # Rounded (bf16) text: each gradient within the rounding as a whole. Elementwise, a sum over many
                # tokens (Z-Image's learned caption pad token, attended at every padded position) has
                # elements that nearly cancel, where the storage's 0.4 % moves them by more than their size.
                err = float((grads[n] - want_grads[n]).norm())
                assert err <= rtol * float(want_grads[n].norm()) + atol, (n, err, float(want_grads[n].norm()))
            else:
                torch.testing.assert_close(grads[n], want_grads[n], rtol=rtol, atol=atol)
    online.net.zero_grad(set_to_none=True)


# Parallel runs (pytest-xdist, ``scripts/test.sh`` starts one worker per core, at most 3): a module's tests
# stay on one worker (its module fixtures are built once), except the modules listed in SPREAD, whose
# tests are independent end-to-end runs sent one by one to whichever worker is free. The SLURM modules
# share one worker (one cluster at a time). Modules that take longest go first, so no worker is left with
# a long module at the end.
SPREAD = {"test_resume", "test_precision_matrix", "test_elastic", "test_distributed", "test_faults",
          "test_flow_families_distributed"}
SLURM = {"test_slurm_cluster", "test_slurm_train"}
# Modules parametrized by a module fixture ``name`` (the family): each family's tests stay on one worker (its
# runs are built once and shared by its checks), the families spread over the workers.
BY_FAMILY = {"test_family_conformance"}
FIRST = ["test_family_conformance", "test_quickstart", "test_quickstart_mmdit", "test_quickstart_edit", "test_docs_run", "test_resume",
         "test_precision_matrix", "test_optimizers",
         "test_elastic", "test_slurm_train", "test_slurm_cluster", "test_multinode", "test_faults", "test_data_mixture", "test_sdxl",
         "test_recipe", "test_reshard", "test_distributed", "test_bench_memory", "test_model_card",
         # Long modules whose names sort late: left to the end they keep one worker busy after the other is done.
         "test_speed_levers", "test_memory_modes", "test_adapters_resume", "test_evaluation", "test_observability",
         "test_checkpoint_integrity", "test_train_e2e", "test_old_checkpoints", "test_run_guard",
         "test_restarts", "test_shutdown", "test_flow_families_distributed", "test_masked_loss", "test_report",
         "test_adapters_training", "test_host_sync", "test_sd3", "test_flux", "test_trackers"]


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    def module(item):
        return Path(str(item.fspath)).stem

    rank = {name: i for i, name in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(module(item), len(FIRST)))  # stable: file order otherwise
    for item in items:
        name = module(item)
        if name in SLURM:
            item.add_marker(pytest.mark.xdist_group("slurm"))
        elif name in BY_FAMILY:
            family = getattr(item, "callspec", None) and item.callspec.params.get("name")
            item.add_marker(pytest.mark.xdist_group(f"{name}[{family}]"))
        elif name not in SPREAD:
            item.add_marker(pytest.mark.xdist_group(name))


# The fault-injection suite's summary (tests marked ``faults``), printed at the end of the run.
FAULTS = {"tried": 0, "survived": 0, "failed": []}


def pytest_runtest_logreport(report):
    if report.when == "call" and "faults" in report.keywords:
        FAULTS["tried"] += 1
        if report.passed:
            FAULTS["survived"] += 1
        else:
            FAULTS["failed"].append(report.nodeid)


def pytest_terminal_summary(terminalreporter):
    if not FAULTS["tried"]:
        return
    tr = terminalreporter
    tr.write_sep("=", "fault injection")
    tr.write_line(f"faults tried: {FAULTS['tried']} (kill -9 at 12 points of saves and exports, signals to every "
                  "process, stalls, decompression bombs, bad values, full and read-only disks, a second run, "
                  "changed configs, hostile pickles and paths, damaged checkpoints, hostile samples and forged "
                  "tar headers, planted secrets, impossible sizes, killed ranks under torchrun, errors at "
                  "every stage, pickles planted in every file of a step folder on 1 and 2 ranks, hostile card templates and "
                  "names, alias bombs, catastrophic regexes, degenerate masks, bad script arguments)")
    tr.write_line(f"runs survived: {FAULTS['survived']}; data lost: {len(FAULTS['failed'])}")
    for nodeid in FAULTS["failed"]:
        tr.write_line(f"  FAILED: {nodeid}")


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (Linux /proc), children before grandchildren."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(0), [])
        out += kids
        todo += kids
    return out


def kill_tree(pid: int, sig=None) -> None:
    """SIGKILL a launcher and everything it started. torchrun starts each trainer in a session of its
    own, so killing torchrun's process group would leave the trainers running as orphans (in a real
    job SLURM's cgroup kills them all; a test must do it itself)."""
    import signal

    sig = sig or signal.SIGKILL
    tree = descendants(pid)
    for p in [pid] + tree:
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass


@pytest.fixture(scope="session")
def sd3_pipeline(family_pipeline):
    """A tiny random-weight StableDiffusion3Pipeline (CLIP-L, CLIP-G, T5, 16-channel VAE, MMDiT)."""
    return family_pipeline("sd3")


@pytest.fixture(scope="session")
def flux_pipeline(family_pipeline):
    """A tiny random-weight FluxPipeline (CLIP pooled + T5 states, 16-channel VAE, guidance-distilled transformer)."""
    return family_pipeline("flux")


@pytest.fixture(scope="session")
def zimage_pipeline(family_pipeline):
    """A tiny random-weight ZImagePipeline (Qwen3 text encoder, 16-channel VAE, single-stream transformer)."""
    return family_pipeline("zimage")


@pytest.fixture(scope="session")
def flux2_klein_pipeline(family_pipeline):
    """A tiny random-weight Flux2KleinPipeline (Qwen3 text encoder, AutoencoderKLFlux2, Flux2 transformer)."""
    return family_pipeline("flux2_klein")


def counting_backend():
    """A torch.compile backend that runs each graph eagerly and records it: (backend, graphs)."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    return backend, graphs
