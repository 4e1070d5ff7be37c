"""The GPU tests' gate (tests/gpu/conftest.py), on stand-in GPU tests in a scratch folder: without
MOONBRIGHT_REQUIRE_GPU their skips are skips; with it, a test that skips because the GPU (or
PyTorch, or the interposer) is missing fails, whether it skips while its module is collected or
while it runs, and only the skips a complete one-GPU machine may give stay skips."""

import os
import pathlib
import shutil
import subprocess
import sys
import textwrap

GATE = pathlib.Path(__file__).resolve().parent / "gpu" / "conftest.py"

FILES = {
    "test_no_device.py": """
        import pytest
        pytest.skip("no CUDA device", allow_module_level=True)

        def test_never_runs():
            pass
    """,
    "test_mixed.py": """
        import pytest

        def test_runs():
            pass

        def test_interposer_missing():
            pytest.skip("no interposer library at /nowhere/libmoonbright_preload.so")

        def test_two_gpus():
            pytest.skip("needs two GPUs")

        @pytest.mark.skipif(True, reason="no nvcc to build the CUDA program")
        def test_nvcc():
            pass

        def test_transformers():
            pytest.skip("could not import 'transformers': No module named 'transformers'")

        def test_torch():
            pytest.importorskip("moonbright_gate_no_such_module")
    """,
}


def run(tmp_path, require):
    gpu = tmp_path / "gpu"
    gpu.mkdir(exist_ok=True)
    shutil.copy(GATE, gpu / "conftest.py")
    for name, text in FILES.items():
        (gpu / name).write_text(textwrap.dedent(text))
    env = {k: v for k, v in os.environ.items() if k != "MOONBRIGHT_REQUIRE_GPU"}
    if require:
        env["MOONBRIGHT_REQUIRE_GPU"] = "1"
    p = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "--rootdir",
         str(tmp_path), "--continue-on-collection-errors", str(gpu)],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )
    return p.returncode, p.stdout + p.stderr


def test_without_the_variable_skips_are_skips(tmp_path):
    rc, out = run(tmp_path, require=False)
    assert rc == 0, out
    assert "1 passed, 6 skipped" in out, out


def test_with_the_variable_a_missing_gpu_fails(tmp_path):
    rc, out = run(tmp_path, require=True)
    assert rc != 0, out
    # The module skipped for want of a device, and the tests skipped for want of the interposer
    # or of a module other than the optional extras, fail; two GPUs, nvcc and transformers stay
    # skips.
    assert "2 failed, 1 passed, 3 skipped, 1 error" in out, out
    why = "MOONBRIGHT_REQUIRE_GPU is set, and this GPU test cannot run: Skipped: "
    assert why + "no CUDA device" in out, out
    assert why + "no interposer library at /nowhere" in out, out
    assert why + "could not import 'moonbright_gate_no_such_module'" in out, out
    for allowed in ["needs two GPUs", "no nvcc", "could not import 'transformers'"]:
        assert allowed in out.split("short test summary info")[1], out
