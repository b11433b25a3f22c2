"""Every new key checked at load (issue 34): user patterns matched with a time bound, the learning rate of
every parameter group against the optimizer's needs, text lengths and resolutions against the family's
limits, ``model.adapter.init_from`` read before any model loads, Flux's ``guidance_embed`` only where the
transformer has a guidance embedding, and config files whose YAML aliases would expand without bound.
Each case is a bad value or file fed to ``sd_training.configure.load`` (or the script that reads it): one
``ConfigError`` naming the key or the file, where the code before issue 34 hung, trained wrongly or
failed at step 1 with a traceback."""

import sys
import time

import pytest
from conftest import train_args

import forked
from sd_training.config import ConfigError
from sd_training.configure import load

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.faults]

LORA = {"model.adapter.type": "lora", "model.adapter.rank": 4}
NESTED = "([a-z_0-9.]+)+Z"  # the red team's pattern: exponential in Python's re on every layer name
# Exponential in the bounded engine too (the `regex` package cuts the red team's pattern short itself)
EXPONENTIAL = "(.|..)*[A-Z]"


def args(tmp_path, pipeline, **overrides):
    return train_args(tmp_path, pipeline, "/data/{0..3}.tar", **{"dataset.params.resolution": 32, **overrides})


# ---------------------------------------------------------------- case 4: bounded regular expressions

_LOAD = ("import sys, time\nfrom sd_training.config import ConfigError\nfrom sd_training.configure import load\n"
         "t = time.monotonic()\ntry:\n    load(sys.argv[1:])\nexcept ConfigError as e:\n"
         "    print(f'{time.monotonic() - t:.1f}', e)\nelse:\n    print(f'{time.monotonic() - t:.1f}')\n")


def _load_forked(argv: list[str]):
    """(seconds, ConfigError text or '') of ``load(argv)`` in a forked child: Python's re held the main
    thread in C code where no signal handler (or pytest's timeout) runs."""
    res = forked.run([sys.executable, "-c", _LOAD, *argv], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    seconds, _, message = res.stdout.strip().rpartition("\n")[2].partition(" ")
    return float(seconds), message


def test_a_nested_quantifier_in_target_regex_is_bounded_at_load(tiny_pipeline, tmp_path):
    """``([a-z_0-9.]+)+Z`` spun at 100% CPU in the memory plan (SIGTERM ignored: the main thread was in the C
    regex engine). The bounded engine answers it at once (it matches no layer: the build says so); a
    pattern that would still backtrack without end is a ConfigError naming the key and the pattern within
    the matching budget."""
    seconds, message = _load_forked(args(tmp_path, tiny_pipeline, **LORA, **{"model.adapter.target_regex": NESTED}))
    assert seconds < 30 and message == "", message
    seconds, message = _load_forked(args(tmp_path, tiny_pipeline, **LORA,
                                         **{"model.adapter.target_regex": EXPONENTIAL}))
    assert message.startswith("'model.adapter.target_regex' '(.|..)*[A-Z]' took more than 2 s"), message
    assert seconds < 30  # the budget (2 s) plus the load itself on a busy machine


def test_plan_memory_refuses_the_pattern_with_one_line(tiny_pipeline, tmp_path):
    argv = args(tmp_path, tiny_pipeline, **LORA, **{"model.adapter.target_regex": EXPONENTIAL})
    res = forked.run([sys.executable, "scripts/plan_memory.py", "--gpu-gb", "24", *argv], capture_output=True,
                     text=True, timeout=120, cwd=forked.ROOT)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "plan_memory: 'model.adapter.target_regex' '(.|..)*[A-Z]' took more than" in res.stderr
    assert "Traceback" not in res.stderr


def test_a_sensible_pattern_still_matches_and_a_broken_one_names_the_key(tiny_pipeline, tmp_path):
    from sd_training.config.patterns import PatternTimeout, full_matches

    names = [f"down_blocks.{i}.attentions.0.transformer_blocks.0.attn1.to_{p}" for i in range(2) for p in "qkvx"]
    assert full_matches(r".*attn1\.to_(q|k|v)", names, "k") == [n for n in names if not n.endswith("x")]
    start = time.monotonic()
    with pytest.raises(PatternTimeout, match=r"'k' '\(a\|aa\)\+Z' took more than 0.2 s"):
        full_matches("(a|aa)+Z", ["a" * 80], "k", budget_s=0.2)
    assert time.monotonic() - start < 5
    with pytest.raises(ConfigError, match=r"'model\.adapter\.target_regex' '\(' is not a regular expression"):
        load(args(tmp_path, tiny_pipeline, **LORA, **{"model.adapter.target_regex": "("}))
