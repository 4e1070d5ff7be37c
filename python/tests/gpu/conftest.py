"""The GPU tests' gate, in one place for every file here.

The tests skip themselves (``pytest.importorskip("torch")``, ``pytest.skip("no CUDA device")``)
where they cannot run, and pytest counts those skips in its summary line (scripts/test.sh runs
it with ``-rs``, which lists each reason). With ``MOONBRIGHT_REQUIRE_GPU=1``, which
scripts/gpu-check.sh sets, a skip here is a failure instead, so that a GPU run where PyTorch,
CUDA, the interposer or the wheel went missing cannot read as a pass. Only the skips a complete
one-GPU machine may give stay skips: a test that needs more GPUs than there are, and the
optional extras (transformers, accelerate, nvcc). The Rust GPU tests do the same through
``moonbright::testing``.
"""

import os
import re

import pytest

REQUIRE_GPU = "MOONBRIGHT_REQUIRE_GPU"

# Skip reasons that stay skips under MOONBRIGHT_REQUIRE_GPU=1 (searched in the reason).
MAY_SKIP = (
    r"\btwo (GPUs|CUDA devices)\b",
    r"could not import '(transformers|accelerate)'",
    r"\bno nvcc\b",
)


def required():
    return os.environ.get(REQUIRE_GPU, "") not in ("", "0")


def fail_closed(report):
    """Turns a skip into a failure under MOONBRIGHT_REQUIRE_GPU=1, unless MAY_SKIP allows it."""
    if not report.skipped or hasattr(report, "wasxfail") or not required():
        return
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    if any(re.search(p, reason) for p in MAY_SKIP):
        return
    report.outcome = "failed"
    report.longrepr = f"{REQUIRE_GPU} is set, and this GPU test cannot run: {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    # A module's skip (PyTorch or the device missing) happens while it is collected.
    outcome = yield
    fail_closed(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    fail_closed(outcome.get_result())
