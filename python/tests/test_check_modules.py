"""scripts/check-modules.py finds modules of a crate that import each other around a cycle,
and leaves test-only code out (scripts/test.sh runs it on the repository; these tests run it
on small crates made here)."""
import importlib.util
import os

ROOT = os.environ.get("MOONBRIGHT_TEST_REPO") or os.path.dirname(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
)
spec = importlib.util.spec_from_file_location(
    "check_modules", os.path.join(ROOT, "scripts", "check-modules.py"))
check_modules = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check_modules)


def crate(tmp_path, files):
    for name, text in files.items():
        path = tmp_path / "src" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return str(tmp_path)


def test_a_cycle_through_a_nested_module_is_found(tmp_path):
    c = crate(tmp_path, {
        "lib.rs": "mod a;\nmod b;\n",
        "a.rs": "use crate::b::{x, y::Z};\n",
        "b/mod.rs": "mod y;\n",
        "b/y.rs": "fn f() { crate::a::g(); }\n",
    })
    problems = check_modules.check_crate(c, quiet=True)
    assert len(problems) == 1 and "a -> b -> a" in problems[0], problems


def test_comments_and_test_modules_import_nothing(tmp_path):
    c = crate(tmp_path, {
        "lib.rs": "mod a;\nmod b;\n",
        "a.rs": "use crate::b::x;\n",
        "b.rs": "//! See `crate::a`.\n#[cfg(test)]\nmod t;\npub fn x() {}\n"
                "#[cfg(test)]\nmod tests {\n    use crate::a;\n}\n",
        "tests.rs": "use crate::a;\n",
    })
    assert check_modules.check_crate(c, quiet=True) == []
    # What follows a `#[cfg(test)] mod t;` declaration is not test code.
    (tmp_path / "src" / "b.rs").write_text("#[cfg(test)]\nmod t;\nuse crate::a;\n")
    assert check_modules.check_crate(c, quiet=True) != []
