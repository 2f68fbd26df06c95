#!/usr/bin/env python3
"""The shape check CI runs (scripts/test.sh): fails on a module cycle in any workspace crate,
and on a Rust file over 1,200 lines outside tests.

A cycle: under one parent module, sibling modules whose code (tests left out) refers to each
other, directly or around a loop. The parent's own file counts as one more sibling ("self"),
so a child that calls back into its parent's items while the parent calls into it is a cycle
too. References are `use` trees and paths through `crate::`, `super::` and `self::` (inside an
inline `mod name { ... }`, `super::` is the file's own module).

Usage: scripts/check-shape.py [--print-graph] [ROOT]
Cycles that are known and accepted are listed, one per line as "crate: a <-> b ...", in
scripts/shape-allow.txt; a listed cycle that is gone is reported so the list shrinks.
"""

import os
import re
import sys

MAX_LINES = 1200
ROOT = os.path.abspath(sys.argv[-1]) if len(sys.argv) > 1 and not sys.argv[-1].startswith("--") else os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
PRINT_GRAPH = "--print-graph" in sys.argv
SKIP_DIRS = {"target", ".git", "node_modules", "tests", "test-guest"}


def crates(root):
    """(crate name, src dir) for each workspace member with a src/ folder."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS and not d.startswith(".")]
        if "Cargo.toml" in filenames and os.path.isdir(os.path.join(dirpath, "src")):
            found.append((os.path.relpath(dirpath, root), os.path.join(dirpath, "src")))
    return sorted(found)


def module_of(src, path):
    """Module path (tuple) of a source file: src/a/b.rs and src/a/b/mod.rs are ("a", "b")."""
    rel = os.path.relpath(path, src)[:-3].split(os.sep)
    if rel[-1] in ("mod", "lib", "main"):
        rel = rel[:-1]
    return tuple(rel)


def strip(text):
    """The code without comments, strings and the trailing test module."""
    text = re.sub(r"//[^\n]*", "", text)
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    # Char literals first: '"' would open a string.
    text = re.sub(r"'(?:\\.|[^'\\\n])'", "' '", text)
    # A raw string starts with r (not a letter's tail: "addr"), and a string may run over lines.
    text = re.sub(r'(?<![\w"])r(#*)"(?:.|\n)*?"\1', '""', text)
    text = re.sub(r'"(?:\\.|[^"\\])*"', '""', text, flags=re.S)
    cut = re.search(r"#\[cfg\(test\)\]\s*(pub(\([^)]*\))?\s+)?mod\s+\w+\s*\{", text)
    return text[: cut.start()] if cut else text


def use_paths(tree):
    """Expands a `use` tree (`crate::a::{b, c::{d, e}}`) into its paths."""
    tree = re.sub(r"\s+", "", tree)
    out = []

    def expand(prefix, t):
        depth = 0
        for i, ch in enumerate(t):
            if ch == "{":
                if depth == 0:
                    head = t[:i]
                    inner = t[i + 1 : t.rindex("}")]
                    parts, d, start = [], 0, 0
                    for j, c in enumerate(inner):
                        if c == "{":
                            d += 1
                        elif c == "}":
                            d -= 1
                        elif c == "," and d == 0:
                            parts.append(inner[start:j])
                            start = j + 1
                    parts.append(inner[start:])
                    for p in parts:
                        if p:
                            expand(prefix + head, p)
                    return
                depth += 1
        out.append(prefix + t)

    expand("", tree)
    return [re.sub(r"as\w+$", "", p) for p in out]


PATH = re.compile(r"\b(crate|super|self)((?:::\w+)+)")


def references(module, text, children=()):
    """Absolute module paths (tuples) that `text`, the code of `module`, refers to; `children`
    are its child modules, which it may name without a prefix."""
    refs = []
    # A re-export (`pub use`) names a module without using it, so it makes no edge.
    text = re.sub(r"\bpub(?:\([^)]*\))?\s+use\s+[^;]+;", "", text)
    for m in re.finditer(r"(?<![:\w])(\w+)::", text):
        if m.group(1) in children:
            refs.append("self::" + m.group(1))
    for m in re.finditer(r"\buse\s+([^;]+);", text):
        for p in use_paths(m.group(1)):
            refs.append(p)
    for m in PATH.finditer(text):
        refs.append(m.group(1) + m.group(2))
    out = []
    for r in refs:
        parts = [p for p in r.split("::") if p]
        if not parts:
            continue
        if parts[0] == "crate":
            base, rest = (), parts[1:]
        elif parts[0] == "super":
            base = module
            while parts and parts[0] == "super":
                base = base[:-1]
                parts = parts[1:]
            rest = parts
        elif parts[0] == "self":
            base, rest = module, parts[1:]
        else:
            continue
        out.append(base + tuple(p for p in rest if p != "self"))
    return out


INLINE_MOD = re.compile(r"\bmod\s+(\w+)\s*\{")


def inline_modules(module, text):
    """(module path, code) for a file's own code and for each inline `mod name { ... }` in it,
    so that `super::` and `self::` inside an inline module resolve from that module."""
    text = re.sub(r"'[{}]'", "' '", text)
    outer, inner, pos = [], [], 0
    while True:
        m = INLINE_MOD.search(text, pos)
        if not m:
            outer.append(text[pos:])
            break
        outer.append(text[pos : m.start()])
        depth, i = 1, m.end()
        while i < len(text) and depth:
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
            i += 1
        inner.extend(inline_modules(module + (m.group(1),), text[m.end() : i - 1]))
        pos = i
    return [(module, "".join(outer))] + inner


def check_crate(name, src):
    modules = {}
    for dirpath, _, filenames in os.walk(src):
        for f in filenames:
            if f.endswith(".rs"):
                path = os.path.join(dirpath, f)
                modules[module_of(src, path)] = path
    known = set(modules)
    edges = set()
    for module, path in modules.items():
        with open(path, encoding="utf-8") as fh:
            text = strip(fh.read())
        for scope, code in inline_modules(module, text):
            children = {m[len(scope)] for m in known if len(m) == len(scope) + 1 and m[: len(scope)] == scope}
            for ref in references(scope, code, children):
                # The longest module the path names; what follows is an item in it (an inline
                # module's items count as its file's).
                target = ref
                while target and target not in known:
                    target = target[:-1]
                if target != module:
                    edges.add((module, target))
    cycles = []
    parents = {m[:-1] for m in known if m}
    for parent in sorted(parents):
        children = sorted({m[len(parent)] for m in known if len(m) > len(parent) and m[: len(parent)] == parent})
        nodes = children + ["self"]

        def node(m):
            if m[: len(parent)] != parent:
                return None
            return m[len(parent)] if len(m) > len(parent) else "self"

        graph = {n: set() for n in nodes}
        for a, b in edges:
            na, nb = node(a), node(b)
            if na is not None and nb is not None and na != nb:
                graph[na].add(nb)
        if PRINT_GRAPH:
            for n in nodes:
                if graph[n]:
                    print(f"{name}: {'::'.join(parent) or '(root)'}: {n} -> {', '.join(sorted(graph[n]))}")
        for scc in sccs(graph):
            if len(scc) > 1:
                label = "::".join(parent) or "(root)"
                cycles.append(f"{name}: {label}: " + " <-> ".join(sorted(scc)))
    return cycles


def sccs(graph):
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            out.append(comp)

    for v in graph:
        if v not in index:
            visit(v)
    return out


def long_files(root):
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS and not d.startswith(".")]
        for f in filenames:
            if f.endswith(".rs"):
                path = os.path.join(dirpath, f)
                with open(path, encoding="utf-8") as fh:
                    n = sum(1 for _ in fh)
                if n > MAX_LINES:
                    out.append((n, os.path.relpath(path, root)))
    return sorted(out, reverse=True)


def main():
    allow_path = os.path.join(ROOT, "scripts", "shape-allow.txt")
    allowed = set()
    if os.path.exists(allow_path):
        with open(allow_path, encoding="utf-8") as fh:
            allowed = {l.strip() for l in fh if l.strip() and not l.startswith("#")}
    cycles = []
    for name, src in crates(ROOT):
        cycles.extend(check_crate(name, src))
    new = [c for c in cycles if c not in allowed]
    gone = sorted(allowed - set(cycles))
    big = long_files(ROOT)
    for c in cycles:
        print(("allowed cycle: " if c in allowed else "CYCLE: ") + c)
    for c in gone:
        print(f"shape-allow.txt lists a cycle that is gone (remove it): {c}")
    for n, path in big:
        print(f"TOO LONG: {path}: {n} lines (at most {MAX_LINES} outside tests)")
    ok = not new and not big and not gone
    print(f"shape: {len(cycles)} module cycles ({len(new)} not allowed), {len(big)} files over {MAX_LINES} lines: {'ok' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
