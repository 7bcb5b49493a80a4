#!/usr/bin/env python3
"""Fails when the library's modules import each other in a circle.

    python3 scripts/check-module-cycles.py [src]

Every file under src/ (but src/bin/, whose programs are separate crates) is a node. An edge
A -> B is written when A names a module of B's file by path: `crate::x::y`, `super::x`,
`self::x`, or a child `x::` that A declares with `mod x;`. A `mod x;` declaration itself is no
edge (a parent owns its children; the arrow of use is what counts), and neither are test
modules (files named tests.rs or *_tests.rs, or under a tests/ folder, and `#[cfg(test)]`
blocks at the end of a file, which may use everything above them). Prints every circle found
and exits 1; prints the number of files and edges and exits 0 when there is none.
"""
import os
import re
import sys

SRC = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "src")
SRC = os.path.normpath(SRC)


def is_test_file(rel):
    parts = rel.split(os.sep)
    name = parts[-1]
    return name == "tests.rs" or name.endswith("_tests.rs") or "tests" in parts[:-1]


def module_of(rel):
    """src-relative path -> module path tuple (lib.rs -> (), a/mod.rs -> (a,), a/b.rs -> (a, b))."""
    parts = rel[:-3].split(os.sep)
    if parts[-1] in ("mod", "lib"):
        parts = parts[:-1]
    return tuple(parts)


files = {}
for root, dirs, names in os.walk(SRC):
    if os.path.relpath(root, SRC).split(os.sep)[0] == "bin":
        continue
    for n in names:
        if n.endswith(".rs"):
            rel = os.path.relpath(os.path.join(root, n), SRC)
            if not is_test_file(rel):
                files[module_of(rel)] = rel

STRIP = re.compile(r'//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\])*"', re.S)
TEST_TAIL = re.compile(r"^#\[cfg\(test\)\]\s*\nmod \w+\s*\{", re.M)
PATH = re.compile(r"(?<![\w:])((?:crate|super|self|[a-z_][a-z0-9_]*)(?:::[A-Za-z_][A-Za-z0-9_]*)+)")
USE_GROUP = re.compile(r"\buse\s+((?:crate|super|self|[a-z_][a-z0-9_]*)(?:::[a-z_][a-z0-9_]*)*)::\{([^;]*)\};", re.S)


def target(mod, path):
    """The file (module) a path names, or None when it leaves the crate's files."""
    segs = path.split("::")
    if segs[0] == "crate":
        base, rest = (), segs[1:]
    elif segs[0] in ("super", "self"):
        base = list(mod)
        while segs and segs[0] in ("super", "self"):
            if segs.pop(0) == "super":
                base = base[:-1]
        base, rest = tuple(base), segs
    else:
        return None
    best = base if base in files else None
    cur = base
    for s in rest:
        cur = cur + (s,)
        if cur in files:
            best = cur
        else:
            break
    return best


edges = {m: set() for m in files}
for mod, rel in files.items():
    text = open(os.path.join(SRC, rel), encoding="utf-8").read()
    t = TEST_TAIL.search(text)
    if t:
        text = text[: t.start()]
    text = STRIP.sub("", text)
    children = set(re.findall(r"^\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+(\w+)\s*;", text, re.M))
    paths = set(PATH.findall(text))
    paths.update(g + "::*" for g in re.findall(r"\buse\s+((?:crate|super|self)(?:::[a-z_][a-z0-9_]*)*)::\*", text))
    for prefix, group in USE_GROUP.findall(text):
        for item in re.findall(r"[A-Za-z_][A-Za-z0-9_]*(?:::[A-Za-z_][A-Za-z0-9_]*)*", group):
            paths.add(prefix + "::" + item)
    for p in paths:
        head = p.split("::")[0]
        if head in children:
            p = "self::" + p
        dst = target(mod, p)
        if dst is not None and dst != mod:
            edges[mod].add(dst)

# Tarjan's strongly connected components.
index, low, stack, on, sccs, counter = {}, {}, [], set(), [], [0]


def strong(v):
    index[v] = low[v] = counter[0]
    counter[0] += 1
    stack.append(v)
    on.add(v)
    for w in edges[v]:
        if w not in index:
            strong(w)
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
        if len(comp) > 1:
            sccs.append(comp)


sys.setrecursionlimit(10000)
for v in sorted(files):
    if v not in index:
        strong(v)

name = lambda m: files[m]
if sccs:
    for comp in sccs:
        members = set(comp)
        print(f"import circle of {len(comp)} files:")
        for m in sorted(comp):
            inside = sorted(name(d) for d in edges[m] if d in members)
            print(f"  {name(m)} -> {', '.join(inside)}")
    sys.exit(1)
print(f"no import circle: {len(files)} files, {sum(len(e) for e in edges.values())} edges")
