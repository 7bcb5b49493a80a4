#!/usr/bin/env python3
"""The handles a placement with perfect foresight would make on a recorded coalescer trace.

    python3 scripts/oracle_handles.py TRACE... [--max BYTES]
    python3 scripts/oracle_handles.py --self-test   (a small trace with known answers; CI)

Traces as for scripts/replay_policies.py. A batch is the pages one `set_access` makes live; a
giving back is a run of `unmap`/`release` events. A page's lifetime ends in the giving back that
unmaps it. Printed per trace: handles if every batch is cut into runs of back-to-back pages that
go in the same giving back (no stranded byte, nothing held ahead of a batch), and the same
across batches (a handle holding bytes ahead for the next batches' pages, as growing ahead
does, but with no bound on the bytes ahead): a floor for placement, not a policy."""
import argparse


def read(path):
    pages, at, batches, unlit = {}, {}, [], set()
    giving, giving_back = 0, False
    for line in open(path):
        if line.startswith("#"):
            continue
        f = line.split()
        res = line.split("=", 1)[1].split()
        if res[0] != "ok":
            continue
        op = f[3]
        if op in ("unmap", "release"):
            giving += not giving_back
            giving_back = True
        else:
            giving_back = False
        if op == "create":
            pages[int(res[1], 16)] = {"size": int(f[4], 16), "va": None, "ends": None}
        elif op == "map" and int(f[7], 16) in pages:
            vh = int(f[7], 16)
            pages[vh]["va"] = int(f[4], 16)
            at[pages[vh]["va"]] = vh
            unlit.add(vh)
        elif op == "set_access":
            va, size = int(f[4], 16), int(f[5], 16)
            b = sorted((pages[v]["va"], v) for v in unlit if va <= pages[v]["va"] < va + size)
            if b:
                batches.append([v for _, v in b])
                unlit.difference_update(v for _, v in b)
        elif op == "unmap":
            va, size = int(f[4], 16), int(f[5], 16)
            for a in [a for a in at if va <= a < va + size]:
                p = pages[at.pop(a)]
                if p["ends"] is None:
                    p["ends"] = giving
    return pages, batches


def handles(pages, batches, most):
    n = 0
    for b in batches:
        prev, length = None, 0
        for v in b:
            p = pages[v]
            if prev and prev["va"] + prev["size"] == p["va"] and prev["ends"] == p["ends"] and length + p["size"] <= most:
                length += p["size"]
            else:
                n, length = n + 1, p["size"]
            prev = p
    return n


SELF_TEST = """# expseg-trace 1
0 0 1 create 0x200000 1 1 0x0 = ok 0x1
0 0 1 create 0x200000 1 1 0x0 = ok 0x2
0 0 1 create 0x200000 1 1 0x0 = ok 0x3
0 0 1 map 0x1000000 0x200000 0x0 0x1 = ok
0 0 1 map 0x1200000 0x200000 0x0 0x2 = ok
0 0 1 set_access 0x1000000 0x400000 0:3 = ok 0x1
0 0 1 map 0x1400000 0x200000 0x0 0x3 = ok
0 0 1 set_access 0x1400000 0x200000 0:3 = ok 0x1
0 0 1 create 0x200000 1 1 0x0 = ok 0x4
0 0 1 map 0x1600000 0x200000 0x0 0x4 = ok
0 0 1 set_access 0x1600000 0x200000 0:3 = ok 0x1
0 0 1 unmap 0x1000000 0x600000 0 = ok 0x1
0 0 1 release 0x1 = ok
0 0 1 create 0x200000 1 1 0x0 = ok 0x5
0 0 1 unmap 0x1600000 0x200000 0 = ok 0x1
"""


def self_test():
    """Three batches (two pages, then one, then one) back to back; the first three pages go in
    one giving back, the last in the next: 3 handles within batches, 2 across them."""
    import os, tempfile
    with tempfile.NamedTemporaryFile("w", suffix=".trace", delete=False) as f:
        f.write(SELF_TEST)
    try:
        pages, batches = read(f.name)
    finally:
        os.unlink(f.name)
    got = (len(batches), handles(pages, batches, 1 << 30), handles(pages, [[v for b in batches for v in b]], 1 << 30))
    assert got == (3, 3, 2), got
    assert handles(pages, [[v for b in batches for v in b]], 0x200000) == 4
    print("oracle_handles self-test: ok")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", nargs="*")
    ap.add_argument("--self-test", action="store_true", help="check the counting on a small trace")
    ap.add_argument("--max", type=lambda v: int(v, 0), default=1 << 30, help="largest handle (EXPSEG_MAX_HANDLE)")
    a = ap.parse_args()
    if a.self_test:
        return self_test()
    if not a.traces:
        ap.error("no trace given")
    for t in a.traces:
        pages, batches = read(t)
        across = [[v for b in batches for v in b]]
        print(f"{t}: {len(pages)} pages in {len(batches)} batches; handles with foresight: "
              f"{handles(pages, batches, a.max)} within batches, {handles(pages, across, a.max)} across batches")


if __name__ == "__main__":
    main()
