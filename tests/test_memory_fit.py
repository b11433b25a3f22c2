"""Will it fit, and what would? The load-time plan's advice (sd_training.memory.fit) for a full-size SDXL
fine-tune on a 24 GiB GPU, checked by applying each advised set of keys to the config: it parses (the
schema's refusals pass: in_backward without clipping, no accumulation), its plan is the number the advice
gave, within 90% of the GPU, and dropping any one of its keys no longer fits (the sets are minimal).
Nothing is built but the UNet on the meta device; no GPU is needed."""

import itertools
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from sd_training.config.loading import parse
from sd_training.memory.fit import ADVICE_FRACTION, advise, load_plan, need_bytes
from sd_training.memory.plan import GIB

pytestmark = pytest.mark.usefixtures("one_thread")
ROOT = Path(__file__).resolve().parents[1]
SDXL = yaml.safe_load((ROOT / "benchmarks" / "memory_models.yaml").read_text())["sdxl"]
# The shipped planning config (configs/plan/sdxl.yaml): the docs' plan_memory.py example
ARGS = [f"config={ROOT / 'configs' / 'plan' / 'sdxl.yaml'}"]


def _plan(changes):
    cfg = parse([*ARGS, *changes])
    return cfg, load_plan(cfg)


@pytest.fixture(scope="module")
def sdxl():
    return _plan([])


def test_a_full_sdxl_fine_tune_is_advised_settings_that_fit_24_gib(sdxl):
    cfg, plan = sdxl
    memory = 24 * GIB
    n = SDXL["net_params"]
    assert dict(cfg.model.unet.params) == SDXL["net"]  # the shipped planning config is the benchmarks' SDXL UNet
    assert plan.params == n
    # AdamW, fp32 weights and gradients, the EMA on the GPU: 4 + 4 + 8 + 4 bytes per parameter
    assert need_bytes(plan, cfg) == pytest.approx(n * 20 + plan.per_sample[False])
    advice = advise(plan, cfg, memory)
    assert advice, "a 24 GiB GPU has settings that fit"
    sets = [a.changes for a in advice]
    for a in advice:
        keys = [kv for change in a.changes for kv in change.split()]
        cfg2, plan2 = _plan(keys)  # the advised keys parse: no schema rule refuses them together
        assert need_bytes(plan2, cfg2) == pytest.approx(a.need) and a.need <= ADVICE_FRACTION * memory
        for fewer in itertools.combinations(a.changes, len(a.changes) - 1):  # minimal: one change fewer does not fit
            cfg3, plan3 = _plan([kv for change in fewer for kv in change.split()])
            assert need_bytes(plan3, cfg3) > ADVICE_FRACTION * memory, (a.changes, fewer)
    # kohya's recipe without offloading: checkpointing, 8-bit AdamW, updates in the backward, EMA off the GPU
    single = [s for s in sets if not any("offload" in c or "block_swap" in c for c in s)]
    assert single and all("model.gradient_checkpointing=true" in s and "optimizer.name=adamw8bit" in s for s in single)
    # block swap (with what it needs: checkpointing, the optimizer in the backward, the EMA on the CPU) at the
    # fewest blocks that fit: one block fewer does not
    swap = next(c for s in sets for c in s if c.startswith("model.block_swap="))
    blocks = int(swap.split()[0].split("=")[1])
    assert "optimizer.in_backward=true" in swap and "model.ema.device=cpu" in swap and blocks > 1
    cfg4, plan4 = _plan([kv for c in next(s for s in sets if swap in s) for kv in c.split()
                         if not kv.startswith("model.block_swap=")] + [f"model.block_swap={blocks - 1}"])
    assert need_bytes(plan4, cfg4) > ADVICE_FRACTION * memory
    assert any("optimizer.in_backward=true optimizer.params.max_grad_norm=null" in s for s in single)
    # one rank: FSDP2 in a process group of one, its state in CPU memory
    assert ["distributed.strategy=fsdp distributed.fsdp_cpu_offload=true"] in sets


def test_a_run_that_fits_gets_no_advice_and_a_bigger_batch_is_advised_smaller(sdxl):
    cfg, plan = sdxl
    assert need_bytes(plan, cfg) < ADVICE_FRACTION * 200 * GIB and advise(plan, cfg, 200 * GIB) == []
    big, plan_big = _plan(["system.batch_size=256", "model.gradient_checkpointing=true", "optimizer.name=adamw8bit",
                           "model.ema.device=cpu"])
    advice = advise(plan_big, big, 80 * GIB)
    batch = [a for a in advice if a.changes[0].startswith("system.batch_size=")]
    assert batch and 1 <= batch[0].batch < 256
    smaller, plan_small = _plan(["system.batch_size=" + str(batch[0].batch), "model.gradient_checkpointing=true",
                                 "optimizer.name=adamw8bit", "model.ema.device=cpu"])
    assert need_bytes(plan_small, smaller) <= ADVICE_FRACTION * 80 * GIB
    one_more, plan_more = _plan(["system.batch_size=" + str(batch[0].batch + 1), "model.gradient_checkpointing=true",
                                 "optimizer.name=adamw8bit", "model.ema.device=cpu"])
    assert need_bytes(plan_more, one_more) > ADVICE_FRACTION * 80 * GIB  # the largest that fits


