#!/usr/bin/env python3
"""Fails if the modules of any crate in crates/ import each other in a cycle.

    python3 scripts/check-modules.py          # check; print the module graph of each crate
    python3 scripts/check-modules.py --quiet  # check only

Every `crate::a::b...` path in a crate's code (in `use` items, brace groups expanded, and in
expressions; not in comments), and every `super::` path, is an edge between sibling modules: from the module the file
is in to the one the path names, at the level where the two paths part. Within each parent
module (the crate root, `core`, `core::heap`, ...) the sibling graph must have no cycle.
Test-only code is left out (files named tests.rs or loom_model.rs, `tests/`, and inline
`#[cfg(test)] mod name { ... }` blocks): tests may reach anything. Cycles between crates
Cargo itself refuses, except through dev-dependencies, which only tests use.
"""
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEST_FILES = {"tests.rs", "loom_model.rs"}
USE = re.compile(r"\buse\s+(crate|super)::(.*?);", re.S)
PATH = re.compile(r"\b(crate|super)((?:::[a-z_][a-z0-9_]*)+)")


def module_of(src: str, path: str) -> list[str]:
    """The module path of a source file: src/core/heap/cache.rs -> [core, heap, cache]."""
    rel = os.path.relpath(path, src)[:-3].split(os.sep)
    if rel[-1] in ("lib", "main", "mod"):
        rel = rel[:-1]
    return rel


def expand(prefix: str, tree: str) -> list[str]:
    """`a::{b, c::{d, e}}` -> [a::b, a::c::d, a::c::e] (the paths `use` names)."""
    tree = re.sub(r"\s+", "", tree)
    if "{" not in tree:
        return [prefix + tree]
    head, rest = tree.split("{", 1)
    body = rest[: rest.rfind("}")]
    parts, depth, cur = [], 0, ""
    for ch in body:
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
            continue
        depth += ch == "{"
        depth -= ch == "}"
        cur += ch
    parts.append(cur)
    out = []
    for p in filter(None, parts):
        out += expand(prefix + head, p)
    return out


def references(text: str, here: list[str]) -> list[list[str]]:
    """The absolute module paths (crate-relative) that `text`, in module `here`, names."""
    paths = []
    for m in USE.finditer(text):
        paths += [(m.group(1), p) for p in expand("", m.group(2))]
    for m in PATH.finditer(USE.sub("", text)):
        paths.append((m.group(1), m.group(2).lstrip(":")))
    out = []
    for base, p in paths:
        parts = [x for x in p.split("::") if x]
        if base == "crate":
            out.append(parts)
        else:  # super:: (maybe repeated)
            up = here[:-1]
            while parts and parts[0] == "super":
                up, parts = up[:-1], parts[1:]
            out.append(up + parts)
    return out


TEST_MOD = re.compile(
    r"^\s*#\[cfg\((?:all\()?test\b[^\n]*\n(?:\s*#\[[^\n]*\n)*\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+\w+\s*\{",
    re.M)


def strip_tests(text: str) -> str:
    """`text` without its inline `#[cfg(test)] mod name { ... }` blocks (a test module in a file
    of its own is left out by name, TEST_FILES)."""
    while m := TEST_MOD.search(text):
        depth, i = 1, m.end()
        while depth and i < len(text):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        text = text[: m.start()] + text[i:]
    return text


def check_crate(crate: str, quiet: bool) -> list[str]:
    src = os.path.join(crate, "src")
    edges: dict[tuple, set] = {}
    modules = {tuple(module_of(src, os.path.join(d, f)))
               for d, _, fs in os.walk(src) for f in fs if f.endswith(".rs")}
    for dirpath, _, files in os.walk(src):
        for f in files:
            if not f.endswith(".rs") or f in TEST_FILES:
                continue
            path = os.path.join(dirpath, f)
            here = module_of(src, path)
            text = strip_tests(open(path, encoding="utf-8").read())
            text = re.sub(r"//[^\n]*", "", text)  # comments and doc comments name, not import
            for ref in references(text, here):
                k = 0
                while k < len(here) and k < len(ref) and here[k] == ref[k]:
                    k += 1
                # Only modules count: an item of the parent (`super::Heap`) is no sibling.
                if k < len(here) and k < len(ref) and tuple(ref[: k + 1]) in modules:
                    edges.setdefault(tuple(here[:k]), set()).add((here[k], ref[k]))
    problems = []
    for parent, es in sorted(edges.items()):
        graph: dict[str, set] = {}
        for a, b in es:
            graph.setdefault(a, set()).add(b)
        cycle = find_cycle(graph)
        name = os.path.basename(crate) + ("::" + "::".join(parent) if parent else "")
        if not quiet:
            print(f"{name}: " + "; ".join(f"{a} -> {', '.join(sorted(bs))}"
                                           for a, bs in sorted(graph.items())))
        if cycle:
            problems.append(f"{name}: modules import each other in a cycle: "
                            + " -> ".join(cycle))
    return problems


def find_cycle(graph: dict[str, set]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str):
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def main() -> int:
    quiet = "--quiet" in sys.argv
    crates = sorted(os.path.join(ROOT, "crates", c) for c in os.listdir(os.path.join(ROOT, "crates")))
    problems = []
    for c in crates:
        if os.path.isdir(os.path.join(c, "src")):
            problems += check_crate(c, quiet)
    for p in problems:
        print("error: " + p, file=sys.stderr)
    if not problems:
        print(f"no import cycle between the modules of {len(crates)} crates")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
