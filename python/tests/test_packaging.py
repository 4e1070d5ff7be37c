"""What pip installs beside the module: the ``moonbright`` command, and libnvrtc found in pip's
``nvidia-cuda-nvrtc`` without LD_LIBRARY_PATH."""

import glob
import gzip
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

import moonbright
import moonbright.cli

MIB = 1 << 20


def run_cli(capfd, *args):
    """``moonbright ARGS`` in this process; returns (status, what it printed)."""
    code = moonbright.cli.main(["moonbright", *args])
    out, err = capfd.readouterr()
    return code, out + err


def test_cli_help_lists_the_commands(capfd):
    code, text = run_cli(capfd, "--help")
    assert code == 0
    for word in ("demo", "replay", "bench-traces"):
        assert word in text, text
    code, text = run_cli(capfd, "--version")
    assert code == 0 and moonbright.__version__ in text


def test_cli_usage_errors_return_2(capfd):
    code, text = run_cli(capfd, "no-such-command")
    assert code == 2 and "error" in text
    code, text = run_cli(capfd, "replay")
    assert code == 2 and "TRACE" in text


def test_cli_replays_a_trace(capfd, tmp_path):
    rows = ["seq,action,addr,size,stream,dt_us"]
    events = [("alloc", 1 << 30, 3 * MIB), ("alloc", (1 << 30) + 4 * MIB, 5 * MIB),
              ("free_completed", 1 << 30, 3 * MIB), ("free_completed", (1 << 30) + 4 * MIB, 5 * MIB)]
    for i, (action, addr, size) in enumerate(events):
        rows.append(f"{i},{action},{addr},{size},0,1")
    trace = tmp_path / "t.csv.gz"
    with gzip.open(trace, "wt") as f:
        f.write("\n".join(rows) + "\n")
    code, text = run_cli(capfd, "replay", str(trace), "--backend", "host", "--json",
                         str(tmp_path / "out.json"))
    assert code == 0, text
    assert (tmp_path / "out.json").is_file()
    code, text = run_cli(capfd, "replay", str(tmp_path / "missing.csv"), "--backend", "host")
    assert code == 1 and "missing.csv" in text


def test_cli_demo_on_the_host_backend(capfd):
    code, text = run_cli(capfd, "demo", "--backend", "host", "--cap-mib", "256", "--block-mib", "2")
    assert code == 0, text
    assert "MoonBright served" in text


def test_the_console_script_is_installed():
    exe = shutil.which("moonbright", path=os.path.dirname(sys.executable))
    if exe is None:
        pytest.skip("no moonbright script beside this Python (the package is not pip-installed)")
    r = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "replay" in r.stdout
    r = subprocess.run([sys.executable, "-m", "moonbright.cli", "--version"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and moonbright.__version__ in r.stdout


# ---- NVRTC from pip --------------------------------------------------------------------------


def fake_site(root, layout):
    for rel in layout:
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"")
    return str(root)


def test_pip_nvrtc_finds_cuda_12_and_13_layouts(tmp_path):
    a = fake_site(tmp_path / "a", ["nvidia/cu13/lib/libnvrtc.so.13",
                                   "nvidia/cu13/lib/libnvrtc-builtins.so.13.0",
                                   "nvidia/cu13/lib/libnvrtc.alt.so.13",
                                   "nvidia/cublas/lib/libcublas.so.13"])
    b = fake_site(tmp_path / "b", ["nvidia/cuda_nvrtc/lib/libnvrtc.so.12"])
    empty = str(tmp_path / "nothing-here")
    found = moonbright._pip_nvrtc([empty, b, "", a, b])
    assert found == [os.path.join(a, "nvidia/cu13/lib/libnvrtc.so.13"),
                     os.path.join(b, "nvidia/cuda_nvrtc/lib/libnvrtc.so.12")]
    assert moonbright._pip_nvrtc([empty]) == []


def run_py(code, extra_env=None):
    env = {k: v for k, v in os.environ.items()
           if k not in ("MOONBRIGHT_NVRTC", "LD_LIBRARY_PATH", "PYTHONPATH")}
    env.update(extra_env or {})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=300)


def test_import_points_moonbright_nvrtc_at_pip_nvrtc(tmp_path):
    site = fake_site(tmp_path, ["nvidia/cu13/lib/libnvrtc.so.13"])
    code = f"""
        import os, sys
        sys.path.append({site!r})
        import moonbright
        print(os.environ.get("MOONBRIGHT_NVRTC"))
    """
    r = run_py(code)
    assert r.returncode == 0, r.stderr
    found = r.stdout.strip().splitlines()[-1].split(os.pathsep)
    assert os.path.join(site, "nvidia/cu13/lib/libnvrtc.so.13") in found, found
    # A value the user set is kept.
    r = run_py(code, {"MOONBRIGHT_NVRTC": "/opt/mine/libnvrtc.so"})
    assert r.stdout.strip().splitlines()[-1] == "/opt/mine/libnvrtc.so"


def real_nvrtc_site():
    """A directory holding pip's nvidia/*/lib/libnvrtc.so*: MOONBRIGHT_TEST_NVRTC_SITE
    (scripts/test.sh installs nvidia-cuda-nvrtc there), else one on sys.path."""
    given = os.environ.get("MOONBRIGHT_TEST_NVRTC_SITE")
    for base in ([given] if given else []) + sys.path:
        if base and glob.glob(os.path.join(base, "nvidia", "*", "lib", "libnvrtc.so*")):
            return base
    return None


def test_nvrtc_from_pip_compiles_without_ld_library_path():
    site = real_nvrtc_site()
    if site is None:
        pytest.skip("no pip nvidia-cuda-nvrtc here (scripts/test.sh installs one)")
    r = run_py(f"""
        import sys
        sys.path.append({site!r})
        import moonbright
        print(moonbright.nvrtc_version())
        ptx = moonbright._moonbright._nvrtc_compile(
            'extern "C" __global__ void mb_probe(int* x) {{ x[threadIdx.x] = 1; }}',
            "probe.cu", ["--gpu-architecture=compute_80"])
        assert ".entry mb_probe" in ptx, ptx
        print("compiled")
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "compiled"


def test_nvrtc_missing_says_where_it_looked():
    r = run_py("""
        import moonbright
        try:
            print(moonbright.nvrtc_version())
        except RuntimeError as e:
            print("error:", e)
    """, {"MOONBRIGHT_NVRTC": "/nonexistent/libnvrtc.so.13"})
    assert r.returncode == 0, r.stderr
    out = r.stdout.strip()
    if out.startswith("error:"):
        assert "/nonexistent/libnvrtc.so.13" in out and "MOONBRIGHT_NVRTC" in out
    else:  # a libnvrtc on the loader path (a CUDA install) was found after the bad one
        assert out.startswith("(")
