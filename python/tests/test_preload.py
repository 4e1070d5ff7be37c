"""moonbright.preload: the interposer's report, read from Python, in a process without it and in
one that runs under it (LD_PRELOAD of target/release/libmoonbright_preload.so, which
scripts/test.sh builds; no GPU is needed to load it and read the report)."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

import moonbright.preload

LIB = pathlib.Path(
    os.environ.get(
        "MOONBRIGHT_PRELOAD_LIB",
        pathlib.Path(__file__).resolve().parents[2] / "target/release/libmoonbright_preload.so",
    )
)


def test_without_the_interposer_there_is_no_report():
    assert moonbright.preload.report() is None


@pytest.mark.skipif(not LIB.is_file(), reason=f"no interposer library at {LIB}")
def test_under_the_interposer_the_report_says_what_it_served():
    env = dict(os.environ, LD_PRELOAD=str(LIB))
    code = "import json, moonbright.preload; print(json.dumps(moonbright.preload.report()))"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout.strip().splitlines()[-1])
    assert rep["served_allocs"] == rep["passed_allocs"] == 0, rep
    assert rep["ipc_handles"] == rep["ipc_opens"] == rep["ipc_exported"] == 0, rep
    assert rep["devices"] == [], "no allocator is made before a CUDA call"