def test_plan_memory_script_says_what_fits_which_gpu():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "plan_memory.py"), *ARGS, "--gpu-gb", "24",
                          "--gpu-gb", "80"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 1, out.stderr[-2000:]
    text = out.stdout
    assert "the GPU has 24 GiB" in text and "It does not fit. Settings that would fit in 90% of it" in text
    assert "optimizer.name=adamw8bit" in text and "the GPU has 80 GiB" in text and "It fits" in text
    assert "[" in text and "about free" in text  # each advised set says what it costs in speed
    # the figures docs/memory.md states for this command are the ones it prints
    docs = (ROOT / "docs" / "memory.md").read_text()
    answer = docs[docs.index("For a full SDXL fine-tune"):].split("\n\n")[0]
    figures = re.findall(r"about \d+(?:\.\d+)? GiB", answer)
    assert len(figures) >= 3 and all(f in text for f in figures), (figures, text)
    bad = subprocess.run([sys.executable, str(ROOT / "scripts" / "plan_memory.py"), *ARGS, "optimizer.nmae=adamw"],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert bad.returncode == 2 and "optimizer.nmae" in bad.stderr


# ---------------------------------------------------------------- the estimate is the family's

def test_the_plan_asks_the_family_for_the_activations_and_the_class(monkeypatch):
    """memory.fit names no model: the trained module's class and one sample's activations come from the
    family the config trains (the autoencoder under model.train_target=vae)."""
    from sd_training.families import registry
    from sd_training.memory.fit import micro_batch_activations

    fam = registry.FAMILIES["sdxl"]
    seen = []

    def elements(cls, conf, sample, checkpointing):
        seen.append((cls, conf.get("_class_name"), sample, checkpointing))
        return 1000.0

    monkeypatch.setattr(fam, "sample_activation_elements", classmethod(elements))
    cfg, plan = _plan(["model.gradient_checkpointing=true", "system.batch_size=3"])
    assert registry.trained_family(cfg) is fam and plan.kind == fam.net_name
    assert plan.per_sample == (1000.0 * 2, 1000.0 * 2)  # bf16: 2 bytes an element, with and without checkpointing
    cls, name, sample, _ckpt = seen[0]
    assert cls is fam and name == fam.net_class == "UNet2DConditionModel"
    assert (sample.resolution, sample.text_tokens) == (1024, 77)  # sdxl: no text_tokens of its own -> CLIP's 77
    assert micro_batch_activations(cfg, config=dict(SDXL["net"])) == 3 * 2 * 1000.0
    assert seen[-1][3] is True  # model.gradient_checkpointing
    # A config.json of another class than the family names is not planned, nor a family that names none.
    assert micro_batch_activations(cfg, config={**SDXL["net"], "_class_name": "UNet2DModel"}) == 0
    monkeypatch.setattr(fam, "planned_net_class", classmethod(lambda cls, cfg: None))
    assert _plan([])[1] is None
    vae = parse([*ARGS, "model.train_target=vae"])
    assert registry.trained_family(vae).net_name == "vae"


def test_a_lora_that_fits_only_on_a_quantised_base_is_advised_nf4():
    """The load-time plan counts a quantised base (its blocks' Linear weights at the backend's bytes, the rest in
    bf16) and advises model.adapter.base_quantization=nf4 where that is what fits; the advised config plans it."""
    lora = ["model.adapter.type=lora", "model.adapter.rank=16", "model.gradient_checkpointing=true",
            "model.use_ema=false"]
    cfg, plan = _plan(lora)
    q_cfg, q_plan = _plan([*lora, "model.adapter.base_quantization=nf4"])
    full, quantised = need_bytes(plan, cfg), need_bytes(q_plan, q_cfg)
    base = plan.planned_adapter
    assert 0 < q_plan.planned_adapter.quantizable == base.quantizable < base.base  # the blocks' Linears only
    assert full - quantised == pytest.approx(base.base * (2 - q_plan.planned_adapter.base_bytes))
    assert quantised < full * 0.5
    memory = (quantised + full) / 2 / ADVICE_FRACTION
    advice = advise(plan, cfg, memory)
    assert ["model.adapter.base_quantization=nf4"] in [a.changes for a in advice]
    assert next(a.need for a in advice if a.changes == ["model.adapter.base_quantization=nf4"]) == pytest.approx(quantised)
