"""The parallel suite's layout holds: under ``scripts/test.sh`` (pytest-xdist, ``--dist loadgroup``) a module's
tests run on one worker, so its module fixtures (a tiny pipeline, a trained run) are built once."""

import os

import pytest


def test_a_module_stays_on_one_worker_in_parallel_runs(request):
    if not os.environ.get("PYTEST_XDIST_WORKER") or not request.config.getvalue("loadgroup"):
        pytest.skip("a serial run (pytest -n 0): there are no workers to group on")
    # xdist suffixes the node id with the group when, and only when, it will keep the group together.
    assert request.node.nodeid.endswith("@test_suite_layout"), (
        f"{request.node.nodeid}: pytest-xdist did not group this module; pytest and pytest-xdist must be the "
        "versions constraints.txt pins (pytest 9.2 broke --dist loadgroup)")
